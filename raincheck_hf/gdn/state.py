"""`GDNState`: what a Gated DeltaNet layer's deferral state offers the layer forward (`gdn.dispatch`).

One GDN layer forward over rows ``[deferred chunk, rest]`` (the rest: a turn's input rows or one generated row)
does, on either engine, the five steps of docs/method.md §4:

1. ``run_chunk``: the deferred rows from the insertion boundary ``(S_b, h_b)``, which becomes ``(S_b', h_b')``;
2. ``join``: the live state corrected by ``S_live += M_R (S_L' - S_L)`` (the leading segment recomputed from
   ``h_b'``), the live conv window with it; the boundary moves past the chunk;
3. ``run_rest``: the rest from the (corrected) live state;
4. after a generated row, ``record`` it into the suffix (a leading-segment token, or ``M_R <- A_t M_R``) while
   deferred rows wait; or
5. after input rows, ``reset_boundary``: the boundary moves to the live state (``M_R = I``).

The two implementations share those steps and differ in what a step is given, because they run the rows
differently:

- `gdn.eager.EagerGDNState` (eager engine, `DeferredDynamicCache`): the rows run through transformers' own
  module forward, so ``run_chunk`` / ``run_rest`` take that forward as a callable of a cache-like object (a
  `BoundaryStateView` for the chunk, the cache for the rest), ``join`` takes nothing and ``record`` the rows'
  ``in_proj_qkv`` / ``in_proj_a`` / ``in_proj_b`` outputs;
- `gdn.static.StaticGDNState` (fast path, `StaticDeferredCache`): fixed buffers changed in place by
  `gdn.kernels`, so the steps take pre-conv inputs and gates, and the counts a captured graph cannot bake in
  (real chunk rows, suffix length) as device scalars.

So the protocol fixes the steps and their order, not their arguments (a static type check sees the step names;
each implementation documents its own arguments).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["GDNState"]


@runtime_checkable
class GDNState(Protocol):
    """One GDN layer's state of docs/method.md §4, as the layer forward drives it (see the module docstring)."""

    def run_chunk(self, *args, **kwargs) -> torch.Tensor:
        """Deferred rows from the boundary; their output rows. The boundary becomes ``(S_b', h_b')``."""
        ...

    def join(self, *args, **kwargs) -> None:
        """After `run_chunk`: correct the live state and conv window; the boundary moves past the chunk."""
        ...

    def run_rest(self, *args, **kwargs):
        """The rows after the boundary from the live state; their output rows (and what `record` needs)."""
        ...

    def record(self, *args, **kwargs) -> None:
        """After a generated row: extend the suffix's record (leading segment or ``M_R``)."""
        ...

    def reset_boundary(self) -> None:
        """After input rows: the boundary moves to the live state, the suffix is empty."""
        ...
