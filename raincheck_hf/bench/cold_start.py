"""Cold start: seconds from a fresh process's start to its first answer, first ever vs with the caches warm.

``python -m raincheck_hf.bench cold-start --model qwen3_vl_8b --processes 3 --out cold_start.json``

Runs ``--processes`` fresh Python processes one after the other. Each: imports, builds the model (random weights of the
real shape, `bench.shapes`), enables the persistent caches (`persist.enable_persistent_caches`) on one cache folder,
runs `raincheck_hf.warm_up` (unless ``--no-warm-up``), then answers the benchmark's image question once, and reports
when its first token and its whole answer came, counted from the moment the parent launched it (interpreter start and
imports included), with the captures the answer made (its trace's ``captures``: none after a warm-up that covers it).
``--warm-up-scope first`` (the default, what the CLI's chat does) warms only what the first turn needs before it
(``warm_up(..., first_turn=True)``) and, after the answer, the rest as idle time would (`IdleWarmUp.finish`, timed:
``rest``; ``--no-rest``: the process ends after its answer, the rest neither captured nor timed); ``all`` warms
everything before the answer. ``--compile-steps on / off`` sets `RaincheckConfig.compile_steps` instead of the default.
Each process's figures include torch's compile-time table (Dynamo's trace and guards, AOTAutograd's and Inductor's
phases, the caches' loads: seconds per compile); ``--profile-warm-up`` also runs its warm-up under cProfile and keeps
the functions with the most cumulative and own time, so that a start's seconds can be split into traces, cache loads,
captures and the rest (the profiler slows the warm-up itself).
The first process starts on an empty cache folder (first ever: every kernel compiled and autotuned); the later ones
find what it left. Prints a table and writes JSON with the hardware. A process that passes ``--timeout`` is recorded
with the marks it reached (each child writes its marks to stderr as it goes) and ends the run.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
import os
import subprocess
import sys
import tempfile
import time


class _Marks(dict):
    """A process's marks, each also written to stderr as it is set (``[cold-start-mark] name seconds``): a parent
    whose child passes its time limit still learns how far it got."""

    def __setitem__(self, name, seconds):
        super().__setitem__(name, seconds)
        print(f"{MARK} {name} {seconds:.3f}", file=sys.stderr, flush=True)


MARK = "[cold-start-mark]"


def marks_from(stderr) -> dict:
    """The marks a child wrote before it was stopped (`_Marks`), from its captured stderr (text, bytes or None)."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    found = {}
    for line in (stderr or "").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == MARK:
            try:
                found[parts[1]] = float(parts[2])
            except ValueError:
                pass
    return found


