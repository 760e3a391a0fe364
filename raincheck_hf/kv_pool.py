"""`SlotKVPool`: the KV storage of the batched engine (`batch_engine.BatchEngine`), one slot per sequence.

Storage per attention layer: ``keys / values [S, H, cap, D]`` (``S`` slots of ``cap`` rows each), and per slot
an order-key row ``slot_keys [S, cap]`` (`cache_utils.order_key` of each stored row; ``MAX_KEY`` = empty, never
visible) and a length (host int). A sequence owns one slot and writes its rows at its own offsets ``length,
length + 1, ...``; no row of another sequence, and no padding, accumulates in it. In a packed forward
``[B, W]`` a sequence with ``n < W`` real rows writes its ``W - n`` padding rows after its new length: their
key stays ``MAX_KEY`` (invisible) and its next rows overwrite them.

One forward over the sequences in slots ``slots [B]`` (`begin_step` ... `end_step`):

- `begin_step` writes the real rows' keys into their slots, and returns the visibility ``[B, W, T]`` over the
  first ``T`` rows of the step's slots (``T`` = the longest ``length + W`` of the step, rounded up to
  ``ROW_ROUNDING``, at most ``cap``): a real query sees the rows whose key is not larger than its own
  (docs/method.md §3 per sequence, the batch-1 engine's rule); a padding query sees only itself (a finite
  output, so no NaN reaches a later layer's stored rows);
- each attention layer's `SlotKVLayer.update` scatters the forward's ``[B, H, W, D]`` keys / values to their
  offsets and hands attention ``[B, H, T, D]`` gathered over the step's slots (a copy of the used rows, not a
  view: slots of one step need not be adjacent), or, when the step's slots are ``0 .. B - 1`` in batch order
  (``SlotStep.dense``: the captured decode steps of `fast.batched_graphs`, whose engine keeps its sequences in the
  lowest slots, `move`), a view of them.

A slot that would overflow doubles the capacity of every slot (reallocation; a new capacity's memory is zeros);
a pool without a free slot doubles its slots. `release` resets a slot's keys to ``MAX_KEY`` and its length to 0:
the departed sequence's KV stays in the tensors but is never visible to the next owner (a key ``MAX_KEY`` is
masked for every real query, and a padding query sees only its own row).

Why slots and not paged blocks: on the eager engine a step's attention reads ``[B, H, T, D]`` through SDPA,
which takes one dense tensor per step; a slot is a contiguous row range, so the read is one gather over the
step's slots, where a block table would need a gather of every block of every sequence into the same dense
layout (the paging only pays with an attention kernel that reads blocks in place, which this eager reference
does not have). Slots waste the unused tail of each slot's capacity; blocks waste less. That trade was not
measured here: it is the fast path's decision.

A pool made with ``scratch_slot=True`` (the captured decode steps of `fast.batched_graphs`) holds one more slot
than it hands out, ``scratch``: the padding rows of a batch-size bucket write there (their keys stay ``MAX_KEY``;
nobody reads them). ``version`` counts reallocations: graphs captured on the old tensors are recaptured.

Gated DeltaNet layers keep no KV rows: their layers here stay empty (the family's packed GDN step keeps the
states per slot, `batched_gdn.PackedGDNStates`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache_utils import to_device_all

MAX_KEY = torch.iinfo(torch.long).max  # the key of an empty row: never visible to a real query
ROW_ROUNDING = 16  # a step attends over its longest slot in use rounded up to this
MIN_CAPACITY = 64
DEFAULT_SLOTS = 4  # slots a pool (and a `BatchEngine`) starts with


def attention_kv_shape(text) -> tuple[int, int, int]:
    """``(attention layers, key / value heads, head dim)`` of a text config: what a token's keys and values take in
    every layer that keeps them (Gated DeltaNet layers keep a fixed-size state instead); 0 where a config lacks one."""
    layer_types = getattr(text, "layer_types", None)
    layers = (sum(t == "full_attention" for t in layer_types) if layer_types
              else int(getattr(text, "num_hidden_layers", 0) or 0))
    attention_heads = int(getattr(text, "num_attention_heads", 0) or 0)
    heads = int(getattr(text, "num_key_value_heads", None) or attention_heads)
    head_dim = getattr(text, "head_dim", None) or (int(text.hidden_size) // attention_heads if attention_heads else 0)
    return layers, heads, int(head_dim)


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in the attention layers (an estimate of the cache's growth per
    token: Gated DeltaNet layers keep a fixed-size state instead; the deferred rows' bookkeeping is extra)."""
    layers, heads, head_dim = attention_kv_shape(model.config.get_text_config())
    try:
        element = next(model.parameters()).element_size()
    except StopIteration:
        element = 2
    return 2 * layers * heads * head_dim * element


