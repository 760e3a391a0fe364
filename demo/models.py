"""Loading the demo's models: the bundled glyph models, the random tiny one, or a checkpoint by name.

A thin layer over `raincheck_hf.loading` (one loader for every entry point): the demo adds its labels for the
model dropdown, a note for the page about what the model is, a cache of loaded models shared by the browser
sessions, and errors worded for the chat (`ModelLoadError`). Nothing is loaded at import.
"""

import threading
from dataclasses import dataclass

import torch

from raincheck_hf.loading import resolve_model

TINY_MODEL = "tiny-random (built in code)"
DEFAULT_MODEL = "qwen3_vl"  # the bundled glyph Qwen3-VL
BUNDLED_LABELS = {"qwen3_vl": "qwen3_vl: glyph Qwen3-VL (bundled, trained)",
                  "qwen3_5": "qwen3_5: glyph Qwen3.5 (bundled, trained)"}
MODEL_LABELS = {**BUNDLED_LABELS, "tiny-random (built in code)": "tiny: Qwen3-VL with random weights (built in code)"}
# the demo's tiny processor: up to 384×384 px per image (144 merged tokens), so patches are visible
TINY_MAX_PIXELS = 384 * 384

TINY_NOTE = (
    "**Note: this is `tiny`, a Qwen3-VL built in code with random weights.** Its answers are gibberish; "
    "the selection, the timings and the restoration you see are real. For answers that can be checked, pick "
    "the bundled glyph model `qwen3_vl` (the default) or `qwen3_5` under *Settings*, or a real checkpoint "
    "(a Hub id or a local folder)."
)
BUNDLED_NOTE = (
    "**Model: the bundled {title}** (`{cls}`, {params:.2f} M parameters, on `{device}`), trained in this project on "
    "its glyph-grid benchmark. **It knows only that task:** n×n grids of 32 px cells, each a glyph g0…g11 in one "
    "of 10 colours over a grey background (dark, dim, pale, light), and a word-level vocabulary of {words} tokens "
    "(special tokens included); any other word reads as `<unk>`. Ask like the examples: `what is the background of the red g3 ?` or `list the "
    "backgrounds of the red and blue glyphs .` When the image is a glyph grid, the reference answer (read off its "
    "pixels) follows the model's. It is not a general VLM: for photos, pick a real Qwen3-VL checkpoint under "
    "*Settings*."
)


class ModelLoadError(RuntimeError):
    """A model could not be loaded (the message says why and what to do)."""


@dataclass
class LoadedModel:
    name: str
    model: object
    processor: object
    is_tiny: bool
    bundled: bool = False  # one of the bundled glyph models: lowercased questions, reference answers

    @property
    def note(self) -> str:
        if self.is_tiny:
            return TINY_NOTE
        if self.bundled:
            return BUNDLED_NOTE.format(
                title="glyph Qwen3.5" if self.name == "qwen3_5" else "glyph Qwen3-VL", cls=type(self.model).__name__,
                params=sum(p.numel() for p in self.model.parameters()) / 1e6, device=self.model.device,
                words=len(self.processor.tokenizer))
        return f"Model: **{self.name}** on `{self.model.device}`."


_MODELS: dict[str, LoadedModel] = {}
_MODELS_LOCK = threading.Lock()


def model_key(name: str | None) -> str:
    """The cache key of a model name: ``qwen3_vl`` / ``qwen3_5`` (bundled; the default), `TINY_MODEL`, or the name."""
    name = (name or "").strip()
    if not name:
        return DEFAULT_MODEL
    if name == TINY_MODEL:
        return TINY_MODEL
    if name in MODEL_LABELS.values():
        return next(k for k, v in MODEL_LABELS.items() if v == name)
    kind, resolved = resolve_model(name)
    return TINY_MODEL if kind == "tiny" else resolved


def model_choices(*first) -> list[tuple[str, str]]:
    """The model dropdown's ``(label, value)`` choices: ``first``, then the bundled and the tiny model."""
    keys = dict.fromkeys([*first, DEFAULT_MODEL, "qwen3_5", TINY_MODEL])
    return [(MODEL_LABELS.get(k, k), k) for k in keys]


def is_loaded(name: str | None) -> bool:
    """Whether `load_model` has ``name`` already (it returns at once)."""
    try:
        return model_key(name) in _MODELS
    except ValueError:
        return False


def load_model(name: str | None) -> LoadedModel:
    """The model and processor for ``name`` (a bundled model, the tiny one, a Hub id or a local folder), cached.

    Raises `ModelLoadError` with an actionable message when it cannot be loaded or is unsupported.
    """
    key = model_key(name)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = _load_uncached(key)
        return _MODELS[key]


def _load_uncached(key: str) -> LoadedModel:
    import raincheck_hf

    if key == TINY_MODEL:
        from raincheck_hf.tiny import build_tiny_processor, build_tiny_qwen3_vl

        model = raincheck_hf.enable(build_tiny_qwen3_vl(seed=0))
        return LoadedModel(key, model, build_tiny_processor(max_pixels=TINY_MAX_PIXELS), is_tiny=True)
    from raincheck_hf.loading import LoadError, load_model as load_named

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bundled = key in BUNDLED_LABELS
    try:  # a folder without a checkpoint, or a Hub id neither cached nor reachable: within seconds
        model, processor, _, _ = load_named(key, device, log=lambda text: None)
        raincheck_hf.enable(model)  # unsupported model classes fail here, naming the supported ones
    except LoadError as error:
        raise ModelLoadError(f"Could not load {'the bundled model' if bundled else 'model'} **{key}**: "
                             f"{' '.join(str(error).split())}") from error
    except Exception as error:  # ValueError (unsupported), ...
        detail = " ".join(str(error).split())
        detail = detail if len(detail) <= 400 else detail[:400] + " …"
        raise ModelLoadError(
            f"Could not load model **{key}**: {type(error).__name__}: {detail} — give a local folder with a "
            "Qwen3-VL or Qwen3.5 checkpoint (config.json, the *.safetensors weights and the processor's files; "
            "demo/README.md, *A real checkpoint*), or a bundled model: qwen3_vl, qwen3_5."
        ) from error
    if bundled:
        return LoadedModel(key, model, processor, is_tiny=False, bundled=True)
    return LoadedModel(key, model, processor, is_tiny=False)



def vision_token_ids(config) -> list[int]:
    """The model's image / video placeholders and vision markers, suppressed in answers: one in an answer would be
    read as an image slot by the next turn's prompt (a random-weight model does produce them now and then)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [i for i in (getattr(config, name, None) for name in names) if i is not None]
