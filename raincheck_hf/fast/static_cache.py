"""`StaticDeferredCache`: preallocated KV slots, keys per slot, visibility on the device.

Storage layout per attention layer: ``keys/values [1, H, capacity + scratch, D]``. Real rows take
slots ``0, 1, 2, ...`` in the order forwards append them (the same storage order as
`DeferredDynamicCache`, whose bookkeeping this class inherits); the last ``scratch`` slots take
the padding rows of a padded chunk (and graph warm-up), and their key stays at the maximum, so no
real query ever sees them. ``slot_keys`` holds each slot's order key; visibility of a forward's
queries is ``slot_keys[None, :] <= query_keys[:, None]``, computed on the device inside the step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache_utils import DeferredDynamicCache

MAX_KEY = torch.iinfo(torch.long).max
SLOT_ROUNDING = 256  # capacities are multiples of this, so a conversation rarely regrows (and recaptures)


def round_capacity(rows: int) -> int:
    return -(-int(rows) // SLOT_ROUNDING) * SLOT_ROUNDING


class StaticDeferredLayer(CacheLayerMixin):
    """One attention layer's preallocated KV; writes go to the cache's current slot indices."""

    is_compileable = True

    def __init__(self, owner: "StaticDeferredCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states):
        n = self.owner.total_slots
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, n, d)
        self.values = value_states.new_zeros(b, h, n, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.current_slots
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.num_rows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.total_slots, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def grow(self, total_slots: int, old_capacity: int, new_capacity: int) -> None:
        if not self.is_initialized:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], total_slots, old.shape[-1])
            new[:, :, :old_capacity] = old[:, :, :old_capacity]
            setattr(self, name, new)


class StaticDeferredCache(DeferredDynamicCache):
    """A `DeferredDynamicCache` whose KV lives in preallocated slots (see module docstring).

    Args:
        num_layers: attention layers of the text model.
        capacity: real rows it can hold before it grows (growing reallocates and drops captured graphs).
        scratch: padding slots at the end (>= the largest forward that is padded or captured).
    """

    is_static = True

    def __init__(self, num_layers: int, capacity: int, scratch: int, device):
        super().__init__(config=None, device=device)
        self.layers = [StaticDeferredLayer(self) for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self.capacity, self.scratch = int(capacity), int(scratch)
        self.slot_keys = torch.full((self.total_slots,), MAX_KEY, dtype=torch.long, device=device)
        self.current_slots = torch.empty(0, dtype=torch.long, device=device)
        self.graphs = None  # StepGraphs, built on first use on CUDA

    def __deepcopy__(self, memo):
        # captured graphs point at this cache's buffers: a copy gets fresh buffers and captures its own
        import copy

        graphs, self.graphs = self.graphs, None
        try:
            clone = copy.copy(self)
            memo[id(self)] = clone
            clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        finally:
            self.graphs = graphs
        return clone

    @property
    def total_slots(self) -> int:
        return self.capacity + self.scratch

    def ensure_capacity(self, rows_needed: int) -> None:
        """Make room for ``rows_needed`` real rows (rounded up to a multiple of `SLOT_ROUNDING`)."""
        if rows_needed <= self.capacity:
            return
        new_capacity = round_capacity(rows_needed)
        old = self.capacity
        self.capacity = new_capacity
        for layer in self.layers:
            layer.grow(self.total_slots, old, new_capacity)
        keys = torch.full((self.total_slots,), MAX_KEY, dtype=torch.long, device=self.slot_keys.device)
        keys[:old] = self.slot_keys[:old]
        self.slot_keys = keys
        self.graphs = None  # captured graphs point at the old buffers

    def assign_slots(self, keys: torch.Tensor, sources: torch.Tensor, kinds, padding: int = 0) -> torch.Tensor:
        """Register real rows (as `add_rows`) and return the slots of ``[real rows, padding rows]``."""
        start = self.num_rows
        n = int(keys.shape[0])
        if start + n > self.capacity:
            raise RuntimeError(f"StaticDeferredCache capacity {self.capacity} exceeded ({start + n} rows)")
        super().add_rows(keys, sources, kinds)  # bookkeeping only (no visibility needed here)
        device = self.slot_keys.device
        self.slot_keys[start:start + n] = keys.to(device)
        real = torch.arange(start, start + n, device=device)
        pad = torch.arange(self.capacity, self.capacity + padding, device=device)
        return torch.cat([real, pad])

    def add_rows(self, keys, sources, kinds):
        raise RuntimeError("StaticDeferredCache rows are registered by the fast path (assign_slots), not add_rows")
