"""The server under concurrent load, measured from the official `openai` client.

    python -m raincheck_hf.bench serve-load --model qwen3_vl_8b --clients 1,4,8,16,32,64 \\
        --answer-tokens 128 --follow-up-tokens 64 --json serve_load.json --plot serve_load.png

One model (random weights at the real shape of `bench/shapes.py`, or a bundled glyph model: ``bundled_qwen3_vl``,
``bundled_qwen3_5``), one server in the process (uvicorn on 127.0.0.1, the `raincheck_hf.serve` app). For each
mode (``raincheck``, ``full``) and each client count N, N clients start together, each in a process of its own
(started once, before any timing: real clients are remote, and the clients' SSE parsing would otherwise compete for
the server process's GIL; ``--in-process-clients``: threads of the server's process instead) with its own
`openai.OpenAI` client, and each runs a three-turn image dialogue, streamed: its own photo-like JPEG (drawn
from its own seed and encoded before any timing) with a question, then two text follow-ups resending the dialogue
(``--think-s`` after each answer). The server's held conversations are dropped between client counts.

Every answer has exactly ``--answer-tokens`` tokens (follow-ups ``--follow-up-tokens``): greedy, ``min_tokens``
and OpenAI's ``logit_bias`` of +100 on words whose text re-tokenizes to the same ids (as ``bench serve`` does), so
the resent history matches what the server generated and the follow-ups continue their held conversations. (The
bundled glyph models' tokenizer has no such words: their trained answers go unbiased, and ``reused_follow_ups``
says how many follow-ups found their conversation.)

Per (mode, N), over every turn of every client: aggregate output tokens/s (all completion tokens over the time
from the first request to the last answer's end), TTFT p50 / p95 (from just before the request to the first SSE
chunk with text), TPOT p50 / p95 (per answer, (last chunk - first chunk) / (chunks - 1)); also the first turns'
TTFT p50 (the image's prefill) and how many follow-ups reused their conversation. At one client, the library
(`raincheck_hf.Conversation` in the process, the decoded JPEG, the same settings and bias) runs the same dialogue:
the server's overhead is its one-client turn-1 TTFT and TPOT over the library's, medians over
``--overhead-dialogues`` dialogues each side (default 3: the one-client rounds count, and more one-client dialogues
are played after them; one dialogue each was too noisy to tell a 10% overhead). Unless ``--no-warmup``, the library
runs the dialogue once untimed first, as each mode's server rounds follow a one-client warm-up round.

``--max-running`` (default: the largest client count, so no client waits in the server's queue) and
``--max-queue`` set the server's admission control; ``--batching`` runs the server's continuous-batching loop
(one forward for every running turn, `serve --batching`) instead of a thread per turn; each row then has ``loop``,
the loop's step figures over its round (`BatchLoop.step_stats`: steps by how they ran, replayed / captured / eager,
with their rows and the mean ms from a launch to the next, of it the host's launch, its choosing and preparing, its
wait for the device, and the host gap after the read with the time new turns took to join; first turns' and
follow-ups' ways to their first token: the wait for the loop, the join, the steps until the token by kind; the
round's last steps and turns one by one), and a line per round sums them up. The JSON has the hardware, the
settings and one row per (mode, N) with ``clients``; ``--plot`` draws tokens/s and TTFT against clients (matplotlib).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import gc
import io
import os
import statistics
import sys
import threading
import time

import torch

from ..configuration import RaincheckConfig, is_limit
from . import shapes
from .load_client import ClientPool, thread_round
from .latency import _write, hardware_info
from .serve import (QUESTION, add_setting_arguments, claim_device, library_conversation, raincheck_settings,
                    round_trip_tokens, setting_values)

BUNDLED = {"bundled_qwen3_vl": "qwen3_vl", "bundled_qwen3_5": "qwen3_5"}
BUNDLED_IMAGE_SIZE = (320, 256)
DEFAULT_CLIENTS = (1, 4, 8, 16, 32, 64)
LOOP_RECENT_STEPS = 32  # a round's last steps, one by one, in its row's ``loop`` (``--batching``)


def photo_jpeg(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like JPEG: smooth random colour fields at a few scales, soft-edged blobs, fine sensor noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = np.zeros((height, width, 3), np.float32)
    for cells, weight in ((3, 0.5), (9, 0.25), (33, 0.12)):  # low to mid frequencies, bicubic-upsampled
        field = rng.uniform(0, 255, (cells, max(2, cells * width // height), 3)).astype(np.uint8)
        up = np.asarray(Image.fromarray(field).resize((width, height), Image.BICUBIC), np.float32)
        image += weight * up
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    for _ in range(12):  # objects: soft ellipses of their own colour
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.03, 0.2) * height, rng.uniform(0.03, 0.2) * width
        mask = np.clip(1.5 - ((yy - cy) / ry) ** 2 - ((xx - cx) / rx) ** 2, 0, 1)[..., None]
        image = image * (1 - 0.8 * mask) + 0.8 * mask * rng.uniform(0, 255, 3).astype(np.float32)
    image += rng.normal(0, 4, image.shape).astype(np.float32)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics; None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


class MemoryWatch:
    """Memory during one round, sampled every ``every`` seconds on a thread of its own until `stop`: the held
    conversations' caches (the server's `ConversationStore`: their bytes at most, and how many were held then) and,
    on CUDA, the device memory PyTorch's allocator had allocated and reserved at most, the largest free-but-split
    bytes (reserved memory in blocks too small for a new allocation: fragmentation), its retries after a failed
    allocation and its failures, and the device's least free memory. `stop` returns a JSON-ready dict."""

    def __init__(self, store, every: float = 0.1):
        self.store, self.every = store, every
        self.cuda = torch.cuda.is_available()
        self._evictions = store.evictions
        self.most_held, self.conversations_then, self.least_free = 0, 0, None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._stats = torch.cuda.memory_stats()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="serve-load memory", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self._once()
        while not self._done.wait(self.every):
            self._once()

    def _once(self) -> None:
        held = self.store.snapshot()
        if held["cache_bytes"] > self.most_held:
            self.most_held, self.conversations_then = held["cache_bytes"], held["conversations"]
        if self.cuda:
            free = torch.cuda.mem_get_info()[0]
            self.least_free = free if self.least_free is None else min(self.least_free, free)

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        self._once()  # (the round's end too, however short it was)
        out = {"held_cache_bytes_max": self.most_held, "held_conversations_then": self.conversations_then,
               "evictions": self.store.evictions - self._evictions}
        if self.cuda:
            stats = torch.cuda.memory_stats()
            out.update({
                "allocated_bytes_max": stats.get("allocated_bytes.all.peak", 0),
                "reserved_bytes_max": stats.get("reserved_bytes.all.peak", 0),
                "inactive_split_bytes_max": stats.get("inactive_split_bytes.all.peak", 0),
                "alloc_retries": stats.get("num_alloc_retries", 0) - self._stats.get("num_alloc_retries", 0),
                "ooms": stats.get("num_ooms", 0) - self._stats.get("num_ooms", 0),
                "device_free_bytes_min": self.least_free,
                "device_total_bytes": torch.cuda.mem_get_info()[1],
            })
        return out


