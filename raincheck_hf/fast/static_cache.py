"""`StaticDeferredCache`: preallocated KV slots, keys per slot, visibility on the device.

Storage layout per attention layer: ``keys/values [1, H, capacity + scratch, D]``. Real rows take
slots ``0, 1, 2, ...`` in the order forwards append them (the same storage order as
`DeferredDynamicCache`, whose bookkeeping this class inherits); the last ``scratch`` slots take
the padding rows of a padded forward (and graph warm-up), and their key stays at the maximum, so no
real query ever sees them. ``slot_keys`` holds each slot's order key; visibility of a forward's
queries is ``slot_keys[None, :B] <= query_keys[:, None]``, computed on the device inside the step,
over the first ``B`` slots only (``attention_slots``, the step's slot bucket, `slot_bucket`): the
layers hand attention views of their first ``B`` slots, so a step's attention costs what the
conversation holds, not what the storage could hold.

The tensors live in a `SlotStorage`, together with the CUDA graphs captured on them (a graph reads
and writes its tensors by address). A storage whose cache has been garbage-collected is handed to
the next cache of the same size for the same model (`acquire_storage`), graphs included, so a new
conversation does not capture again; `release_storage` frees what a model keeps.

Gated DeltaNet layers (Qwen3.5) keep no KV rows: their state lives in `gdn.static.StaticGDNState` buffers of
the same storage (the live recurrent state and conv history, the insertion boundary, the suffix map and the
leading segment's record of docs/method.md §4), allocated with the storage, carried over on growth and deep
copies, and changed in place by the fast path's GDN steps (`gdn.dispatch`), so a captured step holds their
addresses.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache_utils import INPUT, GENERATED, DeferredDynamicCache
from ..gdn.static import RecurrentLayout, StaticGDNState
from .scoping import used_on

MAX_KEY = torch.iinfo(torch.long).max
SLOT_ROUNDING = 256  # the smallest capacity; capacities double from there
SLOT_BUCKET = 256  # the smallest slot bucket, and the bucket step below 2 * SLOT_BUCKET * BUCKETS_PER_DOUBLING
BUCKETS_PER_DOUBLING = 4  # slot buckets between n and 2n (n >= SLOT_BUCKET * BUCKETS_PER_DOUBLING): at most 25% waste
POOLED_PER_MODEL = 4  # storages (with their graphs) kept per model for later conversations


def round_capacity(rows: int) -> int:
    """``SLOT_ROUNDING * 2**k >= rows``: few distinct sizes, so conversations of similar length share a
    pooled storage (and its graphs) and a growing conversation moves rarely (at most 2x the KV memory)."""
    capacity = SLOT_ROUNDING
    while capacity < int(rows):
        capacity *= 2
    return capacity


def slot_bucket(rows: int, capacity: int) -> int:
    """Slots a step attends over when ``rows`` slots are in use (the step's own included), at most ``capacity``:
    ``rows`` rounded up to a multiple of ``max(SLOT_BUCKET, p / BUCKETS_PER_DOUBLING)``, ``p`` the largest power
    of two <= ``rows`` (1,402 -> 1,536; 2,100 -> 2,560; 6,541 -> 7,168 with the defaults). Each bucket is a
    captured shape of its own, so the ladder is geometric: a bounded share of wasted attention (< 25% above
    ``SLOT_BUCKET * BUCKETS_PER_DOUBLING`` rows) for a number of graphs that grows with the log of the length."""
    rows = max(int(rows), 1)
    step = max(SLOT_BUCKET, (1 << (rows.bit_length() - 1)) // BUCKETS_PER_DOUBLING)
    return min(int(capacity), -(-rows // step) * step)


class SlotStorage:
    """KV tensors of ``capacity + scratch`` slots for every attention layer, their keys, the GDN layers'
    `StaticGDNState` (``recurrent``: their `RecurrentLayout`, None for attention-only models) and the graphs
    captured on them (``graphs``, a `StepGraphs` or None). One cache uses a storage at a time."""

    def __init__(self, num_layers: int, capacity: int, scratch: int, device, recurrent: RecurrentLayout | None = None):
        self.num_layers, self.capacity, self.scratch = int(num_layers), int(capacity), int(scratch)
        self.device = torch.device(device)
        self.recurrent = recurrent
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers
        self.slot_keys = torch.full((self.total_slots,), MAX_KEY, dtype=torch.long, device=self.device)
        self.gdn: dict[int, StaticGDNState] = {} if recurrent is None else {
            i: StaticGDNState(recurrent, self.device) for i in recurrent.layers}
        self.graphs = None
        self._user = None
        self.kept = False  # warmed ahead (`raincheck_hf.warm_up`): never evicted from the pool, outside its count
        self._stream = None  # the CUDA stream of the last lease (`_mark_stream`)

    @property
    def total_slots(self) -> int:
        return self.capacity + self.scratch

    def matches(self, num_layers, capacity, scratch, device, recurrent=None) -> bool:
        return (self.num_layers, self.capacity, self.scratch, self.device, self.recurrent) == (
            int(num_layers), int(capacity), int(scratch), torch.device(device), recurrent)

    @property
    def busy(self) -> bool:
        return self._user is not None and self._user() is not None

    def lease(self, cache) -> "SlotStorage":
        self._mark_stream()
        # every slot invisible again: what an earlier conversation left in the KV tensors is unreachable
        self.slot_keys.fill_(MAX_KEY)
        for state in self.gdn.values():  # a new conversation starts from zero states, as on a fresh cache
            state.zero_()
        self._user = weakref.ref(cache)
        return self

    def release(self) -> None:
        self._user = None

    def _mark_stream(self) -> None:
        """A lease from another CUDA stream than the last one: an earlier user may have made these tensors (and the
        captured steps' buffers) on that stream, so they are marked as used on this one too, and freed (the storage
        evicted) they go to no allocation of the other stream before this one's work on them is done
        (`fast.scoping.used_on`). Leases from the stream of the last one mark nothing: what was made since was made
        on that stream (every turn on the default stream: nothing, ever)."""
        if self.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        if stream == self._stream:
            return
        used_on((self.keys, self.values, self.slot_keys, self.gdn,
                 None if self.graphs is None else self.graphs.static_tensors()), stream)
        self._stream = stream

    def layer_tensors(self, idx: int, key_like: torch.Tensor, value_like: torch.Tensor):
        """Layer ``idx``'s ``(keys, values)``, allocated on first use with the batch/head/dim of the arguments."""
        if self.keys[idx] is None:
            b, h, _, d = key_like.shape
            self.keys[idx] = key_like.new_zeros(b, h, self.total_slots, d)
            self.values[idx] = value_like.new_zeros(b, h, self.total_slots, value_like.shape[-1])
        return self.keys[idx], self.values[idx]


_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, list[SlotStorage]]" = weakref.WeakKeyDictionary()
_POOL_LOCK = threading.Lock()


