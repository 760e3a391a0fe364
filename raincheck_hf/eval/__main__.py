"""python -m raincheck_hf.eval: quality of every mode × selector on multi-turn visual dialogues.

    python -m raincheck_hf.eval run --model qwen3_vl --json vl.json --markdown vl.md
    python -m raincheck_hf.eval run --model /path/to/Qwen3-VL-8B-Instruct --data dialogues.jsonl --scorer contains
    python -m raincheck_hf.eval report vl.json q35.json --markdown quality.md --figure quality.png
    python -m raincheck_hf.eval levers --model qwen3_vl --levers source/16/31,attention/16/31,source/4/31

``--model`` is a bundled glyph model (``qwen3_vl``, ``qwen3_5``), a local directory or a Hub id
(`from_pretrained`). ``--data`` is ``glyph:test`` (the benchmark's test split, default),
``glyph:dev`` or a JSONL file (format in `raincheck_hf.eval.data`).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time

from ..configuration import RESTORE_ORDERS, RaincheckConfig
from ..selection import available_selectors
from .harness import CATEGORIES, MODES, evaluate, summarize

LABELS = {"first_fact": "turn 1 fact", "first_list": "turn 1 list (item recall)", "first_text": "turn 1",
          "follow_up": "follow-ups"}


def _load_model(name: str, device: str):
    """A bundled model, ``tiny`` or a checkpoint (`loading.load_model`: a checkpoint in bf16 on CUDA, fp32 on a
    CPU)."""
    from ..loading import load_or_exit

    loaded = load_or_exit(name, device)
    return loaded.model, loaded.processor


def _load_data(spec: str, limit):
    from .data import glyph_dialogues, load_jsonl

    if spec.startswith("glyph:"):
        return glyph_dialogues(spec.split(":", 1)[1], limit=limit)
    return load_jsonl(spec)[:limit]


def _fmt(x) -> str:
    return "–" if x is None or x != x else f"{100 * x:.1f}"


def markdown(results: list[dict]) -> str:
    lines = []
    for res in results:
        acc, rec = res["summary"]["accuracy"], res["summary"]["recovery"]
        cats = [c for c in CATEGORIES if any(c in a for a in acc.values())]
        lines += [f"### {res['model']} — {res['data']} ({res['dialogues']} dialogues, retention {res['settings']['retention']})",
                  "", "| mode | selector | " + " | ".join(LABELS[c] for c in cats) + " |",
                  "|---|---|" + "---:|" * len(cats)]
        for name, a in acc.items():
            mode, selector = name.split("/")
            lines.append(f"| {mode} | {selector} | " + " | ".join(_fmt(a.get(c)) for c in cats) + " |")
        if rec:
            lines += ["", "Recovery of the pruning-induced loss, (mode − hard) / (full − hard), 95% bootstrap interval:",
                      "", "| mode | selector | " + " | ".join(f"{LABELS[c]} (loss)" for c in cats) + " |",
                      "|---|---|" + "---:|" * len(cats)]
            for name, entry in rec.items():
                mode, selector = name.split("/")
                cells = []
                for c in cats:
                    e = entry.get(c)
                    cells.append("–" if e is None else
                                 f"{_fmt(e['ratio'])}% [{_fmt(e['ci95'][0])}, {_fmt(e['ci95'][1])}] ({_fmt(e['loss'])} pts)")
                lines.append(f"| {mode} | {selector} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def figure(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ["first_list", "follow_up"]
    fig, axes = plt.subplots(len(results), len(cats), figsize=(6 * len(cats), 3.2 * len(results)), squeeze=False)
    for row, res in enumerate(results):
        acc = res["summary"]["accuracy"]
        selectors = sorted({n.split("/")[1] for n in acc if not n.startswith("full/")})
        full = acc.get("full/-", {})
        for col, c in enumerate(cats):
            ax = axes[row][col]
            width = 0.27
            for k, mode in enumerate(("hard", "post_answer", "raincheck")):
                ys = [100 * acc.get(f"{mode}/{s}", {}).get(c, float("nan")) for s in selectors]
                ax.bar([i + (k - 1) * width for i in range(len(selectors))], ys, width, label=mode)
            if c in full:
                ax.axhline(100 * full[c], color="black", linestyle="--", linewidth=1, label="full")
            ax.set_xticks(range(len(selectors)), selectors, rotation=30, fontsize=8)
            ax.set_ylim(0, 105)
            ax.set_title(f"{res['model']}: {LABELS[c]}", fontsize=10)
            ax.set_ylabel("accuracy (%)")
            if row == 0 and col == 0:
                ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(results, args):
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    if getattr(args, "figure", None):
        figure(results, args.figure)


def _prepare(args):
    """``(selectors, scorer, model, processor, dialogues)`` of a ``run`` / ``levers`` command: the selectors checked
    against the registry (before the model loads), the scorer (``glyph`` for the glyph data, else ``contains``)."""
    from .scoring import get_scorer

    selectors = available_selectors() if args.selectors == "all" else [s for s in args.selectors.split(",") if s]
    for s in selectors:
        if s not in available_selectors():
            raise SystemExit(f"--selectors: {s!r} is not one of {available_selectors()}")
    scorer = get_scorer(args.scorer if args.scorer else ("glyph" if args.data.startswith("glyph:") else "contains"))
    model, processor = _load_model(args.model, args.device)
    return selectors, scorer, model, processor, _load_data(args.data, args.limit)


def cmd_run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {MODES}")
    selectors, scorer, model, processor, dialogues = _prepare(args)
    began = time.time()
    runs = evaluate(model, processor, dialogues, modes=modes, selectors=selectors, scorer=scorer,
                    retention=args.retention, chunk_size=args.chunk_size, decode_guard=args.decode_guard,
                    restore_order=args.restore_order, margin=args.margin)
    result = {
        "model": args.model, "data": args.data, "dialogues": len(dialogues),
        "settings": {"retention": args.retention, "chunk_size": args.chunk_size, "decode_guard": args.decode_guard,
                     "restore_order": args.restore_order, "margin": args.margin, "scorer": args.scorer or "default", "selectors": selectors, "modes": modes},
        "command": "python -m raincheck_hf.eval " + shlex.join(args.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "device": args.device, "threads": args.threads},
        "elapsed_s": round(time.time() - began, 1),
        "summary": summarize(runs, bootstrap=args.bootstrap),
        "runs": runs,
        "uids": [d.uid for d in dialogues],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    _write([result], args)
    print(markdown([result]))
    return result


def parse_lever(text: str) -> dict:
    """``"ORDER/GUARD/CHUNK"`` or ``"ORDER/GUARD/CHUNK/EVERY"`` (e.g. ``"attention/4/31"``, ``"source/1/15/4"``) ->
    the raincheck settings of one lever (``chunk_every`` only when given), checked by `RaincheckConfig` (ValueError
    naming the setting)."""
    parts = text.split("/")
    if len(parts) not in (3, 4):
        raise ValueError(f"--levers: {text!r} must be ORDER/GUARD/CHUNK[/EVERY], e.g. 'source/16/31', "
                         "'attention/4/31' or 'source/1/15/4'")
    order, numbers = parts[0], parts[1:]
    try:
        numbers = [int(n) for n in numbers]
    except ValueError:
        raise ValueError(f"--levers: {text!r}: GUARD, CHUNK and EVERY must be integers") from None
    lever = {"restore_order": order, "decode_guard": numbers[0], "chunk_size": numbers[1]}
    if len(numbers) == 3:
        lever["chunk_every"] = numbers[2]
    RaincheckConfig(**lever)
    return lever


def cmd_levers(args) -> dict:
    """``full`` and ``hard`` once per selector, then ``raincheck`` under each lever; recovery per lever and selector
    against the same ``full`` / ``hard`` runs (they do not depend on the restoration settings)."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    levers = [parse_lever(t) for t in args.levers.split(",") if t]
    selectors, scorer, model, processor, dialogues = _prepare(args)
    began = time.time()
    base = evaluate(model, processor, dialogues, modes=("full", "hard"), selectors=selectors, scorer=scorer,
                    retention=args.retention, margin=args.margin)
    entries = []
    for lever in levers:
        runs = evaluate(model, processor, dialogues, modes=("raincheck",), selectors=selectors, scorer=scorer,
                        retention=args.retention, margin=args.margin, **lever)
        entries.append({"lever": lever, "summary": summarize({**base, **runs}, bootstrap=args.bootstrap), "runs": runs})
    result = {
        "model": args.model, "data": args.data, "dialogues": len(dialogues),
        "settings": {"retention": args.retention, "margin": args.margin, "scorer": args.scorer or "default",
                     "selectors": selectors},
        "command": "python -m raincheck_hf.eval " + shlex.join(args.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "device": args.device, "threads": args.threads},
        "elapsed_s": round(time.time() - began, 1),
        "base": {"summary": summarize(base, bootstrap=0), "runs": base},
        "levers": entries,
        "uids": [d.uid for d in dialogues],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    text = levers_markdown([result])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text)
    return result