def memory_summary(memory: dict) -> str:
    """One line of a round's `MemoryWatch` figures (GiB)."""
    gib = 2 ** 30
    line = (f"held caches at most {memory['held_cache_bytes_max'] / gib:.2f} GiB "
            f"({memory['held_conversations_then']} conversations), {memory['evictions']} evicted")
    if "allocated_bytes_max" in memory:
        line += (f"; allocated at most {memory['allocated_bytes_max'] / gib:.2f} GiB, reserved "
                 f"{memory['reserved_bytes_max'] / gib:.2f}, split free {memory['inactive_split_bytes_max'] / gib:.2f},"
                 f" device free at least {(memory['device_free_bytes_min'] or 0) / gib:.2f} of "
                 f"{memory['device_total_bytes'] / gib:.2f}; allocator retries {memory['alloc_retries']}, "
                 f"out of memory {memory['ooms']}")
    return line


class GcPauses:
    """The garbage collector's collections while it is entered (`gc.callbacks`): per generation their count, and
    the full collections' (generation 2) pauses, which stop every thread of the process (the batching loop's next
    step included). `reset` starts a new count; `summary` is a JSON-ready dict."""

    def __init__(self):
        self._started = None
        self.reset()

    def reset(self) -> None:
        self.counts = [0, 0, 0]
        self.full_ms: list[float] = []
        self.all_ms = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        generation = info["generation"]
        self.counts[generation] += 1
        self.all_ms += ms
        if generation == 2:
            self.full_ms.append(ms)

    def summary(self) -> dict:
        return {"collections": list(self.counts), "full_pause_ms_max": round(max(self.full_ms, default=0.0), 2),
                "full_pause_ms_total": round(sum(self.full_ms), 2), "pause_ms_total": round(self.all_ms, 2)}

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        return False


def load_row(mode: str, clients: int, dialogues: list[list[dict]], errors: list[str]) -> dict:
    """The figures of one (mode, client count) from its clients' records."""
    turns = [t for d in dialogues for t in d]
    wall = (max(t["end"] for t in turns) - min(t["start"] for t in turns)) if turns else None
    tokens = sum(t["completion_tokens"] for t in turns)
    ttft, tpot = [t["ttft_s"] for t in turns], [t["tpot_s"] for t in turns]
    first = [d[0]["ttft_s"] for d in dialogues if d]
    return {
        "mode": mode, "clients": clients, "errors": len(errors), "error_messages": errors[:5],
        "turns": len(turns), "completion_tokens": tokens, "wall_s": wall,
        "output_tokens_per_s": tokens / wall if wall else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p95_s": percentile(tpot, 0.95),
        "turn1_ttft_p50_s": percentile(first, 0.5),
        "server_t1_p50_s": percentile([t["server_t1_s"] for t in turns], 0.5),
        "reused_follow_ups": sum(bool(t["reused"]) for d in dialogues for t in d[1:]),
    }


def profiled_round(loop, play, top: int = 30) -> dict:
    """``play()`` (a round: `run`'s ``round_of``) with ``loop``'s thread (a `BatchLoop`) under `cProfile`, enabled and
    disabled there between steps (`BatchLoop.call`); its ``top`` functions by own time and by cumulative time, as
    ``(function, calls, own s, cumulative s)``, with the round's tokens/s."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    loop.call(profiler.enable)
    try:
        dialogues, errors = play()[:2]
    finally:
        loop.call(profiler.disable)
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = filename.split("site-packages/")[-1].split("raincheck_hf/")[-1]
        rows.append((f"{where}:{line}({name})", int(calls), float(own), float(cumulative)))
    row = load_row("profiled", 0, dialogues, errors)
    return {"output_tokens_per_s": row["output_tokens_per_s"], "errors": len(errors),
            "calls": sum(r[1] for r in rows), "seconds": sum(r[2] for r in rows),
            "by_own_time": sorted(rows, key=lambda r: -r[2])[:top],
            "by_cumulative_time": sorted(rows, key=lambda r: -r[3])[:top]}


def profile_lines(profile: dict, top: int = 20) -> list[str]:
    """The log's lines of a `profiled_round`: its functions by own time, then by cumulative time."""
    out = []
    for label, key in (("own", "by_own_time"), ("cumulative", "by_cumulative_time")):
        out.append(f"by {label} time (calls, own s, cumulative s):")
        out += [f"  {name}: {calls}, {own:.3f}, {cumulative:.3f}" for name, calls, own, cumulative in profile[key][:top]]
    return out


def loop_summary(steps: dict) -> str:
    """One line of a round's batching-loop figures (`BatchLoop.step_stats`): steps per kind with their mean ms
    (launch to next launch; of it the host's launch and its choosing and preparing, each with the loop thread's CPU
    time in it, the wait for the device and the host gap after the read) and mean sequences, the time new turns took
    to join, the total host gap and device wait."""
    kinds = ", ".join(f"{kind} {k['steps']} ({_ms_of(k['step_ms'])} ms: launch {_ms_of(k['launch_ms'])} "
                      f"(cpu {_ms_of(k['launch_cpu_ms'])}), choose "
                      f"{_ms_of(k['choose_ms'])} (cpu {_ms_of(k.get('choose_cpu_ms'))}; prepare "
                      f"{_ms_of(k.get('prepare_ms'))}, cpu {_ms_of(k.get('prepare_cpu_ms'))}), wait {_ms_of(k['wait_ms'])}, "
                      f"gap {_ms_of(k['gap_ms'])}; "
                      f"{k['sequences']:.1f} seqs)"
                      for kind, k in sorted(steps["kinds"].items(), key=lambda item: -item[1]["steps"]))
    return (f"{steps['steps']} steps ({steps.get('steps_ahead', 0)} launched ahead): {kinds or 'none'}; "
            f"joins {steps['joins']} ({steps.get('joins_in_flight', 0)} while a step ran; follow-ups' sequences "
            f"{steps.get('follow_ups_made_ahead', 0)} made ahead, {steps.get('follow_ups_made_again', 0)} made again) in "
            f"{steps['join_total_s']:.2f} s (cpu {steps.get('join_cpu_s', 0.0):.2f} s), "
            f"host gap {steps['seconds']['gap']:.2f} s, device wait {steps['seconds']['wait']:.2f} s"
            + "".join(f"; {label}: {turn_summary(steps['turns'][key])}"
                      for key, label in (("first", "first turns"), ("follow_up", "follow-ups"))
                      if steps.get("turns", {}).get(key, {}).get("turns")))


def turn_summary(turns: dict) -> str:
    """One round's first turns' or follow-ups' ways to their first token in the loop (`StepLog.snapshot`'s
    ``turns``): medians of the preparation on the asking thread, the wait for the loop, the join, the steps until the
    token and those steps' kinds."""
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(turns["kinds"].items(), key=lambda item: -item[1]))
    return (f"{turns['turns']} turns, {turns['prompt_rows_p50']:.0f} rows p50, ahead {_ms_of(turns['ahead_ms_p50'])} "
            f"(in line {_ms_of(turns.get('ahead_wait_ms_p50'))}, cpu {_ms_of(turns.get('ahead_cpu_ms_p50'))}) + "
            f"wait {_ms_of(turns['queue_ms_p50'])} + "
            f"join {_ms_of(turns['join_ms_p50'])} + {turns['steps_p50']:.0f} steps (most {turns['steps_max']}) "
            f"{_ms_of(turns['first_ms_p50'])} ms p50 [{kinds}]")


def _ms_of(ms):
    return "–" if ms is None else f"{ms:.1f}"


