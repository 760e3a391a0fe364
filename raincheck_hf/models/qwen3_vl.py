"""Qwen3-VL (``Qwen3VLForConditionalGeneration``) through public seams: the vision tower's outputs, input
embeddings, explicit 3-D positions, DeepStack arguments of the text model, a 4-D mask and the cache layer API.

Nothing here copies modeling code. One forward over arbitrary rows is a call of the text model
(`model.model.language_model`) with ``inputs_embeds``, ``position_ids`` of shape ``[3, 1, L]``
(M-RoPE t/h/w), ``visual_pos_masks``/``deepstack_visual_embeds`` restricted to the rows of this
forward (so DeepStack features are added only for the visual rows actually prefilled), and a
4-D mask, which transformers passes to attention untouched.
"""

from __future__ import annotations

from .base import ModelAdapter
from .mixins import DeepStackMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin


class Qwen3VLAdapter(DeepStackMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin, ModelAdapter):
    """Qwen3-VL: full-attention text layers with DeepStack, the Qwen3 vision tower."""

    model_classes = ("Qwen3VLForConditionalGeneration",)
    supports_fast_path = True  # every text layer is attention: all state fits `StaticDeferredCache`
