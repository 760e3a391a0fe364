"""Tiny Qwen3-VL models and a matching processor, built entirely in code.

Nothing is downloaded: tests, the CLI's offline default and the demo's fallback build their model
here: a byte-level BPE tokenizer trained on a fixed in-code corpus
(deterministic), Qwen's special tokens, a Qwen-style chat template, the real Qwen3-VL image and
video processors at small resolutions, and a Qwen3-VL model with a few layers and random weights.

A random-weight model produces meaningless text; anything that prints its output says so.
"""

from __future__ import annotations

import functools

import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A Qwen-style chat template (images and videos as placeholder parts; the processor expands them).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|video_pad|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = [
    "What is in this image? Describe the picture in one sentence.",
    "The glyph in the top left corner is red, the one below it is blue.",
    "List every red glyph you can see. What colour is glyph g17?",
    "A video of a ball rolling across a table, then a cat jumps onto the chair.",
    "Answer the question about the image briefly: yes, no, left, right, up, down.",
    "zero one two three four five six seven eight nine ten seconds",
    "The quick brown fox jumps over the lazy dog. 0123456789 <>()[]{}.,:;!?'\"-_/",
]


@functools.lru_cache(maxsize=4)
def _trained_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = 400):
    """A fast tokenizer with Qwen's special tokens; the same vocabulary on every call."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained_tokenizer(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={},
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_processor(min_pixels: int = 32 * 32, max_pixels: int = 256 * 256, vocab_size: int = 400):
    """A `Qwen3VLProcessor` with Qwen3-VL's patching (16 px patches, 2×2 merge, 2 frames per step)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size=size,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels * 4},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_sample_frames=False,
        cap_pixels_per_frame=True,
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=build_tiny_tokenizer(vocab_size),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def _special_token_ids(ids) -> dict:
    """The config's placeholder / marker / eos / pad ids, from the tokenizer's ``convert_tokens_to_ids``."""
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )


def tiny_qwen3_vl_config(tokenizer=None, num_hidden_layers: int = 4, hidden_size: int = 64, **text_overrides):
    """A Qwen3-VL config with DeepStack on, M-RoPE interleaved, sized to run in milliseconds on a CPU."""
    from transformers import Qwen3VLConfig

    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        pad_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        bos_token_id=None,
    )
    text_config.update(text_overrides)
    vision_config = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
        deepstack_visual_indexes=[0, 1],
    )
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        **_special_token_ids(ids),
    )


def build_tiny_qwen3_vl(seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **config_kwargs):
    """A randomly initialised tiny `Qwen3VLForConditionalGeneration` (same weights for the same seed)."""
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    config = tiny_qwen3_vl_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(dtype)
    model.set_attn_implementation(attn_implementation) if hasattr(model, "set_attn_implementation") else None
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    return model.eval()