def _ms(x):
    return "–" if x is None else f"{x * 1e3:.1f}"


MEDIAN_KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "turn1_ttft_p50_s")


def round_medians(rows: list[dict]) -> list[dict]:
    """Per series and client count (in the rows' first order), the median over its rounds of each of `MEDIAN_KEYS`
    (rounds without a figure left out), with ``rounds`` (how many) and ``errors`` (over all of them)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("series", row["mode"]), row["clients"]), []).append(row)
    out = []
    for (series, clients), group in groups.items():
        med = {"series": series, "mode": group[0]["mode"], "clients": clients, "rounds": len(group),
               "errors": sum(r["errors"] for r in group)}
        for key in MEDIAN_KEYS:
            values = [r[key] for r in group if r.get(key) is not None]
            med[key] = statistics.median(values) if values else None
        out.append(med)
    return out


def print_table(result: dict, log=print) -> None:
    medians = result.get("medians")
    for title, rows in (("", result["rows"]), ("medians over the rounds", medians or [])):
        if not rows:
            continue
        if title:
            log(title)
        log("| mode | clients | tokens/s | TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) | turn-1 TTFT p50 (ms) | errors |")
        log("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            rate = "–" if r["output_tokens_per_s"] is None else f"{r['output_tokens_per_s']:.1f}"
            log(f"| {r.get('series', r['mode'])} | {r['clients']} | {rate} | {_ms(r['ttft_p50_s'])} / "
                f"{_ms(r['ttft_p95_s'])} | {_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p95_s'])} | "
                f"{_ms(r['turn1_ttft_p50_s'])} | {r['errors']} |")
    for mode, o in result.get("overhead", {}).items():
        where = ""
        if o.get("client_http_s") is not None and o.get("in_server_s") is not None:
            decode = result.get("jpeg_decode_s")
            floor = (f" ({_ms(o['client_floor_s'])} ms of it against a server answering at once)"
                     if o.get("client_floor_s") is not None else "")
            where = (f" (of the difference: the client's request and the response {_ms(o['client_http_s'])} ms"
                     f"{floor}, in the server {_ms(o['in_server_s'])} ms"
                     + (f", the JPEG's decoding alone {_ms(decode)} ms" if decode is not None else "") + ")")
        rounds = o.get("rounds")
        log(f"one client, {mode}: server T1 {_ms(o['server_ttft_s'])} ms vs library {_ms(o['library_ttft_s'])} ms, "
            f"TPOT {_ms(o['server_tpot_s'])} vs {_ms(o['library_tpot_s'])} ms"
            + (f", medians of {rounds['server']} / {rounds['library']} dialogues" if rounds else "") + where)


def plot(result: dict, path: str) -> None:
    """Aggregate tokens/s and TTFT (p50, p95 dashed) against clients, one line per mode."""
    from .plot import _pyplot

    plt = _pyplot()
    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"raincheck": "#d62728", "full": "#1f77b4"}
    drawn = result.get("medians") or result["rows"]  # (several rounds: their medians)
    for mode in dict.fromkeys(r.get("series", r["mode"]) for r in drawn):
        rows = [r for r in drawn if r.get("series", r["mode"]) == mode and r["output_tokens_per_s"] is not None]
        x = [r["clients"] for r in rows]
        colour = colours.get(mode)  # (a series beside others of its mode: the plot's own colours)
        rate.plot(x, [r["output_tokens_per_s"] for r in rows], "o-", color=colour, label=mode)
        ttft.plot(x, [r["ttft_p50_s"] * 1e3 for r in rows], "o-", color=colour, label=f"{mode} p50")
        ttft.plot(x, [r["ttft_p95_s"] * 1e3 for r in rows], "x--", color=colour, label=f"{mode} p95")
    for ax, label in ((rate, "aggregate output tokens/s"), (ttft, "time to first token (ms)")):
        ax.set_xscale("log", base=2)
        counts = sorted({r["clients"] for r in result["rows"]})
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    s = result["settings"]
    hardware = result["hardware"].get("gpu") or result["hardware"].get("cpu") or ""
    fig.suptitle(f"serve-load: {s['model']}, {s['answer_tokens']}+{s['follow_up_tokens']}x2 tokens per dialogue "
                 f"({hardware})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _build(model_name: str, device: torch.device):
    """``(model, processor, info, image size)``."""
    if model_name in BUNDLED:
        from ..quality import load_bundled

        begin = time.perf_counter()
        model, processor = load_bundled(BUNDLED[model_name], device=str(device))
        info = {"name": model_name, "class": type(model).__name__, "weights": "the bundled glyph model (trained)",
                "parameters": sum(p.numel() for p in model.parameters()), "device": str(device),
                "build_s": time.perf_counter() - begin}
        return model, processor, info, BUNDLED_IMAGE_SIZE
    model, info = shapes.build_model(model_name, device)
    return model, shapes.build_processor(), info, shapes.MODELS[model_name].image_size


def run(model_name: str = "tiny_qwen3_vl", clients=DEFAULT_CLIENTS, modes=("raincheck", "full"),
        answer_tokens: int = 64, follow_up_tokens: int = 32, think_s: float = 0.0, warmup: bool = True,
        retention: float = 0.3, chunk_size: int = 31, decode_guard: int = RaincheckConfig.decode_guard,
        selector: str | None = None,
        max_running: int | None = None, max_queue: int | None = None, library: bool = True, device=None,
        threads: int | None = None, json_path: str | None = None, plot_path: str | None = None,
        command: str | None = None, log=print, batching: bool = False, client_processes: bool = True,
        switch_interval=None, freeze_heap: bool = True, launch_ahead: str = "on",
        prompt_forwards=(None,), preparing=None, profile_loop: bool = False, prepare_stream: str | None = None,
        ride_rows=(None,), rounds: int = 1, trace_round: bool = False, trace_path: str | None = None,
        chunk_rows=(None,), split_rows=("default",), join_in_flight: str = "off",
        follow_ups_ahead: str = "off", warm_up_tokens: int | None = None, overhead_dialogues: int = 3) -> dict:
    """Run the benchmark (the server in this process; the clients in processes of their own, or with
    ``client_processes=False`` in threads of this one); returns (and writes to ``json_path``) the result dict.
    ``switch_interval``: the interpreter's thread switch interval in seconds (`sys.setswitchinterval`; None: as it
    is, 5 ms by default; a tuple: several compared side by side, each round under its own), put back after: how long
    a thread that wants the interpreter's lock may wait for one that holds it, which the server's threads (the
    batching loop, request threads, the event loop that streams) contend for. ``freeze_heap``: after the warm-up,
    `startup.freeze_heap` (as ``serve`` does at start); each
    row's ``gc`` has the garbage collector's pauses during its round either way (`GcPauses`). ``launch_ahead`` /
    ``prompt_forwards`` / ``preparing`` / ``prepare_stream``: with batching, the loop's `BatchLoop.launch_ahead` and
    ``prepare_stream`` ("on", "off", "high", several comma-separated, or "both"), ``max_prompt_forwards`` and ``max_preparing`` (each a tuple of values:
    None: the loop's default for ``max_prompt_forwards``, no limit for ``max_preparing``; ``preparing`` and
    ``prepare_stream`` left None: the server's defaults with batching, 1 and "on"); ``ride_rows``: the loop's
    ``ride_max_rows`` (a tuple, None its default); ``chunk_rows``: with batching, the server config's
    `RaincheckConfig.batch_chunk_rows` (a tuple: None, the default, no cap; an int, a cap shared by the answers
    carrying chunks), set between rounds; ``split_rows``: with batching, the loop's ``split_rows`` (a tuple:
    ``"default"``, `batch_engine.SPLIT_ROWS`; None, never split a step by width; an int); ``join_in_flight``: with
    batching, the loop's `BatchLoop.join_in_flight` ("on", "off" or "both"); ``follow_ups_ahead``: with batching, the
    loop's `BatchLoop.follow_ups_ahead` (the same); ``warm_up_tokens``: with batching and the warm-up, the rows of
    each of the batched engine's places (``serve --warm-up-tokens``; None: its default, `warmup.DEFAULT_MAX_TOKENS`):
    the places' key / value memory is what the held caches' automatic budget cannot have;
    every combination gets its rounds, a client count's side by side. ``rounds``: each client count's variants that many
    times, in turn and in reverse order every other time (A B, B A, ...: a round's place in the order, its caches'
    warmth say, falls on each variant alike), each round a row (``round``), and with more than one the medians over
    the rounds (``medians``, what the plot draws). ``profile_loop``: with batching, one more
    round per mode at the most clients with the loop's thread under `cProfile` (its functions by own and by
    cumulative time in ``loop_profile``, not among the rows: the profiler slows what it watches). ``trace_round``: with
    batching, one more round per mode at the most clients under `torch.profiler` (`trace_round.traced_round`: per
    CUDA stream how busy it was, and within each turn's preparation; ``trace``, not among the rows), its trace kept
    gzipped at ``trace_path`` (the mode's name put before the extension) when given. ``overhead_dialogues``: with the
    library reference and one client among ``clients``, the one-client dialogues each side whose first turns' medians
    give the server's overhead (the one-client rounds count; more are played after a mode's rounds when short)."""
    from ..integration import enable
    from ..serve import ServeSettings, create_app, running

    try:
        import openai  # noqa: F401 (the clients)
    except ImportError:
        raise ValueError("serve-load drives the server with the official openai client, which is not installed: "
                         "pip install openai") from None
    clients = tuple(clients)
    if not clients or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in clients):
        raise ValueError(f"clients must be integers >= 1, got {list(clients)}")
    if answer_tokens < 2 or follow_up_tokens < 2 or think_s < 0:
        raise ValueError(f"answer and follow-up tokens must be >= 2 (a TPOT needs two tokens) and think_s >= 0; got "
                         f"{answer_tokens}, {follow_up_tokens}, {think_s}.")
    if model_name not in shapes.MODELS and model_name not in BUNDLED:
        raise ValueError(f"unknown model {model_name!r}; choose from {sorted(shapes.MODELS) + sorted(BUNDLED)}.")
    if rounds is None or not is_limit(rounds):
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if overhead_dialogues is None or not is_limit(overhead_dialogues):
        raise ValueError(f"overhead_dialogues must be an integer >= 1, got {overhead_dialogues!r}")
    intervals = tuple(switch_interval) if isinstance(switch_interval, (tuple, list)) else (switch_interval,)
    if not intervals or len(set(intervals)) < len(intervals) or any(
            v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1)
            for v in intervals):
        raise ValueError(f"switch_interval must be a number of seconds in (0, 1], None, or a tuple of distinct such "
                         f"values, got {switch_interval!r}.")
    if warm_up_tokens is not None and (isinstance(warm_up_tokens, bool) or not isinstance(warm_up_tokens, int)
                                       or warm_up_tokens <= answer_tokens):
        raise ValueError(f"warm_up_tokens (--warm-up-tokens) must be an integer above --answer-tokens "
                         f"({answer_tokens}): rows of each of the batched engine's places; got {warm_up_tokens!r}")
    settings, configs = raincheck_settings(retention, chunk_size, decode_guard, selector, modes)
    running_places = max_running if max_running is not None else max(clients)
    queue_places = max_queue if max_queue is not None else max(clients)
    ServeSettings(max_running=running_places, max_queue=queue_places, batching=batching)  # checked before compute
    aheads = _switch_values(launch_ahead, "launch_ahead", "on", (True, False), batching)
    in_flight = _switch_values(join_in_flight, "join_in_flight", "off", (True, False), batching)
    early = _switch_values(follow_ups_ahead, "follow_ups_ahead", "off", (True, False), batching)
    if preparing is None:  # (the server's own settings unless told otherwise)
        preparing = (ServeSettings.max_preparing,) if batching else (None,)
    if prepare_stream is None:
        prepare_stream = "on" if batching else "off"
    from ..batch_engine import check_prompt_forwards, check_ride_rows
    from ..batch_loop import ArrivalGate

    prompt_forwards = _loop_values(prompt_forwards, "prompt_forwards", check_prompt_forwards, batching)
    preparing = _loop_values(preparing, "preparing", ArrivalGate._check, batching)
    ride_rows = _loop_values(ride_rows, "ride_rows", check_ride_rows, batching)
    chunk_rows = _loop_values(chunk_rows, "chunk_rows", _check_chunk_rows, batching)
    from ..batch_engine import SPLIT_ROWS, check_split_rows

    split_rows = tuple(SPLIT_ROWS if v == "default" else v for v in split_rows)
    for value in split_rows:
        check_split_rows(value, "split_rows")
    if not split_rows or len(set(split_rows)) < len(split_rows) or (not batching and split_rows != (SPLIT_ROWS,)):
        raise ValueError(f"split_rows must be one or more distinct of 'default' / None / an int >= 1 (with batching), "
                         f"got {split_rows!r}" + ("" if batching else " without batching"))
    streams = _stream_values(prepare_stream, batching)
    variants = [(a, f, p, st, r, sw, cr, sr, j, e) for a in aheads for f in prompt_forwards for p in preparing
                for st in streams for r in ride_rows
                for sw in (sys.getswitchinterval() if v is None else v for v in intervals) for cr in chunk_rows
                for sr in split_rows for j in in_flight for e in early]
    if profile_loop and not batching:
        raise ValueError("profile_loop profiles the batching loop's thread: it needs batching")
    if (trace_round or trace_path) and not batching:
        raise ValueError("trace_round traces the batching loop's preparations: it needs batching")
    if trace_path and not trace_round:
        raise ValueError("trace_path keeps the trace of trace_round's round: set trace_round too")
    device, previous_threads = claim_device(device, threads)
    previous_interval = sys.getswitchinterval()
    froze = False  # (`freeze_heap` done: undone when the run ends)
    sys.setswitchinterval(variants[0][5])
    started = time.perf_counter()
    try:
        model, processor, model_info, (width, height) = _build(model_name, device)
        enable(model)
        try:
            bias = round_trip_tokens(processor.tokenizer)
        except ValueError:
            if model_name not in BUNDLED:
                raise
            bias = []  # a trained model's answers re-tokenize as generated (mostly: `reused_follow_ups` says)
        questions = [QUESTION, *shapes.FOLLOW_UPS[:2]]
        lengths = [answer_tokens, follow_up_tokens, follow_up_tokens]
        jpegs = [photo_jpeg(width, height, seed=c) for c in range(max(clients))]  # before any timing
        urls = ["data:image/jpeg;base64," + base64.b64encode(j).decode() for j in jpegs]
        result = {
            "benchmark": "serve-load",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command or " ".join(["python -m raincheck_hf.bench serve-load"] + sys.argv[2:]),
            "hardware": hardware_info(device),
            "settings": dict(settings, model=model_name, clients=list(clients), modes=list(modes),
                             answer_tokens=answer_tokens, follow_up_tokens=follow_up_tokens, think_s=think_s,
                             warmup=warmup, max_running=running_places, max_queue=queue_places, batching=batching,
                             client_processes=client_processes,
                             switch_interval_s=list(dict.fromkeys(v[5] for v in variants)),
                             freeze_heap=freeze_heap, launch_ahead=launch_ahead, join_in_flight=join_in_flight,
                             follow_ups_ahead=follow_ups_ahead,
                             prompt_forwards=list(prompt_forwards), preparing=list(preparing),
                             prepare_stream=prepare_stream, ride_rows=list(ride_rows), rounds=rounds,
                             overhead_dialogues=overhead_dialogues, batch_chunk_rows=list(chunk_rows),
                             split_rows=list(split_rows),
                             image_size=[width, height], jpeg_bytes_mean=sum(map(len, jpegs)) / len(jpegs),
                             biased_words=len(bias), client="openai " + _version("openai")),
            "model_info": model_info, "rows": [], "library": {}, "overhead": {},
        }
        restoring = None  # (`ServeSettings.restoring_places`)
        if warmup and batching:  # as `serve --batching` does at start (before its port opens): no capture mid-round
            from ..batch_loop import restoring_places_that_fit
            from ..warmup import DEFAULT_MAX_TOKENS, warm_up

            # (as `serve` leaves --restoring-places unset: the places for held conversations restoring beside the
            # answers that the GPU holds)
            place_rows = DEFAULT_MAX_TOKENS if warm_up_tokens is None else warm_up_tokens
            restoring = restoring_places_that_fit(model, running_places, place_rows)
            result["settings"]["restoring_places"] = restoring
            result["settings"]["warm_up_tokens"] = place_rows
            result["batched_warm_up"] = {}
            for mode in modes:
                # (with the clients' picture size, as `serve --warm-up-image-sizes` does: its tower graph captured
                # now, not by a preparation in the first round)
                summary = warm_up(model, processor, configs[mode], max_tokens=place_rows,
                                  max_new_tokens=answer_tokens, batch=running_places + restoring,
                                  conversations=0, image_sizes=[(height, width)],
                                  cache_dir=False, progress=False)
                result["batched_warm_up"][mode] = dict(captured=summary.batched, seconds=summary.batched_seconds)
                log(f"[serve-load] batched warm-up ({mode}): {summary.batched} batched steps captured in "
                    f"{summary.batched_seconds:.1f} s")
        name = "bench"
        from ..startup import auto_cache_budget

        # the held conversations' budget `serve` takes by default (--max-cache-gb auto), after the warm-up: the
        # rounds' conversations stay held, and unbounded they filled an 80 GB GPU by 32 clients
        budget = auto_cache_budget(device)
        result["settings"]["max_cache_bytes"] = budget
        app = create_app(model, processor, ServeSettings(model_name=name, max_running=running_places,
                                                         max_queue=queue_places, batching=batching,
                                                         restoring_places=restoring, max_cache_bytes=budget))
        server = app.state.server
        if freeze_heap:
            from ..startup import freeze_heap as freeze

            result["frozen_objects"] = freeze()
            froze = True
        pauses = GcPauses()
        with contextlib.ExitStack() as stack:
            stack.enter_context(pauses)
            base = stack.enter_context(running(app))
            pool = stack.enter_context(ClientPool(max(clients))) if client_processes else None

            loop = server.scheduler  # (``batching``: the server's `BatchLoop`, in this process)

            def round_of(mode: str, n: int) -> tuple[list, list, dict | None, dict, dict]:
                if loop is not None:
                    loop.reset_step_stats()
                pauses.reset()
                watch = MemoryWatch(server.store)
                tasks = [dict(base=base, name=name, mode=mode, settings=settings, system=shapes.SYSTEM_PROMPT,
                              image_url=urls[c], questions=questions, lengths=lengths, bias=bias, think_s=think_s)
                         for c in range(n)]
                out, errors = pool.round(tasks) if pool is not None else thread_round(tasks)
                steps = None if loop is None else loop.step_stats(recent=LOOP_RECENT_STEPS)
                collections = pauses.summary()  # (before the collection between rounds below)
                memory = watch.stop()
                server.store.close()  # the next round starts with nothing held
                server.forget_media()  # ... and its images decoded and processed again, as new clients' are
                gc.collect()
                return [d for d in out if d is not None], errors, steps, collections, memory

            for mode in modes:
                if warmup:
                    round_of(mode, 1)
                    log(f"[serve-load] warmed up {mode}")
                # (a client count's variants side by side, every other round in reverse order)
                for n, r, variant in ((n, r, v) for n in clients for r in range(rounds)
                                      for v in (variants if r % 2 == 0 else variants[::-1])):
                    ahead, forwards, prepare, side, ride, interval, cap, split, joins, early_ups = variant
                    parts = [mode] + (["launched ahead" if ahead else "not ahead"] if len(aheads) > 1 else []) + (
                        [f"prompt forwards {forwards or 'any'}"] if len(prompt_forwards) > 1 else []) + (
                        [f"preparing {prepare or 'any'}"] if len(preparing) > 1 else []) + (
                        [_STREAM_NAMES[side]] if len(streams) > 1 else []) + (
                        [f"riding up to {ride or 'default'} rows"] if len(ride_rows) > 1 else []) + (
                        [f"switch interval {1e3 * interval:g} ms"] if len(intervals) > 1 else []) + (
                        [f"chunk cap {cap or 'none'}"] if len(chunk_rows) > 1 else []) + (
                        [f"split at {split or 'never'}"] if len(split_rows) > 1 else []) + (
                        ["joins in flight" if joins else "joins between steps"] if len(in_flight) > 1 else []) + (
                        ["follow-ups made ahead" if early_ups else "follow-ups made on joining"]
                        if len(early) > 1 else [])
                    series = ", ".join(parts)
                    # (between rounds: the loop has nothing running)
                    _apply_variant(loop, variant, server)
                    dialogues, errors, steps, collections, memory = round_of(mode, n)
                    row = load_row(mode, n, dialogues, errors)
                    row["memory"] = memory
                    row["series"], row["gc"], row["round"] = series, collections, r
                    row["switch_interval_s"] = sys.getswitchinterval()
                    if batching:
                        row["launch_ahead"], row["max_prompt_forwards"] = ahead, forwards
                        row["max_preparing"], row["prepare_stream"] = prepare, side
                        row["ride_max_rows"], row["batch_chunk_rows"], row["split_rows"] = ride, cap, split
                        row["join_in_flight"], row["follow_ups_ahead"] = joins, early_ups
                    if steps is not None:
                        row["loop"] = steps
                    result["rows"].append(row)
                    rate = row["output_tokens_per_s"]
                    log(f"[serve-load] {series} x{n}{f' (round {r + 1})' if rounds > 1 else ''}: "
                        f"{rate or float('nan'):.1f} tokens/s, TTFT p50 "
                        f"{_ms(row['ttft_p50_s'])} ms, TPOT p50 {_ms(row['tpot_p50_s'])} ms, errors {len(errors)}")
                    if steps is not None:
                        log(f"[serve-load] {series} x{n} loop: {loop_summary(steps)}")
                    log(f"[serve-load] {series} x{n} memory: {memory_summary(memory)}")
                    log(f"[serve-load] {series} x{n} garbage collector: {collections['collections']} collections "
                        f"(generations 0 / 1 / 2), full ones' pauses {collections['full_pause_ms_total']} ms in all, "
                        f"{collections['full_pause_ms_max']} ms the longest")
                    if n == 1 and dialogues and variant == variants[0]:
                        _keep_one_client_dialogue(result, mode, dialogues[0])
                    if rounds > 1:  # (a run cut short by its time limit keeps the medians of what it measured)
                        result["medians"] = round_medians(result["rows"])
                    _write(result, json_path)
                played = len(result.get("server_one_client_rounds", {}).get(mode, ()))
                if library and 1 in clients and played < overhead_dialogues:
                    # (the overhead's medians: one-client dialogues beyond the rounds', not rows of their own)
                    _apply_variant(loop, variants[0], server)
                    for _ in range(overhead_dialogues - played):
                        dialogues = round_of(mode, 1)[0]
                        if dialogues:
                            _keep_one_client_dialogue(result, mode, dialogues[0])
                    log(f"[serve-load] {mode}: {overhead_dialogues - played} more one-client dialogues for the "
                        "server's overhead")
                if profile_loop:
                    _apply_variant(loop, variants[0], server)
                    profile = profiled_round(loop, lambda: round_of(mode, max(clients)))
                    result.setdefault("loop_profile", {})[mode] = dict(profile, clients=max(clients))
                    log(f"[serve-load] {mode} x{max(clients)}, the loop's thread profiled: "
                        f"{profile['output_tokens_per_s'] or float('nan'):.1f} tokens/s under the profiler; "
                        f"{profile['calls']} calls, {profile['seconds']:.2f} s of functions")
                    for line in profile_lines(profile):
                        log(f"[serve-load]   {line}")
                    _write(result, json_path)
                if trace_round:
                    from .trace_round import trace_lines, traced_round

                    _apply_variant(loop, variants[0], server)
                    kept = None
                    if trace_path:
                        root, ext = os.path.splitext(trace_path)
                        kept = f"{root}_{mode}{ext}"
                    traced = traced_round(loop, lambda: round_of(mode, max(clients)), kept)
                    dialogues, errors = traced.pop("played")[:2]
                    row = load_row(mode, max(clients), dialogues, errors)
                    result.setdefault("trace", {})[mode] = dict(traced, clients=max(clients), file=kept,
                                                                output_tokens_per_s=row["output_tokens_per_s"],
                                                                errors=len(errors))
                    rate = row["output_tokens_per_s"] or float("nan")
                    log(f"[serve-load] {mode} x{max(clients)}, traced: {rate:.1f} tokens/s under the profiler")
                    for line in trace_lines(traced):
                        log(f"[serve-load]   {line}")
                    _write(result, json_path)
            if library and 1 in clients:  # the client's own part of a first token: a server answering at once
                try:  # (an extra figure: its failure is reported, and the run goes on to the library's)
                    floor = measure_client_floor(
                        pool, dict(name=name, system=shapes.SYSTEM_PROMPT, image_url=urls[0], question=questions[0],
                                   repeats=FLOOR_REPEATS))
                    log(f"[serve-load] a server answering at once: the client's first piece after "
                        f"{_ms(floor['ttft_s'])} ms, {_ms(floor['client_s'])} ms of it outside that server's own "
                        f"clock (medians of {floor['requests']} requests)")
                except Exception as error:  # noqa: BLE001
                    floor = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                    log(f"[serve-load] the requests to a server answering at once failed: {floor['error']}")
                result["client_floor"] = floor
        if library:
            from PIL import Image

            from ..serve.media import decode_pixels

            decodes = []  # what the server does for a new picture and the library is given done: its decoding
            for _ in range(5):
                began = time.perf_counter()
                decode_pixels(jpegs[0], "image")
                decodes.append(time.perf_counter() - began)
            result["jpeg_decode_s"] = statistics.median(decodes)
            for mode in modes:
                image = Image.open(io.BytesIO(jpegs[0])).convert("RGB")
                if warmup:  # the library's own single-sequence path captures its graphs on first use, as the
                    # server's rounds were warmed up: the timed dialogue below meets them captured
                    library_conversation(model, processor, configs[mode], image, questions, lengths, bias, 0.0)
                    gc.collect()
                runs = []
                for _ in range(max(rounds, overhead_dialogues)):  # (as many dialogues as the server's one-client ones)
                    runs.append(library_conversation(model, processor, configs[mode], image, questions, lengths,
                                                     bias, think_s))
                    gc.collect()
                result["library"][mode] = {"ttft_s": _first_turns_median(runs, "ttft_s"),
                                           "tpot_s": _first_turns_median(runs, "tpot_s"),
                                           "rounds": [[{k: r[k] for k in ("ttft_s", "tpot_s")} for r in run]
                                                      for run in runs]}
                served = result.get("server_one_client_rounds", {}).get(mode)
                if served:
                    result["overhead"][mode] = overhead(served, runs, result.get("client_floor"))
        if rounds > 1:
            result["medians"] = round_medians(result["rows"])
        result["lengths_ok"] = all(r["completion_tokens"] == r["clients"] * sum(lengths) for r in result["rows"])
        result["elapsed_s"] = time.perf_counter() - started
        _write(result, json_path)
        if plot_path:
            plot(result, plot_path)
        print_table(result, log)
        return result
    finally:
        torch.set_num_threads(previous_threads)
        sys.setswitchinterval(previous_interval)
        if froze:  # (the process goes on, in a test say: its objects back in reach)
            gc.unfreeze()


def _keep_one_client_dialogue(result: dict, mode: str, dialogue: list[dict]) -> None:
    """Keep a server one-client dialogue's turns (TTFT, TPOT, the server's own clock) for the overhead figure."""
    turns = [{k: t[k] for k in ("ttft_s", "tpot_s", "server_t1_s")} for t in dialogue]
    result.setdefault("server_one_client_rounds", {}).setdefault(mode, []).append(turns)


def _first_turns_median(dialogues: list, key: str) -> float | None:
    """The median of ``key`` over the dialogues' first turns (None where no first turn has it)."""
    values = [d[0].get(key) for d in dialogues if d and d[0].get(key) is not None]
    return statistics.median(values) if values else None


