"""The first token (T1) of an image turn with the fast path's prefills padded to 64-row buckets (the library's
`fast.graphs.PREFILL_BUCKET`) or to 32-row ones, side by side in one process, with `full`, `uniform` and stock
`generate`; and an unsynced timeline of each variant's first token (`bench.profile.timeline`: where the device waits
for the host). Measured at 8903770 (then with 32 as the default for prefills beyond 256 rows): the same time.

    python benchmarks/prefill_bucket_t1.py OUT.json [REPS] [MODEL]

Qwen3-VL-8B's shape (random bf16 weights) on CUDA, the 1,344x1024 image, ``max_new_tokens=1``, the library's default
settings; each variant warmed up three times, then the repetitions round robin. The 32-row form is the module's
constant `PREFILL_BUCKET` set to 32 for its calls (a benchmark's patch: the library has no setting for it)."""
import json
import sys

import torch

from raincheck_hf.bench import profile, shapes
from raincheck_hf.bench.latency import hardware_info
from raincheck_hf.configuration import RaincheckConfig
from raincheck_hf.fast import graphs


def main(out: str, reps: int = 9, model_name: str = "qwen3_vl_8b") -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (on a CPU nothing is padded)
    model, info, inputs, prompt = shapes.image_turn(model_name, device)
    bucket = graphs.PREFILL_BUCKET
    forms = {"full": (RaincheckConfig(mode="full"), bucket), "mmtok": (RaincheckConfig(), bucket),
             "mmtok_pad32": (RaincheckConfig(), 32), "uniform": (RaincheckConfig(selector="uniform"), bucket),
             "stock": (None, bucket)}

    def kwargs(name):
        return profile.first_token_kwargs(inputs, forms[name][0])

    def switch(name):
        def setup():
            graphs.PREFILL_BUCKET = forms[name][1]
        return setup

    try:
        times = profile.first_tokens_side_by_side(model, device, {n: (kwargs(n), switch(n)) for n in forms}, reps)
        result = {"benchmark": "prefill_bucket_t1", "hardware": hardware_info(device), "model": info, "prompt": prompt,
                  "settings": {"reps": reps, "bucket": bucket, "defaults": "RaincheckConfig()"},
                  "t1_ms": profile.t1_rows(times), "timelines": {}}
        for name in ("full", "mmtok", "mmtok_pad32", "uniform"):
            switch(name)()
            with torch.no_grad():
                line = profile.timeline(model, device, kwargs(name))
            result["timelines"][name] = line
            print(profile.timeline_summary(name, line), flush=True)
    finally:
        graphs.PREFILL_BUCKET = bucket
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 9, sys.argv[3] if len(sys.argv) > 3 else "qwen3_vl_8b")
