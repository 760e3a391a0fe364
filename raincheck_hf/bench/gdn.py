"""Per-layer cost of the Gated DeltaNet kernels (`gdn.kernels`) against their references.

For one GDN layer and one decode token at the Qwen3.5-9B shape (16 key heads, 32 value heads,
dk = dv = 128, 8,192 conv channels, conv width 4): the suffix-map update ``M <- A M``, the join
``S += M (S_new - S_old)``, the recurrent step (also over a 32-token chunk, as a deferred chunk runs
from the boundary state: ``recurrent_step_chunk``; the same chunk in the chunked form, which the fast path
runs: ``chunked_step``) and the short-conv update, each as the Triton
kernel and as its PyTorch reference (the `gdn.algebra` functions; for the step, transformers' torch
rule). Where fla is installed, its fused recurrent kernel (``fla``) and, for the chunk, its chunked
kernel (``fla_chunk``) too. Timed with CUDA events over many calls (median), both as eager calls
(host launch cost included) and replayed inside a CUDA graph (``replays`` calls captured in one
graph, per-call time = graph time / replays: what a captured decode step pays). Each row also
reports its largest difference from the reference on the same inputs.

``--sweep`` also times each kernel over a few tile sizes and warp counts inside the graph.

On CPU only the references run (wall clock), at a smaller shape unless one is given: a smoke test.
Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import shlex
import statistics
import sys
import time

import torch

from ..gdn import kernels as gk
from ..gdn.algebra import l2norm
from .gdn_state_map import _graphed
from .latency import _write

QWEN3_5_9B = {"batch": 1, "heads_k": 16, "heads_v": 32, "dk": 128, "dv": 128, "kernel_size": 4}
CPU_SMOKE = {"batch": 1, "heads_k": 2, "heads_v": 4, "dk": 32, "dv": 32, "kernel_size": 4}
GDN_LAYERS = 24  # Qwen3.5-9B: 24 of its 32 layers are Gated DeltaNet
CHUNK = 32  # tokens of the recurrent step's second row: a deferred chunk run from the boundary state
OPS = ("suffix_map_update", "join", "recurrent_step", "recurrent_step_chunk", "chunked_step", "conv_update")

# settings tried by --sweep: per op, (the tile constant of gdn.kernels, its values, the op's warps constant)
SWEEP = {"suffix_map_update": ("SUFFIX_BLOCK_J", (8, 16, 32, 64), "SUFFIX_WARPS"),
         "join": ("JOIN_BLOCK", (32, 64), "JOIN_WARPS"),
         "recurrent_step": ("STEP_BLOCK_V", (16, 32, 64), "STEP_WARPS"),
         "recurrent_step_chunk": ("STEP_CHUNK_BLOCK_V", (8, 16, 32), "STEP_CHUNK_WARPS"),
         "chunked_step": ("CHUNKED_BLOCK_V", (16, 32, 64), "CHUNKED_WARPS"),
         "conv_update": ("CONV_BLOCK_C", (64, 128, 256, 512), "CONV_WARPS")}
SWEEP_WARPS = {"recurrent_step_chunk": (1, 2, 4, 8)}  # warps tried per op (default below)
SWEEP_WARPS_DEFAULT = (2, 4, 8)
TILE_NAMES = ("SUFFIX_BLOCK_J", "SUFFIX_WARPS", "JOIN_BLOCK", "JOIN_BLOCK_R", "JOIN_WARPS", "STEP_BLOCK_V",
              "STEP_WARPS", "STEP_CHUNK_BLOCK_V", "STEP_CHUNK_WARPS", "CHUNKED_BLOCK_V", "CHUNKED_WARPS", "CONV_BLOCK_C",
              "CONV_WARPS")


def _measure(device, fn, iters: int) -> float:
    """Median µs per call of ``fn`` (CUDA events on CUDA, wall clock on CPU)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class _Layer:
    """One layer's static buffers and one token's inputs (bf16 activations, fp32 state, as Qwen3.5 runs)."""

    def __init__(self, batch, heads_k, heads_v, dk, dv, kernel_size, device, act_dtype, chunk=CHUNK):
        g = torch.Generator().manual_seed(0)

        def rand(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=g).to(device, dtype)

        B, HK, HV, K, V = batch, heads_k, heads_v, dk, dv
        self.channels = 2 * HK * K + HV * V
        r = HV // HK
        self.M = torch.eye(K, device=device).expand(B, HV, K, K).contiguous()
        self.S_live, self.S_new, self.S_old, self.S = (rand(B, HV, K, V) for _ in range(4))
        self.q = rand(B, 1, HK, K, dtype=act_dtype)
        self.k = l2norm(rand(B, 1, HK, K)).to(act_dtype)
        self.k_rep = self.k.float().repeat_interleave(r, dim=2)  # the eager engine's factors are value-head aligned
        self.v = rand(B, 1, HV, V, dtype=act_dtype)
        # a mild decay, so that thousands of timed updates of one buffer stay in the normal float range
        self.g = torch.full((B, 1, HV), -1e-4, device=device)
        self.beta = torch.rand(B, 1, HV, generator=g).to(device, act_dtype)
        self.history = rand(B, kernel_size - 1, self.channels, dtype=act_dtype)
        self.x = rand(B, 1, self.channels, dtype=act_dtype)
        self.weight = rand(self.channels, kernel_size, dtype=act_dtype)
        self.o = torch.empty_like(self.v)
        # the same for a chunk of tokens (recurrent_step_chunk)
        self.qc, self.kc = rand(B, chunk, HK, K, dtype=act_dtype), rand(B, chunk, HK, K, dtype=act_dtype)
        self.vc = rand(B, chunk, HV, V, dtype=act_dtype)
        self.gc = torch.full((B, chunk, HV), -1e-4, device=device)
        self.betac = torch.rand(B, chunk, HV, generator=g).to(device, act_dtype)
        self.oc = torch.empty_like(self.vc)
        self.y = torch.empty_like(self.x)
        self.out = {}

    def _step(self, op: str):
        if op == "recurrent_step":
            return self.q, self.k, self.v, self.g, self.beta, self.o
        return self.qc, self.kc, self.vc, self.gc, self.betac, self.oc

    def fn(self, op: str, impl: str):
        """The call to time: ``impl`` "kernel" (in place on the static buffers), "reference" or "fla"."""
        q, k, v, g, beta, o = self._step("recurrent_step" if op == "recurrent_step" else "recurrent_step_chunk")
        if impl == "kernel":
            return {
                "suffix_map_update": lambda: gk.suffix_map_update_(self.M, self.k, self.g, self.beta, reference=False),
                "join": lambda: gk.join_(self.S_live, self.M, self.S_new, self.S_old, reference=False),
                "recurrent_step": lambda: gk.recurrent_step_(self.S, q, k, v, g, beta, reference=False, out=o),
                "recurrent_step_chunk": lambda: gk.recurrent_step_(self.S, q, k, v, g, beta, reference=False, out=o),
                "chunked_step": lambda: gk.chunked_step_(self.S, q, k, v, g, beta, reference=False, out=o),
                "conv_update": lambda: gk.conv_update_(self.history, self.x, self.weight, reference=False, out=self.y),
            }[op]
        if impl == "reference":
            from ..gdn.algebra import join_state, update_suffix_map

            out = self.out
            return {
                # as the eager engine called them: new tensors, value-head aligned keys
                "suffix_map_update": lambda: out.__setitem__("M", update_suffix_map(self.M, self.k_rep, self.g,
                                                                                     self.beta)),
                "join": lambda: out.__setitem__("S", join_state(self.S_live, self.M, self.S_old, self.S_new)),
                "recurrent_step": lambda: gk.recurrent_step_(self.S, q, k, v, g, beta, reference=True, out=o),
                "recurrent_step_chunk": lambda: gk.recurrent_step_(self.S, q, k, v, g, beta, reference=True, out=o),
                "chunked_step": lambda: gk.chunked_step_(self.S, q, k, v, g, beta, reference=True, out=o),
                "conv_update": lambda: gk.conv_update_(self.history, self.x, self.weight, reference=True, out=self.y),
            }[op]
        if impl in ("fla", "fla_chunk") and op.startswith("recurrent_step"):
            from fla.ops import gated_delta_rule as fla_gdr

            rule = fla_gdr.fused_recurrent_gated_delta_rule if impl == "fla" else fla_gdr.chunk_gated_delta_rule
            if v.shape[2] != q.shape[2]:
                try:  # recent fla accepts fewer key heads than value heads; older versions need them repeated
                    rule(q, k, v, g=g, beta=beta, initial_state=self.S.clone(), output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
                except Exception:
                    r = v.shape[2] // q.shape[2]
                    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)

            def call():
                out, state = rule(q, k, v, g=g, beta=beta, initial_state=self.S, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
                self.S.copy_(state)
                o.copy_(out)
            return call
        raise ValueError(f"no {impl!r} implementation of {op!r}")

    def result(self, op: str, impl: str):
        """What ``fn(op, impl)`` produced, for the comparison."""
        if impl == "reference" and op == "suffix_map_update":
            return self.out["M"]
        if impl == "reference" and op == "join":
            return self.out["S"]
        return {"suffix_map_update": self.M, "join": self.S_live, "recurrent_step": self.o,
                "recurrent_step_chunk": self.oc, "chunked_step": self.oc, "conv_update": self.y}[op]


def _max_diff(shape, device, act_dtype, op, impl) -> float:
    """Largest |impl - reference| of one call of each on fresh, identical buffers."""
    results = []
    for which in (impl, "reference"):
        layer = _Layer(**shape, device=device, act_dtype=act_dtype)
        layer.fn(op, which)()
        results.append(layer.result(op, which).float())
    return (results[0] - results[1]).abs().max().item()


def hardware(device: torch.device) -> dict:
    from .latency import hardware_info

    return hardware_info(device)


def run(device=None, iters: int = 200, replays: int = 20, sweep: bool = False, shape: dict | None = None,
        json_path: str | None = None, command: str | None = None, log=print, ops=OPS) -> dict:
    """``ops``: the subset of `OPS` timed (and swept)."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {list(OPS)}, got {list(ops)}.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    shape = dict(shape or (QWEN3_5_9B if on_cuda else CPU_SMOKE))
    act_dtype = torch.bfloat16 if on_cuda else torch.float32
    kernels = on_cuda and gk.triton_available()
    impls = ["kernel", "reference"] if kernels else ["reference"]
    fla = on_cuda and importlib.util.find_spec("fla") is not None
    layer = _Layer(**shape, device=device, act_dtype=act_dtype)
    rows = []
    for op in (op for op in OPS if op in ops):
        extra = {"recurrent_step": ["fla"], "recurrent_step_chunk": ["fla", "fla_chunk"]}.get(op, []) if fla else []
        for impl in impls + extra:
            try:
                fn = layer.fn(op, impl)
                fn()  # compile / warm up
                fn()
                eager = _measure(device, fn, iters)
                graph_us = None
                if on_cuda:
                    replay = _graphed(fn, device, replays)
                    graph_us = _measure(device, replay, max(iters // 4, 10)) / replays
                diff = 0.0 if impl == "reference" else _max_diff(shape, device, act_dtype, op, impl)
                rows.append({"op": op, "impl": impl, "eager_us": eager, "graph_us": graph_us, "max_abs_diff": diff})
            except Exception as error:  # fla's API varies across versions: report, keep the other rows
                if not impl.startswith("fla"):
                    raise
                rows.append({"op": op, "impl": impl, "error": f"{type(error).__name__}: {error}"[:300]})
    sweeps = []
    if sweep and kernels:
        saved = {name: getattr(gk, name) for name in TILE_NAMES}
        try:
            for op, (name, values, warps_name) in SWEEP.items():
                if op not in ops:
                    continue
                for value in values:
                    for warps in SWEEP_WARPS.get(op, SWEEP_WARPS_DEFAULT):
                        setattr(gk, name, value)
                        setattr(gk, warps_name, warps)
                        fn = layer.fn(op, "kernel")
                        fn()
                        replay = _graphed(fn, device, replays)
                        sweeps.append({"op": op, name: value, "num_warps": warps,
                                       "graph_us": _measure(device, replay, max(iters // 4, 10)) / replays,
                                       # this setting's result against the reference (fresh buffers)
                                       "max_abs_diff": _max_diff(shape, device, act_dtype, op, "kernel")})
                for attr, v in saved.items():
                    setattr(gk, attr, v)
        finally:
            for attr, v in saved.items():
                setattr(gk, attr, v)
    result = {
        "benchmark": "gdn_kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or "python -m raincheck_hf.bench gdn",
        "hardware": hardware(device),
        "shape": {**shape, "conv_channels": layer.channels, "chunk_tokens": CHUNK,
                  "activations": str(act_dtype).replace("torch.", ""),
                  "gdn_layers_9b": GDN_LAYERS},
        "settings": {"iters": iters, "replays_per_graph": replays,
                     "tiles": {name: getattr(gk, name) for name in TILE_NAMES}},
        "rows": rows,
        "sweep": sweeps,
    }
    _print(result, log)
    if json_path:
        _write(result, json_path)
        log(f"[gdn] wrote {json_path}")
    return result


def _print(result: dict, log) -> None:
    hw = result["hardware"]
    s = result["shape"]
    log(f"GDN kernels, one layer, one token (recurrent_step_chunk, chunked_step: {s['chunk_tokens']}): B={s['batch']} "
        f"HK={s['heads_k']} HV={s['heads_v']} dk={s['dk']} dv={s['dv']} C={s['conv_channels']} Kc={s['kernel_size']} "
        f"on {hw.get('gpu') or hw.get('cpu')}; "
        f"median µs per call of {result['settings']['iters']}"
        + (f" (graph: per call of {result['settings']['replays_per_graph']} replayed in one CUDA graph)"
           if hw.get("gpu") else " (CPU: the references only, wall clock)"))
    log(f"{'op':<22}{'impl':<11}{'eager µs':>10}{'graph µs':>10}{'max |diff|':>12}")
    for row in result["rows"]:
        if "error" in row:
            log(f"{row['op']:<22}{row['impl']:<11}  {row['error']}")
            continue
        graph = "-" if row["graph_us"] is None else f"{row['graph_us']:.2f}"
        log(f"{row['op']:<22}{row['impl']:<11}{row['eager_us']:>10.2f}{graph:>10}{row['max_abs_diff']:>12.2e}")
    if result["sweep"]:
        log("sweep (graph µs per call):")
        for op in OPS:
            entries = [e for e in result["sweep"] if e["op"] == op]
            if entries:
                best = min(entries, key=lambda e: e["graph_us"])
                log(f"  {op:<18} " + "  ".join(
                    f"{'/'.join(str(v) for k, v in e.items() if k not in ('op', 'graph_us'))}: {e['graph_us']:.2f}"
                    for e in entries) + f"   best {best['graph_us']:.2f}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench gdn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per row (median)")
    parser.add_argument("--replays", type=int, default=20, help="calls captured in one CUDA graph")
    parser.add_argument("--batch", type=int, default=None, help="batch rows (default 1)")
    parser.add_argument("--sweep", action="store_true", help="also time each kernel over tile sizes and warps")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--json", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    for name in ("iters", "replays"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    shape = dict(QWEN3_5_9B if device.type == "cuda" else CPU_SMOKE)
    if args.batch is not None:
        shape["batch"] = args.batch
    ops = [op for op in args.ops.split(",") if op]
    if not ops or set(ops) - set(OPS):
        parser.error(f"--ops takes a comma-separated subset of {','.join(OPS)}, got {args.ops!r}")
    return run(device, args.iters, args.replays, args.sweep, shape, args.json,
               command="python -m raincheck_hf.bench gdn " + shlex.join(argv), ops=ops)
