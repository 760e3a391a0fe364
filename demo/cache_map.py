"""The map: a turn's pictures with every merged vision token shaded by what the cache holds for it.

`live_status` reads the cache (consistently, while another thread may be appending rows); a `VisualTurn` knows
where its images' tokens sit among the conversation's source positions and gives each one a state (prefilled
first, deferred, restored during or after the answer, dropped, or waiting for the prefill); `draw_picture` draws
the views side by side with a legend of the counts.
"""

import time
from dataclasses import dataclass

import torch

PICTURE_WIDTH = 640
LEGEND_LABELS = [("selected", "prefilled first"), ("deferred", "deferred"), ("during", "restored during answer"),
                 ("after", "restored after it"), ("dropped", "dropped"), ("waiting", "prefilling")]
STATES = tuple(state for state, _ in LEGEND_LABELS)


@dataclass
class LiveStatus:
    """Source positions by what the cache holds for them, read from a running conversation."""

    in_cache: set
    restored: set
    pending: set
    dropped: set


def live_status(cache) -> LiveStatus:
    """A consistent read of the cache's public attributes while another thread may be appending rows.

    `DeferredDynamicCache.add_rows` replaces ``row_sources`` and ``row_kinds`` one after the other,
    so a read can see them at different lengths for a moment; retry until they agree. (A
    ``Conversation.snapshot()`` taken under the conversation's lock would make this unnecessary.)
    """
    empty = torch.empty(0, dtype=torch.long)
    if cache is None:
        return LiveStatus(set(), set(), set(), set())
    for _ in range(100):
        rows = cache.row_sources
        try:
            restored = cache.restored_sources()
        except (IndexError, RuntimeError):
            time.sleep(0.001)
            continue
        pending = cache.pending_sources
        dropped = getattr(cache, "dropped", empty)
        return LiveStatus(set(rows.tolist()), set(restored.tolist()), set(pending.tolist()), set(dropped.tolist()))
    return LiveStatus(set(), set(), set(), set())


@dataclass
class VisualTurn:
    """The images / videos of one turn and where their tokens sit in the conversation."""

    number: int  # turn number in its conversation, from 1
    views: list  # SegmentView per trace segment, in source order
    start: int  # source position where the turn's new tokens begin (after the previous sequences)
    positions: list | None = None  # per view: source positions (from the trace once the turn ended)
    during: set | None = None  # positions restored during the answer (from the trace once the turn ended)
    result: object = None  # the turn's TurnResult once it ended

    def locate(self, cache, image_token_id: int, video_token_id: int) -> bool:
        """Find the views' source positions in the cache's token ids (once the turn is prefilled).

        The trace's ``segments`` give them exactly when `generate` returns; while the answer
        streams they are read off ``cache.source_ids``: each view takes the next ``h * w``
        image-pad (or video-pad) positions of the turn, in source order.
        """
        if self.positions is not None:
            return True
        if cache is None or cache.source_length <= self.start:
            return False
        ids = cache.source_ids[self.start:]
        queues = {"image": ((ids == image_token_id).nonzero().flatten() + self.start).tolist(),
                  "video": ((ids == video_token_id).nonzero().flatten() + self.start).tolist()}
        positions = []
        for view in self.views:
            n = view.grid[1] * view.grid[2]
            queue = queues[view.modality]
            if len(queue) < n:
                return False
            positions.append(queue[:n])
            del queue[:n]
        self.positions = positions
        return True

    def use_trace(self, trace) -> None:
        self.during = {int(p) for r in trace.restored_per_forward[1:] for p in r.tolist()}
        segments = list(trace.segments)
        if len(segments) == len(self.views) and all(
            tuple(grid) == tuple(view.grid) for (_, grid, _), view in zip(segments, self.views)
        ):
            self.positions = [list(map(int, pos)) for _, _, pos in segments]

    def states(self, live: LiveStatus) -> list[list[str]]:
        """Per view, per merged token (row-major): selected / deferred / during / after / dropped / waiting.

        ``during`` and ``after``: restored during the answer, or after it (idle time, or the next
        question's prefill). While the answer streams, everything restored so far is ``during``.
        """
        if self.positions is None:
            return [["waiting"] * (v.grid[1] * v.grid[2]) for v in self.views]
        out = []
        for positions in self.positions:
            row = []
            for p in positions:
                if p in live.dropped:
                    row.append("dropped")
                elif p in live.restored:
                    row.append("during" if self.during is None or p in self.during else "after")
                elif p in live.pending or p not in live.in_cache:  # pending, or a chunk in flight
                    row.append("deferred")
                else:
                    row.append("selected")
            out.append(row)
        return out


