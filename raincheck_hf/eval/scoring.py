"""Scorers: ``(turn, prediction) -> {"correct": int, "total": int, ...}``.

``glyph`` is the benchmark's exact match per fact (lists: per-item recall, with precision);
``exact`` compares whitespace- and case-normalised strings; ``contains`` checks the reference
occurs in the prediction. A custom scorer is any importable ``"module:function"`` with the same
signature.
"""

from __future__ import annotations

import importlib


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def glyph_scorer(turn, prediction: str) -> dict:
    from ..quality.glyphs import Turn, score_turn

    return score_turn(Turn(turn.question, turn.answer, turn.kind, tuple(turn.facts)), prediction)


def exact_scorer(turn, prediction: str) -> dict:
    hit = int(_normalise(prediction) == _normalise(turn.answer))
    return {"correct": hit, "total": 1}


def contains_scorer(turn, prediction: str) -> dict:
    hit = int(_normalise(turn.answer) in _normalise(prediction))
    return {"correct": hit, "total": 1}


SCORERS = {"glyph": glyph_scorer, "exact": exact_scorer, "contains": contains_scorer}


def get_scorer(name):
    if callable(name):
        return name
    if name in SCORERS:
        return SCORERS[name]
    if isinstance(name, str) and ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"scorer {name!r} could not be imported ({error})") from None
        if not callable(fn):
            raise ValueError(f"scorer {name!r} is not callable")
        return fn
    raise ValueError(f"scorer must be one of {sorted(SCORERS)} or 'module:function', got {name!r}")
