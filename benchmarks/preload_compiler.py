"""Does importing torch's compiler on a thread while the model loads shorten a start? (`fast.compiled.preload_compiler`)

    python benchmarks/preload_compiler.py --runs 3 --json benchmarks/results/preload_compiler_cpu.json

Fresh processes in turn, preloading off and on alternately (off first), each: imports, then (on) the preloading thread
started, then ``from_pretrained`` of a saved checkpoint (a Qwen3-VL-8B-shaped model with ``--layers`` decoder and
vision layers, random bf16 weights, written to ``--checkpoint`` first if that folder holds none), then a compiled
function made (`fast.compiled.compiled`, which waits for the thread) and called once. Seconds after the
process's start: model loaded, compiled function made, first compile done (one Inductor cache folder for every
process, filled by a first process that is not counted). Medians per setting, JSON with the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _child(mode: str, checkpoint: str) -> dict:
    started = time.time()
    import torch
    import transformers

    from raincheck_hf.fast import compiled

    marks = {"preload": mode, "imports_s": time.time() - started}
    if mode == "on":
        compiled.preload_compiler()
    transformers.Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.bfloat16)
    marks["loaded_s"] = time.time() - started

    def norm(x, w):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype) * w

    fn = compiled.compiled(norm, rows={0: (0,)})
    marks["made_s"] = time.time() - started
    fn(torch.randn(4, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16))
    marks["first_compile_s"] = time.time() - started
    if mode == "on":
        marks["preloaded_s"] = compiled.preload_finished_at() - started
    return marks


def _checkpoint(folder: str, layers: int) -> None:
    import transformers

    from raincheck_hf.bench import shapes

    config = shapes.qwen3_vl_8b_config()
    config.text_config.num_hidden_layers = layers
    config.vision_config.depth = layers
    config.vision_config.deepstack_visual_indexes = [i for i in (2, 4, 6) if i < layers]
    model = shapes.build_from_config(transformers.Qwen3VLForConditionalGeneration, config, "cpu")
    model.save_pretrained(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="processes per setting")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "raincheck-preload-ckpt"))
    parser.add_argument("--layers", type=int, default=8, help="decoder and vision layers of a new checkpoint")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.checkpoint)), flush=True)
        return 0
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        _checkpoint(args.checkpoint, args.layers)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="raincheck-preload-inductor-"))

    def one(mode):
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--checkpoint", args.checkpoint],
                              capture_output=True, text=True, env=env, check=True)
        return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])

    one("off")  # (fills the Inductor cache: not counted)
    runs = [one(mode) for _ in range(args.runs) for mode in ("off", "on")]
    keys = ("imports_s", "loaded_s", "made_s", "first_compile_s")
    medians = {mode: {k: statistics.median(r[k] for r in runs if r["preload"] == mode) for k in keys}
               for mode in ("off", "on")}
    import torch

    from raincheck_hf.bench.latency import hardware_info

    report = {"benchmark": "preload_compiler", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "settings": {"runs": args.runs, "layers": args.layers, "checkpoint_bytes": sum(
                  os.path.getsize(os.path.join(args.checkpoint, f)) for f in os.listdir(args.checkpoint))},
              "hardware": {**hardware_info(torch.device("cpu")), "cpu_count": os.cpu_count()},
              "runs": runs, "medians": medians,
              "first_compile_on_over_off": medians["on"]["first_compile_s"] / medians["off"]["first_compile_s"]}
    for mode in ("off", "on"):
        print(f"preload {mode:>3}: " + ", ".join(f"{k} {medians[mode][k]:.2f}" for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