def _round_up(n: int, step: int) -> int:
    return -(-int(n) // step) * step


class SlotStep:
    """The running forward's placement: ``slots [B]`` (long, host), ``write [B, W]`` (long, host; each row's offset
    in its slot, padding rows after the real ones) and ``span`` (``T``, rows of each slot attention reads)."""

    def __init__(self, slots: torch.Tensor, write: torch.Tensor, span: int, lengths_before: list[int],
                 dense: int | None = None, on: dict | None = None):
        self.slots, self.write, self.span = slots, write, int(span)
        self.lengths_before = lengths_before
        self.dense = dense  # the step's slots are 0 .. dense - 1 in batch order: attention reads a view of them
        self._on: dict = dict(on or {})  # device -> (slots, write) there, those already moved

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, write)`` on ``device`` (copied once per device and step: a model split by accelerate)."""
        got = self._on.get(device)
        if got is None:
            got = self._on[device] = tuple(to_device_all([self.slots, self.write], device))
        return got


class PoolOutOfMemory(torch.OutOfMemoryError):
    """A slot pool's growth that found no device memory (after asking for room where it may: `SlotKVPool.on_short`).
    The pool is as it was before the growth; its ``version`` is bumped where a tensor was replaced
    (`SlotKVPool._resize`)."""


def grow_each(layers, grow, growth, on_short) -> None:
    """``grow(layer)`` for each of ``layers`` in turn (a batched pool's layers, or its Gated DeltaNet states'). One
    that runs out of device memory asks ``on_short`` (a weak reference to a callable taking bytes and saying whether
    room was made, or None) for what the growth of it and of the layers after it still needs (`growth_need`), and if
    room was made grows once more; otherwise the error is raised, the layers before it grown. ``growth(layer)``:
    ``(net, peak)``, the bytes the layer's growth leaves allocated beyond what it holds now and the most beyond that
    on the way (a new tensor is made while the one it replaces is still held)."""
    layers = list(layers)
    for at, layer in enumerate(layers):
        try:
            grow(layer)
        except torch.OutOfMemoryError:
            relieve = None if on_short is None else on_short()
            if relieve is None or not relieve(growth_need(growth(rest) for rest in layers[at:])):
                raise
            grow(layer)


def growth_need(steps) -> int:
    """The device bytes a growth made of ``steps`` one after the other needs beyond what is held now: the most, over
    the steps, of the earlier steps' net growth and the step's own peak (each step ``(net, peak)``, as
    `SlotKVLayer.resize_growth`). Asking for every new tensor's bytes instead (what a growth allocates) counted the
    replaced tensors, freed on the way, as still held: about twice the need when slots double, and twice the held
    conversations evicted for it."""
    need = held = 0
    for net, peak in steps:
        need = max(need, held + peak)
        held += net
    return need


def _tensor_shapes(layers) -> list:
    """Each layer's keys' and values' shapes (None: not allocated yet): a resize replaces a tensor exactly where its
    shape changes."""
    return [(layer.keys.shape, layer.values.shape) if layer.is_initialized else None for layer in layers]


def _sized(t: torch.Tensor, num_slots: int, capacity: int) -> bool:
    """Whether a layer's ``[S, H, cap, D]`` tensor is already of ``num_slots`` slots of ``capacity`` rows."""
    return t.shape[0] == num_slots and t.shape[2] == capacity


