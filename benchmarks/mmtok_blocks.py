"""mmtok's greedy loop on the GPU, its step forms and block sizes side by side: which is the fastest.

    python benchmarks/mmtok_blocks.py --out benchmarks/results/mmtok_blocks_h100.json

`selection.kernels` runs mmtok's ``k`` picks as one CUDA graph of step kernels: ``mmtok`` (the default: two launches
a pick, the partial gains over tiles of rows and candidates, then their sum and the vote) or ``mmtok_one`` (one
launch a pick: each program sums a block of candidates' gains over every row, `MMTOK_BLOCK_N` columns by
`MMTOK_BLOCK_R` rows a tile). This times `kernels.greedy_select` (graphs captured first, then replayed; the device synchronised
around each call) for the split form and the one-launch form at several block sizes, on the coverage matrices of a
1,344-token image (one segment, ``k = 403``) and of a 6,144-token video (32 segments of 192, ``k = 58`` each), random
features (the time does not depend on their values), every form checked to pick what the split form picks.
Medians of ``--reps`` calls per form, the forms taken in turn. JSON with the hardware.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {"image": (1, 1344, 403), "video": (32, 192, 58)}  # (segments, tokens per segment, kept per segment)
BLOCKS = [(16, 128), (8, 256), (8, 128), (16, 64), (32, 64), (32, 128)]  # (MMTOK_BLOCK_N, MMTOK_BLOCK_R)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from raincheck_hf.bench.latency import hardware_info
    from raincheck_hf.selection import kernels
    from raincheck_hf.selection.mmtok import mmtok_inputs

    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (B, n, k) in SHAPES.items():
        features = torch.randn(B, n, 4096, generator=g).to(device, torch.bfloat16)
        text = torch.randn(14, 4096, generator=g).to(device, torch.bfloat16)
        inputs = mmtok_inputs(features, text, 0.5, 0.02, 0.2)
        forms = [("mmtok", None)] + [("mmtok_one", b) for b in BLOCKS]
        want = kernels.greedy_select("mmtok", inputs, k)
        times = {}
        for method, blocks in forms:  # each form's graph captured (and checked) before any timing
            key = (method, blocks)
            if blocks is not None:
                kernels.MMTOK_BLOCK_N, kernels.MMTOK_BLOCK_R = blocks
            kernels.release_selection_graphs()
            got = kernels.greedy_select(method, inputs, k)
            times[key] = {"same_picks": bool(torch.equal(got, want)), "ms": []}
        for _ in range(args.reps):
            for method, blocks in forms:
                if blocks is not None:
                    kernels.MMTOK_BLOCK_N, kernels.MMTOK_BLOCK_R = blocks
                kernels.release_selection_graphs()
                kernels.greedy_select(method, inputs, k)  # the capture, untimed
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                kernels.greedy_select(method, inputs, k)
                torch.cuda.synchronize(device)
                times[(method, blocks)]["ms"].append((time.perf_counter() - start) * 1e3)
        split = statistics.median(times[("mmtok", None)]["ms"])
        for (method, blocks), t in times.items():
            median = statistics.median(t["ms"])
            rows.append({"input": name, "segments": B, "tokens": n, "k": k, "form": method,
                         "block_n": None if blocks is None else blocks[0], "block_r": None if blocks is None else blocks[1],
                         "median_ms": median, "x_split": median / split, "same_picks": t["same_picks"],
                         "reps_ms": t["ms"]})
            print(f"{name:<6} {method:<12} {str(blocks):<10} {median:7.2f} ms  x split {median / split:5.2f}  "
                  f"same picks {t['same_picks']}")
    result = {"benchmark": "mmtok_blocks", "hardware": hardware_info(device), "reps": args.reps, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
