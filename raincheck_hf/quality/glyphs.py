"""Glyph grids: a procedural, seeded multi-turn visual dialogue benchmark.

An image is an n×n grid of 32-pixel cells, one cell per merged Qwen vision token (16 px patches,
2×2 merge). Every cell shows a glyph (a 4×4 bit pattern from a fixed library) drawn in a colour
over a grey background. Each (colour, glyph) pair occurs exactly once per image, so the pair is a
content address, and the cell's background level is the fact behind it:

    user:      <image> what is the background of the red g3 ?
    assistant: dim

Three properties make the benchmark measure what Raincheck is about (information hard pruning
loses and deferred prefill gives back):

- every cell carries its own fact, so no small set of salient tokens holds them all;
- facts are addressed by content (colour + glyph), which a small model can learn to retrieve,
  not by coordinates;
- some first turns ask for a long list that needs many cells spread over the image
  ("list the backgrounds of the red and blue glyphs ." → "red g0 dark red g3 pale …"), so
  restoration *during* the answer matters; follow-ups ask about colours the first question did not
  name, i.e. cells a selection made for the first question has no reason to keep.

Everything is deterministic given a seed: `dialogue(seed, grid)` and the fixed splits of
`benchmark_split`. Scoring is exact match per fact (`score_turn`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

CELL_PIXELS = 32  # one merged vision token: 2×2 patches of 16 px
GLYPH_BITS = 4  # glyphs are GLYPH_BITS × GLYPH_BITS patterns, 8 px per bit
LIBRARY_SIZE = 12
_LIBRARY_SEED = 20261202

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (30, 180, 30),
    "blue": (40, 60, 235),
    "yellow": (245, 225, 20),
    "cyan": (20, 215, 225),
    "magenta": (225, 30, 205),
    "orange": (250, 135, 20),
    "purple": (125, 40, 165),
    "brown": (135, 80, 30),
    "pink": (250, 155, 195),
}
BACKGROUNDS: dict[str, int] = {"dark": 20, "dim": 85, "pale": 160, "light": 230}
GLYPHS = tuple(f"g{i}" for i in range(LIBRARY_SIZE))
MAX_GRID = len(COLOURS)  # n colours × n glyphs fill an n×n grid exactly once each
MIN_GRID = 2

FACT_QUESTION = "what is the background of the {colour} {glyph} ?"
LIST_QUESTION = "list the backgrounds of the {first} and {second} glyphs ."


def glyph_library() -> torch.Tensor:
    """``[LIBRARY_SIZE, 4, 4]`` bool: distinct random patterns with 5 … 11 bits set (both colours show)."""
    rng = random.Random(_LIBRARY_SEED)
    patterns: list[tuple[int, ...]] = []
    while len(patterns) < LIBRARY_SIZE:
        bits = tuple(rng.random() < 0.5 for _ in range(GLYPH_BITS * GLYPH_BITS))
        # far from every earlier glyph (Hamming ≥ 5) so glyphs stay apart after the patch embedding
        if 5 <= sum(bits) <= 11 and all(sum(a != b for a, b in zip(bits, p)) >= 5 for p in patterns):
            patterns.append(bits)
    return torch.tensor(patterns, dtype=torch.bool).view(LIBRARY_SIZE, GLYPH_BITS, GLYPH_BITS)


@dataclass(frozen=True)
class Cell:
    row: int
    col: int
    colour: str
    glyph: str
    background: str


@dataclass(frozen=True)
class Turn:
    """One question and its reference answer.

    ``facts`` are the (colour, glyph, background) triples the answer states, in answer order; a
    ``fact`` turn states one, a ``list`` turn one per glyph of each colour asked.
    """

    question: str
    answer: str
    kind: str  # "fact" or "list"
    facts: tuple[tuple[str, str, str], ...]


@dataclass
class Dialogue:
    uid: str
    grid: int
    cells: list[Cell]
    turns: list[Turn]
    meta: dict = field(default_factory=dict)

    def render(self) -> torch.Tensor:
        """``[3, H, W]`` uint8."""
        return render_grids(*self.index_tensors())[0]

    def image(self):
        """The grid as a PIL image (what a user, the processor and the demo see)."""
        from PIL import Image

        return Image.fromarray(self.render().permute(1, 2, 0).contiguous().numpy())

    def index_tensors(self):
        """``[1, n, n]`` long tensors of colour, glyph and background indices, for `render_grids`."""
        n = self.grid
        colour_of = {c: i for i, c in enumerate(COLOURS)}
        glyph_of = {g: i for i, g in enumerate(GLYPHS)}
        background_of = {b: i for i, b in enumerate(BACKGROUNDS)}
        cells = sorted(self.cells, key=lambda c: (c.row, c.col))
        table = torch.tensor([[colour_of[c.colour], glyph_of[c.glyph], background_of[c.background]] for c in cells])
        colour, glyph, background = table.T.reshape(3, 1, n, n).unbind(0)
        return colour, glyph, background

    def messages(self, upto: int | None = None, with_answers: bool = True) -> list[dict]:
        """Chat messages (the image in the first user turn), turns ``[0, upto)``."""
        out = []
        for i, turn in enumerate(self.turns[:upto]):
            content = [{"type": "text", "text": turn.question}]
            if i == 0:
                content.insert(0, {"type": "image"})
            out.append({"role": "user", "content": content})
            if with_answers:
                out.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
        return out


def render_grids(colour: torch.Tensor, glyph: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """Draw ``B`` grids at once: index tensors ``[B, n, n]`` → ``[B, 3, 32n, 32n]`` uint8.

    Batched and device-agnostic (the trainer draws on the GPU); `Dialogue.image` uses it too, so
    training and evaluation images are the same pixels.
    """
    device = colour.device
    library = glyph_library().to(device)
    palette = torch.tensor(list(COLOURS.values()), dtype=torch.uint8, device=device)  # [C, 3]
    greys = torch.tensor(list(BACKGROUNDS.values()), dtype=torch.uint8, device=device)  # [G]
    scale = CELL_PIXELS // GLYPH_BITS
    bits = library[glyph]  # [B, n, n, 4, 4]
    fg = palette[colour]  # [B, n, n, 3]
    bg = greys[background][..., None].expand_as(fg)  # [B, n, n, 3]
    pixels = torch.where(bits[..., None], fg[:, :, :, None, None, :], bg[:, :, :, None, None, :])  # [B,n,n,4,4,3]
    b, n = pixels.shape[:2]
    pixels = pixels.permute(0, 5, 1, 3, 2, 4).reshape(b, 3, n * GLYPH_BITS, n * GLYPH_BITS)
    return pixels.repeat_interleave(scale, 2).repeat_interleave(scale, 3).contiguous()


def _fact(cell: Cell) -> tuple[str, str, str]:
    return (cell.colour, cell.glyph, cell.background)


def fact_turn(cell: Cell, question: str | None = None) -> Turn:
    """The single-fact turn about ``cell`` (its background)."""
    return Turn(question or FACT_QUESTION.format(colour=cell.colour, glyph=cell.glyph), cell.background, "fact",
                (_fact(cell),))


def list_turn(colours, glyphs, by_pair: dict, question: str | None = None) -> Turn:
    """The list turn for ``colours``: one (colour, glyph, background) triple per glyph, glyphs in library order."""
    facts = tuple(_fact(by_pair[(c, g)]) for c in colours for g in glyphs)
    return Turn(question or LIST_QUESTION.format(first=colours[0], second=colours[1]),
                " ".join(" ".join(f) for f in facts), "list", facts)


def dialogue(seed: int, grid: int, *, long_first: bool | None = None, follow_ups: int | None = None,
             uid: str | None = None) -> Dialogue:
    """One dialogue on a fresh ``grid × grid`` image, fully determined by ``seed``.

    Turn 1 is a two-colour list question (``long_first=True``) or a single fact; then
    ``follow_ups`` (default 2 or 3) single-fact questions about colours turn 1 did not name, each
    about a different cell. ``long_first=None`` draws it (half the dialogues).
    """
    if not MIN_GRID <= grid <= MAX_GRID:
        raise ValueError(f"grid must be in [{MIN_GRID}, {MAX_GRID}] (n colours × n glyphs), got {grid}")
    rng = random.Random(seed)
    colours = rng.sample(list(COLOURS), grid)
    glyphs = sorted(rng.sample(GLYPHS, grid), key=GLYPHS.index)
    pairs = [(c, g) for c in colours for g in glyphs]
    rng.shuffle(pairs)
    cells = [
        Cell(i // grid, i % grid, c, g, rng.choice(list(BACKGROUNDS))) for i, (c, g) in enumerate(pairs)
    ]
    by_pair = {(c.colour, c.glyph): c for c in cells}
    if long_first is None:
        long_first = rng.random() < 0.5
    if follow_ups is None:
        follow_ups = rng.choice((2, 3))

    turns: list[Turn] = []
    if long_first:
        asked = rng.sample(colours, 2)
        turns.append(list_turn(asked, glyphs, by_pair))
    else:
        first = by_pair[(rng.choice(colours), rng.choice(glyphs))]
        asked = [first.colour]
        turns.append(fact_turn(first))
    # follow-ups: colours the first question did not name (fall back to any on a tiny grid)
    others = [c for c in cells if c.colour not in asked] or [c for c in cells if _fact(c) not in turns[0].facts]
    for cell in rng.sample(others, min(follow_ups, len(others))):
        turns.append(fact_turn(cell))
    return Dialogue(uid or f"glyphs-{grid}-{seed}", grid, cells, turns, {"seed": seed, "long_first": long_first})


# The benchmark's fixed splits: seeds far apart from the trainer's stream (which starts at 0).
SPLITS = {"test": (1_000_000, 100), "dev": (2_000_000, 64)}
BENCHMARK_GRID = 10


def benchmark_split(split: str = "test", limit: int | None = None, grid: int = BENCHMARK_GRID) -> list[Dialogue]:
    """The ``test`` split (100 dialogues, half with a long first answer) or ``dev`` (64), on 10×10 grids."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    base, size = SPLITS[split]
    size = size if limit is None else min(limit, size)
    # alternate long / short first turns so any prefix of the split is balanced
    return [dialogue(base + i, grid, long_first=(i % 2 == 0), uid=f"{split}-{i:03d}") for i in range(size)]


