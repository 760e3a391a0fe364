"""Where a Raincheck answer's time goes: stages of the first token, and host vs device per decode step.

    python -m raincheck_hf.bench profile --model qwen3_vl_8b --modes full,raincheck --tokens 64 --json out.json

For each mode, after two warm-up calls (the vision tower captures a grid on its second sighting):

- ``stages``: one `generate` call with a device sync around each stage (so the stages add up to
  the first token; the syncs cost a little on their own): HF's preparation before the loop, the
  vision tower, the rest of `encode_turn`, selection, the prefill forward, and every decode forward
  (``decode_forward`` = host + device of the step's `Runner.run`).
- ``replay``: on the fast path, each captured graph replayed alone ``--replays`` times back to back
  with one sync at the end: the device time of one step without any host work in between. The gap
  between a step's TPOT and its replay time is host work between replays.
- ``timeline``: one unsynced `generate` call with the same stages marked, each entry and exit by the
  host's clock and by a device event on the current stream (no waits added): when the host reached a
  stage and when the device did, relative to the call's start, up to the first token. A stage whose
  device start is close to its host start found the device idle: the gap before it
  (``device_idle_before_ms``) is device time the first token spent waiting for the host.
- ``profiler``: `torch.profiler` over one unsynced `generate` call, the top operators by self CPU
  and by self device time (text tables in the JSON), and the counts of host-device syncs.

Nothing here is asserted; it reports measured times (seconds) on the machine it runs on.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections import defaultdict

import torch

from . import shapes
from .latency import TokenClock, _sync, _write


@contextlib.contextmanager
def stage_timers(model, device, record: dict, marks: list | None = None):
    """Wrap the engine's stages (this model's adapter class and the loop's helpers) with synced timers; with
    ``marks`` (a list), with unsynced marks instead: each call appends ``(label, host_enter, host_exit,
    event_enter, event_exit)`` (events on the current stream of a CUDA device, else None) and waits for nothing."""
    from .. import generation
    from ..fast.runner import StaticRunner
    from ..fast.vision_graphs import VisionGraphs
    from ..models import get_adapter
    from ..runner import EagerRunner

    adapter_cls = type(get_adapter(model))
    inner = model.model
    patched = []

    def wrap(owner, name, label, by_instance=False):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if marks is not None:
                enter = (time.perf_counter(), _event(device))
                try:
                    return original(*args, **kwargs)
                finally:
                    marks.append((label, enter[0], time.perf_counter(), enter[1], _event(device)))
            _sync(device)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync(device)
                record[label].append(time.perf_counter() - t0)

        setattr(owner, name, timed)
        patched.append((owner, name, original, by_instance))

    wrap(adapter_cls, "encode_turn", "encode_turn")
    wrap(inner, "get_image_features", "vision_tower", by_instance=True)
    wrap(inner, "get_video_features", "vision_tower", by_instance=True)
    wrap(VisionGraphs, "encode", "vision_tower")  # the fast path's tower (replayed per grid)
    wrap(inner, "get_rope_index", "rope_index", by_instance=True)
    wrap(generation, "start_visual_selection", "selection")
    # one forward of the loop's, on either engine (`runner.Runner.run`; a turn's first, `Runner.run_ahead`)
    for runner_cls in (EagerRunner, StaticRunner):
        wrap(runner_cls, "run", "forward")
        wrap(runner_cls, "run_ahead", "forward")
    if marks is not None:  # the timeline's finer marks: the host's work between the selection and the prefill
        from ..fast import graphs
        from ..fast.static_cache import StaticDeferredCache
        from ..selection import kernels, mmtok

        wrap(mmtok.MMTokSelector, "kernel_inputs", "selection_inputs")
        wrap(kernels, "greedy_select", "greedy")
        wrap(generation, "build_plan", "plan")
        wrap(generation, "_pending_rows", "pending_rows")
        wrap(adapter_cls, "rows", "rows")
        wrap(StaticDeferredCache, "assign_slots", "assign_slots")
        wrap(graphs, "fill", "fill")
        # after the first forward's launch, up to the first token: the sampling, the next step's rows and its fill
        wrap(generation, "choose_next_tokens", "sample")
        wrap(generation.ChunkScheduler, "decode_step", "decode_step")
        wrap(StaticRunner, "prepare", "prepare")
    entered = {}
    original_sample = generation.raincheck_sample

    @functools.wraps(original_sample)  # HF reads the callable's signature for its extra arguments
    def sample(*args, **kwargs):
        if marks is None:
            _sync(device)
        entered["t"] = time.perf_counter()
        return original_sample(*args, **kwargs)

    patched.append((generation, "raincheck_sample", original_sample, False))
    generation.raincheck_sample = sample
    # the generate wrapper imported raincheck_sample by name: patch it there too
    from .. import integration

    patched.append((integration, "raincheck_sample", integration.raincheck_sample, False))
    integration.raincheck_sample = sample
    try:
        yield entered
    finally:
        for owner, name, original, by_instance in reversed(patched):
            if by_instance:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _event(device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def timeline(model, device, kw: dict) -> dict:
    """One unsynced `generate` call with its stages marked (`stage_timers` with marks): each stage's host and
    device start and end in ms after the call's start, up to the first token, and the device's idle time on
    the current stream before each stage (its device start minus the latest device end before it, where the
    device reached the stage no later than 0.05 ms after the host did; else 0: the device was still busy)."""
    marks = []
    clock = TokenClock(device)
    _sync(device)
    with stage_timers(model, device, defaultdict(list), marks) as entered:
        t0, e0 = time.perf_counter(), _event(device)
        model.generate(**kw, streamer=clock)
        _sync(device)
    first = clock.times[0]
    rows = []
    device_end = 0.0
    for label, host_in, host_out, ev_in, ev_out in sorted(marks, key=lambda m: m[1]):
        if host_in > first:
            break
        row = {"stage": label, "host_start_ms": (host_in - t0) * 1e3, "host_end_ms": (host_out - t0) * 1e3}
        if e0 is not None:
            start, end = e0.elapsed_time(ev_in), e0.elapsed_time(ev_out)
            idle = start - device_end if start - row["host_start_ms"] <= 0.05 else 0.0
            row.update(device_start_ms=start, device_end_ms=end, device_idle_before_ms=max(0.0, idle))
            device_end = max(device_end, end)
        rows.append(row)
    return {"hf_before_loop_ms": (entered["t"] - t0) * 1e3, "first_token_ms": (first - t0) * 1e3, "stages": rows}


def timeline_summary(name: str, line: dict, host: bool = True, prefix: str = "[timeline]") -> str:
    """One printed line of a `timeline`: each stage's host span (with ``host``), and where the device was timed (CUDA)
    its device span and, with ``host``, the device's idle time before it."""
    parts = []
    for r in line["stages"]:
        text = f"{r['stage']}"
        if host:
            text += f" host {r['host_start_ms']:.1f}-{r['host_end_ms']:.1f}"
        if "device_start_ms" in r:
            text += f" device {r['device_start_ms']:.1f}-{r['device_end_ms']:.1f}"
            if host:
                text += f" idle before {r['device_idle_before_ms']:.2f}"
        parts.append(text)
    return f"{prefix} {name}: first token {line['first_token_ms']:.1f} ms; " + "; ".join(parts)


