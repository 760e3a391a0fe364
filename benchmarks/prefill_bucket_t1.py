"""The first token (T1) of an image turn with the fast path's prefills padded to 64-row buckets (the library's
`fast.graphs.PREFILL_BUCKET`) or to 32-row ones, side by side in one process, with `full`, `uniform` and stock
`generate`; and an unsynced timeline of each variant's first token (`bench.profile.timeline`: where the device waits
for the host). Measured at 8903770 (then with 32 as the default for prefills beyond 256 rows): the same time.

    python benchmarks/prefill_bucket_t1.py OUT.json [REPS] [MODEL]

Qwen3-VL-8B's shape (random bf16 weights) on CUDA, the 1,344x1024 image, ``max_new_tokens=1``, the library's default
settings; each variant warmed up three times, then the repetitions round robin. The 32-row form is the module's
constant `PREFILL_BUCKET` set to 32 for its calls (a benchmark's patch: the library has no setting for it)."""
import json
import statistics
import sys
import time

import torch

import raincheck_hf
from raincheck_hf.bench import profile, shapes
from raincheck_hf.bench.latency import TokenClock, _sync, hardware_info
from raincheck_hf.configuration import RaincheckConfig
from raincheck_hf.fast import graphs


def main(out: str, reps: int = 9, model_name: str = "qwen3_vl_8b") -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (on a CPU nothing is padded)
    model, info = shapes.build_model(model_name, device)
    raincheck_hf.enable(model)
    processor = shapes.build_processor()
    first, prompt = shapes.build_prompt(processor, shapes.MODELS[model_name], "image")
    first.pop("mm_token_type_ids", None)
    inputs = {k: v.to(device) for k, v in first.items()}
    common = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False)
    bucket = graphs.PREFILL_BUCKET
    variants = {"full": (RaincheckConfig(mode="full"), bucket), "mmtok": (RaincheckConfig(), bucket),
                "mmtok_pad32": (RaincheckConfig(), 32), "uniform": (RaincheckConfig(selector="uniform"), bucket),
                "stock": (None, bucket)}

    def kwargs(name):
        config = variants[name][0]
        return dict(inputs, **common, **({} if config is None else {"raincheck": config}))

    def t1(name):
        graphs.PREFILL_BUCKET = variants[name][1]
        clock = TokenClock(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**kwargs(name), streamer=clock)
        _sync(device)
        return (clock.times[0] - t0) * 1e3

    try:
        for name in variants:
            for _ in range(3):
                t1(name)
        times = {name: [] for name in variants}
        for _ in range(reps):
            for name in variants:
                times[name].append(t1(name))
        result = {"benchmark": "prefill_bucket_t1", "hardware": hardware_info(device), "model": info, "prompt": prompt,
                  "settings": {"reps": reps, "bucket": bucket, "defaults": "RaincheckConfig()"}, "t1_ms": {},
                  "timelines": {}}
        for name, t in times.items():
            result["t1_ms"][name] = {"median": statistics.median(t), "reps": t,
                                     "x_full": statistics.median(t) / statistics.median(times["full"])}
            row = result["t1_ms"][name]
            print(f"[t1] {name}: {row['median']:.2f} ms, x full {row['x_full']:.3f}", flush=True)
        for name in ("full", "mmtok", "mmtok_pad32", "uniform"):
            graphs.PREFILL_BUCKET = variants[name][1]
            with torch.no_grad():
                line = profile.timeline(model, device, kwargs(name))
            result["timelines"][name] = line
            print(f"[timeline] {name}: first token {line['first_token_ms']:.1f} ms; " + "; ".join(
                f"{r['stage']} host {r['host_start_ms']:.1f}-{r['host_end_ms']:.1f} device "
                f"{r.get('device_start_ms', 0):.1f}-{r.get('device_end_ms', 0):.1f} idle before "
                f"{r.get('device_idle_before_ms', 0):.2f}" for r in line["stages"]),
                flush=True)
    finally:
        graphs.PREFILL_BUCKET = bucket
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 9, sys.argv[3] if len(sys.argv) > 3 else "qwen3_vl_8b")
