"""Batched `generate`: aggregate output tokens/s and per-row TPOT at several batch sizes, side by side.

    python -m raincheck_hf.bench batch --model qwen3_vl_8b --batch 1,8,32 --answer-tokens 128 \\
        --json benchmarks/results/batch_qwen3_vl_8b_h200.json

Every row of a batch is its own image prompt (one image per row, same size, a different picture each, so the
processor's left padding is a no-op and every row does the same work) and answers exactly ``answer_tokens``
tokens (``min_new_tokens = max_new_tokens``, every special token suppressed, greedy), through the public API:

- ``raincheck``: ``model.generate(**batch, raincheck=RaincheckConfig())``, the default settings. At B = 1 on
  CUDA that is the fast path (``fast_path=None``); at B > 1 the batched engine, its decode steps replayed from
  CUDA graphs (`fast.batched_graphs`), each row's prompt in a captured prefill step of its own.
  ``--batch-chunk-rows`` sets a cap on the batched steps' chunk rows (`RaincheckConfig.batch_chunk_rows`; ``none``,
  the default: every row its full chunk), the one setting that differs from the defaults when given; several
  (``none,64``) run side by side, the first under the variant's name, each other as ``<variant>_cap<N>`` (or
  ``<variant>_uncapped`` for ``none``).
- ``full``: the same with ``RaincheckConfig(mode="full")`` (every visual token prefilled at once).
- ``raincheck_eager`` / ``full_eager`` (B = 1 only): the same with ``fast_path=False``, the eager engine (a batch's
  prompt pieces run on it), so the batch's scaling over one row is also given engine for engine.
- ``stock``: transformers' own ``model.generate(**batch)`` (dynamic cache), the batch HF users run today.

Per (batch size, variant), after one untimed warm-up call of the same length at that batch size (so one-time
costs, CUDA-graph captures and compiles, are paid before timing): ``e2e_s`` (the call, prompt
encoding and prefill included), ``tokens_per_s`` = B x answer_tokens / e2e_s (aggregate output tokens/s),
``ttft_s`` (call start to the first token on the host), ``tpot_s`` (per-row time per output token after the
first: (last token - first token) / (answer_tokens - 1), every row gets one token per step) and
``decode_tokens_per_s`` = B / tpot_s; each run also gives the CUDA-graph captures its traces report (``captures``,
``capture_s``: the single-sequence path's; a batch's captured steps are not in its traces). Medians over ``--reps``
calls (each token timed when it reaches the host, `latency.TokenClock`; ``--clock-check`` also times each row with a
device-wide wait at every token, as this benchmark did before: ``synced_clock``). ``--profile`` adds two more calls
per row under `torch.profiler` (`profile_call`: device time, the host's waits for the device, the top kernels),
untimed: the whole call (``profile``) and its decode steps alone, per step (``decode_profile``).
The JSON carries the hardware and the
ratios the batching targets read: each variant's tokens/s over its own B = 1 (and over the eager engine's B = 1
for ``raincheck`` / ``full``), ``raincheck`` TPOT over ``full``'s, and each variant's tokens/s over ``stock``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..configuration import RaincheckConfig
from ..integration import enable
from .latency import TokenClock, _sync, _write, hardware_info
from .shapes import MODELS, QUESTIONS, SYSTEM_PROMPT, build_model, build_processor, special_token_ids

VARIANTS = ("raincheck", "full", "raincheck_eager", "full_eager", "stock")
EAGER_AT_ONE = ("raincheck_eager", "full_eager")


def build_batch(processor, spec, batch: int, image_size=None) -> dict:
    """``batch`` left-padded image prompts (row ``i`` draws picture seed ``i``), as HF users batch them."""
    from ..tiny import draw_test_image

    width, height = image_size or spec.image_size
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS["image"]}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [draw_test_image(width, height, seed=i) for i in range(batch)]
    processor.tokenizer.padding_side = "left"
    return dict(processor(text=[prompt] * batch, images=images, padding=True, return_tensors="pt"))


DEFAULT_CHUNK_ROWS = RaincheckConfig.batch_chunk_rows


def _kwargs(variant: str, answer_tokens: int, suppress: list[int], batch_chunk_rows=DEFAULT_CHUNK_ROWS) -> dict:
    kw = dict(max_new_tokens=answer_tokens, min_new_tokens=answer_tokens, do_sample=False, suppress_tokens=suppress)
    if variant == "stock":
        return kw
    mode = "full" if variant.startswith("full") else "raincheck"
    kw["raincheck"] = RaincheckConfig(mode=mode, fast_path=False if variant in EAGER_AT_ONE else None,
                                      batch_chunk_rows=batch_chunk_rows)
    kw["return_dict_in_generate"] = True  # (the traces: each call's CUDA-graph captures, `time_call`)
    return kw


class SyncedClock(TokenClock):
    """The clock `bench batch` used until 2026-12-06: a device-wide wait at every token (see
    `TokenClock`), kept to show what it cost (``--clock-check``)."""

    def put(self, value):
        if self._prompt_seen:
            _sync(self.device)
        super().put(value)


def time_call(model, device, inputs: dict, kwargs: dict, clock_class=TokenClock) -> dict:
    clock = clock_class(device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(**inputs, **kwargs, streamer=clock)
    _sync(device)
    end = time.perf_counter()
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    generated = int(sequences.shape[1] - inputs["input_ids"].shape[1])
    times = clock.times
    traces = getattr(out, "raincheck", None)
    traces = [] if traces is None else traces if isinstance(traces, list) else [traces]
    captures = [c for trace in traces for c in trace.captures]  # (the single-sequence path's; batched steps: none)
    return {"e2e_s": end - start, "ttft_s": times[0] - start,
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "generated_tokens": generated, "steps": len(times),
            "captures": len(captures), "capture_s": sum(c[2] for c in captures)}


# the host's waits for the device (a read back synchronizes its stream; the engine's non-blocking pinned copies to the
# device, ``cudaMemcpyAsync``, do not wait and are not counted)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class _ProfileFromFirstToken(TokenClock):
    """A `TokenClock` that starts ``prof`` (a `torch.profiler.profile`) when the first generated token reaches the
    host: what it records is the decode steps only, the prompts' encoding and prefill left out."""

    def __init__(self, device, prof):
        super().__init__(device)
        self.prof = prof

    def put(self, value):
        super().put(value)
        if len(self.times) == 1:  # (once: the times only grow)
            self.prof.start()


