"""The architectures of the bundled models: the real transformers classes, a few million parameters.

Sizes are chosen so a model trains on the H200 in minutes and its fp32 safetensors stay under the
15 MB bundling limit. Qwen3-VL keeps DeepStack (one injected vision layer); Qwen3.5 keeps the real
3 : 1 pattern of Gated DeltaNet and gated full-attention layers, with grouped GDN heads.
"""

from __future__ import annotations

import torch

from ..tiny import _special_token_ids

FAMILIES = ("qwen3_vl", "qwen3_5")

_VISION = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, patch_size=16, spatial_merge_size=2,
               temporal_patch_size=2, num_position_embeddings=400)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12], "mrope_interleaved": True}


def glyph_config(family: str, tokenizer):
    from transformers import Qwen3_5Config, Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), bos_token_id=None,
                tie_word_embeddings=False)
    if family == "qwen3_vl":
        return Qwen3VLConfig(
            text_config=dict(text, rope_parameters=dict(_ROPE)),
            vision_config=dict(_VISION, out_hidden_size=256, deepstack_visual_indexes=[0]),
            **_special_token_ids(ids))
    if family == "qwen3_5":
        return Qwen3_5Config(
            text_config=dict(
                text, layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=64,
                linear_conv_kernel_dim=4,
                # partial rotary as in the real model: M-RoPE sections cover half of the 64-dim head
                rope_parameters=dict(_ROPE, mrope_section=[4, 6, 6], partial_rotary_factor=0.5)),
            vision_config=dict(_VISION, out_hidden_size=256),
            **_special_token_ids(ids))
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def build_glyph_model(family: str, tokenizer, seed: int = 0):
    """A freshly initialised model of the bundled architecture (fp32, training mode)."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config = glyph_config(family, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                               do_sample=False)
    return model
