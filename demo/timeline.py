"""The restoration timeline: which of a turn's deferred patches came back at which step, as a map and a strip.

Built once the turn's restoration is over, from the turn's trace and the cache (`build_timeline`); the page's
slider shows the map at one step (`timeline_states`), a line describing it (`describe_step`) and a strip with one
bar per step (`draw_timeline`).
"""

import time
from dataclasses import dataclass

from .cache_map import FILL, PICTURE_WIDTH, VisualTurn

TIMELINE_WAITING = ("Timeline: when a turn's restoration is done, drag the slider (or press *Replay*) to see which "
                    "deferred patch came back at which generated token, and which after the answer.")


@dataclass
class TimelineStep:
    """One step of a turn's restoration: the deferred positions that came back in it."""

    label: str  # "first token", "token 17", "idle chunk 2", "next question's prefill"
    phase: str  # "prefill" (nothing restored yet), "during" (fused into a decode step), "after"
    restored: list  # source positions restored at this step, in order


def build_timeline(turn: VisualTurn, cache, chunk_size: int, next_result=None) -> list[TimelineStep]:
    """Which of ``turn``'s deferred patches came back at which step, from its trace and the cache.

    Step 0 is the first token (nothing restored: what the answer starts from). Step ``i`` (from 1)
    is the decode step that consumed generated token ``i``, with the chunk fused into it (the trace's
    ``restored_per_forward[i]``); then the chunks restored after the answer: idle-time chunks (the
    cache stores them in restoration order, ``chunk_size`` at a time) and, when a follow-up came
    first, the rest at the next question's prefill (``next_result``'s forward 0).
    """
    result = turn.result
    if result is None or turn.positions is None:
        return []
    mine = {p for positions in turn.positions for p in positions}
    steps = [TimelineStep("first token", "prefill", [])]
    forwards = result.trace.restored_per_forward
    for i, rows in enumerate(forwards[1:], 1):
        steps.append(TimelineStep(f"token {i}", "during", [p for p in rows.tolist() if p in mine]))
    during = {p for step in steps for p in step.restored}
    at_next = []
    if next_result is not None and next_result.trace.restored_per_forward:
        at_next = [p for p in next_result.trace.restored_per_forward[0].tolist() if p in mine]
    later = set(at_next)
    after = [p for p in live_restored_order(cache) if p in mine and p not in during and p not in later]
    for j in range(0, len(after), max(1, chunk_size)):
        steps.append(TimelineStep(f"idle chunk {j // max(1, chunk_size) + 1}", "after", after[j:j + chunk_size]))
    if at_next:
        steps.append(TimelineStep("next question's prefill", "after", at_next))
    return steps


def live_restored_order(cache) -> list[int]:
    """The restored deferred positions in the order they entered the cache (a consistent read)."""
    for _ in range(100):
        try:
            return cache.restored_sources().tolist() if cache is not None else []
        except (IndexError, RuntimeError):  # read while a forward appends rows; read again
            time.sleep(0.001)
    return []


def timeline_states(turn: VisualTurn, steps: list[TimelineStep], upto: int, dropped=()) -> list[list[str]]:
    """Per view, per merged token: the state after step ``upto`` of ``steps``."""
    phase = {}
    for step in steps[:upto + 1]:
        for p in step.restored:
            phase[p] = step.phase
    deferred = {p for step in steps for p in step.restored}
    dropped = set(dropped)
    return [["dropped" if p in dropped else phase[p] if p in phase else "deferred" if p in deferred else "selected"
             for p in positions] for positions in turn.positions]


def describe_step(steps: list[TimelineStep], upto: int) -> str:
    """One line for the scrubber: where it is and how much has come back by then."""
    total = sum(len(s.restored) for s in steps)
    answer = sum(1 for s in steps if s.phase != "after")  # the first token and the decode steps
    step = steps[upto]
    done = sum(len(s.restored) for s in steps[:upto + 1])
    during = sum(len(s.restored) for s in steps[:upto + 1] if s.phase == "during")
    if step.phase == "after":
        where = f"**after the answer, {step.label}**"
    elif upto == 0:
        where = "**the first token** (the answer starts from the patches prefilled first)"
    else:  # step i is the decode step that read generated token i (and produced token i + 1)
        where = f"**decode step {upto} of {answer - 1}**, which read generated token {upto}"
    came = f"{len(step.restored)} came back in this step" if step.restored else "nothing came back in this step"
    return (f"Timeline: {where}: {came}; {done} of {total} deferred patches restored so far "
            f"({during} during the answer, {done - during} after it).")


def draw_timeline(steps: list[TimelineStep], upto: int, width: int = PICTURE_WIDTH, height: int = 86):
    """A strip: one bar per step (its height: patches restored then), green during the answer,
    violet after it; a marker at step ``upto``."""
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=12)
    left, right, top, bottom = 6, width - 6, 6, height - 22
    n = len(steps)
    most = max([len(s.restored) for s in steps] + [1])
    step_w = (right - left) / max(n, 1)
    answer_end = left + step_w * sum(1 for s in steps if s.phase != "after")
    draw.rectangle((left, top, answer_end, bottom), fill=(240, 253, 244))
    draw.rectangle((answer_end, top, right, bottom), fill=(250, 245, 255))
    for i, step in enumerate(steps):
        if not step.restored:
            continue
        fill, outline = FILL[step.phase]
        h = max(2, round((bottom - top) * len(step.restored) / most))
        x0 = left + step_w * i
        draw.rectangle((x0 + (1 if step_w > 3 else 0), bottom - h, x0 + max(step_w - 1, 1), bottom),
                       fill=outline[:3])
    x = left + step_w * (upto + 0.5)
    draw.line((x, top - 4, x, bottom + 2), fill=(15, 23, 42), width=2)
    answer = sum(1 for s in steps if s.phase != "after")
    draw.text((left, bottom + 5), f"answer: {answer} tokens", fill=(21, 128, 61), font=font)
    if n > answer:
        text = f"after the answer: {n - answer} step{'s' if n - answer != 1 else ''}"
        draw.text((max(answer_end + 4, right - draw.textlength(text, font=font)), bottom + 5), text,
                  fill=(126, 34, 206), font=font)
    return canvas