def _child(args) -> dict:
    launched = args.launched_at
    marks = _Marks()
    marks["interpreter_s"] = time.time() - launched
    import torch

    import raincheck_hf
    from raincheck_hf.bench import shapes
    from raincheck_hf.persist import enable_persistent_caches

    marks["imports_s"] = time.time() - launched
    caches = enable_persistent_caches(args.cache_dir)
    marks["caches_s"] = time.time() - launched
    device = torch.device(args.device)
    preloaded = args.preload_compiler == "on" and device.type == "cuda"
    if preloaded:  # (an experiment: the CLI / server / demo do not)
        from raincheck_hf.fast.compiled import preload_compiler

        preload_compiler()
    if device.type == "cuda":  # the CUDA context on its own (the model's build would pay it otherwise)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    marks["device_s"] = time.time() - launched
    model, info = shapes.build_model(args.model, device)
    processor = shapes.build_processor()
    raincheck_hf.enable(model)
    spec = shapes.MODELS[args.model]
    # the default settings unless a chunk size or the compile setting is given
    given = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    if args.compile_steps != "default":
        given["compile_steps"] = args.compile_steps == "on"
    config = raincheck_hf.RaincheckConfig(**given)
    marks["model_s"] = time.time() - launched
    summary = None
    width, height = spec.image_size
    bounds = dict(max_tokens=args.max_tokens, max_new_tokens=args.max_new_tokens, image_sizes=[(height, width)],
                  cache_dir=args.cache_dir)
    first_turn = args.warm_up_scope == "first"
    profile = None
    marks["warm_up_start_s"] = time.time() - launched
    modules_before = set(sys.modules)
    triton_record = TritonRecord.start() if device.type == "cuda" else None
    from raincheck_hf.fast.autotune_ahead import switched_off, timing_in_full

    # (--compile-ahead off: the autotuner compiles each configuration itself and times it in full, as before
    # fast.autotune_ahead; full-timing: compiled ahead, timed in full)
    ahead = {"on": nullcontext, "off": switched_off, "full-timing": timing_in_full}[args.compile_ahead]
    with ahead():
        if args.warm_up and args.profile_warm_up:
            import cProfile

            profiler = cProfile.Profile()
            summary = profiler.runcall(raincheck_hf.warm_up, model, processor, config, progress=False,
                                       first_turn=first_turn, **bounds)
            profile = profile_figures(profiler)
        elif args.warm_up:
            summary = raincheck_hf.warm_up(model, processor, config, progress=False, first_turn=first_turn, **bounds)
    marks["warm_up_done_s"] = time.time() - launched
    warm_up_triton = None if triton_record is None else triton_record.figures()
    if preloaded:  # (its imports ended before the warm-up began, or in it)
        from raincheck_hf.fast.compiled import preload_finished_at

        marks["compiler_preloaded_s"] = preload_finished_at() - launched
    warm_up_imports = imported_figures(set(sys.modules) - modules_before)
    inputs, prompt = shapes.build_prompt(processor, spec, "image")
    inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}

    class FirstToken:  # HF's streamer protocol: the prompt first, then each token
        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.at is None:
                self.at = time.time()

        def end(self):
            pass

    first = FirstToken()
    out = model.generate(**inputs, raincheck=config, max_new_tokens=args.max_new_tokens, min_new_tokens=1,
                         do_sample=False, return_dict_in_generate=True, streamer=first,
                         suppress_tokens=shapes.special_token_ids(processor))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    marks["first_answer_s"] = time.time() - launched
    marks["first_token_s"] = (first.at or time.time()) - launched
    answer_tokens = int(out.sequences.shape[1] - inputs["input_ids"].shape[1])
    # (the answer's time per token after the first: the compiled steps' speed, which a cold start must not trade away)
    tpot = (marks["first_answer_s"] - marks["first_token_s"]) / (answer_tokens - 1) if answer_tokens > 1 else None
    captures = [list(c) for c in out.raincheck.captures]
    rest = None
    if args.warm_up and first_turn and args.rest:  # what idle time captures after the answer (the chat: as it waits)
        del out
        started = time.time()
        more = raincheck_hf.IdleWarmUp(model, processor, config, **bounds).finish(progress=False)
        rest = {"seconds": time.time() - started, "graphs_captured": 0 if more is None else len(more.captured),
                "already_captured": 0 if more is None else more.already_captured,
                "captures": None if more is None else capture_figures(more.captured, config.max_chunk_size + 1)}
        marks["rest_done_s"] = time.time() - launched
    return {
        **marks,
        "answer_tokens": answer_tokens,
        "tpot_s": tpot,
        "captures_during_answer": captures,
        "warm_up_scope": args.warm_up_scope if args.warm_up else None,
        "rest": rest,
        "warm_up": None if summary is None else {
            "seconds": summary.seconds, "path": summary.path, "graphs_captured": len(summary.captured),
            "already_captured": summary.already_captured, "vision_grids": len(summary.vision),
            "capacities": summary.capacities, "coverage": summary.coverage,
            "compiled_ahead": summary.compiled_ahead,
            "captures": capture_figures(summary.captured, config.max_chunk_size + 1)},
        "cache_folder_set_aside": None if caches.set_aside is None else caches.set_aside[1],
        "loaded_compile_artifacts": caches.loaded_artifacts,
        "warm_up_profile": profile,
        "preload_compiler": preloaded,
        "compile_ahead": args.compile_ahead,
        "warm_up_imports": warm_up_imports,
        "compile_times": compile_figures(),  # (the warm-up's and the answer's compiles: none in a covered answer)
        "warm_up_triton": warm_up_triton,
        "prompt": prompt,
        "model": info,
    }


