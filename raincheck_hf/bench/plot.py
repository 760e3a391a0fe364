"""Figures from ``latency`` JSONs: ``python -m raincheck_hf.bench plot results.json [more.json ...] --out DIR``.

Writes PNGs, one panel per (model, input) run of every file in each:

- ``ttft.png``: time to first token of turn 1 by variant;
- ``tpot.png``: mean time per output token of turn 1 by variant (hatched: the mean over the steps
  that carried a deferred chunk);
- ``chunk_sweep.png``: TPOT of turn 1 and TPOT over the chunk-carrying steps against chunk size,
  fused and serial, with stock dynamic / static and ``full`` as reference lines;
- ``fused_vs_serial.png``: TPOT over the chunk-carrying steps, fused against serial, per chunk size;
- ``follow_up.png``: time to first token of follow-up 2 right after the answer, after an idle gap,
  and behind a completion barrier (when the run had two turns or more);
- ``step_times.png``: per-token gaps of turn 1 (first repetition) for the main variants.

Values are the JSON's medians; nothing is recomputed. matplotlib is an optional dependency
(``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MISSING = ("the plot command needs matplotlib, which is not installed: pip install matplotlib "
           "(it is not a dependency of raincheck_hf)")


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(MISSING) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _runs(result: dict) -> list[dict]:
    return [r for r in result.get("runs", []) if r.get("variants")]


def _title(run: dict) -> str:
    p = run.get("prompt", {})
    source = f"[{run['_source']}] " if run.get("_source") else ""
    return f"{source}{run['model']} / {run['input']} ({p.get('prompt_tokens')} tok, {p.get('visual_tokens')} visual)"


def _median(entry: dict, key: str):
    return entry.get("median", {}).get(key)


def _panels(plt, n: int, width: float = 7.0, height: float = 4.0):
    fig, axes = plt.subplots(n, 1, figsize=(width, height * n), squeeze=False)
    return fig, [a[0] for a in axes]


def _colour(entry: dict) -> str:
    return {"stock_dynamic": "#7f7f7f", "stock_static": "#bcbd22", "stock_static_reused": "#dbdb8d",
            "full": "#1f77b4", "hard": "#9467bd", "post_answer": "#8c564b", "raincheck": "#d62728",
            "serial": "#ff7f0e"}.get(entry.get("family"), "#17becf")


def _bars(ax, run: dict, key: str, label: str, hatch_key: str | None = None):
    names, values, colours, hatched = [], [], [], []
    for name, entry in run["variants"].items():
        value = _median(entry, key)
        if value is None:
            continue
        names.append(name)
        values.append(value * 1e3)
        colours.append(_colour(entry))
        hatched.append(_median(entry, hatch_key) * 1e3 if hatch_key and _median(entry, hatch_key) else None)
    x = range(len(names))
    ax.bar(x, values, color=colours)
    if hatch_key:
        for i, h in enumerate(hatched):
            if h is not None:
                ax.bar([i], [h], color="none", edgecolor="black", hatch="//", width=0.5)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(label)
    ax.set_title(_title(run), fontsize=9)
    return bool(names)


def _sweep(run: dict, family: str, key: str):
    points = sorted((e["chunk_size"], _median(e, key)) for e in run["variants"].values()
                    if e.get("family") == family and isinstance(e.get("chunk_size"), int)
                    and _median(e, key) is not None)
    return [c for c, _ in points], [v * 1e3 for _, v in points]


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bar_panels(plt, runs, path, key: str, label: str, hatch_key: str | None = None):
    """One panel of `_bars` a run."""
    fig, axes = _panels(plt, len(runs))
    for ax, run in zip(axes, runs):
        _bars(ax, run, key, label, hatch_key=hatch_key)
    _save(plt, fig, path)


def plot_ttft(plt, runs, path):
    _bar_panels(plt, runs, path, "t1_s", "time to first token, turn 1 (ms)")


def plot_tpot(plt, runs, path):
    _bar_panels(plt, runs, path, "tpot1_s", "TPOT, turn 1 (ms); hatched: chunk-carrying steps",
                hatch_key="tpot1_restoring_s")


def plot_chunk_sweep(plt, runs, path):
    fig, axes = _panels(plt, len(runs))
    for ax, run in zip(axes, runs):
        styles = {"raincheck": ("#d62728", "fused"), "serial": ("#ff7f0e", "serial")}
        for family, (colour, label) in styles.items():
            c, v = _sweep(run, family, "tpot1_s")
            if c:
                ax.plot(c, v, "o-", color=colour, label=f"{label}: TPOT over the answer")
            c, v = _sweep(run, family, "tpot1_restoring_s")
            if c:
                ax.plot(c, v, "s--", color=colour, label=f"{label}: TPOT of chunk-carrying steps")
        for ref, style in (("stock_dynamic", ":"), ("stock_static", "-."), ("full", "--")):
            value = _median(run["variants"].get(ref, {}), "tpot1_s")
            if value is not None:
                ax.axhline(value * 1e3, color="#555555", linestyle=style, linewidth=1, label=f"{ref} TPOT")
        ax.set_xscale("log", base=2)
        for family, (colour, label) in styles.items():  # chunk_size="auto": a level, not a point of the sweep
            auto = [_median(e, "tpot1_s") for e in run["variants"].values()
                    if e.get("family") == family and e.get("chunk_size") == "auto"]
            if auto and auto[0] is not None:
                ax.axhline(auto[0] * 1e3, color=colour, linestyle=(0, (1, 1)), linewidth=1,
                           label=f"{label} chunk_size=auto: TPOT over the answer")
        sizes = sorted({e["chunk_size"] for e in run["variants"].values()
                        if e.get("family") in styles and e.get("median") and isinstance(e.get("chunk_size"), int)})
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(c) for c in sizes])
        ax.minorticks_off()
        ax.set_xlabel("chunk size c (deferred tokens per decode step)")
        ax.set_ylabel("ms per output token")
        ax.set_title(_title(run), fontsize=9)
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_fused_vs_serial(plt, runs, path):
    fig, axes = _panels(plt, len(runs))
    for ax, run in zip(axes, runs):
        fc, fv = _sweep(run, "raincheck", "tpot1_restoring_s")
        sc, sv = _sweep(run, "serial", "tpot1_restoring_s")
        sizes = sorted(set(fc) & set(sc))
        f = dict(zip(fc, fv))
        s = dict(zip(sc, sv))
        x = range(len(sizes))
        ax.bar([i - 0.2 for i in x], [f[c] for c in sizes], width=0.4, color="#d62728", label="fused")
        ax.bar([i + 0.2 for i in x], [s[c] for c in sizes], width=0.4, color="#ff7f0e", label="serial")
        for i, c in enumerate(sizes):
            ax.annotate(f"x{s[c] / f[c]:.2f}", (i + 0.2, s[c]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"c={c}" for c in sizes])
        ax.set_ylabel("ms per chunk-carrying decode step\n(label: serial / fused)")
        ax.set_title(_title(run) + ("" if sizes else ": no chunk ran during the answer"), fontsize=9)
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_follow_up(plt, runs, path):
    runs = [r for r in runs if any("t2_s" in e.get("median", {}) for e in r["variants"].values())]
    if not runs:
        return False
    fig, axes = _panels(plt, len(runs))
    keys = (("t2_s", "right after the answer"), ("t2_idle_s", "after an idle gap"),
            ("t2_barrier_s", "completion barrier (derived)"))
    for ax, run in zip(axes, runs):
        names = [n for n, e in run["variants"].items() if _median(e, "t2_s") is not None]
        for j, (key, label) in enumerate(keys):
            values = [(_median(run["variants"][n], key) or 0.0) * 1e3 for n in names]
            ax.bar([i + (j - 1) * 0.27 for i in range(len(names))], values, width=0.27, label=label)
        ax.set_xticks(list(range(len(names))))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("time to first token, follow-up 2 (ms)")
        ax.set_title(_title(run), fontsize=9)
        ax.legend(fontsize=7)
    _save(plt, fig, path)
    return True


def plot_step_times(plt, runs, path):
    fig, axes = _panels(plt, len(runs))
    drawn = False
    for ax, run in zip(axes, runs):
        primary = run.get("primary_chunk")
        for name, entry in run["variants"].items():
            if entry.get("family") in ("raincheck", "serial") and entry.get("turns", 1) < max(
                    e.get("turns", 1) for e in run["variants"].values()):
                continue  # sweep sizes: keep the panel readable
            reps = entry.get("reps") or []
            gaps = reps[0]["turns"][0].get("token_intervals_ms") if reps else None
            if gaps:
                ax.plot(range(1, len(gaps) + 1), gaps, linewidth=0.8, color=_colour(entry), label=name)
                drawn = True
        ax.set_xlabel("decode step (forward k produces token k + 1)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(_title(run) + (f", c={primary}" if primary else ""), fontsize=9)
        ax.legend(fontsize=7)
    _save(plt, fig, path)
    return drawn


def _load(result):
    if isinstance(result, (str, os.PathLike)):
        with open(result) as f:
            loaded = json.load(f)
        name = os.path.splitext(os.path.basename(os.fspath(result)))[0]
    else:
        loaded, name = result, None
    if loaded.get("benchmark") != "latency":
        raise ValueError(f"plot expects the JSON of `python -m raincheck_hf.bench latency`; got benchmark="
                         f"{loaded.get('benchmark')!r}" + (f" in {result}" if name else "") + ".")
    return loaded, name


def plot(results, out_dir: str) -> list[str]:
    """Write the figures of ``results`` (a result dict, a JSON path, or a list of them) into ``out_dir``.

    Returns the paths written. With several files, each panel's title starts with its file's name.
    """
    if isinstance(results, (dict, str, os.PathLike)):
        results = [results]
    loaded = [_load(r) for r in results]
    runs = []
    for result, name in loaded:
        for run in _runs(result):
            runs.append(dict(run, _source=name) if len(loaded) > 1 else run)
    if not runs:
        raise ValueError("the JSON holds no measured run (every run was skipped or failed).")
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fn in (("ttft", plot_ttft), ("tpot", plot_tpot), ("chunk_sweep", plot_chunk_sweep),
                     ("fused_vs_serial", plot_fused_vs_serial), ("follow_up", plot_follow_up),
                     ("step_times", plot_step_times)):
        path = os.path.join(out_dir, f"{name}.png")
        if fn(plt, runs, path) is not False:
            written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="JSONs written by `python -m raincheck_hf.bench latency --json`")
    parser.add_argument("--out", required=True, help="folder for the PNGs (created if needed)")
    args = parser.parse_args(argv)
    try:
        paths = plot(args.results, args.out)
    except (ImportError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0
