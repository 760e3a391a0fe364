"""The host time of transformers' `generate` before a raincheck call's own loop starts (HF's preparation: the
generation config, logits processors, stopping criteria, special tokens, the cache it would build), with HF's unused
`DynamicCache` left out (the default: `integration._hf_cache_unused`) and built (``use_cache=True``), side by side in
one process.

    python benchmarks/hf_preamble.py OUT.json [REPS] [MODEL]

The model (Qwen3-VL-8B's shape by default) is made on the meta device: nothing is computed, so this runs on any CPU
and times the host's preparation only; the loop (`generation.raincheck_sample`) is replaced by a stand-in that
records when it is entered and stops the call there. The captured tower's path is taken (the pixels held back from
HF's own encoding, as on CUDA). Each variant is warmed up 5 times, then REPS rounds, the variants in turn; medians and
their ratio are printed and written with the hardware."""
import functools
import json
import statistics
import sys
import time

import torch

import raincheck_hf
from raincheck_hf import RaincheckConfig, generation, integration
from raincheck_hf.bench import shapes
from raincheck_hf.bench.latency import hardware_info
from raincheck_hf.models import get_adapter


class _Entered(Exception):
    pass


def main(out: str, reps: int = 200, model_name: str = "qwen3_vl_8b") -> dict:
    import transformers

    spec = shapes.MODELS[model_name]
    class_name, make_config = shapes._REAL[spec.family]
    with torch.device("meta"):
        model = getattr(transformers, class_name)._from_config(make_config(), dtype=torch.bfloat16,
                                                               attn_implementation="sdpa")
    model.eval()
    raincheck_hf.enable(model)
    adapter_cls = type(get_adapter(model))
    holds_pixels = adapter_cls.use_vision_graphs
    inputs, prompt = shapes.build_prompt(shapes.build_processor(), spec, "image")
    inputs.pop("mm_token_type_ids", None)
    entered = {}
    original = generation.raincheck_sample

    @functools.wraps(original)  # HF reads the callable's signature for its extra arguments
    def loop(*args, **kwargs):
        entered["t"] = time.perf_counter()
        raise _Entered

    variants = {"hf_cache_left_out": {}, "hf_cache_built": {"use_cache": True}}

    def preamble_ms(name):
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                model.generate(**inputs, **variants[name], max_new_tokens=1, do_sample=False,
                               raincheck=RaincheckConfig())
        except _Entered:
            pass
        return (entered["t"] - t0) * 1e3

    integration.raincheck_sample = generation.raincheck_sample = loop
    adapter_cls.use_vision_graphs = lambda self, config: True  # the path a CUDA call takes: pixels held back
    try:
        for name in variants:
            for _ in range(5):
                preamble_ms(name)
        times = {name: [] for name in variants}
        for _ in range(reps):
            for name in variants:
                times[name].append(preamble_ms(name))
    finally:
        integration.raincheck_sample = generation.raincheck_sample = original
        adapter_cls.use_vision_graphs = holds_pixels
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {"benchmark": "hf_preamble", "command": " ".join(["python", *sys.argv]),
              "hardware": hardware_info(torch.device("cpu")), "model": {"name": model_name, "device": "meta"},
              "prompt": prompt, "settings": {"reps": reps, "raincheck": "RaincheckConfig()", "max_new_tokens": 1},
              "median_ms": medians, "ratio_left_out_to_built": medians["hf_cache_left_out"] / medians["hf_cache_built"],
              "reps_ms": times}
    for name, m in medians.items():
        print(f"[preamble] {name}: {m:.3f} ms", flush=True)
    print(f"[preamble] left out / built: {result['ratio_left_out_to_built']:.3f}", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200,
         sys.argv[3] if len(sys.argv) > 3 else "qwen3_vl_8b")
