"""What a fused ``[chunk, decode token]`` forward costs against a plain decode forward.

Runs the compared variants side by side in one process on the same cache state (a deep copy per
repetition): a plain decode step, the fused step with chunk sizes 7, 15, 31, 63, and the serial
variant (the chunk's own forward, then the decode token). Prints a table of medians and ratios and
writes JSON with the hardware.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch


def _setup(model, processor, image_size):
    from ..configuration import RaincheckConfig
    from ..tiny import draw_test_image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[draw_test_image(*image_size, seed=0)], return_tensors="pt")
    inputs.pop("mm_token_type_ids")
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         raincheck=RaincheckConfig(mode="post_answer", retention=0.3))
    return out


def run(model, processor, chunk_sizes=(7, 15, 31, 63), reps=30, image_size=(512, 512)):
    from ..cache_utils import DEFERRED, GENERATED, order_key
    from ..generation import run_rows
    from ..models import get_adapter
    from ..models.base import RowBatch

    adapter = get_adapter(model)
    out = _setup(model, processor, image_size)
    base = out.cache
    token = out.sequences[0, -1:].to(model.device)
    position = base.next_position
    key = order_key(base.turn - 1, GENERATED, 10**6).reshape(1)
    source = torch.tensor([out.sequences.shape[1] - 1])

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def plain(cache):
        run_rows(adapter, cache, adapter.text_row(token, position), key, source, GENERATED, True)

    def fused(c):
        def step(cache):
            chunk = cache.take_pending(c)
            batch = RowBatch.concat([adapter.pending_batch(chunk), adapter.text_row(token, position)])
            kinds = torch.cat([torch.full((len(chunk),), DEFERRED, dtype=torch.int8),
                               torch.tensor([GENERATED], dtype=torch.int8)])
            run_rows(adapter, cache, batch, torch.cat([chunk.keys, key.to(chunk.keys.device)]),
                     torch.cat([chunk.sources.cpu(), source]), kinds, True)
        return step

    def serial(c):
        def step(cache):
            chunk = cache.take_pending(c)
            run_rows(adapter, cache, adapter.pending_batch(chunk), chunk.keys, chunk.sources, DEFERRED, False)
            plain(cache)
        return step

    variants = {"decode": plain}
    for c in chunk_sizes:
        if c <= base.num_pending:
            variants[f"fused c={c}"] = fused(c)
            variants[f"serial c={c}"] = serial(c)
    samples = {name: [] for name in variants}
    with torch.no_grad():
        for rep in range(reps + 3):
            for name, fn in variants.items():  # interleaved, so drift hits every variant alike
                cache = copy.deepcopy(base)
                sync()
                t0 = time.perf_counter()
                fn(cache)
                sync()
                if rep >= 3:  # warm-up
                    samples[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(v) for name, v in samples.items()}
    rows = [{"variant": name, "median_ms": medians[name] * 1e3, "ratio_to_decode": medians[name] / medians["decode"]}
            for name in variants]
    return {
        "benchmark": "fused_step",
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "cached_rows": base.num_rows,
        "pending_deferred": base.num_pending,
        "reps": reps,
        "hardware": {"platform": platform.platform(), "processor": platform.processor(),
                     "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "rows": rows,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench fused-step", description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    from ..integration import enable
    from ..tiny import build_tiny_processor, build_tiny_qwen3_vl

    model = enable(build_tiny_qwen3_vl(seed=0, hidden_size=args.hidden_size, num_hidden_layers=args.layers))
    result = run(model, build_tiny_processor(max_pixels=512 * 512), reps=args.reps)
    print(f"{result['model']} ({result['parameters'] / 1e6:.2f} M params), {result['cached_rows']} cached rows, "
          f"{result['pending_deferred']} pending; {result['hardware']['platform']}, torch {result['hardware']['torch']}, "
          f"{result['hardware']['threads']} threads; medians of {result['reps']}")
    print(f"{'variant':<14}{'median ms':>11}{'x decode':>10}")
    for row in result["rows"]:
        print(f"{row['variant']:<14}{row['median_ms']:>11.3f}{row['ratio_to_decode']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result
