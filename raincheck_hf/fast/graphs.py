"""Executing forwards on a `StaticDeferredCache`: eager, or replaying a captured CUDA graph.

A forward's inputs live in static buffers of a fixed row count ``L``: embeddings ``[1, L, D]``,
3-D positions ``[3, 1, L]``, query keys ``[L]``, slots ``[L]`` and one DeepStack addend
``[1, L, D]`` per DeepStack layer (zero on rows without features). The step writes the rows' keys
into the slot keys, computes visibility from them, runs the stock text model with that 4-D mask
and the cache, and writes the last row's logits into a buffer.

Rows are laid out ``[deferred rows, padding, the rest]``; padding rows write to scratch slots with
the maximum key, so no real query sees them, and they see every real row (so they never attend to
nothing). A prefill without deferred rows is thus ``[padding, input rows]``. Shapes captured on CUDA: ``L = 1`` (decode), ``L = c + 1`` (a chunk of ``c`` padded
rows fused with the decode token), ``L = c`` (an idle-time chunk) and prefills padded up to a
multiple of `PREFILL_BUCKET`, each per *slot bucket*: a step attends over the first ``B`` slots
only, ``B`` = the used slots (this step's rows included) rounded up on a geometric ladder
(`static_cache.slot_bucket`), so its attention and mask grow with the conversation, not with the
storage's capacity. The scratch slots lie beyond every bucket: padding rows write
there, nobody reads them. Graphs belong to the cache's `SlotStorage`, which later conversations
of the same size reuse, so each (shape, bucket) is captured once per storage.

A family whose text layers do more than attention (Qwen3.5's Gated DeltaNet) says per forward what its
step runs beyond the shape (`ModelAdapter.static_step_variant`: e.g. whether a generated row is recorded
in the suffix map), which is part of a graph's key, and gets the step's device scalars ``step_info``
(real deferred rows among the padded ones, the suffix length, a prefill's leading padding) to mask with; the adapter's
`ModelAdapter.static_step` scope routes its layers to their static-buffer forwards inside the step. A
family may also refuse to pad and capture prefills (``ModelAdapter.bucketed_prefill``): those then run
eagerly, unpadded, on the same static cache.

Nothing here reads device memory back to the host on the decode path: keys built on the host go
to the device through pinned memory without waiting, slots are written by ``arange`` on the
device, and row counts come from host-side shapes.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..cache_utils import DEFERRED, GENERATED, to_device
from ..masking import visibility_to_attention_mask
from .scoping import CAPTURE_LOCK, graph_capture, step_scope
from .static_cache import MAX_KEY, StaticDeferredCache, slot_bucket
from .timing import StepTimings

PREFILL_BUCKET = 64  # CUDA prefills are padded to a multiple of this, so one captured graph serves a bucket


def scratch_slots(chunk_size: int) -> int:
    """Scratch slots a cache needs: the padding of a chunk step or of a bucketed prefill."""
    return max(int(chunk_size) + 1, PREFILL_BUCKET)


@dataclass
class StepBuffers:
    embeds: torch.Tensor
    positions: torch.Tensor
    query_keys: torch.Tensor
    slots: torch.Tensor
    deepstack: list[torch.Tensor]
    step_info: torch.Tensor | None  # [3] long: real deferred rows of the forward, the cache's suffix length before
    # it, the leading padding of a forward without deferred rows (families with state outside the KV slots only,
    # `ModelAdapter.has_linear_attention`; else None)
    logits: torch.Tensor | None = None
    deepstack_rows: int = 0  # the leading rows that may hold DeepStack features (a deferred block written before)
    deepstack_scattered: bool = False  # rows outside the leading deferred block may hold features

    @property
    def rows(self) -> int:
        return int(self.embeds.shape[1])

    @classmethod
    def empty(cls, rows: int, hidden: int, num_deepstack: int, dtype, device, step_info: bool = True):
        return cls(
            torch.zeros(1, rows, hidden, dtype=dtype, device=device),
            torch.zeros(3, 1, rows, dtype=torch.long, device=device),
            torch.full((rows,), MAX_KEY, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            [torch.zeros(1, rows, hidden, dtype=dtype, device=device) for _ in range(num_deepstack)],
            torch.zeros(3, dtype=torch.long, device=device) if step_info else None,
        )


def fill(buffers: StepBuffers, batch, keys: torch.Tensor, start: int, capacity: int, n_deferred: int,
         padding: int, suffix_length: int = 0) -> None:
    """Copy a forward's rows into ``buffers`` as ``[deferred rows, padding, rest]``.

    ``keys`` are on the buffers' device; real rows take slots ``start, start + 1, ...`` in batch order,
    padding rows the scratch slots ``capacity, capacity + 1, ...``. ``step_info`` gets ``n_deferred`` and
    ``suffix_length`` (the cache's, before this forward), and for a forward of several rows without deferred
    ones (a prefill: ``[padding, input rows]``) the padding.
    """
    n = int(batch.embeds.shape[0])
    lo, hi = n_deferred, n_deferred + padding
    rest = n - n_deferred
    if buffers.rows != n + padding:
        raise RuntimeError(f"step buffers hold {buffers.rows} rows, the forward {n} + {padding} padding")
    embeds, positions, query_keys, slots = buffers.embeds[0], buffers.positions[:, 0], buffers.query_keys, buffers.slots
    if lo:
        embeds[:lo].copy_(batch.embeds[:lo])
        positions[:, :lo].copy_(batch.positions[:, :lo])
        query_keys[:lo].copy_(keys[:lo])
        torch.arange(start, start + lo, out=slots[:lo])
    if padding:
        query_keys[lo:hi].fill_(MAX_KEY)
        torch.arange(capacity, capacity + padding, out=slots[lo:hi])
    if rest:
        embeds[hi:].copy_(batch.embeds[lo:])
        positions[:, hi:].copy_(batch.positions[:, lo:])
        query_keys[hi:].copy_(keys[lo:])
        torch.arange(start + lo, start + n, out=slots[hi:])
    _fill_deepstack(buffers, batch, lo, hi)
    if buffers.step_info is not None:
        buffers.step_info[0].fill_(lo)  # a scalar fill: queued, no host wait
        buffers.step_info[1].fill_(int(suffix_length))
        if lo == 0 and n > 1:  # decode steps keep their buffers' 0 (one row is never padded)
            buffers.step_info[2].fill_(padding)


def _fill_deepstack(buffers: StepBuffers, batch, lo: int, hi: int) -> None:
    if not buffers.deepstack:
        return
    features = batch.deepstack
    n_visual = 0 if features is None else int(features[0].shape[0])
    if n_visual == 0 or n_visual == lo:
        # no features, or exactly the leading deferred rows have them (a chunk, or a prefill carrying leftover
        # deferred rows: deferred rows are visual, the rest text): every row after them must be zero but the
        # padding's (nobody sees those), including rows where an earlier forward of this shape wrote a longer
        # leading block
        if buffers.deepstack_scattered:
            for addend in buffers.deepstack:
                addend.zero_()
            buffers.deepstack_scattered, buffers.deepstack_rows = False, 0
        elif buffers.deepstack_rows > lo:
            for addend in buffers.deepstack:
                addend[0, lo:buffers.deepstack_rows].zero_()
            buffers.deepstack_rows = lo
        if n_visual:
            for addend, layer in zip(buffers.deepstack, features):
                addend[0, :lo].copy_(layer)
            buffers.deepstack_rows = lo
        return
    # visual rows among the rest (a prefill): scatter them to their rows, known from the host where the batch's rows
    # were chosen there (`ModelAdapter.rows`), else read from the visual mask (a device read, once per prefill)
    rows = batch.visual_rows if batch.visual_rows is not None else batch.visual.nonzero().flatten()
    dest = torch.where(rows < lo, rows, rows + (hi - lo))
    for addend, layer in zip(buffers.deepstack, features):
        addend.zero_()
        addend[0, dest] = layer.to(addend.dtype)
    buffers.deepstack_scattered = True


class StepKey(NamedTuple):
    """A captured step's key in `StepGraphs._captured` (and in its timings): its shape, then its slot bucket
    (last: `StepTimings.nearest_cost` compares keys but for their last entry)."""

    rows: int  # the step's rows, padding included
    want_logits: bool
    variant: object  # the adapter's `ModelAdapter.static_step_variant` (None: the family has one kind of step)
    bucket: int  # the slots ``[0, bucket)`` the step attends over

    @property
    def shape(self) -> tuple:
        """The key but for its bucket: the same shape at another slot bucket shares it."""
        return self[:3]


@dataclass
class PreparedStep:
    """A captured forward whose buffers are filled, waiting for `StepGraphs.launch`."""

    graph: torch.cuda.CUDAGraph
    key: StepKey  # the graph's key in `StepGraphs._captured` (and in its timings)
    buffers: StepBuffers
    want_logits: bool
    start: int  # the first slot its rows take (the cache's row count when it was prepared)
    keys: torch.Tensor
    sources: torch.Tensor
    kinds: torch.Tensor


def _recurrent_snapshot(cache: StaticDeferredCache) -> list[torch.Tensor]:
    """Copies of the cache's GDN buffers (a capture's warm-up and timed replays run the step for real)."""
    return [t.clone() for state in cache.storage.gdn.values() for t in state.tensors()]


def _recurrent_restore(cache: StaticDeferredCache, saved: list[torch.Tensor]) -> None:
    tensors = [t for state in cache.storage.gdn.values() for t in state.tensors()]
    for t, s in zip(tensors, saved):
        t.copy_(s)


class StepFigures(NamedTuple):
    """A step shape at the slot bucket it would run at now (`StepGraphs.step_figures`)."""

    cost: float | None  # measured device seconds there, else at the nearest bucket measured; None: never measured
    captured: bool  # its graph is captured at that bucket (running it pauses for nothing)
    capture: float | None  # wall seconds its latest capture (at any bucket) took; None: never captured


def graph_pool_bytes(pool) -> int:
    """Bytes of the device memory segments a CUDA-graph memory pool (``graph.pool()``) holds, from the caching
    allocator's snapshot (segments are kept by their pool while it lives, whatever the graphs still use). 0 for
    None."""
    if pool is None:
        return 0
    pool = tuple(pool)
    return sum(int(segment["total_size"]) for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", ())) == pool)


def private_pools_free_bytes(device=None) -> int:
    """Bytes the caching allocator holds free inside private memory pools (CUDA graphs' pools: segments of a pool
    other than the default one) on ``device`` (None: the current one), from its snapshot: reserved and not
    allocated, yet no allocation outside those pools' captures can have them. `torch.cuda.memory_reserved` less
    `torch.cuda.memory_allocated` counts them as unused all the same."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return sum(int(segment["total_size"]) - int(segment["allocated_size"]) for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0) and segment.get("device", index) == index)


