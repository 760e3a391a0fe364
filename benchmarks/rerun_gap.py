"""Gap between Raincheck's fixed-factor GDN join and a full re-run (docs/method.md §4: reported, not asserted).

Runs `generate(raincheck=...)` on a Qwen3.5 model (the 9B shape with random bf16 weights on CUDA,
or the tiny fp32 model on CPU), then re-prefills the final logical sequence (kept rows in key
order, original positions) in one stock forward, and compares the logits of every decode
forward. As a noise floor it does the same for `mode="full"` (where the two computations agree up
to floating point). Uses the test suite's reference (`tests/reference_gdn.py`).

    python benchmarks/rerun_gap.py --model qwen3_5_9b --tokens 64 --json gap.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from reference import TurnRecord  # noqa: E402
from reference_gdn import full_rerun_logits  # noqa: E402

import raincheck_hf  # noqa: E402
from raincheck_hf import RaincheckConfig  # noqa: E402
from raincheck_hf.bench.shapes import MODELS, build_model, build_processor, build_prompt  # noqa: E402


def gap(model, inputs, config, tokens):
    device = next(model.parameters()).device
    moved = {k: v.to(device) for k, v in inputs.items() if k != "mm_token_type_ids"}
    out = model.generate(**moved, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, raincheck=config,
                         return_dict_in_generate=True, output_logits=True)
    record = TurnRecord(moved["input_ids"], out, moved.get("pixel_values"), moved.get("image_grid_thw"))
    with torch.no_grad():
        rerun = full_rerun_logits(model, [record])[0]
    diffs = [(a[0].float() - b.float()).abs() for a, b in zip(out.logits, rerun)]
    top1 = [int(a[0].argmax()) == int(b.argmax()) for a, b in zip(out.logits, rerun)]
    scale = torch.stack([b.float().std() for b in rerun]).mean().item()
    return {"max_abs": max(d.max().item() for d in diffs), "mean_abs": sum(d.mean().item() for d in diffs) / len(diffs),
            "top1_agreement": sum(top1) / len(top1), "logit_std": scale, "forwards": len(diffs),
            "restored_during_decode": out.raincheck.restored_during_decode,
            "deferred": int(out.raincheck.deferred.numel())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_5_9b", choices=[m for m in MODELS if "qwen3_5" in m])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--image-size", default=None, help="WxH")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, info = build_model(args.model, device)
    model = raincheck_hf.enable(model.eval())
    processor = build_processor()
    size = tuple(int(x) for x in args.image_size.split("x")) if args.image_size else None
    inputs, prompt_info = build_prompt(processor, MODELS[args.model], "image", image_size=size)
    result = {"model": info, "prompt": prompt_info, "tokens": args.tokens,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    for name, cfg in (("raincheck c=31 g=16", RaincheckConfig(selector="uniform", chunk_size=31, decode_guard=16)),
                      ("full (noise floor)", RaincheckConfig(mode="full"))):
        result[name] = gap(model, inputs, cfg, args.tokens)
        r = result[name]
        print(f"{name:<22} max |Δlogit| {r['max_abs']:.4f}  mean {r['mean_abs']:.5f}  top-1 agree "
              f"{r['top1_agreement']:.2f}  (logit std {r['logit_std']:.3f}, {r['forwards']} forwards, "
              f"{r['restored_during_decode']}/{r['deferred']} restored during decode)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