def imported_figures(names) -> dict:
    """The modules first imported during the warm-up, per top-level package: how many, and how many of those read
    from source, without their bytecode cache (``__pycache__``: compiled again in every process; a package installed
    without it, or an interpreter that writes none, ``sys.flags.dont_write_bytecode``)."""
    from raincheck_hf.startup import bytecode_path

    packages: dict = {}
    for name in names:
        module = sys.modules.get(name)
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        entry = packages.setdefault(name.split(".")[0], [0, 0])
        entry[0] += 1
        if isinstance(origin, str) and origin.endswith(".py"):
            cached = bytecode_path(origin)
            if cached is None or not os.path.exists(cached):
                entry[1] += 1
    return {"modules": sum(n for n, _ in packages.values()), "dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
            "by_package": {k: {"imported": n, "without_bytecode": m}
                           for k, (n, m) in sorted(packages.items(), key=lambda kv: -kv[1][0])}}


def profile_figures(profiler, top: int = 60) -> dict:
    """Where a profiled warm-up's time went: the ``top`` functions by cumulative and by own time (``[where, calls,
    own s, cumulative s]`` each) and torch's compile-time table (`torch._dynamo.utils.compile_times`), if any."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append([f"{os.path.basename(path)}:{line}({name})", int(calls), round(own, 4), round(cumulative, 4)])
    return {"by_cumulative": sorted(rows, key=lambda r: -r[3])[:top], "by_own": sorted(rows, key=lambda r: -r[2])[:top],
            "compile_times": compile_figures()}


class TritonRecord:
    """Triton's compiles and autotuning during a warm-up: each kernel's compiles (Triton's compilation listener: how
    many compiled, how many found in its cache, their seconds summed over the threads that compiled them: more than
    the wall time where `fast.autotune_ahead` compiles on threads) and, from the autotuned kernels in the
    loaded modules, each one's last tuning (how many configurations, seconds: their compiles and timed runs) and the
    keys it has tuned with the configuration chosen for each."""

    def __init__(self, knobs):
        import threading

        self.knobs, self.previous, self.kernels = knobs, knobs.compilation.listener, {}
        self.started, self.lock = time.perf_counter(), threading.Lock()  # (compiles ahead report from their threads)

    @classmethod
    def start(cls):
        try:
            from triton import knobs
        except ImportError:  # (a Triton without knobs: no record)
            return None
        record = cls(knobs)
        knobs.compilation.listener = record
        return record

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit):
        if self.previous is not None:
            self.previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        with self.lock:
            entry = self.kernels.setdefault(getattr(src, "name", "?"), {"compiled": 0, "cached": 0, "seconds": 0.0})
            entry["cached" if cache_hit else "compiled"] += 1
            entry["seconds"] += getattr(times, "total", 0) / 1e6  # (microseconds)

    def figures(self) -> dict:
        self.knobs.compilation.listener = self.previous
        from raincheck_hf.fast.autotune_ahead import autotuners_in

        tuned, seen = {}, set()
        for name, module in list(sys.modules.items()):
            if not name.startswith(("fla", "raincheck_hf", "transformers")):
                continue
            for tuner, jit in autotuners_in(module):
                if getattr(tuner, "bench_time", None) is not None and id(tuner) not in seen:
                    seen.add(id(tuner))  # (a kernel a second module imports is one tuner)
                    tuned[f"{name}.{getattr(jit.fn, '__name__', '?')}"] = {
                        "configs": len(getattr(tuner, "configs_timings", None) or tuner.configs),
                        "seconds": round(float(tuner.bench_time), 3),
                        # every tuning key it holds (its tuned heads, dims and dtypes) and the configuration chosen
                        "keys": {str(key): str(config) for key, config in getattr(tuner, "cache", {}).items()}}
        kernels = dict(sorted(self.kernels.items(), key=lambda kv: -kv[1]["seconds"]))
        for entry in kernels.values():
            entry["seconds"] = round(entry["seconds"], 3)
        return {"seconds": round(time.perf_counter() - self.started, 3),
                "compiled": sum(e["compiled"] for e in kernels.values()),
                "cached": sum(e["cached"] for e in kernels.values()),
                "compile_s": round(sum(e["seconds"] for e in kernels.values()), 3),
                "autotuned": dict(sorted(tuned.items(), key=lambda kv: -kv[1]["seconds"])),
                "autotune_s": round(sum(e["seconds"] for e in tuned.values()), 3),
                "kernels": kernels}


def compile_figures() -> dict | str:
    """torch's compile-time table so far in this process (`torch._dynamo.utils.compile_times`): per phase (Dynamo's
    trace, its guards, AOTAutograd, Inductor, the caches' loads), the seconds of each compile in order."""
    try:
        import torch._dynamo.utils as dynamo_utils

        return {name: [round(float(s), 4) for s in seconds]
                for name, seconds in dynamo_utils.compilation_time_metrics.items()}
    except Exception as error:  # (another torch's table: not essential to the figures)
        return f"unavailable: {type(error).__name__}: {error}"


