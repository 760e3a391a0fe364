"""Qwen3-VL-8B's vision tower on the 1,344x1024 image (5,376 patches): eager time and its kernel table; the same
with the fast path's one-kernel rotation (`raincheck_hf.fast.vision_attention`, what the library's tower forwards use),
its outputs compared with stock's bit for bit; then each vision block compiled (`nn.Module.compile`), their outputs'
largest difference. The last is a probe of what compiling the tower would give; the library does not compile it.

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
from raincheck_hf.fast.vision_attention import vision_attention_scope

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

    def timed(reps=10, fused=False):
        with torch.no_grad(), vision_attention_scope(tower, enabled=fused):
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

    def kernels(rows, fused=False):
        with torch.no_grad(), vision_attention_scope(tower, enabled=fused), profile(activities=[ACTIVITY]) as prof:
            tower(pixels, grid_thw=grid, return_dict=True)
            sync()
        table = prof.key_averages()
        return table.table(sort_by=SORT, row_limit=rows), sum(getattr(e, "self_device_time_total", 0) for e in table)

    result["eager_ms"], reference = timed()
    print("[tower] eager", result["eager_ms"], flush=True)
    result["eager_kernels"], result["eager_kernel_us"] = kernels(30)
    print(result["eager_kernels"], flush=True)
    result["fused_rotary_ms"], fused = timed(fused=True)
    result["fused_rotary_equal"] = bool(torch.equal(fused.pooler_output, reference.pooler_output)) and all(
        torch.equal(a, b) for a, b in zip(fused.deepstack_features or [], reference.deepstack_features or []))
    result["fused_rotary_kernels"], result["fused_rotary_kernel_us"] = kernels(30, fused=True)
    print("[tower] fused rotary", result["fused_rotary_ms"], "equal to eager:", result["fused_rotary_equal"],
          flush=True)
    print(result["fused_rotary_kernels"], flush=True)
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
        result["compiled_kernels"], result["compiled_kernel_us"] = kernels(20)
        print(result["compiled_kernels"], flush=True)
    except Exception as error:  # (a probe: the failure is its result)
        result["compile_error"] = repr(error)[:2000]
        print("[tower] compile failed", repr(error)[:2000], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
