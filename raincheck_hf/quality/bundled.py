"""The small models trained on the glyph benchmark, bundled with the package.

Each is a directory under ``raincheck_hf/checkpoints`` that `from_pretrained` reads directly
(safetensors weights, config, generation config, processor and tokenizer files, a model card).
They come from `raincheck_hf.quality.train` (see each model card for the exact command).
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
BUNDLED = {"qwen3_vl": "glyph-qwen3-vl", "qwen3_5": "glyph-qwen3_5"}


def bundled_path(name: str = "qwen3_vl") -> Path:
    if name not in BUNDLED:
        raise ValueError(f"bundled model must be one of {sorted(BUNDLED)}, got {name!r}")
    path = CHECKPOINTS / BUNDLED[name]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"bundled model {name!r} is missing at {path} (the package was installed without "
                                "its checkpoints?)")
    return path


def load_bundled(name: str = "qwen3_vl", attn_implementation: str = "sdpa", device: str = "cpu"):
    """``(model, processor)`` of a bundled model: fp32, eval mode, on ``device``."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = bundled_path(name)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation=attn_implementation)
    processor = AutoProcessor.from_pretrained(path, tokenizer=load_word_tokenizer(path))
    return model.to(device).eval(), processor


def load_word_tokenizer(path):
    """The bundled word-level tokenizer, as saved.

    `AutoTokenizer` cannot be trusted here: transformers lists ``qwen3_5`` among the model types
    whose Hub tokenizer class is "known wrong" and swaps in `Qwen3_5Tokenizer` (byte-level BPE
    pre-tokenisation) whatever ``tokenizer_config.json`` says, which turns every word of ours into
    ``<unk>``. Loading the saved ``tokenizer.json`` through `PreTrainedTokenizerFast` keeps it.
    """
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    probe = "what is the background of the red g3 ?"
    if tok.unk_token_id in tok(probe)["input_ids"]:
        raise RuntimeError(f"the tokenizer at {path} does not read the glyph vocabulary (got <unk> for {probe!r})")
    return tok
