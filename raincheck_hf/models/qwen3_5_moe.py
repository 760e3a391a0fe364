"""Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``): Qwen3.5 with mixture-of-experts MLPs (routed
experts plus a gated shared expert).

The text layers are Qwen3.5's (Gated DeltaNet + gated full attention, `gdn.dispatch`'s split
forward, through `GatedDeltaNetMixin`); the GDN kernels checked for their state layout are the ones of
``modeling_qwen3_5_moe``, the layer's own modeling file. The experts are per token (no capacity limit),
so deferral changes nothing about routing. The fast path is Qwen3.5's (GDN states in static buffers,
captured decode and chunk steps); the vision tower (Qwen3's, without DeepStack) is replayed from CUDA
graphs on it.
"""

from __future__ import annotations

from .base import ModelAdapter
from .mixins import ExpertsMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin
from .qwen3_5 import GatedDeltaNetMixin


class Qwen3_5MoeAdapter(ExpertsMixin, GatedDeltaNetMixin, Qwen3VisionTowerMixin, QwenVisionLanguageMixin, ModelAdapter):
    """Qwen3.5-MoE: Qwen3.5's hybrid text layers with MoE MLPs, the Qwen3 vision tower."""

    model_classes = ("Qwen3_5MoeForConditionalGeneration",)