class SlotKVLayer(CacheLayerMixin):
    """One attention layer's slot storage (``keys / values [S, H, cap, D]``, allocated at its first write on the
    layer's device); writes and reads follow the pool's running `SlotStep`."""

    def __init__(self, pool: "SlotKVPool", layer_idx: int):
        super().__init__()
        self._pool, self.layer_idx = weakref.ref(pool), layer_idx  # weak: no pool <-> layer cycle

    @property
    def pool(self) -> "SlotKVPool":
        return self._pool()

    def lazy_initialization(self, key_states, value_states):
        pool = self.pool
        shape = lambda t: (pool.total_slots, t.shape[1], pool.capacity, t.shape[-1])  # noqa: E731
        self.keys = key_states.new_zeros(shape(key_states))
        self.values = value_states.new_zeros(shape(value_states))
        self.is_initialized = True

    def resize_growth(self, num_slots: int, capacity: int) -> tuple[int, int]:
        """``(net, peak)``: the bytes `resize` to that shape leaves allocated beyond what the layer holds now, and the
        most beyond that on the way (each tensor's copy is made while the one it replaces is held; ``(0, 0)``: nothing
        allocated yet, or already of that shape)."""
        net = peak = 0
        if not self.is_initialized:
            return net, peak
        for t in (self.keys, self.values):
            if _sized(t, num_slots, capacity):
                continue
            new = t.element_size() * num_slots * t.shape[1] * capacity * t.shape[-1]
            peak, net = max(peak, net + new), net + new - t.numel() * t.element_size()
        return net, peak

    def resize(self, num_slots: int, capacity: int) -> None:
        """Reallocate to ``[num_slots, H, capacity, D]`` (zeros), keeping what the old tensors held. A tensor already
        of that shape is kept (a retry after an allocation failed part of the way)."""
        if not self.is_initialized:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            if _sized(old, num_slots, capacity):
                continue
            new = old.new_zeros(num_slots, old.shape[1], capacity, old.shape[-1])
            new[:old.shape[0], :, :old.shape[2]] = old
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        """``key_states / value_states [B, H, W, D]`` of the running step -> ``[B, H, T, D]`` of its slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.pool.step
        if step is None:
            raise RuntimeError("a SlotKVPool was written outside a step (SlotKVPool.begin_step places the rows).")
        slots, write = step.on(self.keys.device)
        # advanced indices on dims 0 and 2 put [B, W] in front: the stored rows are [B, W, H, D]
        self.keys[slots[:, None], :, write] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[slots[:, None], :, write] = value_states.transpose(1, 2).to(self.values.dtype)
        span = step.span
        if step.dense:  # slots 0 .. B - 1 in batch order: a view, no copy
            return self.keys[:step.dense, :, :span], self.values[:step.dense, :, :span]
        return self.keys[:, :, :span].index_select(0, slots), self.values[:, :, :span].index_select(0, slots)

    def get_seq_length(self) -> int:
        step = self.pool.step
        return 0 if step is None else step.span

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        step = self.pool.step
        return (query_length if step is None else step.span), 0

    def get_max_length(self) -> int:
        return self.pool.capacity

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


class SlotKVPool(Cache):
    """Per-sequence KV slots shared by the sequences of a batched engine (see the module docstring).

    Args:
        num_layers: the text model's layers (Gated DeltaNet layers' entries stay empty).
        num_slots: slots to start with (doubled when none is free).
        capacity: rows per slot to start with (doubled when a slot would overflow).
        device: where ``slot_keys`` live (the model's input device).
    """

    def __init__(self, num_layers: int, num_slots: int = DEFAULT_SLOTS, capacity: int = MIN_CAPACITY, device=None,
                 scratch_slot: bool = False):
        if int(num_slots) < 1 or int(capacity) < 1:
            raise ValueError(f"SlotKVPool needs num_slots >= 1 and capacity >= 1, got {num_slots} and {capacity}.")
        self.num_slots = int(num_slots)
        self.capacity = _round_up(max(int(capacity), MIN_CAPACITY), ROW_ROUNDING)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.has_scratch = bool(scratch_slot)
        super().__init__(layers=[SlotKVLayer(self, i) for i in range(int(num_layers))])
        self.slot_keys = torch.full((self.total_slots, self.capacity), MAX_KEY, dtype=torch.long, device=self.device)
        self.lengths = [0] * self.num_slots
        self._free = list(range(self.num_slots))
        self.step: SlotStep | None = None
        self.version = 0  # bumped whenever the tensors are reallocated (captured graphs hold their addresses)
        # called with the bytes a growth still needs when its allocation ran out of device memory: whether room was
        # made (the growth then tries once more); a weak reference to a bound method (`BatchLoop._relieve_memory`:
        # the server evicts held conversations) or None
        self.on_short: "weakref.WeakMethod | None" = None

    @property
    def total_slots(self) -> int:
        """Slots in the tensors: ``num_slots``, plus the scratch slot (index ``num_slots``) where the pool has one."""
        return self.num_slots + int(self.has_scratch)

    @property
    def scratch(self) -> int | None:
        """The scratch slot (never allocated; the padding rows of a batch bucket write there, its keys stay
        ``MAX_KEY``), or None."""
        return self.num_slots if self.has_scratch else None

    # ---- slots ------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A free slot (empty: length 0, every key ``MAX_KEY``); doubles the slots when none is free."""
        if not self._free:
            self._resize(self.num_slots * 2, self.capacity)
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        """Free ``slot``: its keys go back to ``MAX_KEY`` (nothing it held is visible to its next owner)."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"SlotKVPool.release got slot {slot}, which is not in use.")
        self.slot_keys[slot] = MAX_KEY
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort()

    def move(self, src: int, dst: int) -> None:
        """Move the rows, keys and length of slot ``src`` (in use) to the free slot ``dst``; ``src`` is freed (its
        keys reset). ``dst``'s rows past the moved length keep the empty key."""
        if dst not in self._free or src in self._free or not 0 <= src < self.num_slots:
            raise ValueError(f"SlotKVPool.move from slot {src} to slot {dst}: needs a slot in use and a free one.")
        n = self.lengths[src]
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst, :, :n] = layer.keys[src, :, :n]
                layer.values[dst, :, :n] = layer.values[src, :, :n]
        self.slot_keys[dst] = self.slot_keys[src]
        self.lengths[dst] = n
        self._free.remove(dst)
        self.release(src)

    def grow_slots(self, num_slots: int) -> None:
        """At least ``num_slots`` slots (a reallocation when there are fewer)."""
        if num_slots > self.num_slots:
            self._resize(int(num_slots), self.capacity)

    def reserve(self, rows_after: int, relieve: bool = True) -> None:
        """Make every slot hold at least ``rows_after`` rows (capacity doubling). ``relieve``: a growth short of device
        memory may ask for room (`on_short`; False: it raises `PoolOutOfMemory` at once, nobody's memory taken)."""
        capacity = self.capacity
        while capacity < rows_after:
            capacity *= 2
        if capacity != self.capacity:
            self._resize(self.num_slots, capacity, relieve)

    def _resize(self, num_slots: int, capacity: int, relieve: bool = True) -> None:
        """The layers one at a time (each old tensor freed once its copy is made: the pool is never held twice),
        then the keys and the sizes. An allocation that fails part of the way leaves the pool at its old sizes, every
        layer holding at least those (a retry skips the layers already resized), and ``version`` bumped all the same
        where a tensor was replaced: captured steps hold the replaced tensors' addresses, freed now, and must not
        replay on them. Before that, a layer whose allocation failed asks `on_short` for the bytes still needed
        (`growth_need`) and, if room was made, tries again (with ``relieve``). A failure raises `PoolOutOfMemory`."""
        total = num_slots + int(self.has_scratch)
        shapes = _tensor_shapes(self.layers)
        grown = False
        try:
            keys = torch.full((total, capacity), MAX_KEY, dtype=torch.long, device=self.device)
            grow_each(self.layers, lambda layer: layer.resize(total, capacity),
                      lambda layer: layer.resize_growth(total, capacity), self.on_short if relieve else None)
            grown = True
        except torch.OutOfMemoryError as error:
            raise PoolOutOfMemory(str(error)) from error
        finally:
            if grown or _tensor_shapes(self.layers) != shapes:  # (a failure that replaced nothing leaves the
                self.version += 1  # captured steps theirs)
        keys[:self.num_slots, :self.capacity] = self.slot_keys[:self.num_slots]  # (the scratch slot's keys: MAX_KEY)
        self.slot_keys = keys
        self._free += list(range(self.num_slots, num_slots))
        self.lengths += [0] * (num_slots - self.num_slots)
        self.num_slots, self.capacity = num_slots, capacity

    # ---- one forward ------------------------------------------------------------------------
    def begin_step(self, slots: list[int], query_keys: list[torch.Tensor], width: int) -> torch.Tensor:
        """Place a forward ``[B, width]`` over ``slots`` (one per row of the batch), ``query_keys[b]`` the order keys of
        slot ``b``'s real rows (its first ``len`` rows; the rest of ``width`` is padding). Writes the keys, advances
        the lengths and returns the visibility ``[B, width, T]`` (bool, on the pool's device)."""
        if self.step is not None:
            raise RuntimeError("SlotKVPool.begin_step inside a running step.")
        before = [self.lengths[s] for s in slots]
        self.reserve(max(before) + width)
        starts = torch.tensor(before, dtype=torch.long)
        write = starts[:, None] + torch.arange(width)[None]
        span = min(self.capacity, _round_up(max(before) + width, ROW_ROUNDING))
        host_slots = torch.tensor(slots, dtype=torch.long)
        # the step's placement and the keys made on the host go to the device in one non-blocking copy (no wait)
        moved = to_device_all([host_slots, write, *[k.long() for k in query_keys]], self.device)
        index, write_on, query_keys = moved[0], moved[1], moved[2:]
        queries = torch.full((len(slots), width), MAX_KEY, dtype=torch.long, device=self.device)
        for b, (slot, keys) in enumerate(zip(slots, query_keys)):
            n = int(keys.shape[0])
            if n:
                queries[b, :n] = keys
                self.slot_keys[slot, self.lengths[slot]:self.lengths[slot] + n] = keys
            self.lengths[slot] += n
        stored = self.slot_keys[:, :span].index_select(0, index)  # [B, T]
        visible = stored[:, None, :] <= queries[:, :, None]
        own = write_on[:, :, None] == torch.arange(span, device=self.device)[None, None]
        padding = queries == MAX_KEY
        visible = torch.where(padding[:, :, None], own, visible)
        self.step = SlotStep(host_slots, write, span, before, on={self.device: (index, write_on)})
        return visible

    def end_step(self, completed: bool = True) -> None:
        """The step is over; when it did not complete (the forward raised), its rows are taken back: the slots'
        lengths and keys are as before it (whatever it wrote past them is invisible)."""
        step, self.step = self.step, None
        if step is None or completed:
            return
        for slot, before in zip(step.slots.tolist(), step.lengths_before):
            self.slot_keys[slot, before:self.lengths[slot]] = MAX_KEY
            self.lengths[slot] = before

    # ---- one slot as a batch-1 cache ----------------------------------------------------------
    def rows_of(self, slot: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(keys, values) [1, H, length, D]`` of ``slot`` in layer ``layer_idx`` (None: the layer holds no KV)."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            return None
        n = self.lengths[slot]
        return layer.keys[slot:slot + 1, :, :n], layer.values[slot:slot + 1, :, :n]

    def load(self, slot: int, keys: torch.Tensor, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill the empty ``slot`` with a batch-1 cache's rows: order ``keys [n]`` and per attention layer
        ``(keys, values) [1, H, n, D]``."""
        if self.lengths[slot]:
            raise ValueError(f"SlotKVPool.load into slot {slot}, which holds {self.lengths[slot]} rows.")
        n = int(keys.shape[0])
        self.reserve(n)
        for layer_idx, (k, v) in kv.items():
            layer = self.layers[layer_idx]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys[slot, :, :n] = k[0].to(layer.keys.device, layer.keys.dtype)
            layer.values[slot, :, :n] = v[0].to(layer.values.device, layer.values.dtype)
        self.slot_keys[slot, :n] = keys.to(self.device)
        self.lengths[slot] = n

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.step is None else self.step.span

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(slots={self.num_slots}, capacity={self.capacity}, "
                f"in_use={self.num_slots - len(self._free)})")
