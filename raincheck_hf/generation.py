"""The decoding loop: `model.generate(..., raincheck=cfg)` ends up here (a `custom_generate`
callable with `_sample`'s signature), after HF's own input preparation, logits processors,
stopping criteria and vision encoding.

One call, top to bottom:

1. encode the turn's new tokens (embeddings, DeepStack rows, absolute 3-D positions);
2. select the visual rows that go first (a `DeferredPlan`);
3. forward 0 (prefill): pending deferred rows of earlier turns (they precede this turn in physical
   order, docs/method.md §6 "early follow-up") and then T ∪ S;
4. each decode forward i >= 1 consumes generated token i; the scheduler (`ChunkScheduler`, the only
   place that decides *when* deferred rows run) lets one chunk ride along after the guard: fused into
   the same forward (``raincheck``) or in a forward of its own just before (``serial``); with
   ``chunk_size="auto"`` its size comes from the measured step costs (`auto_chunk_size`);
5. logits processors, sampling, stopping criteria and the streamer exactly as HF's `_sample`;
6. return HF's output plus the cache and a `RaincheckTrace`; pending rows stay with the cache.

The engine in two halves, as vLLM keeps them: the scheduler here (`ChunkScheduler.decode_step`) decides each
forward's rows (`runner.ForwardRows`); a runner (`runner.Runner`: `runner.EagerRunner` over a `DeferredDynamicCache`,
`fast.runner.StaticRunner` over the fast path's static cache and its captured steps) executes them and answers
what the scheduler asks (step costs for ``"auto"``, captures). The runner is chosen once per call, where the cache
is made (`runner.open_runner`); this loop talks to the `Runner` protocol only.

A batch of prompts (``input_ids [B, L]``, B > 1, left-padded) goes to `batch_engine.batched_sample` instead
(`integration.enable` picks it): `batch_engine.BatchEngine`, every row's rows packed into one forward per step
over per-sequence KV slots, each row planned and scheduled as its own call (every family; Qwen3.5's Gated DeltaNet
states per row, `batched_gdn.py`); with ``fast_path=True`` its decode steps replay CUDA graphs per batch-size
bucket for the attention families (`fast.batched_graphs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache_utils import DEFERRED, GENERATED, INPUT, DeferredDynamicCache, PendingRows, order_key, to_device
from .configuration import CHUNK_LADDER, RaincheckConfig
from .fast.vision_graphs import vision_graphs_for
from .models import get_adapter
from .models.base import RowBatch
from .plan import DeferredPlan, build_plan, input_rows_on_device, restoration_order, start_visual_selection
from .runner import ForwardRows, Runner, open_runner, runner_for


@dataclass
class RaincheckTrace:
    """What happened to the prompt's multimodal tokens during one `generate` call.

    All positions are source positions: indices into the ``input_ids`` given to `generate`.

    Attributes:
        mode: the config's mode.
        selected: ``[s]`` visual positions prefilled first, source order.
        deferred: ``[d]`` visual positions deferred (``hard``: dropped), source order.
        restored_per_forward: one LongTensor per forward: forward 0 is the prefill (it restores
            deferred rows left over from earlier turns), forward i >= 1 consumes generated token i.
        chunk_size_per_forward: per forward (same indexing), the chunk size the scheduler chose for
            it: the rows its chunk step was padded to (``chunk_size``, or the ladder size
            ``chunk_size="auto"`` picked), 0 when it carried no chunk (always 0 for forward 0).
        captures: ``(forward, rows, seconds)`` per CUDA-graph capture of a step shape at a new slot bucket
            made during this call (fast path on CUDA; same forward indexing; ``rows``: the step's rows,
            padding included: 1 a plain decode step, ``c + 1`` a fused chunk of ``c``, ``c`` a ``serial``
            or leftover chunk, a multiple of 64 a prefill): each is a pause of that many wall seconds
            (warm-up runs, the capture, timing replays). Later calls on the same slot storage replay them.
        pending: deferred positions not yet restored when `generate` returned.
        dropped: positions removed for good (``hard`` mode).
        segments: ``(modality, (t, h, w), source_positions)`` per image / video slice, for drawing.
    """

    mode: str
    selected: torch.Tensor
    deferred: torch.Tensor
    restored_per_forward: list[torch.Tensor] = field(default_factory=list)
    chunk_size_per_forward: list[int] = field(default_factory=list)
    captures: list[tuple[int, int, float]] = field(default_factory=list)
    pending: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    dropped: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    segments: list = field(default_factory=list)

    @property
    def restored_during_decode(self) -> int:
        return int(sum(int(r.numel()) for r in self.restored_per_forward[1:]))


@dataclass
class RaincheckGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's `GenerateDecoderOnlyOutput` plus ``raincheck``, the `RaincheckTrace`."""

    raincheck: RaincheckTrace | None = None


