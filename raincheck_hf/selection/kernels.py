"""The greedy selectors at GPU speed: one Triton kernel per greedy step, the whole loop one CUDA graph.

`mmtok`, `divprune` and `cdpruner` pick their ``k`` tokens one at a time, each pick depending on the
last. Their reference loops (`mmtok_greedy`, `divprune_greedy`, `dpp_greedy_map`) keep every step on
the device but launch ~10 small kernels per step from Python: for a 1,344-token image (``k = 403``)
that is ~4,000 launches, and the first answer waited on the host for them. Here each step is **one**
kernel over a batch of equal-sized segments (a video's temporal slices go together), and the ``k``
launches of one shape are captured once as a CUDA graph and replayed.

(mmtok's step is two launches: the partial gains over tiles of rows and candidates, then their fixed-order sum and
the vote. Two one-launch forms gave the same picks and no gain on an H100, the launches not being what bounds a pick:
the last row tile of each column block summing and voting, 3.15 against 3.00 ms for the greedy alone, and one program
per block of candidates summing over every row, 5.64 against 3.94 ms for the whole selection. A lazy greedy in one
program per segment, every pick in one launch, re-evaluating only the candidates whose last gain could still win,
picked the same tokens and was slower again: 13.94 against 4.59 ms for the image, most candidates' gains staying too
close to be skipped; see ``benchmarks/results/README.md``.)

One step, for every segment ``b`` of the batch and a block of candidate columns per program:

1. read the previous step's winner ``j`` from ``slots[s - 1, b]`` and apply it to the method's
   running state (coverage maxima, minimum distances, or one row of the incremental Cholesky factor);
2. score the block's candidates from the updated state, mask the ones already taken;
3. ``atomic_max`` one packed int64 per program into ``slots[s, b]``: the score's bits in an
   order-preserving integer form in the high half, ``0xFFFFFFFF - column`` in the low half, so the
   maximum is the best score and, among equal scores, the lowest column: exactly ``torch.argmax``'s
   first-maximum rule that the references use.

State a step must not read while it is written (mmtok's coverage, cdpruner's residual gains) is
double-buffered by step parity. The arithmetic is the references': divprune's is exact (minima only);
mmtok's gains are sums of many terms, so both sides sum them in float64 and round to float32 once (the
order of the sum then moves a gain by ~1e-16, never across a float32 step in practice); cdpruner's
Cholesky dot products are float32 in both, in another order, which tests with random inputs check
(identical indices at the sizes used, ties to the lowest index).

CPU tests run these kernels through Triton's interpreter (``TRITON_INTERPRET=1``); the CUDA graphs
are tested on a GPU (`tests/test_gpu.py`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import torch

from .._triton import triton_available  # noqa: F401 (asked here by `selection.base` and the tests)
from ..fast.scoping import CAPTURE_LOCK, StreamOrder, graph_capture, used_on

INT64_MIN = -(2 ** 63)
LOW_MASK = 0xFFFFFFFF
MAX_GRAPHS = 16  # captured shapes kept per device, least recently used evicted
BLOCK_N = 32  # candidate columns per program
BLOCK_R = 64  # reduction rows per tile


@functools.lru_cache(maxsize=None)
def _kernels():
    """The jitted step kernels (imported on first use: importing this module needs no Triton)."""
    from ._triton_steps import KERNELS

    return KERNELS


# ---- one greedy run: its buffers and its k launches ---------------------------------------------

class GreedyRun:
    """Buffers and launches of one greedy selection over ``B`` segments of ``n`` candidates, ``k`` picks.

    ``inputs`` are the method's matrices (its selector's ``kernel_inputs``: `mmtok.mmtok_inputs`,
    `divprune.divprune_inputs`, `cdpruner.cdpruner_inputs`);
    `launch` resets the state and queues the ``k`` step kernels; `indices` is ``[B, k]`` int64 in pick
    order. All of it is device work only, so it can be captured in a CUDA graph.
    """

    def __init__(self, method: str, inputs: dict, k: int):
        self.method, self.k = method, int(k)
        self.inputs = inputs
        first = next(iter(inputs.values()))
        self.B, self.n = int(first.shape[0]), int(first.shape[-1])
        device = first.device
        B, n = self.B, self.n
        self.slots = torch.empty(self.k, B, dtype=torch.int64, device=device)
        self.taken = torch.empty(B, n, dtype=torch.int8, device=device)
        self.indices = torch.empty(B, self.k, dtype=torch.int64, device=device)
        if method == "mmtok":
            R = int(inputs["P"].shape[1])
            self.state = {"cov": torch.empty(2, B, R, dtype=torch.float32, device=device),
                          "part": torch.empty(-(-R // BLOCK_R), B, n, dtype=torch.float64, device=device)}
        elif method == "divprune":
            self.state = {"mind": torch.empty(B, n, dtype=torch.float32, device=device)}
        elif method == "cdpruner":
            self.state = {"C": torch.empty(B, self.k, n, dtype=torch.float32, device=device),
                          "d2": torch.empty(2, B, n, dtype=torch.float32, device=device)}
        else:
            raise ValueError(f"no greedy kernel for selector {method!r}")

    def launch(self) -> torch.Tensor:
        kernel = _kernels()[self.method]
        B, n, k = self.B, self.n, self.k
        self.slots.fill_(INT64_MIN)
        self.taken.zero_()
        grid = (B, -(-n // BLOCK_N))
        if self.method == "mmtok":
            gain, vote = kernel
            cov, part, P, W = self.state["cov"], self.state["part"], self.inputs["P"], self.inputs["W"]
            R, row_blocks = int(P.shape[1]), int(part.shape[0])
            cov.zero_()
            for s in range(k):
                gain[grid + (row_blocks,)](P, W, cov, part, self.slots, s, B, R, n, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
                vote[grid](part, self.taken, self.slots, s, B, n, row_blocks, INT64_MIN,
                           BLOCK_RB=max(2, 1 << (row_blocks - 1).bit_length()), BLOCK_N=BLOCK_N)
        elif self.method == "divprune":
            mind = self.state["mind"]
            mind.fill_(float("inf"))
            for s in range(k):
                kernel[grid](self.inputs["D"], self.inputs["first"], mind, self.taken, self.slots, s, B, n, INT64_MIN,
                             BLOCK_N=BLOCK_N)
        else:
            C, d2 = self.state["C"], self.state["d2"]
            C.zero_()
            d2[0].copy_(self.inputs["diag"])
            for s in range(k):
                kernel[grid](self.inputs["L"], C, d2, self.inputs["fallback"], self.inputs["tol"], self.taken,
                             self.slots, s, B, n, k, INT64_MIN, BLOCK_T=32, BLOCK_N=BLOCK_N)
        torch.sub(LOW_MASK, self.slots.t() & LOW_MASK, out=self.indices)
        return self.indices


# ---- captured runs ---------------------------------------------------------------------------------

class _Captured:
    def __init__(self, graph, run: GreedyRun):
        self.graph, self.run = graph, run
        self.lock = threading.Lock()
        self.order = StreamOrder()  # (replays from several CUDA streams: one after the other on the device too)


_GRAPHS: dict[object, OrderedDict] = {}  # device -> key -> _Captured, least recently used first
_TABLE_LOCK = threading.Lock()  # the tables above (captures themselves run under the fast path's CAPTURE_LOCK)


def _key(method: str, inputs: dict, k: int) -> tuple:
    return (method, int(k)) + tuple((name, tuple(t.shape)) for name, t in inputs.items())


def captured_shapes() -> set:
    """The keys (method, ``k``, input shapes) of the selection graphs captured now, on every device."""
    with _TABLE_LOCK:
        return {key for graphs in _GRAPHS.values() for key in graphs}


def release_selection_graphs() -> None:
    """Drop every captured selection graph (and its buffers)."""
    with _TABLE_LOCK:
        _GRAPHS.clear()


def _capture(method: str, inputs: dict, k: int) -> _Captured:
    static = {name: t.clone() for name, t in inputs.items()}
    run = GreedyRun(method, static, k)
    # compiles the kernel and warms the launcher outside the capture, on the caller's stream (`fast.scoping`)
    GreedyRun(method, static, min(k, 2)).launch()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):  # other threads' device work goes on
        run.launch()
    return _Captured(graph, run)


def greedy_select(method: str, inputs: dict, k: int, use_graphs: bool | None = None) -> torch.Tensor:
    """``[B, k]`` indices (pick order, on the inputs' device) of the greedy selection over ``inputs``.

    ``use_graphs`` (default: on CUDA) replays one CUDA graph per shape (method, ``k``, the inputs' shapes),
    captured on first use, at most `MAX_GRAPHS` per device; otherwise the ``k`` kernels launch directly
    (what Triton's interpreter runs on CPU).
    """
    device = next(iter(inputs.values())).device
    if use_graphs is None:
        use_graphs = device.type == "cuda"
    if not use_graphs:
        return GreedyRun(method, inputs, k).launch().clone()
    key = _key(method, inputs, k)
    with _TABLE_LOCK:
        graphs = _GRAPHS.setdefault(device, OrderedDict())
        captured = graphs.get(key)
        if captured is not None:
            graphs.move_to_end(key)
    if captured is None:
        with CAPTURE_LOCK:  # one capture at a time in the process (step, tower and selection graphs)
            with _TABLE_LOCK:
                captured = graphs.get(key)
            if captured is None:
                captured = _capture(method, inputs, k)
                with _TABLE_LOCK:
                    graphs[key] = captured
                    while len(graphs) > MAX_GRAPHS:
                        graphs.popitem(last=False)
    # copy in, replay and copy out as one unit: two threads selecting at one shape share the buffers (on the device
    # too, when they queue on different streams)
    with captured.lock:
        captured.order.wait(device)
        run = captured.run  # (its buffers, made on the capturing thread's stream: freed, not reused before this replay)
        used_on(run, device=device)
        for name, t in inputs.items():
            run.inputs[name].copy_(t)
        captured.graph.replay()
        indices = run.indices.clone()
        captured.order.done(device)
        return indices