def overhead(served: list, runs: list, floor: dict | None = None) -> dict:
    """The server's one-client overhead over the library from their dialogues (``served``: the server's one-client
    rounds, each a list of turns with ``ttft_s``, ``tpot_s``, ``server_t1_s``; ``runs``: the library's, each a list
    of turns): medians over the rounds of the first turn's TTFT and TPOT each side, their differences and ratios, and
    where the server's part of the first token goes: ``client_http_s`` (the client's request and the server's
    response, outside the server's own clock: the TTFT the client saw less the server's ``server_t1_s``) and
    ``in_server_s`` (the server's own clock less the library's TTFT); ``rounds`` how many of each. With ``floor``
    (`measure_client_floor`): ``client_floor_s``, what of ``client_http_s`` the same request costs against a server
    that answers at once (the client itself and HTTP on the loopback), and ``server_http_s``, the rest (the server's
    HTTP handling outside its clock, the first piece's way from the loop to the socket)."""
    server_ttft, server_tpot = _first_turns_median(served, "ttft_s"), _first_turns_median(served, "tpot_s")
    server_t1 = _first_turns_median(served, "server_t1_s")
    lib_ttft, lib_tpot = _first_turns_median(runs, "ttft_s"), _first_turns_median(runs, "tpot_s")
    client_http = None if server_ttft is None or server_t1 is None else server_ttft - server_t1
    return {"server_ttft_s": server_ttft, "library_ttft_s": lib_ttft,
            "server_tpot_s": server_tpot, "library_tpot_s": lib_tpot,
            "ttft_s": None if server_ttft is None or lib_ttft is None else server_ttft - lib_ttft,
            "tpot_s": None if server_tpot is None or lib_tpot is None else server_tpot - lib_tpot,
            "ttft_ratio": server_ttft / lib_ttft if server_ttft and lib_ttft else None,
            "tpot_ratio": server_tpot / lib_tpot if server_tpot and lib_tpot else None,
            "client_http_s": client_http,
            "in_server_s": None if server_t1 is None or lib_ttft is None else server_t1 - lib_ttft,
            "rounds": {"server": len(served), "library": len(runs)},
            **({} if not floor or "client_s" not in floor else {
                "client_floor_s": floor["client_s"],
                "server_http_s": None if client_http is None else client_http - floor["client_s"]})}