def profile_call(model, device, inputs: dict, kwargs: dict, top: int = 30, decode_only: bool = False) -> dict:
    """One more call of the same kind under `torch.profiler` (after the timed ones): where its time went. Wall
    seconds; device seconds (the sum of the kernels' time, CUDA only); the host's seconds in the calls that wait for
    the device (`HOST_WAITS`) and how many; the ``top`` kernels (CUDA) or operators (CPU) by self time. A profiled
    call runs slower than a timed one: the figures say where time goes, not how long a call takes.

    ``decode_only``: the profiler runs from the first generated token to the call's end (the decode steps, without
    the prompts' encoding and prefill), and every figure is also given per step (``steps``: the tokens after the
    first; ``per_step_ms``, each top entry's ``per_step_ms``), so a batched step's kernels read directly."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if decode_only:
        prof = profile(activities=activities)
        run = time_call(model, device, inputs, kwargs, lambda d: _ProfileFromFirstToken(d, prof))
        prof.stop()
        wall, steps = run["e2e_s"] - run["ttft_s"], run["steps"] - 1
    else:
        _sync(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            time_call(model, device, inputs, kwargs)
        wall, steps = time.perf_counter() - start, None
    events = prof.key_averages()
    on_device = device.type == "cuda"
    device_us = sum(e.self_device_time_total for e in events) if on_device else 0.0
    waits = [e for e in events if e.key in HOST_WAITS]
    ranked = sorted(events, key=lambda e: e.self_device_time_total if on_device else e.self_cpu_time_total,
                    reverse=True)[:top]
    out = {"wall_s": wall, "device_s": device_us / 1e6 if on_device else None,
           "host_wait_s": sum(e.self_cpu_time_total for e in waits) / 1e6,
           "host_waits": sum(e.count for e in waits),
           "top": [{"name": e.key[:120], "calls": e.count,
                    "self_s": (e.self_device_time_total if on_device else e.self_cpu_time_total) / 1e6}
                   for e in ranked]}
    if decode_only:
        per = max(steps, 1)
        out["steps"] = steps
        out["per_step_ms"] = {"wall": wall * 1e3 / per,
                              "device": device_us / 1e3 / per if on_device else None,
                              "host_wait": out["host_wait_s"] * 1e3 / per}
        for entry in out["top"]:
            entry["per_step_ms"] = entry["self_s"] * 1e3 / per
    return out


def summarize(reps: list[dict], batch: int, answer_tokens: int) -> dict:
    def med(key):
        values = [r[key] for r in reps if r[key] is not None]
        return statistics.median(values) if values else None

    e2e, tpot = med("e2e_s"), med("tpot_s")
    return {"batch": batch, "reps": len(reps), "e2e_s": e2e, "ttft_s": med("ttft_s"), "tpot_s": tpot,
            "tokens_per_s": batch * answer_tokens / e2e, "decode_tokens_per_s": batch / tpot if tpot else None,
            "exact_lengths": all(r["generated_tokens"] == answer_tokens for r in reps), "runs": reps}


def cap_suffix(batch_chunk_rows, first) -> str:
    """A variant's name suffix for a chunk cap compared side by side (`run`'s ``batch_chunk_rows`` list): none for the
    first one listed, else ``_cap<N>`` or ``_uncapped``."""
    if batch_chunk_rows == first:
        return ""
    return "_uncapped" if batch_chunk_rows is None else f"_cap{batch_chunk_rows}"


def add_ratios(rows: list[dict]) -> None:
    """Ratios the batching targets read (in place): over B = 1, raincheck over full (of the same chunk cap), over
    stock."""
    at = {(r["variant"], r["batch"]): r for r in rows}
    for r in rows:
        one = at.get((r["variant"], 1))
        if one is not None:
            r["tokens_per_s_over_b1"] = r["tokens_per_s"] / one["tokens_per_s"]
        eager = at.get((f"{r['variant']}_eager", 1))
        if eager is not None:
            r["tokens_per_s_over_eager_b1"] = r["tokens_per_s"] / eager["tokens_per_s"]
        stock = at.get(("stock", r["batch"]))
        if stock is not None and r["variant"] != "stock":
            r["tokens_per_s_over_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
        if r["variant"].startswith("raincheck") and not r["variant"].endswith("_eager"):
            suffix = r["variant"][len("raincheck"):]  # ("", or a chunk cap's: `cap_suffix`)
            full = at.get((f"full{suffix}", r["batch"]))
            if full is not None and r["tpot_s"] and full["tpot_s"]:
                r["tpot_over_full"] = r["tpot_s"] / full["tpot_s"]


def run(model_name: str, batches: list[int], variants: list[str], answer_tokens: int = 128, reps: int = 2,
        device=None, image_size=None, json_path: str | None = None, log=print,
        batch_chunk_rows=DEFAULT_CHUNK_ROWS, profile: bool = False, clock_check: bool = False) -> dict:
    """``batch_chunk_rows``: the raincheck / full variants' `RaincheckConfig.batch_chunk_rows`, or a list of several
    run side by side (each after the first as ``<variant><cap_suffix>``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    caps = list(batch_chunk_rows) if isinstance(batch_chunk_rows, (list, tuple)) else [batch_chunk_rows]
    if not caps or len(set(caps)) < len(caps):
        raise ValueError(f"--batch-chunk-rows must list distinct values, got {caps}.")
    for cap in caps:
        try:
            RaincheckConfig(batch_chunk_rows=cap)
        except ValueError as error:
            raise ValueError(f"--batch-chunk-rows: {error}") from None
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"--variants has {bad}; choose from {list(VARIANTS)}.")
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"--batch must list batch sizes >= 1, got {batches}.")
    if answer_tokens < 2 or reps < 1:
        raise ValueError(f"--answer-tokens must be >= 2 and --reps >= 1, got {answer_tokens} and {reps}.")
    model, info = build_model(model_name, device)
    enable(model)  # `raincheck=` on this instance; the stock variant passes none and runs transformers' own loop
    processor = build_processor()
    suppress = special_token_ids(processor)
    result = {"benchmark": "batch", "hardware": hardware_info(device), "model": info,
              "settings": {"batches": batches, "variants": variants, "answer_tokens": answer_tokens, "reps": reps,
                           "profile": profile, "clock_check": clock_check,
                           "image_size": list(image_size or MODELS[model_name].image_size),
                           "batch_chunk_rows": caps[0] if len(caps) == 1 else caps,
                           "raincheck_config": " / ".join(
                               "RaincheckConfig() (defaults)" if c == DEFAULT_CHUNK_ROWS
                               else f"RaincheckConfig(batch_chunk_rows={c!r})" for c in caps)},
              "rows": []}
    for batch in batches:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                  for k, v in build_batch(processor, MODELS[model_name], batch, image_size).items()}
        result["settings"].setdefault("prompt_tokens", int(inputs["attention_mask"][0].sum()))
        for variant, cap in ((v, c) for v in variants for c in (caps if v != "stock" else caps[:1])):
            if variant in EAGER_AT_ONE and batch != 1:
                continue
            kwargs = _kwargs(variant, answer_tokens, suppress, cap)
            time_call(model, device, inputs, kwargs)  # warm-up: the same call (captures, compiles, autotuning)
            runs = [time_call(model, device, inputs, kwargs) for _ in range(reps)]
            name = variant if variant == "stock" else variant + cap_suffix(cap, caps[0])
            row = {"variant": name, **summarize(runs, batch, answer_tokens)}
            if variant != "stock":
                row["batch_chunk_rows"] = cap
            if clock_check:  # the same call timed as until 2026-12-06 (a device wait at every token)
                synced = summarize([time_call(model, device, inputs, kwargs, SyncedClock) for _ in range(reps)],
                                   batch, answer_tokens)
                row["synced_clock"] = {k: synced[k] for k in ("e2e_s", "ttft_s", "tpot_s", "tokens_per_s")}
            if profile:
                row["profile"] = profile_call(model, device, inputs, kwargs)
                row["decode_profile"] = profile_call(model, device, inputs, kwargs, decode_only=True)
            result["rows"].append(row)
            synced = row.get("synced_clock")
            log(f"B={batch:3d} {name:20s} {row['tokens_per_s']:8.1f} tok/s  TTFT {row['ttft_s'] * 1e3:8.1f} ms  "
                f"TPOT {row['tpot_s'] * 1e3:7.2f} ms"
                + (f"  (synced clock: {synced['tokens_per_s']:.1f} tok/s, TPOT {synced['tpot_s'] * 1e3:.2f} ms)"
                   if synced else ""))
            _write(result, json_path)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_ratios(result["rows"])
    _write(result, json_path)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench batch", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3_vl_8b", choices=sorted(MODELS))
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-chunk-rows", default=str(DEFAULT_CHUNK_ROWS).lower(),
                        help="RaincheckConfig.batch_chunk_rows of the raincheck / full variants: an integer >= 1 (a "
                             "cap on a step's chunk rows, shared), or 'none' (no cap: every row its full chunk); "
                             "several comma-separated run side by side (e.g. none,64); "
                             f"default {str(DEFAULT_CHUNK_ROWS).lower()} (the config's)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed calls, two more under torch.profiler per row: device time, the host's "
                             "waits for the device, the top kernels, of the whole call and of its decode steps per "
                             "step (in the JSON's rows)")
    parser.add_argument("--clock-check", action="store_true",
                        help="also time each row's call with a device-wide wait at every token, as this benchmark did "
                             "before (`synced_clock` in the JSON's rows)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    chunk_rows = []
    for rows in (r.strip() for r in args.batch_chunk_rows.split(",")):
        if rows.lower() == "none":
            chunk_rows.append(None)
            continue
        try:
            chunk_rows.append(int(rows))
        except ValueError:
            parser.error(f"--batch-chunk-rows must be integers >= 1 or 'none', comma-separated, got "
                         f"{args.batch_chunk_rows!r}")
    chunk_rows = chunk_rows[0] if len(chunk_rows) == 1 else chunk_rows
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    return run(args.model, batches, variants, args.answer_tokens, args.reps, args.device, json_path=args.json,
               batch_chunk_rows=chunk_rows, profile=args.profile, clock_check=args.clock_check)