def acquire_storage(pool_key, cache, num_layers: int, capacity: int, scratch: int, device,
                    recurrent: RecurrentLayout | None = None) -> SlotStorage:
    """A free pooled storage of this size for ``pool_key`` (the text model), else a new one (pooled while
    fewer than `POOLED_PER_MODEL` are kept, evicting the oldest free one of another size when full)."""
    with _POOL_LOCK:  # two conversations starting at once (the demo's concurrent chats) must not lease one storage
        pool = None if pool_key is None else _POOLS.setdefault(pool_key, [])
        if pool is not None:
            for storage in pool:
                if not storage.busy and storage.matches(num_layers, capacity, scratch, device, recurrent):
                    return storage.lease(cache)
        storage = SlotStorage(num_layers, capacity, scratch, device, recurrent)
        if pool is not None:
            evictable = [s for s in pool if not s.kept]  # storages warmed ahead stay, outside the count
            if len(evictable) >= POOLED_PER_MODEL:
                free = [s for s in evictable if not s.busy]
                if free:
                    pool.remove(free[0])
                    evictable.remove(free[0])
            if len(evictable) < POOLED_PER_MODEL:
                pool.append(storage)
        return storage.lease(cache)


def keep_storage(pool_key, storage: SlotStorage) -> None:
    """Keep ``storage`` in ``pool_key``'s pool for good (`raincheck_hf.warm_up`: the graphs captured on it ahead of
    the conversations that will use it), beyond the `POOLED_PER_MODEL` storages kept otherwise; `release_storage`
    still frees it."""
    with _POOL_LOCK:
        pool = _POOLS.setdefault(pool_key, [])
        storage.kept = True
        if not any(s is storage for s in pool):
            pool.append(storage)