def levers_markdown(results: list[dict]) -> str:
    """Per model, one row per lever: list-answer recovery per selector (95% interval), the least of them, and the
    least follow-up recovery."""
    lines = []
    for res in results:
        selectors = res["settings"]["selectors"]
        lines += [f"### {res['model']} — {res['data']} ({res['dialogues']} dialogues, retention "
                  f"{res['settings']['retention']})", "",
                  "| order | guard | chunk | " + " | ".join(selectors) + " | least (list) | least (follow-ups) |",
                  "|---|---:|---:|" + "---:|" * (len(selectors) + 2)]
        for entry in res["levers"]:
            lever, rec = entry["lever"], entry["summary"]["recovery"]
            cells, lows, follow = [], [], []
            for s in selectors:
                e = rec.get(f"raincheck/{s}", {})
                lst, fu = e.get("first_list"), e.get("follow_up")
                cells.append("–" if lst is None else
                             f"{_fmt(lst['ratio'])}% [{_fmt(lst['ci95'][0])}, {_fmt(lst['ci95'][1])}]")
                if lst is not None:
                    lows.append(lst["ratio"])
                if fu is not None:
                    follow.append(fu["ratio"])
            every = lever.get("chunk_every", 1)
            chunk = lever["chunk_size"] if every == 1 else f"{lever['chunk_size']} every {every}"
            lines.append(f"| {lever['restore_order']} | {lever['decode_guard']} | {chunk} | "
                         + " | ".join(cells) + f" | {_fmt(min(lows) if lows else None)}% | "
                         f"{_fmt(min(follow) if follow else None)}% |")
        lines += ["", f"    {res['command']}", ""]
    return "\n".join(lines)


