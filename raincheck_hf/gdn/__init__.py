"""Gated DeltaNet deferral (docs/method.md §4): everything that joins deferred rows into a GDN layer's state.

Qwen3.5's linear-attention layers carry a recurrent state instead of KV rows, so a deferred chunk cannot be
masked in: it runs from the insertion boundary and the live state is corrected by the state-difference
identity. The package, from the math up (each module imports only those above it):

- `algebra`: the reference, pure functions and `GDNLayerParams` (no state, no kernels): the delta rule, the
  suffix map ``M_R``, the join, the short convolution, the leading-segment repair; its module docstring states
  the join precisely.
- `kernels` (+ `_triton`): the hot operations in place, one launch per layer each on CUDA, each wrapper beside
  (and falling back to) its reference in `algebra`.
- `suffix_map`: `SuffixStateMap`, one layer's record (S_b, h_b, leading segment, M_R) for the eager engine.
- `state`: `GDNState`, the steps a layer forward runs on a layer's state (run the chunk, join, run the rest,
  record, reset the boundary).
- `eager`: `EagerGDNState` on a `DeferredDynamicCache` (HF's cache layer plus its `SuffixStateMap`);
  `static`: `StaticGDNState`, fixed buffers of the fast path's static cache.
- `dispatch`: the layer forward of each engine (eager, fast-path step, packed batch), installed per module
  instance for the calling thread only; a model adapter (`models/qwen3_5.py`) enters it once per forward.

Following one hidden state: `dispatch._split_gdn_forward` -> `EagerGDNState.run_chunk` / ``join`` ->
`SuffixStateMap.join` -> `algebra.repair_leading_segment` and `kernels.join_` (reference `algebra.join_state`);
on the fast path `dispatch._static_gdn_forward` -> `StaticGDNState.run_chunk` / ``join`` -> `kernels`.
"""

from .state import GDNState

__all__ = ["GDNState"]
