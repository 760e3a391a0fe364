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

Gated DeltaNet layers (Qwen3.5) keep no KV rows: their state lives in `StaticGDNState` buffers of the same
storage (the live recurrent state and conv history, the insertion boundary, the suffix map and the leading
segment's record of docs/method.md §4), allocated with the storage, carried over on growth and deep copies,
and changed in place by the fast path's GDN steps (`StaticGDNState.run_chunk` / ``join`` / ``run_rest`` /
``record`` / ``reset_boundary``), so a captured step holds their addresses.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache_utils import INPUT, GENERATED, DeferredDynamicCache
from ..gated_delta import GDNLayerParams
from . import gdn_kernels

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


@dataclass(frozen=True)
class RecurrentLayout:
    """The Gated DeltaNet layers of a text model, as the static cache reserves them.

    Attributes:
        layers: indices of the GDN (``linear_attention``) layers.
        num_k_heads, num_v_heads, head_k_dim, head_v_dim: the head split (Qwen3.5-9B: 16, 32, 128, 128).
        kernel_size: the short convolution's width ``Kc`` (4).
        dtype: the pre-conv inputs' dtype (the model's).
    """

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    kernel_size: int
    dtype: torch.dtype

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


class StaticGDNState:
    """One GDN layer's state of docs/method.md §4 in fixed buffers (batch 1), changed only in place.

    Buffers (fp32 states, pre-conv inputs in the model's dtype):
        state ``[1, HV, K, V]`` and conv ``[1, Kc - 1, C]``: the live recurrent state and conv history;
        boundary_state / boundary_conv: S_b and h_b, where deferred rows are inserted;
        leading_state ``[1, HV, K, V]``: S_L, the first ``l <= Kc - 1`` suffix tokens applied to S_b;
        leading_qkv ``[1, Kc - 1, C]``: those tokens' pre-conv inputs (slot ``j`` holds suffix token ``j``), and
            leading_g ``[1, Kc - 1, HV]`` (fp32) / leading_beta: their gates, which an insertion does not change
            (they depend on the token's own projections only; q, k and v go through the conv and do);
        rest_map ``[1, HV, K, K]``: M, the product of the later suffix tokens' transitions.

    The suffix length ``t`` (and how many rows of a padded chunk are real) come with each step as device
    scalars, so one captured step serves every value; padding rows get ``g = 0, beta = 0`` (no change to
    any state) and never enter a conv history.
    """

    _NAMES = ("state", "conv", "boundary_state", "boundary_conv", "leading_state", "leading_qkv", "leading_g",
              "leading_beta", "rest_map")

    def __init__(self, layout: RecurrentLayout, device):
        hv, dk, dv, width = layout.num_v_heads, layout.head_k_dim, layout.head_v_dim, layout.kernel_size - 1
        f32 = dict(dtype=torch.float32, device=device)
        own = dict(dtype=layout.dtype, device=device)
        self.state = torch.zeros(1, hv, dk, dv, **f32)
        self.conv = torch.zeros(1, width, layout.conv_dim, **own)
        self.boundary_state = torch.zeros(1, hv, dk, dv, **f32)
        self.boundary_conv = torch.zeros(1, width, layout.conv_dim, **own)
        self.leading_state = torch.zeros(1, hv, dk, dv, **f32)
        self.leading_qkv = torch.zeros(1, width, layout.conv_dim, **own)
        self.leading_g = torch.zeros(1, width, hv, **f32)
        self.leading_beta = torch.zeros(1, width, hv, **own)
        self.rest_map = torch.zeros(1, hv, dk, dk, **f32)
        self.repaired = torch.zeros(1, hv, dk, dv, **f32)  # scratch of `join` (S_L'), not part of the state
        self.width = width
        self._eye = torch.eye(dk, **f32)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._NAMES]

    def copy_from(self, other: "StaticGDNState") -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)

    def zero_(self) -> None:
        for t in self.tensors():
            t.zero_()

    # ---- the steps (params: the layer's `GDNLayerParams`) -------------------------------------
    def run_chunk(self, qkv, g, beta, n_real: torch.Tensor, params: GDNLayerParams, chunk_rule=None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Deferred rows from the boundary: ``S_b <- S_b'``, ``h_b <- h_b'``; their core outputs ``[1, R, HV, V]``
        (into ``out`` when given).

        ``qkv [1, R, C]``, ``g, beta [1, R, HV]``: the first ``n_real`` (a device scalar ``[1]``) rows are
        real, the rest padding (gated to no-ops; they follow the real rows, so no real row's conv reads them,
        and only the real rows enter h_b). Two launches, each masking by ``n_real`` itself: the conv, then the
        rule token by token; or, for longer chunks (the caller's choice), ``chunk_rule``
        (transformers' chunked rule, exact for gated-off rows too).
        """
        y = gdn_kernels.conv_update_(self.boundary_conv, qkv, params.conv_weight, params.conv_bias, params.activation,
                                     rows_in=n_real)
        q, k, v = _split_heads(y, params)
        if chunk_rule is None:
            # the token-by-token kernel: `gdn_kernels.chunked_step_` computes the same in the chunked form, but a
            # fused Qwen3.5-9B step with it in this place measured no faster (9.81 against 9.58 ms on an H200)
            return gdn_kernels.recurrent_step_(self.boundary_state, q, k, v, g, beta, valid=n_real, out=out)
        g, beta = gdn_kernels.gate_off(g, beta, (torch.arange(qkv.shape[1], device=qkv.device) < n_real)[None, :, None])
        o, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=self.boundary_state,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        self.boundary_state.copy_(final)
        return o if out is None else out.copy_(o)

    def join(self, suffix_length: torch.Tensor, params: GDNLayerParams) -> None:
        """After `run_chunk`: ``S_live += M (S_L' - S_L)``, S_L' the leading segment (``min(t, Kc - 1)``
        recorded tokens, ``t = suffix_length``, a device scalar ``[1]``) recomputed from the new h_b and
        applied to the new S_b; the live conv history follows h_b while ``t < Kc - 1``: it is the last
        ``Kc - 1`` of ``[h_b', the t recorded tokens]``, which the conv writes (otherwise it holds suffix tokens
        only and does not change). Four launches: the conv, the rule into the scratch S_L', the join, S_L <- S_L'.
        """
        t = suffix_length
        y = gdn_kernels.conv_update_(self.boundary_conv, self.leading_qkv, params.conv_weight, params.conv_bias,
                                     params.activation, rows_in=t, history_out=self.conv, only_within_window=True)
        q, k, v = _split_heads(y, params)
        gdn_kernels.recurrent_step_(self.boundary_state, q, k, v, self.leading_g, self.leading_beta, valid=t,
                                    state_out=self.repaired)
        gdn_kernels.join_(self.state, self.rest_map, self.repaired, self.leading_state)
        self.leading_state.copy_(self.repaired)

    def run_rest(self, qkv, g, beta, params: GDNLayerParams, chunk_rule=None, out: torch.Tensor | None = None):
        """Rows after the boundary (a generated token, or a turn's input) from the live state.

        One row runs the recurrent rule; several (a prefill after leftover deferred rows) ``chunk_rule`` (transformers'
        chunked gated delta rule of the layer's modeling file), as the stock module does. Returns the core
        outputs ``[1, T, HV, V]`` (into ``out`` when given) and the rows' keys ``[1, T, HK, K]`` and values (raw)
        for `record`.
        """
        y = gdn_kernels.conv_update_(self.conv, qkv, params.conv_weight, params.conv_bias, params.activation)
        q, k, v = _split_heads(y, params)
        if qkv.shape[1] == 1 or chunk_rule is None:
            return gdn_kernels.recurrent_step_(self.state, q, k, v, g, beta, out=out), k, v
        o, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=self.state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        self.state.copy_(final)
        return (o if out is None else out.copy_(o)), k, v

    def run_input(self, qkv, g, beta, n_padding: torch.Tensor, params: GDNLayerParams, chunk_rule=None):
        """A turn's input rows from the live state, after ``n_padding`` (a device scalar ``[1]``) leading padding
        rows: the layout of a bucketed prefill, ``[padding, input rows]``, whose captured graph serves every
        input length of its bucket. `run_rest`'s result for the real rows, and the same states after.

        Padding rows get ``g = 0, beta = 0`` (the state passes them unchanged), and the conv history is moved
        next to the first real row: of ``[h, padding, real rows]`` (``P`` padding rows) the shifted sequence
        is ``[anything (P rows), h, real rows]``, so every real row's conv window holds ``[h, real rows]`` only
        and the new history is the last ``Kc - 1`` of that, whatever ``P``. Padding rows' outputs are garbage.
        """
        rows = qkv.shape[1]
        device = qkv.device
        joined = torch.cat([self.conv, qkv.to(self.conv.dtype)], dim=1)  # [1, Kc - 1 + R, C]
        position = torch.arange(self.width + rows, device=device)
        index = torch.where(position < n_padding + self.width, (position - n_padding).clamp(min=0), position)
        shifted = joined.index_select(1, index)
        history = shifted[:, :self.width].clone()
        y = gdn_kernels.conv_update_(history, shifted[:, self.width:], params.conv_weight, params.conv_bias,
                                     params.activation)
        self.conv.copy_(history)  # the last Kc - 1 of [h, real rows]
        q, k, v = _split_heads(y, params)
        g, beta = gdn_kernels.gate_off(g, beta, (torch.arange(rows, device=device) >= n_padding)[None, :, None])
        if rows == 1 or chunk_rule is None:
            return gdn_kernels.recurrent_step_(self.state, q, k, v, g, beta), k, v
        out, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=self.state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        self.state.copy_(final)
        return out, k, v

    def record(self, qkv, k, v, g, beta, suffix_length: torch.Tensor, leading: bool) -> None:
        """Extend the suffix by the generated token that just ran: its pre-conv input ``qkv [1, 1, C]`` and its
        factors from `run_rest` (``k`` raw, ``v``, ``g``, ``beta [1, 1, HV]``). With ``leading`` (``t < Kc -
        1``, known on the host) it fills leading-record slot ``t`` and S_L advances by it; otherwise ``M <- A_t
        M`` (``k`` normalised inside the update)."""
        if leading:
            self.leading_qkv.index_copy_(1, suffix_length, qkv.to(self.leading_qkv.dtype))
            self.leading_g.index_copy_(1, suffix_length, g.to(self.leading_g.dtype))
            self.leading_beta.index_copy_(1, suffix_length, beta.to(self.leading_beta.dtype))
            gdn_kernels.recurrent_step_(self.leading_state, k, k, v, g, beta)  # the output is not needed
            return
        gdn_kernels.suffix_map_update_(self.rest_map, k, g, beta, l2norm=True)

    def reset_boundary(self) -> None:
        """The boundary moves to the live state (after a turn's input rows): ``S_b = S_L = S_live``,
        ``h_b`` = the live conv history, ``M = I``; the leading record is emptied by the suffix length 0."""
        self.boundary_state.copy_(self.state)
        self.leading_state.copy_(self.state)
        self.boundary_conv.copy_(self.conv)
        self.rest_map.copy_(self._eye.expand_as(self.rest_map))


def _split_heads(y: torch.Tensor, params: GDNLayerParams):
    """Conv outputs ``[1, T, C]`` -> ``q, k [1, T, HK, K]`` and ``v [1, T, HV, V]`` (channels ``[q | k | v]``)."""
    bsz, seq, _ = y.shape
    q, k, v = torch.split(y, [params.key_dim, params.key_dim, params.value_dim], dim=-1)
    return (q.reshape(bsz, seq, params.num_k_heads, params.head_k_dim),
            k.reshape(bsz, seq, params.num_k_heads, params.head_k_dim),
            v.reshape(bsz, seq, params.num_v_heads, params.head_v_dim))


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
        # every slot invisible again: what an earlier conversation left in the KV tensors is unreachable
        self.slot_keys.fill_(MAX_KEY)
        for state in self.gdn.values():  # a new conversation starts from zero states, as on a fresh cache
            state.zero_()
        self._user = weakref.ref(cache)
        return self

    def release(self) -> None:
        self._user = None

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

    is_static = True

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