def chunk_size_for_forward(forward_index: int, config: RaincheckConfig, num_pending: int) -> int:
    """How many deferred rows ride along with decode forward ``forward_index`` (>= 1), fixed chunk size.

    Forward i consumes generated token i, so i tokens have been generated when it runs; the guard
    holds chunks back until ``i >= decode_guard`` (and never before the first decode forward), and from
    there on every ``chunk_every``-th forward carries one (`RaincheckConfig.chunk_every`).
    ``chunk_size="auto"`` goes through `ChunkScheduler` instead (this returns the ladder's largest).
    """
    if not config.restores_during_decode or num_pending == 0:
        return 0
    first = max(config.decode_guard, 1)
    if forward_index < first or (forward_index - first) % config.chunk_every:
        return 0
    return min(config.max_chunk_size, num_pending)


def shared_chunk_cap(carrying: int, budget: int | None, chunk_size: int) -> int | None:
    """The cap on each sequence's chunk in a batched step where ``carrying`` sequences carry one, all with chunks of
    up to ``chunk_size`` rows (`RaincheckConfig.max_chunk_size`), sharing ``budget`` chunk rows
    (`RaincheckConfig.batch_chunk_rows`); None: no cap (each carries its full chunk).

    A pure function (the rule `batch_engine.RowScheduler` applies at the start of each step). No cap for a single
    sequence (batch 1 is unchanged), without a budget, or while ``carrying * chunk_size`` fits the budget;
    otherwise the largest ladder size below ``chunk_size`` whose ``carrying`` chunks fit, at least the ladder's
    smallest (so a crowded step still restores, in few captured shapes; ``carrying`` times it may then exceed
    the budget); a ``chunk_size`` at or below the ladder's smallest is never cut.
    """
    if budget is None or carrying <= 1 or carrying * chunk_size <= budget:
        return None
    smallest = min(CHUNK_LADDER)
    if chunk_size <= smallest:
        return None
    fitting = [s for s in CHUNK_LADDER if s < chunk_size and carrying * s <= budget]
    return max(fitting) if fitting else smallest


@dataclass(frozen=True)
class StepCosts:
    """What decode step ``steps`` may weigh with ``chunk_size="auto"`` (`auto_chunk_size`).

    Attributes:
        decode: measured seconds of a plain decode step.
        chunk: ladder size ``c`` -> measured seconds of a decode step carrying a chunk padded to ``c`` rows
            (the fused forward, or in ``serial`` mode the chunk's forward plus the token's), None where not
            measured yet; the sizes a step may carry (absent: not a candidate, e.g. a shape that is never
            captured and would run eagerly).
        captured: the ladder sizes whose step is captured at the slot bucket it would run at now (running
            them pauses for nothing); None: no capture to weigh (every size counts as captured).
        capture: ladder size -> wall seconds that capturing its step took at another bucket (the pause a
            size outside ``captured`` costs now); absent or None: never captured.
    """

    decode: float
    chunk: dict
    captured: frozenset | None = None
    capture: dict = field(default_factory=dict)


def chunk_extras(costs: StepCosts, ladder=CHUNK_LADDER) -> dict:
    """Ladder size -> the seconds a step carrying that chunk costs beyond a plain decode step (the sizes in
    ``costs.chunk`` only).

    Measured sizes give their figure (at least 0). A size not measured yet (None) takes the least of two upper
    bounds from the measured ones, assuming a step's cost grows with its rows but never faster than in
    proportion to them (memory-bound steps: more rows cost less per row): a larger measured size's extra,
    and a smaller measured size's extra scaled by the ratio of the sizes. Empty when nothing is measured.
    """
    measured = {c: max(t - costs.decode, 0.0) for c, t in costs.chunk.items() if c in ladder and t is not None}
    if not measured:
        return {}
    extras = {}
    for c in ladder:
        if c not in costs.chunk:
            continue
        if c in measured:
            extras[c] = measured[c]
            continue
        bounds = [e for m, e in measured.items() if m > c] + [e * c / m for m, e in measured.items() if m < c]
        extras[c] = min(bounds)
    return extras


