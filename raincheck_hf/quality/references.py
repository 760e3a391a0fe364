"""References for glyph-grid questions asked about any image: the CLI's and the demo's scoring.

`read_glyph_grid` recovers the cells of a grid drawn by `glyphs` from its pixels (so a user's own
saved grid gets references too), `glyph_reference` builds the reference `Turn` of a question in the
benchmark's two forms, `judge` phrases its score.
"""

from __future__ import annotations

import re

from .glyphs import (BACKGROUNDS, CELL_PIXELS, COLOURS, FACT_QUESTION, GLYPH_BITS, GLYPHS, LIST_QUESTION, MAX_GRID,
                     MIN_GRID, Cell, fact_turn, glyph_library, list_turn, score_turn)


def read_glyph_grid(image):
    """The `Cell`s of a glyph grid read off its pixels, or ``None`` when ``image`` is not one.

    Exact: a grid drawn by `raincheck_hf.quality.glyphs` (and saved losslessly, e.g. as PNG) is
    flat 8 × 8 px blocks, each a palette colour (glyph bit set) or a background grey.
    """
    import numpy as np

    width, height = image.size
    if width != height or width % CELL_PIXELS or not MIN_GRID <= width // CELL_PIXELS <= MAX_GRID:
        return None
    n, scale, bits = width // CELL_PIXELS, CELL_PIXELS // GLYPH_BITS, GLYPH_BITS
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16).reshape(n * bits, scale, n * bits, scale, 3)
    if (pixels != pixels[:, :1, :, :1]).any():  # not flat blocks
        return None
    blocks = pixels[:, 0, :, 0]  # [4n, 4n, 3]: one sample per glyph bit
    palette = {tuple(rgb): name for name, rgb in COLOURS.items()}
    greys = {(v, v, v): name for name, v in BACKGROUNDS.items()}
    library = {tuple(p.flatten().tolist()): GLYPHS[i] for i, p in enumerate(glyph_library())}
    cells = []
    for r in range(n):
        for c in range(n):
            colours, backgrounds, pattern = set(), set(), []
            for rgb in map(tuple, blocks[r * bits:(r + 1) * bits, c * bits:(c + 1) * bits].reshape(-1, 3).tolist()):
                if rgb in palette:
                    colours.add(palette[rgb])
                    pattern.append(True)
                elif rgb in greys:
                    backgrounds.add(greys[rgb])
                    pattern.append(False)
                else:
                    return None
            glyph = library.get(tuple(pattern))
            if len(colours) != 1 or len(backgrounds) != 1 or glyph is None:
                return None
            cells.append(Cell(r, c, colours.pop(), glyph, backgrounds.pop()))
    return cells


def words_of(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]+", text.lower())


def _match(template: str, words: list[str]) -> dict | None:
    """Bind a question template's ``{slots}`` to ``words`` (the final punctuation is optional)."""
    slots = template.split()
    if slots and slots[-1] in "?." and words and words[-1] not in "?.":
        slots = slots[:-1]
    if len(slots) != len(words):
        return None
    bound = {}
    for slot, word in zip(slots, words):
        if slot.startswith("{"):
            bound[slot.strip("{}")] = word
        elif slot != word:
            return None
    return bound


def glyph_reference(cells, question: str):
    """The reference `Turn` for a benchmark question about the grid ``cells``, or ``None``.

    Understands the benchmark's two question forms (``what is the background of the red g3 ?``,
    ``list the backgrounds of the red and blue glyphs .``), case and final punctuation aside.
    """
    if not cells:
        return None
    words = words_of(question)
    by_pair = {(c.colour, c.glyph): c for c in cells}
    fact = _match(FACT_QUESTION, words)
    if fact is not None:
        cell = by_pair.get((fact["colour"], fact["glyph"]))
        if cell is None:
            return None
        return fact_turn(cell, question)
    listed = _match(LIST_QUESTION, words)
    if listed is not None:
        colours = [listed["first"], listed["second"]]
        glyphs = sorted({c.glyph for c in cells}, key=GLYPHS.index)
        if any((colour, glyphs[0]) not in by_pair for colour in colours):
            return None
        return list_turn(colours, glyphs, by_pair, question)
    return None


def missing_from_grid(cells, question: str) -> str | None:
    """Why a benchmark-form question has no reference on ``cells`` (it names a glyph or colour the grid lacks)."""
    if not cells or glyph_reference(cells, question) is not None:
        return None
    words = words_of(question)
    fact, listed = _match(FACT_QUESTION, words), _match(LIST_QUESTION, words)
    if fact is not None:
        return f"this grid has no {fact['colour']} {fact['glyph']}"
    if listed is not None:
        present = {c.colour for c in cells}
        absent = [c for c in (listed["first"], listed["second"]) if c not in present]
        return f"this grid has no {' or '.join(absent)} glyphs"
    return None


def judge(reference, answer: str) -> str:
    """``right`` / ``wrong`` for a fact, ``k/n facts right`` for a list (`glyphs.score_turn`)."""
    score = score_turn(reference, answer)
    if reference.kind == "fact":
        return "right" if score["correct"] else "wrong"
    extra = f", {score['stated']} stated" if score["stated"] != score["total"] else ""
    return f"{score['correct']}/{score['total']} facts right{extra}"
