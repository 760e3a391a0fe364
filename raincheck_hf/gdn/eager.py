"""The eager engine's Gated DeltaNet layer state: HF's cache layer plus the insertion boundary (docs/method.md §4).

HF keeps a GDN layer's *live* state in its `LinearAttentionLayer`: the recurrent state ``[B, HV, K, V]`` (fp32)
and the conv window ``[B, C, Kc]`` of pre-conv inputs. Those stay where HF keeps them and are read and written
only through the cache's public calls (``get_conv_state / update_conv_state / get_recurrent_state /
update_recurrent_state``). What deferral adds per layer is the *insertion boundary* (the state right after the
turn's T ∪ S input): a `SuffixStateMap` (S_b, h_b, the leading segment's record, M_R), kept in
`DeferredLinearAttentionLayer.suffix_map`, next to the live state it corrects.

There is one live boundary per conversation: a turn's prefill first flushes every earlier-turn leftover (those
rows join at the *earlier* boundary, whose suffix is that turn's answer), then runs the new input, after which
the boundary moves there (`EagerGDNState.reset_boundary`, M = I).

`EagerGDNState` is the `gdn.state.GDNState` of a `DeferredDynamicCache`; `gdn.dispatch` drives it.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.cache_utils import LinearAttentionLayer

from .algebra import GDNLayerParams, hf_conv_state_to_history, history_to_hf_conv_state
from .suffix_map import SuffixStateMap

__all__ = ["BoundaryStateView", "DeferredLinearAttentionLayer", "EagerGDNState", "deferred_linear_layer"]


class DeferredLinearAttentionLayer(LinearAttentionLayer):
    """HF's `LinearAttentionLayer` plus the insertion boundary of its GDN layer.

    Attributes:
        suffix_map: the layer's `SuffixStateMap` (None until the first prefill): boundary state and
            conv history, the leading segment's pre-conv record and the suffix map ``M_R``.
    """

    def __init__(self, number_of_states: int = 1, **kwargs):
        super().__init__(number_of_states=number_of_states, **kwargs)
        self.suffix_map: SuffixStateMap | None = None

    def reset(self) -> None:
        super().reset()
        self.suffix_map = None

    def reorder_cache(self, beam_idx: torch.Tensor):
        raise NotImplementedError(
            "DeferredLinearAttentionLayer does not support beam search (reorder_cache): Raincheck decodes one "
            "conversation with num_beams=1."
        )


def deferred_linear_layer(cache, layer_idx: int) -> DeferredLinearAttentionLayer:
    """The cache layer of GDN layer ``layer_idx`` as a `DeferredLinearAttentionLayer`.

    A `DeferredDynamicCache` built from a hybrid config holds HF's plain `LinearAttentionLayer`
    objects; the first Raincheck forward swaps each one, while it is still empty, for the subclass
    (same states, plus the boundary). A plain layer that already holds a state was filled outside
    Raincheck, so its boundary is unknown: that is an error.
    """
    layer = cache.layers[layer_idx]
    if isinstance(layer, DeferredLinearAttentionLayer):
        return layer
    if not isinstance(layer, LinearAttentionLayer):
        raise ValueError(
            f"cache layer {layer_idx} is a {type(layer).__name__}, but the model's layer {layer_idx} is a Gated "
            "DeltaNet (linear_attention) layer: build the cache from the model's text config."
        )
    if any(layer.has_previous_state.values()):
        raise RuntimeError(
            f"cache layer {layer_idx} already holds a Gated DeltaNet state that Raincheck did not write, so its "
            "insertion boundary is unknown; start from an empty DeferredDynamicCache (or the `cache` returned "
            "by an earlier raincheck generate)."
        )
    upgraded = DeferredLinearAttentionLayer(number_of_states=layer.number_of_states)
    cache.layers[layer_idx] = upgraded
    return upgraded


class BoundaryStateView:
    """A stand-in cache for one GDN layer that starts at the boundary ``(S_b, h_b)``.

    Deferred rows run through the stock ``Qwen3_5GatedDeltaNet.forward`` on this object: it offers
    the calls that forward makes (``get_conv_state``, ``get_recurrent_state``, ``update_conv_state``,
    ``update_recurrent_state``, ``is_recording_past``) for ``layer_idx`` only, backed by a private
    HF `LinearAttentionLayer` seeded with copies of the boundary, so HF's own conv-window and state
    semantics apply. Afterwards it holds ``(S_b', h_b')``.
    """

    def __init__(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor):
        self.layer_idx = layer_idx
        self._layer = LinearAttentionLayer()
        self._layer.update_conv_state(conv_state.clone())  # first update: stores the window as given
        self._layer.update_recurrent_state(recurrent_state)  # copies

    def _check(self, layer_idx: int) -> None:
        if layer_idx != self.layer_idx:
            raise RuntimeError(f"BoundaryStateView of layer {self.layer_idx} used for layer {layer_idx}.")

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        self._check(layer_idx)
        return self._layer.conv_states[state_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        self._check(layer_idx)
        return self._layer.recurrent_states[state_idx]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check(layer_idx)
        return self._layer.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check(layer_idx)
        return self._layer.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


class EagerGDNState:
    """Method.md §4 for one GDN layer of a `DeferredDynamicCache`, for one forward (a `gdn.state.GDNState`).

    The rows run through the stock module forward (``run(cache_like) -> output``, the caller's closure over the
    module and the rows); per forward of rows ``[deferred chunk (optional), rest (input rows or one generated
    row)]``:

    1. ``run_chunk(run)``: the chunk on a `BoundaryStateView` (from S_b, h_b);
    2. ``join()``: correct the live state by the state-difference identity with the leading-segment repair
       (`SuffixStateMap.join`) and write it, and the live conv window, back into the cache; the boundary moves
       past the chunk;
    3. ``run_rest(run)``: the rest on the cache as usual (from the corrected live state); then
       ``record(mixed_qkv, a, b)`` for a generated row (the suffix grows, ``M_R <- A M_R``), or
       ``reset_boundary()`` after input rows (the boundary moves after them, ``M_R = I``).

    Args:
        cache: the `DeferredDynamicCache`.
        layer_idx: the GDN layer's index (``module.layer_idx``).
        params: the layer's conv / gate parameters (`GDNLayerParams.from_module`).
    """

    def __init__(self, cache, layer_idx: int, params: GDNLayerParams):
        self.cache = cache
        self.layer_idx = layer_idx
        self.params = params
        self.layer = deferred_linear_layer(cache, layer_idx)
        self._view: BoundaryStateView | None = None

    def _map(self) -> SuffixStateMap:
        smap = self.layer.suffix_map
        if smap is None:
            raise RuntimeError(
                f"GDN layer {self.layer_idx}: deferred rows arrived before any input was prefilled on this cache, "
                "so there is no boundary to insert them at."
            )
        return smap

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        conv = self.cache.get_conv_state(self.layer_idx)
        state = self.cache.get_recurrent_state(self.layer_idx)
        if conv is None or state is None:
            raise RuntimeError(f"GDN layer {self.layer_idx} has no live state yet (no prefill ran on this cache).")
        return conv, state

    def run_chunk(self, run: Callable[[BoundaryStateView], torch.Tensor]) -> torch.Tensor:
        """Run deferred rows from the boundary: ``run`` gets a `BoundaryStateView`, which holds S_b', h_b' after."""
        smap = self._map()
        conv = history_to_hf_conv_state(smap.boundary_conv_history, self.params.kernel_size)
        self._view = BoundaryStateView(self.layer_idx, conv, smap.boundary_state)
        return run(self._view)

    def join(self) -> None:
        """Insert what `run_chunk` ran at the boundary: correct the live state and conv window in place."""
        if self._view is None:
            raise RuntimeError(f"GDN layer {self.layer_idx}: join() without a run_chunk() before it.")
        view, self._view = self._view, None
        smap = self._map()
        conv, live = self._live()
        k = self.params.kernel_size
        new_state = view.get_recurrent_state(self.layer_idx)
        new_history = hf_conv_state_to_history(view.get_conv_state(self.layer_idx), k)
        joined = smap.join(new_state, new_history, live)
        self.cache.update_recurrent_state(joined.to(live.dtype), self.layer_idx)  # copies in place
        conv.copy_(history_to_hf_conv_state(smap.live_conv_history, k).to(conv.dtype))  # keeps HF's address

    def run_rest(self, run: Callable[[object], torch.Tensor]) -> torch.Tensor:
        """Run the rows after the boundary on the cache itself (from the live state)."""
        return run(self.cache)

    def record(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Record suffix tokens that just ran (``[B, n, C]`` pre-conv, ``[B, n, HV]`` gate inputs)."""
        self._map().append_suffix(mixed_qkv, a, b)

    def reset_boundary(self) -> None:
        """The boundary is now the live state (call after a forward's input rows ran)."""
        conv, state = self._live()
        if self.layer.suffix_map is None or self.layer.suffix_map.params is not self.params:
            self.layer.suffix_map = SuffixStateMap(self.params)
        self.layer.suffix_map.reset_boundary(state, hf_conv_state_to_history(conv, self.params.kernel_size))
