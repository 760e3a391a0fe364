"""mmtok's one-launch greedy with each pick's winning coverage column read from a transposed copy of P (the default)
and from P's strided column (`selection.kernels.mmtok_transposed_column`), alone and in an image turn's first token
(T1), side by side in one process; `full`, `uniform` and stock `generate` beside them, and an unsynced timeline of
the first token with finer marks between the selection and the prefill (`bench.profile.timeline`).

    python benchmarks/mmtok_column_t1.py OUT.json [REPS] [MODEL] [ORDER]

Qwen3-VL-8B's shape (random bf16 weights) on CUDA, the 1,344x1024 image, ``max_new_tokens=1``, the library's default
settings. The greedy alone: `bench.selectors.mmtok_part_rows` (captured graphs replayed, medians of REPS x 4). T1:
each variant warmed up three times, then REPS rounds round robin (`bench.profile.first_tokens_side_by_side`); the
form is the benchmark's switch, a context variable around the call (the library has no setting for it)."""
import json
import sys

import torch

from raincheck_hf.bench import profile, shapes
from raincheck_hf.bench.latency import hardware_info
from raincheck_hf.bench.selectors import encode, mmtok_part_rows
from raincheck_hf.configuration import RaincheckConfig
from raincheck_hf.selection.kernels import mmtok_transposed_column


def main(out: str, reps: int = 9, model_name: str = "qwen3_vl_8b", order: str | None = None) -> dict:
    """``order``: the variants' names comma-separated, the order they run in within each round (default: full,
    mmtok, uniform, stock, mmtok_strided), to see whether a variant's place in the round moves its time."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, info, inputs, prompt = shapes.image_turn(model_name, device)
    forms = {"full": (RaincheckConfig(mode="full"), True), "mmtok": (RaincheckConfig(), True),
             "uniform": (RaincheckConfig(selector="uniform"), True), "stock": (None, True),
             "mmtok_strided": (RaincheckConfig(), False)}
    if order is not None:
        names = order.split(",")
        if sorted(names) != sorted(forms):
            raise ValueError(f"order={order!r} must name each of {sorted(forms)} once")
        forms = {name: forms[name] for name in names}

    def kwargs(name):
        return profile.first_token_kwargs(inputs, forms[name][0])

    def scope(name):
        return lambda: mmtok_transposed_column(forms[name][1])

    result = {"benchmark": "mmtok_column_t1", "command": " ".join(["python", *sys.argv]),
              "hardware": hardware_info(device), "model": info, "prompt": prompt,
              "settings": {"reps": reps, "defaults": "RaincheckConfig()", "max_new_tokens": 1, "order": list(forms)},
              "greedy_ms": {},
              "timelines": {}}
    times = profile.first_tokens_side_by_side(model, device, {n: (kwargs(n), scope(n)) for n in forms}, reps)
    result["t1_ms"] = profile.t1_rows(times)
    # the selection's parts alone, on the turn the library encodes (`bench.selectors`' turn)
    turn, _ = encode(model, inputs)
    for row in mmtok_part_rows(turn, "image", reps * 4, warmup=3) if device.type == "cuda" else []:
        result["greedy_ms"][row["variant"]] = {"median": row["median_ms"], "reps": row["reps_ms"]}
        print(f"[part] {row['variant']}: {row['median_ms']:.3f} ms", flush=True)
    for name in ("full", "mmtok", "mmtok_strided"):
        with mmtok_transposed_column(forms[name][1]), torch.no_grad():
            line = profile.timeline(model, device, kwargs(name))
        result["timelines"][name] = line
        print(profile.timeline_summary(name, line), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 9, sys.argv[3] if len(sys.argv) > 3 else "qwen3_vl_8b",
         sys.argv[4] if len(sys.argv) > 4 else None)
