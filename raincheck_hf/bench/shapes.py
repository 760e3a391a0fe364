"""Models at the real shapes (random weights) and prompts of the real sizes, built in code.

Nothing is downloaded. Timings do not depend on weight values (MoE routing aside: random router
weights spread tokens over the experts roughly evenly), so the benchmark builds
``Qwen3VLForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` and their MoE variants
(``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B; ``Qwen3_5MoeForConditionalGeneration``:
Qwen3.5-35B-A3B) from configs written out here (the shapes of docs/baselines.md and the public
configs) with random bf16 weights, directly on the target device.

Token ids. The real Qwen tokenizers are not available, so prompts are tokenized with the tiny
in-code tokenizer of `raincheck_hf.tiny` (400 ids, Qwen's special tokens at ids 0-6). Its ids are
all valid rows of the big vocabularies (151,936 / 248,320), so the *big configs take the tiny
tokenizer's special-token ids* (``image_token_id``, ``video_token_id``, ``vision_start/end``,
``eos`` = ``<|im_end|>``, ``pad`` = ``<|endoftext|>``) instead of Qwen's (151655, ...). Only the id
values differ from the real models; the vocabulary size (embedding and LM-head cost) is the
real one. Text takes more tokens than with Qwen's tokenizer (the tiny BPE knows few words), so the
JSON reports the actual prompt lengths.

Inputs (real shapes):

- ``image``: one 1344x1024 px (W x H) image = 64x84 patches of 16 px = 1,344 merged visual tokens
  (the baselines' image); with the system prompt and question the prompt is 1,403 tokens
  (baselines: 1,394 with Qwen's tokenizer).
- ``video``: 64 frames of 512x384 px (W x H), not resized: 32 temporal groups (2 frames each) x
  12x16 merged tokens = 6,144 video tokens (a 32 s clip sampled at 2 fps at a mid resolution,
  about what Qwen3-VL's default video budget gives a 64-frame clip of that size); the processor
  adds a timestamp per temporal group, so the prompt is about 6.5 k tokens.

Tiny variants (CPU smoke runs): a 320x256 image (80 visual tokens) and 8 frames of 128x128
(4 x 4x4 = 64 video tokens), on the tiny models of `raincheck_hf.tiny`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..tiny import CHAT_TEMPLATE, build_tiny_tokenizer, draw_test_image, draw_test_video

SYSTEM_PROMPT = "You are a helpful assistant."
QUESTIONS = {
    "image": "Describe the image in detail.",
    "video": "What happens in the video?",
}
FOLLOW_UPS = (
    "What colour is the glyph in the top left corner?",
    "List every red glyph you can see.",
    "Answer the question about the image briefly.",
)
VIDEO_FPS = 2.0


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarkable model: how to build it and the size of its inputs."""

    name: str
    family: str  # "qwen3_vl" | "qwen3_5" | "qwen3_vl_moe" | "qwen3_5_moe"
    real_shape: bool  # True: needs a GPU (tens of GB of bf16 weights)
    image_size: tuple[int, int]  # (width, height) px
    video_frames: int
    video_size: tuple[int, int]  # (width, height) px of every frame


MODELS = {
    "qwen3_vl_8b": ModelSpec("qwen3_vl_8b", "qwen3_vl", True, (1344, 1024), 64, (512, 384)),
    "qwen3_5_9b": ModelSpec("qwen3_5_9b", "qwen3_5", True, (1344, 1024), 64, (512, 384)),
    "qwen3_vl_30b_a3b": ModelSpec("qwen3_vl_30b_a3b", "qwen3_vl_moe", True, (1344, 1024), 64, (512, 384)),
    "qwen3_5_35b_a3b": ModelSpec("qwen3_5_35b_a3b", "qwen3_5_moe", True, (1344, 1024), 64, (512, 384)),
    "tiny_qwen3_vl": ModelSpec("tiny_qwen3_vl", "qwen3_vl", False, (320, 256), 8, (128, 128)),
    "tiny_qwen3_5": ModelSpec("tiny_qwen3_5", "qwen3_5", False, (320, 256), 8, (128, 128)),
    "tiny_qwen3_vl_moe": ModelSpec("tiny_qwen3_vl_moe", "qwen3_vl_moe", False, (320, 256), 8, (128, 128)),
    "tiny_qwen3_5_moe": ModelSpec("tiny_qwen3_5_moe", "qwen3_5_moe", False, (320, 256), 8, (128, 128)),
}


