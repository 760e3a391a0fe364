"""End-to-end latency of stock `generate` against Raincheck's modes, side by side in one process.

    python -m raincheck_hf.bench latency --model qwen3_vl_8b,qwen3_5_9b --input image,video --turns 3 \\
        --answer-tokens 512 --reps 3 --chunk-sizes 7,15,31,63 --json out.json

For every (model, input) it builds the model once (random weights at the real shape, see
`bench/shapes.py`), warms every variant up, then runs ``reps`` repetitions; each repetition runs
every variant once, in an order rotated per repetition, so drift hits every variant alike.

Variants (all on the same model instance, the same prompt, the same answer length):

- ``stock_dynamic``: HF's own `generate`, full prefill, `DynamicCache`; later turns continue the
  returned cache (``generate(input_ids=<whole conversation>, cache=...)``).
- ``stock_static``: the same with ``cache_implementation="static"`` (HF auto-compiles the decode
  step on CUDA, "reduce-overhead" = CUDA graphs); the `StaticCache` is sized once per model
  (``max_cache_len``) for the longest conversation of the run so that it compiles once; later turns
  continue it. Its compile is warmed up outside the timings and reported under ``warmup``.
- ``stock_static_reused``: the same compiled decode step, but one `StaticCache` object per model
  passed as ``cache=`` and ``reset()`` before every conversation, so the CUDA graphs always see
  the same addresses (what a careful user of stock transformers would do; ``stock_static`` gets a
  fresh cache per call, which may make the CUDA graphs re-record).
- ``full``, ``hard``, ``post_answer``: ``generate(..., raincheck=RaincheckConfig(mode=...))``.
- ``raincheck c=<c>`` (fused) and ``serial c=<c>`` for every chunk size of the sweep. The primary
  chunk size (31 when swept) runs all turns; the other sizes run ``--sweep-turns`` turns (default 1).
  ``auto`` in the sweep (``--chunk-sizes 7,15,31,63,auto``) runs ``chunk_size="auto"`` with
  ``--tpot-slack``; its idle-time restoration (the idle probe) uses the largest ladder size, as
  `Conversation` does.
- Every Raincheck variant runs with `RaincheckConfig.compile_steps`'s default (None: the fast path's
  steps compiled where they are captured as CUDA graphs, i.e. on CUDA; uncompiled on CPU);
  ``--compile-steps`` / ``--no-compile-steps`` force it on / off for all of them.
- ``full_uncompiled``, ``raincheck_uncompiled c=<primary>``: ``full`` and the primary fused variant with
  ``compile_steps=False``; ``full_compiled``, ``raincheck_compiled c=<primary>``: the same with
  ``compile_steps=True``. Only when asked for by name in ``--variants``, whatever ``--compile-steps`` says;
  side by side with the default variants they measure what the compile buys.

Every answer has exactly ``--answer-tokens`` tokens (follow-ups: ``--follow-up-tokens``): greedy,
``min_new_tokens = max_new_tokens``, and every special token (EOS included) suppressed, the same
logits processors for every variant. Turns 2.. are text-only follow-ups built as `Conversation`
builds them.

Metrics (seconds in the JSON, milliseconds in the table; every clock read follows
``torch.cuda.synchronize()`` on CUDA; inputs are already on the device, processor time excluded):

- ``t1``: time to first token of turn 1: from just before `generate` to the streamer's first
  ``put`` after the prompt (vision encoding + selection + prefill + first sampling included).
- ``tpot<k>``: mean time per output token of turn k, (last token time - first token time) / (n - 1).
  ``tpot1_restoring`` / ``tpot1_plain``: the same over the decode steps of turn 1 that did / did not
  carry a deferred chunk (from the trace; Raincheck variants only); ``chunk_sizes_chosen``: how many
  decode steps carried a chunk of each (padded) size, from the trace; ``decode_captures``: the step shapes
  captured as CUDA graphs during the answer (``[forward, rows, seconds]``, the trace's ``captures``).
  ``tpot1_median_interval``: the median gap between consecutive tokens (robust to one-time stalls such as a
  CUDA-graph re-record).
- ``e2e<k>``: wall time of turn k's `generate` call; ``e2e_total``: the sum over turns.
- ``t<k>`` (k >= 2): time to first token of follow-up k sent right after turn k-1's answer: for
  Raincheck variants the deferred tokens still pending ride along with the follow-up's prefill
  (docs/method.md §6, "early follow-up").
- ``t2_idle``: time to first token of the same follow-up 2 after an idle gap in which restoration
  finished: on a deep copy of the cache after turn 1, the pending deferred tokens are restored
  chunk by chunk with `raincheck_hf.restore_pending` exactly as `Conversation.complete()` does
  (timed: ``idle_restore``), then the follow-up's first token is timed (``max_new_tokens=1``).
  ``t2_barrier`` = ``idle_restore + t2_idle`` (derived): a follow-up that arrives at once and waits
  at a completion barrier, as ``Conversation(early_follow_up=False)`` does.
- ``warmup`` (per run): the wall time of each variant's first (warm-up) conversation, which pays its
  one-time costs (graph captures, compiles, kernel autotuning); printed under the table.
- ``peak_mem``: `torch.cuda.max_memory_allocated` over the variant's turns, its counter reset before
  each turn (weights included; None on CPU).
- Medians over repetitions; ``ratio_to_stock_dynamic`` / ``ratio_to_full`` divide medians.
- ``memory_floor`` (per run): the bandwidth of a large device-to-device copy measured in the same
  process (bytes read + written per second), the bytes a decode step must read at the first answer's
  mean context (`decode_bytes`) and their quotient ``floor_s``; ``tpot_plain_over_floor`` (per variant,
  the ``step/floor`` column) is its turn-1 decode step without a chunk over that floor.

The JSON (``--json``) is rewritten after every conversation, so a run cut short keeps what it
measured; ``--budget-s`` skips a variant's repetition when its estimate (from its warm-up or last
repetition) would end past the budget, and says so (``budget_skipped_reps``). Nothing is extrapolated: a variant that failed, was not supported or did not fit the
``--budget-s`` says so in its ``status``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from ..configuration import RaincheckConfig, parse_chunk_size
from . import shapes


def split_chunk_spec(spec) -> tuple[int | str, int]:
    """``(chunk_size, chunk_every)`` of a chunk size as the benchmark takes it: `configuration.parse_chunk_size`'s
    (an integer or ``"auto"``), or ``"C/K"``: size C on every K-th decode step (`RaincheckConfig.chunk_every`)."""
    if isinstance(spec, str) and "/" in spec:
        size, every = spec.split("/", 1)
        return parse_chunk_size(size), int(every)
    return parse_chunk_size(spec), 1


def parse_chunk_spec(value) -> int | str:
    """A chunk size as the benchmark keeps it (`split_chunk_spec`'s input): an integer, ``"auto"``, or the text
    ``"C/K"`` when K > 1 ("C/1" is C)."""
    size, every = split_chunk_spec(value)
    return size if every == 1 else f"{size}/{every}"


STOCK_VARIANTS = ("stock_dynamic", "stock_static", "stock_static_reused")
PLAIN_MODES = ("full", "hard", "post_answer")
DEFAULT_CHUNK_SIZES = (7, 15, 31, 63)
SLOW_FIRST_WARMUP_S = 10.0  # a non-static variant's first warm-up call slower than this is run once more


# ---- variants ----------------------------------------------------------------------------------

@dataclass
class Variant:
    """One way of answering. ``mode`` is None for stock variants; ``turns`` is how many turns it runs."""

    name: str
    kind: str  # "stock" | "raincheck"
    turns: int
    mode: str | None = None
    chunk_size: int | str | None = None  # "auto": chunk_size="auto"
    cache: str | None = None  # stock: "dynamic" | "static" | "static_reused"
    family: str = ""  # "raincheck" / "serial" for the sweep, else the name
    compiled: bool | None = None  # RaincheckConfig.compile_steps forced whatever --compile-steps says (None: not forced)

    def config(self, settings: dict):
        from ..configuration import RaincheckConfig

        # fast_path=None: the CUDA fast path where the family supports it (every family now), else the eager engine
        chunk_size, chunk_every = split_chunk_spec(self.chunk_size)
        return RaincheckConfig(mode=self.mode, retention=settings["retention"], chunk_size=chunk_size,
                               chunk_every=chunk_every,
                               decode_guard=settings["decode_guard"], selector=settings["selector"],
                               fast_path=settings.get("fast_path"), tpot_slack=settings.get("tpot_slack", 0.02),
                               compile_steps=self.compiled if self.compiled is not None
                               else settings.get("compile_steps"))


def build_variants(chunk_sizes, primary_chunk: int, turns: int, sweep_turns: int, only=None) -> list[Variant]:
    """The variants of one run, in their base order. ``only``: names or families to keep (None: all)."""
    variants = [Variant("stock_dynamic", "stock", turns, cache="dynamic", family="stock_dynamic"),
                Variant("stock_static", "stock", turns, cache="static", family="stock_static"),
                Variant("stock_static_reused", "stock", turns, cache="static_reused", family="stock_static_reused")]
    variants += [Variant(m, "raincheck", turns, mode=m, chunk_size=primary_chunk, family=m) for m in PLAIN_MODES]
    # the primary chunk size first (all turns), then the rest of the sweep: a time budget cuts the sweep first
    for mode in ("raincheck", "serial"):
        variants.append(Variant(f"{mode} c={primary_chunk}", "raincheck", turns, mode=mode, chunk_size=primary_chunk,
                                family=mode))
    for c in chunk_sizes:  # fused and serial side by side per size, so a budget drops whole sizes
        for mode in ("raincheck", "serial"):
            if c != primary_chunk:
                variants.append(Variant(f"{mode} c={c}", "raincheck", min(turns, sweep_turns), mode=mode,
                                        chunk_size=c, family=mode))
    # twins of full and the primary fused variant with compile_steps forced: only when named in `only`
    twins = [Variant(f"{mode}_{suffix}" + (f" c={primary_chunk}" if mode == "raincheck" else ""), "raincheck", turns,
                     mode=mode, chunk_size=primary_chunk, family=f"{mode}_{suffix}", compiled=forced)
             for suffix, forced in (("uncompiled", False), ("compiled", True)) for mode in ("full", "raincheck")]
    if not only:
        return variants
    variants += twins
    if only:
        only = set(only)
        unknown = only - {v.name for v in variants} - {v.family for v in variants}
        if unknown:
            raise ValueError(f"--variants: unknown {sorted(unknown)}; choose from "
                             f"{sorted({v.family for v in variants} | {v.name for v in variants})}.")
        variants = [v for v in variants if v.name in only or v.family in only]
    return variants


# ---- clocks -------------------------------------------------------------------------------------

def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TokenClock(BaseStreamer):
    """Streamer recording when each generated token reaches the host: the time ``put`` is handed it.

    The first ``put`` is the prompt (HF's `generate` and the Raincheck loops all send it first) and
    is not a token. Every loop measured here hands over host tensors, whose read already waited for the
    step that made them (stock `generate`'s ``next_tokens.cpu()``, the single-sequence loop's, the batched
    engine's one read a step), so the clock waits for nothing itself; a token handed over on the device is
    synchronized first. It must not wait otherwise: the batched engine (`batch_engine.batched_sample`)
    launches its next step before it hands over this step's tokens, and a device-wide wait there held the
    host until that next step had ended, so its preparation of the one after never overlapped the device
    (every `bench batch` figure at B > 1 until 2026-12-06 paid that on each step; stock
    `generate` and batch-1 calls did not)."""

    def __init__(self, device: torch.device):
        self.device, self.times, self._prompt_seen = device, [], False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _reset_memory(device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_memory(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def timed_generate(model, device, kwargs) -> tuple[object, dict]:
    """``model.generate(**kwargs)`` with a `TokenClock`; returns the output and the turn's timings."""
    clock = TokenClock(device)
    mem_before = _reset_memory(device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(**kwargs, streamer=clock)
    _sync(device)
    end = time.perf_counter()
    times = clock.times
    prompt_len = kwargs["input_ids"].shape[1]
    record = {
        "ttft_s": times[0] - start if times else None,
        "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        "median_interval_s": statistics.median([b - a for a, b in zip(times, times[1:])]) if len(times) > 1 else None,
        "e2e_s": end - start,
        "generated_tokens": int(out.sequences.shape[1] - prompt_len),
        "streamed_tokens": len(times),
        "prompt_tokens": int(prompt_len),
        "peak_mem_bytes": _peak_memory(device),
        "mem_before_bytes": mem_before,
        "_intervals": [b - a for a, b in zip(times, times[1:])],
    }
    return out, record


def _trace_fields(out, record: dict) -> dict:
    """Restoration counts and TPOT split by whether a decode step carried a chunk (Raincheck outputs)."""
    trace = getattr(out, "raincheck", None)
    if trace is None:
        return {}
    per_forward = [int(r.numel()) for r in trace.restored_per_forward]
    chosen = {}
    for size in getattr(trace, "chunk_size_per_forward", [])[1:]:
        if size:
            chosen[str(size)] = chosen.get(str(size), 0) + 1
    intervals = record["_intervals"]  # intervals[k - 1] is decode forward k
    carrying = [intervals[k - 1] for k in range(1, len(per_forward)) if per_forward[k] and k - 1 < len(intervals)]
    plain = [intervals[k - 1] for k in range(1, len(per_forward)) if not per_forward[k] and k - 1 < len(intervals)]
    return {
        "selected_tokens": int(trace.selected.numel()),
        "deferred_tokens": int(trace.deferred.numel()),
        "restored_in_prefill": per_forward[0] if per_forward else 0,
        "restored_during_answer": int(sum(per_forward[1:])),
        "steps_with_chunk": len(carrying),
        "chunk_sizes_chosen": chosen,
        # CUDA-graph captures of step shapes during the answer's decode forwards: [forward, rows, seconds] each
        "decode_captures": [[f, rows, round(s, 4)] for f, rows, s in getattr(trace, "captures", []) if f > 0],
        "pending_after": int(trace.pending.numel()),
        "dropped_tokens": int(trace.dropped.numel()),
        "tpot_restoring_s": statistics.fmean(carrying) if carrying else None,
        "tpot_plain_s": statistics.fmean(plain) if plain else None,
        # whether the fast path's steps ran compiled (`RaincheckConfig.compile_steps` as the call resolved it)
        "steps_compiled": bool(getattr(getattr(out, "cache", None), "compile_steps", False)),
    }


# ---- one conversation ---------------------------------------------------------------------------

@dataclass
class Context:
    """Everything a variant's conversation needs for one (model, input)."""

    model: object
    processor: object
    device: torch.device
    first_inputs: dict
    settings: dict
    raincheck_supported: bool
    static_max_cache_len: int
    suppress: list = field(default_factory=list)
    shared: dict = field(default_factory=dict)  # per model, across inputs: the reused StaticCache, compile state

    def reused_static_cache(self):
        if self.shared.get("static_cache") is None:
            from transformers import StaticCache

            self.shared["static_cache"] = StaticCache(config=self.model.config.get_text_config(decoder=True),
                                                      max_cache_len=self.static_max_cache_len)
        return self.shared["static_cache"]


def _generate_kwargs(ctx: Context, variant: Variant, n_tokens: int, first_turn: bool) -> dict:
    kw = dict(max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False, suppress_tokens=ctx.suppress,
              return_dict_in_generate=True)
    if variant.kind == "raincheck":
        kw["raincheck"] = variant.config(ctx.settings)
    elif variant.cache == "static" and first_turn:
        kw.update(cache_implementation="static", max_cache_len=ctx.static_max_cache_len)
    elif variant.cache == "static_reused" and first_turn:
        cache = ctx.reused_static_cache()
        cache.reset()  # same tensors every conversation: CUDA graphs replay at the same addresses
        kw["cache"] = cache
    return kw


def _turn_inputs(ctx: Context, ids: torch.Tensor, cache) -> dict:
    ids = ids.to(ctx.device)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache)


def run_conversation(ctx: Context, variant: Variant, answer_tokens: int, follow_up_tokens: int,
                     turns: int | None = None, idle_probe: bool = True, keep_intervals: bool = True) -> dict:
    """Run ``turns`` turns of ``variant`` (its own count when None); the timings of every turn and the idle probe."""
    from ..generation import restore_pending

    turns = variant.turns if turns is None else turns
    model, device = ctx.model, ctx.device
    records = []
    kw = dict(ctx.first_inputs, **_generate_kwargs(ctx, variant, answer_tokens, True))
    out, rec = timed_generate(model, device, kw)
    rec.update(_trace_fields(out, rec))
    records.append(rec)
    idle = None
    if turns >= 2 and idle_probe:
        # the follow-up after an idle gap, on a copy of the state right after turn 1
        cache = copy.deepcopy(out.cache)
        restored = chunks = 0
        _sync(device)
        start = time.perf_counter()
        if getattr(cache, "num_pending", 0):
            while True:
                r = restore_pending(model, cache, max_tokens=variant.config(ctx.settings).idle_chunk_size)
                if r.numel() == 0:
                    break
                restored, chunks = restored + int(r.numel()), chunks + 1
        _sync(device)
        restore_s = time.perf_counter() - start
        ids = shapes.follow_up_ids(ctx.processor, out.sequences, shapes.FOLLOW_UPS[0])
        probe_kw = dict(_turn_inputs(ctx, ids, cache), **_generate_kwargs(ctx, variant, 1, False))
        probe, probe_rec = timed_generate(model, device, probe_kw)
        idle = {"restore_s": restore_s, "restored_tokens": restored, "restore_chunks": chunks,
                "ttft_s": probe_rec["ttft_s"], "peak_mem_bytes": probe_rec["peak_mem_bytes"],
                "restored_in_prefill": _trace_fields(probe, probe_rec).get("restored_in_prefill")}
        del cache, probe
    cache, sequences = out.cache, out.sequences
    del out
    for k in range(2, turns + 1):
        ids = shapes.follow_up_ids(ctx.processor, sequences, shapes.FOLLOW_UPS[(k - 2) % len(shapes.FOLLOW_UPS)])
        kw = dict(_turn_inputs(ctx, ids, cache), **_generate_kwargs(ctx, variant, follow_up_tokens, False))
        out, rec = timed_generate(model, device, kw)
        rec.update(_trace_fields(out, rec))
        records.append(rec)
        cache, sequences = out.cache, out.sequences
        del out
    del cache
    for i, rec in enumerate(records):
        intervals = rec.pop("_intervals")
        if keep_intervals and i == 0:
            rec["token_intervals_ms"] = [round(x * 1e3, 4) for x in intervals]
    return {"turns": records, "idle": idle}


# ---- summaries ----------------------------------------------------------------------------------

def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(reps: list[dict]) -> dict:
    """Medians over repetitions of the per-conversation metrics (seconds, bytes)."""
    if not reps:
        return {}
    n_turns = max(len(r["turns"]) for r in reps)
    out = {}
    for k in range(1, n_turns + 1):
        turn = [r["turns"][k - 1] for r in reps if len(r["turns"]) >= k]
        out[f"t{k}_s"] = _median([t["ttft_s"] for t in turn])
        out[f"tpot{k}_s"] = _median([t["tpot_s"] for t in turn])
        out[f"e2e{k}_s"] = _median([t["e2e_s"] for t in turn])
        if k == 1:
            out["tpot1_restoring_s"] = _median([t.get("tpot_restoring_s") for t in turn])
            out["tpot1_plain_s"] = _median([t.get("tpot_plain_s") for t in turn])
            out["tpot1_median_interval_s"] = _median([t.get("median_interval_s") for t in turn])
    out["e2e_total_s"] = _median([sum(t["e2e_s"] for t in r["turns"]) for r in reps])
    peaks = [max((t["peak_mem_bytes"] for t in r["turns"] if t["peak_mem_bytes"] is not None), default=None)
             for r in reps]
    out["peak_mem_bytes"] = _median(peaks)
    idles = [r["idle"] for r in reps if r.get("idle")]
    if idles:
        out["t2_idle_s"] = _median([i["ttft_s"] for i in idles])
        out["idle_restore_s"] = _median([i["restore_s"] for i in idles])
        out["t2_barrier_s"] = _median([i["restore_s"] + i["ttft_s"] for i in idles if i["ttft_s"] is not None])
    return {k: v for k, v in out.items() if v is not None}


RATIO_METRICS = ("t1_s", "tpot1_s", "e2e1_s", "t2_s", "tpot2_s", "t3_s", "tpot3_s", "t2_idle_s", "t2_barrier_s",
                 "e2e_total_s", "peak_mem_bytes")


def add_ratios(variants: dict) -> None:
    for ref in ("stock_dynamic", "full"):
        base = variants.get(ref, {}).get("median", {})
        for entry in variants.values():
            med = entry.get("median", {})
            ratios = {m: med[m] / base[m] for m in RATIO_METRICS if m in med and base.get(m)}
            if ratios:
                entry[f"ratio_to_{ref}"] = ratios


def check_lengths(variants: dict, answer_tokens: int, follow_up_tokens: int) -> dict:
    """Whether every variant generated exactly the requested tokens in every turn of every repetition."""
    bad = []
    for name, entry in variants.items():
        for r, rep in enumerate(entry.get("reps", [])):
            for k, turn in enumerate(rep["turns"]):
                want = answer_tokens if k == 0 else follow_up_tokens
                if turn["generated_tokens"] != want or turn["streamed_tokens"] != want:
                    bad.append(f"{name} rep {r} turn {k + 1}: {turn['generated_tokens']} (want {want})")
    return {"consistent": not bad, "mismatches": bad}


# ---- hardware -----------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(device: torch.device) -> dict:
    import importlib.metadata as md

    import transformers

    versions = {}
    for pkg in ("raincheck_hf", "fla-core", "flash-linear-attention", "flash-attn", "triton", "accelerate"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    info = {
        "platform": platform.platform(), "python": platform.python_version(), "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "cuda_runtime": torch.version.cuda, "packages": versions,
        "device": str(device), "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_memory_bytes=props.total_memory,
                    gpu_count=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
    return info


# ---- the run ------------------------------------------------------------------------------------

def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> dict:
    """Memory bandwidth as a large device-to-device copy moves it (bytes read + written per second), the
    yardstick of the decode floor (a 4 GiB copy on a GPU, 256 MiB on a CPU)."""
    nbytes = int(nbytes or (4 * 2**30 if device.type == "cuda" else 256 * 2**20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    seconds = statistics.median(times)
    return {"copy_bytes": nbytes, "copy_median_s": seconds, "bandwidth_bytes_per_s": 2 * nbytes / seconds}


def decode_bytes(model, context_tokens: int) -> dict:
    """What one decode step must read at least: the language model's weights (the input embedding table
    only where the output head shares it: a step reads one row of it otherwise; the issue's 16.4 GB anchor
    for the Qwen3-VL-8B shape counted it, this counts 15.1 GB; of an MoE layer's experts only the share a token
    routes to, ``num_experts_per_tok / num_experts``), the KV of
    ``context_tokens`` in every full-attention layer, and each linear-attention layer's state (read and
    written)."""
    text_config = model.config.get_text_config()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    # MoE: a decode token reads its num_experts_per_tok of num_experts experts (their share of the expert tensors)
    expert_share = getattr(text_config, "num_experts_per_tok", 1) / getattr(text_config, "num_experts", 1)
    weights = sum(p.numel() * p.element_size() * (expert_share if ".experts." in f".{name}" else 1)
                  for name, p in model.named_parameters()
                  if ".visual." not in f".{name}" and (p is not embed or p is head))
    weights = int(weights)
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
    full = sum(t == "full_attention" for t in layer_types)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    kv = 2 * full * text_config.num_key_value_heads * head_dim * embed.element_size() * int(context_tokens)
    linear = len(layer_types) - full
    state = 0
    if linear:
        heads = getattr(text_config, "linear_num_value_heads", 0)
        dk = getattr(text_config, "linear_key_head_dim", 0)
        dv = getattr(text_config, "linear_value_head_dim", 0)
        state = 2 * linear * heads * dk * dv * 4  # float32 recurrent state, read and written
    return {"weight_bytes": weights, "kv_bytes": kv, "linear_state_bytes": state, "context_tokens": int(context_tokens),
            "total_bytes": weights + kv + state}


def add_floor_ratios(run_entry: dict) -> None:
    """``tpot_plain_over_floor`` per variant: its turn-1 decode step (steps without a chunk) over the floor."""
    floor = (run_entry.get("memory_floor") or {}).get("floor_s")
    if not floor:
        return
    for entry in run_entry["variants"].values():
        plain = (entry.get("median") or {}).get("tpot1_plain_s") or (entry.get("median") or {}).get("tpot1_s")
        if plain:
            entry["tpot_plain_over_floor"] = plain / floor


def _static_max_cache_len(prompts: list[int], answer_tokens: int, follow_up_tokens: int, turns: int) -> int:
    # each follow-up adds the glue, its question (< 64 tokens with the tiny tokenizer) and its answer
    need = max(prompts) + answer_tokens + (turns - 1) * (64 + follow_up_tokens) + 16
    return -(-need // 256) * 256


COMPACT_ABOVE = 256_000  # characters of indented JSON beyond which `_write` writes it compactly


def _write(result: dict, path: str | None):
    """``result`` as JSON at ``path`` (its folder made; written whole, then moved into place); None: nothing.
    Indented, unless that comes to more than `COMPACT_ABOVE` characters (a load run's every request): then without
    spaces or line breaks, the same data in about two thirds of the bytes."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = json.dumps(result, indent=1)
    if len(text) > COMPACT_ABOVE:
        text = json.dumps(result, separators=(",", ":"))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def write_script_result(script: str, argv, path: str | None, **fields) -> dict:
    """A CPU profiling script's result (``benchmarks/<script>``): its command line (``argv``, None: this process's),
    this machine's hardware and ``fields``, written as JSON at ``path`` (`_write`; None: not written); returned."""
    args = list(argv if argv is not None else sys.argv[1:])
    result = {**{k: v for k, v in fields.items() if k in ("benchmark", "what")},
              "command": " ".join([f"python benchmarks/{script}", *args]),
              **{k: v for k, v in fields.items() if k not in ("benchmark", "what")},
              "hardware": hardware_info(torch.device("cpu"))}
    _write(result, path)
    return result


@dataclass(frozen=True)
class LatencySettings:
    """What one latency run measures: `run`'s keyword arguments (`main`'s options), checked and completed
    (defaults resolved) before any model is built.

    ``follow_up_tokens`` defaults to ``answer_tokens``; ``selector`` to the library's default; ``primary_chunk``
    (the chunk size that runs every turn) to 31 when swept, else the first size; ``warmup_tokens`` to
    ``min(answer_tokens, decode_guard + 4)``; ``variants`` names a subset (None: every variant).
    """

    models: tuple = ("tiny_qwen3_vl",)
    inputs: tuple = ("image",)
    turns: int = 2
    answer_tokens: int = 8
    follow_up_tokens: int | None = None
    reps: int = 1
    chunk_sizes: tuple = DEFAULT_CHUNK_SIZES
    primary_chunk: int | str | None = None
    sweep_turns: int = 1
    variants: tuple | None = None
    retention: float = 0.3
    decode_guard: int = RaincheckConfig.decode_guard
    tpot_slack: float = 0.02
    compile_steps: bool | None = None
    selector: str | None = None
    warmup: bool = True
    warm_up_api: bool = False
    warmup_tokens: int | None = None
    idle_probe: bool = True
    budget_s: float | None = None
    dtype: object = None
    image_size: tuple | None = None
    video_frames: int | None = None
    video_size: tuple | None = None
    static_max_cache_len: int | None = None
    json_path: str | None = None
    strict: bool = False
    keep_intervals: bool = True
    command: str | None = None

    def __post_init__(self):
        from ..configuration import RaincheckConfig

        def put(name, value):
            object.__setattr__(self, name, value)

        put("models", tuple(self.models))
        put("inputs", tuple(self.inputs))
        put("variants", None if self.variants is None else tuple(self.variants))
        put("follow_up_tokens", self.answer_tokens if self.follow_up_tokens is None else self.follow_up_tokens)
        put("chunk_sizes", tuple(parse_chunk_spec(c) for c in self.chunk_sizes))
        if (self.turns < 1 or self.answer_tokens < 1 or self.follow_up_tokens < 1 or self.reps < 1
                or not self.chunk_sizes):
            raise ValueError("turns, answer tokens, follow-up tokens and reps must be >= 1, and there must be a chunk size.")
        if self.selector is None:
            put("selector", RaincheckConfig().selector)  # what a user gets by default
        put("primary_chunk", parse_chunk_spec(self.primary_chunk) if self.primary_chunk else (
            31 if 31 in self.chunk_sizes else self.chunk_sizes[0]))
        if self.primary_chunk not in self.chunk_sizes:
            raise ValueError(f"primary chunk size {self.primary_chunk} is not among the chunk sizes "
                             f"{list(self.chunk_sizes)}.")
        for c in self.chunk_sizes:  # invalid settings fail here, before any model is built
            size, every = split_chunk_spec(c)
            RaincheckConfig(retention=self.retention, chunk_size=size, chunk_every=every, decode_guard=self.decode_guard,
                            selector=self.selector, tpot_slack=self.tpot_slack, compile_steps=self.compile_steps)
        for name in self.models:
            if name not in shapes.MODELS:
                raise ValueError(f"unknown model {name!r}; choose from {sorted(shapes.MODELS)}.")
        for kind in self.inputs:
            if kind not in shapes.QUESTIONS:
                raise ValueError(f"unknown input {kind!r}; choose from {sorted(shapes.QUESTIONS)}.")
        put("warmup_tokens", self.warmup_tokens or min(self.answer_tokens, self.decode_guard + 4))


def run(device=None, threads: int | None = None, log=print, **settings) -> dict | list[dict]:
    """Run the benchmark in-process; returns (and writes to ``json_path``) the result dict.

    ``settings``: `LatencySettings`' fields (checked before any model is built). ``answer_tokens`` may be a list
    of lengths: each is a run of its own (its own result and JSON file: ``json_path`` must then hold
    ``{answer_tokens}``, e.g. ``latency_{answer_tokens}.json``) on the same model, built and warmed once; a list
    of the results is returned. ``threads``: torch intra-op threads; on CPU the default is 1 (tiny models gain
    nothing from more, and on a shared machine spinning thread pools distort the timings), on CUDA torch's
    default.
    """
    started = time.perf_counter()
    lengths = settings.get("answer_tokens", LatencySettings.answer_tokens)
    several = not isinstance(lengths, int)
    lengths = list(lengths) if several else [lengths]
    path = settings.get("json_path")
    if several and path is not None and "{answer_tokens}" not in path:
        raise ValueError(f"json_path={path!r}: with several answer lengths ({lengths}) it must hold "
                         "'{answer_tokens}', one file per length")
    if not lengths or len(set(lengths)) != len(lengths):
        raise ValueError(f"answer_tokens={lengths!r}: give one length or several different ones")
    runs = []
    for n in lengths:
        one = dict(settings, answer_tokens=n)
        if several and path is not None:
            one["json_path"] = path.replace("{answer_tokens}", str(n))
        if settings.get("warmup_tokens") == "answer":
            one["warmup_tokens"] = n
        runs.append(LatencySettings(**one))
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    variant_list = build_variants(runs[0].chunk_sizes, runs[0].primary_chunk, runs[0].turns, runs[0].sweep_turns,
                                  runs[0].variants)
    previous_threads = torch.get_num_threads()
    if threads is not None or device.type == "cpu":
        torch.set_num_threads(threads or 1)
    try:
        results = _run(runs, started, device, variant_list, log)
    finally:
        torch.set_num_threads(previous_threads)
    return results if several else results[0]


def _new_result(s: "LatencySettings", settings: dict, device, variant_list) -> dict:
    return {
        "benchmark": "latency",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": s.command or " ".join(["python -m raincheck_hf.bench latency"] + sys.argv[2:]),
        "hardware": hardware_info(device),
        "settings": dict(settings, models=list(s.models), inputs=list(s.inputs), turns=s.turns, answer_tokens=s.answer_tokens,
                         follow_up_tokens=s.follow_up_tokens, reps=s.reps, chunk_sizes=list(s.chunk_sizes),
                         primary_chunk=s.primary_chunk, sweep_turns=s.sweep_turns, warmup=s.warmup,
                         warmup_tokens=s.warmup_tokens, warm_up_api=s.warm_up_api, idle_probe=s.idle_probe,
                         budget_s=s.budget_s, variants=[v.name for v in variant_list]),
        "runs": [],
    }


def _run(runs: list["LatencySettings"], started: float, device, variant_list, log) -> list[dict]:
    """Every model of the settings, built once; on it, every input, and for each, every run (answer length) in
    turn, each into its own result."""
    s = runs[0]  # what the runs share: all but the answer length, the warm-up length and the JSON path
    settings = dict(retention=s.retention, decode_guard=s.decode_guard, selector=s.selector, tpot_slack=s.tpot_slack,
                    compile_steps=s.compile_steps)
    results = [_new_result(r, settings, device, variant_list) for r in runs]
    processor = shapes.build_processor()
    suppress = shapes.special_token_ids(processor)

    def over_budget(extra: float = 0.0) -> bool:
        return s.budget_s is not None and time.perf_counter() - started + extra > s.budget_s

    def skip_all(entry: dict) -> None:
        for r, result in zip(runs, results):
            result["runs"].append(dict(entry))
            _write(result, r.json_path)

    for model_name in s.models:
        if over_budget():
            skip_all({"model": model_name, "status": f"skipped: time budget {s.budget_s} s spent"})
            continue
        try:
            model, model_info = shapes.build_model(model_name, device, dtype=s.dtype)
        except ValueError as error:
            log(f"[latency] skipping {model_name}: {error}")
            skip_all({"model": model_name, "status": f"skipped: {error}"})
            continue
        log(f"[latency] {model_name}: {model_info['class']} {model_info['parameters'] / 1e9:.3f} B params, "
            f"{model_info['dtype']} on {device}, built in {model_info['build_s']:.1f} s")
        raincheck_error = None
        try:
            from ..integration import enable

            enable(model)
        except ValueError as error:  # e.g. no adapter for this family yet
            raincheck_error = str(error)
            log(f"[latency] {model_name}: Raincheck modes unsupported: {error}")
        spec = shapes.MODELS[model_name]
        prompts = {kind: shapes.build_prompt(processor, spec, kind, s.image_size, s.video_frames, s.video_size)
                   for kind in s.inputs}
        cache_len = s.static_max_cache_len or max(_static_max_cache_len(
            [info["prompt_tokens"] for _, info in prompts.values()], r.answer_tokens, r.follow_up_tokens, r.turns)
            for r in runs)
        shared = {"static_compile_measured": False}  # per model: the compiled decode step, the reused StaticCache
        bandwidth = measure_copy_bandwidth(device)
        log(f"[latency] copy bandwidth {bandwidth['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (bytes read + written, "
            f"{bandwidth['copy_bytes'] / 2**30:.2f} GiB copy)")
        for kind in s.inputs:
            first_inputs, prompt_info = prompts[kind]
            for r, result in zip(runs, results):
                if over_budget():
                    result["runs"].append({"model": model_name, "input": kind,
                                           "status": f"skipped: time budget {s.budget_s} s spent"})
                    _write(result, r.json_path)
                    continue
                ctx = Context(model, processor, device, {k: v.to(device) for k, v in first_inputs.items()}, settings,
                              raincheck_error is None, cache_len, suppress, shared)
                # the floor at the first answer's mean context: the prompt plus half the answer
                step_bytes = decode_bytes(model, prompt_info["prompt_tokens"] + r.answer_tokens // 2)
                floor = {**step_bytes, **bandwidth,
                         "floor_s": step_bytes["total_bytes"] / bandwidth["bandwidth_bytes_per_s"]}
                run_entry = {"model": model_name, "input": kind, "status": "ok", "model_info": model_info,
                             "prompt": prompt_info, "primary_chunk": r.primary_chunk, "static_max_cache_len": cache_len,
                             "memory_floor": floor, "warmup": {}, "variants": {}}
                result["runs"].append(run_entry)
                if len(runs) > 1:
                    log(f"[latency] {model_name} / {kind}: {r.answer_tokens}-token answers")
                _run_one(r, ctx, run_entry, variant_list, raincheck_error, over_budget, started, result, log)
                print_table(run_entry, log)
                del ctx
        del model, shared
        gc.collect()
        torch.compiler.reset()  # drop the compiled decode step (and its CUDA graphs) with the model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r, result in zip(runs, results):
        result["elapsed_s"] = time.perf_counter() - started
        _write(result, r.json_path)
    return results


def _warm_up_api(s: "LatencySettings", ctx, run_entry, active, log) -> None:
    """`raincheck_hf.warm_up` for each Raincheck variant's config before anything is timed, as the CLI, the demo
    and the server call it at start: every step graph the variant's conversations can need is captured here, so
    the timed answers' traces should show no capture (``timed_captures`` says whether they did)."""
    from ..warmup import warm_up

    info = run_entry["prompt"]
    done = {}
    for v in active:
        if v.kind != "raincheck":
            continue
        config = v.config(ctx.settings)
        t0 = time.perf_counter()
        summary = warm_up(ctx.model, ctx.processor, config, max_tokens=ctx.static_max_cache_len,
                          max_new_tokens=max(s.answer_tokens, s.warmup_tokens),
                          prompt_tokens=info["prompt_tokens"], follow_up_tokens=max(64, s.follow_up_tokens + 64),
                          cache_dir=False, progress=False)
        done[v.name] = {"seconds": round(time.perf_counter() - t0, 3), "path": summary.path,
                        "graphs_captured": len(summary.captured), "already_captured": summary.already_captured,
                        "coverage": summary.coverage}
        log(f"[latency]   warm_up({v.name}): {done[v.name]['seconds']:.1f} s, {len(summary.captured)} graphs captured "
            f"({summary.already_captured} already)")
    run_entry["warmup"]["api"] = done


def _run_one(s: "LatencySettings", ctx, run_entry, variant_list, raincheck_error, over_budget, started, result, log):
    """Warm-up and repetitions of every variant for one (model, input); fills ``run_entry``."""
    device, settings = ctx.device, ctx.settings
    estimates = {}  # variant name -> a first-turn record, for the time budget
    active = []
    for v in variant_list:
        entry = {"kind": v.kind, "family": v.family, "mode": v.mode, "chunk_size": v.chunk_size, "turns": v.turns,
                 "status": "ok", "reps": []}
        if v.kind == "raincheck":
            made = v.config(settings)
            entry["config"] = dict(settings, chunk_size=made.chunk_size, chunk_every=made.chunk_every, mode=v.mode,
                                   compile_steps=made.compile_steps)
            if raincheck_error is not None:
                entry["status"] = f"unsupported: {raincheck_error}"
        elif v.cache == "static":
            entry["config"] = {"cache_implementation": "static", "max_cache_len": ctx.static_max_cache_len,
                               "continuation": "later turns pass the returned StaticCache as cache="}
        elif v.cache == "static_reused":
            entry["config"] = {"cache": "one StaticCache per model, reset() before every conversation",
                               "max_cache_len": ctx.static_max_cache_len}
        run_entry["variants"][v.name] = entry
        if entry["status"] == "ok":
            active.append(v)
    info = run_entry["prompt"]
    log(f"[latency] {run_entry['model']} / {run_entry['input']}: prompt {info['prompt_tokens']} tokens "
        f"({info['visual_tokens']} visual, grid {info['grid_thw']}); {len(active)} variants")

    def attempt(v, fn):
        entry = run_entry["variants"][v.name]
        try:
            with torch.no_grad():
                return fn()
        except Exception as error:  # recorded, so one broken variant does not hide the others
            if s.strict:
                raise
            entry["status"] = f"error: {type(error).__name__}: {error}"
            entry["traceback"] = traceback.format_exc(limit=8)
            log(f"[latency]   {v.name}: {entry['status']}")
            return None
        finally:
            gc.collect()

    if s.warm_up_api:
        _warm_up_api(s, ctx, run_entry, active, log)
    if s.warmup:
        for v in active:
            if over_budget():
                break  # what is not warmed up is not timed either: its estimate is unknown and the budget spent
            static = v.cache in ("static", "static_reused")
            # two turns: the follow-up's prefill shape is captured (fast path) or compiled (stock static) here too
            n_turns = min(v.turns, 2)
            # the model's first static variant runs twice: the first call compiles, the second shows what is left
            calls = 2 if static and not ctx.shared["static_compile_measured"] else 1
            walls = []
            while len(walls) < calls:
                _sync(device)
                t0 = time.perf_counter()
                done = attempt(v, lambda: run_conversation(ctx, v, s.warmup_tokens, s.warmup_tokens, n_turns,
                                                           idle_probe=False, keep_intervals=False))
                if done is None:
                    break
                walls.append(time.perf_counter() - t0)
                estimates[v.name] = done["turns"][0]
                if not static and len(walls) == 1 and walls[0] > SLOW_FIRST_WARMUP_S and not over_budget():
                    # a slow first call (kernel autotuning: fla's Triton kernels on Qwen3.5 took ~60 s) once more,
                    # so that the time budget estimates this variant from a warm call, not from the tuning
                    calls = 2
            if static and walls:
                w = {"tokens_per_turn": s.warmup_tokens, "turns": n_turns, "calls_s": walls,
                     "compiled": hasattr(ctx.model, "_compiled_call")}
                if len(walls) == 2:
                    w["first_minus_second_s"] = walls[0] - walls[1]
                    w["note"] = ("the first call of this model's first static variant includes torch.compile and "
                                 "CUDA-graph capture of the decode step when compiled=True; first_minus_second_s "
                                 "estimates that one-time cost")
                    ctx.shared["static_compile_measured"] = True
                run_entry["warmup"][v.name] = w
            elif walls:
                run_entry["warmup"].setdefault("other_s", {})[v.name] = walls[0]
                if len(walls) == 2:
                    run_entry["warmup"].setdefault("other_repeated_s", {})[v.name] = walls[1]
        active = [v for v in active if run_entry["variants"][v.name]["status"] == "ok"]
        static_info = {k: (round(w["calls_s"][0], 2), w["compiled"]) for k, w in run_entry["warmup"].items()
                       if k not in ("other_s", "other_repeated_s", "api")}
        log(f"[latency]   warm-up done at {time.perf_counter() - started:.1f} s; static (first call s, compiled): "
            f"{static_info}")
        others = run_entry["warmup"].get("other_s", {})
        if others:
            log("[latency]   warm-up, first call s: " + ", ".join(f"{k} {w:.2f}" for k, w in others.items()))

    def expected_s(v) -> float:
        # from the variant's warm-up (or measured) first turn: a prefill per turn plus every token's step; the
        # median step, so that a one-time stall (a compile, a graph capture in a short warm-up) does not inflate it
        rec = estimates.get(v.name)
        if rec is None or rec.get("ttft_s") is None:
            return 0.0
        per_token = rec.get("median_interval_s") or rec.get("tpot_s") or rec["ttft_s"]
        n = v.turns
        return (n + (1 if n >= 2 and s.idle_probe else 0)) * rec["ttft_s"] + per_token * (
            s.answer_tokens + (n - 1) * s.follow_up_tokens)

    def save():
        for entry in run_entry["variants"].values():
            entry["median"] = summarize(entry["reps"])
        add_ratios(run_entry["variants"])
        add_floor_ratios(run_entry)
        run_entry["lengths"] = check_lengths(run_entry["variants"], s.answer_tokens, s.follow_up_tokens)
        run_entry["rep_wall_s"] = rep_times
        run_entry["timed_captures"] = {
            name: sum(len(t.get("decode_captures") or []) for r in entry["reps"] for t in r["turns"])
            for name, entry in run_entry["variants"].items() if entry["kind"] == "raincheck"}
        result["elapsed_s"] = time.perf_counter() - started
        _write(result, s.json_path)

    rep_times = []
    for rep in range(s.reps):
        t_rep = time.perf_counter()
        order = active[rep % len(active):] + active[: rep % len(active)] if active else []
        for v in order:
            entry = run_entry["variants"][v.name]
            if over_budget(expected_s(v)):
                entry.setdefault("budget_skipped_reps", []).append(rep)
                log(f"[latency]   {v.name}: rep {rep + 1} skipped, it would end past the time budget ({s.budget_s} s)")
                continue
            conv = attempt(v, lambda: run_conversation(ctx, v, s.answer_tokens, s.follow_up_tokens,
                                                       idle_probe=s.idle_probe, keep_intervals=s.keep_intervals))
            if conv is not None:
                entry["reps"].append(conv)
                estimates[v.name] = conv["turns"][0]
            save()  # after every conversation, so a run cut short keeps what it measured
        active = [v for v in active if run_entry["variants"][v.name]["status"] == "ok"]
        rep_times.append(time.perf_counter() - t_rep)
        save()
        log(f"[latency]   rep {rep + 1}/{s.reps} done in {rep_times[-1]:.1f} s")
    skipped = sum(bool(e.get("budget_skipped_reps")) for e in run_entry["variants"].values())
    if skipped:
        run_entry["status"] = f"ok, but {skipped} variants lost repetitions to the time budget ({s.budget_s} s)"


# ---- output -------------------------------------------------------------------------------------

def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _ratio(x):
    return "-" if x is None else f"{x:.2f}"


def print_table(run_entry: dict, log=print) -> None:
    info = run_entry.get("prompt", {})
    log(f"\n{run_entry['model']} / {run_entry['input']}: prompt {info.get('prompt_tokens')} tokens "
        f"({info.get('visual_tokens')} visual); medians (ms unless noted); lengths consistent: "
        f"{run_entry.get('lengths', {}).get('consistent')}")
    floor = run_entry.get("memory_floor")
    if floor:
        log(f"decode floor {floor['floor_s'] * 1e3:.2f} ms: {floor['total_bytes'] / 1e9:.2f} GB per step (weights "
            f"{floor['weight_bytes'] / 1e9:.2f}, KV of {floor['context_tokens']} tokens {floor['kv_bytes'] / 1e9:.3f}, "
            f"linear-attention state {floor['linear_state_bytes'] / 1e9:.3f}) at "
            f"{floor['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    cols = ["variant", "T1", "TPOT1", "TPOT1 rest", "E2E1 s", "T2", "T2 idle", "idle rest", "T2 barrier",
            "peak GiB", "T1/stock", "TPOT/stock", "T1/full", "step/floor"]
    widths = [20, 8, 7, 11, 7, 8, 8, 10, 11, 9, 9, 11, 8, 11]
    log("".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    for name, entry in run_entry["variants"].items():
        if not entry.get("reps"):
            status = entry["status"] if entry["status"] != "ok" else "no repetition ran (time budget)"
            log(f"{name:<20}{status[:110]}")
            continue
        m = entry.get("median", {})
        rs = entry.get("ratio_to_stock_dynamic", {})
        rf = entry.get("ratio_to_full", {})
        peak = m.get("peak_mem_bytes")
        e2e = m.get("e2e1_s")
        cells = [name, _ms(m.get("t1_s")), _ms(m.get("tpot1_s")), _ms(m.get("tpot1_restoring_s")),
                 "-" if e2e is None else f"{e2e:.2f}", _ms(m.get("t2_s")), _ms(m.get("t2_idle_s")),
                 _ms(m.get("idle_restore_s")), _ms(m.get("t2_barrier_s")),
                 "-" if peak is None else f"{peak / 2**30:.2f}", _ratio(rs.get("t1_s")), _ratio(rs.get("tpot1_s")),
                 _ratio(rf.get("t1_s")), _ratio(entry.get("tpot_plain_over_floor"))]
        log("".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    warm = run_entry.get("warmup") or {}
    firsts = {**{k: w["calls_s"][0] for k, w in warm.items() if isinstance(w, dict) and "calls_s" in w},
              **warm.get("other_s", {})}
    if firsts:
        log("warm-up (first call, s; graph captures / compiles included): "
            + ", ".join(f"{k} {v:.2f}" for k, v in firsts.items()))
    for name, entry in run_entry["variants"].items():
        chosen = [t.get("chunk_sizes_chosen") for r in entry.get("reps", []) for t in r["turns"][:1]]
        if entry.get("chunk_size") == "auto" and chosen:
            log(f"{name}: chunk sizes chosen in turn 1 (steps per size, per repetition): {chosen}")
        captured = [t.get("decode_captures") for r in entry.get("reps", []) for t in r["turns"][:1]]
        if any(captured):
            log(f"{name}: step captures during the turn-1 answer ([forward, rows, s], per repetition): {captured}")
    if run_entry.get("timed_captures"):
        log("graph captures during the timed answers (every turn, every repetition): "
            + ", ".join(f"{k} {n}" for k, n in run_entry["timed_captures"].items()))



def _size(text: str) -> tuple[int, int]:
    w, h = text.lower().split("x")
    return int(w), int(h)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_qwen3_vl",
                        help=f"comma-separated, from {sorted(shapes.MODELS)} (default tiny_qwen3_vl)")
    parser.add_argument("--input", default="image", help="comma-separated, from image,video (default image)")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation (1: no follow-up metrics)")
    parser.add_argument("--answer-tokens", default="512", help="tokens of every first-turn answer; several "
                        "(e.g. 64,128,512): a run each on the same model, built and warmed once, --json holding "
                        "'{answer_tokens}' (one file per length)")
    parser.add_argument("--follow-up-tokens", type=int, default=None, help="tokens of follow-up answers "
                        "(default: --answer-tokens)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-sizes", default="7,15,31,63", help="chunk sizes swept for raincheck and serial; "
                        "'auto' adds chunk_size=\"auto\" (e.g. 7,15,31,63,auto); 'C/K': size C on every K-th decode "
                        "step (RaincheckConfig.chunk_every, e.g. 63/10)")
    parser.add_argument("--primary-chunk", type=parse_chunk_spec, default=None, help="the chunk size that runs every "
                        "turn (default 31 when swept, else the first)")
    parser.add_argument("--compile-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="RaincheckConfig.compile_steps=True (--no-compile-steps: False) for every Raincheck "
                        "variant but the _compiled / _uncompiled twins (torch.compile of the fast path's element-wise "
                        "work; the compile is paid in each storage's first captures, reported under warm-up). "
                        "Default: the library's default, compiled where the steps are captured as CUDA graphs")
    parser.add_argument("--tpot-slack", type=float, default=0.02, help="RaincheckConfig.tpot_slack of the auto "
                        "variants (default 0.02)")
    parser.add_argument("--sweep-turns", type=int, default=1, help="turns run by the other chunk sizes (default 1)")
    parser.add_argument("--variants", default=None, help="comma-separated subset: names (e.g. 'raincheck c=31') or "
                        "families (stock_dynamic, stock_static, full, hard, post_answer, raincheck, serial; the twins full_compiled, "
                        "raincheck_compiled, full_uncompiled, raincheck_uncompiled only when named)")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--decode-guard", type=int, default=RaincheckConfig.decode_guard)
    parser.add_argument("--selector", default=None,
                        help="a registered selector name (default: the library's default, RaincheckConfig().selector)")
    parser.add_argument("--warmup-tokens", default=None, help="default min(answer, guard + 4); 'answer': each run's "
                        "answer length")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--warm-up-api", action="store_true", help="call raincheck_hf.warm_up with each Raincheck "
                        "variant's config before anything is timed (as the CLI, the demo and the server do at start)")
    parser.add_argument("--no-idle-probe", action="store_true", help="skip the follow-up-after-idle measurement")
    parser.add_argument("--budget-s", type=float, default=None, help="start no conversation that would end past "
                        "this many seconds after start (estimated from warm-up / earlier repetitions)")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU, torch's on CUDA)")
    parser.add_argument("--image-size", type=_size, default=None, help="WxH, default per model (real: 1344x1024)")
    parser.add_argument("--video-frames", type=int, default=None, help="default per model (real: 64)")
    parser.add_argument("--video-size", type=_size, default=None, help="WxH per frame, default per model (real: 512x384)")
    parser.add_argument("--static-max-cache-len", type=int, default=None)
    parser.add_argument("--strict", action="store_true", help="raise on the first failing variant")
    parser.add_argument("--no-intervals", action="store_true", help="do not store turn 1's per-token intervals")
    parser.add_argument("--json", default=None, help="write the results here (rewritten after every conversation)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m raincheck_hf.bench latency"] + list(sys.argv[2:] if argv is None else argv))
    try:
        lengths = [int(n) for n in args.answer_tokens.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--answer-tokens {args.answer_tokens!r}: integers, comma-separated")
    warmup_tokens = args.warmup_tokens
    if warmup_tokens is not None and warmup_tokens != "answer":
        try:
            warmup_tokens = int(warmup_tokens)
        except ValueError:
            parser.error(f"--warmup-tokens {warmup_tokens!r}: an integer or 'answer'")
    return run(
        models=[m.strip() for m in args.model.split(",") if m.strip()],
        inputs=[i.strip() for i in args.input.split(",") if i.strip()],
        turns=args.turns, answer_tokens=lengths[0] if len(lengths) == 1 else lengths, follow_up_tokens=args.follow_up_tokens, reps=args.reps,
        chunk_sizes=[parse_chunk_spec(c) for c in args.chunk_sizes.split(",") if c.strip()],
        primary_chunk=args.primary_chunk, tpot_slack=args.tpot_slack, compile_steps=args.compile_steps,
        sweep_turns=args.sweep_turns,
        variants=[v.strip() for v in args.variants.split(",")] if args.variants else None,
        retention=args.retention, decode_guard=args.decode_guard, selector=args.selector,
        warmup=not args.no_warmup, warm_up_api=args.warm_up_api, warmup_tokens=warmup_tokens, idle_probe=not args.no_idle_probe,
        budget_s=args.budget_s, device=args.device, threads=args.threads, image_size=args.image_size, video_frames=args.video_frames,
        video_size=args.video_size, static_max_cache_len=args.static_max_cache_len, json_path=args.json,
        strict=args.strict, keep_intervals=not args.no_intervals, command=command,
    )
