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
    processor = AutoProcessor.from_pretrained(path)
    return model.to(device).eval(), processor
