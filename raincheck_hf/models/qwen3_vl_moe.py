"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``, e.g. Qwen3-VL-30B-A3B): Qwen3-VL with
mixture-of-experts MLPs.

Everything the engine needs is Qwen3-VL's (same processor, placeholders, Qwen3 vision tower with
DeepStack, rope index, full-attention text layers), composed from the same mixins. The experts need
nothing: routing is per token (top-k of the token's own router logits, no capacity limit), so a row's
output does not depend on which other rows share its forward, and deferred rows, fused chunks and
padding rows route exactly as in a full prefill.

Fast path: all text layers are attention, so the static KV slots and graph replay apply when the experts
run without host synchronisation: transformers' default ``grouped_mm`` in bfloat16 (`ExpertsMixin`). In
another dtype or with ``experts_implementation="eager"``, ``fast_path=None`` picks the eager engine.
"""

from __future__ import annotations

from .base import ModelAdapter
from .mixins import DeepStackMixin, ExpertsMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin


class Qwen3VLMoeAdapter(ExpertsMixin, DeepStackMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin, ModelAdapter):
    """Qwen3-VL-MoE: full-attention text layers with MoE MLPs and DeepStack, the Qwen3 vision tower."""

    model_classes = ("Qwen3VLMoeForConditionalGeneration",)
    supports_fast_path = True
