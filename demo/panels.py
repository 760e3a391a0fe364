"""What the page shows of a session: the map and its counts, the timeline at a step, the caption, the per-turn
figures and the JSON state (the *Live trace* panel and the ``/status`` API).

Read-only views of a `demo.session.Session`, except for what the page was last sent (``session.drawn``), so that
the map is redrawn only when it changed.
"""

import math
from dataclasses import fields

from .cache_map import STATES, draw_picture, live_status
from .timeline import build_timeline, describe_step, draw_timeline, live_restored_order, timeline_states

FIGURE_HEADERS = ["turn", "visual tokens", "prefilled first", "TTFT (ms)", "TPOT (ms)",
                  "restored during answer", "restored after answer", "pending", "dropped"]


def picture_and_counts(session, draw: bool = True, force: bool = False):
    """``(picture or None, counts or None, changed)`` for the latest turn with images or videos."""
    if not session.visual_turns:
        changed = force or session.drawn is not None
        if draw:
            session.drawn = None
        return None, None, changed
    turn = session.visual_turns[-1]
    if session.loaded is not None:
        config = session.loaded.model.config
        turn.locate(session.cache, config.image_token_id, config.video_token_id)
    states = turn.states(live_status(session.cache))
    flat = [s for view in states for s in view]
    counts = {name: flat.count(name) for name in STATES}
    signature = (id(turn), tuple(flat))
    changed = force or signature != session.drawn
    if not (draw and changed):
        return None, counts, changed
    session.drawn = signature
    return draw_picture(turn.views, states), counts, True


def timeline(session):
    """``(turn, steps)``: the latest visual turn and its `build_timeline` once its restoration is
    over (``steps`` is None while it answers or restores)."""
    if not session.visual_turns:
        return None, None
    turn = session.visual_turns[-1]
    if session.answering or turn.result is None or session.pending:
        return turn, None
    turns = session.conversation.turns if session.conversation is not None else []
    following = turns[turn.number] if len(turns) > turn.number else None
    return turn, build_timeline(turn, session.cache, session.settings.chunk_size, following)


def timeline_view(session, upto: int | None = None):
    """``(picture, strip, text, upto, steps)`` for the timeline at step ``upto`` (default: the last)."""
    turn, steps = timeline(session)
    if not steps:
        return None, None, None, 0, steps
    upto = len(steps) - 1 if upto is None else max(0, min(int(upto), len(steps) - 1))
    dropped = turn.result.trace.dropped.tolist()
    picture = draw_picture(turn.views, timeline_states(turn, steps, upto, dropped))
    if dropped:
        text = (f"Timeline: mode `hard` dropped the {len(dropped)} deferred patches for good: nothing comes "
                "back, at any token.")
    elif len(steps) == 1 or not any(step.restored for step in steps):
        text = "Timeline: nothing was deferred in this turn, so nothing had to come back."
    else:
        text = describe_step(steps, upto)
    return picture, draw_timeline(steps, upto), text, upto, steps


def heading(session) -> str:
    """The caption's first line: the conversation and its settings."""
    s = session.settings
    return f"Conversation {session.number} · mode `{s.mode}` · selector `{s.selector}` · retention {s.retention:g}"


def caption(session, counts) -> str:
    """The caption under the map: the turn's state and its counts (``counts`` None: no picture yet, what to do)."""
    head = heading(session)
    if session.slow_motion_ms:
        head += f" · slow motion {session.slow_motion_ms} ms/token (in the timings too)"
    if counts is None:
        return (f"{head}\n\nAttach an image or a video and ask about it: this panel shows which of its patches "
                "the model read first (blue), which it deferred (dark), which were restored while it answered "
                "(green) and which after the answer (violet); `hard` drops them for good (red). The timeline "
                "under it replays the restoration token by token.")
    if session.answering:
        state = "answering…"
    elif session.busy and session.busy.startswith("loading"):
        state = session.busy + "…"
    elif session.pending:
        state = f"answer done · restoring in idle time ({session.pending} pending)"
    elif counts["dropped"]:
        state = "ready · the dropped tokens are gone for good"
    else:
        state = "ready · every deferred token is in the cache"
    total = sum(counts.values())
    shown = session.visual_turns[-1].number
    if session.answering and session.live is not None and session.live["number"] != shown:
        state = f"the picture is turn {shown}'s; turn {session.live['number']} (no new image) is being answered…"
    if counts["waiting"]:
        numbers = "prefilling the first tokens…"
    else:
        numbers = (f"{counts['selected']} prefilled first · {counts['deferred']} deferred · "
                   f"{counts['during']} restored during the answer · {counts['after']} after it · "
                   f"{counts['dropped']} dropped")
    return f"{head}\n\n**Turn {shown}** ({total} visual tokens): **{state}** — {numbers}"