def _special_ids(tokenizer) -> dict:
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )


# what Qwen3-VL's public configs share (8B and 30B-A3B): the text model's multimodal rope and the vision tower
_QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                  "mrope_interleaved": True}
_QWEN3_VL_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                        deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")


def qwen3_vl_8b_config(tokenizer=None):
    """Qwen3-VL-8B's shapes (docs/baselines.md) with the tiny tokenizer's special ids: 8.77 B parameters."""
    from transformers import Qwen3VLConfig

    special = _special_ids(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    text_config = dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters=dict(_QWEN3_VL_ROPE),
        eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"], bos_token_id=None,
    )
    vision_config = dict(_QWEN3_VL_VISION, out_hidden_size=4096)
    return Qwen3VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False, **special)


def qwen3_5_9b_config(tokenizer=None):
    """Qwen3.5-9B's shapes: transformers' `Qwen3_5Config` defaults, vision out hidden 4096: 9.41 B parameters.

    (24 Gated DeltaNet + 8 gated full-attention layers, as `Qwen3_5TextConfig`'s defaults lay out.)
    """
    from transformers import Qwen3_5Config

    special = _special_ids(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    text_config = dict(eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"], bos_token_id=None)
    return Qwen3_5Config(text_config=text_config, vision_config=dict(out_hidden_size=4096), tie_word_embeddings=False,
                         **special)


def qwen3_vl_30b_a3b_config(tokenizer=None):
    """Qwen3-VL-30B-A3B's shapes (the public ``Qwen/Qwen3-VL-30B-A3B-Instruct`` config) with the tiny
    tokenizer's special ids: 48 layers of full attention (32 query / 4 key-value heads of 128), an MoE MLP in
    every layer (128 experts of width 768, 8 per token), DeepStack at vision blocks 8 / 16 / 24: 31.07 B
    parameters, 28.99 B of them in experts, 3.89 B used per token (vision tower and embeddings included)."""
    from transformers import Qwen3VLMoeConfig

    special = _special_ids(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    text_config = dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters=dict(_QWEN3_VL_ROPE),
        eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"], bos_token_id=None,
    )
    vision_config = dict(_QWEN3_VL_VISION, out_hidden_size=2048)
    return Qwen3VLMoeConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False,
                            **special)


def qwen3_5_35b_a3b_config(tokenizer=None):
    """Qwen3.5-35B-A3B's shapes: transformers' `Qwen3_5MoeConfig` defaults (its documented checkpoint,
    ``Qwen/Qwen3.5-35B-A3B``: 40 layers, 30 Gated DeltaNet + 10 gated attention, 256 experts of width 512, 8
    per token, plus a shared expert), vision out hidden 2048, with the tiny tokenizer's special ids: 35.11 B
    parameters, 32.21 B of them in experts, 3.90 B used per token (vision tower and embeddings included)."""
    from transformers import Qwen3_5MoeConfig

    special = _special_ids(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    text_config = dict(eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"], bos_token_id=None)
    return Qwen3_5MoeConfig(text_config=text_config, vision_config=dict(out_hidden_size=2048),
                            tie_word_embeddings=False, **special)


_REAL = {  # family -> (model class name, config builder)
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", qwen3_vl_8b_config),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", qwen3_5_9b_config),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", qwen3_vl_30b_a3b_config),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", qwen3_5_35b_a3b_config),
}


@torch.no_grad()
def fast_random_init_(model, seed: int = 0, std: float = 0.02):
    """Overwrite every parameter with random values, on its own device (seconds at 9 B on a GPU).

    Matrices (and embeddings, conv kernels): N(0, std). 1-D parameters keep their meaning so that
    activations stay finite: norm scales 1 (0 for Qwen3.5's ``1 + weight`` RMSNorm), biases 0,
    GDN ``dt_bias`` 1 and ``A_log`` = log(U(1, 16)). Buffers (RoPE frequencies) are left as
    ``__init__`` computed them.
    """
    torch.manual_seed(seed)
    for module in model.modules():
        kind = type(module).__name__
        for name, param in module.named_parameters(recurse=False):
            if param.ndim >= 2:
                param.normal_(0.0, std)
            elif name == "A_log":
                param.uniform_(1.0, 16.0).log_()
            elif name == "dt_bias":
                param.fill_(1.0)
            elif name == "bias":
                param.zero_()
            elif "Norm" in kind and name == "weight":
                param.fill_(0.0 if kind in ("Qwen3_5RMSNorm",) else 1.0)
            else:
                param.normal_(0.0, std)
    return model


def build_from_config(cls, config, device, dtype=torch.bfloat16, seed: int = 0, attn_implementation: str = "sdpa"):
    """``cls`` built from ``config`` straight on ``device`` in ``dtype``, HF's init skipped, random weights.

    No CPU copy and no per-module HF init: modules are created under ``torch.device(device)``
    inside `transformers.initialization.no_init_weights`, then `fast_random_init_` fills every
    parameter on the device.
    """
    from transformers import GenerationConfig
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        model = cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    fast_random_init_(model, seed=seed)
    text = config.get_text_config()
    model.generation_config = GenerationConfig(
        eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id, do_sample=False
    )
    return model.eval()


def _build_real(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int, attn_implementation: str):
    import transformers

    class_name, make_config = _REAL[spec.family]
    return build_from_config(getattr(transformers, class_name), make_config(), device, dtype, seed,
                             attn_implementation)


def build_model(name: str, device: torch.device | str, dtype: torch.dtype | None = None, seed: int = 0,
                attn_implementation: str = "sdpa"):
    """``(model, info)`` for ``MODELS[name]`` on ``device``; ``info`` says what was built and how long it took.

    Real shapes: bf16 unless ``dtype`` says otherwise, and a GPU is required. Tiny models: the
    builders of `raincheck_hf.tiny` (fp32 on CPU, bf16 on a GPU unless ``dtype`` says otherwise).
    Raises ``ValueError`` for an unknown name, a real shape on CPU, or a tiny builder that does not
    exist (yet) in `raincheck_hf.tiny`.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}.")
    spec = MODELS[name]
    device = torch.device(device)
    if spec.real_shape and device.type == "cpu":
        raise ValueError(
            f"model {name!r} has the real {spec.family} shape (18-70 GB of bf16 weights) and needs a GPU; the device "
            f"is {device}. Use the tiny_* models for CPU smoke runs."
        )
    if dtype is None:
        dtype = torch.bfloat16 if (spec.real_shape or device.type == "cuda") else torch.float32
    start = time.perf_counter()
    if spec.real_shape:
        model = _build_real(spec, device, dtype, seed, attn_implementation)
    else:
        from .. import tiny

        builder_name = f"build_tiny_{spec.family}"
        builder = getattr(tiny, builder_name, None)
        if builder is None:
            raise ValueError(f"model {name!r} needs raincheck_hf.tiny.{builder_name}, which does not exist (yet).")
        model = builder(seed=seed, attn_implementation=attn_implementation).to(device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - start
    info = {
        "name": name,
        "class": type(model).__name__,
        "family": spec.family,
        "real_shape": spec.real_shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "attn_implementation": attn_implementation,
        "build_s": build_s,
        "weights": "random (timings do not depend on weight values)",
    }
    return model, info


def build_processor(max_pixels: int = 2048 * 2048, video_max_pixels: int = 64 * 512 * 512):
    """A `Qwen3VLProcessor` (tiny tokenizer, Qwen3-VL patching) that leaves the benchmark's inputs at their size.

    ``max_pixels`` bounds one image; ``video_max_pixels`` bounds frames x height x width of a video
    (frames are not sampled and not capped per frame, so the grid follows the input exactly).
    """
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": max_pixels},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": video_max_pixels},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_sample_frames=False, cap_pixels_per_frame=False,
    )
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=build_tiny_tokenizer(),
                            video_processor=video_processor, chat_template=CHAT_TEMPLATE)


def image_turn(name: str, device, image_size=None) -> tuple:
    """``(model, info, inputs, prompt)``: the model ``name`` (`build_model`, enabled for Raincheck) and the first
    turn of an image prompt (`build_prompt`) on ``device``, as the first-token scripts of ``benchmarks/`` time it."""
    import raincheck_hf

    device = torch.device(device)
    model, info = build_model(name, device)
    raincheck_hf.enable(model)
    first, prompt = build_prompt(build_processor(), MODELS[name], "image", image_size=image_size)
    first.pop("mm_token_type_ids", None)
    return model, info, {k: v.to(device) for k, v in first.items()}, prompt


def build_prompt(processor, spec: ModelSpec, kind: str, image_size=None, video_frames=None, video_size=None):
    """``(inputs, info)``: the first turn's processor outputs (CPU tensors) for ``kind`` in {image, video}.

    ``input_ids`` = system prompt + ``<|vision_start|>`` + one pad per merged visual token +
    ``<|vision_end|>`` (per temporal group, with a timestamp, for video) + question + assistant
    prefix, made by the chat template and the processor. ``info`` gives the token counts and grid.
    """
    from transformers.video_utils import VideoMetadata

    if kind not in QUESTIONS:
        raise ValueError(f"unknown input {kind!r}; choose from {sorted(QUESTIONS)}.")
    part = {"type": kind}
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": [part, {"type": "text", "text": QUESTIONS[kind]}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if kind == "image":
        width, height = image_size or spec.image_size
        inputs = processor(text=[prompt], images=[draw_test_image(width, height, seed=0)], return_tensors="pt")
        grid = inputs["image_grid_thw"][0].tolist()
        token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        media = {"width": width, "height": height}
    else:
        frames = video_frames or spec.video_frames
        width, height = video_size or spec.video_size
        video = draw_test_video(frames, width, height, seed=0)
        metadata = VideoMetadata(total_num_frames=frames, fps=VIDEO_FPS, frames_indices=list(range(frames)))
        inputs = processor(text=[prompt], videos=[video], videos_kwargs={"video_metadata": [metadata]},
                           return_tensors="pt")
        grid = inputs["video_grid_thw"][0].tolist()
        token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        media = {"frames": frames, "width": width, "height": height, "fps": VIDEO_FPS}
    ids = inputs["input_ids"][0]
    visual = int((ids == token_id).sum())
    info = {"kind": kind, **media, "grid_thw": grid, "prompt_tokens": int(ids.numel()), "visual_tokens": visual,
            "text_tokens": int(ids.numel()) - visual}
    return dict(inputs), info


def follow_up_ids(processor, sequences: torch.Tensor, text: str) -> torch.Tensor:
    """The whole conversation for a text-only follow-up: earlier ``sequences`` + end of turn + the new turn.

    Built exactly as `raincheck_hf.Conversation` does (``<|im_end|>`` unless the answer ended with
    it, a newline, then the chat template of the user turn with the assistant prefix).
    """
    tok = processor.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                           add_generation_prompt=True, tokenize=False)
    new = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    glue = ([] if int(sequences[0, -1]) == end_id else [end_id]) + newline
    return torch.cat([sequences.cpu(), torch.tensor([glue], dtype=torch.long), new], dim=1)


def special_token_ids(processor) -> list[int]:
    """Ids the benchmark never lets a model generate (every special token, EOS included)."""
    tok = processor.tokenizer
    return sorted({tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
                  | {tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                            "<|video_pad|>", "<|im_start|>", "<|im_end|>",
                                                            "<|endoftext|>")})