def first_token_kwargs(inputs: dict, config=None) -> dict:
    """The `generate` arguments of a first-token timing: ``inputs``, one greedy token, and ``raincheck=config`` unless
    ``config`` is None (stock `generate`)."""
    return dict(inputs, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                **({} if config is None else {"raincheck": config}))


def first_tokens_side_by_side(model, device, variants: dict, reps: int, warm_up: int = 3) -> dict:
    """``{name: [ms, ...]}``: the first token's time (call start to the first token on the host, `TokenClock`) of each
    variant's `generate` call, ``warm_up`` calls each first, then ``reps`` rounds, the variants in turn in each (round
    robin, so that a drift of the machine spreads over all of them). ``variants``: name -> ``(kwargs, setup)``, where
    ``setup`` (or None) is called before each of that variant's calls (a benchmark's switch: its form of something the
    library has no setting for); a context manager it returns is entered around the call."""

    def first_token(name):
        kwargs, setup = variants[name]
        scope = setup() if setup is not None else None
        clock = TokenClock(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), (scope if scope is not None else contextlib.nullcontext()):
            model.generate(**kwargs, streamer=clock)
        _sync(device)
        return (clock.times[0] - t0) * 1e3

    for name in variants:
        for _ in range(warm_up):
            first_token(name)
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name in variants:
            times[name].append(first_token(name))
    return times


