"""The CUDA fast path: the same plan, scheduler and trace as the eager engine, other execution.

- `StaticDeferredCache`: KV buffers preallocated for the whole conversation (every deferred row
  has its slot reserved, so restoring it allocates nothing) plus a scratch region for padding;
  visibility is computed on the device from a per-slot key buffer.
- `StepGraphs`: CUDA-graph capture of the plain decode step, of the fused ``[chunk, decode]``
  step at a fixed chunk shape (the last chunk is padded, the padding masked) and of the idle-time
  chunk-only step; DeepStack features enter through forward hooks on the first decoder layers
  (a plain add of a static buffer, which a graph can hold) instead of boolean indexing.

The eager engine stays the reference: tests compare the two step by step.
"""

from .static_cache import StaticDeferredCache, StaticDeferredLayer

__all__ = ["StaticDeferredCache", "StaticDeferredLayer"]