def kept_in_use(pool_key, num_layers: int, capacity: int, scratch: int, device,
                recurrent: RecurrentLayout | None = None) -> int:
    """How many storages of this size kept in ``pool_key``'s pool (`keep_storage`) a live cache holds now: a warm-up
    counts them among the storages it was asked for (it cannot capture on them, and a new storage beside them would
    only be one more)."""
    with _POOL_LOCK:
        return sum(1 for s in _POOLS.get(pool_key, ()) if s.kept and s.busy
                   and s.matches(num_layers, capacity, scratch, device, recurrent))


def release_storage(model) -> int:
    """Drop the slot storages (KV tensors and captured graphs) kept for ``model``; returns how many.

    Storages in use by a live cache stay with that cache and are freed with it. The pools are keyed by the text
    model, a submodule of ``model`` (or ``model`` itself).
    """
    with _POOL_LOCK:
        keys = [key for key in list(_POOLS.keys()) if key is model or any(key is m for m in model.modules())]
        return sum(len(_POOLS.pop(key, [])) for key in keys)


class StaticDeferredLayer(CacheLayerMixin):
    """One attention layer's preallocated KV (in the cache's storage); writes go to the cache's current slots."""

    is_compileable = True

    def __init__(self, owner: "StaticDeferredCache", layer_idx: int):
        super().__init__()
        # a weak reference: no cache <-> layer cycle, so a dropped cache (and its storage) is free at once,
        # not at the next garbage collection
        self._owner, self.layer_idx = weakref.ref(owner), layer_idx

    @property
    def owner(self) -> "StaticDeferredCache":
        return self._owner()

    def lazy_initialization(self, key_states, value_states):
        self.keys, self.values = self.owner.storage.layer_tensors(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        self.keys.index_copy_(2, owner.current_slots, key_states)
        self.values.index_copy_(2, owner.current_slots, value_states)
        n = owner.attention_slots  # the step's slot bucket: attention reads its first n slots (views, no copy)
        if n is None:
            return self.keys, self.values
        return self.keys[:, :, :n], self.values[:, :, :n]

    def get_seq_length(self) -> int:
        return self.owner.num_rows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.attention_slots or self.owner.total_slots, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def attach(self, storage: SlotStorage) -> None:
        """Point at ``storage``'s tensors for this layer, when it has them (else the first `update` allocates).

        The layer must know its storage's tensors without having run: a cache on a pooled storage may replay
        graphs an earlier cache captured there, which write the storage's tensors by address and run no Python,
        so `lazy_initialization` would never happen."""
        keys, values = storage.keys[self.layer_idx], storage.values[self.layer_idx]
        self.keys, self.values, self.is_initialized = keys, values, keys is not None


class StaticDeferredCache(DeferredDynamicCache):
    """A `DeferredDynamicCache` whose KV lives in preallocated slots (see module docstring).

    Args:
        num_layers: attention layers of the text model.
        capacity: real rows it can hold before it grows (growing moves to a bigger storage).
        scratch: padding slots at the end (>= the largest padding of a padded forward).
        device: where the slots live.
        pool_key: the text model, whose pool of storages (and captured graphs) this cache draws from;
            None: a private storage.
        recurrent: the text model's Gated DeltaNet layers (`RecurrentLayout`), None when every layer is
            attention. Their layers in ``layers`` stay unused: the GDN state lives in `gdn_state`.

    ``suffix_length`` counts the generated rows since the last forward with input rows (the suffix whose
    transitions the GDN layers record while deferred rows are pending).
    """

    def __init__(self, num_layers: int, capacity: int, scratch: int, device, pool_key=None,
                 recurrent: RecurrentLayout | None = None):
        super().__init__(config=None, device=device)
        self._pool_ref = None if pool_key is None else weakref.ref(pool_key)
        self.num_layers = int(num_layers)
        self.recurrent = recurrent
        self.suffix_length = 0
        self.storage = acquire_storage(pool_key, self, num_layers, capacity, scratch, device, recurrent)
        self.layers = [StaticDeferredLayer(self, i) for i in range(num_layers)]
        for layer in self.layers:
            layer.attach(self.storage)
        self.layer_class_to_replicate = None
        self.current_slots = torch.empty(0, dtype=torch.long, device=device)
        self.attention_slots: int | None = None  # the running step's slot bucket (None: every slot)
        self.compile_steps = False  # RaincheckConfig.compile_steps of the call using the cache (`fast.compiled`)
        self.time_steps = False  # the call chooses chunk sizes from measured step costs (chunk_size="auto")

    @property
    def _pool_key(self):
        return None if self._pool_ref is None else self._pool_ref()

    @property
    def capacity(self) -> int:
        return self.storage.capacity

    @property
    def scratch(self) -> int:
        return self.storage.scratch

    @property
    def total_slots(self) -> int:
        return self.storage.total_slots

    @property
    def slot_keys(self) -> torch.Tensor:
        return self.storage.slot_keys

    @property
    def graphs(self):
        return self.storage.graphs

    @graphs.setter
    def graphs(self, value):
        self.storage.graphs = value

    def gdn_state(self, layer_idx: int) -> StaticGDNState:
        """GDN layer ``layer_idx``'s `StaticGDNState` (in the current storage: fetch it per step)."""
        return self.storage.gdn[layer_idx]

    def _move_to(self, storage: SlotStorage, rows: int) -> None:
        """Carry the first ``rows`` slots (keys and KV) and the GDN states over to ``storage`` and use it from now on.

        The KV comes from the current storage's tensors, not from the layer objects: those may never have run
        (every forward of this cache so far replayed graphs captured by an earlier cache), and what the storage
        holds is what the replays wrote."""
        old = self.storage
        storage.slot_keys[:rows].copy_(old.slot_keys[:rows])
        for idx in range(self.num_layers):
            keys, values = old.keys[idx], old.values[idx]
            if keys is None:
                continue
            new_keys, new_values = storage.layer_tensors(idx, keys, values)
            new_keys[:, :, :rows].copy_(keys[:, :, :rows])
            new_values[:, :, :rows].copy_(values[:, :, :rows])
        for idx, state in old.gdn.items():
            storage.gdn[idx].copy_from(state)
        self.storage = storage
        for layer in self.layers:
            layer.attach(storage)

    def __deepcopy__(self, memo):
        # the copy takes a storage of its own (pooled: graphs captured there before are reused) with the same
        # contents; everything else is copied as usual
        clone = copy.copy(self)
        memo[id(self)] = clone
        state = {k: v for k, v in self.__dict__.items() if k not in ("storage", "layers")}
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone.layers = [StaticDeferredLayer(clone, i) for i in range(self.num_layers)]
        storage = acquire_storage(self._pool_key, clone, self.num_layers, self.capacity, self.scratch,
                                  self.storage.device, self.recurrent)
        clone.storage = self.storage  # start from the source's storage ...
        clone._move_to(storage, self.total_slots)  # ... and copy it (every slot) into the clone's own
        return clone

    def ensure_capacity(self, rows_needed: int, scratch: int | None = None) -> None:
        """Make room for ``rows_needed`` real rows (`round_capacity`: the next power-of-two multiple of
        `SLOT_ROUNDING`) and at least ``scratch`` padding slots (a later turn may use a larger chunk size),
        moving to a bigger storage; the old one goes back to the pool."""
        scratch = self.scratch if scratch is None else max(int(scratch), self.scratch)
        if rows_needed <= self.capacity and scratch == self.scratch:
            return
        old = self.storage
        self._move_to(acquire_storage(self._pool_key, self, self.num_layers,
                                      max(self.capacity, round_capacity(rows_needed)), scratch, old.device,
                                      self.recurrent),
                      self.num_rows)
        old.release()

    def assign_slots(self, keys: torch.Tensor, sources: torch.Tensor, kinds) -> int:
        """Register real rows (bookkeeping as `add_rows`; ``keys`` on the slots' device) and return the first slot.

        The rows take slots ``start, start + 1, ...``; the step itself writes their keys into ``slot_keys``.
        """
        start = self.num_rows
        n = int(keys.shape[0])
        if start + n > self.capacity:
            raise RuntimeError(f"StaticDeferredCache capacity {self.capacity} exceeded ({start + n} rows)")
        self.register_rows(keys, sources, kinds)
        kinds = torch.as_tensor(kinds, dtype=torch.int8).expand(n)
        if bool((kinds == INPUT).any()):
            self.suffix_length = 0
        else:
            self.suffix_length += int((kinds == GENERATED).sum())
        return start

    def add_rows(self, keys, sources, kinds):
        raise RuntimeError("StaticDeferredCache rows are registered by the fast path (assign_slots), not add_rows")

    def reset(self) -> None:
        super().reset()
        self.storage.slot_keys.fill_(MAX_KEY)
        for state in self.storage.gdn.values():
            state.zero_()
        self.suffix_length = 0
