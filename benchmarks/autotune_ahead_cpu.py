"""fla's Gated DeltaNet forward's first compiles with and without `raincheck_hf.fast.autotune_ahead`, on a CPU.

    pip install fla-core==0.6.0 einops     # (the GPU path's kernels: pyproject's [gpu] extra)
    python benchmarks/autotune_ahead_cpu.py --runs 3 --json benchmarks/results/autotune_ahead_cpu.json

What a first start pays for fla's autotuned kernels is mostly Triton compiling each configuration of each kernel, one
after the other. Triton's compiler needs no GPU, so this plays that part on a CPU: each fresh process (its own empty
Triton cache) runs fla's `chunk_gated_delta_rule_fwd` (the chunked forward transformers' Qwen3.5 calls for a prefill)
on CPU tensors of Qwen3.5-9B's Gated DeltaNet shape (a 448-row prefill: 16 key heads, 32 value heads, head dims 128),
with Triton's driver stood in by one that names a CUDA sm_90 target and each kernel launch turned into the
autotuner's compiles: every configuration of an autotuned kernel compiled in turn in the calling thread (Triton's
own ``Autotuner.warmup``), the others as they are. The timed runs between the autotuner's compiles are not played
(they need the GPU). ``off``: as Triton does it; ``on``: inside `compiling_configs_ahead` (its other configurations
on threads). The processes alternate off and on; JSON with the hardware, medians and their ratio.
fla decides some configuration lists from the GPU it finds; on a CPU it finds none, so the lists are its
fallbacks (fewer stages), not Hopper's.
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


def _child(mode: str, workers: int | None) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import KernelInterface

    import fla.ops.gated_delta_rule.chunk as chunk  # (imported before the stand-in driver: fla finds a CPU)
    from raincheck_hf.fast.autotune_ahead import compiling_configs_ahead, switched_off

    class StandInDriver:
        """What a kernel's compile asks Triton's driver (no GPU is touched)."""

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(StandInDriver())

    def compile_instead(kernel, grid, args, kwargs):
        if isinstance(kernel, Heuristics):  # (its values, then the kernel under it)
            named = {**dict(zip(kernel.arg_names, args)), **kwargs}
            kwargs = {**kwargs, **{name: rule(named) for name, rule in kernel.values.items()}}
            return compile_instead(kernel.fn, grid, args, kwargs)
        if isinstance(kernel, Autotuner):  # (every configuration, in turn: the autotuner's first tuning)
            return kernel.warmup(*args, grid=grid, **kwargs)
        return kernel.run(*args, grid=grid, warmup=True, **kwargs)

    KernelInterface.__getitem__ = lambda self, grid: lambda *a, **k: compile_instead(self, grid, a, k)
    heard = []
    triton.knobs.compilation.listener = lambda *, cache_hit, **_: heard.append(cache_hit)
    b, t, h, hv, d = 1, 448, 16, 32, 128
    q, k = (torch.randn(b, t, h, d, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, t, hv, d, dtype=torch.bfloat16)
    g, beta = torch.randn(b, t, hv), torch.rand(b, t, hv, dtype=torch.bfloat16)
    started = time.perf_counter()
    with compiling_configs_ahead(workers=workers) if mode == "on" else switched_off() as ahead:
        chunk.chunk_gated_delta_rule_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=d ** -0.5, initial_state=None,
                                         output_final_state=True, cu_seqlens=None)
    seconds = time.perf_counter() - started
    return {"mode": mode, "seconds": seconds, "compiled": heard.count(False), "from_cache": heard.count(True),
            "compiled_ahead": None if ahead is None else ahead.submitted,
            "errors": None if ahead is None else ahead.errors}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="processes per mode (they alternate off, on)")
    parser.add_argument("--workers", type=int, default=None, help="compile threads (default: autotune_ahead's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=("off", "on"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.workers)), flush=True)
        return 0
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    rows = []
    for run in range(args.runs):
        for mode in ("off", "on"):
            env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-"), "PYTHONWARNINGS": "ignore"}
            command = [sys.executable, __file__, "--child", mode]
            if args.workers:
                command += ["--workers", str(args.workers)]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"the {mode} process failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"run": run, **row})
            print(f"[autotune-ahead] run {run} {mode}: {row['seconds']:.2f} s, {row['compiled']} compiled, "
                  f"{row['from_cache']} found in the cache ({row['compiled_ahead']} handed to threads)",
                  file=sys.stderr)
    import torch

    from raincheck_hf.bench.latency import hardware_info
    from raincheck_hf.fast.autotune_ahead import default_workers

    medians = {m: statistics.median(r["seconds"] for r in rows if r["mode"] == m) for m in ("off", "on")}
    report = {
        "benchmark": "autotune_ahead_cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {"runs": args.runs, "workers": args.workers or default_workers(), "target": "cuda sm_90",
                     "shape": "Qwen3.5-9B Gated DeltaNet, a 448-row prefill", "played": "compiles only"},
        "hardware": hardware_info(torch.device("cpu")),  # (versions of Triton and fla among its packages)
        "median_s": medians, "on_over_off": medians["on"] / medians["off"], "rows": rows,
    }
    print(f"[autotune-ahead] medians: off {medians['off']:.2f} s, on {medians['on']:.2f} s "
          f"({report['on_over_off']:.2f}x)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