FLOOR_REPEATS = 21  # requests to the server that answers at once (`measure_client_floor`), the first not counted


def at_once_app():
    """An app that answers a chat completion request at once, streamed: the request's body read and parsed as JSON,
    then one piece of text with the app's own clock (``raincheck.t1_ms``, from the request's arrival, as the server
    reports it), then the end. What the client's part of a first token costs with no model behind it."""
    import json

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat_completions(request):
        arrived = time.perf_counter()
        body = json.loads(await request.body())

        async def events():
            piece = {"id": "chatcmpl-at-once", "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": body.get("model", ""), "raincheck": {"t1_ms": 1e3 * (time.perf_counter() - arrived)},
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "."}, "finish_reason": None,
                                  "logprobs": None}]}
            yield f"data: {json.dumps(piece)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def measure_client_floor(pool, task: dict) -> dict:
    """One client's first-turn request (``task``: `load_client.client_floor`'s arguments but ``base``) sent to
    `at_once_app` on the loopback, from a client process of ``pool`` (None: a thread of this process): medians over
    the requests but the first of the client's TTFT (``ttft_s``), of the app's own clock (``in_app_s``) and of the
    difference (``client_s``: what of a first token is the client's request and the response outside a server's
    clock), and how many requests (``requests``)."""
    from ..serve import running

    with running(at_once_app()) as base:
        tasks = [dict(task, base=base)]
        out, errors = pool.round(tasks, kind="floor") if pool is not None else thread_round(tasks, kind="floor")
    if errors or not out[0]:
        raise RuntimeError(f"the requests to a server answering at once failed: {errors}")
    records = out[0][1:] or out[0]
    return {"ttft_s": statistics.median(r["ttft_s"] for r in records),
            "in_app_s": statistics.median(r["server_t1_s"] for r in records),
            "client_s": statistics.median(r["ttft_s"] - r["server_t1_s"] for r in records),
            "requests": len(records)}