def draw_test_image(width: int = 128, height: int = 96, seed: int = 0):
    """A deterministic RGB test image (a PIL image) with blocks of colour, so patches differ."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    cells = torch.randint(0, 256, (3, max(1, height // 16), max(1, width // 16)), generator=g, dtype=torch.uint8)
    big = cells.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, :height, :width]
    return Image.fromarray(big.permute(1, 2, 0).contiguous().numpy())


def draw_test_video(num_frames: int = 4, width: int = 64, height: int = 64, seed: int = 0):
    """A deterministic video as a uint8 tensor (frames, 3, H, W)."""
    g = torch.Generator().manual_seed(seed)
    cells = torch.randint(0, 256, (num_frames, 3, max(1, height // 16), max(1, width // 16)), generator=g,
                          dtype=torch.uint8)
    return cells.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, :height, :width].contiguous()


# ---- Qwen3.5 (hybrid Gated DeltaNet + gated full attention) ------------------------------------
#
# The same tokenizer and processor serve Qwen3.5: transformers maps qwen3_5 to `Qwen3VLProcessor`
# with the Qwen2-VL image and Qwen3-VL video processors, and Qwen3.5's rope index expects exactly
# what that processor writes (one ``<|vision_start|> … <|vision_end|>`` group per video frame,
# separated by timestamps, so each temporal slice is its own placeholder run).

TINY_QWEN3_5_LAYER_TYPES = ("linear_attention", "linear_attention", "full_attention", "linear_attention")


def tiny_qwen3_5_config(tokenizer=None, layer_types=TINY_QWEN3_5_LAYER_TYPES, hidden_size: int = 64,
                        **text_overrides):
    """A Qwen3.5 config sized for a CPU: GDN layers below and above a full-attention layer.

    Odd-on-purpose GDN shapes (2 key heads serving 4 value heads, ``dk = 8 != dv = 16``) so a head
    repeat or a transposed state cannot pass by accident; partial rotary (half of a 32-dim head) with
    interleaved M-RoPE sections as in the real model.
    """
    from transformers import Qwen3_5Config

    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.5},
        pad_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        bos_token_id=None,
    )
    text_config.update(text_overrides)
    vision_config = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
    )
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        **_special_token_ids(ids),
    )


def build_tiny_qwen3_5(seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **config_kwargs):
    """A randomly initialised tiny `Qwen3_5ForConditionalGeneration` (same weights for the same seed).

    The GDN decay rates ``A = exp(A_log)`` are set to 0.02 … 0.3 instead of HF's init range
    [0.01, 16]: with A of several units the state forgets a token within a few steps, and deferred
    rows would barely reach the answer's state, so tests of the join would measure nothing.
    """
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration

    config = tiny_qwen3_5_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    text = config.text_config
    with torch.no_grad():
        for layer, kind in zip(model.model.language_model.layers, text.layer_types):
            if kind == "linear_attention":
                layer.linear_attn.A_log.copy_(torch.linspace(0.02, 0.3, text.linear_num_value_heads).log())
    model = model.to(dtype)
    model.set_attn_implementation(attn_implementation) if hasattr(model, "set_attn_implementation") else None
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    return model.eval()


def _generation_ready(model, config, attn_implementation: str, dtype):
    from transformers import GenerationConfig

    model = model.to(dtype)
    model.set_attn_implementation(attn_implementation) if hasattr(model, "set_attn_implementation") else None
    text = config.get_text_config()
    model.generation_config = GenerationConfig(eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
                                               do_sample=False)
    return model.eval()


# ---- Qwen3-VL-MoE and Qwen3.5-MoE: the dense tiny configs with mixture-of-experts MLPs -------------
#
# Four experts, two per token, so that routing differs between tokens (every expert is hit by the
# tiny prompts) while a forward stays a few milliseconds.

TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_qwen3_vl_moe_config(tokenizer=None, num_hidden_layers: int = 4, hidden_size: int = 64, **text_overrides):
    """Qwen3-VL-MoE: `tiny_qwen3_vl_config`'s shapes (DeepStack on) with an MoE MLP in every layer."""
    from transformers import Qwen3VLMoeConfig

    dense = tiny_qwen3_vl_config(tokenizer, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size)
    return _moe_config(Qwen3VLMoeConfig, dense, _TEXT_KEYS, decoder_sparse_step=1, **text_overrides)


def build_tiny_qwen3_vl_moe(seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **config_kwargs):
    """A randomly initialised tiny `Qwen3VLMoeForConditionalGeneration` (same weights for the same seed)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    config = tiny_qwen3_vl_moe_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config)
    _init_experts(model, seed)
    return _generation_ready(model, config, attn_implementation, dtype)


def tiny_qwen3_5_moe_config(tokenizer=None, layer_types=TINY_QWEN3_5_LAYER_TYPES, hidden_size: int = 64,
                            **text_overrides):
    """Qwen3.5-MoE: `tiny_qwen3_5_config`'s shapes (GDN below and above a full-attention layer) with MoE MLPs
    (routed experts plus the gated shared expert)."""
    from transformers import Qwen3_5MoeConfig

    dense = tiny_qwen3_5_config(tokenizer, layer_types=layer_types, hidden_size=hidden_size)
    return _moe_config(Qwen3_5MoeConfig, dense, _TEXT_KEYS + _GDN_KEYS, shared_expert_intermediate_size=32,
                       **text_overrides)


def build_tiny_qwen3_5_moe(seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **config_kwargs):
    """A randomly initialised tiny `Qwen3_5MoeForConditionalGeneration` (decay rates as `build_tiny_qwen3_5`)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    config = tiny_qwen3_5_moe_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(config)
    _slow_decay(model, config.text_config)
    _init_experts(model, seed)
    return _generation_ready(model, config, attn_implementation, dtype)


