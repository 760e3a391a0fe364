"""`BatchEngine`: continuous batching on the eager engine (sequences join and leave at any step).

Each sequence is a `batched.SequenceState` (its own plan, pending deferred rows, 3-D positions, DeepStack rows,
`ChunkScheduler` and trace) and owns a slot of a `kv_pool.SlotKVPool` (and, on the Gated DeltaNet families, a
row of the per-slot recurrent states `batched_gdn.PackedGDNStates`). A step is one forward (two in ``serial``
mode, or split by width, below) over the rows of every sequence that has work:

- each running sequence that was fed a token (`feed`) contributes its decode row with its deferred chunk when
  its scheduler gives it one (``[chunk, token]`` fused; ``serial``: the chunks in a forward of their own first);
  with a `RaincheckConfig.batch_chunk_rows` cap (None by default: no cap), when several carry one, each chunk is
  cut to the step's share of it (`RowScheduler.chunk_cap`, `generation.shared_chunk_cap`: ladder sizes, a lone
  sequence never cut). A forward is rectangular (every sequence padded to the widest), so when a few sequences
  carry chunks among many that decode a token alone, it runs as two by width (`width_split`,
  `RowScheduler.by_width`: the one-row entries, then a `WideForward` of the others), which changes no sequence's
  rows;
- sequences still prefilling contribute the next piece of their prompt (for a continued conversation: its
  leftover deferred rows, then the new turn's T ∪ S), under a per-step token budget (``token_budget`` rows per
  step, decode rows first, the rest to the waiting prompts in arrival order: vLLM's chunked prefill). A long
  image prompt is prefilled over several steps while the others keep decoding; its logits come with the step
  that ran its last piece. While the decode rows alone fill the budget, prompts wait;
- held conversations that only restore (`restore`: a `batched.RestoringState`, which generates nothing) get
  pieces of their pending deferred rows in what the budget has left after all of that (the step's spare rows;
  without a budget a piece of at most their idle chunk each), taken as idle-time restoration takes them
  (`generation.idle_rows`), so they never take a row from an answer. With captured decode steps (``graphs``) a
  step of decode rows and restoring pieces is still replayed: a restoring piece pads to the step's width like a
  shorter decode group (`fast.batched_graphs`).

`step` returns the next-token logits of the sequences that have them this step; choosing tokens stays with the
caller (HF's logits processors, sampling and stopping criteria live in the driver: `batched_sample` below).
A decode step waits for the device once: the driver reads every row's sampled token (and which rows go on) in one
copy and feeds host ints; the rows' placement, order keys, sources and lengths are host data, and what a step
needs of them on the device goes over pinned and non-blocking (`cache_utils.to_device_all`): building a step never
stalls on the device.

Each step leaves a record of what it ran (``BatchEngine.last_step``, a `StepRecord`: each forward replayed through
the captured steps, captured there first, or eager; its rows by kind), decided on the host with the step, for the
loops that time their steps (`step_log.StepLog`).

Two classes split the work as vLLM v1 does: `RowScheduler` decides which rows each sequence gets this step
(it takes chunks from the sequences' pending rows and prompt pieces from their prefill), `ForwardRunner` builds
and runs the forward from them (packing, the slot placement and mask, the family's packed recurrent step).

Every sequence sees only its own rows (docs/method.md §3 per sequence, through its slot's order keys), so each
sequence's tokens and logits are those of the same sequence run alone through batch-1 ``generate`` under the same
chunk schedule (its trace's ``chunk_size_per_forward``: with ``batch_chunk_rows=None``, the default, the schedule
it gets alone; a cap may have cut it), to float rounding (a chunked prefill sums attention
and the Gated DeltaNet recurrence in pieces).

A held conversation joins with its batch-1 `DeferredDynamicCache` (`add(..., cache=)`): its KV rows and order
keys are copied into a slot, its GDN states into the slot's row, its pending deferred rows go in front of the
new turn's prefill (docs/method.md §7), and the turn continues as the batch-1 follow-up would. `remove` gives a
sequence's state back as the `DeferredDynamicCache` its own call would have returned; for a restoring sequence,
the held cache with the rows it restored stored, as idle-time restoration (`generation.restore_pending`) leaves it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import NamedTuple

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .batched import (DeviceToken, RestoringState, RowGroup, SequenceState, new_sequence, restoring_sequence,
                      start_sequences, token_rows)
from .cache_utils import DeferredDynamicCache, to_device
from .generation import RaincheckGenerateOutput, choose_next_tokens, sampling_setup, shared_chunk_cap
from .configuration import RaincheckConfig, is_limit
from .fast import batched_graphs
from .fast.static_cache import StaticDeferredCache
from .kv_pool import DEFAULT_SLOTS, PoolOutOfMemory, SlotKVPool
from .masking import batched_visibility_to_attention_mask, check_attention_implementation
from .models import get_adapter

__all__ = ["BatchEngine", "ForwardRunner", "RowScheduler", "StepRecord", "StepRows", "WideForward", "batched_sample",
           "width_split"]

Entry = tuple[SequenceState, RowGroup]  # one sequence's rows in one forward


def _check_held(cache, what: str) -> None:
    """A held conversation's cache joins a batch by copying its rows into a slot: it must be a batch-1
    `DeferredDynamicCache`, and not a fast-path one (static slots of CUDA graphs,
    `fast.static_cache.StaticDeferredCache`), which has no such rows to copy; say so instead of failing mid-copy."""
    if not isinstance(cache, DeferredDynamicCache):
        raise ValueError(f"BatchEngine.{what} takes a held conversation's DeferredDynamicCache (of its last turn), "
                         f"got a {type(cache).__name__}.")
    if isinstance(cache, StaticDeferredCache):
        raise ValueError(f"BatchEngine.{what} got a {type(cache).__name__} (a fast-path conversation's static cache); "
                         "a batch continues conversations held in a DeferredDynamicCache: run that conversation with "
                         "RaincheckConfig(fast_path=False), or in the batch from its first turn.")


class StepRows(NamedTuple):
    """A step's rows by kind (host counts, `StepRows.of` the step's forwards)."""

    sequences: int  # sequences with rows in the step (restoring ones included)
    decode: int  # generated-token rows: one per sequence fed a token
    chunk: int  # deferred chunk rows riding with them (fused, or in ``serial`` mode's forward of their own)
    prefill: int  # prompt rows: pieces of joining turns' prefill (a continued conversation's leftovers, then T ∪ S)
    restoring: int  # pieces of held conversations that only restore (`BatchEngine.restore`)

    @property
    def total(self) -> int:
        return self.decode + self.chunk + self.prefill + self.restoring

    @staticmethod
    def of(forwards: list[list[Entry]], fed: set) -> "StepRows":
        """The rows of ``forwards`` (`RowScheduler.schedule`'s) by kind; ``fed``: the sequences that had a token to
        decode when they were scheduled (their groups are ``[chunk?, token]``; the other sequences' are prompt
        pieces, or restoring pieces of a `batched.RestoringState`)."""
        sequences, decode, chunk, prefill, restoring = set(), 0, 0, 0, 0
        for entries in forwards:
            for seq, group in entries:
                sequences.add(seq)
                n = len(group)
                if seq.restores_only:
                    restoring += n
                elif seq not in fed:
                    prefill += n
                elif group.want_logits:  # (its token's group: fused with its chunk, or alone after ``serial``'s)
                    decode += 1
                    chunk += n - 1
                else:  # ``serial``: the chunk in a forward of its own
                    chunk += n
        return StepRows(len(sequences), decode, chunk, prefill, restoring)


class StepRecord(NamedTuple):
    """What `BatchEngine.step` ran last (``BatchEngine.last_step``), for diagnosing a loop's time: decided with the
    step, from host data only (nothing read from the device for it).

    ``forwards``: how each of its forwards ran (one; two in ``serial`` mode when chunks ride, or when the decode
    forward is split by width (`RowScheduler.by_width`), and with captured decode steps when prompt pieces ride beside
    decode rows: `RowScheduler`'s ``separate_prefill``): ``"replayed"``
    through the captured decode steps (`fast.batched_graphs.BatchedStepGraphs`; on a CPU model, their
    static-buffer step run eagerly), ``"captured"`` the same but that launch captured its key's graph first (the
    capture's warm-up runs included), ``"eager"`` the packed eager forward (`ForwardRunner`: prompt pieces, or an
    engine without captured steps; also a step of the captured steps whose capture failed, which runs eagerly on its
    buffers); ``rows``: its `StepRows`."""

    forwards: tuple[str, ...]
    rows: StepRows

    @property
    def kind(self) -> str:
        """``forwards`` joined by ``+`` (``"replayed"``, ``"captured"``, ``"eager"``, ``"eager+replayed"``, ...)."""
        return self.forwards[0] if len(self.forwards) == 1 else "+".join(self.forwards)


def check_prompt_forwards(value, setting: str) -> None:
    """``max_prompt_forwards``: None, or an int >= 1 (see `RowScheduler`)."""
    if not is_limit(value):
        raise ValueError(f"{setting} must be None (as many as the token budget gives) or an int >= 1 (prompt-piece "
                         f"forwards per step), got {value!r}.")


SPLIT_ROWS = 256  # rows a forward runs in about the time of its one pass over the weights (`width_split`)


class WideForward(list):
    """The wide half of a step split by width (`width_split`): a forward of its own, after the narrow half's, whose
    captured step gathers its slots (`fast.batched_graphs.BatchedStepGraphs.prepare`'s ``gather``)."""


def width_split(widths: list[int], split_rows: int | None) -> bool:
    """Whether a forward whose entries have ``widths`` rows each runs as two: its one-row entries (decode tokens
    without a chunk) in one forward, the wider ones (a token with its chunk, a restoring piece, a riding prompt) in
    another. A batched forward is rectangular, every entry padded to the widest, so while a few sequences carry
    chunks every other one pays their width; two forwards pay a second pass over the weights instead. A pure rule,
    by a roofline model of a forward's cost: ``max(1, rows / split_rows)`` passes' worth (a forward of up to
    ``split_rows`` rows costs about its one read of the weights; beyond, its arithmetic grows with its rows); split
    when the one forward's ``len(widths) x widest`` rows cost more than the narrow forward's and the wide one's
    together. None: never split. (The bf16 ridge of an H100 or H200, peak arithmetic over memory bandwidth, is 200
    to 300 rows for a dense model's matrix products: arithmetic from the published figures, not a measurement.)"""
    wide = [w for w in widths if w > 1]
    return _splits(len(widths) - len(wide), len(wide), max(wide, default=1), split_rows)


def _splits(narrow: int, wide: int, widest: int, split_rows: int | None) -> bool:
    """`width_split` for ``narrow`` one-row entries and ``wide`` others, the widest ``widest`` rows."""
    if split_rows is None or not narrow or not wide:
        return False

    def passes(rows: int) -> float:
        return max(1.0, rows / split_rows)

    return passes((narrow + wide) * widest) > passes(narrow) + passes(wide * widest)


def split_batches(max_batch: int, width: int, split_rows: int | None = SPLIT_ROWS) -> list[int]:
    """The batch buckets (`fast.batched_graphs.batch_bucket`) the wide half of a step split by width can take in steps
    of up to ``max_batch`` sequences whose widest entry has ``width`` rows (`width_split`; a narrower widest entry
    splits less often): what `raincheck_hf.warm_up` captures those halves at."""
    out = set()
    for n in range(2, max_batch + 1):
        for wide in range(1, n):
            if _splits(n - wide, wide, width, split_rows):
                out.add(batched_graphs.batch_bucket(wide))
    return sorted(out)


def check_split_rows(value, setting: str) -> None:
    """``split_rows``: None, or an int >= 1 (see `width_split`)."""
    if not is_limit(value):
        raise ValueError(f"{setting} must be None (never split a step by width) or an int >= 1 (rows a forward runs "
                         f"in about the time of its pass over the weights; default {SPLIT_ROWS}), got {value!r}.")


def check_ride_rows(value, setting: str) -> None:
    """``ride_max_rows``: None, or an int >= 1 (see `BatchEngine`)."""
    if not is_limit(value):
        raise ValueError(f"{setting} must be None (the default, {batched_graphs.RIDE_MAX_ROWS}) or an int >= 1 (rows "
                         f"a decode step may grow to by a prompt riding in it), got {value!r}.")


class RowScheduler:
    """Which rows each sequence gets in a step (no tensors of the model touched).

    Args:
        config: the engine's `RaincheckConfig` (``mode``: ``serial`` splits chunks into a forward of their own).
        token_budget: rows per step (decode rows, their chunks, prompt pieces and restoring pieces together),
            None: unbounded.
        separate_prefill: the prompt pieces of a step that also decodes go in a forward of their own, after the
            decode rows' (an engine with captured decode steps: the decode rows then replay their graph). In one
            packed forward ``[B, W]`` every sequence is padded to the longest piece: 31 decode rows beside a 630-row
            prompt piece cost 32 x 630 rows of compute and attention (the H200 server's eager steps at 32 clients:
            335 ms each, 60% of the round). Each sequence's rows are the same either way and sequences see only their
            own slots, so the answers do not change.
        ride: with ``separate_prefill``, ``ride(prefill, width, sequences)``: how many rows of a sequence's remaining
            prompt ride in the decode rows' forward (the captured step: `BatchedStepGraphs.ride_rows`, a short
            follow-up question, while the step stays narrow; ``width``: the step's widest decode group, ``sequences``:
            its sequences with this one), or 0: the piece goes in a forward of its own. None: no piece rides.
        piece_forwards: with ``separate_prefill``, each prompt piece that does not ride gets a forward of its own
            (the captured steps run a piece alone in a prefill step: `BatchedStepGraphs.accepts`), instead of one for
            them all.
        split_rows: the step's decode forward (decode rows, restoring pieces, riding prompts) runs as two forwards by
            width when `width_split` says it costs less (its one-row entries, then the wider ones: a `WideForward`),
            with this many rows to a pass over the weights; None: never. An attribute: it may change between steps.
        max_prompt_forwards: with ``piece_forwards``, at most this many such forwards in a step (each is a pass over
            the weights; a step's tokens come only once all its forwards ran): the prompts beyond them wait for the
            next step, whose decode rows run first, instead of every answer waiting for all of them. None: as many as
            the token budget gives. Pieces that ride, and the one-forward engines (no ``piece_forwards``), are not
            limited. An attribute: it may change between steps.
    """

    def __init__(self, config: RaincheckConfig, token_budget: int | None = None, separate_prefill: bool = False,
                 ride=None, piece_forwards: bool = False, max_prompt_forwards: int | None = None,
                 split_rows: int | None = SPLIT_ROWS):
        if not is_limit(token_budget):
            raise ValueError(f"BatchEngine token_budget must be None (no limit) or an int >= 1 (rows per step), "
                             f"got {token_budget!r}.")
        check_prompt_forwards(max_prompt_forwards, "BatchEngine(max_prompt_forwards=...)")
        check_split_rows(split_rows, "BatchEngine(split_rows=...)")
        self.split_rows = split_rows
        self.max_prompt_forwards = max_prompt_forwards
        self.config = config
        self.token_budget = token_budget
        self.separate_prefill = separate_prefill
        self.ride = ride
        self.piece_forwards = piece_forwards

    def chunk_cap(self, fed: list[SequenceState]) -> int | None:
        """The cap on each chunk of this step (`generation.shared_chunk_cap` over the ``fed`` sequences, those with a
        token to decode, whose next forward may carry a chunk; `RaincheckConfig.batch_chunk_rows`), or None: every
        sequence its own chunk."""
        carrying = sum(1 for seq in fed if seq.may_carry_chunk())
        return shared_chunk_cap(carrying, self.config.batch_chunk_rows, self.config.max_chunk_size)

    def schedule(self, adapter, sequences: list[SequenceState]) -> list[list[Entry]]:
        """The step's forwards (one; two in ``serial`` mode when a chunk rides; with ``separate_prefill`` the prompt
        pieces that do not ride with the decode rows (``ride``) in one more, or one more each with
        ``piece_forwards``), each a list of entries in the order of ``sequences``. Takes the fed tokens, chunks (each
        within the step's `chunk_cap`) and prompt pieces from the sequences."""
        fed = [seq for seq in sequences if seq.prefilled and seq.token is not None]
        cap = self.chunk_cap(fed)
        decode, used = [], 0
        for seq, row in zip(fed, token_rows(adapter, fed)):  # (their token rows made together)
            groups = seq.decode_groups(adapter, self.config, seq.token, cap, row)
            seq.token = None
            decode.append((seq, groups))
            used += sum(len(g) for g in groups)
        left = None if self.token_budget is None else self.token_budget - used
        widest = None  # (the step's widest decode group: found when a prompt may ride, not on every decode step)
        prefill, riding = [], []
        for seq in sequences:
            if seq.prefilled:
                continue
            if left is not None and left <= 0:
                break
            # (beside decode rows only, and whole: alone, a piece takes what the budget gives in one forward)
            most = 0
            if decode and self.separate_prefill and self.ride is not None:
                if widest is None:
                    widest = max(len(groups[-1]) for _, groups in decode)
                most = self.ride(seq.prefill, widest, len(decode) + len(riding) + 1)
                most = most if left is None or most <= left else 0
            if not most and self.piece_forwards and self.max_prompt_forwards is not None \
                    and len(prefill) >= self.max_prompt_forwards:
                continue  # (its piece would be one forward more: it waits for a next step; a later one may ride)
            piece = seq.take_prefill(most or left)
            (riding if most else prefill).append((seq, piece))
            if most:
                widest = max(widest, len(piece))
            if left is not None:
                left -= len(piece)
            if seq.prefilled:  # its forward 0 completes in this step
                seq.trace.restored_per_forward.append(seq.prefill_restored)
                seq.trace.chunk_size_per_forward.append(0)
        restoring = self.restoring_pieces(adapter, sequences, left)
        forwards = []
        chunks = [(seq, groups[0]) for seq, groups in decode if len(groups) == 2]
        if chunks:
            forwards.append(chunks)
        decoding = [(seq, groups[-1]) for seq, groups in decode] + riding
        if self.separate_prefill and prefill and (decoding or restoring or self.piece_forwards):
            pieces = [[piece] for piece in prefill] if self.piece_forwards else [prefill]
            return forwards + (self.by_width(decoding + restoring) if decoding or restoring else []) + pieces
        main = decoding + prefill + restoring
        if main:
            forwards += self.by_width(main)
        return forwards

    def by_width(self, entries: list[Entry]) -> list[list[Entry]]:
        """``entries`` as one forward, or split by width (`width_split`): their one-row entries, then a `WideForward`
        of the others, each in the order of ``entries``. Each sequence's rows are the same either way, and every
        sequence sees only its own slot, so nothing any sequence computes changes."""
        if not width_split([len(g) for _, g in entries], self.split_rows):
            return [entries]
        return [[e for e in entries if len(e[1]) == 1], WideForward(e for e in entries if len(e[1]) > 1)]

    def restoring_pieces(self, adapter, sequences: list[SequenceState], left: int | None) -> list[Entry]:
        """The restoring sequences' pieces in the step's spare budget: ``left``, the rows the budget has after every
        decode row, its chunk and the prompt pieces (None: no budget; each piece is then its sequence's
        ``max_rows``, so a step stays bounded). In arrival order, a piece each while rows are left; taken from
        their pending rows. They ride in whatever step the others make: with captured decode steps a step of decode
        rows and restoring pieces is still replayed (`fast.batched_graphs.decode_only`)."""
        pieces = []
        for seq in sequences:
            if not isinstance(seq, RestoringState) or seq.num_pending == 0:
                continue
            if left is not None and left <= 0:
                break
            piece = seq.take_piece(adapter, left)
            pieces.append((seq, piece))
            if left is not None:
                left -= len(piece)
        return pieces


class ForwardRunner:
    """Runs one packed forward ``[B, W]`` over entries of several sequences on the slot pool.

    Builds ``embeds [B, W, D]``, ``positions [3, B, W]``, DeepStack rows and the 4-D mask from the pool's slot keys
    (`SlotKVPool.begin_step`); Gated DeltaNet families run their layers per sequence on the step's rows of the
    per-slot states (``recurrent``: taken for the step's slots and put back after it)."""

    def __init__(self, adapter, pool: SlotKVPool, recurrent=None):
        self.adapter, self.pool, self.recurrent = adapter, pool, recurrent

    def run(self, entries: list[Entry]) -> dict[SequenceState, torch.Tensor]:
        """Logits ``[V]`` of the last row of each entry whose group wants them."""
        adapter, pool = self.adapter, self.pool
        device = adapter.device
        width = max(len(g) for _, g in entries)
        batch = len(entries)
        hidden = adapter.text_model.embed_tokens.weight.shape[-1]
        embeds = torch.zeros(batch, width, hidden, dtype=adapter.dtype, device=device)
        positions = torch.zeros(3, batch, width, dtype=torch.long, device=device)
        visual = torch.zeros(batch, width, dtype=torch.bool, device=device)
        deepstack = []
        for b, (_, group) in enumerate(entries):
            n = len(group)
            embeds[b, :n] = group.batch.embeds.to(device, adapter.dtype)
            positions[:, b, :n] = group.batch.positions.to(device)
            visual[b, :n] = group.batch.visual.to(device)
            if group.batch.deepstack is not None and group.batch.deepstack[0].shape[0]:  # (shapes: no host sync)
                deepstack.append(group.batch.deepstack)
        slots = [seq.slot for seq, _ in entries]
        visible = pool.begin_step(slots, [g.keys for _, g in entries], width)
        ok = False
        try:
            mask = batched_visibility_to_attention_mask(visible, adapter.attn_implementation, adapter.dtype)
            ds = [torch.cat(layer) for layer in zip(*deepstack)] if deepstack else None
            states = None if self.recurrent is None else self.recurrent.take(slots)
            scope = (contextlib.nullcontext() if states is None
                     else adapter.packed_step(states, [seq.layout(g) for seq, g in entries]))
            with scope:
                out = adapter.text_model(
                    inputs_embeds=embeds,
                    position_ids=positions,
                    attention_mask=adapter.text_attention_mask(mask),
                    cache=pool,
                    use_cache=True,
                    **adapter.packed_deepstack_kwargs(visual, ds),
                )
            ok = True
        finally:
            pool.end_step(ok)  # a forward that failed leaves the slots as they were
        if states is not None:
            self.recurrent.put(slots, states)
        for seq, group in entries:
            seq.stored(group)
        wanted = [b for b, (_, g) in enumerate(entries) if g.want_logits]
        if not wanted:
            return {}
        picks = torch.tensor([wanted, [len(entries[b][1]) - 1 for b in wanted]], dtype=torch.long)
        picks = to_device(picks, device)  # (pinned, non-blocking: the host does not wait for the forward)
        picked = out.last_hidden_state[picks[0], picks[1]]
        head = adapter.lm_head(picked[:, None])[:, 0]
        return {entries[b][0]: head[k] for k, b in enumerate(wanted)}


class _Snapshot:
    """The engine's sequences as they are before `BatchEngine.prepare` schedules a step (their attributes, their
    traces' and schedulers', and the lengths of the lists among them), to put back if that step is never launched:
    scheduling rebinds a sequence's pending rows, prefill, token and counters, and appends to its lists (the tokens
    fed, the trace's per-forward records, a restoring sequence's pieces), which are cut back to their lengths. (Lengths,
    not copies: a long answer's lists would make every step copy its whole history.)"""

    def __init__(self, sequences: list[SequenceState]):
        self.saved = []
        for seq in sequences:
            for owner in (seq, seq.trace, seq.scheduler):
                if owner is not None:
                    attrs = dict(vars(owner))
                    self.saved.append((owner, attrs, [(v, len(v)) for v in attrs.values() if isinstance(v, list)]))

    def restore(self) -> None:
        for owner, attrs, lists in self.saved:
            vars(owner).update(attrs)
            for items, n in lists:
                del items[n:]  # (the same list objects: whoever holds them sees them restored)


class _Ahead(NamedTuple):
    forwards: list  # the step's forwards (`RowScheduler.schedule`)
    ready: list  # per forward, its prepared captured step (`BatchedStepGraphs.prepare`) or None
    snapshot: _Snapshot
    rows: StepRows  # its rows by kind
    narrowed: list  # per forward, whether it runs as `BatchEngine._narrowed` forwards (`BatchEngine._padding_short`)


class BatchEngine:
    """Sequences that join and leave at any step, one packed forward per step (see the module docstring).

    Args:
        model: a model `raincheck_hf` supports (on the eager engine: ``attn_implementation`` ``sdpa`` or ``eager``).
        config: the `RaincheckConfig` of every sequence (mode, retention, chunks, selector).
        token_budget: rows per step (decode rows first, then prompt pieces, then restoring pieces); None: no limit
            (a prompt's whole prefill in its first step).
        num_slots, capacity: the pool's initial slots and rows per slot (both double on demand).
        max_prompt_forwards: with ``graphs``, the most prompt-piece forwards in one step (`RowScheduler`); None: as
            many as the token budget gives.
        ride_max_rows: with ``graphs`` on the attention families, the most rows (batch bucket x width) a decode
            step may grow to by a short prompt riding in it (`BatchedStepGraphs.ride_rows`); a prompt that would make
            it wider runs in a forward of its own. None: `batched_graphs.RIDE_MAX_ROWS`. May be set between steps.
        split_rows: a step's decode forward runs as two by width when `width_split` (with this many rows to a pass
            over the weights) says that costs less: the sequences decoding a token alone in one, those carrying a
            chunk (and restoring pieces, riding prompts) in a second, so that a few chunks do not pad every other
            sequence to their width (with captured steps the second gathers its slots, at the width of the largest
            chunk). Default `SPLIT_ROWS`; None: never. Answers are the same either way. May be set between steps.
        graphs: run the decode steps (decode rows, and restoring sequences' pieces beside them; on the attention
            families also short prompts riding with them, and each longer prompt's pieces in a step of their own)
            as captured CUDA graphs per (batch bucket, width, span bucket) (`fast.batched_graphs`; on a CPU model
            the same static-buffer step runs eagerly); None: follow ``config.fast_path`` (None: eager; True where
            the family supports it: every family with a fast path, the MoE ones with transformers' ``grouped_mm``
            experts in bfloat16, on CUDA; on the Gated DeltaNet families the per-slot GDN states are read and
            written through the step's device slot indices, and every prompt piece runs alone in a step of its
            own). With graphs, the pool (and its graphs, and the per-slot GDN states) comes from the ones
            kept per model and goes back with `close`.
    """

    def __init__(self, model, config: RaincheckConfig | None = None, *, token_budget: int | None = None,
                 num_slots: int = DEFAULT_SLOTS, capacity: int = 256, graphs: bool | None = None,
                 max_prompt_forwards: int | None = None, ride_max_rows: int | None = None,
                 split_rows: int | None = SPLIT_ROWS):
        check_ride_rows(ride_max_rows, "BatchEngine(ride_max_rows=...)")
        check_split_rows(split_rows, "BatchEngine(split_rows=...)")
        self._ride_max_rows = ride_max_rows
        self.model = model
        self.config = config if config is not None else RaincheckConfig()
        self.adapter = get_adapter(model)
        check_attention_implementation(self.adapter.attn_implementation)
        use_graphs = batched_graphs.resolve_graphs(self.adapter, self.config, graphs)
        # (with captured steps, a short prompt's piece rides in the decode rows' step on the attention families,
        # `BatchedStepGraphs.ride_rows`; any other runs in a captured forward of its own after it, alone)
        self.text_config = model.config.get_text_config()
        self.graphs = None
        ride = None
        if use_graphs:
            self.graphs = batched_graphs.acquire(self.adapter, self.text_config.num_hidden_layers, num_slots, capacity)
            self.pool = self.graphs.pool
            graphs, config = self.graphs, self.config
            def ride(prefill, width, n, engine=weakref.ref(self)):  # (a weak reference: no cycle through the scheduler)
                most = engine().ride_max_rows
                most = batched_graphs.RIDE_MAX_ROWS if most is None else most
                return graphs.ride_rows(prefill, config, width, n, most)
        else:
            self.pool = SlotKVPool(self.text_config.num_hidden_layers, num_slots, capacity, self.adapter.device)
        # None: attention layers only; with graphs, the per-slot states kept with the pool (its captured steps use them)
        self.recurrent = (self.graphs.recurrent if self.graphs is not None
                          else self.adapter.packed_states(self.pool.num_slots))
        self.runner = ForwardRunner(self.adapter, self.pool, self.recurrent)
        self._narrow_until = 0.0  # (`_padding_short`: no growth for padding tried again before this monotonic time)
        self.scheduler = RowScheduler(self.config, token_budget, separate_prefill=use_graphs, ride=ride,
                                      piece_forwards=use_graphs, max_prompt_forwards=max_prompt_forwards,
                                      split_rows=split_rows)
        self.sequences: list[SequenceState] = []  # in arrival order
        self._members: set[SequenceState] = set()
        self.carried: dict[SequenceState, int] = {}  # the sequences with rows in the last step, and their rows
        self.last_step: StepRecord | None = None  # what the last step ran (None: no step yet, or it raised)
        self._ahead: _Ahead | None = None  # the next step, `prepare`d
        self._arrivals = 0
        self._closed = False

    # ---- joining and leaving ------------------------------------------------------------------
    def add(self, input_ids: torch.Tensor, *, cache: DeferredDynamicCache | None = None, captures=None,
            **media) -> SequenceState:
        """A new sequence, prefilled from the next `step` on: a fresh prompt ``input_ids`` (``[L]`` or ``[1, L]``,
        no padding) with its media (``pixel_values`` / ``pixel_values_videos`` or ``mm_encoder_outputs``,
        ``image_grid_thw`` / ``video_grid_thw``, ``second_per_grid_ts``), or the next turn of a held
        conversation: ``cache`` (a batch-1 `DeferredDynamicCache`, left unchanged) and ``input_ids`` the whole
        conversation as a batch-1 follow-up takes them. ``captures``: the prompt's VisionZip record."""
        if self._closed:
            raise ValueError("BatchEngine.add after close(): the engine gave its pool back; make a new engine.")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"BatchEngine.add takes one sequence's input_ids ([L] or [1, L], L >= 1), got shape "
                             f"{tuple(ids.shape)}; add each prompt of a batch on its own.")
        if cache is not None:
            _check_held(cache, "add(cache=...)")
        state = new_sequence(self.model, self.adapter, self.config, self._arrivals, ids, cache=cache,
                             captures=captures, **media)
        self._arrivals += 1
        self.join(state, cache)
        return state

    def add_made(self, state: SequenceState, cache: DeferredDynamicCache | None = None) -> SequenceState:
        """A sequence made ahead by `batched.new_sequence` with this engine's model and an equal config (elsewhere,
        e.g. on the thread that asked: `batch_loop.BatchLoop.prepare_ahead`), prefilled from the next `step` on, as
        `add` would have made it; it takes the next arrival number. ``cache``: for a follow-up, the held cache it was
        made from, as it was then (the caller's promise; copied in, left unchanged)."""
        if self._closed:
            raise ValueError("BatchEngine.add_made after close(): the engine gave its pool back; make a new engine.")
        if state in self._members or state.prefilled:
            raise ValueError("BatchEngine.add_made takes a sequence made by new_sequence and not added anywhere yet.")
        if cache is not None:
            _check_held(cache, "add_made(cache=...)")
        state.index = self._arrivals
        self._arrivals += 1
        self.join(state, cache)
        return state

    def restore(self, cache: DeferredDynamicCache, max_rows: int | None = None) -> RestoringState:
        """A held conversation joins only to restore its pending deferred rows in the spare budget of the steps
        (a `batched.RestoringState`: it generates nothing; ``cache``, a batch-1 `DeferredDynamicCache` with
        pending rows, is left unchanged). Each step gives it at most ``max_rows`` (default: the engine config's
        ``idle_chunk_size``), the head of its pending rows, as `generation.restore_pending` takes them, and only
        rows the step's ``token_budget`` has left after every decode row, chunk and prompt piece. It leaves with
        `remove` (its cache: the held one with the restored rows stored) or `discard`, whenever the caller says:
        once ``num_pending`` is 0, or when its conversation gets a follow-up (which then joins with that cache)."""
        if self._closed:
            raise ValueError("BatchEngine.restore after close(): the engine gave its pool back; make a new engine.")
        _check_held(cache, "restore")
        if cache.num_pending == 0:
            raise ValueError("BatchEngine.restore got a cache with no pending deferred rows: nothing to restore.")
        max_rows = self.config.idle_chunk_size if max_rows is None else max_rows
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"BatchEngine.restore max_rows must be an int >= 1 (rows per step), got {max_rows!r}.")
        state = restoring_sequence(cache, self._arrivals, max_rows)
        self._arrivals += 1
        self.join(state, cache)
        return state

    def join(self, state: SequenceState, cache: DeferredDynamicCache | None = None) -> None:
        """Give ``state`` (from `batched.new_sequence`) a slot; with ``cache`` (the held conversation it continues),
        copy its KV rows, order keys and recurrent states in."""
        if self._closed:
            raise ValueError("BatchEngine.join after close(): the engine gave its pool back; make a new engine.")
        self.abandon()  # a step prepared without it is not the next step any more
        slot = self.pool.allocate()
        if self.recurrent is not None:
            self.recurrent.grow(self.pool.num_slots)
            self.recurrent.reset(slot)
        state.slot = slot
        if cache is not None:
            kv = {i: (layer.keys, layer.values) for i, layer in enumerate(cache.layers)
                  if not isinstance(layer, LinearAttentionCacheLayerMixin) and layer.is_initialized}
            self.pool.load(slot, cache.row_keys, kv)
            if self.recurrent is not None:
                self.adapter.load_packed_state(self.recurrent, slot, cache)
        self.sequences.append(state)
        self._members.add(state)

    @property
    def ride_max_rows(self) -> int | None:
        """The most rows a decode step may grow to by a prompt riding in it (see the class's ``ride_max_rows``)."""
        return self._ride_max_rows

    @ride_max_rows.setter
    def ride_max_rows(self, value: int | None) -> None:
        check_ride_rows(value, "BatchEngine.ride_max_rows")
        self._ride_max_rows = value

    @property
    def split_rows(self) -> int | None:
        """Rows to a pass over the weights in the rule that splits a step's decode forward by width (see the class's
        ``split_rows``; None: never split)."""
        return self.scheduler.split_rows

    @split_rows.setter
    def split_rows(self, value: int | None) -> None:
        check_split_rows(value, "BatchEngine.split_rows")
        self.scheduler.split_rows = value  # (a step prepared under the old rule stays: answers are the same)

    def remove(self, seq: SequenceState) -> DeferredDynamicCache | None:
        """``seq`` leaves (at any step): its state as the `DeferredDynamicCache` its own call would have returned
        (`SequenceState.to_cache`), or None when its prompt was not fully prefilled yet (nothing to continue);
        its slot is freed (its keys reset: nothing of it is visible to the slot's next owner)."""
        return self.remove_many([seq])[0]

    def remove_many(self, seqs: list[SequenceState]) -> list[DeferredDynamicCache | None]:
        """`remove` of each of ``seqs`` (the same caches, in their order), at once: the recurrent states of all of
        them exported from one gathered copy per state tensor and layer (`ModelAdapter.export_packed_states`), their
        slots freed together, the highest first, and the sequences that stay moved down once into the holes below
        them (at the end of a batched ``generate``, where every row leaves, nothing moves). One by one, the end of a
        batch-8 ``generate`` on Qwen3.5-9B took ~130 ms after its last token (an H100), ~32 ms this way."""
        seqs = list(seqs)
        if not seqs:  # (nothing leaves: a prepared step stays prepared)
            return []
        for seq in seqs:
            if seq not in self._members:
                raise ValueError("BatchEngine.remove / remove_many got a sequence that is not in this engine.")
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("BatchEngine.remove_many got a sequence more than once.")
        self.abandon()  # (before their states are read: a prepared step took their tokens and chunks)
        caches = [seq.to_cache(self.pool, self.text_config, self.adapter.device) if seq.prefilled else None
                  for seq in seqs]
        done = [(seq, cache) for seq, cache in zip(seqs, caches) if cache is not None]
        if done and self.recurrent is not None:
            self.adapter.export_packed_states(self.recurrent, [seq.slot for seq, _ in done], [c for _, c in done])
        for seq, cache in done:
            if seq.trace is not None:  # (a restoring sequence has no turn of its own)
                seq.trace.pending = cache.pending_sources
        self._free(*seqs)
        return caches

    def discard(self, seq: SequenceState) -> None:
        """``seq`` leaves without a cache (a failed or abandoned turn): its slot is freed and reset as in `remove`,
        and nothing of its state is built back (it may be half-updated by a step that raised)."""
        if seq not in self._members:
            raise ValueError("BatchEngine.discard got a sequence that is not in this engine.")
        self._free(seq)

    def _free(self, *seqs: SequenceState) -> None:
        """Release the slots of ``seqs`` (keys reset, recurrent rows reset) and take them out of the engine; with
        captured steps, the sequences in the highest slots then move down into the holes (they read views of the
        lowest slots), each at most once."""
        self.abandon()  # a step prepared with them is not the next step any more
        holes = sorted((seq.slot for seq in seqs), reverse=True)
        for seq in seqs:
            seq.slot = None
            self.sequences.remove(seq)
            self._members.discard(seq)
        for hole in holes:  # (the highest first: the free list stays sorted with the fewest shifts)
            self.pool.release(hole)
        if self.recurrent is not None:
            self.recurrent.reset_rows(holes)
        if self.graphs is None:
            return
        for hole in sorted(holes):  # the lowest hole takes the highest sequence above it, and so on
            last = max(self.sequences, key=lambda s: s.slot, default=None)
            if last is None or last.slot < hole:
                break
            self.pool.move(last.slot, hole)
            if self.recurrent is not None:
                self.recurrent.move(last.slot, hole)
            last.slot = hole

    # ---- stepping --------------------------------------------------------------------------------
    def feed(self, seq: SequenceState, token) -> None:
        """The token the caller chose from ``seq``'s last logits (an int, or a one-element tensor, best on the host: a
        device tensor is read back here): its next decode row (generated token i)."""
        self._check_feed(seq, "feed")
        if isinstance(token, torch.Tensor):
            if token.numel() != 1:
                raise ValueError(f"BatchEngine.feed takes one token id, got a tensor of shape {tuple(token.shape)}.")
            token = token.item()  # (a host int from here on: a device tensor is read back once, here)
        seq.token = int(token)
        seq.generated += 1

    def feed_all(self, sequences: list[SequenceState], tokens: torch.Tensor) -> list[DeviceToken]:
        """Feed ``sequences[i]`` the token ``tokens[i]`` (a tensor ``[n]``, on the device where it was chosen) without
        reading it back: their decode rows are made from it on the device, so the next step can be `prepare`d
        before the host waits for the tokens. Returns each one's `batched.DeviceToken`: set its ``value`` to the host
        int once read (else it is read when a cache needs it)."""
        if tokens.dim() != 1 or tokens.shape[0] != len(sequences):
            raise ValueError(f"BatchEngine.feed_all takes one token per sequence ([{len(sequences)}]), got a tensor "
                             f"of shape {tuple(tokens.shape)}.")
        for seq in sequences:
            self._check_feed(seq, "feed_all")
        fed = [DeviceToken(tokens, i) for i in range(len(sequences))]
        for seq, token in zip(sequences, fed):
            seq.token = token
            seq.generated += 1
        return fed

    def _check_feed(self, seq: SequenceState, what_call: str) -> None:
        self.abandon()  # (the prepared step, if any, took the fed tokens: they are back)
        members = self._members  # (a set: a list's membership test is linear in the batch)
        if seq not in members or not seq.prefilled or seq.token is not None or isinstance(seq, RestoringState):
            what = ("not in this engine" if seq not in members else "still prefilling" if not seq.prefilled
                    else "restoring only (it generates nothing)" if isinstance(seq, RestoringState)
                    else "already fed a token for the next step")
            raise ValueError(f"BatchEngine.{what_call}: the sequence is {what}.")


    @property
    def idle(self) -> bool:
        """No sequence has rows of an answer to run (restoring sequences do not count: they only fill steps)."""
        return self._ahead is None and all(s.prefilled and s.token is None for s in self.sequences)

    @property
    def restoring(self) -> list[RestoringState]:
        """The restoring sequences (`restore`), in arrival order."""
        return [s for s in self.sequences if isinstance(s, RestoringState)]

    def prepare(self) -> None:
        """Decide the next step now and make it ready without running it (a captured step's buffers filled:
        `BatchedStepGraphs.prepare`), so that the host's work for step ``i + 1`` overlaps the device's step ``i``:
        the drivers feed the tokens they chose on the device (`feed_all`), prepare, and only then wait for the
        tokens. `step` launches it. Any change of the sequences before that (a join, a leave, a feed) abandons it
        (`abandon`: every sequence back as it was) and the next `step` decides again, as if it never was."""
        if self._ahead is not None or self._closed:
            return
        self._ahead = self._decide()

    def _decide(self) -> _Ahead:
        """The next step: its forwards (`RowScheduler.schedule`, which takes the sequences' tokens, chunks and pieces),
        the captured one's buffers filled, its rows by kind; a schedule or fill that raises leaves every sequence as
        it was."""
        snapshot = _Snapshot(self.sequences)
        try:
            fed = {seq for seq in self.sequences if seq.token is not None}  # (before the schedule takes the tokens)
            forwards = self.scheduler.schedule(self.adapter, self.sequences)
            rows = StepRows.of(forwards, fed)
            ready = [None] * len(forwards)
            # (``serial`` mode's second forward is filled after its first ran: its rows start after the chunks'; a
            # step split by width is two forwards over other sequences, both filled now: the narrow one's padding in
            # the wide one's slots sits where the wide one writes after it)
            split = len(forwards) == 2 and isinstance(forwards[1], WideForward)
            accepted = [self.graphs is not None and self.graphs.accepts(f, self.config) for f in forwards]
            narrowed = [self._padding_short(f, a) for f, a in zip(forwards, accepted)]
            if (len(forwards) == 1 or split) and not any(narrowed) and all(accepted):
                ready = [self.graphs.prepare(f, self.config, gather=isinstance(f, WideForward)) for f in forwards]
                if split and ready[0].setting != ready[1].setting:  # (the wide one grew the pool: fill the first again)
                    ready[0] = self.graphs.prepare(forwards[0], self.config)
        except BaseException:
            snapshot.restore()
            raise
        return _Ahead(forwards, ready, snapshot, rows, narrowed)

    def _extent(self, entries, captured: bool) -> int:
        """The rows of its slots that the forward ``entries`` writes up to (each entry padded to the forward's width
        from its slot's length on): `batched_graphs.step_width` where the captured steps take it (``captured``: they
        accept it), else the widest entry (`ForwardRunner`)."""
        width = (batched_graphs.step_width(entries, self.config, isinstance(entries, WideForward)) if captured
                 else max(len(g) for _, g in entries))
        return max(self.pool.lengths[seq.slot] for seq, _ in entries) + width

    def _padding_short(self, entries, captured: bool) -> bool:
        """Whether the forward ``entries`` (``captured``: the captured steps accept it) must run narrower (`_narrowed`):
        its padding would outgrow the pool's slots (`_extent`) while every entry's own rows fit them, and that growth
        found no device memory. The growth is tried without asking for room (`kv_pool.SlotKVPool.reserve`'s
        ``relieve``): padding is no reason to evict a held conversation. After one that failed, none is tried for
        `NARROW_S` (a failed allocation has the caching allocator give back every cached block, each later one a new
        device allocation): the forwards run narrower meanwhile. A growth the entries' own rows need is left to the
        forward (which may ask for room)."""
        pool = self.pool
        extent = self._extent(entries, captured)
        if extent <= pool.capacity or any(pool.lengths[seq.slot] + len(g) > pool.capacity for seq, g in entries):
            return False
        if time.monotonic() < self._narrow_until:
            return True
        try:
            pool.reserve(extent, relieve=False)
        except PoolOutOfMemory:
            self._narrow_until = time.monotonic() + self.NARROW_S
            return True
        return False

    NARROW_S = 1.0  # after a growth for padding found no memory, the seconds before one is tried again

    def _narrowed(self, entries) -> list[list]:
        """The forward ``entries`` as eager forwards (`ForwardRunner`, each at its widest entry's rows) that the pool's
        slots hold: the entries on the fullest slots in forwards of their own, as narrow as their rows. Each entry's
        rows and what it sees are the same in any forward (a sequence reads only its own slot), so its results are
        too."""
        pool = self.pool
        left, parts = sorted(entries, key=lambda e: pool.lengths[e[0].slot]), []
        while left:
            part = []
            for entry in left:  # (the first always fits alone: its own rows fit its slot)
                width = max(len(g) for _, g in part + [entry])
                if all(pool.lengths[seq.slot] + width <= pool.capacity for seq, _ in part + [entry]):
                    part.append(entry)
            parts.append(part)
            left = [e for e in left if not any(e is p for p in part)]
        return parts

    def abandon(self) -> None:
        """Drop the `prepare`d step, if any: the sequences get back the chunks, pieces and tokens it took."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.snapshot.restore()

    def step(self) -> dict[SequenceState, torch.Tensor]:
        """One step: every fed token (with its chunk), prompt pieces under the budget, then restoring sequences'
        pieces in what the budget has left (the `prepare`d step when there is one). The next-token logits ``[V]`` of
        each sequence that has them (a fed token ran, or its prompt's last piece). ``carried``: the sequences with
        rows in it and their rows (set before it runs: if it raises, those are the sequences it may have changed).
        ``last_step``: what it ran (`StepRecord`), set once it ran (None while it runs, and after one that raised)."""
        ahead, self._ahead = self._ahead, None
        self.last_step = None
        if ahead is None:
            # (until it is decided, every sequence that may get rows: a fill that raises may have changed them)
            self.carried = {s: 0 for s in self.sequences if not s.prefilled or s.token is not None or s.restores_only}
            ahead = self._decide()
        forwards, ready, rows = ahead.forwards, ahead.ready, ahead.rows
        self.carried = {}
        for entries in forwards:
            for seq, group in entries:
                self.carried[seq] = self.carried.get(seq, 0) + len(group)
        logits, how = {}, []
        for entries, prepared, narrowed in zip(forwards, ready, ahead.narrowed):
            captures = None if self.graphs is None else len(self.graphs.capture_log)  # (a capture is logged there)
            if narrowed:  # (its padding found no memory to grow the slots: narrower forwards, eagerly)
                for part in self._narrowed(entries):
                    logits.update(self.runner.run(part))
                how.append("eager")
                continue
            if prepared is not None:
                logits.update(self.graphs.launch(prepared))
            elif self.graphs is not None and self.graphs.accepts(entries, self.config):
                logits.update(self.graphs.run(entries, self.config, gather=isinstance(entries, WideForward)))
            else:
                logits.update(self.runner.run(entries))
                how.append("eager")
                continue
            how.append("eager" if self.graphs.ran_eagerly  # (its capture failed: the step ran eagerly on its buffers)
                       else "captured" if len(self.graphs.capture_log) > captures else "replayed")
        self.last_step = StepRecord(tuple(how), rows)
        return logits

    def close(self) -> None:
        """Give the pool (with its captured graphs) back for later engines on the model, once every sequence has
        left (else it is simply dropped with the engine). The engine takes no sequence after this."""
        self.abandon()
        if self.graphs is not None and not self.sequences:
            batched_graphs.release(self.graphs)
        self.graphs = None
        self._closed = True

# ---- `generate` with a batch of prompts: every row joins at step 0 ----------------------------------------

def batched_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                   streamer=None, raincheck_config: RaincheckConfig | None = None, raincheck_grids: dict | None = None,
                   raincheck_streamer=None, raincheck_captures=None, raincheck_pixels=None, **model_kwargs):
    """The ``custom_generate`` callable for ``input_ids [B, L]``, B > 1 (`integration.enable` passes it instead of
    `generation.raincheck_sample`; same signature; see `batched`'s module docstring): one driver over a
    `BatchEngine` in which every row joins at step 0 (its whole prompt in the first forward) and leaves when it
    finishes; choosing tokens (HF's processors, sampling, stopping criteria, streamer) stays here.
    ``raincheck_pixels`` is always None for a batch (the wrapper holds pixels back for batch 1 only)."""
    streamer = streamer if streamer is not None else raincheck_streamer
    if raincheck_streamer is not None:
        raincheck_streamer.put(input_ids.cpu())  # what HF's generate does before calling the loop
    config = raincheck_config if raincheck_config is not None else RaincheckConfig()
    adapter = get_adapter(model)
    grids = raincheck_grids or {}
    states = start_sequences(model, adapter, config, input_ids, model_kwargs.get("attention_mask"), grids,
                             model_kwargs.get("mm_encoder_outputs"), raincheck_captures)
    engine = BatchEngine(model, config, num_slots=len(states),
                         capacity=max(len(s.prefill) + s.num_pending for s in states)
                         + generation_config.max_length - input_ids.shape[1] + 1, split_rows=SPLIT_ROWS)
    try:
        return _drive(engine, states, input_ids, logits_processor, stopping_criteria, generation_config, streamer)
    finally:
        engine.close()  # its pool (and captured decode steps) go back for the model's next batched call


def _drive(engine, states, input_ids, logits_processor, stopping_criteria, generation_config, streamer):
    """`batched_sample`'s loop over ``engine``: every sequence joins, steps until every row has finished."""
    for s in states:
        engine.join(s)
    caches: list[DeferredDynamicCache | None] = [None] * len(states)

    logits = engine.step()  # forward 0: each sequence's T ∪ S
    scores, raw_logits, finished_pad = sampling_setup(input_ids, stopping_criteria, generation_config)
    leaves = finished_pad is not None  # a finished row's tokens are pads from then on
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    active = list(states)  # the sequences still in the engine
    while True:
        # the rows' logits in one copy (a finished row that left: zeros, its token is the pad whatever they are)
        rows = torch.stack([logits[s] for s in active])
        if len(active) == input_ids.shape[0]:  # (every row still in, in row order: ``active`` keeps it)
            full = rows
        else:
            full = rows.new_zeros(input_ids.shape[0], rows.shape[-1])
            full.index_copy_(0, to_device(torch.tensor([s.index for s in active], dtype=torch.long), full.device),
                             rows)
        next_tokens, scores, raw_logits = choose_next_tokens(
            full, input_ids, logits_processor, generation_config, scores, raw_logits, unfinished,
            finished_pad)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        # The next step is decided and made ready before the host waits for this one (its host work overlaps the
        # device's): every active row fed its token where it was chosen, as if none finishes. A row that does leaves
        # below, which drops that step (`BatchEngine.abandon`), and the next `step` decides again without it.
        fed = engine.feed_all(active, next_tokens if len(active) == input_ids.shape[0]
                              else next_tokens[to_device(torch.tensor([s.index for s in active]), next_tokens.device)])
        engine.prepare()
        # The step's one wait for the device: the sampled tokens and the rows still going, read back together.
        # Everything the host decides from here (who leaves, the next step's rows) uses these ints.
        tokens, going = torch.stack([next_tokens.long(), unfinished.long()]).tolist()
        for s, token in zip(active, fed):
            token.value = tokens[s.index]
        done = max(going) == 0
        leaving = [s for s in active if not going[s.index]] if leaves and not done else []
        if leaving:  # finished sequences leave the engine (their slots with them); the next step is decided again
            for s, cache in zip(leaving, engine.remove_many(leaving)):
                caches[s.index] = cache
                active.remove(s)
        if not done:  # the next step goes now, the streamer's work beside it on the host
            logits = engine.step()
        if streamer is not None:
            streamer.put(torch.tensor(tokens, dtype=next_tokens.dtype))
        if done:
            break

    for s, cache in zip(active, engine.remove_many(active)):
        caches[s.index] = cache
    traces = [s.trace for s in states]  # (each one's pending rows set as it left)
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return input_ids
    return RaincheckGenerateOutput(sequences=input_ids, scores=scores, logits=raw_logits, cache=caches,
                                   raincheck=traces)
