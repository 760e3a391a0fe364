"""A `bench batch --profile` JSON's kernels by kind, per row: where a batched step's device time goes.

    python benchmarks/kernel_categories.py benchmarks/results/batch_qwen3_5_9b_tiles_h100.json
    python benchmarks/kernel_categories.py RESULT.json --profile decode_profile   # the decode steps alone, per step

Each profiled row (``profile``: the whole call; ``decode_profile``: its decode steps, with ``steps``) lists its
heaviest kernels by self time. This sums them into kinds by their names: ``gemm`` (cuBLAS / cuBLASLt / nvjet matrix
products and their split-K reductions), ``attention`` (the few-query kernel, SDPA's flash / cuDNN kernels), ``gdn``
(the Gated DeltaNet kernels: recurrent and chunked steps, joins, conv, suffix map; fla's), ``selection`` (the greedy
selectors' steps), ``compiled`` (Inductor's fused kernels), ``copies`` (copies, concatenations, index copies, memcpy),
``elementwise`` (PyTorch's other element-wise and reduction kernels) and ``other``, with what the listed kernels
leave of the profile's device time as ``unlisted``. Milliseconds per step where the profile has steps, else per
call. Host-side operator entries (``aten::...``, whose self device time is their kernels') are left out: their
kernels are counted under their own names.
"""

from __future__ import annotations

import argparse
import json
import re

KINDS = (
    ("gemm", re.compile(r"nvjet|gemm|cublas|cutlass|splitKreduce|sm90_xmma|ampere_.*gemm", re.I)),
    ("attention", re.compile(r"few_query|flash|fmha|sdpa|attention|softmax", re.I)),
    ("gdn", re.compile(r"recurrent_step|chunked_step|\bjoin\b|conv_update|suffix_map|chunk_gated|fused_recurrent|"
                       r"chunk_fwd|chunk_scaled|solve_tril|wy_fast|l2norm_fwd", re.I)),
    ("selection", re.compile(r"mmtok|divprune|cdpruner|greedy", re.I)),
    ("compiled", re.compile(r"^triton_(poi|red|per|tem)_", re.I)),
    ("copies", re.compile(r"copy|Memcpy|CatArray|index_elementwise|gather|scatter|Memset", re.I)),
    ("elementwise", re.compile(r"elementwise|reduce_kernel|vectorized|unrolled|at::native", re.I)),
)
ORDER = [name for name, _ in KINDS] + ["other", "unlisted"]


def kind(name: str) -> str | None:
    """The kind of a profiler entry's name; None for a host-side operator (``aten::...``), counted by its kernels."""
    if name.startswith("aten::") or name.startswith("cuda") or name.startswith("Torch-Compiled"):
        return None
    for label, pattern in KINDS:
        if pattern.search(name):
            return label
    return "other"


def categorize(profile: dict) -> dict:
    """``{kind: ms}`` of one row's profile (per step when it has ``steps``), plus ``unlisted`` (its device time the
    listed kernels do not cover) and ``total``, those two None where the profile has no device time (a CPU run,
    whose entries are host operators: nothing is summed)."""
    per = max(int(profile.get("steps") or 1), 1)
    out = dict.fromkeys(ORDER, 0.0)
    for entry in profile.get("top", []):
        label = kind(entry["name"])
        if label is not None:
            out[label] += entry["self_s"] * 1e3 / per
    device = profile.get("device_s")
    if device is None:
        return {"per": "step" if profile.get("steps") else "call", "total": None, **out, "unlisted": None}
    total = device * 1e3 / per
    out["unlisted"] = max(total - sum(v for k, v in out.items() if k != "unlisted"), 0.0)
    return {"per": "step" if profile.get("steps") else "call", "total": total, **out}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", help="a `python -m raincheck_hf.bench batch --profile` JSON")
    parser.add_argument("--profile", default="profile", choices=("profile", "decode_profile"),
                        help="the whole call's profile (default) or the decode steps' (per step)")
    args = parser.parse_args(argv)
    with open(args.result) as f:
        rows = json.load(f)["rows"]
    table = []
    for row in rows:
        profile = row.get(args.profile)
        if not profile:
            continue
        table.append({"variant": row["variant"], "batch": row["batch"], **categorize(profile)})
    if not table:
        parser.error(f"{args.result} has no row with a {args.profile!r}: run `bench batch --profile`")
    unit = "ms/step" if table[0]["per"] == "step" else "ms/call"
    print(f"{'B':>3} {'variant':12s} {'total':>9s} " + " ".join(f"{k:>11s}" for k in ORDER) + f"   ({unit})")
    for r in table:
        cells = " ".join(f"{r[k]:11.2f}" if r[k] is not None else f"{'-':>11s}" for k in ORDER)
        total = f"{r['total']:9.2f}" if r["total"] is not None else f"{'-':>9s}"
        print(f"{r['batch']:3d} {r['variant']:12s} {total} {cells}")
    return table


if __name__ == "__main__":
    main()
