"""Batched `generate(raincheck=...)`: several sequences' rows in one forward (eager engine, every family).

``model.generate(**inputs, raincheck=cfg)`` with ``input_ids [B, L]``, B > 1, comes here through
`batch_engine.batched_sample`. The prompts are left-padded as HF users pass them (the processor with
``padding_side="left"`` and its ``attention_mask``), each row with its own images / videos. Every row is
its own sequence (`SequenceState`): it is encoded, selected and planned exactly as the same call on that
row alone (without its padding) would do it (`new_sequence`), keeps its own pending deferred rows, 3-D
positions, DeepStack rows, chunk scheduler and trace, and sees only its own rows (docs/method.md §3, per
sequence).

The forwards run on `batch_engine.BatchEngine`: each sequence owns a slot of its `kv_pool.SlotKVPool` and
writes its rows at its own offsets there; one packed forward ``[B, W]`` per step carries each sequence's
``RowGroup`` (a prefill: its T ∪ S rows; a decode step: its ``[chunk?, token]``), shorter groups padded at the
end, and a query sees the rows of its own slot whose order key is not larger than its own (the batch-1
engine's rule; padding rows keep the empty key, so nothing of another sequence or of padding is visible).
`batch_engine.batched_sample` is one driver over the engine: every row joins at step 0 with its whole prompt in
the first forward, and chooses its tokens with HF's logits processors, sampling and stopping criteria.

A sequence that has finished (its later tokens are forced to the pad token, as in stock batched
`generate`: an EOS stopping criterion and a pad token) leaves the engine (`BatchEngine.remove_many`, with the
others that finish in the same step, as every row still going does at the end: its slot is freed), so it costs no
compute and its chunks stop; its scores in the output are zeros from then on (its token is the pad token whatever
they are). Without an EOS criterion a finished row keeps decoding, as stock `generate` does.

What the call returns for B > 1: ``out.raincheck`` is a list of B `RaincheckTrace`s, ``out.cache`` a list of
B `DeferredDynamicCache`s (each row's KV rows, order keys, pending deferred rows and source accounting,
as the row alone would leave them: `restore_pending` or a follow-up batch-1 `generate` continues that
row's conversation). A trace's and a cache's source positions index the row *without* its left padding
(``input_ids[i, pad_i:]``, ``pad_i = (attention_mask[i] == 0).sum()``), exactly as in the row's own call.

Gated DeltaNet families (Qwen3.5, Qwen3.5-MoE): their GDN layers keep no KV rows; each sequence's recurrent
states are its slot's row of `batched_gdn.PackedGDNStates` (from `ModelAdapter.packed_states`), and each
forward gives the family each sequence's row layout (`SequenceState.layout`: deferred rows, then input
rows or a generated row, then padding), which its GDN layers run per sequence (`batched_gdn.PackedGDNState.step`).
A sequence's cache gets its states and boundary record when it leaves.

Decode steps (every row's ``[chunk?, token]``) run as captured CUDA graphs per (batch bucket, width, span bucket)
(`fast.batched_graphs`) where the engine's ``graphs`` setting resolves on: ``fast_path=None`` on CUDA for every
family with a fast path (the MoE ones with ``grouped_mm`` experts in bfloat16; the Gated DeltaNet families with
their per-slot states read and written in the graph), ``fast_path=True`` on any device (on a CPU the same
static-buffer step runs eagerly). Prompt pieces do too: on the attention families a short prompt rides in the
decode step; other pieces (on the Gated DeltaNet families every piece) replay a prefill step of their own;
``fast_path=False`` runs on the eager `batch_engine.ForwardRunner`.

Not here (refused before any compute by `validate_batch`): ``fast_path=True`` for a model without captured
batched steps (an accelerate-split model), continuing a cache in a batched call (a held
conversation joins a `BatchEngine` with ``add(..., cache=)``), and a keep-mask tensor as selector.
VisionZip (which reads the vision tower's last block) gets each row's cut of the batch's one tower call
(`_row_capture`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .batched_gdn import PackedRowLayout
from .cache_utils import (DEFERRED, GENERATED, INPUT, DeferredDynamicCache, PendingRows, hold_rows, order_key_int,
                          to_device)
from .configuration import RaincheckConfig
from .models import get_adapter
from .models.base import RowBatch


# ---- checks (before any compute) ------------------------------------------------------------------

def left_padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> list[int]:
    """Per row, how many leading positions are padding; a ValueError for any other padding layout."""
    batch, length = input_ids.shape
    if attention_mask is None:
        return [0] * batch
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"generate(raincheck=...) got an attention_mask of shape {tuple(attention_mask.shape)} for "
                         f"input_ids of shape {(batch, length)}.")
    mask = attention_mask.cpu().long()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("generate(raincheck=...) takes an attention_mask of 0 / 1 entries only.")
    pads = []
    for i in range(batch):
        pad = int((mask[i] == 0).sum())
        if pad >= length or not bool((mask[i, pad:] == 1).all()):
            raise ValueError(
                f"generate(raincheck=...) with batch size {batch}: row {i} of attention_mask is not left padding "
                f"({'no token' if pad >= length else 'a 0 after a 1'}); pad the prompts on the left "
                "(processor.tokenizer.padding_side = 'left', or processor(..., padding_side='left')), each row "
                "with at least one token."
            )
        pads.append(pad)
    return pads


def validate_batch(model, config: RaincheckConfig, input_ids: torch.Tensor, kwargs: dict) -> None:
    """What `integration.validate_request` checks beyond the batch-1 checks when ``input_ids`` has B > 1 rows."""
    adapter = get_adapter(model)
    batch = input_ids.shape[0]
    if config.fast_path is True:
        from .fast.batched_graphs import batched_graph_blocker, resolve_graphs

        blocker = batched_graph_blocker(adapter)
        if blocker is not None:
            raise ValueError(
                f"RaincheckConfig.fast_path=True with batch size {batch}: {blocker}. Use fast_path=None (auto) or "
                "fast_path=False for batches on this model, or call generate per prompt."
            )
        resolve_graphs(adapter, config, None)  # a ValueError where the captured steps cannot run on this model
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and (isinstance(cache, DeferredDynamicCache) or cache.get_seq_length() > 0):
        raise ValueError(
            f"generate(raincheck=...) with batch size {batch} starts new conversations only; got a "
            f"{type(cache).__name__} to continue. Continue each row with its own cache from the batched call's "
            "`cache` list (out.cache[i]) at batch size 1."
        )
    if isinstance(config.selector, torch.Tensor):
        raise ValueError(
            f"RaincheckConfig.selector is a keep-mask tensor, which pins the selection of one prompt; with batch size "
            f"{batch} use a selector (a name or a Selector instance), or call generate per prompt."
        )
    pads = left_padding(kwargs.get("attention_mask"), input_ids)
    media_of_rows(adapter, [input_ids[i, p:] for i, p in enumerate(pads)],
                  {k: kwargs.get(k) for k in ("image_grid_thw", "video_grid_thw")})


def media_of_rows(adapter, rows: list[torch.Tensor], grids: dict) -> list[dict]:
    """Which images and videos (indices into the call's ``image_grid_thw`` / ``video_grid_thw``, in order) each
    row's placeholders hold: per row ``{"image": [...], "video": [...]}``. A ValueError where the grids do not
    split over the rows' placeholders."""
    merge = int(adapter.config.vision_config.spatial_merge_size) ** 2
    owned = [{"image": [], "video": []} for _ in rows]
    for modality, token_id in (("image", adapter.image_token_id), ("video", adapter.video_token_id)):
        grid = grids.get(f"{modality}_grid_thw")
        sizes = [] if grid is None else (grid.cpu().prod(-1) // merge).tolist()
        k = 0
        for i, ids in enumerate(rows):
            need = int((ids == token_id).sum())
            got = 0
            while got < need and k < len(sizes):
                got += sizes[k]
                owned[i][modality].append(k)
                k += 1
            if got != need:
                raise ValueError(
                    f"generate(raincheck=...) with batch size {len(rows)}: row {i} of input_ids holds {need} "
                    f"<|{modality}_pad|> placeholders, which the {modality}s of {modality}_grid_thw ({len(sizes)} "
                    "given) do not cover in order; pass the processor's outputs for the whole batch."
                )
        if k != len(sizes):
            raise ValueError(f"generate(raincheck=...) with batch size {len(rows)}: {modality}_grid_thw has "
                             f"{len(sizes)} {modality}s but the rows' placeholders hold only {k} of them.")
    return owned


_MEDIA = {"image": "pixel_values", "video": "pixel_values_videos"}


def expand_return_sequences(model, input_ids: torch.Tensor, kwargs: dict, n: int) -> tuple[torch.Tensor, dict]:
    """``num_return_sequences=n`` as stock `generate` lays it out: each prompt row ``n`` times, one copy after the
    other (row ``i``'s copies are rows ``i * n ... i * n + n - 1``), every copy with its own row's images and videos
    (their ``pixel_values`` / ``pixel_values_videos`` patches, ``*_grid_thw`` and ``second_per_grid_ts`` entries, in
    the order the copies' placeholders hold them). Returns ``(input_ids, kwargs)`` for a call of ``B * n`` prompts
    and ``num_return_sequences=1``: the batched engine then runs every copy as its own sequence (each with its own
    selection, plan and trace, sampling its own tokens), as stock `generate` runs the copies as rows of its batch.
    Row-shaped inputs (``attention_mask``, ``mm_token_type_ids``) are repeated alike. Stock `generate` encodes each
    picture once and copies its features; here every copy's pictures go through the vision tower, ``n`` times in
    one call."""
    adapter = get_adapter(model)
    batch = input_ids.shape[0]
    pads = left_padding(kwargs.get("attention_mask"), input_ids)
    owned = media_of_rows(adapter, [input_ids[i, p:] for i, p in enumerate(pads)],
                          {k: kwargs.get(k) for k in ("image_grid_thw", "video_grid_thw")})
    out = dict(kwargs, num_return_sequences=1)
    for name in ("attention_mask", "mm_token_type_ids"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[:1] == (batch,):
            out[name] = value.repeat_interleave(n, dim=0)
    for modality, pixels_name in _MEDIA.items():
        grid = kwargs.get(f"{modality}_grid_thw")
        if grid is None or not len(grid):
            continue
        order = [k for i in range(batch) for _ in range(n) for k in owned[i][modality]]
        index = torch.tensor(order, dtype=torch.long)
        out[f"{modality}_grid_thw"] = grid[to_device(index, grid.device)]
        pixels = kwargs.get(pixels_name)
        if pixels is not None:
            ends = grid.cpu().prod(-1).cumsum(0).tolist()  # each picture's patches, one after the other
            starts = [0] + ends[:-1]
            out[pixels_name] = torch.cat([pixels[starts[k]:ends[k]] for k in order])
        seconds = kwargs.get("second_per_grid_ts") if modality == "video" else None
        if seconds is not None:
            out["second_per_grid_ts"] = (seconds[to_device(index, seconds.device)] if isinstance(seconds, torch.Tensor)
                                         else [seconds[k] for k in order])
    return input_ids.repeat_interleave(n, dim=0), out


# ---- one sequence ---------------------------------------------------------------------------------

@dataclass
class RowGroup:
    """One sequence's rows in one packed forward (storage order): ``batch`` (its `RowBatch`), ``keys [n]``,
    ``sources [n]``, ``kinds [n]``; ``want_logits``: the logits of its last row are wanted; ``visual``: the rows'
    visual flags on the host (``[n]`` bool) where known, so that `split` cuts a prompt's DeepStack rows without
    reading ``batch.visual`` back from the device (a read there waits for every step queued before it)."""

    batch: RowBatch
    keys: torch.Tensor
    sources: torch.Tensor
    kinds: torch.Tensor
    want_logits: bool = True
    visual: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @staticmethod
    def concat(groups: list["RowGroup"]) -> "RowGroup":
        """The groups' rows one after the other (logits wanted as the last group says)."""
        if len(groups) == 1:
            return groups[0]
        device = groups[-1].keys.device
        known = all(g.visual is not None for g in groups)
        return RowGroup(RowBatch.concat([g.batch for g in groups]),
                        torch.cat([to_device(g.keys, device) for g in groups]),
                        torch.cat([g.sources.to("cpu", torch.long) for g in groups]),
                        torch.cat([torch.as_tensor(g.kinds, dtype=torch.int8).cpu() for g in groups]),
                        groups[-1].want_logits, torch.cat([g.visual for g in groups]) if known else None)

    @staticmethod
    def of(rows) -> "RowGroup":
        """One forward's rows as the scheduler decided them (`runner.ForwardRows`), as a group of one sequence."""
        n = int(rows.keys.shape[0])
        kinds = torch.as_tensor(rows.kinds, dtype=torch.int8)
        if kinds.shape != (n,) or kinds.stride() != (1,):  # one kind for every row (an expanded view): its own copy
            kinds = kinds.expand(n).clone()
        return RowGroup(rows.batch, rows.keys, rows.sources.to("cpu", torch.long), kinds, rows.want_logits)

    def split(self, n: int) -> tuple["RowGroup", "RowGroup | None"]:
        """``(first n rows, the rest or None)``; the first wants no logits unless it is all of them (a chunked
        prefill's pieces: only the last piece's last row gives the sequence's next-token logits)."""
        if n >= len(self):
            return self, None
        b = self.batch
        deepstack = None
        rest_ds = None
        if b.deepstack is not None:
            v = int((b.visual if self.visual is None else self.visual)[:n].sum())
            deepstack, rest_ds = [d[:v] for d in b.deepstack], [d[v:] for d in b.deepstack]
        flags = (None, None) if self.visual is None else (self.visual[:n], self.visual[n:])
        head = RowGroup(RowBatch(b.embeds[:n], b.positions[:, :n], b.visual[:n], deepstack), self.keys[:n],
                        self.sources[:n], self.kinds[:n], want_logits=False, visual=flags[0])
        tail = RowGroup(RowBatch(b.embeds[n:], b.positions[:, n:], b.visual[n:], rest_ds), self.keys[n:],
                        self.sources[n:], self.kinds[n:], want_logits=self.want_logits, visual=flags[1])
        return head, tail


class _Joined:
    """A host tensor kept as the pieces `SequenceState.stored` appends to the list attribute ``parts`` (a cat per
    step would copy every stored row's record again, each step), joined once when read; setting it replaces the
    pieces."""

    def __init__(self, parts: str, dtype):
        self.parts, self.dtype = parts, dtype

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        parts = getattr(obj, self.parts)
        if not parts:
            return torch.empty(0, dtype=self.dtype)
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]
        return parts[0]

    def __set__(self, obj, value: torch.Tensor) -> None:
        setattr(obj, self.parts, [value])


@dataclass(eq=False)  # identity: the engine maps sequences to their logits
class SequenceState:
    """Everything of one sequence in a batched engine: what the batch-1 loop keeps in its locals and cache.

    Attributes:
        index: its row in the call's ``input_ids`` (`batch_engine.batched_sample`), or its arrival number
            (`BatchEngine.add`).
        pad: the row's left padding (its source positions count from the first real token).
        ids: ``[L_i]`` the conversation's source tokens before its answer (for a continued conversation: the held
            cache's source ids, then the new turn's).
        plan: its `DeferredPlan`; ``turn`` its `TurnInputs`; ``scheduler`` its `ChunkScheduler`.
        trace: its `RaincheckTrace`.
        first_generated_position: M-RoPE position of its first generated token.
        pending: its deferred rows not yet prefilled (`PendingRows`), or None.
        prefill: the rows of its first forward not yet run (`RowGroup`: leftover deferred rows of a continued
            conversation, then the turn's T ∪ S), None once they all ran; ``prefill_restored``: the sources of
            those leftover rows (its trace's forward 0).
        slot: its slot of the engine's `kv_pool.SlotKVPool` (and row of its recurrent states), None outside one.
        row_sources / row_kinds: per stored row of its slot (host).
        generated: tokens generated so far; ``fed``: generated tokens whose forward ran (its source ids);
        ``token``: the generated token id its next forward consumes (`BatchEngine.feed`: a host int;
            `BatchEngine.feed_all`: a `DeviceToken`), or None.
    """

    index: int
    pad: int
    ids: torch.Tensor
    turn: object
    plan: object
    scheduler: object
    trace: object
    first_generated_position: int
    pending: PendingRows | None = None
    prefill: RowGroup | None = None
    prefill_restored: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    slot: int | None = None
    _sources_parts: list = field(default_factory=list, repr=False)  # `row_sources`, in pieces (`stored`)
    _kinds_parts: list = field(default_factory=list, repr=False)  # `row_kinds`, in pieces
    dropped: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    generated: int = 0
    fed: list = field(default_factory=list)
    token: "int | DeviceToken | None" = None
    # `peek_pending`'s split of ``pending``: ``(pending, n, head, tail)``, which `take_pending` takes while ``pending``
    # is the same object (a decode step peeks at its chunk, then takes it: one split instead of two)
    _split: tuple | None = field(default=None, repr=False)
    restores_only = False  # (a class attribute, not a field) `RestoringState`: it generates nothing

    # ---- pending rows (the `DeferredDynamicCache` calls `ChunkScheduler` makes) ----
    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else len(self.pending)

    def take_pending(self, n: int | None = None) -> PendingRows | None:
        if self.num_pending == 0:
            return None
        if n is None or n >= len(self.pending):
            rows, self.pending = self.pending, None
            return rows
        last, self._split = self._split, None  # (no reference to rows that left kept)
        if last is not None and last[0] is self.pending and last[1] == n:
            rows, self.pending = last[2], last[3]
        else:
            rows, self.pending = self.pending.split(n)
        return rows

    @property
    def prefilled(self) -> bool:
        return self.prefill is None

    # ---- the rows of its forwards ----
    def prefill_group(self, adapter, earlier: PendingRows | None = None) -> RowGroup:
        """Its first forward's rows: ``earlier`` (leftover deferred rows of a continued conversation), then T ∪ S."""
        plan = self.plan
        n = plan.input_rows.numel()
        batch = adapter.rows(self.turn, plan.input_rows)
        # (its visual flags on the host once here, where the sequence is made, not in the steps that cut its pieces)
        group = RowGroup(batch, plan.input_keys, plan.sources(plan.input_rows),
                         torch.full((n,), INPUT, dtype=torch.int8), visual=self.turn.visual_flags_on_host(plan.input_rows))
        if earlier is None:
            return group
        return RowGroup.concat([RowGroup(adapter.pending_batch(earlier), earlier.keys, earlier.sources.cpu(),
                                         torch.full((len(earlier),), DEFERRED, dtype=torch.int8),
                                         visual=torch.ones(len(earlier), dtype=torch.bool)), group])

    def take_prefill(self, n: int | None) -> RowGroup:
        """The next ``n`` rows of its prefill (all when None) for this step's forward."""
        piece, self.prefill = self.prefill.split(len(self.prefill) if n is None else n)
        return piece

    def peek_pending(self, n: int | None = None) -> PendingRows | None:
        """The rows `take_pending` would return, left pending (what `ChunkScheduler.decode_step` reads)."""
        if self.num_pending == 0:
            return None
        if n is None or n >= len(self.pending):
            return self.pending
        head, tail = self.pending.split(n)
        self._split = (self.pending, n, head, tail)
        return head

    def may_carry_chunk(self) -> bool:
        """Whether its next decode forward (``self.generated``) may carry a chunk (`ChunkScheduler.may_carry_chunk`):
        what `batch_engine.RowScheduler` counts to share a step's chunk budget."""
        return self.scheduler.may_carry_chunk(self, self.generated)

    def decode_groups(self, adapter, config: RaincheckConfig, token: int,
                      cap: int | None = None, row=None) -> list[RowGroup]:
        """Decode forward ``self.generated`` (it consumes ``token``, generated token i), as its scheduler decides it
        for the batch-1 loop (`ChunkScheduler.decode_step`): ``[chunk?, token]`` as one group (fused), or
        ``[chunk, token]`` as two groups (``serial``); the chunk leaves the pending rows and goes to the trace.
        ``cap``: at most this many chunk rows (the step's share of `RaincheckConfig.batch_chunk_rows`). ``row``: the
        token's row made ahead for the step's sequences together (`token_rows`), None: made here."""
        i = self.generated
        ids = None
        if row is None:
            ids = torch.full((1,), token, dtype=torch.long, device=adapter.device)  # a fill on the device: no copy
        step = self.scheduler.decode_step(adapter, self, self.plan, ids, i, self.first_generated_position,
                                          self.ids.shape[0] + i, cap, token=row)
        if step.n_chunk:
            self.take_pending(step.n_chunk)
        self.trace.restored_per_forward.append(step.restored)
        self.trace.chunk_size_per_forward.append(step.chunk_size)
        self.fed.append(token)
        return [RowGroup.of(rows) for rows in step.forwards]

    # ---- storage bookkeeping ----
    row_sources = _Joined("_sources_parts", torch.long)  # ``[n]`` each stored row's source (host), storage order
    row_kinds = _Joined("_kinds_parts", torch.int8)  # ``[n]`` int8 each stored row's kind (host), storage order

    def stored(self, group: RowGroup) -> None:
        """Account for ``group``'s rows, which a forward just wrote to its slot."""
        self._sources_parts.append(group.sources.to("cpu", torch.long))
        self._kinds_parts.append(torch.as_tensor(group.kinds, dtype=torch.int8).cpu())

    def layout(self, group: RowGroup | None) -> PackedRowLayout:
        """How ``group``'s rows split for layers with per-sequence recurrent state: deferred rows first, then input
        rows or one generated row (recorded while deferred rows are still pending after it)."""
        if group is None or not len(group):
            return PackedRowLayout(0, 0, None)
        kinds = torch.as_tensor(group.kinds, dtype=torch.int8).cpu()
        n_deferred = int((kinds == DEFERRED).sum())
        rest = kinds[n_deferred:]
        if n_deferred and not bool((kinds[:n_deferred] == DEFERRED).all()) or len(set(rest.tolist())) > 1:
            raise ValueError(f"a packed forward's rows of one sequence are [deferred, input or generated], got "
                             f"kinds {kinds.tolist()}.")
        kind = int(rest[0]) if rest.numel() else None
        return PackedRowLayout(n_deferred, int(rest.numel()), kind, kind == GENERATED and self.num_pending > 0)

    def to_cache(self, pool, text_config, device) -> DeferredDynamicCache:
        """This sequence's slot of ``pool`` (a `kv_pool.SlotKVPool`) as the `DeferredDynamicCache` its own batch-1 call
        would have returned: its rows in storage order, with their order keys, the pending rows, the source ids fed and
        the next position. Its recurrent layers' states (a Gated DeltaNet family's) are the engine's to write, for
        every leaving sequence at once (`BatchEngine.remove_many`, `ModelAdapter.export_packed_states`)."""
        cache = DeferredDynamicCache(config=text_config, device=device)
        n = pool.lengths[self.slot]
        cache.register_rows(pool.slot_keys[self.slot, :n], self.row_sources, self.row_kinds)
        kv = {layer_idx: pool.rows_of(self.slot, layer_idx) for layer_idx, layer in enumerate(cache.layers)
              if not isinstance(layer, LinearAttentionCacheLayerMixin)}  # (those states live in ``recurrent``: below)
        hold_rows(cache, {layer_idx: rows for layer_idx, rows in kv.items() if rows is not None})
        if self.pending is not None:
            cache.add_pending(self.pending)
        cache.drop(self.dropped)
        # the tokens whose forward ran (the last generated token is fed by the next turn, as at batch 1)
        fed = torch.tensor([int(t) for t in self.fed], dtype=torch.long)  # (a `DeviceToken` as its value)
        cache.extend_source(torch.cat([self.ids.cpu(), fed]), self.first_generated_position + len(self.fed))
        cache.turn = self.turns_started
        return cache

    @property
    def turns_started(self) -> int:
        """Turns started on its conversation (its cache's ``turn``): this one included."""
        return self.plan.turn + 1


@dataclass(eq=False)
class RestoringState(SequenceState):
    """A held conversation in a batched engine only to restore its pending deferred rows (`BatchEngine.restore`):
    it generates nothing (never fed a token) and has no turn of its own; each step it may run a piece of its pending
    rows, in the step's spare budget (`batch_engine.RowScheduler`), taken as idle-time restoration takes them
    (`generation.idle_rows`: the head of the pending rows, at most ``max_rows``, its config's idle chunk).
    ``held_turns``: the held cache's ``turn``; ``restored``: the sources of each piece it ran."""

    max_rows: int = 1
    held_turns: int = 0
    restored: list = field(default_factory=list)
    restores_only = True  # (what `fast.batched_graphs.decode_only` reads: its pieces ride in captured steps)

    @property
    def turns_started(self) -> int:
        return self.held_turns

    def take_piece(self, adapter, budget: int | None) -> RowGroup:
        """Its next piece (``min(max_rows, budget)`` rows, ``budget`` None: ``max_rows``), taken from its pending
        rows (at least one must be pending)."""
        from .generation import idle_rows

        n = self.max_rows if budget is None else min(self.max_rows, budget)
        group = RowGroup.of(idle_rows(adapter, self, n))
        self.restored.append(group.sources)
        return group


class DeviceToken:
    """A token fed while still on the device (`batch_engine.BatchEngine.feed_all`): ``values[at]`` of a tensor the
    caller chose it into. Its decode row is made from the device tensor (no read); its host value is read only if
    nobody set ``value`` (the driver does once it has read the step's tokens) by the time it is needed (`int`)."""

    __slots__ = ("values", "at", "value")

    def __init__(self, values: torch.Tensor, at: int):
        self.values, self.at, self.value = values, at, None

    def __int__(self) -> int:
        if self.value is None:
            self.value = int(self.values[self.at])  # (a read of the device: only where no driver set it)
        return self.value

    __index__ = __int__


def _token_ids(tokens: list, device):
    """The fed tokens as ``text_rows`` takes them: host ints as a list, else one device tensor ``[n]`` (fed from
    the device: gathered there, nothing read back)."""
    if not any(isinstance(t, DeviceToken) and t.value is None for t in tokens):
        return [int(t) for t in tokens]
    values = tokens[0].values if isinstance(tokens[0], DeviceToken) else None
    if values is not None and all(isinstance(t, DeviceToken) and t.values is values for t in tokens):
        at = [t.at for t in tokens]
        if at == list(range(values.shape[0])):
            return values.reshape(-1)
        return values.reshape(-1).index_select(0, to_device(torch.tensor(at, dtype=torch.long), values.device))
    return torch.cat([t.values.reshape(-1)[t.at:t.at + 1] if isinstance(t, DeviceToken) and t.value is None
                      else torch.full((1,), int(t), dtype=torch.long, device=device) for t in tokens])


def token_rows(adapter, sequences: list[SequenceState]) -> list[tuple]:
    """Each fed sequence's decode row for its next forward, made for all of them at once: ``(RowBatch, key [1],
    source [1], kind [1])`` per sequence, the values `ChunkScheduler.decode_step` makes for one (the token's row,
    `ModelAdapter.text_rows`; its order key, source and kind ``GENERATED``), as views of one tensor each, instead of
    a few operations per sequence."""
    if not sequences:
        return []
    index = [s.generated - 1 for s in sequences]  # the token is generated token i - 1 of its turn
    rows = adapter.text_rows(_token_ids([s.token for s in sequences], adapter.device),
                             [s.first_generated_position + i for s, i in zip(sequences, index)])
    host = torch.tensor([[order_key_int(s.plan.turn, GENERATED, i) for s, i in zip(sequences, index)],
                         [s.ids.shape[0] + s.generated - 1 for s in sequences]], dtype=torch.long)  # keys, sources
    kinds = torch.full((len(sequences), 1), GENERATED, dtype=torch.int8)
    return list(zip(rows, host[0].unsqueeze(1).unbind(0), host[1].unsqueeze(1).unbind(0), kinds.unbind(0)))


def restoring_sequence(cache: DeferredDynamicCache, index: int, max_rows: int) -> RestoringState:
    """A `RestoringState` for the held ``cache`` (left unchanged): its pending rows (shared, never written), its
    stored rows' accounting and its source accounting; `BatchEngine.join` copies its KV rows and states in."""
    state = RestoringState(index, 0, cache.source_ids.clone(), None, None, None, None, cache.next_position,
                           max_rows=max_rows, held_turns=cache.turn)
    state.pending = cache.peek_pending()
    state.dropped = cache.dropped.clone()
    state.row_sources, state.row_kinds = cache.row_sources.clone(), cache.row_kinds.clone()
    return state


# ---- the call ------------------------------------------------------------------------------------

def _row_capture(record: dict, grid: torch.Tensor, indices: list[int]) -> dict:
    """A `integration.VisionAttentionCapture` record of one tower call over several rows' images / videos cut to
    those of one row (``indices``, consecutive, into ``grid``): their patches of the last block's input, its
    window boundaries and rotary embedding, and their part of the merged-token order. Windows never cross an
    image or a video slice, and the tower's window order (Qwen2.5-VL) permutes within each, so the cut record
    is what the row's own tower call would record (to float rounding)."""
    patches = grid.cpu().prod(-1).tolist()
    p0, p1 = sum(patches[:indices[0]]), sum(patches[:indices[-1] + 1])
    bounds = [int(b) for b in record["cu_seqlens"].tolist()]
    if p0 not in bounds or p1 not in bounds:
        raise ValueError(f"the vision tower's last block attends across images ({bounds}); batched generate cannot "
                         "cut its record per row.")
    cut = dict(record)
    cut["grid_thw"] = record["grid_thw"][indices[0]:indices[-1] + 1]
    cut["hidden_states"] = record["hidden_states"][p0:p1]
    cut["cu_seqlens"] = torch.tensor([b - p0 for b in bounds if p0 <= b <= p1], dtype=torch.int32)
    cut["position_embeddings"] = tuple(e[p0:p1] for e in record["position_embeddings"])
    order = record.get("merged_order")
    if order is not None:
        unit = int(record["merge_unit"])
        m0, m1 = p0 // unit, p1 // unit
        part = order.cpu()[m0:m1] - m0
        if bool((part < 0).any() | (part >= m1 - m0).any()):
            raise ValueError("the vision tower's merged-token order mixes images; batched generate cannot cut it per "
                             "row.")
        cut["merged_order"] = part
    return cut


def _row_media(outputs, indices: list[int]):
    """The encoder output of the given images / videos (per-item tuples, as `get_image_features` splits them)."""
    if outputs is None or not indices:
        return None
    deepstack = getattr(outputs, "deepstack_features", None)
    return SimpleNamespace(
        pooler_output=tuple(outputs.pooler_output[j] for j in indices),
        deepstack_features=None if deepstack is None else [tuple(f[j] for j in indices) for f in deepstack],
    )


def new_sequence(model, adapter, config: RaincheckConfig, index: int, ids: torch.Tensor, *, pad: int = 0,
                 cache: DeferredDynamicCache | None = None, captures=None, **encode) -> SequenceState:
    """Encode, select and plan one sequence's turn exactly as its own batch-1 call does.

    ``ids [L]``: a fresh prompt (``cache`` None), or, with ``cache`` (a held batch-1 `DeferredDynamicCache`, left
    unchanged), the whole conversation as a batch-1 follow-up takes it: the cache's source ids, then the new
    turn's. ``encode``: `ModelAdapter.encode_turn`'s media arguments for this turn (``mm_encoder_outputs`` or
    ``pixel_values`` / ``pixel_values_videos``, the grids). ``captures``: the turn's VisionZip record.
    The sequence's prefill (leftover deferred rows of the cache, then T ∪ S) is ready in ``state.prefill``."""
    from .generation import ChunkScheduler, RaincheckTrace, _pending_rows
    from .plan import build_plan, restoration_order, select_visual_rows

    ids = ids.reshape(-1)
    start = 0 if cache is None else cache.source_length
    if cache is not None and (ids.shape[0] <= start or not torch.equal(ids[:start].cpu(), cache.source_ids)):
        what = "" if ids.shape[0] <= start else " that do not start with the cache's source ids"
        raise ValueError(
            f"a continued conversation takes the whole conversation's ids (the held cache's {start} source ids, "
            f"then the new turn's); got {ids.shape[0]} ids{what}."
        )
    new_ids = ids[start:]
    turn = adapter.encode_turn(new_ids, 0 if cache is None else cache.next_position,
                               text_prefix=1 if start > 0 else 0,  # the previous answer's last token, not yet fed
                               **encode)
    selector = config.build_selector()
    keep = select_visual_rows(turn, config, selector, model=model, captures=captures)
    plan = build_plan(turn, keep, 0 if cache is None else cache.turn, start)
    if config.defers:  # the order its deferred rows are restored in, as its own call orders them
        plan.restore_order = restoration_order(turn, plan, config.restore_order, model=model, selector=selector)
    trace = RaincheckTrace(mode=config.mode, selected=plan.sources(plan.selected_rows),
                           deferred=plan.sources(plan.deferred_rows),
                           segments=[(s.modality, s.grid, s.source_positions + start) for s in turn.segments])
    source_ids = turn.ids_on_host() if cache is None else torch.cat([cache.source_ids, turn.ids_on_host()])
    state = SequenceState(index, pad, source_ids, turn, plan, ChunkScheduler(config), trace, turn.next_position)
    earlier = None
    if cache is not None:
        earlier = cache.peek_pending()
        state.dropped = cache.dropped.clone()
        state.row_sources, state.row_kinds = cache.row_sources.clone(), cache.row_kinds.clone()
    if plan.deferred_rows.numel():
        if config.defers:
            state.pending = _pending_rows(adapter, turn, plan)
        else:  # hard: gone for good
            trace.dropped = plan.sources(plan.deferred_rows)
            state.dropped = torch.cat([state.dropped, trace.dropped])
    state.prefill = state.prefill_group(adapter, earlier)
    if earlier is not None:
        state.prefill_restored = earlier.sources.cpu()
    return state


def start_sequences(model, adapter, config: RaincheckConfig, input_ids, attention_mask, grids: dict,
                    mm_encoder_outputs: dict | None, captures=None) -> list[SequenceState]:
    """Encode, select and plan every row of a left-padded batch as its own call would (turn 0, no cache).
    ``captures``: the whole call's `integration.VisionAttentionCapture` (VisionZip), cut per row."""
    pads = left_padding(attention_mask, input_ids)
    rows = [input_ids[i, p:] for i, p in enumerate(pads)]
    media = media_of_rows(adapter, rows, grids)
    mm_encoder_outputs = mm_encoder_outputs or {}
    states = []
    for i, (ids, pad) in enumerate(zip(rows, pads)):
        owned = media[i]
        row_outputs = {m: _row_media(mm_encoder_outputs.get(m), owned[m]) for m in ("image", "video")}
        for m in ("image", "video"):
            if owned[m] and row_outputs[m] is None:
                raise ValueError(f"row {i} holds {m}s but no {m} features reached the loop (pass pixel_values"
                                 f"{'' if m == 'image' else '_videos'} with the batch).")
        image_grid = grids.get("image_grid_thw")
        video_grid = grids.get("video_grid_thw")
        seconds = grids.get("second_per_grid_ts")
        row_captures = None
        if captures is not None:
            row_captures = {m: _row_capture(captures[m], grids[f"{m}_grid_thw"], owned[m])
                            for m in ("image", "video") if owned[m] and m in captures}
        states.append(new_sequence(
            model, adapter, config, i, ids, pad=pad, captures=row_captures,
            mm_encoder_outputs={m: o for m, o in row_outputs.items() if o is not None},
            image_grid_thw=image_grid[owned["image"]] if owned["image"] else None,
            video_grid_thw=video_grid[owned["video"]] if owned["video"] else None,
            second_per_grid_ts=(torch.as_tensor(seconds)[owned["video"]] if seconds is not None and owned["video"]
                                else None),
        ))
    return states
