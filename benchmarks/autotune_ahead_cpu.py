"""fla's Gated DeltaNet forward's first compiles with and without `raincheck_hf.fast.autotune_ahead`, on a CPU.

    pip install fla-core==0.6.0 einops     # (the GPU path's kernels: pyproject's [gpu] extra)
    python benchmarks/autotune_ahead_cpu.py --runs 3 --json benchmarks/results/autotune_ahead_cpu.json
    python benchmarks/autotune_ahead_cpu.py --compare probe --runs 3 --json benchmarks/results/layout_probe_cpu.json

What a first start pays for fla's autotuned kernels is mostly Triton compiling each configuration of each kernel, one
after the other. Triton's compiler needs no GPU, so this plays that part on a CPU: each fresh process (its own empty
Triton cache) runs fla's L2 norm of q and k and its `chunk_gated_delta_rule_fwd` (what transformers' Qwen3.5 calls for a
prefill) on CPU tensors of Qwen3.5-9B's Gated DeltaNet shape (a 448-row prefill: 16 key heads, 32 value heads, head
dims 128), with Triton's driver stood in by one that names a CUDA sm_90 target and each kernel launch turned into the
autotuner's compiles: the first time an autotuned kernel meets a tuning key (Triton's: its key arguments and its
tensors' dtypes) every configuration compiled in turn in the calling thread (Triton's own ``Autotuner.warmup``), later
its chosen one; the other kernels as they are. The timed runs between the autotuner's compiles are not played (they
need the GPU). ``--compare ahead``: ``off`` as Triton does it against ``on``, inside `compiling_configs_ahead` (its
other configurations on threads). ``--compare probe``: what a first start compiles when the Qwen3.5 adapter's layout
check runs fla's rule before the first prefill, at a tiny fp32 shape (as it did) against the model's own (as it does),
compiles ahead on. The processes alternate; JSON with the hardware, medians and their ratio.
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


# what a first start runs through fla before its first prefill: the Qwen3.5 adapter's check of fla's state layout
# (`gdn.dispatch.check_state_layout`), as it was (a tiny fp32 probe: 2 heads of 64, 5 rows) or as it is (the model's
# own head split and dtype on a prefill's rows, `ProbeLayout.of`, `PROBE_ROWS["cuda"]`), or nothing
BEFORE = {"none": None, "tiny-probe": (5, 2, 2, 64, "float32"), "model-probe": (512, 16, 32, 128, "bfloat16")}
PREFILL = (448, 16, 32, 128, "bfloat16")  # Qwen3.5-9B's Gated DeltaNet, a 448-row prefill


def _child(mode: str, workers: int | None, before: str = "none") -> dict:
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

    tuned = {}  # id(autotuner) -> the tuning keys it has met (Triton's: its key arguments and every tensor's dtype)

    def compile_instead(kernel, grid, args, kwargs):
        if isinstance(kernel, Heuristics):  # (its values, then the kernel under it)
            named = {**dict(zip(kernel.arg_names, args)), **kwargs}
            kwargs = {**kwargs, **{name: rule(named) for name, rule in kernel.values.items()}}
            return compile_instead(kernel.fn, grid, args, kwargs)
        if isinstance(kernel, Autotuner):
            named = {k: v for k, v in {**dict(zip(kernel.arg_names, args)), **kwargs}.items() if k in kernel.arg_names}
            key = tuple(named[k] for k in kernel.keys if k in named) + tuple(
                str(v.dtype) for v in named.values() if hasattr(v, "dtype"))
            if key in tuned.setdefault(id(kernel), set()):  # (tuned already: its chosen configuration, the first here)
                return kernel.fn.run(*args, grid=grid, warmup=True, **kwargs, **kernel.configs[0].all_kwargs())
            tuned[id(kernel)].add(key)
            return kernel.warmup(*args, grid=grid, **kwargs)  # (every configuration in turn: a tuning)
        return kernel.run(*args, grid=grid, warmup=True, **kwargs)

    KernelInterface.__getitem__ = lambda self, grid: lambda *a, **k: compile_instead(self, grid, a, k)
    heard = []
    triton.knobs.compilation.listener = lambda *, cache_hit, **_: heard.append(cache_hit)
    from fla.modules.l2norm import l2norm_fwd

    def gated_delta(rows, h, hv, d, dtype_name):
        """fla's chunked rule as transformers' Qwen3.5 calls it (``use_qk_l2norm_in_kernel``: q and k normalised
        first), q, k and v split from one projection, fp32 gates and state, beta in the model's dtype."""
        dtype = getattr(torch, dtype_name)
        qkv = torch.randn(1, rows, (2 * h + hv) * d).to(dtype)
        q, k, v = torch.split(qkv, [h * d, h * d, hv * d], dim=-1)
        q, k, v = q.reshape(1, rows, h, d), k.reshape(1, rows, h, d), v.reshape(1, rows, hv, d)
        (q, _), (k, _) = l2norm_fwd(q.contiguous()), l2norm_fwd(k.contiguous())
        chunk.chunk_gated_delta_rule_fwd(q=q, k=k, v=v.contiguous(), g=-torch.rand(1, rows, hv),
                                         beta=torch.rand(1, rows, hv).to(dtype), scale=d ** -0.5,
                                         initial_state=torch.zeros(1, hv, d, d), output_final_state=True,
                                         cu_seqlens=None)

    started = time.perf_counter()
    with compiling_configs_ahead(workers=workers) if mode == "on" else switched_off() as ahead:
        if BEFORE[before] is not None:
            gated_delta(*BEFORE[before])
        gated_delta(*PREFILL)
    seconds = time.perf_counter() - started
    return {"mode": mode, "before": before, "seconds": seconds, "compiled": heard.count(False),
            "from_cache": heard.count(True), "compiled_ahead": None if ahead is None else ahead.submitted,
            "errors": None if ahead is None else ahead.errors}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="processes per mode (they alternate off, on)")
    parser.add_argument("--workers", type=int, default=None, help="compile threads (default: autotune_ahead's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare", choices=("ahead", "probe"), default="ahead",
                        help="ahead: compiles ahead off against on, a prefill alone; probe: the layout check's tiny "
                             "fp32 probe against one at the model's own layout, each before the prefill, compiles "
                             "ahead on (warm_up's default)")
    parser.add_argument("--child", choices=("off", "on"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--before", choices=tuple(BEFORE), default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.workers, args.before)), flush=True)
        return 0
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    variants = ([("off", "none"), ("on", "none")] if args.compare == "ahead"
                else [("on", "tiny-probe"), ("on", "model-probe")])
    rows = []
    for run in range(args.runs):
        for mode, before in variants:
            env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-"), "PYTHONWARNINGS": "ignore"}
            command = [sys.executable, __file__, "--child", mode, "--before", before]
            if args.workers:
                command += ["--workers", str(args.workers)]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"the {mode} / {before} process failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"run": run, **row})
            print(f"[autotune-ahead] run {run} {mode}, before the prefill {before}: {row['seconds']:.2f} s, "
                  f"{row['compiled']} compiled, {row['from_cache']} found in the cache ({row['compiled_ahead']} "
                  f"handed to threads)", file=sys.stderr)
    import torch

    from raincheck_hf.bench.latency import hardware_info
    from raincheck_hf.fast.autotune_ahead import default_workers

    names = [f"{mode}/{before}" for mode, before in variants]
    medians = {name: statistics.median(r["seconds"] for r in rows if f"{r['mode']}/{r['before']}" == name)
               for name in names}
    compiled = {name: statistics.median(r["compiled"] for r in rows if f"{r['mode']}/{r['before']}" == name)
                for name in names}
    report = {
        "benchmark": "autotune_ahead_cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {"runs": args.runs, "workers": args.workers or default_workers(), "target": "cuda sm_90",
                     "compare": args.compare, "variants": names,
                     "shape": "Qwen3.5-9B Gated DeltaNet: q and k normalised, then the chunked rule on a 448-row "
                              "prefill, after the probe named (rows, key heads, value heads, head dim, dtype: "
                              f"{ {k: v for k, v in BEFORE.items() if v} })",
                     "played": "compiles only (an autotuner's first meeting of a key compiles every configuration, "
                               "a later one its chosen configuration)"},
        "hardware": hardware_info(torch.device("cpu")),  # (versions of Triton and fla among its packages)
        "median_s": medians, "median_compiled": compiled, "ratio": medians[names[1]] / medians[names[0]],
        "rows": rows,
    }
    print(f"[autotune-ahead] medians: {names[0]} {medians[names[0]]:.2f} s ({compiled[names[0]]} compiled), "
          f"{names[1]} {medians[names[1]]:.2f} s ({compiled[names[1]]} compiled), {report['ratio']:.2f}x",
          file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
