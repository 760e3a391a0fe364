"""The quality testbed: the glyph-grid dialogue benchmark, its word-level tokenizer and processor,
the small models trained on it (bundled under ``raincheck_hf/checkpoints``) and their trainer.

    from raincheck_hf.quality import load_bundled
    model, processor = load_bundled("qwen3_vl")
"""

from .bundled import BUNDLED, bundled_path, load_bundled

__all__ = ["BUNDLED", "bundled_path", "load_bundled"]
