"""Cost of the Gated DeltaNet state map (docs/method.md §4) at the Qwen3.5-9B shape.

Per GDN layer (32 value heads, dk = dv = 128, fp32 state map): the join
``S_live + M (S_b' - S_b)`` and the online update ``M <- A_t M`` of one suffix token, timed with
CUDA events over many calls (median), both as eager calls and as CUDA-graph replays (how a
captured decode step would run them); plus the memory the map keeps per layer. Prints a table and
writes JSON. On CPU it runs too (wall clock), for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ..gdn.algebra import identity_map, join_state, l2norm, update_suffix_map


def _timer(device):
    if device.type == "cuda":
        def measure(fn, iters):
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)  # µs
            return statistics.median(times)
    else:
        def measure(fn, iters):
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
    return measure


def _graphed(fn, device, replays=20):
    """A function replaying ``fn`` ``replays`` times inside one captured graph (per-call cost = total / replays)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    torch.cuda.synchronize()
    return graph.replay


def run(heads=32, dk=128, dv=128, gdn_layers=24, iters=200, device=None):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    S_live, S_b, S_b_new = rand(1, heads, dk, dv), rand(1, heads, dk, dv), rand(1, heads, dk, dv)
    M = identity_map(1, heads, dk, device=device)
    k = l2norm(rand(1, heads, dk))
    gate = -torch.rand(1, heads, generator=g).to(device)
    beta = torch.rand(1, heads, generator=g).to(device)
    out = {}

    def join():
        out["S"] = join_state(S_live, M, S_b, S_b_new)

    def online():
        out["M"] = update_suffix_map(M, k, gate, beta)

    measure = _timer(device)
    for fn in (join, online):
        fn()
    rows = []
    replays = 20
    for name, fn in (("join (one layer)", join), ("online update, 1 token (one layer)", online)):
        eager = measure(fn, iters)
        graph = _graphed(fn, device, replays)
        graphed = measure(graph, max(iters // 4, 10)) / replays if graph is not None else None
        rows.append({"op": name, "eager_us": eager, "graph_us": graphed})
    state_bytes = {
        "M (suffix map, fp32)": M.numel() * 4,
        "S_b (boundary state, fp32)": S_b.numel() * 4,
        "S_L (state after the leading segment, fp32)": S_b.numel() * 4,
    }
    result = {
        "benchmark": "gdn_state_map",
        "shape": {"value_heads": heads, "dk": dk, "dv": dv, "gdn_layers": gdn_layers},
        "iters": iters,
        "hardware": {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                     "torch": torch.__version__, "platform": platform.platform()},
        "rows": rows,
        "memory_per_layer_bytes": state_bytes,
        "memory_per_layer_mib": sum(state_bytes.values()) / 2**20,
        "memory_model_mib": gdn_layers * sum(state_bytes.values()) / 2**20,
    }
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench gdn-state-map", description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(iters=args.iters, device=args.device)
    print(f"GDN state map at the Qwen3.5-9B shape {result['shape']} on {result['hardware']['device']}, "
          f"torch {result['hardware']['torch']}; medians of {result['iters']}")
    print(f"{'op':<38}{'eager µs':>10}{'graph µs':>10}")
    for row in result["rows"]:
        graph = "-" if row["graph_us"] is None else f"{row['graph_us']:.2f}"
        print(f"{row['op']:<38}{row['eager_us']:>10.2f}{graph:>10}")
    for name, size in result["memory_per_layer_bytes"].items():
        print(f"  {name}: {size / 2**20:.2f} MiB per layer")
    print(f"  total {result['memory_per_layer_mib']:.2f} MiB per layer, {result['memory_model_mib']:.0f} MiB for "
          f"{result['shape']['gdn_layers']} GDN layers")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result
