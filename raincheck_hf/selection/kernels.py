"""The greedy selectors at GPU speed: one Triton kernel per greedy step, the whole loop one CUDA graph.

`mmtok`, `divprune` and `cdpruner` pick their ``k`` tokens one at a time, each pick depending on the
last. Their reference loops (`mmtok_greedy`, `divprune_greedy`, `dpp_greedy_map`) keep every step on
the device but launch ~10 small kernels per step from Python: for a 1,344-token image (``k = 403``)
that is ~4,000 launches, and the first answer waited on the host for them. Here each step is **one**
kernel over a batch of equal-sized segments (a video's temporal slices go together), and the ``k``
launches of one shape are captured once as a CUDA graph and replayed.

mmtok runs every pick in **one launch** where it fits (`whole_run_shape`: a 1,344-token image does, a video's 32
slices with their text rows do not): a few programs per segment, each holding its block of candidates' coverage
columns in registers for the whole run and the coverage maxima of its own, vote at every pick and wait for each other
(a barrier on a counter in device memory), then read the winner's coverage column as one contiguous row of a
transposed copy of P, made at the launch's start (P's own column is strided: a memory sector per row;
`mmtok_transposed_column(False)` reads it there, for the benchmark and tests). Its programs must all be resident at
once, so the grid is at most one program per multiprocessor and such runs go one after the other on a device
(`_one_at_a_time`: two at once could each hold what the other's waiting programs need). On an H100, for a 1,344-token
image, the greedy alone took 1.68 ms (2.07 reading P's strided column) against 3.16 for two launches a pick. Elsewhere a pick is two launches (the partial gains over tiles of rows and candidates,
then their fixed-order sum and the vote). Earlier one-launch-a-pick forms (the last row tile of each column block
summing and voting; one program per block of candidates summing over every row) and a lazy greedy (one program per
segment, re-evaluating only the candidates whose last gain could still win) gave no gain or were slower: launches
were not what bounds a pick, the dependent rounds are (see ``benchmarks/results/README.md``).

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

import contextlib
import contextvars
import functools
import os
import threading
from collections import OrderedDict

import torch

from .._triton import cdiv, pow2, triton_available  # noqa: F401 (triton_available: asked here by `selection.base`)
from ..fast.scoping import CAPTURE_LOCK, StreamOrder, graph_capture, used_on

INT64_MIN = -(2 ** 63)
LOW_MASK = 0xFFFFFFFF
MAX_GRAPHS = 16  # captured shapes kept per device, least recently used evicted
BLOCK_N = 32  # candidate columns per program
BLOCK_R = 64  # reduction rows per tile


WHOLE_SLAB = 32768  # coverage values one program of mmtok's one-launch run holds in registers (R_PAD x BLOCK_N)
_ONE_LAUNCH: contextvars.ContextVar = contextvars.ContextVar("raincheck_mmtok_one_launch", default=None)
_TRANSPOSED: contextvars.ContextVar = contextvars.ContextVar("raincheck_mmtok_transposed", default=True)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def mmtok_transposed_column(enabled: bool):
    """Within the block (this thread or task only), whether mmtok's one-launch run reads each pick's winning coverage
    column as one contiguous row of a transposed copy of P (``True``, the default) or as P's strided column
    (``False``: one memory sector per row). The same picks either way; for the benchmark and tests."""
    if not isinstance(enabled, bool):
        raise ValueError(f"mmtok_transposed_column: enabled={enabled!r} must be True or False")
    return _scoped(_TRANSPOSED, enabled)


def mmtok_one_launch(enabled: bool | None):
    """Within the block (this thread or task only), mmtok's greedy runs as one launch (``True``; a `ValueError` where
    it does not fit), as two launches a pick (``False``), or as fits (``None``, the default). For the benchmark and
    tests that compare the two."""
    if enabled not in (True, False, None):
        raise ValueError(f"mmtok_one_launch: enabled={enabled!r} must be True, False or None")
    return _scoped(_ONE_LAUNCH, enabled)


def whole_run_shape(B: int, n: int, R: int, device) -> tuple | None:
    """``(programs per segment, R_PAD, BLOCK_N, num_warps)`` of mmtok's one-launch run over ``B`` segments of ``n``
    candidates and ``R`` coverage rows, or None where it does not fit. Its programs wait for each other at every
    pick, so all of them must be resident at once: one per multiprocessor at most (`resident_programs`), each
    holding its block of columns (``R_PAD x BLOCK_N`` values, at most `WHOLE_SLAB`) in registers. Off CUDA (Triton's
    interpreter, which runs programs one after the other) one program per segment."""
    device = torch.device(device)
    r_pad = pow2(R)
    if device.type != "cuda":
        return 1, r_pad, pow2(n, 2), 4
    per_segment = resident_programs(device) // max(1, B)
    if per_segment < 1:
        return None
    block_n = pow2(cdiv(n, per_segment), 16)
    if r_pad * block_n > WHOLE_SLAB:
        return None
    return cdiv(n, block_n), r_pad, block_n, 16 if r_pad * block_n > 16384 else 8


def resident_programs(device) -> int:
    """How many one-program-per-multiprocessor programs this process can count on having resident at once: the
    device's multiprocessors, or the share that CUDA MPS gives a client (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        percent = float(share) if share else 100.0
    except ValueError:
        percent = 100.0
    return int(sms * min(100.0, max(0.0, percent)) // 100)


_WHOLE: dict = {}  # device -> (lock, StreamOrder) of one-launch runs


@contextlib.contextmanager
def _one_at_a_time(device, whole: bool):
    """One-launch runs on a device one after the other, on the device too: two at once could each hold
    multiprocessors that the other's waiting programs need, and neither would end."""
    device = torch.device(device)
    if not whole or device.type != "cuda":
        yield
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _TABLE_LOCK:
        lock, order = _WHOLE.setdefault(device, (threading.Lock(), StreamOrder()))
    with lock:
        order.wait(device)
        try:
            yield
        finally:
            order.done(device)


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

    def __init__(self, method: str, inputs: dict, k: int, one_launch: bool | None = None, transposed: bool = True):
        self.method, self.k = method, int(k)
        self.inputs = inputs
        first = next(iter(inputs.values()))
        self.B, self.n = int(first.shape[0]), int(first.shape[-1])
        device = first.device
        B, n = self.B, self.n
        self.slots = torch.empty(self.k, B, dtype=torch.int64, device=device)
        self.indices = torch.empty(B, self.k, dtype=torch.int64, device=device)
        self.whole = None  # mmtok's one-launch run: (programs per segment, R_PAD, BLOCK_N, num_warps), when it fits
        if method == "mmtok":
            R = int(inputs["P"].shape[1])
            self.whole = whole_run_shape(B, n, R, device) if one_launch is not False else None
            if one_launch and self.whole is None:
                raise ValueError(f"mmtok's one-launch run does not fit {B} segment(s) of {n} tokens, {R} rows")
            if self.whole is not None:
                self.transposed = transposed
                self.state = {"arrived": torch.empty(B, dtype=torch.int32, device=device)}
                if transposed:  # P's transposed copy: each winner's column is one contiguous row of it
                    self.state["PT"] = torch.empty(B, n, R, dtype=torch.float32, device=device)
            else:
                self.state = {"cov": torch.empty(2, B, R, dtype=torch.float32, device=device),
                              "part": torch.empty(cdiv(R, BLOCK_R), B, n, dtype=torch.float64, device=device)}
        elif method == "divprune":
            self.state = {"mind": torch.empty(B, n, dtype=torch.float32, device=device)}
        elif method == "cdpruner":
            self.state = {"C": torch.empty(B, self.k, n, dtype=torch.float32, device=device),
                          "d2": torch.empty(2, B, n, dtype=torch.float32, device=device)}
        else:
            raise ValueError(f"no greedy kernel for selector {method!r}")
        # taken flags per candidate (the one-launch run's programs keep theirs in registers)
        self.taken = None if self.whole is not None else torch.empty(B, n, dtype=torch.int8, device=device)

    def launch(self) -> torch.Tensor:
        kernel = _kernels()[self.method]
        B, n, k = self.B, self.n, self.k
        self.slots.fill_(INT64_MIN)
        if self.whole is not None:
            programs, r_pad, block_n, warps = self.whole
            P, arrived = self.inputs["P"], self.state["arrived"]
            PT = self.state.get("PT", P)  # (P itself stands in where the kernel does not read it)
            arrived.zero_()
            if self.transposed:
                PT.copy_(P.transpose(1, 2))
            _kernels()["mmtok_run"][(B * programs,)](P, PT, self.inputs["W"], self.slots, arrived, B, int(P.shape[1]),
                                                     n, k, programs, INT64_MIN, R_PAD=r_pad, BLOCK_N=block_n,
                                                     TRANSPOSED=self.transposed, num_warps=warps)
            return self._indices()
        self.taken.zero_()
        grid = (B, cdiv(n, BLOCK_N))
        if self.method == "mmtok":
            gain, vote = kernel
            cov, part, P, W = self.state["cov"], self.state["part"], self.inputs["P"], self.inputs["W"]
            R, row_blocks = int(P.shape[1]), int(part.shape[0])
            cov.zero_()
            for s in range(k):
                gain[grid + (row_blocks,)](P, W, cov, part, self.slots, s, B, R, n, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
                vote[grid](part, self.taken, self.slots, s, B, n, row_blocks, INT64_MIN,
                           BLOCK_RB=pow2(row_blocks, 2), BLOCK_N=BLOCK_N)
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
        return self._indices()

    def _indices(self) -> torch.Tensor:
        torch.sub(LOW_MASK, self.slots.t() & LOW_MASK, out=self.indices)  # (the packed votes' columns, pick order)
        return self.indices


# ---- captured runs ---------------------------------------------------------------------------------

class _Captured:
    def __init__(self, graph, run: GreedyRun):
        self.graph, self.run = graph, run
        self.lock = threading.Lock()
        self.order = StreamOrder()  # (replays from several CUDA streams: one after the other on the device too)


_GRAPHS: dict[object, OrderedDict] = {}  # device -> key -> _Captured, least recently used first
_TABLE_LOCK = threading.Lock()  # the tables above (captures themselves run under the fast path's CAPTURE_LOCK)


def _key(method: str, inputs: dict, k: int, one_launch: bool | None = None, transposed: bool = True) -> tuple:
    key = (method, int(k)) + tuple((name, tuple(t.shape)) for name, t in inputs.items())
    key = key if one_launch is None else key + (("one_launch", one_launch),)
    return key if transposed or method != "mmtok" else key + (("strided_column", True),)


def captured_shapes() -> set:
    """The keys (method, ``k``, input shapes) of the selection graphs captured now, on every device."""
    with _TABLE_LOCK:
        return {key for graphs in _GRAPHS.values() for key in graphs}


def release_selection_graphs() -> None:
    """Drop every captured selection graph (and its buffers)."""
    with _TABLE_LOCK:
        _GRAPHS.clear()


def _capture(method: str, inputs: dict, k: int, one_launch: bool | None, transposed: bool) -> _Captured:
    static = {name: t.clone() for name, t in inputs.items()}
    run = GreedyRun(method, static, k, one_launch, transposed)
    # compiles the kernel and warms the launcher outside the capture, on the caller's stream (`fast.scoping`)
    warm = GreedyRun(method, static, min(k, 2), one_launch, transposed)
    with _one_at_a_time(static[next(iter(static))].device, warm.whole is not None):
        warm.launch()
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
    one_launch, transposed = _ONE_LAUNCH.get(), _TRANSPOSED.get()
    if not use_graphs:
        run = GreedyRun(method, inputs, k, one_launch, transposed)
        with _one_at_a_time(device, run.whole is not None):
            return run.launch().clone()
    key = _key(method, inputs, k, one_launch, transposed)
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
                captured = _capture(method, inputs, k, one_launch, transposed)
                with _TABLE_LOCK:
                    graphs[key] = captured
                    while len(graphs) > MAX_GRAPHS:
                        graphs.popitem(last=False)
    # copy in, replay and copy out as one unit: two threads selecting at one shape share the buffers (on the device
    # too, when they queue on different streams)
    with captured.lock, _one_at_a_time(device, captured.run.whole is not None):
        captured.order.wait(device)
        run = captured.run  # (its buffers, made on the capturing thread's stream: freed, not reused before this replay)
        used_on(run, device=device)
        for name, t in inputs.items():
            run.inputs[name].copy_(t)
        captured.graph.replay()
        indices = run.indices.clone()
        captured.order.done(device)
        return indices