def t1_rows(times: dict, log=print) -> dict:
    """``{name: {"median", "reps", "x_full", "x_stock"}}`` of `first_tokens_side_by_side`'s ``times`` (ratios to the
    ``full`` and ``stock`` variants' medians, where they ran), each logged as a ``[t1]`` line."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = {}
    for name, t in times.items():
        row = rows[name] = {"median": medians[name], "reps": t}
        row.update({f"x_{base}": medians[name] / medians[base] for base in ("full", "stock") if base in medians})
        log(f"[t1] {name}: {row['median']:.2f} ms" + "".join(
            f", x {base} {row[f'x_{base}']:.3f}" for base in ("full", "stock") if f"x_{base}" in row), flush=True)
    return rows


def _kwargs(mode, tokens, suppress, settings):
    from ..configuration import RaincheckConfig

    return dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, suppress_tokens=suppress,
                return_dict_in_generate=True,
                raincheck=RaincheckConfig(mode=mode, retention=settings["retention"], chunk_size=settings["chunk_size"],
                                          decode_guard=settings["decode_guard"], fast_path=settings["fast_path"],
                                          selector=settings["selector"],
                                          compile_steps=settings.get("compile_steps")))


def _replay_seconds(graph, device, replays: int) -> float:
    """One replay of a captured graph, back to back with the others (one sync at the end)."""
    graph.replay()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    _sync(device)
    return (time.perf_counter() - t0) / replays


def profile_mode(model, device, inputs, mode, tokens, suppress, settings, replays: int, top: int) -> dict:
    kw = dict(inputs, **_kwargs(mode, tokens, suppress, settings))
    with torch.no_grad():
        for _ in range(2):  # warm-up: graph capture (the vision tower captures a grid on its second sighting)
            model.generate(**kw)
        _sync(device)

        # stages, synced
        record = defaultdict(list)
        clock = TokenClock(device)  # the latency bench's clock: a synced time per token after the prompt
        with stage_timers(model, device, record) as entered:
            t0 = time.perf_counter()
            out = model.generate(**kw, streamer=clock)
            _sync(device)
            total = time.perf_counter() - t0
        forwards = record.pop("forward")
        stages = {
            "hf_before_loop_s": entered["t"] - t0,
            "encode_turn_s": sum(record["encode_turn"]),
            "vision_tower_s": sum(record["vision_tower"]),
            "rope_index_s": sum(record["rope_index"]),
            "selection_s": sum(record["selection"]),
            "prefill_forward_s": forwards[0],
            "first_token_s": clock.times[0] - t0,
            "decode_forward_median_s": statistics.median(forwards[1:]) if len(forwards) > 1 else None,
            "decode_interval_median_s": statistics.median([b - a for a, b in zip(clock.times, clock.times[1:])])
            if len(clock.times) > 1 else None,
            "total_s": total,
        }
        stages["encode_turn_other_s"] = stages["encode_turn_s"] - stages["vision_tower_s"] - stages["rope_index_s"]
        per_forward = [int(r.numel()) for r in out.raincheck.restored_per_forward]
        chunk_forwards = [f for f, n in zip(forwards[1:], per_forward[1:]) if n]
        plain_forwards = [f for f, n in zip(forwards[1:], per_forward[1:]) if not n]
        stages["decode_forward_plain_median_s"] = statistics.median(plain_forwards) if plain_forwards else None
        stages["decode_forward_chunk_median_s"] = statistics.median(chunk_forwards) if chunk_forwards else None

        # the same stages unsynced: where the device waits for the host before the first token
        line = timeline(model, device, kw)

        # captured graphs alone
        from ..fast.vision_graphs import vision_graphs_for
        from ..models import get_adapter

        graphs = getattr(out.cache, "graphs", None)
        replay = {f"rows={key[0]},logits={key[1]},variant={key[2]},slots={key[3]}": _replay_seconds(graph, device,
                                                                                                    replays)
                  for key, (graph, _buffers) in sorted((getattr(graphs, "_captured", None) or {}).items(), key=repr)}
        for key, captured in vision_graphs_for(get_adapter(model))._captured.items():
            replay[f"vision_tower,grid={list(map(list, key[0]))}"] = _replay_seconds(captured.graph, device, replays)
        del out

        # torch.profiler over one unsynced call
        prof_out = {}
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.generate(**kw)
                _sync(device)
            averages = prof.key_averages()
            prof_out["by_self_cpu"] = averages.table(sort_by="self_cpu_time_total", row_limit=top)
            prof_out["by_self_device"] = averages.table(sort_by="self_cuda_time_total", row_limit=top)
            counts = {}
            for e in averages:
                if any(s in e.key for s in ("Synchronize", "cudaMemcpy", "item", "nonzero", "_local_scalar_dense",
                                            "cudaGraphLaunch")):
                    counts[e.key] = e.count
            prof_out["sync_like_calls"] = counts
    return {"stages": stages, "timeline": line, "replay_s": replay, "profiler": prof_out}


def run(model_name="qwen3_vl_8b", input_kind="image", modes=("full", "raincheck"), tokens=64, replays=50, top=40,
        retention=None, chunk_size=None, decode_guard=None, fast_path=None, selector=None, json_path=None, log=print,
        compile_steps: bool | None = None):
    from .latency import hardware_info

    from ..configuration import RaincheckConfig
    from ..integration import enable

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shipped = RaincheckConfig()  # what a user gets by default, for every setting not given
    selector = selector if selector is not None else shipped.selector
    retention = shipped.retention if retention is None else retention
    chunk_size = shipped.chunk_size if chunk_size is None else chunk_size
    decode_guard = shipped.decode_guard if decode_guard is None else decode_guard

    model, info = shapes.build_model(model_name, device)
    enable(model)
    processor = shapes.build_processor()
    spec = shapes.MODELS[model_name]
    first, prompt = shapes.build_prompt(processor, spec, input_kind)
    first.pop("mm_token_type_ids", None)
    inputs = {k: v.to(device) for k, v in first.items()}
    suppress = shapes.special_token_ids(processor)
    settings = dict(retention=retention, chunk_size=chunk_size, decode_guard=decode_guard, fast_path=fast_path,
                    selector=selector, compile_steps=compile_steps)
    result = {"benchmark": "profile", "hardware": hardware_info(device), "model": info, "prompt": prompt,
              "settings": dict(settings, tokens=tokens, replays=replays), "modes": {}}
    for mode in modes:
        result["modes"][mode] = profile_mode(model, device, inputs, mode, tokens, suppress, settings, replays, top)
        s = result["modes"][mode]["stages"]
        log(f"[profile] {model_name}/{input_kind} {mode}: " + ", ".join(
            f"{k[:-2]} {v * 1e3:.1f} ms" for k, v in s.items() if isinstance(v, float)))
        log(timeline_summary(mode, result["modes"][mode]["timeline"], prefix="[profile]   unsynced"))
        replays = result["modes"][mode]["replay_s"]
        log("[profile]   replay: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in replays.items()))
        _write(result, json_path)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_qwen3_vl", help=f"one of {sorted(shapes.MODELS)}")
    parser.add_argument("--input", default="image", choices=sorted(shapes.QUESTIONS))
    parser.add_argument("--modes", default="full,raincheck")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--top", type=int, default=40, help="operators per profiler table")
    parser.add_argument("--retention", type=float, default=None, help="default: the library's (RaincheckConfig())")
    parser.add_argument("--chunk-size", type=int, default=None, help="default: the library's")
    parser.add_argument("--decode-guard", type=int, default=None, help="default: the library's")
    parser.add_argument("--selector", default=None,
                        help="a registered selector name (default: the library's default, RaincheckConfig().selector)")
    parser.add_argument("--eager", action="store_true", help="fast_path=False (the eager engine)")
    parser.add_argument("--compile-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="RaincheckConfig.compile_steps=True (--no-compile-steps: False; default: the library's "
                        "default, compiled where the steps are captured as CUDA graphs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    return run(args.model, args.input, [m for m in args.modes.split(",") if m], args.tokens, args.replays, args.top,
               args.retention, args.chunk_size, args.decode_guard, False if args.eager else None, args.selector,
               args.json, compile_steps=args.compile_steps)
