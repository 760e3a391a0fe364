"""The CUDA fast path: the same plan, scheduler and trace as the eager engine, other execution.

- `StaticDeferredCache`: KV buffers preallocated for the whole conversation (every deferred row
  has its slot reserved, so restoring it allocates nothing) plus a scratch region for padding;
  visibility is computed on the device from a per-slot key buffer.
- `SlotStorage`: the KV tensors, slot keys, Gated DeltaNet state buffers (`gdn.static.StaticGDNState`: live,
  boundary and leading-segment states, the suffix map, conv histories; Qwen3.5) and captured graphs;
  pooled per model, so a later conversation of the same size reuses them instead of capturing again
  (`release_storage` frees them).
- the per-step GDN operations (recurrent step, suffix-map update, join, short convolution) run in place on
  those buffers through `raincheck_hf.gdn.kernels`: on CUDA Triton kernels (one launch per layer each), on
  CPU the references of `gdn.algebra`.
- `StepGraphs`: CUDA-graph capture of the plain decode step, of the fused ``[chunk, decode]``
  step at a fixed chunk shape (the last chunk is padded, the padding masked; GDN layers gate it off
  by a real-row count on the device), of the idle-time chunk-only step and of prefills padded to
  64-row buckets (a prefill carrying leftover deferred rows of a GDN family runs eagerly), each per slot bucket (a step
  attends over the slots in use rounded up on a geometric ladder, `static_cache.slot_bucket`, not over
  the whole storage); DeepStack features enter through forward hooks on the first decoder layers
  (a plain add of a static buffer, which a graph can hold) instead of boolean indexing.
- `StaticRunner` (`runner`): the fast path's side of the engine interface (`raincheck_hf.runner.Runner`): it runs
  the rows the scheduler decided with these captured steps and answers the scheduler from them (step costs,
  captures, room); `raincheck_hf.runner.open_runner` picks it where the static cache is made.
- `timing`: the captured steps' device times (CUDA events, read without waiting) and the wall time of
  their captures, the costs `chunk_size="auto"` schedules with (`generation.auto_chunk_size`).
- `compiled`: ``compile_steps`` (by default on wherever the steps are captured, i.e. on CUDA) runs the
  decoder layers' norms and MLPs and the few-query attention's core as `torch.compile`d functions inside
  the captured steps (element-wise work fused).
- `scoping`: those hooks and the few-query attention act only for the thread running the step
  (a context variable; the shared modules and config look stock to every other thread), and graph
  captures are serialised (`CAPTURE_LOCK`), so chats in several threads can share one model; a capture
  also waits for a batching loop's iteration and its turns' preparations to end (`device_work`, the
  shared side of the same `DeviceGate`), and they for it.
- `few_query_attention` (`attention`): inside captured steps of ``sdpa`` models, attention for a
  decode token or a fused chunk as two batched matmuls over the key/value heads (stock SDPA's
  masked kernel was ~2 ms of a 10 ms decode step on the H200); prefills keep stock SDPA.
- `VisionGraphs` (`vision_graphs`): the vision tower captured per image / video grid, its grid
  bookkeeping precomputed by the family's adapter (a grid is captured on its second sighting; every family
  with ``supports_vision_graphs``); its forwards there rotate each block's queries and keys in one Triton kernel
  (`vision_attention`: bit for bit the stock rotation, ~7 ms less of Qwen3-VL-8B's tower on an H100).

The eager engine stays the reference: tests compare the two step by step.
"""

from .static_cache import SlotStorage, StaticDeferredCache, StaticDeferredLayer, release_storage
from .vision_graphs import VisionGraphs, release_vision_graphs, vision_graphs_for

__all__ = ["SlotStorage", "StaticDeferredCache", "StaticDeferredLayer", "VisionGraphs", "release_storage",
           "release_vision_graphs", "vision_graphs_for"]
