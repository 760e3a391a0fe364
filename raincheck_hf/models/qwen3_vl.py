"""Qwen3-VL (``Qwen3VLForConditionalGeneration``) through public seams: the vision tower's outputs, input
embeddings, explicit 3-D positions, DeepStack arguments of the text model, a 4-D mask and the cache layer API.

Nothing here copies modeling code. One forward over arbitrary rows is a call of the text model
(`model.model.language_model`) with ``inputs_embeds``, ``position_ids`` of shape ``[3, 1, L]``
(M-RoPE t/h/w), ``visual_pos_masks``/``deepstack_visual_embeds`` restricted to the rows of this
forward (so DeepStack features are added only for the visual rows actually prefilled), and a
4-D mask, which transformers passes to attention untouched.

With ``RaincheckConfig.compile_steps`` the fast path runs each decoder layer as `fused_decoder_layer`:
the layer's own modules called in the layer's order, cut in two compiled regions around the cache write
and the attention (which stay as they are), so that Inductor fuses the norms, the rotary embedding, the
activation and the residual adds; the tests compare it with the stock layer step by step.
"""

from __future__ import annotations

from ..patching import module_function
from .base import ModelAdapter
from .mixins import DeepStackMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin


def _attention_inputs(layer, hidden_states, cos, sin, rotary):
    """A Qwen3-VL decoder layer up to its cache write: ``(q, k, v)`` ``[B, heads, L, head_dim]`` after the input
    norm, the projections, the query / key norms and the rotary embedding (compiled)."""
    attn = layer.self_attn
    normed = layer.input_layernorm(hidden_states)
    shape = (*normed.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(normed).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(normed).view(shape)).transpose(1, 2)
    v = attn.v_proj(normed).view(shape).transpose(1, 2)
    q, k = rotary(q, k, cos, sin)
    return q, k, v


def _layer_output(layer, residual, attn_output):
    """The rest of the layer after attention: output projection, residual, post-attention norm, MLP, residual."""
    hidden = residual + layer.self_attn.o_proj(attn_output.reshape(*residual.shape[:-1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


# the regions' row dimensions (`fast.compiled.mark_rows`): the hidden states, cos and sin ``[B, L, ...]`` and the
# attention output ``[B, L, heads, head_dim]`` count rows in their first two (sequences and rows per sequence)
_INPUT_ROWS = {1: (0, 1), 2: (0, 1), 3: (0, 1)}
_OUTPUT_ROWS = {1: (0, 1), 2: (0, 1)}


def fused_decoder_layer(layer, hidden_states, position_embeddings, attention_mask=None, position_ids=None,
                        cache=None, use_cache=False, **kwargs):
    """A Qwen3-VL text decoder layer (the stock forward's arguments and result) as two compiled regions around
    the cache write and the attention function the layer's config selects (the fast path's few-query
    attention inside its steps)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..fast.compiled import compiled

    attn = layer.self_attn
    cos, sin = position_embeddings
    q, k, v = compiled(_attention_inputs, _INPUT_ROWS)(layer, hidden_states, cos, sin,
                                                       module_function(attn, "apply_rotary_pos_emb"))
    attention_kwargs = dict(position_ids=position_ids, use_cache=use_cache, **kwargs)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=attention_kwargs)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                      module_function(attn, "eager_attention_forward"))
    out, _ = interface(attn, q, k, v, attention_mask, dropout=attn.attention_dropout if attn.training else 0.0,
                       scaling=attn.scaling, **attention_kwargs)
    return compiled(_layer_output, _OUTPUT_ROWS)(layer, hidden_states, out)


class Qwen3VLAdapter(DeepStackMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin, ModelAdapter):
    """Qwen3-VL: full-attention text layers with DeepStack, the Qwen3 vision tower."""

    model_classes = ("Qwen3VLForConditionalGeneration",)
    supports_fast_path = True  # every text layer is attention: all state fits `StaticDeferredCache`

    def compile_targets(self) -> list:
        """Every decoder layer as `fused_decoder_layer` (the whole layer but its cache write and attention
        compiled)."""
        return [(layer, fused_decoder_layer) for layer in self.text_model.layers]
