"""One benchmark round under `torch.profiler`: where a turn's preparation waits (`bench serve-load --trace-round`).

A batching server prepares a conversation's first turn on the request's thread (`BatchLoop.prepare_ahead`: the
vision tower, the selection, the plan) while the loop's thread keeps the running answers' steps queued on the device.
Under load a preparation takes several times its time alone. The round here runs with the profiler's CPU and CUDA
activities on, each preparation marked as a range (`PREPARE`), and the trace is reduced to what the question needs:
per CUDA stream, its kernels (and copies) and how busy it was over the round, and within each preparation's range how
busy each stream was. A preparation whose own stream is idle most of its range waits for the host (the interpreter's
lock, its own Python); one whose stream is busy but slow shares the device with the loop's steps.

A preparation's range is its whole `prepare_ahead`, its wait for its place among the preparations included: under a
burst with ``max_preparing=1`` a first turn's range is mostly that wait (the loop's record, ``ahead`` and ``in
line``, tells the two apart). The profiler slows what it watches: the figures say where the time goes, not how much
there is without it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import statistics
import tempfile

import torch

PREPARE = "raincheck.prepare"  # the ranges preparations run in: ".first" (a conversation's first turn), ".follow_up"
KINDS = ("first", "follow_up")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def labelled_preparations(loop):
    """``loop.prepare_ahead`` (a `BatchLoop`'s; this instance only, as it was after) run inside a profiler range named
    `PREPARE` ``.first`` (a conversation's first turn: its vision tower, selection and plan too) or ``.follow_up``."""
    own = vars(loop).get("prepare_ahead")  # (an instance's own, if it had one: put back after)
    original = loop.prepare_ahead

    def prepare_ahead(job):
        kind = "first" if getattr(job.conversation, "cache", None) is None else "follow_up"
        with torch.profiler.record_function(f"{PREPARE}.{kind}"):
            return original(job)

    loop.prepare_ahead = prepare_ahead
    try:
        yield
    finally:
        if own is None:
            del loop.prepare_ahead  # (the class's method again)
        else:
            loop.prepare_ahead = own


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _busy_within(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """How much of ``[start, end]`` the merged intervals ``busy`` cover (their units)."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in busy)


def trace_summary(trace: dict, top: int = 8) -> dict:
    """A Chrome trace (`torch.profiler.profile.export_chrome_trace`'s JSON) reduced to: per stream, its device events
    (kernels, copies, memsets), busy milliseconds (their union) and share of the traced span, its ``top`` kernels by
    total time; per `PREPARE` range, its kind, wall milliseconds and each stream's busy milliseconds within it; and
    per kind the medians of those over its preparations."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    names = {f"{PREPARE}.{kind}": kind for kind in KINDS}
    prepares = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), names[e["name"]]) for e in events
                      if e.get("name") in names and e.get("cat") == "user_annotation")
    span = None
    if events:
        span = (min(float(e["ts"]) for e in events), max(float(e["ts"]) + float(e["dur"]) for e in events))
    streams: dict[str, dict] = {}
    busy: dict[str, list] = {}
    for e in device:
        stream = str((e.get("args") or {}).get("stream", "?"))
        entry = streams.setdefault(stream, {"events": 0, "kernels": {}})
        entry["events"] += 1
        name = str(e.get("name", "?"))[:80]
        entry["kernels"][name] = entry["kernels"].get(name, 0.0) + float(e["dur"]) / 1e3
        busy.setdefault(stream, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    busy = {s: _union(v) for s, v in busy.items()}
    for stream, entry in streams.items():
        entry["busy_ms"] = sum(b - a for a, b in busy[stream]) / 1e3
        entry["busy_share"] = (entry["busy_ms"] * 1e3 / (span[1] - span[0])) if span and span[1] > span[0] else None
        entry["top_kernels_ms"] = sorted(entry.pop("kernels").items(), key=lambda kv: -kv[1])[:top]
    windows = [{"kind": kind, "wall_ms": (end - start) / 1e3,
                "busy_ms": {s: _busy_within(b, start, end) / 1e3 for s, b in busy.items()}}
               for start, end, kind in prepares]
    medians = {}
    for kind in KINDS:
        mine = [w for w in windows if w["kind"] == kind]
        if mine:
            medians[kind] = {"preparations": len(mine), "wall_ms": statistics.median(w["wall_ms"] for w in mine),
                             "busy_ms": {s: statistics.median(w["busy_ms"][s] for w in mine) for s in busy}}
    return {"span_ms": None if span is None else (span[1] - span[0]) / 1e3, "streams": streams,
            "preparations": len(windows), "preparation_medians": medians, "preparation_windows": windows}


def traced_round(loop, play, trace_path: str | None = None, top: int = 20) -> dict:
    """``play()`` (a round: ``bench serve-load``'s ``round_of``, returning ``(dialogues, errors, ...)``) under
    `torch.profiler` (CPU, and CUDA where there is one), ``loop``'s preparations marked (`labelled_preparations`).
    Returns `trace_summary` of the trace with the round's dialogues and errors, and the ``top`` operators by device
    time (by CPU time off CUDA) as the profiler's text table; ``trace_path``: the trace kept there, gzipped."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # every thread's operators (the loop's, the preparing ones'), not only this one's
        from torch.profiler import _ExperimentalConfig

        config, all_threads = _ExperimentalConfig(profile_all_threads=True), True
    except (ImportError, TypeError):  # (a torch without it: this thread's operators; the device's events all the same)
        config, all_threads = None, False
    with labelled_preparations(loop), profile(activities=activities, experimental_config=config) as prof:
        played = play()
    if cuda:
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        if trace_path:
            with open(path, "rb") as f, gzip.open(trace_path, "wb") as out:
                out.write(f.read())
    summary = trace_summary(trace)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=top)
    except (AttributeError, KeyError, ValueError):  # (an older profiler's name for it)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    summary["operators"] = table
    summary["all_threads"] = all_threads
    summary["played"] = played
    return summary


def trace_lines(summary: dict) -> list[str]:
    """The log's lines of a `traced_round`: the streams, then the preparations' medians."""
    out = [f"traced span {summary['span_ms'] or 0:.0f} ms; {summary['preparations']} preparations"]
    for stream, entry in sorted(summary["streams"].items(), key=lambda kv: -kv[1]["busy_ms"]):
        share = entry["busy_share"]
        out.append(f"  stream {stream}: {entry['events']} device events, busy {entry['busy_ms']:.1f} ms"
                   + ("" if share is None else f" ({share:.0%} of the span)"))
        out += [f"    {ms:8.1f} ms  {name}" for name, ms in entry["top_kernels_ms"][:5]]
    for kind, medians in summary["preparation_medians"].items():
        busy = ", ".join(f"stream {s} {ms:.1f}" for s, ms in sorted(medians["busy_ms"].items(), key=lambda kv: -kv[1]))
        out.append(f"  {kind.replace('_', '-')} preparations ({medians['preparations']}, medians): "
                   f"{medians['wall_ms']:.1f} ms wall; busy within it (ms): {busy or 'none'}")
    return out
