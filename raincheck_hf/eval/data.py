"""Dialogues to evaluate: the glyph benchmark's splits, or a user's JSONL file.

JSONL format (one dialogue per line; image paths relative to the file):

    {"id": "kitchen-1", "images": ["kitchen.jpg"],
     "turns": [{"question": "What is on the table?", "answer": "a red mug", "kind": "text"},
               {"question": "What colour is the mug?", "answer": "red"}]}

``images`` are shown with the first question (the HF convention for a conversation about one
set of images). ``kind`` is optional (``"text"`` by default) and reaches the scorer, as does an
optional ``facts`` list; every other field of a turn is kept in ``extra`` for custom scorers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EvalTurn:
    question: str
    answer: str
    kind: str = "text"
    facts: tuple = ()
    extra: dict = field(default_factory=dict)


@dataclass
class EvalDialogue:
    uid: str
    images: list  # PIL images (or paths), shown with the first question
    turns: list[EvalTurn]
    source: object = None  # the glyph `Dialogue`, when it came from the benchmark

    def load_images(self):
        from PIL import Image

        return [Image.open(i).convert("RGB") if isinstance(i, (str, Path)) else i for i in self.images]


def glyph_dialogues(split: str = "test", limit: int | None = None) -> list[EvalDialogue]:
    from ..quality.glyphs import benchmark_split

    out = []
    for d in benchmark_split(split, limit=limit):
        turns = [EvalTurn(t.question, t.answer, t.kind, t.facts) for t in d.turns]
        out.append(EvalDialogue(d.uid, [d.image()], turns, source=d))
    return out


def load_jsonl(path) -> list[EvalDialogue]:
    """Read a JSONL file of dialogues; errors name the line and the field."""
    path = Path(path)
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(row, dict) or not isinstance(row.get("turns"), list) or not row["turns"]:
            raise ValueError(f"{where}: a dialogue needs a non-empty 'turns' list")
        images = row.get("images", [])
        if not isinstance(images, list):
            raise ValueError(f"{where}: 'images' must be a list of paths, got {type(images).__name__}")
        resolved = []
        for image in images:
            p = (path.parent / image) if not Path(image).is_absolute() else Path(image)
            if not p.is_file():
                raise ValueError(f"{where}: image {image!r} not found (looked at {p})")
            resolved.append(p)
        turns = []
        for i, t in enumerate(row["turns"]):
            if not isinstance(t, dict) or not isinstance(t.get("question"), str) or not isinstance(t.get("answer"), str):
                raise ValueError(f"{where}: turn {i} needs string 'question' and 'answer' fields")
            rest = {k: v for k, v in t.items() if k not in ("question", "answer", "kind", "facts")}
            facts = tuple(tuple(f) if isinstance(f, list) else f for f in t.get("facts", ()))
            turns.append(EvalTurn(t["question"], t["answer"], t.get("kind", "text"), facts, rest))
        out.append(EvalDialogue(str(row.get("id", f"{path.stem}-{lineno}")), resolved, turns))
    if not out:
        raise ValueError(f"{path}: no dialogues")
    return out
