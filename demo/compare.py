"""The *Compare modes* tab: one question (and an optional follow-up) on one image through each mode.

Every mode gets the same settings, so ``hard``, ``post_answer`` and ``raincheck`` prefill the same patches first;
each `ModeRun` has the mode's map (where every patch ended up), its answers scored against the reference read off
a glyph grid, and its timings.
"""

import math
import threading
from dataclasses import dataclass, replace

from raincheck_hf.quality.references import glyph_reference, judge, missing_from_grid, read_glyph_grid

from .cache_map import VisualTurn, draw_picture, live_status
from .media import MediaLimits, prepare_turn
from .models import LoadedModel, vision_token_ids
from .session import Settings

COMPARE_MODES = ("full", "hard", "post_answer", "raincheck")
COMPARE_HEADERS = ["mode", "answer", "follow-up", "T1 (ms)", "TPOT (ms)", "restored during answer",
                   "restored after it", "dropped"]
COMPARE_PICTURE_WIDTH = 320
_WARM: set = set()  # (model, settings) pairs whose one-time costs (CUDA graph capture, ...) are paid
_WARM_LOCK = threading.Lock()


@dataclass
class ModeRun:
    """One mode's run of the comparison: its map, answer(s), scores and timings."""

    mode: str
    answer: str
    score: str  # against the reference read off the grid ("18/20 facts right", "right"), or why there is none
    reference: str | None
    ttft: float
    tpot: float
    during: int
    after: int
    dropped: int
    picture: object
    follow_up: str | None = None
    follow_up_score: str | None = None
    follow_up_reference: str | None = None

    def row(self) -> list[str]:
        ms = ["–" if math.isnan(t) else f"{t * 1e3:.1f}" for t in (self.ttft, self.tpot)]
        return [self.mode, self.score, self.follow_up_score or "–", *ms, str(self.during), str(self.after),
                str(self.dropped)]

    def markdown(self) -> str:
        ms = ["–" if math.isnan(t) else f"{t * 1e3:.1f} ms" for t in (self.ttft, self.tpot)]
        def said(answer, score, reference):
            return (f"> {answer or '*(empty answer)*'}\n\n**{score}**"
                    + (f" · reference: {reference}" if reference is not None else ""))

        text = f"**{self.mode}** · T1 {ms[0]} · TPOT {ms[1]}\n\n{said(self.answer, self.score, self.reference)}"
        if self.follow_up is not None:
            text += "\n\nFollow-up:\n\n" + said(self.follow_up, self.follow_up_score, self.follow_up_reference)
        return text


def _score(cells, question: str, answer: str) -> tuple[str, str | None]:
    """``(score, reference answer or None)`` for an answer to ``question`` about the grid ``cells``."""
    reference = glyph_reference(cells, question)
    if reference is not None:
        return judge(reference, answer), reference.answer
    missing = missing_from_grid(cells, question)
    return (f"no reference: {missing}" if missing else "no reference (not a glyph-grid question)"), None


def compare_modes(loaded: LoadedModel, path: str, question: str, follow_up: str, settings: Settings,
                  max_new_tokens: int = 64, limits: MediaLimits = MediaLimits()):
    """Run ``question`` (then ``follow_up``, if any) on the image or video at ``path`` in each of
    `COMPARE_MODES`, one fresh `Conversation` each; yields a `ModeRun` per mode, in order.

    Every mode gets the same settings, so ``hard``, ``post_answer`` and ``raincheck`` select the
    same tokens. A mode's map shows where each patch ended up once its restoration was done:
    prefilled first, restored during the answer, restored after it, or dropped. Before the first
    comparison of a model and settings, a short unshown pass of each mode pays the one-time costs
    (the CUDA fast path captures its graphs on first use), so that T1 and TPOT compare the modes.
    Raises ValueError (a message for the visitor) for a file the model cannot take.
    """
    from raincheck_hf import Conversation

    if not str(question or "").strip():
        raise ValueError("Type a question to compare the modes on.")
    if not path:
        raise ValueError("Choose an image (or click the example) to compare the modes on.")
    prepared = prepare_turn([path], loaded.processor, limits=limits)
    if prepared.problems:
        raise ValueError(" ".join(prepared.problems))
    asked, follow = question.strip(), str(follow_up or "").strip() or None
    if loaded.bundled:
        asked, follow = asked.lower(), follow.lower() if follow else None
    single = len(prepared.images) == 1 and not prepared.videos
    cells = read_glyph_grid(prepared.images[0]) if single else None
    config = loaded.model.config
    kwargs = {"suppress_tokens": vision_token_ids(config)}
    media = {"images": prepared.images, "videos": prepared.videos, "video_fps": prepared.video_fps}
    with _WARM_LOCK:
        warm = (loaded.name, replace(settings, mode="raincheck")) in _WARM
        _WARM.add((loaded.name, replace(settings, mode="raincheck")))
    if not warm:
        for mode in COMPARE_MODES:
            with Conversation(loaded.model, loaded.processor, replace(settings, mode=mode).config(),
                              background=False) as conversation:
                conversation.ask(asked, max_new_tokens=settings.decode_guard + 2, **media, **kwargs)
                conversation.complete()
    for mode in COMPARE_MODES:
        with Conversation(loaded.model, loaded.processor, replace(settings, mode=mode).config(),
                          background=False) as conversation:
            result = conversation.ask(asked, max_new_tokens=int(max_new_tokens), **media, **kwargs)
            conversation.complete()  # what post_answer and raincheck restore after the answer
            turn = VisualTurn(1, prepared.views, 0)
            turn.use_trace(result.trace)
            turn.locate(conversation.cache, config.image_token_id, config.video_token_id)
            states = turn.states(live_status(conversation.cache))
            picture = draw_picture(turn.views, states, width=COMPARE_PICTURE_WIDTH, max_height=260)
            run = ModeRun(mode, result.text, *_score(cells, asked, result.text), result.time_to_first_token,
                          result.time_per_output_token, result.restored_during_answer, result.restored_after_answer,
                          len(result.trace.dropped), picture)
            if follow:
                second = conversation.ask(follow, max_new_tokens=int(max_new_tokens), **kwargs)
                run.follow_up = second.text
                run.follow_up_score, run.follow_up_reference = _score(cells, follow, second.text)
        yield run


def small_model_note(loaded: LoadedModel) -> str:
    """Why T1 need not favour the pruned modes with a small model on a CPU (said under the comparison)."""
    if not (loaded.bundled or loaded.is_tiny) or getattr(loaded.model.device, "type", "cpu") != "cpu":
        return ""
    return ("\n\n*Why `full` can have the fastest first token here: with a model this small on a CPU, the first "
            "token takes about as long in every mode. Most of it is work every mode does; prefilling 30% of the "
            "image instead of all of it saves a few milliseconds, and selecting that 30% costs about as much, so "
            "one run's T1 can put any mode first. The time saved grows with the model and the image: for "
            "Qwen3-VL-8B on a GPU, `raincheck`'s first token comes 18% sooner than `full`'s (README.md, "
            "Benchmarks).*")


def compare_frame(rows):
    """The side-by-side table of `ModeRun.row` rows."""
    import pandas as pd

    return pd.DataFrame(rows, columns=COMPARE_HEADERS)
