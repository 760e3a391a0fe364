"""`DeferredDynamicCache`: a `DynamicCache` that knows which rows are input, deferred or generated.

Rows are stored in the order forwards append them (``[T∪S] y1 … yg [chunk1, y(g+1)] …``), which
is not the order the method reasons in. Method.md §3 puts deferred tokens *after the last input
token and before the first generated token* of their turn. Every row therefore carries an
**order key**, its place in that logical physical order,

    key = (turn, segment, index)   with segment 0 = input (T ∪ S), 1 = deferred, 2 = generated,

packed into one int64, and attention visibility is simply causality in key order: a query sees
the cached rows whose key is not larger than its own. That single rule gives all of §3 and §6:

- a deferred chunk sees the input of its turn, earlier chunks, itself causally, and every earlier
  turn; never a generated token of its own turn (segment 2 > segment 1);
- a decode token sees all input, every chunk restored so far and earlier generated tokens;
- a later turn sees everything before it, so restored deferred tokens of earlier turns count.

Rows not yet in the cache are not visible to anyone, which gives "chunks processed so far".

The cache also holds the *pending* deferred rows (their input embeddings, DeepStack features,
3-D positions and keys), so restoration can continue after `generate` returns, in idle time or
at the next turn, and the conversation-level source accounting (`source_ids`, `next_position`)
that lets a follow-up `generate` call pass the whole conversation as HF does.

Gated DeltaNet layers (Qwen3.5) keep no rows: their cache layers and insertion boundaries are
`raincheck_hf.gdn.eager`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import DynamicCache

INPUT, DEFERRED, GENERATED = 0, 1, 2
_SEGMENT_BITS = 40
_TURN_BITS = 42


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a small host tensor goes to a GPU through pinned memory, without waiting for the
    device's queue (a plain ``.to(cuda)`` of pageable memory syncs, which stalls a decode loop every step)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def hold_rows(cache: DynamicCache, kv: dict) -> None:
    """Each empty layer ``i`` of ``cache`` holds ``kv[i] = (keys, values)``, copied into one new block of memory for
    all of them (``[2 * layers, ...]``: each layer's keys and values are views of it) when their shapes and dtypes
    agree, else each pair copied on its own (`DynamicLayer.update`). One allocation per cache, not two per layer: when a
    held cache is dropped (a server's eviction), its memory comes back in one piece that the next cache of any size can
    use, where tensors of a few MB each would leave holes among the caches still held (the CUDA caching allocator
    carves allocations under 10 MB out of shared 20-MB segments)."""
    pairs = [(i, k, v) for i, (k, v) in kv.items()]
    if not pairs:
        return
    first = pairs[0][1]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
           for _, k, v in pairs for t in (k, v)):
        for i, k, v in pairs:
            cache.update(k, v, i)
        return
    block = torch.stack([t for _, k, v in pairs for t in (k, v)])
    for j, (i, k, v) in enumerate(pairs):
        layer = cache.layers[i]
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = block[2 * j], block[2 * j + 1]


def to_device_all(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``, the host ones of a GPU step moved together: one pinned buffer, one non-blocking
    copy (where `to_device` one by one would make a copy each). Those already there pass through. The host tensors
    share one dtype (the engine's index and key tensors, int64); otherwise each goes through `to_device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" names the current device: tensors say "cuda:N"
        device = torch.device("cuda", torch.cuda.current_device())
    moving = [i for i, t in enumerate(tensors) if t.device != device]
    out = list(tensors)
    if not moving:
        return out
    if (device.type != "cuda" or len(moving) == 1 or any(tensors[i].device.type != "cpu" for i in moving)
            or len({tensors[i].dtype for i in moving}) > 1):
        return [to_device(t, device) for t in tensors]
    moved = to_device(torch.cat([tensors[i].reshape(-1) for i in moving]), device)
    offset = 0
    for i in moving:
        n = tensors[i].numel()
        out[i] = moved[offset:offset + n].view(tensors[i].shape)
        offset += n
    return out


def order_key(turn: int, segment: int, index: torch.Tensor | int) -> torch.Tensor:
    """Pack (turn, segment, index) into sortable int64 keys (index < 2**40, turn < 2**21)."""
    index = torch.as_tensor(index, dtype=torch.long)
    return (turn << _TURN_BITS) + (segment << _SEGMENT_BITS) + index


def order_key_int(turn: int, segment: int, index: int) -> int:
    """`order_key` of one row as a host int (the same packing, no tensor: for keys made in bulk on the host)."""
    return (int(turn) << _TURN_BITS) + (int(segment) << _SEGMENT_BITS) + int(index)


@dataclass
class PendingRows:
    """Deferred rows waiting to be prefilled, in source order.

    Shapes: ``embeds [n, D]``, ``positions [3, n]`` (M-RoPE t/h/w ids), ``keys [n]``, ``sources [n]``
    (positions in the conversation's token sequence), ``deepstack`` a list (one per DeepStack
    layer) of ``[n, D]`` or None for models without DeepStack.
    """

    embeds: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    sources: torch.Tensor
    deepstack: list[torch.Tensor] | None

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def split(self, n: int) -> tuple["PendingRows", "PendingRows"]:
        """``(the first n rows, the rest)``; the rest is a `_PendingTail` (its fields sliced when first read: a decode
        step reads only the chunk it takes, and the rest is split again at the next step)."""
        return self._rows(0, n), _PendingTail(self, n)

    def _rows(self, start: int, stop: int) -> "PendingRows":
        return PendingRows(
            self.embeds[start:stop], self.positions[:, start:stop], self.keys[start:stop], self.sources[start:stop],
            None if self.deepstack is None else [d[start:stop] for d in self.deepstack],
        )

    @staticmethod
    def concat(parts: list["PendingRows"]) -> "PendingRows":
        parts = [p for p in parts if p is not None and len(p)]
        if len(parts) == 1:
            return parts[0]
        return PendingRows(
            torch.cat([p.embeds for p in parts]),
            torch.cat([p.positions for p in parts], dim=1),
            torch.cat([p.keys for p in parts]),
            torch.cat([p.sources for p in parts]),
            None if parts[0].deepstack is None
            else [torch.cat(ds) for ds in zip(*[p.deepstack for p in parts])],
        )



class _PendingTail(PendingRows):
    """`PendingRows.split`'s rest: rows ``start:`` of ``base`` (a `PendingRows` whose fields are tensors), each field
    sliced from it when first read and kept; splitting it slices ``base`` directly, so a sequence's pending rows cost
    one set of views per step (its chunk), not two. Equal to ``base``'s rows ``start:`` in every field."""

    def __init__(self, base: PendingRows, start: int):  # (not the dataclass' fields: they are read from ``base``)
        if isinstance(base, _PendingTail):
            base, start = base._base, base._start + start
        self._base, self._start = base, min(start, len(base))
        self._n = len(base) - self._start

    def __len__(self) -> int:
        return self._n

    def split(self, n: int) -> tuple[PendingRows, PendingRows]:
        return self._base._rows(self._start, self._start + n), _PendingTail(self._base, self._start + n)

    def _rows(self, start: int, stop: int) -> PendingRows:
        return self._base._rows(self._start + start, self._start + stop)

    @functools.cached_property
    def embeds(self) -> torch.Tensor:
        return self._base.embeds[self._start:]

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return self._base.positions[:, self._start:]

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        return self._base.keys[self._start:]

    @functools.cached_property
    def sources(self) -> torch.Tensor:
        return self._base.sources[self._start:]

    @functools.cached_property
    def deepstack(self) -> list[torch.Tensor] | None:
        return None if self._base.deepstack is None else [d[self._start:] for d in self._base.deepstack]

class DeferredDynamicCache(DynamicCache):
    """A `DynamicCache` with per-row order keys, source positions and pending deferred rows.

    Attributes:
        row_keys: ``[n_rows]`` order keys of the stored rows, in storage order.
        row_sources: ``[n_rows]`` source positions (index in the conversation's ``input_ids``).
        row_kinds: ``[n_rows]`` INPUT / DEFERRED / GENERATED.
        source_ids: ``[source_length]`` the conversation's token ids this cache accounts for
            (processed, pending or dropped); the next turn's new tokens start after it.
        next_position: the M-RoPE text position the next source token gets.
        turn: number of turns started on this cache.
        dropped: source positions removed for good (``hard`` mode).
    """

    def __init__(self, config=None, device: torch.device | str | None = None, **kwargs):
        super().__init__(config=config, **kwargs)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.row_keys = torch.empty(0, dtype=torch.long, device=device)
        self.row_sources = torch.empty(0, dtype=torch.long)
        self.row_kinds = torch.empty(0, dtype=torch.int8)
        self.source_ids = torch.empty(0, dtype=torch.long)
        self.next_position = 0
        self.turn = 0
        self.dropped = torch.empty(0, dtype=torch.long)
        self._pending: PendingRows | None = None

    # ---- rows -----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.row_keys.shape[0])

    def add_rows(self, keys: torch.Tensor, sources: torch.Tensor, kinds: torch.Tensor | int) -> torch.Tensor:
        """Register the rows the next forward appends, and return their visibility.

        Call once per forward, before it runs; the forward's KV writes then line up with these
        rows. Returns a boolean ``[len(keys), num_rows]`` matrix (after adding): query i may see
        stored row j iff ``row_keys[j] <= keys[i]``.
        """
        keys = self.register_rows(keys, sources, kinds)
        return self.row_keys[None, :] <= keys[:, None]

    def register_rows(self, keys: torch.Tensor, sources: torch.Tensor, kinds: torch.Tensor | int) -> torch.Tensor:
        """The bookkeeping of `add_rows` without the visibility; returns ``keys`` on the cache's device."""
        if self.get_seq_length() != self.num_rows:
            raise RuntimeError(
                f"DeferredDynamicCache holds {self.get_seq_length()} KV rows but accounts for {self.num_rows}: "
                "a forward ran on this cache without add_rows()."
            )
        keys = to_device(keys, self.row_keys.device)
        self.row_keys = torch.cat([self.row_keys, keys])
        self.row_sources = torch.cat([self.row_sources, sources.to("cpu", torch.long)])
        kinds = torch.as_tensor(kinds, dtype=torch.int8).expand(keys.shape[0])
        self.row_kinds = torch.cat([self.row_kinds, kinds.cpu()])
        return keys

    # ---- pending deferred rows ------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return 0 if self._pending is None else len(self._pending)

    @property
    def pending_sources(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long) if self._pending is None else self._pending.sources.cpu()

    def add_pending(self, rows: PendingRows) -> None:
        self._pending = PendingRows.concat([self._pending, rows]) if self._pending is not None else rows

    def take_pending(self, n: int | None = None) -> PendingRows | None:
        """Remove and return the first ``n`` pending rows (all when None), in source order."""
        if self._pending is None or len(self._pending) == 0:
            return None
        if n is None or n >= len(self._pending):
            rows, self._pending = self._pending, None
            return rows
        rows, self._pending = self._pending.split(n)
        return rows

    def peek_pending(self, n: int | None = None) -> PendingRows | None:
        """The rows `take_pending` would return (views), leaving them pending."""
        if self._pending is None or len(self._pending) == 0:
            return None
        if n is None or n >= len(self._pending):
            return self._pending
        return self._pending.split(n)[0]

    # ---- source accounting ----------------------------------------------------------------
    @property
    def source_length(self) -> int:
        return int(self.source_ids.shape[0])

    def extend_source(self, ids: torch.Tensor, next_position: int) -> None:
        self.source_ids = torch.cat([self.source_ids, ids.detach().to("cpu", torch.long)])
        self.next_position = int(next_position)

    def drop(self, sources: torch.Tensor) -> None:
        self.dropped = torch.cat([self.dropped, sources.to("cpu", torch.long)])

    def restored_sources(self) -> torch.Tensor:
        """Source positions of the deferred rows restored so far, in storage order."""
        return self.row_sources[self.row_kinds == DEFERRED]

    def reset(self) -> None:
        super().reset()  # keeps the layer objects, clears their KV
        self.row_keys = self.row_keys[:0]
        self.row_sources = self.row_sources[:0]
        self.row_kinds = self.row_kinds[:0]
        self.source_ids = self.source_ids[:0]
        self.next_position, self.turn = 0, 0
        self.dropped = self.dropped[:0]
        self._pending = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={self.num_rows}, pending={self.num_pending}, "
            f"dropped={int(self.dropped.numel())}, source_length={self.source_length}, turns={self.turn})"
        )