def _version(package: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "?"


def _switch_values(value: str, name: str, without_batching: str, both: tuple, batching: bool) -> tuple:
    """An on / off switch of the loop compared side by side: ``value`` "on", "off" or "both" (``both``: the two in
    the rows' order); without batching only ``without_batching`` (what the per-turn server does) is taken."""
    values = {"on": (True,), "off": (False,), "both": both}.get(value)
    if values is None or (not batching and value != without_batching):
        raise ValueError(f"{name} must be 'on', 'off' or 'both' (with batching), got {value!r}"
                         + ("" if batching else " without batching"))
    return values


_STREAM_NAMES = {False: "one stream", True: "own streams", "high": "own high-priority streams"}


def _stream_values(value: str, batching: bool) -> tuple:
    """``prepare_stream``'s values compared side by side: comma-separated "off" (the default stream), "on" (streams of
    their own) and "high" (of their own, at the device's highest priority), or "both" ("off,on"); without batching
    only "off" (the per-turn server prepares in its turn's thread)."""
    names = {"off": False, "on": True, "high": "high"}
    parts = ["off", "on"] if value == "both" else [p.strip() for p in str(value).split(",")]
    if not parts or any(p not in names for p in parts) or len(set(parts)) < len(parts) or (
            not batching and parts != ["off"]):
        raise ValueError(f"prepare_stream must be 'both' or comma-separated 'off', 'on', 'high' (with batching), got "
                         f"{value!r}" + ("" if batching else " without batching"))
    return tuple(names[p] for p in parts)


def _apply_variant(loop, variant: tuple, server=None) -> None:
    """Set the settings compared side by side (between rounds): ``(launch_ahead, max_prompt_forwards, max_preparing,
    prepare_stream, ride_max_rows, switch interval in seconds, batch_chunk_rows, split_rows, join_in_flight,
    follow_ups_ahead)``, ``prepare_stream`` False, True or "high" (`_stream_values`); the first five and the last three
    are ``loop``'s (None: no batching loop, only the interval), ``batch_chunk_rows`` the ``server``'s config's (its
    requests' configs are made from it)."""
    ahead, forwards, preparing, stream, ride, interval, cap, split, joins, early = variant
    sys.setswitchinterval(interval)
    if loop is None:
        return
    if server is not None:
        server.settings.config.batch_chunk_rows = cap
    loop.launch_ahead, loop.max_prompt_forwards, loop.max_preparing, loop.ride_max_rows = ahead, forwards, preparing, ride
    loop.split_rows = split
    loop.join_in_flight, loop.follow_ups_ahead = joins, early
    loop.prepare_stream = bool(stream)
    loop.prepare_priority = "high" if stream == "high" else "normal"


def _loop_values(values, name: str, check, batching: bool) -> tuple:
    """A loop setting's values to compare side by side (a tuple; None: the loop's default), each checked by
    ``check(value, name)``; refused when empty, or other than ``(None,)`` without batching."""
    values = tuple(values)
    for value in values:
        check(value, name)
    if not values or (not batching and values != (None,)):
        raise ValueError(f"{name} must be one or more of None / an int >= 1 (with batching), got {values!r}"
                         + ("" if batching else " without batching"))
    return values


def _check_chunk_rows(value, name: str) -> None:
    """``chunk_rows``: None or an int >= 1 (`RaincheckConfig.batch_chunk_rows`)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None (no cap) or an int >= 1 (a step's chunk rows), got {value!r}")


def _forwards(text: str) -> tuple:
    try:
        return tuple(None if x.strip() == "any" else int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes 'any' or integers, comma-separated, got {text!r}") from None


def _ints_or(words: dict, option: str):
    """An argparse type: comma-separated integers, or the ``words`` (lowercase) for the values they stand for."""
    names = " or ".join(f"'{w}'" for w in words)

    def parse(text: str) -> tuple:
        try:
            return tuple(words[x] if x in words else int(x)
                         for x in (part.strip().lower() for part in text.split(",")) if x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} takes {names} or integers, comma-separated, got "
                                             f"{text!r}") from None

    return parse


_caps = _ints_or({"none": None}, "--chunk-rows")
_splits = _ints_or({"default": "default", "never": None}, "--split-rows")


def _intervals(text: str) -> tuple:
    try:
        return tuple(None if x.strip() == "default" else float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--switch-interval takes seconds or 'default', comma-separated, got "
                                         f"{text!r}") from None


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients must be comma-separated integers, got {text!r}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench serve-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_qwen3_vl",
                        help=f"one of {sorted(shapes.MODELS) + sorted(BUNDLED)}")
    parser.add_argument("--clients", type=_counts, default=DEFAULT_CLIENTS,
                        help="client counts, comma-separated (default 1,4,8,16,32,64)")
    parser.add_argument("--modes", default="raincheck,full", help="comma-separated Raincheck modes")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--follow-up-tokens", type=int, default=None, help="default: half of --answer-tokens")
    parser.add_argument("--think-s", type=float, default=0.0, help="seconds between an answer and the next question")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--warm-up-tokens", type=int, default=None,
                        help="with --batching: rows of each of the batched engine's places, as serve's option "
                             "(default: serve's, 4096)")
    parser.add_argument("--no-library", action="store_true", help="skip the library reference at one client")
    parser.add_argument("--max-running", type=int, default=None, help="the server's (default: the most clients)")
    parser.add_argument("--max-queue", type=int, default=None, help="the server's (default: the most clients)")
    parser.add_argument("--in-process-clients", action="store_true",
                        help="the clients in threads of the server's process (they then share its GIL) instead of "
                             "a process each")
    parser.add_argument("--batching", action="store_true",
                        help="the server's continuous-batching loop (serve --batching) instead of a thread per turn")
    parser.add_argument("--switch-interval", type=_intervals, default=(None,), metavar="S[,S...]",
                        help="the interpreter's thread switch interval, in seconds (sys.setswitchinterval; 'default': "
                             "as it is, 0.005): how long the batching loop may wait for the interpreter's lock while "
                             "another of the server's threads holds it; several: side by side, each round under its "
                             "own")
    parser.add_argument("--launch-ahead", choices=("on", "off", "both"), default="on",
                        help="with --batching: the loop launches a step ahead of its predecessor's streaming (on, the "
                             "server's default), never (off), or both, each client count's rounds side by side")
    parser.add_argument("--join-in-flight", choices=("on", "off", "both"), default="off",
                        help="with --batching: turns prepared ahead join the loop while a step runs (on), only between "
                             "steps (off, the server's default), or both, each client count's rounds side by side")
    parser.add_argument("--follow-ups-ahead", choices=("on", "off", "both"), default="off",
                        help="with --batching: a follow-up's sequence made on its request's thread before it joins "
                             "(on), or by the loop when it joins (off, the server's default), or both side by side")
    parser.add_argument("--prompt-forwards", type=_forwards, default=(None,), metavar="K[,K...]",
                        help="with --batching: the loop's max_prompt_forwards, one value or several side by side "
                             "(e.g. any,1,2; 'any': as many as the token budget gives, the default)")
    parser.add_argument("--preparing", type=_forwards, default=None, metavar="K[,K...]",
                        help="with --batching: the loop's max_preparing (turns prepared at once on the asking threads, "
                             "the others in line), one value or several side by side (e.g. any,1,2; 'any': no limit; "
                             "default: the server's, 1)")
    parser.add_argument("--prepare-stream", default=None, metavar="on|off|high[,...]|both",
                        help="with --batching: the loop prepares turns on CUDA streams of their own (on, the server's "
                             "default), on the default stream (off), on streams of their own at the device's highest "
                             "priority (high); several comma-separated side by side ('both': off,on)")
    parser.add_argument("--ride-rows", type=_forwards, default=(None,), metavar="R[,R...]",
                        help="with --batching: the loop's ride_max_rows (the most rows a captured decode step may grow "
                             "to by a short prompt riding in it), one value or several side by side (e.g. any,256; "
                             "'any': the default)")
    parser.add_argument("--split-rows", type=_splits, default=("default",), metavar="R[,R...]",
                        help="with --batching: the loop's split_rows (a decode step split by width when a roofline "
                             "rule with R rows to a pass over the weights says so; 'default': the engine's, "
                             "'never': no split), one value or several side by side (e.g. default,never)")
    parser.add_argument("--chunk-rows", type=_caps, default=(None,), metavar="N[,N...]",
                        help="with --batching: the server config's RaincheckConfig.batch_chunk_rows ('none', the "
                             "default: every answer carries its full chunk; N: a cap on a step's chunk rows, shared), "
                             "one value or several side by side (e.g. none,64)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each client count's variants this many times, every other time in reverse order (A B, "
                             "B A, ...), a row each; with more than one, the medians over them too (default 1)")
    parser.add_argument("--overhead-dialogues", type=int, default=3,
                        help="one-client dialogues each side (server and library) for the server's overhead, medians "
                             "of their first turns (default 3; the one-client rounds count)")
    parser.add_argument("--trace-round", action="store_true",
                        help="with --batching: one more round per mode at the most clients under torch.profiler: how "
                             "busy each CUDA stream was over it and within each turn's preparation (log and JSON)")
    parser.add_argument("--trace-file", default=None, metavar="PATH",
                        help="with --trace-round: keep the round's trace there, gzipped (the mode's name before the "
                             "extension; open it in Perfetto)")
    parser.add_argument("--profile-loop", action="store_true",
                        help="with --batching: one more round per mode at the most clients with the loop's thread "
                             "under cProfile (its top functions in the log and the JSON's loop_profile)")
    parser.add_argument("--no-freeze-heap", action="store_true",
                        help="skip what serve does after its warm-up (gc.freeze: the objects alive then are out of "
                             "the garbage collector's full collections), to see its pauses")
    add_setting_arguments(parser)
    parser.add_argument("--json", default=None, help="write the results here (rewritten after every client count)")
    parser.add_argument("--plot", default=None, help="a PNG of tokens/s and TTFT against clients (matplotlib)")
    args = parser.parse_args(argv)
    try:
        return run(model_name=args.model, clients=args.clients,
                   modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                   answer_tokens=args.answer_tokens,
                   follow_up_tokens=args.follow_up_tokens or max(2, args.answer_tokens // 2), think_s=args.think_s,
                   warmup=not args.no_warmup, max_running=args.max_running, max_queue=args.max_queue,
                   library=not args.no_library, json_path=args.json, plot_path=args.plot, batching=args.batching,
                   client_processes=not args.in_process_clients, switch_interval=args.switch_interval,
                   freeze_heap=not args.no_freeze_heap, launch_ahead=args.launch_ahead,
                   join_in_flight=args.join_in_flight, follow_ups_ahead=args.follow_ups_ahead,
                   prompt_forwards=args.prompt_forwards, preparing=args.preparing, profile_loop=args.profile_loop,
                   prepare_stream=args.prepare_stream, ride_rows=args.ride_rows, rounds=args.rounds,
                   overhead_dialogues=args.overhead_dialogues,
                   chunk_rows=args.chunk_rows, split_rows=args.split_rows,
                   trace_round=args.trace_round, trace_path=args.trace_file, warm_up_tokens=args.warm_up_tokens,
                   log=lambda *a: print(*a, flush=True), **setting_values(args))
    except ValueError as error:
        print(f"[serve-load] {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