def timeline_caption(session, upto: int) -> str | None:
    """The caption while the picture shows step ``upto`` of the latest turn's timeline (not the live cache)."""
    turn, steps = timeline(session)
    if not steps:
        return None
    upto = max(0, min(int(upto), len(steps) - 1))
    states = timeline_states(turn, steps, upto, turn.result.trace.dropped.tolist())
    head = heading(session)
    flat = [state for view in states for state in view]
    step = steps[upto]
    when = ("the first token" if upto == 0 else f"after the answer, {step.label}" if step.phase == "after"
            else f"decode step {upto}")
    return (f"{head}\n\n**Turn {session.visual_turns[-1].number}** ({len(flat)} visual tokens): **the timeline at "
            f"{when}** — {flat.count('selected')} prefilled first · {flat.count('deferred')} still deferred then · "
            f"{flat.count('during')} restored during the answer · {flat.count('after')} after it · "
            f"{flat.count('dropped')} dropped. "
            + ("(The end of the timeline: where the turn's restoration ended.)" if upto == len(steps) - 1 else
               "(The picture shows the cache as it was then; drag to the end for where the turn ended.)"))


def figures(session):
    """The per-turn table: timings and restoration, with the turn being answered as far as it is known."""
    import pandas as pd

    rows = []
    for i, r in enumerate(session.conversation.turns if session.conversation is not None else [], 1):
        tpot = r.time_per_output_token
        ttft, tpot = (("–" if math.isnan(t) else f"{t * 1e3:.1f}") for t in (r.time_to_first_token, tpot))
        visual = len(r.trace.selected) + len(r.trace.deferred)
        if visual == 0:  # a follow-up without a new image: nothing of its own to defer or restore
            rows.append([i, "no new visual tokens", "–", ttft, tpot, "–", "–", "–", "–"])
            continue
        rows.append([i, visual, len(r.trace.selected), ttft, tpot, r.restored_during_answer,
                     r.restored_after_answer, r.pending, len(r.trace.dropped)])
    if session.live is not None:  # the turn being answered, from the live picture
        first = session.live["first"]
        ttft = "…" if first is None else f"{(first - session.live['start']) * 1e3:.1f}"
        row = [session.live["number"], "…", "…", ttft, "…", "…", "…", "…", "…"]
        if session.visual_turns and session.visual_turns[-1].number == session.live["number"]:
            _, counts, _ = picture_and_counts(session, draw=False)
            if not counts["waiting"]:
                row[1:3] = [sum(counts.values()), counts["selected"]]
                row[5], row[7], row[8] = counts["during"], counts["deferred"], counts["dropped"]
        rows.append(row)
    return pd.DataFrame(rows, columns=FIGURE_HEADERS).astype(str)


def status(session) -> dict:
    """Machine-readable state, for the API and the *Live trace* panel."""
    live = live_status(session.cache)
    turns = session.conversation.turns if session.conversation is not None else []
    out = {
        "session": session.id, "conversation": session.number,
        "settings": {f.name: getattr(session.settings, f.name) for f in fields(session.settings)},
        "answering": session.answering, "turns": len(turns), "pending": session.pending,
        "restored": len(live.restored), "restored_once": restored_once(session.cache), "dropped": len(live.dropped),
        "turn_figures": [
            {"turn": i, "visual_tokens": len(r.trace.selected) + len(r.trace.deferred),
             "selected": len(r.trace.selected), "deferred": len(r.trace.deferred),
             "ttft_ms": round(r.time_to_first_token * 1e3, 2),
             "tpot_ms": None if math.isnan(r.time_per_output_token) else round(r.time_per_output_token * 1e3, 2),
             "restored_during_answer": r.restored_during_answer, "restored_after_answer": r.restored_after_answer,
             "restored_at_prefill": int(r.trace.restored_per_forward[0].numel()) if r.trace.restored_per_forward
             else 0,
             "pending": r.pending, "dropped": len(r.trace.dropped), "answer_tokens": int(r.token_ids.numel())}
            for i, r in enumerate(turns, 1)
        ],
    }
    _, steps = timeline(session)
    if steps:  # the latest visual turn's restoration, step by step (steps where something came back)
        out["timeline"] = {"steps": len(steps), "restored": [
            {"step": i, "label": step.label, "phase": step.phase, "count": len(step.restored)}
            for i, step in enumerate(steps) if step.restored]}
    if session.visual_turns:
        turn = session.visual_turns[-1]
        out["picture"] = {"turn": turn.number, "located": turn.positions is not None, "segments": [
            {"modality": v.modality, "grid": list(v.grid), "size": list(v.picture.size), "label": v.label}
            for v in turn.views]}
    return out


def restored_once(cache) -> bool:
    """Every restored deferred row is in the cache exactly once (what the completion barrier promises)."""
    restored = live_restored_order(cache)
    return len(restored) == len(set(restored))
