"""Loading a model by name, one way for every entry point: the CLI chat, the server, the demo and the eval.

A name is a bundled glyph model (``qwen3_vl``, ``qwen3_5``, offline), ``tiny`` (a random-weight Qwen3-VL built in
code) or a checkpoint: a local folder as ``save_pretrained`` writes it, or a Hub id (which fails within seconds
when the Hub cannot be reached and the id is not cached, instead of after ``from_pretrained``'s retries).
Checkpoints load in bf16 on CUDA and fp32 elsewhere, with SDPA attention, in eval mode.

Nothing here imports torch or transformers at import time (the CLI's ``--help`` stays instant).
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

# names of the bundled models (raincheck_hf.quality.BUNDLED) and of the random tiny model
BUNDLED_ALIASES = {"qwen3_vl": "qwen3_vl", "qwen3-vl": "qwen3_vl", "glyph-qwen3-vl": "qwen3_vl",
                   "qwen3_5": "qwen3_5", "qwen3.5": "qwen3_5", "qwen3-5": "qwen3_5", "glyph-qwen3_5": "qwen3_5"}
TINY_ALIASES = ("tiny", "tiny-random")
DEFAULT_MODEL = "qwen3_vl"
BUNDLED_TITLES = {"qwen3_vl": "glyph Qwen3-VL", "qwen3_5": "glyph Qwen3.5"}


def resolve_model(name: str | None) -> tuple[str, str]:
    """``(kind, name)``: ``("bundled", "qwen3_vl" | "qwen3_5")``, ``("tiny", "tiny")`` or ``("checkpoint", path_or_id)``.

    A bundled name wins over a local folder of the same name; write ``./qwen3_vl`` for the folder.
    """
    key = (name or DEFAULT_MODEL).strip()
    if key.lower() in BUNDLED_ALIASES:
        return "bundled", BUNDLED_ALIASES[key.lower()]
    if key.lower() in TINY_ALIASES:
        return "tiny", "tiny"
    return "checkpoint", key


class CheckpointError(ValueError):
    """A checkpoint name that cannot be loaded here; the message says why and what to do instead."""


CHECKPOINT_HELP = ("Give a local folder holding the checkpoint (config.json, the *.safetensors weights and the "
                   "processor's files, as `save_pretrained` writes them; README.md, \"A real checkpoint\"), or a "
                   "bundled model: qwen3_vl or qwen3_5 (the glyph models, offline), or tiny (random weights).")


def locate_checkpoint(name: str, timeout: float = 3.0) -> tuple[str, bool]:
    """``(path_or_id, local_files_only)`` for a checkpoint, or a `CheckpointError` within seconds.

    A local folder must hold ``config.json``. A Hub id is loaded from the local Hugging Face cache
    when the Hub cannot be reached (``HF_HUB_OFFLINE=1``, or a ``timeout``-second probe fails), and
    fails at once when it is not cached, instead of after ``from_pretrained``'s retries.
    """
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"{name!r} is a folder without config.json, so it is not a checkpoint. "
                                  + CHECKPOINT_HELP)
        return path, True
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:  # a path, not "org/name"
        raise CheckpointError(f"there is no folder {name!r}. " + CHECKPOINT_HELP)
    import huggingface_hub
    from huggingface_hub import constants

    cached = isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return name, True
        raise CheckpointError(f"{name!r} is not a local folder and not in the Hugging Face cache, and the Hub is "
                              "off (HF_HUB_OFFLINE is set). " + CHECKPOINT_HELP)
    try:
        huggingface_hub.HfApi().model_info(name, timeout=timeout)
    except Exception as error:  # no network, DNS, timeout, not found, gated
        if cached:
            return name, True
        reason = " ".join(str(error).split())[:200]
        raise CheckpointError(f"{name!r} is not a local folder, not in the Hugging Face cache, and the Hub did not "
                              f"give it ({type(error).__name__}: {reason}). " + CHECKPOINT_HELP) from error
    return name, False


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def bundled_description(name: str, model) -> str:
    from .quality import BUNDLED

    return (f"the bundled {BUNDLED_TITLES[name]} ({type(model).__name__}, {count_parameters(model) / 1e6:.2f} M "
            f"parameters, trained on the glyph-grid benchmark; it knows only that task's words; "
            f"card: raincheck_hf/checkpoints/{BUNDLED[name]}/README.md)")


class LoadError(ValueError):
    """A model that cannot be loaded; the message says which and why (and what to give instead)."""


class LoadedModel(NamedTuple):
    model: object
    processor: object
    kind: str  # "bundled", "tiny" or "checkpoint" (`resolve_model`)
    name: str


def load_model(model_id: str | None, device: str, dtype=None, log=None) -> LoadedModel:
    """The model (on ``device``, eval mode; not enabled) and processor that ``model_id`` names (`resolve_model`).

    ``dtype``: a checkpoint's weights (default bf16 on CUDA, fp32 elsewhere; ``"auto"``: the checkpoint's own);
    the bundled models are fp32 and the tiny one is built in fp32. ``log``: where a line about what is loaded
    goes (default standard error). Raises `LoadError`.
    """
    log = log if log is not None else (lambda text: print(text, file=sys.stderr))
    kind, name = resolve_model(model_id)
    if kind == "tiny":
        from .tiny import build_tiny_processor, build_tiny_qwen3_vl

        log("[raincheck] --model tiny: a tiny Qwen3-VL built in code with RANDOM weights "
            "(answers are gibberish; the timings and restoration are real).")
        return LoadedModel(build_tiny_qwen3_vl(seed=0).to(device), build_tiny_processor(), kind, name)
    if kind == "bundled":
        from .quality import load_bundled

        try:
            model, processor = load_bundled(name, device=device)
        except (FileNotFoundError, OSError) as error:
            raise LoadError(f"could not load the bundled model {name}: {error}") from error
        log(f"[raincheck] model: {bundled_description(name, model)}.")
        return LoadedModel(model, processor, kind, name)
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        source, local_only = locate_checkpoint(name)
    except CheckpointError as error:
        raise LoadError(f"could not load {name}: {error}") from error
    log(f"[raincheck] loading {name}{'' if local_only else ' (downloading from the Hub if needed)'}...")
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        processor = AutoProcessor.from_pretrained(source, local_files_only=local_only)
        model = AutoModelForImageTextToText.from_pretrained(
            source, dtype=dtype, attn_implementation="sdpa", local_files_only=local_only).to(device)
    except OSError as error:
        raise LoadError(f"could not load {name}: {error}\n{CHECKPOINT_HELP}") from error
    return LoadedModel(model.eval(), processor, kind, name)


def load_or_exit(model_id: str | None, device: str) -> LoadedModel:
    """`load_model` for the command line: a `LoadError` ends the program with its message."""
    try:
        return load_model(model_id, device)
    except LoadError as error:
        raise SystemExit(f"[raincheck] {error}") from None


class _QuietFallbacks:
    """Drops transformers' "falling back to its reference PyTorch implementation" warnings, which
    would land in the middle of a streamed answer; `note_fallbacks` says it once instead."""

    def filter(self, record) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


def note_fallbacks(model) -> None:
    """On Qwen3.5 without fla / causal_conv1d: quiet transformers' per-call fallback warnings and say it once."""
    import importlib.util
    import logging

    if getattr(model.config, "model_type", None) != "qwen3_5":
        return
    logging.getLogger("transformers.integrations.hub_kernels").addFilter(_QuietFallbacks())
    missing = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"[raincheck] Qwen3.5's Gated DeltaNet layers run on transformers' PyTorch fallbacks ("
              f"{' and '.join(missing)} not installed): correct, slower.", file=sys.stderr)