def merge(results: list[dict], bootstrap: int = 1000) -> dict:
    """One result from runs of the same model and data split over several processes (by selector / mode). The
    restoration settings (chunk size, guard, order) must agree between results holding runs that restore
    deferred tokens; results of ``full`` / ``hard`` runs only merge with any (those runs do not depend on them)."""
    first = results[0]
    keys = ("model", "data", "dialogues", "uids")
    fixed = ("retention", "margin", "scorer")
    # restoration settings only matter to runs that restore: results holding only full / hard runs merge with any
    restoring = [r for r in results if any(name.split("/")[0] not in ("full", "hard") for name in r["runs"])]
    for other in results[1:]:
        for k in keys:
            if other[k] != first[k]:
                raise ValueError(f"cannot merge: {k} differs ({first[k]!r} vs {other[k]!r})")
        for k in fixed:
            if other["settings"].get(k) != first["settings"].get(k):
                raise ValueError(f"cannot merge: settings.{k} differs ({first['settings'].get(k)!r} vs {other['settings'].get(k)!r})")
    for other in restoring[1:]:
        for k in ("chunk_size", "decode_guard", "restore_order"):
            if other["settings"].get(k) != restoring[0]["settings"].get(k):
                raise ValueError(f"cannot merge: settings.{k} differs between runs that restore deferred tokens "
                                 f"({restoring[0]['settings'].get(k)!r} vs {other['settings'].get(k)!r})")
    runs = {}
    for r in results:
        for name, run in r["runs"].items():
            if name in runs and run != runs[name]:
                raise ValueError(f"cannot merge: run {name} appears twice with different records")
            runs[name] = run
    merged = dict(first)
    restore = {k: restoring[0]["settings"].get(k) for k in ("chunk_size", "decode_guard", "restore_order")} \
        if restoring else {}
    merged["settings"] = dict(first["settings"], **restore,
                              selectors=sorted({s for r in results for s in r["settings"]["selectors"]}),
                              modes=sorted({m for r in results for m in r["settings"]["modes"]}))
    merged["command"] = [r["command"] for r in results]
    merged["elapsed_s"] = sum(r["elapsed_s"] for r in results)
    merged["runs"] = runs
    merged["summary"] = summarize(runs, bootstrap=bootstrap)
    return merged


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="evaluate one model")
    run.add_argument("--model", default="qwen3_vl")
    run.add_argument("--data", default="glyph:test")
    run.add_argument("--limit", type=int, default=None)
    run.add_argument("--modes", default=",".join(MODES))
    run.add_argument("--selectors", default="all", help="'all' or a comma-separated list")
    run.add_argument("--retention", type=float, default=0.3)
    run.add_argument("--chunk-size", type=int, default=RaincheckConfig.chunk_size)
    run.add_argument("--decode-guard", type=int, default=RaincheckConfig.decode_guard)
    run.add_argument("--restore-order", default=RaincheckConfig.restore_order, choices=RESTORE_ORDERS,
                     help="which deferred tokens are restored first (RaincheckConfig.restore_order)")
    run.add_argument("--margin", type=int, default=2, help="answer budget: reference tokens + this (same for every mode)")
    run.add_argument("--scorer", default=None, help="glyph | exact | contains | module:function")
    run.add_argument("--bootstrap", type=int, default=1000)
    run.add_argument("--device", default="cpu")
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--json")
    run.add_argument("--markdown")
    run.add_argument("--figure")
    levers = sub.add_parser("levers", help="recovery of long first answers under several restoration settings")
    levers.add_argument("--model", default="qwen3_vl")
    levers.add_argument("--data", default="glyph:test")
    levers.add_argument("--limit", type=int, default=None)
    levers.add_argument("--levers", required=True,
                        help="comma-separated ORDER/GUARD/CHUNK[/EVERY] (restore_order / decode_guard / chunk_size "
                             "/ chunk_every), e.g. 'source/16/31,attention/16/31,source/4/31,source/1/15/4'")
    levers.add_argument("--selectors", default="all", help="'all' or a comma-separated list")
    levers.add_argument("--retention", type=float, default=0.3)
    levers.add_argument("--margin", type=int, default=2)
    levers.add_argument("--scorer", default=None)
    levers.add_argument("--bootstrap", type=int, default=1000)
    levers.add_argument("--device", default="cpu")
    levers.add_argument("--threads", type=int, default=1)
    levers.add_argument("--json")
    levers.add_argument("--markdown")
    report = sub.add_parser("report", help="merge result JSONs into one table and figure")
    report.add_argument("inputs", nargs="+")
    report.add_argument("--markdown")
    report.add_argument("--figure")
    report.add_argument("--merge", help="merge the inputs (one model, split over processes) into this JSON")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the results record as their command
    if args.command == "run":
        if args.limit is not None and args.limit <= 0:
            parser.error(f"--limit must be positive, got {args.limit}")
        cmd_run(args)
    elif args.command == "levers":
        if args.limit is not None and args.limit <= 0:
            parser.error(f"--limit must be positive, got {args.limit}")
        try:
            for text in args.levers.split(","):
                parse_lever(text)
        except ValueError as e:
            parser.error(str(e))
        cmd_levers(args)
    else:
        results = [json.load(open(p)) for p in args.inputs]
        if args.merge:
            results = [merge(results)]
            with open(args.merge, "w") as f:
                json.dump(results[0], f, indent=1)
        _write(results, args)
        print(markdown(results))


if __name__ == "__main__":
    main()
