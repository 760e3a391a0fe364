"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) through public seams.

What differs from the Qwen3 families:

- **No DeepStack.** The tower returns only ``pooler_output``; the text model is plain full attention
  (q/k/v projections with bias, no q/k norms), so the base `ModelAdapter.forward` runs it.
- **Its own 3-D rope index.** ``get_rope_index`` spaces a video's temporal positions by
  ``tokens_per_second * second_per_grid_ts`` (the processor's seconds per temporal patch), so
  `second_per_grid_ts` travels from the processor's outputs to `encode_turn`. Its processor writes one
  ``<|vision_start|> <|video_pad|>... <|vision_end|>`` run per video (Qwen3's write one per temporal
  slice); `QwenVisionLanguageMixin` cuts runs into one segment per slice either way.
- **Windowed vision attention.** The tower reorders its patches window by window (``window_index``) and
  attends within windows except in ``fullatt_block_indexes``; the merger's outputs are put back in source
  order at the end. The last block holds the tokens in window order, so VisionZip's scores are permuted
  back (`vision_merged_order`), and the fast path precomputes the window index with the other grid
  bookkeeping (`vision_grid_kwargs`).
- **FastV** reads the per-head queries and keys from ``q_proj`` / ``k_proj`` (no per-head norms).

Fast path: every text layer is attention (static KV slots and graph replay apply), and the tower is
replayed per grid.
"""

from __future__ import annotations

import torch

from ..patching import module_function
from .base import ModelAdapter
from .mixins import QwenVisionLanguageMixin


def _window_index(tower, grid_thw: torch.Tensor):
    from transformers.vision_utils import get_vision_window_index

    return get_vision_window_index(grid_thw.to("cpu"), spatial_merge_size=tower.spatial_merge_size,
                                   window_size=tower.window_size, patch_size=tower.patch_size)


class Qwen2_5_VLAdapter(QwenVisionLanguageMixin, ModelAdapter):
    """Qwen2.5-VL (see the module docstring)."""

    model_classes = ("Qwen2_5_VLForConditionalGeneration",)
    supports_fast_path = True
    supports_vision_graphs = True

    def _rope_index(self, ids, mm_types, image_grid_thw, video_grid_thw, second_per_grid_ts):
        positions, _ = self.model.model.get_rope_index(
            ids[None], mm_types[None], image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
        )
        return positions[:, 0]

    def attention_query_key(self, layer: int):
        attn = self.text_model.layers[layer].self_attn
        return attn, attn.q_proj, attn.k_proj, module_function(attn, "apply_rotary_pos_emb")

    def vision_merged_order(self, grid_thw: torch.Tensor) -> torch.Tensor:
        window_index, _ = _window_index(self.vision_tower, grid_thw)
        return torch.argsort(window_index)

    @staticmethod
    def vision_input_device(tower) -> torch.device:
        return tower.patch_embed.proj.weight.device

    @staticmethod
    def vision_grid_kwargs(tower, grid_thw: torch.Tensor) -> dict:
        """Rotary positions, the window index and the full / windowed attention boundaries for ``grid_thw``.
        Boundaries stay on the host for the SDPA / eager backends (they only read the lengths)."""
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        device = tower.patch_embed.proj.weight.device
        grid = grid_thw.to("cpu")
        position_ids = get_vision_position_ids(grid, tower.spatial_merge_size)
        cu_seqlens, _ = get_vision_attention_seqlens(grid, tower.config)
        window_index, cu_window_seqlens = _window_index(tower, grid)
        kwargs = {"position_ids": position_ids.to(device), "window_index": window_index.to(device)}
        if "flash" in str(getattr(tower.config, "_attn_implementation", "") or ""):
            kwargs.update(cu_seqlens=cu_seqlens.to(device), cu_window_seqlens=cu_window_seqlens.to(device),
                          max_seqlen=get_max_seqlen(cu_seqlens, tower.config),
                          max_window_seqlen=get_max_seqlen(cu_window_seqlens, tower.config))
        else:
            kwargs.update(cu_seqlens=cu_seqlens, cu_window_seqlens=cu_window_seqlens)
        return kwargs
