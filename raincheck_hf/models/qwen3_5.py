"""Qwen3.5 (``Qwen3_5ForConditionalGeneration``): hybrid Gated DeltaNet + gated full attention.

Encoding is shared with Qwen3-VL through `models/mixins.py` (same processor, placeholder tokens,
vision tower API and rope index: `QwenVisionLanguageMixin`, `Qwen3VisionTowerMixin`); the differences:

- **No DeepStack.** Qwen3.5's vision tower returns only ``pooler_output``; the text model takes no
  ``visual_pos_masks`` / ``deepstack_visual_embeds``.
- **Masks per layer type.** The text model accepts a ``{layer_type: mask}`` mapping: the
  ``full_attention`` layers get the 4-D visibility mask of docs/method.md §3 (sdpa: boolean, eager:
  additive, exactly as for Qwen3-VL; HF's gated attention passes it to the attention function
  untouched and only gates the output), the ``linear_attention`` layers get None (they have no
  padding to zero; their "visibility" is the recurrent state itself).
- **Gated DeltaNet deferral** (docs/method.md §4, §5): every forward's rows are ``[deferred chunk
  (optional), rest]``, and the GDN layers place the chunk at the insertion boundary and join it into
  their live state. All of that is `raincheck_hf.gdn`: the algebra (`gdn.algebra`), the eager and
  static states (`gdn.eager`, `gdn.static`), the kernels (`gdn.kernels`) and the layer dispatch
  (`gdn.dispatch`), which this adapter enters once per engine forward (`forward`), fast-path step
  (`static_step`) or packed forward (`packed_step`). What is Qwen3.5's own here: which layers are GDN
  layers (``config.layer_types``), their module (``decoder_layer.linear_attn``), its head split and conv
  width (`static_recurrent_layout`, `static_step_variant`) and the modeling file whose kernels
  `gdn.dispatch.check_state_layout` checks.
"""

from __future__ import annotations

import torch

from ..batched_gdn import PackedGDNStates
from ..cache_utils import GENERATED, INPUT
from ..gdn import dispatch
from ..gdn.dispatch import (RECURRENT_CHUNK_MAX, ProbeLayout, RowSplit, StaticSplit, check_state_layout,
                            layer_params)
from ..gdn.eager import deferred_linear_layer
from ..gdn.static import RecurrentLayout
from ..masking import visibility_to_attention_mask
from .base import ModelAdapter, RowBatch
from .mixins import Qwen3VisionTowerMixin, QwenVisionLanguageMixin

__all__ = ["GatedDeltaNetMixin", "Qwen3_5Adapter"]


