"""Run dialogues through every mode × selector and summarise per-turn accuracy and recovery.

Every mode gets the same dialogues, the same selection (the selector runs on the same inputs),
the same generation budget (the reference answer's token count plus a margin, greedy) and the
same scorer; nothing is tuned per mode. Each dialogue runs as a `Conversation` without the
background worker (leftovers are prefilled ahead of the next question, which gives the same
logits as waiting for them, see `Conversation`), so results do not depend on timing.

Recovery ratio (the paper's headline): ``(raincheck - hard) / (full - hard)`` per turn category,
with a bootstrap interval over dialogues.
"""

from __future__ import annotations

import random
import time

from ..configuration import RaincheckConfig

CATEGORIES = ("first_fact", "first_list", "first_text", "follow_up")
MODES = ("full", "hard", "post_answer", "raincheck")


def category(turn_index: int, kind: str) -> str:
    if turn_index > 0:
        return "follow_up"
    return {"fact": "first_fact", "list": "first_list"}.get(kind, "first_text")


def answer_budget(tokenizer, answer: str, margin: int) -> int:
    return len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + margin


def run_dialogue(model, processor, dialogue, config: RaincheckConfig, scorer, margin: int = 2) -> list[dict]:
    from ..conversation import Conversation

    records = []
    with Conversation(model, processor, config, background=False) as chat:
        for i, turn in enumerate(dialogue.turns):
            images = dialogue.load_images() if i == 0 else ()
            budget = answer_budget(processor.tokenizer, turn.answer, margin)
            result = chat.ask(turn.question, images=images, max_new_tokens=budget, do_sample=False)
            score = scorer(turn, result.text)
            trace = result.trace
            records.append({
                "turn": i, "category": category(i, turn.kind), "prediction": result.text,
                "correct": int(score["correct"]), "total": int(score["total"]),
                **{k: v for k, v in score.items() if k not in ("correct", "total")},
                "selected": int(trace.selected.numel()), "deferred": int(trace.deferred.numel()),
                "restored_during_answer": int(result.restored_during_answer),
            })
    return records


def evaluate(model, processor, dialogues, *, modes=MODES, selectors=("mmtok",), scorer,
             retention: float = RaincheckConfig.retention, chunk_size: int = RaincheckConfig.chunk_size,
             decode_guard: int = RaincheckConfig.decode_guard, restore_order: str = RaincheckConfig.restore_order,
             chunk_every: int = RaincheckConfig.chunk_every, margin: int = 2, progress=print) -> dict:
    """``{"<mode>/<selector>": [per-dialogue list of turn records]}`` (``full`` runs once, as ``full/-``)."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"modes: each must be one of {MODES}, got {mode!r}")
    runs = {}
    plan = [("full", "-")] if "full" in modes else []
    plan += [(m, s) for s in selectors for m in modes if m != "full"]
    for mode, selector in plan:
        config = RaincheckConfig(mode=mode, selector="uniform" if selector == "-" else selector, retention=retention,
                                 chunk_size=chunk_size, decode_guard=decode_guard, restore_order=restore_order,
                                 chunk_every=chunk_every)
        began = time.time()
        runs[f"{mode}/{selector}"] = [run_dialogue(model, processor, d, config, scorer, margin) for d in dialogues]
        if progress:
            acc = accuracy(runs[f"{mode}/{selector}"])
            progress(f"[eval] {mode:<11} {selector:<9} {time.time() - began:6.1f} s  "
                     + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    return runs


def _counts(dialogue_records, wanted=CATEGORIES):
    out = {c: [0, 0] for c in wanted}
    for r in dialogue_records:
        if r["category"] in out:
            out[r["category"]][0] += r["correct"]
            out[r["category"]][1] += r["total"]
    return out


def accuracy(run, indices=None) -> dict:
    """Micro-averaged accuracy per category (facts for fact turns, items for list turns)."""
    total = {c: [0, 0] for c in CATEGORIES}
    for i in (range(len(run)) if indices is None else indices):
        for c, (hit, n) in _counts(run[i]).items():
            total[c][0] += hit
            total[c][1] += n
    return {c: hit / n for c, (hit, n) in total.items() if n}


def recovery(full, hard, other, indices=None) -> dict:
    f, h, o = accuracy(full, indices), accuracy(hard, indices), accuracy(other, indices)
    return {c: ((o[c] - h[c]) / (f[c] - h[c]) if abs(f[c] - h[c]) > 1e-9 else float("nan"))
            for c in f if c in h and c in o}


def summarize(runs: dict, bootstrap: int = 1000, seed: int = 0) -> dict:
    """Accuracy per run, and recovery (point estimate + 95% bootstrap interval) of raincheck and post_answer."""
    summary = {"accuracy": {name: accuracy(run) for name, run in runs.items()}, "recovery": {}}
    full = runs.get("full/-")
    if full is None:
        return summary
    n = len(full)
    full_acc = summary["accuracy"]["full/-"]
    rng = random.Random(seed)
    samples = [[rng.randrange(n) for _ in range(n)] for _ in range(bootstrap)]
    for name, run in runs.items():
        mode, selector = name.split("/")
        hard = runs.get(f"hard/{selector}")
        if mode not in ("raincheck", "post_answer") or hard is None:
            continue
        point = recovery(full, hard, run)
        draws = [recovery(full, hard, run, idx) for idx in samples]
        entry = {}
        for c, value in point.items():
            values = sorted(d[c] for d in draws if c in d and d[c] == d[c])
            lo = values[int(0.025 * (len(values) - 1))] if values else float("nan")
            hi = values[int(0.975 * (len(values) - 1))] if values else float("nan")
            entry[c] = {"ratio": value, "ci95": [lo, hi], "loss": full_acc[c] - summary["accuracy"][f"hard/{selector}"][c]}
        summary["recovery"][name] = entry
    return summary
