"""Qwen3-VL-8B's vision tower on the 1,344x1024 image (5,376 patches): eager time and its kernel table, then the
same with each vision block compiled (`nn.Module.compile`), their outputs' largest difference. A probe of what
compiling the tower would give; the library does not compile it.

    python benchmarks/vision_tower_compile.py OUT.json

Environment: DEV (default cuda), MODEL (default qwen3_vl_8b; tiny_qwen3_vl runs on a CPU)."""
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from raincheck_hf.bench import shapes
from raincheck_hf.bench.latency import hardware_info

device = torch.device(os.environ.get("DEV", "cuda"))
NAME = os.environ.get("MODEL", "qwen3_vl_8b")
ACTIVITY = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
SORT = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(out: str):
    model, _info = shapes.build_model(NAME, device)
    processor = shapes.build_processor()
    first, prompt = shapes.build_prompt(processor, shapes.MODELS[NAME], "image")
    pixels = first["pixel_values"].to(device, next(model.parameters()).dtype)
    grid = first["image_grid_thw"].to(device)
    tower = model.model.visual
    result = {"benchmark": "vision_tower_compile", "hardware": hardware_info(device), "prompt": prompt}

    def timed(reps=10):
        with torch.no_grad():
            for _ in range(3):
                output = tower(pixels, grid_thw=grid, return_dict=True)
            sync()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                output = tower(pixels, grid_thw=grid, return_dict=True)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), output

    def kernels(rows):
        with torch.no_grad(), profile(activities=[ACTIVITY]) as prof:
            tower(pixels, grid_thw=grid, return_dict=True)
            sync()
        return prof.key_averages().table(sort_by=SORT, row_limit=rows)

    result["eager_ms"], reference = timed()
    print("[tower] eager", result["eager_ms"], flush=True)
    result["eager_kernels"] = kernels(30)
    print(result["eager_kernels"], flush=True)
    t0 = time.perf_counter()
    for block in tower.blocks:
        block.compile()
    try:
        result["compiled_ms"], output = timed()
        result["compile_s"] = time.perf_counter() - t0
        result["max_abs_diff"] = (output.pooler_output.float() - reference.pooler_output.float()).abs().max().item()
        result["ref_abs_max"] = reference.pooler_output.float().abs().max().item()
        print("[tower] compiled blocks", result["compiled_ms"], "compile s", result["compile_s"], "diff",
              result["max_abs_diff"], result["ref_abs_max"], flush=True)
        result["compiled_kernels"] = kernels(20)
        print(result["compiled_kernels"], flush=True)
    except Exception as error:  # (a probe: the failure is its result)
        result["compile_error"] = repr(error)[:2000]
        print("[tower] compile failed", repr(error)[:2000], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