class GatedDeltaNetMixin:
    """Text models of Gated DeltaNet + gated full-attention layers (Qwen3.5, dense and MoE): the GDN split
    forward of `gdn.dispatch`. The MLP (dense or mixture of experts) needs nothing: it is per token."""

    has_linear_attention = True
    # The fast path keeps the GDN layers' states (live, boundary, suffix map, leading record) in the static
    # cache's buffers (`gdn.static.StaticGDNState`) and the gated attention layers in its KV slots.
    supports_fast_path = True
    static_layer_types = ("full_attention", "linear_attention")
    # A prefill of input rows only (every turn 1; a later turn whose deferred rows are all restored) is padded
    # in front to its bucket and captured: padding gets ``g = 0, beta = 0`` and the conv history is moved past
    # it (`StaticGDNState.run_input`). A prefill that carries leftover deferred rows in front is padded between
    # them and its input rows (the chunk step's layout) and runs eagerly: its split point varies.
    bucketed_prefill = True

    def __init__(self, model):
        super().__init__(model)
        layer_types = self.text_model.config.layer_types
        self._gdn_modules = [layer.linear_attn for layer, kind in zip(self.text_model.layers, layer_types)
                             if kind == "linear_attention"]
        self._layout_checked = None  # the (device type, dtype) the kernels were last checked at

    def _check_state_layout(self) -> None:
        if not self._gdn_modules:
            return
        where = (self.device.type, self.dtype)
        if where == self._layout_checked:
            return
        from ..fast.autotune_ahead import compiling_configs_ahead

        module = self._gdn_modules[0]
        # the kernels of the GDN layer's own modeling file (Qwen3.5 or Qwen3.5-MoE); on CUDA the probe is where fla
        # first tunes its kernels for this model's key: their configurations compiled side by side and timed
        # briefly, as in `warm_up` (inside one, this adds nothing), also for a first `generate` without it
        with compiling_configs_ahead(enabled=where[0] == "cuda"):
            check_state_layout(where[0], type(module).__module__, ProbeLayout.of(module, where[1]))
        self._layout_checked = where

    # ---- one forward over arbitrary rows --------------------------------------------------
    def forward(self, cache, batch: RowBatch, visible: torch.Tensor | None, want_logits: bool = True, kinds=None):
        """Run ``batch`` on ``cache``; logits of its last row (``[1, V]``) or None.

        ``visible`` (``[L, n_rows]`` from `DeferredDynamicCache.add_rows`, None = plain causal) drives
        the full-attention layers; ``kinds`` (``[L]``, deferred rows first) drives the GDN layers.
        """
        split = RowSplit.from_kinds(kinds, batch.embeds.shape[0])
        self._check_state_layout()
        mask = None
        if visible is not None:
            full = visibility_to_attention_mask(visible.to(self.device), self.attn_implementation, self.dtype)
            mask = {"full_attention": full, "linear_attention": None}
        with dispatch.eager_forward(self._gdn_modules, cache, split):
            return self.run_text_model(cache, batch, mask, want_logits)

    # ---- the fast path ------------------------------------------------------------------------
    def static_recurrent_layout(self):
        if not self._gdn_modules:
            return None
        m = self._gdn_modules[0]
        return RecurrentLayout(tuple(x.layer_idx for x in self._gdn_modules), m.num_k_heads, m.num_v_heads,
                               m.head_k_dim, m.head_v_dim, m.conv_kernel_size, m.in_proj_qkv.weight.dtype)

    def text_attention_mask(self, mask):
        return {"full_attention": mask, "linear_attention": None}

    def static_step_variant(self, kinds, pending_after: int, suffix_length: int) -> StaticSplit:
        split = RowSplit.from_kinds(kinds, int(kinds.shape[0]))
        if split.rest_kind == INPUT and not split.n_deferred:
            return StaticSplit(0, INPUT, padded_input=True)
        record = None
        if split.rest_kind == GENERATED and pending_after > 0:
            width = self.text_model.config.linear_conv_kernel_dim - 1
            record = "lead" if suffix_length < width else "map"
        return StaticSplit(split.n_rest, split.rest_kind, record)

    def capturable(self, variant: StaticSplit, rows: int) -> bool:
        # a prefill of input rows only is captured per bucket; one with leftover deferred rows in front runs
        # eagerly (its split point varies), and so do chunks too long for the recurrent rule
        if variant.padded_input:
            return True
        return variant.rest_kind != INPUT and rows - variant.n_rest <= RECURRENT_CHUNK_MAX

    # ---- the batched eager engine (`batched.py`) ------------------------------------------------------
    def packed_states(self, batch: int):
        return PackedGDNStates(batch)

    def make_packed_layers(self, states) -> None:
        for module in self._gdn_modules:  # (the dtype and device its projections give the packed forward)
            weight = module.in_proj_qkv.weight
            states.layer(module.layer_idx, dispatch.layer_params(module), weight.dtype, weight.device)

    def packed_step(self, states, layouts):
        self._check_state_layout()
        return dispatch.packed_step(self._gdn_modules, states, layouts)

    def static_packed_step(self, states, step, chunks: bool, record: bool, prefill: bool = False,
                           dense: bool = False):
        """The GDN layers of a captured batched step (`fast.batched_graphs`) on the per-slot ``states``."""
        self._check_state_layout()
        return dispatch.static_packed_step(self._gdn_modules, states, step, chunks, record, prefill, dense)

    def export_packed_states(self, states, indices: list[int], caches: list) -> None:
        rows = list(indices)
        index = states.row_index(rows)  # (once for every layer)
        for module in self._gdn_modules:  # (a gathered copy per state tensor and layer for all of them)
            states.layers[module.layer_idx].export_rows(
                rows, [deferred_linear_layer(cache, module.layer_idx) for cache in caches], layer_params(module), index)

    def load_packed_state(self, states, index: int, cache) -> None:
        for module in self._gdn_modules:
            params = layer_params(module)
            state = states.layer(module.layer_idx, params, module.in_proj_qkv.weight.dtype, self.device)
            state.load(index, deferred_linear_layer(cache, module.layer_idx), params)

    def static_step(self, cache, step_info, variant: StaticSplit):
        self._check_state_layout()
        return dispatch.static_step(self._gdn_modules, cache, step_info, variant)


class Qwen3_5Adapter(GatedDeltaNetMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin, ModelAdapter):
    """Qwen3.5 through public seams (see the module docstring)."""

    model_classes = ("Qwen3_5ForConditionalGeneration",)
