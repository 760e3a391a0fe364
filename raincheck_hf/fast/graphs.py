"""Executing forwards on a `StaticDeferredCache`: eager, or replaying a captured CUDA graph.

A forward's inputs live in static buffers of a fixed row count ``L``: embeddings ``[1, L, D]``,
3-D positions ``[3, 1, L]``, query keys ``[L]``, slots ``[L]`` and one DeepStack addend
``[1, L, D]`` per DeepStack layer (zero on rows without features). The step computes visibility
from the cache's slot keys, runs the stock text model with that 4-D mask and the cache, and writes
the last row's logits into a buffer. Shapes captured: ``L = 1`` (decode), ``L = c + 1`` (a chunk of
``c`` padded rows fused with the decode token) and ``L = c`` (an idle-time chunk); the padding rows
sit between the real chunk rows and the decode token, write to scratch slots, and are invisible to
every real query (their slot keys stay at the maximum).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from ..masking import visibility_to_attention_mask
from .static_cache import MAX_KEY, StaticDeferredCache


@dataclass
class StepBuffers:
    embeds: torch.Tensor
    positions: torch.Tensor
    query_keys: torch.Tensor
    slots: torch.Tensor
    deepstack: list[torch.Tensor]
    logits: torch.Tensor | None = None

    @classmethod
    def empty(cls, rows: int, hidden: int, num_deepstack: int, dtype, device):
        return cls(
            torch.zeros(1, rows, hidden, dtype=dtype, device=device),
            torch.zeros(3, 1, rows, dtype=torch.long, device=device),
            torch.full((rows,), MAX_KEY, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            [torch.zeros(1, rows, hidden, dtype=dtype, device=device) for _ in range(num_deepstack)],
        )


@contextlib.contextmanager
def deepstack_hooks(text_model, addends: list[torch.Tensor]):
    """Add ``addends[i]`` to decoder layer i's output (what DeepStack does, as a graph-safe add)."""
    handles = [
        text_model.layers[i].register_forward_hook(lambda module, args, output, a=a: output + a)
        for i, a in enumerate(addends)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def fill(buffers: StepBuffers, cache: StaticDeferredCache, batch, keys: torch.Tensor, slots: torch.Tensor,
         pad_at: int, padding: int) -> None:
    """Copy a forward's rows into ``buffers``: real rows, ``padding`` zero rows inserted at ``pad_at``."""
    n = batch.embeds.shape[0]
    order = torch.arange(n)
    dest = torch.where(order < pad_at, order, order + padding).to(buffers.embeds.device)
    buffers.embeds.zero_()
    buffers.embeds[0, dest] = batch.embeds.to(buffers.embeds.dtype)
    buffers.positions.zero_()
    buffers.positions[:, 0, dest] = batch.positions
    buffers.query_keys.fill_(MAX_KEY)
    buffers.query_keys[dest] = keys.to(buffers.query_keys.device)
    real_slots, pad_slots = slots[:n], slots[n:]
    buffers.slots[dest] = real_slots
    if padding:
        pad_dest = torch.arange(pad_at, pad_at + padding, device=buffers.slots.device)
        buffers.slots[pad_dest] = pad_slots
    visual_dest = dest[batch.visual.to(dest.device)]
    for addend, layer in zip(buffers.deepstack, batch.deepstack or []):
        addend.zero_()
        addend[0, visual_dest] = layer.to(addend.dtype)
    if batch.deepstack is None:
        for addend in buffers.deepstack:
            addend.zero_()


class StepGraphs:
    """Captured steps for one cache (graphs point at its buffers)."""

    def __init__(self, adapter, cache: StaticDeferredCache, use_graphs: bool):
        self.adapter, self.cache = adapter, cache
        self.use_graphs = use_graphs and torch.cuda.is_available() and adapter.device.type == "cuda"
        self.text_model = adapter.text_model
        self.num_deepstack = len(getattr(adapter.config.vision_config, "deepstack_visual_indexes", []) or [])
        self.hidden = self.text_model.config.hidden_size
        self._captured: dict[tuple[int, bool], tuple] = {}
        self._pool = None
        self.capture_seconds = 0.0

    # the step itself: identical in eager and captured form
    def _step(self, buffers: StepBuffers, want_logits: bool):
        cache = self.cache
        cache.current_slots = buffers.slots
        visible = cache.slot_keys[None, :] <= buffers.query_keys[:, None]
        mask = visibility_to_attention_mask(visible, self.adapter.attn_implementation, self.adapter.dtype)
        with deepstack_hooks(self.text_model, buffers.deepstack):
            hidden = self.text_model(inputs_embeds=buffers.embeds, position_ids=buffers.positions,
                                     attention_mask=mask, cache=cache, use_cache=True).last_hidden_state
        if want_logits:
            logits = self.adapter.lm_head(hidden[:, -1])
            if buffers.logits is None:
                buffers.logits = logits
            else:
                buffers.logits.copy_(logits)
        return buffers.logits

    def _capture(self, rows: int, want_logits: bool):
        import time

        t0 = time.perf_counter()
        buffers = StepBuffers.empty(rows, self.hidden, self.num_deepstack, self.adapter.dtype, self.adapter.device)
        # warm-up and capture write only scratch slots, with keys that no real query can see
        buffers.slots.copy_(torch.arange(self.cache.capacity, self.cache.capacity + rows, device=buffers.slots.device))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(buffers, want_logits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(buffers, want_logits)
        self._pool = graph.pool()
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        self._captured[(rows, want_logits)] = (graph, buffers)
        return graph, buffers

    def run(self, batch, keys, sources, kinds, want_logits: bool, pad_to: int | None = None):
        """One forward; ``pad_to`` pads the leading deferred rows to that many (fixed-shape capture)."""
        cache = self.cache
        n = batch.embeds.shape[0]
        n_deferred = int((kinds == 1).sum())
        padding = 0 if pad_to is None else max(pad_to - n_deferred, 0)
        rows = n + padding
        if padding > cache.scratch:
            raise RuntimeError(f"padding {padding} exceeds the cache's scratch slots {cache.scratch}")
        slots = cache.assign_slots(keys, sources, kinds, padding=padding)
        key = (rows, want_logits)
        if self.use_graphs and (key in self._captured or pad_to is not None or n == 1):
            captured = self._captured.get(key)
            if captured is None:
                try:
                    captured = self._capture(rows, want_logits)
                except RuntimeError as error:  # e.g. an op that cannot be captured: run this shape eagerly
                    warnings.warn(f"raincheck fast path: CUDA-graph capture of a {rows}-row step failed ({error}); "
                                  "running it eagerly on the static cache instead.", RuntimeWarning, stacklevel=2)
                    self.use_graphs = False
            if captured is not None:
                graph, buffers = captured
                fill(buffers, cache, batch, keys, slots, n_deferred, padding)
                graph.replay()
                return buffers.logits.clone() if want_logits else None
        buffers = StepBuffers.empty(rows, self.hidden, self.num_deepstack, self.adapter.dtype, self.adapter.device)
        fill(buffers, cache, batch, keys, slots, n_deferred, padding)
        logits = self._step(buffers, want_logits)
        return logits if want_logits else None