def auto_chunk_size(costs: StepCosts | None, slack: float, pending: int, steps: int, spent: float,
                    ladder=CHUNK_LADDER) -> int:
    """The chunk size (a ladder size, or 0: none) that decode step ``steps`` carries with ``chunk_size="auto"``.

    A pure function. The budget: after ``steps`` decode steps the answer may have cost
    ``(1 + slack) * steps * costs.decode``, i.e. ``slack * costs.decode`` of extra time accrues per
    step and what earlier steps' chunks cost beyond a plain step, their graph captures included
    (``spent``, seconds), is taken off; accumulated slack may be spent at once. A chunk of ``c`` costs
    `chunk_extras`' figure for ``c`` (measured, or an upper bound from the measured sizes), whatever
    the rows it really holds (a short last chunk is padded to ``c``), plus, once, the capture of its
    step when that is not captured at the slot bucket it would run at (``costs.captured``).

    Which sizes compete: when a size in ``costs.captured`` is affordable now, the captured ones only
    (a step never pays a capture that a captured size makes unnecessary). Otherwise also the sizes
    whose capture was measured at another bucket (``costs.capture``), with that one-time cost; a size
    never captured anywhere (its capture cost unknown) only when nothing at all is captured at this
    bucket, and then at no capture cost (the best size by this rule is captured there: its measured
    pause reaches ``spent`` after the step, and from then on its capture cost is known).

    Which size: of those, the one whose chunks would restore the ``pending`` rows earliest under the
    budget (``ceil(pending / c)`` chunks, the k-th affordable ``(k * extra + capture - allowance) /
    (slack * decode)`` steps from now, at most one per step; ties go to the cheaper total, then the
    larger size). It runs now if this step's allowance pays for its extra and capture, else the step
    carries nothing and the budget grows. Larger chunks cost less per row, so waiting for one can
    finish sooner than spending every step's slack on the smallest; near the end, the smallest size
    that holds the rest wins.

    Without measurements (``costs`` None or no ladder size measured: the eager engine, a CPU, or no
    chunk step captured yet) it returns the smallest ladder size (documented fallback: a bounded cost
    per step that restores everything; on the fast path, the size captured first), or the smallest
    captured or candidate one.

    Args:
        costs: measured step costs (and what is captured), or None.
        slack: `RaincheckConfig.tpot_slack` (>= 0).
        pending: deferred rows waiting.
        steps: decode steps of the answer so far, this one included (forward index).
        spent: extra seconds that earlier steps' chunks cost: `chunk_extras` of each size taken, plus the
            wall time of the captures of chunk steps made during the answer.
    """
    if pending <= 0:
        return 0
    extras = chunk_extras(costs, ladder) if costs is not None else {}
    captured = None if costs is None or costs.captured is None else frozenset(costs.captured) & frozenset(ladder)
    if not extras:
        candidates = [c for c in (costs.chunk if costs is not None else ()) if c in ladder]
        return min(captured) if captured else min(candidates or ladder)
    rate = slack * costs.decode  # allowance gained per step
    allowance = rate * steps - spent
    eps = 1e-12
    if captured is None:
        once = dict.fromkeys(extras, 0.0)  # ladder size -> the one-time capture it costs now
    elif any(extras[c] <= allowance + eps for c in captured):
        once = dict.fromkeys(captured, 0.0)
    else:
        once = {}
        for c in extras:
            known = costs.capture.get(c)
            if c in captured or (known is None and not captured):
                once[c] = 0.0
            elif known is not None:
                once[c] = known
    best, best_rank = 0, None
    for c, capture in once.items():
        extra = extras[c]
        n = -(-pending // c)
        need = n * extra + capture - allowance
        if need <= 0:
            finish = n - 1
        elif rate > 0:
            finish = max(n - 1, math.ceil(need / rate))
        else:
            continue  # no slack: only chunks already paid for
        rank = (finish, n * extra + capture, -c)
        if best_rank is None or rank < best_rank:
            best, best_rank = c, rank
    if best and extras[best] + once[best] <= allowance + eps:
        return best
    return 0


class ChunkScheduler:
    """When a deferred chunk rides along with a decode step, and how large (one per `generate` call): the half of
    the engine that decides rows (`decode_step`); a `runner.Runner` executes them.

    Fixed ``chunk_size``: `chunk_size_for_forward`. ``"auto"``: after the guard, `auto_chunk_size` with the
    costs the runner measured for its cache's steps (`Runner.step_figures`; on the fast path
    `StepGraphs.step_figures`, which captures nothing: a size's figures come from its captures and replays, here
    or at another slot bucket, made when a step carried it; none on the eager engine, or without a runner),
    keeping the extra time its chosen chunks cost (``spent``), the wall time of the chunk steps' captures made
    during the answer included (`charge_captures`).

    Of a cache it reads the pending rows only: `chunk_size` their count (``num_pending``, so `batched.SequenceState`
    serves as well), `decode_step` also the chunk it lets ride along (``peek_pending``); graph buffers, slots and
    other cache internals are the runner's.

    A batched sequence's scheduler may be given a cap for one forward (``cap`` of `chunk_size` / `decode_step`:
    the step's shared chunk budget, `shared_chunk_cap`); the batch-1 loop never gives one.

    Args:
        config: the call's `RaincheckConfig`.
        runner: the runner ``"auto"`` asks for step figures; None: the runner of the cache asked about.
        schedule: internal, for tests: the padded chunk size of each forward to replay (indexed by forward, as a
            trace's ``chunk_size_per_forward``; a forward past its end, or one with nothing pending, carries
            none) instead of deciding them. It reproduces a schedule decided elsewhere (a batched row's, cut by
            the step's shared budget) so that the same sequence can be run alone under it.
    """

    def __init__(self, config: RaincheckConfig, runner: Runner | None = None, *, schedule=None):
        self.config = config
        self.runner = runner  # what "auto" asks for step figures; None: the runner of the cache asked about
        self.spent = 0.0
        self.schedule = None if schedule is None else [int(c) for c in schedule]

    def step_costs(self, adapter, cache) -> StepCosts | None:
        """The runner's figures for the steps the next decode forward may take over ``cache``'s pending rows
        (`StepCosts`), or None: nothing measured (the eager engine, no plain decode step timed, or a cache that is
        no `DeferredDynamicCache` and no runner given: a batched sequence's rows)."""
        runner = self.runner
        if runner is None:
            if not isinstance(cache, DeferredDynamicCache):
                return None
            runner = runner_for(adapter, cache)
        pending = cache.num_pending
        decode = runner.step_figures(1, True, pending_after=pending)
        if decode is None or decode.cost is None:
            return None
        decode = decode.cost
        chunk, captured, capture = {}, set(), {}
        for c in CHUNK_LADDER:
            n = min(c, pending)  # real rows of the chunk (a short last one is padded to c)
            if self.config.mode == "serial":
                fig = runner.step_figures(c, False, real_rows=n, pending_after=pending - n)
            else:
                fig = runner.step_figures(c + 1, True, real_rows=n + 1, pending_after=pending - n)
            if fig is None:
                continue  # not a captured shape: it would run eagerly, at a cost nobody measured
            chunk[c] = None if fig.cost is None else fig.cost + (decode if self.config.mode == "serial" else 0.0)
            if fig.captured:
                captured.add(c)
            capture[c] = fig.capture
        return StepCosts(decode, chunk, frozenset(captured), capture)

    def may_carry_chunk(self, cache, forward_index: int) -> bool:
        """Whether decode forward ``forward_index`` over ``cache``'s pending rows may carry a chunk (the guard passed,
        rows pending, a mode that restores during decode; with ``"auto"`` it may still carry none)."""
        if self.schedule is not None:
            return self._replayed(cache, forward_index) > 0
        return chunk_size_for_forward(forward_index, self.config, cache.num_pending) > 0

    def _replayed(self, cache, forward_index: int) -> int:
        schedule = self.schedule
        if cache.num_pending == 0 or forward_index >= len(schedule):
            return 0
        return schedule[forward_index]

    def chunk_size(self, adapter, cache, forward_index: int, cap: int | None = None) -> int:
        """The padded chunk size decode forward ``forward_index`` carries (0: none); counts it as spent. ``cap``
        (a batched step's share, `shared_chunk_cap`): at most this many rows; with ``"auto"``, a choice among the
        ladder sizes up to it."""
        config = self.config
        if self.schedule is not None:
            return self._replayed(cache, forward_index)
        if not self.may_carry_chunk(cache, forward_index):
            return 0
        if not config.auto_chunk:
            return config.chunk_size if cap is None else min(config.chunk_size, cap)
        ladder = CHUNK_LADDER if cap is None else tuple(c for c in CHUNK_LADDER if c <= cap) or (min(CHUNK_LADDER),)
        costs = self.step_costs(adapter, cache)
        c = auto_chunk_size(costs, config.tpot_slack, cache.num_pending, forward_index, self.spent, ladder)
        if c and costs is not None:
            self.spent += chunk_extras(costs, ladder).get(c, 0.0)
        return c

    def charge_captures(self, captures) -> None:
        """Count the captures a decode forward made (`RaincheckTrace.captures` entries) against ``"auto"``'s
        budget: those of steps with deferred rows (a chunk's shape, which the scheduler chose), not a plain
        decode step's (which every mode pays at a new slot bucket)."""
        if self.config.auto_chunk:
            self.spent += sum(seconds for _, rows, seconds in captures if rows > 1)

    def decode_step(self, adapter, cache, plan, next_tokens, forward_index: int, first_generated_position: int,
                    sequence_length: int, cap: int | None = None, token=None) -> "_DecodeForward":
        """Decode forward ``forward_index``'s rows: generated token i (``next_tokens``, source
        ``sequence_length - 1``) and the chunk of pending rows `chunk_size` lets ride along, fused into one forward
        ``[chunk, token]`` or (``serial``) in a forward of its own just before. The chunk is only peeked at: it
        leaves the pending rows when the step runs (`_DecodeForward.run`). ``cap``: at most this many chunk rows
        (a batched step's share of `RaincheckConfig.batch_chunk_rows`; None: the sequence's own choice).
        ``token``: the token's row already made, ``(RowBatch, key [1], source [1], kind [1])`` (the batched engine
        makes every sequence's token row of a step at once, `batched.token_rows`), with the values this method would
        make; None: made here from ``next_tokens``."""
        position = first_generated_position + forward_index - 1
        if token is None:
            token_key = order_key(plan.turn, GENERATED, forward_index - 1).reshape(1)
            token_source = torch.tensor([sequence_length - 1])
            batch = adapter.text_row(next_tokens, position)
            token_kind = GENERATED
        else:
            batch, token_key, token_source, token_kind = token
        token = ForwardRows(batch, token_key, token_source, token_kind, True)
        size = self.chunk_size(adapter, cache, forward_index, cap)
        chunk = cache.peek_pending(min(size, cache.num_pending)) if size else None
        if chunk is None:
            return _DecodeForward([token], 0, 0, position, torch.empty(0, dtype=torch.long))
        chunk_kinds = torch.full((len(chunk),), DEFERRED, dtype=torch.int8)
        if self.config.mode == "serial":
            forwards = [ForwardRows(adapter.pending_batch(chunk), chunk.keys, chunk.sources, chunk_kinds, False, size),
                        token]
        else:  # fused: one forward over [chunk, decode token]
            forwards = [ForwardRows(RowBatch.concat([adapter.pending_batch(chunk), batch]),
                                    torch.cat([chunk.keys, to_device(token_key, chunk.keys.device)]),
                                    torch.cat([chunk.sources.cpu(), token_source]),
                                    torch.cat([chunk_kinds, torch.tensor([GENERATED], dtype=torch.int8)]),
                                    True, size)]
        return _DecodeForward(forwards, len(chunk), size, position, chunk.sources.cpu())


# ---- the engine's steps (shared by generate, idle-time restoration and Conversation) ----------

def run_rows(adapter, cache: DeferredDynamicCache, batch: RowBatch, keys, sources, kinds, want_logits: bool,
             pad_to: int | None = None):
    """One forward over ``batch`` with the visibility of its keys, by the cache's runner (`runner.runner_for`);
    logits of its last row or None.

    ``pad_to`` (fast path only) pads the forward's deferred rows to a fixed count, so the step has
    the shape its CUDA graph was captured at.
    """
    return runner_for(adapter, cache).run(ForwardRows(batch, keys, sources, kinds, want_logits, pad_to))


@dataclass
class _DecodeForward:
    """Decode forward i, as the scheduler decided it (`ChunkScheduler.decode_step`): its ``[chunk?, token]`` rows
    (one forward, or two in ``serial`` mode)."""

    forwards: list[ForwardRows]
    n_chunk: int
    chunk_size: int  # the chunk's padded size (0: no chunk)
    position: int  # the token's M-RoPE position
    restored: torch.Tensor  # sources of the chunk's deferred rows
    prepared: object = None  # the first forward, made ready ahead by the runner (`Runner.prepare`)

    def run(self, runner: Runner, cache):
        """Take the chunk from ``cache``'s pending rows and run the forward(s) on ``runner``; the token's logits."""
        if self.n_chunk:
            cache.take_pending(self.n_chunk)  # the rows `decode_step` peeked at
        logits = None
        for i, forward in enumerate(self.forwards):
            logits = runner.run(forward, self.prepared if i == 0 else None)
        return logits


def restore_pending(model, cache: DeferredDynamicCache, max_tokens: int | None = None) -> torch.Tensor:
    """Prefill up to ``max_tokens`` pending deferred rows (all when None) in one forward.

    Returns their source positions. Used after the answer (idle time) and by `Conversation`.
    """
    adapter = get_adapter(model)
    if cache.num_pending == 0:
        return torch.empty(0, dtype=torch.long)
    runner = runner_for(adapter, cache)
    if max_tokens is not None:
        runner.reserve(0, max_tokens)  # a chunk is padded up to max_tokens
    forward = idle_rows(adapter, cache, max_tokens)
    with torch.no_grad():
        runner.run(forward)
    return forward.sources.cpu()


def idle_rows(adapter, pending, max_tokens: int | None = None) -> ForwardRows:
    """An idle-time restoration forward's rows: the first ``max_tokens`` pending deferred rows of ``pending`` (all
    when None; at least one must be pending), taken from them. ``pending`` is anything with ``take_pending``: a
    `DeferredDynamicCache` (`restore_pending`) or a restoring sequence of the batched engine
    (`batched.RestoringState`), so both restore the same rows in the same order (restoration order: the head of
    the pending rows, whose order keys increase along it, so any split into pieces gives each row the same
    visible rows). On the fast path the forward is padded to ``max_tokens`` rows (`run_rows`' ``pad_to``)."""
    rows = pending.take_pending(max_tokens)
    return ForwardRows(adapter.pending_batch(rows), rows.keys, rows.sources, DEFERRED, False, max_tokens)


def sampling_setup(input_ids, stopping_criteria, generation_config):
    """What HF's `_sample` sets up before its loop: ``(scores, raw_logits, finished_pad)``, the first two empty
    tuples when returned (else None), ``finished_pad`` the pad token (on ``input_ids``' device) that finished rows
    get when an EOS criterion stops rows and a pad token is set, else None."""
    return_dict = generation_config.return_dict_in_generate
    scores = () if (return_dict and generation_config.output_scores) else None
    raw_logits = () if (return_dict and generation_config.output_logits) else None
    has_eos_stopping_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    pad_token_id = generation_config._pad_token_tensor
    finished_pad = pad_token_id.to(input_ids.device) if has_eos_stopping_criteria and pad_token_id is not None else None
    return scores, raw_logits, finished_pad


def choose_next_tokens(logits, input_ids, logits_processor, generation_config, scores, raw_logits, unfinished,
                       pad_token_id=None):
    """One step of HF's `_sample` after the forward: ``logits [B, V]`` -> logits processors -> greedy or sampled
    tokens ``[B]``, finished rows (``unfinished`` 0) given ``pad_token_id`` when it is not None; ``scores`` and
    ``raw_logits`` (tuples, or None when not returned) extended. Returns ``(tokens, scores, raw_logits)``."""
    next_token_logits = logits.to(copy=True, dtype=torch.float32, device=input_ids.device)
    next_token_scores = logits_processor(input_ids, next_token_logits)
    if scores is not None:
        scores += (next_token_scores,)
    if raw_logits is not None:
        raw_logits += (next_token_logits,)
    if generation_config.do_sample:
        probs = nn.functional.softmax(next_token_scores, dim=-1)
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
    else:
        next_tokens = torch.argmax(next_token_scores, dim=-1)
    if pad_token_id is not None:
        next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
    return next_tokens, scores, raw_logits


def raincheck_sample(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    raincheck_config: RaincheckConfig | None = None,
    raincheck_grids: dict | None = None,
    raincheck_streamer=None,
    raincheck_captures=None,
    raincheck_pixels: dict | None = None,
    raincheck_chunk_schedule=None,
    **model_kwargs,
):
    """`_sample` with deferred multimodal prefill (the `custom_generate` callable).

    ``raincheck_pixels`` (``pixel_values`` / ``pixel_values_videos``, held back from HF's own encoding
    by `integration.enable`'s wrapper) are encoded by the captured vision tower (`ModelAdapter.use_vision_graphs`).
    ``raincheck_chunk_schedule`` (internal, for tests; ``generate(..., raincheck_chunk_schedule=...)``, checked by
    `integration.validate_request`): per forward, the padded chunk size to replay instead of deciding it (a batched
    row's ``trace.chunk_size_per_forward``: the row alone under its batch's chunk schedule; `ChunkScheduler`'s
    ``schedule``).
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"raincheck_sample runs one sequence, got input_ids of batch {input_ids.shape[0]}; a batch of "
                         "prompts goes to batch_engine.batched_sample (model.generate picks it after enable(model)).")
    config = raincheck_config if raincheck_config is not None else RaincheckConfig()
    streamer = streamer if streamer is not None else raincheck_streamer
    if raincheck_streamer is not None:
        raincheck_streamer.put(input_ids.cpu())  # what HF's generate does before calling the loop
    grids = raincheck_grids or {}
    adapter = get_adapter(model)
    given = model_kwargs.get("cache")
    start = given.source_length if isinstance(given, DeferredDynamicCache) else 0
    pending_before = given.num_pending if isinstance(given, DeferredDynamicCache) else 0
    rows_needed = input_ids.shape[1] - start + pending_before + generation_config.max_length - input_ids.shape[1]
    # the engine of this call, chosen once: the runner over the cache to continue, or over a new one sized for the
    # turn (`runner.open_runner`); from here on the loop talks to it through the `Runner` protocol only
    runner = open_runner(model, adapter, given, config, rows_needed)
    cache = runner.cache

    # 1. the new tokens of this turn
    new_ids = input_ids[0, start:]
    vision_graphs = None
    if raincheck_pixels is not None:
        model_kwargs = {**model_kwargs, **raincheck_pixels}
        vision_graphs = vision_graphs_for(adapter)
    turn = adapter.encode_turn(
        new_ids,
        cache.next_position,
        mm_encoder_outputs=model_kwargs.get("mm_encoder_outputs"),
        image_grid_thw=grids.get("image_grid_thw"),
        video_grid_thw=grids.get("video_grid_thw"),
        pixel_values=model_kwargs.get("pixel_values"),
        pixel_values_videos=model_kwargs.get("pixel_values_videos"),
        text_prefix=1 if start > 0 else 0,  # the previous answer's last token, not yet fed back
        vision_graphs=vision_graphs,
        second_per_grid_ts=grids.get("second_per_grid_ts"),
    )

    # 2. selection: made (on a GPU, queued) without waiting for it; the plan comes from its keep-mask on the host
    selector = config.build_selector()
    started = start_visual_selection(turn, config, selector, model=model, captures=raincheck_captures)
    turn_index = cache.turn
    cache.turn += 1

    # 3. forward 0: leftover deferred rows of earlier turns, then T ∪ S, its rows chosen on the device from the
    # selection's keep-mask there (`plan.input_rows_on_device`, the row count known on the host). The runner launches
    # it before the selection is read where it can (`Runner.run_ahead`: a captured step's replay); the plan, and then
    # what only later forwards need (this turn's deferred rows, the trace), are made while the device runs it. On a
    # GPU the host's work between the selection and the launch is time the device idles before the first token.
    watch = runner.capture_watch()
    earlier = cache.take_pending()
    input_rows = input_rows_on_device(turn, started.keep_on(turn.embeds.device), started.count)
    parts, keys, sources, kinds = [], [], [], []
    if earlier is not None:
        parts.append(adapter.pending_batch(earlier))
        keys.append(earlier.keys.to(input_rows.device))  # (the same device but under an accelerate split)
        sources.append(earlier.sources.cpu())
        kinds.append(torch.full((len(earlier),), DEFERRED, dtype=torch.int8))
    parts.append(adapter.rows(turn, input_rows, num_visual=started.count))
    keys.append(order_key(turn_index, INPUT, input_rows))
    kinds.append(torch.full((input_rows.numel(),), INPUT, dtype=torch.int8))
    plan = None

    def plan_sources():
        nonlocal plan
        plan = build_plan(turn, started.keep(), turn_index, start)  # checks the selector's picks
        if plan.input_rows.numel() != input_rows.numel():  # (the keep-mask's count is the selection's contract)
            raise RuntimeError(f"the turn's first forward ran {input_rows.numel()} input rows, its plan has "
                               f"{plan.input_rows.numel()}")
        return torch.cat(sources + [plan.sources(plan.input_rows)])

    logits = runner.run_ahead(ForwardRows(RowBatch.concat(parts), torch.cat(keys), torch.empty(0, dtype=torch.long),
                                          torch.cat(kinds), want_logits=True), plan_sources)
    # this turn's deferred rows wait after the forward (only a generated row's step reads the pending ones:
    # a prefill's rows and state do not depend on them, `gdn.dispatch`)
    trace = RaincheckTrace(
        mode=config.mode,
        selected=plan.sources(plan.selected_rows),
        deferred=plan.sources(plan.deferred_rows),
        segments=[(s.modality, s.grid, s.source_positions + start) for s in turn.segments],
    )
    if plan.deferred_rows.numel():
        if config.defers:
            plan.restore_order = restoration_order(turn, plan, config.restore_order, model=model, selector=selector)
            cache.add_pending(_pending_rows(adapter, turn, plan))
        else:  # hard: gone for good
            cache.drop(plan.sources(plan.deferred_rows))
            trace.dropped = plan.sources(plan.deferred_rows)
    # the turn's ids from the encoding's host copy: a copy of ``new_ids`` (on the model's device) would wait here for
    # the prefill just launched, and the first token's sampling and the next step's preparation behind it
    cache.extend_source(turn.ids_on_host(), turn.next_position)
    trace.restored_per_forward.append(earlier.sources.cpu() if earlier is not None else torch.empty(0, dtype=torch.long))
    trace.chunk_size_per_forward.append(0)
    trace.captures.extend(watch.new(0))

    # 4-5. decode, HF's way
    scheduler = ChunkScheduler(config, runner, schedule=raincheck_chunk_schedule)
    out = _decode_loop(model, adapter, runner, scheduler, plan, config, trace, logits, input_ids, logits_processor,
                       stopping_criteria, generation_config, streamer, turn.next_position, watch)
    trace.pending = cache.pending_sources
    return out


def _pending_rows(adapter, turn, plan: DeferredPlan):
    rows = plan.restore_rows  # restoration order: the scheduler takes chunks from the head
    batch = adapter.rows(turn, rows)
    return PendingRows(batch.embeds, batch.positions, to_device(plan.deferred_keys, adapter.device),
                       plan.sources(rows), batch.deepstack)


def _decode_loop(model, adapter, runner: Runner, scheduler: ChunkScheduler, plan, config, trace, logits, input_ids,
                 logits_processor, stopping_criteria, generation_config, streamer, first_generated_position, watch):
    scores, raw_logits, finished_pad = sampling_setup(input_ids, stopping_criteria, generation_config)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    cache = runner.cache
    generated = 0
    while True:
        next_tokens, scores, raw_logits = choose_next_tokens(
            logits, input_ids, logits_processor, generation_config, scores, raw_logits, unfinished,
            finished_pad)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        generated += 1
        # forward i = generated consumes y_i: its rows decided by the scheduler and made ready by the runner (on
        # the fast path its graph's buffers filled) before the stopping check, so that this host work overlaps the
        # device's; nothing in the cache changes until `run`
        step = scheduler.decode_step(adapter, cache, plan, next_tokens, generated, first_generated_position,
                                     input_ids.shape[1])
        step.prepared = runner.prepare(step.forwards[0])
        # Everything so far was only launched and queues behind the last forward; the stopping check is
        # launched too, then one wait for all of it. The token's host copy is taken after that wait (behind
        # the next forward, `.cpu()` would wait for that forward as well).
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        finished = bool(unfinished.max() == 0)
        token_host = next_tokens.cpu()
        if streamer is not None:
            streamer.put(token_host)
        if finished:
            break
        logits = step.run(runner, cache)
        cache.extend_source(token_host, step.position + 1)
        trace.restored_per_forward.append(step.restored)
        trace.chunk_size_per_forward.append(step.chunk_size)
        captures = watch.new(generated)
        if captures:
            scheduler.charge_captures(captures)  # the pauses the answer paid for its chunks count as spent
            trace.captures.extend(captures)

    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    return RaincheckGenerateOutput(
        sequences=input_ids, scores=scores, logits=raw_logits, cache=cache, raincheck=trace,
    )