def parse_facts(text: str) -> list[tuple[str, str, str]]:
    """Read "colour glyph background" triples out of a list answer (anything else is skipped)."""
    words = text.split()
    out, i = [], 0
    while i + 2 < len(words):
        c, g, b = words[i:i + 3]
        if c in COLOURS and g in GLYPHS and b in BACKGROUNDS:
            out.append((c, g, b))
            i += 3
        else:
            i += 1
    return out


def score_turn(turn: Turn, prediction: str) -> dict:
    """Exact match per fact.

    ``fact`` turn: ``correct`` is 1 if the first word of the answer is the background, else 0.
    ``list`` turn: per-item recall (``correct`` = true triples stated, out of ``total``) and
    precision (true triples over triples stated); a triple counts once.
    """
    if turn.kind == "fact":
        words = prediction.split()
        hit = int(bool(words) and words[0] == turn.facts[0][2])
        return {"correct": hit, "total": 1, "stated": 1 if words else 0, "precision": float(hit)}
    stated = list(dict.fromkeys(parse_facts(prediction)))
    truth = set(turn.facts)
    hits = sum(f in truth for f in stated)
    return {"correct": hits, "total": len(turn.facts), "stated": len(stated),
            "precision": hits / len(stated) if stated else 0.0}


def vocabulary() -> list[str]:
    """Every word the benchmark's questions and answers use (the word-level tokenizer's vocabulary)."""
    words = set(FACT_QUESTION.split()) | set(LIST_QUESTION.split())
    words -= {"{colour}", "{glyph}", "{first}", "{second}"}
    return sorted(words) + list(COLOURS) + list(GLYPHS) + list(BACKGROUNDS)