# per state: the cell's fill and outline (RGBA); the timeline's bars take the outline colour
FILL = {
    "selected": ((59, 130, 246, 70), (37, 99, 235, 255)),
    "deferred": ((15, 23, 42, 215), (51, 65, 85, 255)),
    "during": ((34, 197, 94, 120), (21, 128, 61, 255)),
    "after": ((168, 85, 247, 110), (126, 34, 206, 255)),
    "dropped": ((239, 68, 68, 150), (185, 28, 28, 255)),
    "waiting": ((148, 163, 184, 110), None),
}


def draw_picture(views, states, width: int = PICTURE_WIDTH, max_height: int = 480):
    """The views side by side (2 or 4 per row) with each merged token's cell shaded by its state."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(views)
    cols = 1 if n == 1 else 2 if n <= 4 else 4
    gap = 6
    tile_w = (width - gap * (cols - 1)) // cols
    if n == 1:  # a tall image: narrower rather than taller than the chat beside it
        tile_w = min(tile_w, round(max_height * views[0].picture.width / views[0].picture.height))
    tiles = []
    for view, cell_states in zip(views, states):
        tile_h = max(1, round(view.picture.height * tile_w / view.picture.width))
        tile = view.tile(tile_w, tile_h)
        overlay = Image.new("RGBA", tile.size, (0, 0, 0, 0))
        draw = ImageDraw.Draw(overlay)
        gh, gw = view.grid[1], view.grid[2]
        line = 3 if tile_w / gw >= 40 else 2 if tile_w / gw >= 16 else 1
        for index, state in enumerate(cell_states):
            r, c = divmod(index, gw)
            box = (round(c * tile_w / gw), round(r * tile_h / gh),
                   round((c + 1) * tile_w / gw) - 1, round((r + 1) * tile_h / gh) - 1)
            fill, outline = FILL[state]
            draw.rectangle(box, fill=fill, outline=outline, width=line if outline else 0)
            if state == "dropped":
                draw.line(box, fill=outline, width=line)
                draw.line((box[0], box[3], box[2], box[1]), fill=outline, width=line)
        tile = Image.alpha_composite(tile, overlay)
        if n > 1:
            label = ImageDraw.Draw(tile)
            font = ImageFont.load_default(size=12 if cols > 2 else 14)
            x0, y0, x1, y1 = label.textbbox((4, 3), view.label, font=font)
            label.rectangle((x0 - 3, y0 - 2, x1 + 3, y1 + 2), fill=(255, 255, 255, 230))
            label.text((4, 3), view.label, fill=(15, 23, 42, 255), font=font)
        tiles.append(tile.convert("RGB"))
    rows = [tiles[i:i + cols] for i in range(0, n, cols)]
    flat_states = [s for view in states for s in view]
    legend_h = 8 + 22 * len(_legend_lines(flat_states, width))
    height = sum(max(t.height for t in row) for row in rows) + gap * (len(rows) - 1) + legend_h
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    x0 = (width - tile_w) // 2 if n == 1 else 0
    y = 0
    for row in rows:
        for j, tile in enumerate(row):
            canvas.paste(tile, (x0 + j * (tile_w + gap), y))
        y += max(t.height for t in row) + gap
    _draw_legend(canvas, y + 4, flat_states)
    return canvas


def _legend_lines(flat_states, width: int) -> list[list[tuple[str, str, int]]]:
    """The legend's entries ``(state, text, x)``, wrapped into lines that fit ``width``."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=14)
    lines, x = [[]], 2
    for state, label in LEGEND_LABELS:
        count = flat_states.count(state)
        if state == "waiting" and not count:  # a moment at the start of a turn; the others always show
            continue
        text = f"{label} {count}"
        size = 22 + int(font.getlength(text)) + 16
        if x > 2 and x + size - 16 > width:
            lines.append([])
            x = 2
        lines[-1].append((state, text, x))
        x += size
    return lines


def _draw_legend(canvas, y: int, flat_states) -> None:
    """Swatches with counts under the tiles (drawn, so it needs no emoji font in the browser)."""
    from PIL import ImageDraw, ImageFont

    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=14)
    for line in _legend_lines(flat_states, canvas.width):
        for state, text, x in line:
            fill, outline = FILL[state]
            draw.rectangle((x, y + 3, x + 16, y + 19), fill=fill[:3], outline=outline[:3] if outline else None,
                           width=2)
            draw.text((x + 22, y + 3), text, fill=(15, 23, 42), font=font)
        y += 22

