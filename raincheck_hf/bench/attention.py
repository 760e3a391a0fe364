"""The fast path's few-query attention against stock SDPA at the real shapes, side by side.

    python -m raincheck_hf.bench attention --batch 1,8,32 --json out.json

For each (batch, query rows, cache slots) of a fast-path step (batch: sequences of a batched decode step, each
with its own keys and visibility) — rows 1 (decode) and 32 (a fused chunk of
31 + the token), slots as the static cache holds them (capacity + 64 scratch) — the variants run
on the same random bf16 inputs and the same boolean visibility mask, as one layer's call repeated
``--layers`` times (a model's depth). On CUDA each variant is captured in a CUDA graph and replayed
(the fast path replays its steps), so the time is the device's; on CPU it runs eagerly. Reports
medians over ``--reps`` replays (microseconds per layer call), the ratio, and the largest difference
between the two outputs. Nothing is asserted.

Variants: ``sdpa`` (stock `sdpa_attention_forward`, the reference), ``few_query`` (what the steps run:
`few_query_attention`, on CUDA its Triton kernel), ``few_query_matmul`` (its matmul form reading half-precision
keys as they are) and ``few_query_upcast`` (the matmul form with the keys upcast to float32 first, as compiled
steps trace it and as it ran before).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _variants():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..fast.attention import _few_query, few_query_attention

    def upcast(module, q, k, v, mask, scaling):
        return _few_query(q, k, v, mask, scaling, low_precision_reads=False), None

    def matmul(module, q, k, v, mask, scaling):
        return _few_query(q, k, v, mask, scaling, low_precision_reads=True), None

    return {"sdpa": sdpa_attention_forward, "few_query": few_query_attention, "few_query_matmul": matmul,
            "few_query_upcast": upcast}


def _case(rows, slots, heads, kv_heads, dim, device, dtype, seed=0, batch=1):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=g).to(device, dtype)
    k = torch.randn(batch, kv_heads, slots, dim, generator=g).to(device, dtype)
    v = torch.randn(batch, kv_heads, slots, dim, generator=g).to(device, dtype)
    visible = torch.rand(batch, rows, slots, generator=g) < 0.7
    visible[:, :, 0] = True
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    return module, q, k, v, visible[:, None].to(device)


def _timed(fn, device, layers: int, reps: int) -> list[float]:
    """Seconds per call of ``fn`` (``layers`` calls per timed unit), one value per repetition."""
    if device.type == "cuda":
        from .gdn_state_map import _graphed

        replay = _graphed(fn, device, replays=layers)  # the ``layers`` calls captured in one graph
        replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / layers)
        return times
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(layers):
            fn()
        times.append((time.perf_counter() - t0) / layers)
    return times


def run(rows=(1, 32), slots=(2112, 4160), heads=32, kv_heads=8, dim=128, layers=36, reps=30, device=None,
        json_path=None, log=print, batches=(1,)) -> dict:
    from .latency import _write, hardware_info

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    with torch.no_grad():
        for batch, n_rows, n_slots in [(b, r, n) for b in batches for r in rows for n in slots]:
            module, q, k, v, mask = _case(n_rows, n_slots, heads, kv_heads, dim, device, dtype, batch=batch)
            scale = dim ** -0.5
            outputs, medians = {}, {}
            for name, fn in _variants().items():
                outputs[name] = fn(module, q, k, v, mask, scaling=scale)[0]
                times = _timed(lambda fn=fn: fn(module, q, k, v, mask, scaling=scale), device, layers, reps)
                medians[name] = statistics.median(times)
            diff = (outputs["few_query"].float() - outputs["sdpa"].float()).abs().max().item()
            entry = {"batch": batch, "rows": n_rows, "slots": n_slots, "median_s": medians,
                     "ratio_few_query_to_sdpa": medians["few_query"] / medians["sdpa"],
                     "ratio_few_query_to_upcast": medians["few_query"] / medians["few_query_upcast"],
                     "max_abs_diff": diff}
            results.append(entry)
    result = {"benchmark": "attention", "hardware": hardware_info(device), "dtype": str(dtype).replace("torch.", ""),
              "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "layers_per_replay": layers},
              "reps": reps, "results": results}
    log(f"few-query attention vs stock sdpa on {result['hardware'].get('gpu') or 'cpu'} ({result['dtype']}; "
        f"{heads} query / {kv_heads} key-value heads, dim {dim}); microseconds per layer call, medians of {reps}")
    log(f"{'batch':>5} {'rows':>5} {'slots':>6} {'sdpa':>9} {'few_query':>10} {'matmul':>9} {'upcast':>9} "
        f"{'ratio':>6} {'max |diff|':>11}")
    for e in results:
        m = e["median_s"]
        log(f"{e['batch']:>5} {e['rows']:>5} {e['slots']:>6} {m['sdpa'] * 1e6:>9.1f} {m['few_query'] * 1e6:>10.1f} "
            f"{m['few_query_matmul'] * 1e6:>9.1f} {m['few_query_upcast'] * 1e6:>9.1f} "
            f"{e['ratio_few_query_to_sdpa']:>6.2f} {e['max_abs_diff']:>11.2e}")
    _write(result, json_path)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1", help="sequences per step, comma-separated")
    parser.add_argument("--rows", default="1,32", help="query rows per step, comma-separated")
    parser.add_argument("--slots", default="2112,4160", help="cache slots (capacity + scratch), comma-separated")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ints = lambda text, name: [int(x) for x in text.split(",") if x.strip()] or parser.error(f"--{name} is empty")
    for name, value in (("heads", args.heads), ("kv-heads", args.kv_heads), ("head-dim", args.head_dim),
                        ("layers", args.layers), ("reps", args.reps)):
        if value < 1:
            parser.error(f"--{name}={value} must be >= 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    return run(batches=ints(args.batch, "batch"), rows=ints(args.rows, "rows"), slots=ints(args.slots, "slots"),
               heads=args.heads, kv_heads=args.kv_heads,
               dim=args.head_dim, layers=args.layers, reps=args.reps, device=args.device, json_path=args.json)