def capture_figures(captured, step_rows: int) -> dict:
    """What `warm_up`'s step captures cost (``WarmUpSummary.captured``: ``(capacity, rows, logits, variant, bucket,
    seconds)`` each), split by prefills (more rows than the config's largest decode / chunk step, ``step_rows``;
    a prefill of no more rows counts as a step) and steps, and by
    a row count's first capture in the process (its warm-up pays lazy initialisation: two runs, compiles, kernel
    tuning) and the later ones at other slot buckets or storages: count, total and median seconds each, and every
    capture as ``[capacity, rows, bucket, seconds]``."""
    import statistics

    groups: dict = {}
    seen = set()
    for capacity, rows, _, variant, bucket, seconds in captured:
        kind = "prefill" if rows > step_rows else "step"
        first = (rows, variant) not in seen
        seen.add((rows, variant))
        groups.setdefault(f"{kind}_{'first' if first else 'again'}", []).append(float(seconds))
    return {
        "total_s": float(sum(entry[-1] for entry in captured)),
        "groups": {name: {"count": len(v), "total_s": sum(v), "median_s": statistics.median(v)}
                   for name, v in sorted(groups.items())},
        "each": [[capacity, rows, bucket, round(float(seconds), 4)]
                 for capacity, rows, _, _, bucket, seconds in captured],
    }


