"""Streaming an answer to the page: the updates a turn yields (`Step`) and the pace they are shown at (`pace`).

Redrawn per token, the picture, caption and figures slowed the answer they showed (Python on the page's thread
competes with generation; demo/README.md has the numbers), so a token's update is shown at most every so often.
*Slow motion* (`Pause`) goes the other way: a pause per generated token, to watch the map fill in.
"""

import math
import time
from dataclasses import dataclass

# the page streams an answer's text at most this often, and redraws the picture, caption and figures at most this
# often: per token, that work would slow the answer it shows (Python on the page's thread competes with generation)
STREAM_TEXT_EVERY_S = 0.1
STREAM_PICTURE_EVERY_S = 0.5


class Pause:
    """A logits processor that sleeps before each token is chosen: the demo's *slow motion*."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, input_ids, scores):
        time.sleep(self.seconds)
        return scores


@dataclass
class Step:
    """What one update of the page changes besides the chat, the caption and the figures."""

    picture: bool | str = True  # True: redraw if it changed; "force": redraw; False: leave it
    timer: bool | None = None  # start / stop the timer that follows idle-time restoration
    textbox: str | None = None  # "lock" (cleared, disabled while answering), "clear", "keep_files"
    files: tuple = ()
    model_choice: str | None = None  # what the model dropdown shows (after a change, or to undo a failed one)
    model_note: str | None = None
    token: bool = False  # one more piece of the answer: shown at most every STREAM_*_EVERY_S (see `pace`)


def pace(steps, text_every: float = STREAM_TEXT_EVERY_S, picture_every: float = STREAM_PICTURE_EVERY_S,
         clock=time.perf_counter):
    """``(what, step)`` for the steps worth showing: ``what`` is ``"all"`` (render everything) or ``"text"``
    (the chat only). Every step but a token's is shown at once; a token's at most every ``text_every``
    seconds, and with the picture, caption and figures at most every ``picture_every`` seconds, so that the
    page's work does not slow the answer it shows. The step after the last token (the turn's end) draws
    everything."""
    shown_text = shown_all = -math.inf
    for step in steps:
        if not step.token:
            yield "all", step
            continue
        now = clock()
        if now - shown_all >= picture_every:
            shown_all = shown_text = now
            yield "all", step
        elif now - shown_text >= text_every:
            shown_text = now
            yield "text", step