_TEXT_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "rope_parameters", "pad_token_id", "eos_token_id",
              "bos_token_id"]
_GDN_KEYS = ["layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim"]


def _moe_config(config_class, dense, text_keys, **text_updates):
    """``config_class`` (an MoE family's config) with ``dense``'s text settings named in ``text_keys``, `TINY_MOE`'s
    experts, ``text_updates``, and ``dense``'s vision tower and special token ids."""
    text = {k: v for k, v in dense.text_config.to_dict().items() if k in text_keys}
    text.update(TINY_MOE, **text_updates)
    return config_class(text_config=text, vision_config=_vision_dict(dense), **_ids_of(dense))


def _vision_dict(config) -> dict:
    keep = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
            "spatial_merge_size", "temporal_patch_size", "num_position_embeddings", "deepstack_visual_indexes")
    return {k: v for k, v in config.vision_config.to_dict().items() if k in keep}


def _ids_of(config) -> dict:
    return {k: getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id")}


def _slow_decay(model, text) -> None:
    with torch.no_grad():
        for layer, kind in zip(model.model.language_model.layers, text.layer_types):
            if kind == "linear_attention":
                layer.linear_attn.A_log.copy_(torch.linspace(0.02, 0.3, text.linear_num_value_heads).log())


def _init_experts(model, seed: int) -> None:
    """Expert and router weights at the scale of the dense MLPs' (HF's MoE init leaves the 3-D expert tensors
    and routers at a scale where every token picks the same experts)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


# ---- Qwen2.5-VL: windowed vision attention, no DeepStack, its own processor --------------------
#
# Qwen2.5-VL's processor writes one ``<|vision_start|> <|video_pad|>... <|vision_end|>`` run per
# video (the chat template below puts the markers around each part; Qwen3's processors insert them per
# frame themselves) and returns ``second_per_grid_ts``, which its rope index reads. Patches of 14 px,
# windows of 56 px (2x2 merged tokens), the last of two vision blocks full attention, as in the real
# tower's ``fullatt_block_indexes``.

QWEN2_5_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|video_pad|>' -}}", "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}")


def build_tiny_qwen2_5_vl_processor(min_pixels: int = 28 * 28, max_pixels: int = 256 * 256, vocab_size: int = 400):
    """A `Qwen2_5_VLProcessor` with Qwen2.5-VL's patching (14 px patches, 2x2 merge, 2 frames per step)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    common = dict(patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
                  image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **common)
    video_processor = Qwen2VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels * 4},
                                            do_sample_frames=False, cap_pixels_per_frame=True, **common)
    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=build_tiny_tokenizer(vocab_size),
                               video_processor=video_processor, chat_template=QWEN2_5_CHAT_TEMPLATE)


def tiny_qwen2_5_vl_config(tokenizer=None, num_hidden_layers: int = 4, hidden_size: int = 64, **text_overrides):
    """A Qwen2.5-VL config sized for a CPU (M-RoPE sections [2, 3, 3] of a 16-dim head, windowed tower)."""
    from transformers import Qwen2_5_VLConfig

    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), bos_token_id=None,
    )
    text_config.update(text_overrides)
    vision_config = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **_special_token_ids(ids))


def build_tiny_qwen2_5_vl(seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **config_kwargs):
    """A randomly initialised tiny `Qwen2_5_VLForConditionalGeneration` (same weights for the same seed)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = tiny_qwen2_5_vl_config(**config_kwargs)
    torch.manual_seed(seed)
    return _generation_ready(Qwen2_5_VLForConditionalGeneration(config), config, attn_implementation, dtype)