def _launch(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """One fresh process (tests stand in their own)."""
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def run(model: str = "qwen3_vl_8b", processes: int = 2, device: str | None = None, cache_dir: str | None = None,
        max_tokens: int = 4096, max_new_tokens: int = 64, chunk_size=None, warm_up: bool = True,
        out: str | None = None, timeout: float = 1800.0, warm_up_scope: str = "first", rest: bool = True,
        compile_steps: str = "default", profile_warm_up: bool = False, preload_compiler: str = "off",
        compile_ahead: str = "on") -> dict:
    """Launch ``processes`` fresh processes in turn and collect their figures (see the module docstring)."""
    import torch

    from .latency import hardware_info
    from .shapes import MODELS

    if model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    if warm_up_scope not in ("first", "all"):
        raise ValueError(f"--warm-up-scope must be 'first' or 'all', got {warm_up_scope!r}")
    if compile_steps not in ("default", "on", "off"):
        raise ValueError(f"--compile-steps must be 'default', 'on' or 'off', got {compile_steps!r}")
    if preload_compiler not in ("on", "off", "both"):
        raise ValueError(f"--preload-compiler must be 'on', 'off' or 'both', got {preload_compiler!r}")
    if compile_ahead not in ("on", "off", "full-timing"):
        raise ValueError(f"--compile-ahead must be 'on', 'off' or 'full-timing', got {compile_ahead!r}")
    if processes < 2:
        raise ValueError(f"--processes must be >= 2 (a first-ever process and one after it), got {processes}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    fresh = cache_dir is None
    folder = tempfile.mkdtemp(prefix="raincheck-cold-start-") if fresh else cache_dir
    if not fresh and os.path.exists(os.path.join(folder, "current")):
        raise ValueError(f"--cache-dir {folder!r} already holds a cache: the first process must start on an empty "
                         "folder (leave --cache-dir out for a fresh temporary one)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")}
    results = []
    for index in range(processes):
        launched = time.time()
        command = [sys.executable, "-m", "raincheck_hf.bench.cold_start", "--child", "--launched-at", repr(launched),
                   "--model", model, "--device", device, "--cache-dir", folder, "--max-tokens", str(max_tokens),
                   "--max-new-tokens", str(max_new_tokens), "--warm-up-scope", warm_up_scope]
        if chunk_size is not None:
            command += ["--chunk-size", str(chunk_size)]
        if not warm_up:
            command.append("--no-warm-up")
        if not rest:
            command.append("--no-rest")
        if compile_steps != "default":
            command += ["--compile-steps", compile_steps]
        if profile_warm_up:
            command.append("--profile-warm-up")
        preload = preload_compiler if preload_compiler != "both" else ("off" if index % 2 == 0 else "on")
        command += ["--preload-compiler", preload, "--compile-ahead", compile_ahead]
        try:
            done = _launch(command, env, timeout)
        except subprocess.TimeoutExpired as expired:  # (what it reached, then no later process: its cache is partial)
            reached = marks_from(expired.stderr)
            results.append({**reached, "process": index, "timed_out_after_s": timeout,
                            "cache": "empty (first ever)" if index == 0 else "left by the processes before"})
            last = max(reached, key=reached.get) if reached else "nothing"
            print(f"[cold-start] process {index} passed its {timeout:.0f}-s limit; its last mark: {last}"
                  + (f" at {reached[last]:.1f} s" if reached else ""), file=sys.stderr)
            break
        if done.returncode != 0:
            raise RuntimeError(f"cold-start process {index} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1])
        result["process"] = index
        result["cache"] = "empty (first ever)" if index == 0 else "left by the processes before"
        results.append(result)
        print(f"[cold-start] process {index} ({result['cache']}): first token {result['first_token_s']:.1f} s, "
              f"first answer {result['first_answer_s']:.1f} s after launch (warm-up done at "
              f"{result['warm_up_done_s']:.1f} s; {len(result['captures_during_answer'])} captures in the answer)",
              file=sys.stderr)
        tri = result.get("warm_up_triton")
        if tri:
            top = ", ".join(f"{k} {v['compiled']}+{v['cached']} {v['seconds']:.1f} s" for k, v in
                            list(tri["kernels"].items())[:8])
            tuned = ", ".join(f"{k.rsplit('.', 1)[-1]} {v['configs']} {v['seconds']:.1f} s {len(v['keys'])} keys"
                              for k, v in list(tri["autotuned"].items())[:8])
            print(f"[cold-start] process {index} warm-up Triton: {tri['compiled']} compiled, {tri['cached']} from the "
                  f"cache, {tri['compile_s']:.1f} s compiling; autotuned {tri['autotune_s']:.1f} s; by kernel "
                  f"(compiled+cached): {top}; autotuned (configs, last tuning, keys held): {tuned}", file=sys.stderr)
    report = {
        "benchmark": "cold_start",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {"model": model, "processes": processes, "device": device, "max_tokens": max_tokens,
                     "answer_tokens": max_new_tokens, "chunk_size": chunk_size or "default", "warm_up": warm_up,
                     "warm_up_scope": warm_up_scope if warm_up else None,
                     "rest_after_answer": rest and warm_up and warm_up_scope == "first",
                     "compile_steps": compile_steps, "profile_warm_up": profile_warm_up,
                     "preload_compiler": preload_compiler, "compile_ahead": compile_ahead,
                     "cache_dir": "a fresh temporary folder" if fresh else folder},
        "hardware": hardware_info(torch.device(device)),
        "first_ever": {k: results[0].get(k) for k in ("first_token_s", "first_answer_s", "warm_up_done_s")},
        "later": [{k: r.get(k) for k in ("first_token_s", "first_answer_s", "warm_up_done_s")} for r in results[1:]],
        "processes": results,
    }
    print(f"{'process':>8} {'cache':>6} {'preload':>8} {'imports':>8} {'device':>8} {'model':>8} {'warm-up':>8} "
          f"{'1st token':>10} {'answer':>8} {'captures':>9} {'TPOT ms':>8}")
    for r in results:
        if "timed_out_after_s" in r:
            print(f"{r['process']:>8} {('empty' if r['process'] == 0 else 'warm'):>6}  passed its "
                  f"{r['timed_out_after_s']:.0f}-s limit (marks reached: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k.endswith("_s") and k != "timed_out_after_s")
                  + ")")
            continue
        tpot = "-" if r.get("tpot_s") is None else f"{1e3 * r['tpot_s']:.2f}"
        preload = f"{r['compiler_preloaded_s']:.1f}" if "compiler_preloaded_s" in r else "off"
        print(f"{r['process']:>8} {('empty' if r['process'] == 0 else 'warm'):>6} {preload:>8} {r['imports_s']:>8.1f} "
              f"{r['device_s']:>8.1f} {r['model_s']:>8.1f} {r['warm_up_done_s']:>8.1f} {r['first_token_s']:>10.1f} "
              f"{r['first_answer_s']:>8.1f} {len(r['captures_during_answer']):>9} {tpot:>8}")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"[cold-start] wrote {out}", file=sys.stderr)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench cold-start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_vl_8b", help="a model of bench/shapes.py (tiny_* run on a CPU)")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes, the first on an empty cache")
    parser.add_argument("--device", default=None)
    parser.add_argument("--cache-dir", default=None,
                        help="the cache folder (must be empty; default: a fresh temporary folder)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="warm_up's conversation bound")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="the first answer's length limit")
    parser.add_argument("--chunk-size", default=None, help="RaincheckConfig.chunk_size (default: the default settings')")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--warm-up-scope", choices=("first", "all"), default="first",
                        help="first: what the first turn needs before it, the rest after the answer (timed apart; "
                             "what the chat does); all: everything before the first answer")
    parser.add_argument("--rest", action=argparse.BooleanOptionalAction, default=True,
                        help="with --warm-up-scope first: after the answer, capture the rest as idle time would and "
                             "time it (--no-rest: each process ends after its answer)")
    parser.add_argument("--compile-steps", choices=("default", "on", "off"), default="default",
                        help="RaincheckConfig.compile_steps (default: the default settings', compiled where the steps "
                             "are captured; off: what a start without the compile's traces costs)")
    parser.add_argument("--profile-warm-up", action="store_true",
                        help="run each warm-up under cProfile and keep where its time went (the JSON's "
                             "warm_up_profile; the profiler slows the warm-up itself)")
    parser.add_argument("--preload-compiler", choices=("on", "off", "both"), default="off",
                        help="on CUDA, import torch's compiler on a thread while the model is built "
                             "(fast.compiled.preload_compiler; not done by the CLI, the server or the demo); both: "
                             "the processes alternate off and on, the first off (side by side)")
    parser.add_argument("--compile-ahead", choices=("on", "off", "full-timing"), default="on",
                        help="on (the default, warm_up's): an autotuned Triton kernel's configurations compiled on "
                             "threads beside its autotuner and timed briefly (fast.autotune_ahead); off: each compiled "
                             "by the autotuner itself, one after the other, and timed as Triton does; full-timing: "
                             "compiled ahead, timed as Triton does")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a process may take; one that passes it is recorded with the marks it reached "
                             "(imports, model, warm-up...) and no later process runs")
    parser.add_argument("--out", default=None, help="JSON file to write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from ..configuration import parse_chunk_size

    args.chunk_size = None if args.chunk_size is None else parse_chunk_size(args.chunk_size)
    if args.child:
        print(json.dumps(_child(args), default=str), flush=True)
        return 0
    return run(args.model, args.processes, args.device, args.cache_dir, args.max_tokens, args.max_new_tokens,
               args.chunk_size, args.warm_up, args.out, timeout=args.timeout, warm_up_scope=args.warm_up_scope,
               rest=args.rest,
               compile_steps=args.compile_steps, profile_warm_up=args.profile_warm_up,
               preload_compiler=args.preload_compiler, compile_ahead=args.compile_ahead)


if __name__ == "__main__":
    sys.exit(main())