def usable_device_memory(device, private_free: int | None = None) -> int:
    """Device bytes an allocation outside the CUDA graphs' pools can have now on a CUDA ``device``: CUDA's free
    memory and what the caching allocator holds unused, less what of that it holds free in the graphs' private
    pools (``private_free``; None: read now, `private_pools_free_bytes`). Counted in, those pools' free blocks
    made a server on an 80 GB GPU think 6.6 GiB free that no answer could use."""
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pools = private_pools_free_bytes(device) if private_free is None else private_free
    return int(free) + max(0, int(unused) - int(pools))


class StepGraphs:
    """Captured steps of one `SlotStorage` (the graphs point at its tensors and at their own buffers).

    Holds no reference to the model (the storage pool is keyed by the text model): the adapter comes
    with every call.
    """

    def __init__(self, adapter, use_graphs: bool):
        self.use_graphs = use_graphs and torch.cuda.is_available() and adapter.device.type == "cuda"
        # bucketed prefill shapes: only worth it when they are captured, and only for families that can
        self.pad_prefill = self.use_graphs and adapter.bucketed_prefill
        self.num_deepstack = adapter.num_deepstack_layers
        self.hidden = adapter.text_model.config.hidden_size
        self.attn_implementation = adapter.attn_implementation  # what the captured graphs run
        self.compiled = False  # the captured graphs run the compiled modules (RaincheckConfig.compile_steps)
        # `StepKey` -> (graph, buffers)
        self._captured: dict[StepKey, tuple] = {}
        # graphs (and their timings) of the other (attention backend, compile_steps) settings this storage ran
        # with: kept, so that alternating settings (a benchmark, two chats) replay instead of capturing again
        self._other_settings: dict[tuple, tuple] = {}
        self._pool = None
        self._pool_bytes = 0  # `pool_bytes` as last read (None: a capture since: read again when asked)
        self.timings = StepTimings(enabled=self.use_graphs)  # device time of the replays (`chunk_size="auto"`)
        # every capture made on this storage, in order: (key, wall seconds); `generate` reads the ones made during
        # its forwards (its trace, and `chunk_size="auto"`'s budget). One entry per graph, so it stays short.
        self.capture_log: list[tuple[tuple, float]] = []

    # the step itself: identical in eager and captured form
    def _step(self, adapter, cache: StaticDeferredCache, buffers: StepBuffers, want_logits: bool,
              bucket: int | None = None, variant=None):
        """``bucket``: the slots ``[0, bucket)`` attended over (every real row of the step lies there;
        None: all slots); ``variant``: the adapter's `ModelAdapter.static_step_variant` of the step."""
        cache.current_slots = buffers.slots
        cache.attention_slots = bucket
        # the rows' own keys first: a row sees itself (padding rows write the maximum key to scratch slots)
        cache.slot_keys.index_copy_(0, buffers.slots, buffers.query_keys)
        visible = cache.slot_keys[None, :bucket] <= buffers.query_keys[:, None]
        mask = visibility_to_attention_mask(visible, adapter.attn_implementation, adapter.dtype)
        text_model = adapter.text_model
        # DeepStack addends and the few-query attention, for this thread's step only (`fast.scoping`), and the
        # family's static-buffer layers (GDN), also for this thread only
        with step_scope(text_model, buffers.deepstack, layers=adapter.deepstack_layers(),
                        compile_targets=adapter.compile_targets() if self.compiled else ()), \
                adapter.static_step(cache, buffers.step_info, variant):
            hidden = text_model(inputs_embeds=buffers.embeds, position_ids=buffers.positions,
                                attention_mask=adapter.text_attention_mask(mask), cache=cache,
                                use_cache=True).last_hidden_state
        if want_logits:
            logits = adapter.lm_head(hidden[:, -1])
            if buffers.logits is None:
                buffers.logits = logits
            else:
                buffers.logits.copy_(logits)
        return buffers.logits

    def _capture(self, adapter, cache: StaticDeferredCache, rows: int, want_logits: bool, start: int,
                 bucket: int | None = None, variant=None, timed: bool = True):
        bucket = cache.capacity if bucket is None else bucket
        key = StepKey(rows, want_logits, variant, bucket)
        # warm-up runs execute: they write the last `rows` slots with the maximum key, which no query sees; those
        # are scratch, free slots and this forward's own slots from `start` on, which its real run then writes
        first = cache.total_slots - rows
        if first < start:
            return None  # not enough room without touching stored rows: this shape runs eagerly this time
        buffers = StepBuffers.empty(rows, self.hidden, self.num_deepstack, adapter.dtype, adapter.device,
                                    step_info=adapter.has_linear_attention)
        torch.arange(first, cache.total_slots, out=buffers.slots)
        # One capture at a time in the process; other threads' own work on the device goes on meanwhile
        # (thread_local: only this thread's unsafe calls would break the capture).
        # a row count already captured at another slot bucket has done its lazy initialisation (library handles,
        # kernel tuning, compiles): one warm-up run then, two for a new one
        warmups = 1 if any(k.shape == key.shape for k in self._captured) else 2
        with CAPTURE_LOCK:
            # the warm-up runs (and the timed replays) change the cache's recurrent (GDN) state too: kept aside
            # before, put back after, also when the capture fails (the step then runs eagerly from the state it
            # should see)
            saved = _recurrent_snapshot(cache)
            try:
                for _ in range(warmups):  # on the caller's stream (`fast.scoping`: what they allocate and keep)
                    self._step(adapter, cache, buffers, want_logits, bucket, variant)
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph, self._pool):
                    self._step(adapter, cache, buffers, want_logits, bucket, variant)
                self._pool = graph.pool()
                torch.cuda.synchronize()
                self._pool_bytes = None
                if timed and rows <= cache.scratch:  # a decode or chunk step (what chunk_size="auto" weighs)
                    # first cost figures, while synchronised anyway (the replays write what the warm-up wrote)
                    self.timings.time_replays(key, graph)
            finally:
                _recurrent_restore(cache, saved)
        self._captured[key] = (graph, buffers)
        return graph, buffers

    def _try_capture(self, adapter, cache: StaticDeferredCache, rows: int, want_logits: bool, start: int,
                     bucket: int | None, variant, prefill: bool = False, timed: bool = True):
        """`_capture`, or None: no room, or a capture that raised (e.g. an op that cannot be captured), which
        warns and runs eagerly from then on: every prefill after a prefill's failure (the steps stay captured),
        everything after a step's. A capture's wall time (the pause it costs whoever waits on the step) goes to
        `capture_log` and `StepTimings.add_capture`."""
        started = self.clock()
        try:
            captured = self._capture(adapter, cache, rows, want_logits, start, bucket, variant, timed)
        except RuntimeError as error:
            what = "prefill" if prefill else "step"
            warnings.warn(f"raincheck fast path: CUDA-graph capture of a {rows}-row {what} failed ({error}); "
                          f"running {'prefills' if prefill else 'it'} eagerly on the static cache instead.",
                          RuntimeWarning, stacklevel=3)
            self.pad_prefill = False  # the forward at hand keeps its (valid) padded shape
            self.use_graphs = self.use_graphs and prefill
            return None
        if captured is not None:
            key = StepKey(rows, want_logits, variant, cache.capacity if bucket is None else bucket)
            seconds = self.clock() - started
            self.timings.add_capture(key, seconds)
            self.capture_log.append((key, seconds))
        return captured

    @staticmethod
    def clock() -> float:
        """Host wall clock of capture times (tests stand in a clock of their own)."""
        return time.perf_counter()

    @property
    def pool_bytes(self) -> int:
        """The device memory the graphs' pool holds (`graph_pool_bytes`), read from the allocator's snapshot when
        first asked after a capture (not at each capture: a warm-up captures a hundred graphs or more)."""
        if self._pool_bytes is None:
            self._pool_bytes = graph_pool_bytes(self._pool)
        return self._pool_bytes

    def nbytes(self) -> int:
        """Device memory the captured steps hold beside the storage's own tensors: their pool's segments
        (``pool_bytes``) and their static buffers (every setting's), each tensor's storage once."""
        storages = {}
        for fields in self.static_tensors():
            for value in fields.values():
                for t in value if isinstance(value, list) else [value]:
                    if isinstance(t, torch.Tensor):
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return self.pool_bytes + sum(storages.values())

    def static_tensors(self) -> list[dict]:
        """The captured steps' static buffers (every setting's), each `StepBuffers` as the dict of its fields."""
        return [vars(buffers) for captured in [self._captured] + [other[0] for other in self._other_settings.values()]
                for _, buffers in captured.values()]

    def step_figures(self, adapter, cache: StaticDeferredCache, rows: int, want_logits: bool,
                     real_rows: int | None = None, pending_after: int = 1) -> "StepFigures | None":
        """What `chunk_size="auto"` weighs about a ``rows``-row step run now (`StepFigures`); captures nothing.
        None when the step cannot run as a captured graph (no graphs, more padding than scratch slots, a shape
        the family does not capture): it would run eagerly, unmeasured.

        The step is a decode token (``rows = 1``), a chunk of ``rows - 1`` deferred rows fused with it, or an
        idle-time chunk of ``rows`` rows (``want_logits`` False); ``real_rows`` of them are real (a short last
        chunk is padded to ``rows``; default all), ``pending_after`` deferred rows stay pending after it (the
        adapter's step variant depends on it). Its slot bucket is the one `run` will use."""
        if not self.use_graphs or rows > cache.scratch:  # a capture's warm-up runs in the scratch slots
            return None
        real_rows = rows if real_rows is None else real_rows
        bucket = slot_bucket(cache.num_rows + real_rows, cache.capacity)
        n_chunk = rows - 1 if want_logits else rows
        kinds = torch.tensor([DEFERRED] * n_chunk + [GENERATED] * (rows - n_chunk), dtype=torch.int8)
        key = StepKey(rows, want_logits, adapter.static_step_variant(kinds, pending_after, cache.suffix_length), bucket)
        if not adapter.capturable(key.variant, rows):
            return None
        # the cost of the step with rows still pending after it (every step but a last chunk): measured most often
        timed = key if pending_after > 0 else key._replace(variant=adapter.static_step_variant(
            kinds, 1, cache.suffix_length))
        cost = self.timings.cost(timed)
        if cost is None:
            cost = self.timings.nearest_cost(timed)
        return StepFigures(cost, key in self._captured, self.timings.capture_cost(key))

    def step_rows(self, n: int, n_deferred: int, pad_to: int | None) -> int:
        """Rows the forward runs with: ``pad_to`` pads the deferred rows to that many (a chunk step's shape);
        on CUDA a prefill is padded to a multiple of `PREFILL_BUCKET`."""
        if pad_to is not None:
            return n + max(pad_to - n_deferred, 0)
        if self.pad_prefill and n > 1:
            return -(-n // PREFILL_BUCKET) * PREFILL_BUCKET
        return n

    def _use_setting(self, adapter, cache: StaticDeferredCache) -> None:
        """Take the graphs of the model's attention backend and the cache's ``compile_steps``."""
        compiled = bool(getattr(cache, "compile_steps", False))
        setting = (adapter.attn_implementation, compiled)
        if setting != (self.attn_implementation, self.compiled):
            # the model was switched to another attention backend, or compile_steps changed: the graphs captured
            # the other way run other kernels; put them aside (one memory pool: replays are sequential) and take
            # this setting's own, if it ran here before
            self._other_settings[(self.attn_implementation, self.compiled)] = (self._captured, self.timings)
            self._captured, self.timings = self._other_settings.pop(
                setting, ({}, StepTimings(enabled=self.use_graphs)))
            self.attn_implementation, self.compiled = setting

    def warm(self, adapter, cache: StaticDeferredCache, key: StepKey, prefill: bool,
             timed: bool = True) -> float | None:
        """Capture the step ``key`` before any forward runs it (`raincheck_hf.warm_up`), on ``cache``'s storage;
        ``prefill``: a padded prefill's shape. Returns the capture's wall seconds, or None: already captured, or
        a shape this storage runs eagerly (no graphs, prefills not captured, not capturable, no room).

        A capture runs on static buffers of its own whatever the forward's rows (`_capture`), so capturing a key
        here is what the first forward of that key would do, minus the pause; ``timed=False`` leaves out the timed
        replays after it (first cost figures for ``chunk_size="auto"``, ~3 steps' device time a capture; without
        them its first figures come from the key's first replays)."""
        self._use_setting(adapter, cache)
        if (not self.use_graphs or key in self._captured or (prefill and not self.pad_prefill)
                or not adapter.capturable(key.variant, key.rows)):
            return None
        made = len(self.capture_log)
        self._try_capture(adapter, cache, key.rows, key.want_logits, cache.num_rows, key.bucket, key.variant,
                          prefill, timed)
        return self.capture_log[made][1] if len(self.capture_log) > made else None

    def _shape(self, adapter, cache: StaticDeferredCache, batch, kinds, want_logits: bool, pad_to: int | None,
               taken: bool):
        """``(n, n_deferred, rows, padding, key)`` of a forward; ``taken``: its deferred rows were already taken
        from the pending ones (`run`), not yet (`prepare`): the adapter's step variant depends on what stays
        pending after it."""
        self._use_setting(adapter, cache)
        n = int(batch.embeds.shape[0])
        n_deferred = int((kinds == DEFERRED).sum())  # kinds live on the host
        pending_after = cache.num_pending - (0 if taken else n_deferred)
        rows = self.step_rows(n, n_deferred, pad_to)
        padding = rows - n
        if padding > cache.scratch:
            raise RuntimeError(f"padding {padding} exceeds the cache's scratch slots {cache.scratch}")
        if want_logits and padding and n == n_deferred:
            raise RuntimeError("a padded forward of deferred rows only has no last real row to take logits from")
        variant = adapter.static_step_variant(kinds, pending_after, cache.suffix_length)
        # the bucket before the rows are registered: the slots in use once they are
        return n, n_deferred, rows, padding, StepKey(rows, want_logits, variant,
                                                     slot_bucket(cache.num_rows + n, cache.capacity))

    def prepare(self, adapter, cache: StaticDeferredCache, batch, keys, sources, kinds, want_logits: bool,
                pad_to: int | None = None) -> PreparedStep | None:
        """Fill the buffers of the forward's captured graph without touching the cache's bookkeeping.

        The decode loop prepares step ``i + 1`` before it waits for step ``i`` (the stopping check), so
        the host work of building a step overlaps the device's; `launch` then registers the rows and
        replays. The fill is queued behind the running replay, which is done reading the buffers by
        then; a step that is not launched (the answer stopped) leaves only its buffers written. None
        when the shape is not captured yet or there is no room (`run` then does it all after the check).
        """
        if not self.use_graphs:
            return None
        # the forward's deferred rows are still pending (`generation._DecodeForward.run` takes them before launching)
        n, n_deferred, rows, padding, key = self._shape(adapter, cache, batch, kinds, want_logits, pad_to,
                                                        taken=False)
        captured = self._captured.get(key)
        start = cache.num_rows
        if captured is None or start + n > cache.capacity:
            return None
        graph, buffers = captured
        keys = to_device(keys, cache.slot_keys.device)
        fill(buffers, batch, keys, start, cache.capacity, n_deferred, padding, cache.suffix_length)
        return PreparedStep(graph, key, buffers, want_logits, start, keys, sources, kinds)

    def _replay(self, cache: StaticDeferredCache, key, graph) -> None:
        # timing events around the replay only for a call that chooses its chunks from them (chunk_size="auto");
        # every captured decode / chunk shape was timed once at capture anyway
        if cache.time_steps:
            self.timings.replay(key, graph)
        else:
            graph.replay()

    def launch(self, cache: StaticDeferredCache, step: PreparedStep):
        """Register a prepared step's rows and replay its graph; logits of its last real row or None."""
        start = cache.assign_slots(step.keys, step.sources, step.kinds)
        if start != step.start:
            raise RuntimeError(f"a step prepared for slot {step.start} was launched at slot {start}: rows were "
                               "added to the cache in between")
        self._replay(cache, step.key, step.graph)
        return step.buffers.logits.clone() if step.want_logits else None

    def _graphed(self, adapter, key: StepKey, n: int, pad_to: int | None) -> bool:
        """Whether a forward of ``n`` real rows and ``key`` runs as a captured graph (captured first if need be).
        A prefill (any unpadded multi-row forward: `step_rows` pads it to a bucket) is captured only when padded."""
        prefill = pad_to is None and n > 1
        return self.use_graphs and (self.pad_prefill or not prefill) and adapter.capturable(key.variant, key.rows)

    def run_ahead(self, adapter, cache: StaticDeferredCache, batch, keys, sources, kinds, want_logits: bool,
                  pad_to: int | None = None):
        """`run` for rows whose sources the host learns only later: ``sources()`` gives them (a turn's first forward,
        its rows chosen on the device from picks not read back yet: `generation.raincheck_sample`).

        Where the step replays a graph already captured, its buffers are filled and the replay launched first, and
        the rows registered after (`StaticDeferredCache.assign_slots`: bookkeeping; the replay writes the rows'
        keys into their slots itself), so the host waits for nothing before the launch. Otherwise (a capture, an
        eager step, no room) ``sources()`` comes first and `run` does it all, as for any forward."""
        n, n_deferred, rows, padding, key = self._shape(adapter, cache, batch, kinds, want_logits, pad_to,
                                                        taken=True)
        captured = self._captured.get(key) if self._graphed(adapter, key, n, pad_to) else None
        start = cache.num_rows
        if captured is None or start + n > cache.capacity:
            return self.run(adapter, cache, batch, keys, sources(), kinds, want_logits, pad_to)
        graph, buffers = captured
        keys = to_device(keys, cache.slot_keys.device)
        fill(buffers, batch, keys, start, cache.capacity, n_deferred, padding, cache.suffix_length)
        self._replay(cache, key, graph)
        logits = buffers.logits.clone() if want_logits else None
        if cache.assign_slots(keys, sources(), kinds) != start:
            raise RuntimeError(f"a forward launched at slot {start} was registered elsewhere: rows were added to the "
                               "cache in between")
        return logits

    def run(self, adapter, cache: StaticDeferredCache, batch, keys, sources, kinds, want_logits: bool,
            pad_to: int | None = None):
        """One forward; logits of its last real row (``[1, V]``) or None."""
        n, n_deferred, rows, padding, key = self._shape(adapter, cache, batch, kinds, want_logits, pad_to,
                                                        taken=True)
        variant, bucket = key.variant, key.bucket
        keys = to_device(keys, cache.slot_keys.device)
        suffix_length = cache.suffix_length  # before this forward's rows count
        start = cache.assign_slots(keys, sources, kinds)
        if self._graphed(adapter, key, n, pad_to):
            captured = self._captured.get(key)
            if captured is None:
                captured = self._try_capture(adapter, cache, rows, want_logits, start, bucket, variant,
                                             prefill=pad_to is None and n > 1)
            if captured is not None:
                graph, buffers = captured
                fill(buffers, batch, keys, start, cache.capacity, n_deferred, padding, suffix_length)
                self._replay(cache, key, graph)
                return buffers.logits.clone() if want_logits else None
        buffers = StepBuffers.empty(rows, self.hidden, self.num_deepstack, adapter.dtype, adapter.device,
                                    step_info=adapter.has_linear_attention)
        fill(buffers, batch, keys, start, cache.capacity, n_deferred, padding, suffix_length)
        logits = self._step(adapter, cache, buffers, want_logits, bucket, variant)
        return logits if want_logits else None
