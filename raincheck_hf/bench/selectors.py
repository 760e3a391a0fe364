"""Selection time per selector, side by side, and (``--t1``) the first token per selector through `generate`.

    python -m raincheck_hf.bench selectors [--model qwen3_vl_8b] [--inputs image,video] [--reps 5] [--t1]

Selection: the turn is encoded once (with the vision tower's last block recorded, which VisionZip
reads); then, per selector, ``plan.select_visual_rows`` (what `generate` calls: FastV's scoring pass
and VisionZip's attention recompute included) is timed with the device synchronised before and
after, warm-up calls first (CUDA graphs of the greedy selectors are captured there), median of
``--reps``. The greedy selectors also run their reference loops (``fast_path=False``) as rows of
variant ``reference``. On CUDA, ``mmtok`` also runs with its greedy as two launches a pick (variant
``two_launches``; the default runs every pick in one launch where it fits), and its parts are timed alone on the
turn's first group of equal segments: the kernel inputs (variant ``inputs``) and the greedy replayed in each form
(``greedy_one_launch``, the default; ``greedy_one_launch_strided``, the winner's column read from P's strided
column, `selection.kernels.mmtok_transposed_column`; ``greedy_two_launches``; with ``--t1``, ``mmtok_two_launches``
too). ``--t1``:
``model.generate(**inputs, raincheck=RaincheckConfig(selector=...), max_new_tokens=1)``, synchronised wall
time, for every selector, ``full`` and stock ``generate``, every variant warmed up first, then the repetitions
in round robin over the variants.

Models: the real shapes on a GPU (``qwen3_vl_8b``, ``qwen3_5_9b``: random bf16 weights, the
1,344-token image and 6,144-token video of `bench.shapes`); on a CPU a tiny model at those input
sizes (``tiny_qwen3_vl``, the greedy loops cost the same per token whatever the hidden size) or the
bundled glyph model (``bundled_qwen3_vl``: a 10x10-cell glyph image, 100 visual tokens).
The JSON holds ``"benchmark": "selectors"``, ``"date"``, ``"hardware"``, ``"rows"`` (selector,
tokens, device, median_ms, ...) and, with ``--t1``, ``"t1_rows"``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

SELECTORS = ("uniform", "random", "divprune", "mmtok", "cdpruner", "visionzip", "fastv")
GREEDY = ("mmtok", "divprune", "cdpruner")
BUNDLED = {"bundled_qwen3_vl": "qwen3_vl", "bundled_qwen3_5": "qwen3_5"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _bundled_inputs(processor):
    from ..quality.glyphs import dialogue

    dlg = dialogue(seed=0, grid=10)
    messages = dlg.messages(upto=1, with_answers=False)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[prompt], images=[dlg.image()], return_tensors="pt"))


def build(model_name: str, device: torch.device, kinds):
    """``(model, {kind: (inputs, info)}, model_info)``."""
    if model_name in BUNDLED:
        from ..quality import load_bundled

        model, processor = load_bundled(BUNDLED[model_name], device=str(device))
        inputs = _bundled_inputs(processor)
        n = int((inputs["input_ids"] == model.config.image_token_id).sum())
        return model, {"image": (inputs, {"kind": "image", "visual_tokens": n,
                                          "prompt_tokens": int(inputs["input_ids"].shape[1])})}, {"name": model_name}
    from .shapes import MODELS, build_model, build_processor, build_prompt

    model, info = build_model(model_name, device)
    processor = build_processor()
    real = MODELS["qwen3_vl_8b"]  # the real input sizes, also for tiny models (selection cost follows n, k)
    prompts = {kind: build_prompt(processor, real, kind) for kind in kinds}
    return model, prompts, info


def encode(model, inputs: dict):
    """``(turn, captures)``: the turn as `generate` encodes it, with the tower's last block recorded."""
    from ..integration import VisionAttentionCapture
    from ..models import get_adapter

    adapter = get_adapter(model)
    inputs = {k: v.to(adapter.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}  # as generate has them
    grids = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    captures = VisionAttentionCapture(model, grids)
    with torch.no_grad(), captures:
        turn = adapter.encode_turn(inputs["input_ids"][0], 0, image_grid_thw=grids["image_grid_thw"],
                                   video_grid_thw=grids["video_grid_thw"], pixel_values=inputs.get("pixel_values"),
                                   pixel_values_videos=inputs.get("pixel_values_videos"))
    # the record holds references only while the context is open: keep what VisionZip reads
    kept = {m: dict(captures[m]) for m in ("image", "video") if m in captures}
    return turn, kept


def selection_rows(model, turn, captures, kind: str, selectors, reps: int, warmup: int) -> list[dict]:
    from ..configuration import RaincheckConfig
    from ..plan import select_visual_rows

    device = turn.embeds.device
    rows = []
    from ..selection.kernels import mmtok_one_launch

    # (selector, fast_path, variant): each greedy selector's reference loop too, and mmtok's greedy as two launches
    # a pick beside the default (one launch for every pick where it fits)
    variants = [(s, None, "default") for s in selectors] + [(s, False, "reference") for s in selectors if s in GREEDY]
    variants += [("mmtok", None, "two_launches")] if "mmtok" in selectors and device.type == "cuda" else []
    for name, fast, variant in variants:
        config = RaincheckConfig(selector=name, fast_path=fast)
        selector = config.build_selector()

        def run():
            with torch.no_grad(), mmtok_one_launch(False if variant == "two_launches" else None):
                return select_visual_rows(turn, config, selector, model=model, captures=captures)

        keep = run()
        times = _timed(run, device, warmup, reps)
        rows.append({"selector": name, "variant": variant, "input": kind,
                     "tokens": int(turn.num_visual), "segments": len(turn.segments), "kept": int(keep.sum()),
                     "device": device.type, "median_ms": statistics.median(times), "reps_ms": times})
    if "mmtok" in selectors and device.type == "cuda":
        rows += mmtok_part_rows(turn, kind, reps, warmup)
    return rows


def mmtok_part_rows(turn, kind: str, reps: int, warmup: int) -> list[dict]:
    """mmtok's parts on the turn's first group of equal segments (the image, or a video's slices): its kernel inputs
    (the coverage matrices) and its greedy alone, in one launch and in two launches a pick (captured graphs)."""
    from ..configuration import RaincheckConfig
    from ..selection import SelectionContext, get_selector
    from ..selection.base import keep_count
    from ..selection.kernels import greedy_select, mmtok_one_launch, mmtok_transposed_column, whole_run_shape

    device = turn.embeds.device
    first = turn.segments[0].features.shape
    group = [s for s in turn.segments if s.features.shape == first]
    features = torch.stack([s.features for s in group])
    text = turn.embeds[turn.text_rows]
    selector = get_selector("mmtok")
    k = keep_count(RaincheckConfig().retention, int(first[0]))  # (what `select_visual_rows` keeps by default)
    context = SelectionContext(text_embeds=text)
    inputs = selector.kernel_inputs(features, context)
    parts = [("inputs", lambda: selector.kernel_inputs(features, context))]
    # the one-launch run (the winner's column from a transposed copy of P, the default, or P's strided column:
    # `kernels.mmtok_transposed_column`), then two launches a pick
    forms = (("greedy_one_launch", True, True), ("greedy_one_launch_strided", True, False),
             ("greedy_two_launches", False, True))
    for variant, one_launch, transposed in forms:
        if one_launch and whole_run_shape(*features.shape[:2], inputs["P"].shape[1], device) is None:
            continue

        def greedy(one_launch=one_launch, transposed=transposed):
            with mmtok_one_launch(one_launch), mmtok_transposed_column(transposed):
                return greedy_select("mmtok", inputs, k)

        parts.append((variant, greedy))
    rows = []
    for variant, fn in parts:
        with torch.no_grad():
            times = _timed(fn, device, warmup, reps)
        rows.append({"selector": "mmtok", "variant": variant, "input": kind, "tokens": int(features.shape[0] *
                     features.shape[1]), "segments": len(group), "kept": k * len(group), "device": device.type,
                     "median_ms": statistics.median(times), "reps_ms": times})
    return rows


def t1_rows(model, inputs: dict, kind: str, selectors, reps: int, warmup: int) -> list[dict]:
    import raincheck_hf
    from ..configuration import RaincheckConfig

    raincheck_hf.enable(model)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    common = dict(max_new_tokens=1, min_new_tokens=1, do_sample=False)
    variants = [("stock", None)] + [("full", RaincheckConfig(mode="full"))]
    variants += [(name, RaincheckConfig(selector=name)) for name in selectors]
    if "mmtok" in selectors and device.type == "cuda":  # its greedy as two launches a pick, beside the default
        variants.append(("mmtok_two_launches", RaincheckConfig(selector="mmtok")))

    def runner(name, config):
        from ..selection.kernels import mmtok_one_launch

        def run():
            with torch.no_grad(), mmtok_one_launch(False if name == "mmtok_two_launches" else None):
                if config is None:
                    return model.generate(**inputs, **common)
                return model.generate(**inputs, **common, raincheck=config)

        return run

    runs = {name: runner(name, config) for name, config in variants}
    for run in runs.values():  # every variant warm (graphs captured, kernels compiled) before any timing
        _timed(run, device, warmup, 0)
    # repetitions interleaved (round robin over the variants), so that a drift in the machine's state over
    # the run lands on every variant alike instead of on whichever ran at that time
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            times[name] += _timed(run, device, 0, 1)
    rows = [{"variant": name, "input": kind, "device": device.type, "median_ms": statistics.median(t), "reps_ms": t}
            for name, t in times.items()]
    by = {r["variant"]: r["median_ms"] for r in rows}
    for r in rows:
        r["x_full"] = r["median_ms"] / by["full"]
        r["x_stock"] = r["median_ms"] / by["stock"]
        if "uniform" in by:
            r["x_uniform"] = r["median_ms"] / by["uniform"]
    return rows


def print_tables(result: dict, log=print) -> None:
    log(f"\nselection time, {result['model']['name']} on {result['hardware'].get('gpu') or result['hardware'].get('cpu')} (median ms)")
    log(f"{'selector':<11} {'variant':<10} {'input':<6} {'tokens':>7} {'segments':>8} {'median ms':>10}")
    for r in result["rows"]:
        log(f"{r['selector']:<11} {r['variant']:<10} {r['input']:<6} {r['tokens']:>7} {r['segments']:>8} "
            f"{r['median_ms']:>10.2f}")
    if result.get("t1_rows"):
        log("\nT1 through generate(max_new_tokens=1) (median ms)")
        log(f"{'variant':<10} {'input':<6} {'T1 ms':>8} {'x full':>7} {'x stock':>8} {'x uniform':>10}")
        for r in result["t1_rows"]:
            log(f"{r['variant']:<10} {r['input']:<6} {r['median_ms']:>8.1f} {r['x_full']:>7.2f} {r['x_stock']:>8.2f} "
                f"{r.get('x_uniform', float('nan')):>10.2f}")


def run(model_name: str = "tiny_qwen3_vl", device: str | None = None, kinds=("image", "video"), selectors=SELECTORS,
        reps: int = 5, warmup: int = 2, t1: bool = False, t1_reps: int = 5, out: str | None = None,
        command: str | None = None, log=print) -> dict:
    from .latency import _write, hardware_info

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    unknown = set(selectors) - set(SELECTORS)
    if unknown:
        raise ValueError(f"--selectors: unknown {sorted(unknown)}; choose from {list(SELECTORS)}")
    model, prompts, info = build(model_name, device, kinds)
    model.eval()
    result = {"benchmark": "selectors", "date": datetime.date.today().isoformat(), "command": command,
              "hardware": hardware_info(device), "model": info, "settings": {"retention": 0.3, "reps": reps,
                                                                             "warmup": warmup},
              "inputs": {k: v[1] for k, v in prompts.items()}, "rows": [], "t1_rows": []}
    for kind, (inputs, _info) in prompts.items():
        turn, captures = encode(model, inputs)
        result["rows"] += selection_rows(model, turn, captures, kind, selectors, reps, warmup)
        log(f"[selectors] {kind}: {turn.num_visual} visual tokens in {len(turn.segments)} segments done")
        if t1:
            result["t1_rows"] += t1_rows(model, inputs, kind, selectors, t1_reps, warmup)
    print_tables(result, log)
    if out:
        _write(result, out)
        log(f"[selectors] wrote {out}")
    return result


def main(argv=None):
    import sys

    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench selectors", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="qwen3_vl_8b / qwen3_5_9b (GPU), tiny_qwen3_vl / tiny_qwen3_5, bundled_qwen3_vl / "
                             "bundled_qwen3_5 (default: qwen3_vl_8b on CUDA, tiny_qwen3_vl on CPU)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--inputs", default="image,video", help="comma-separated: image, video (default: both)")
    parser.add_argument("--selectors", default=",".join(SELECTORS), help=f"comma-separated (default: all: {','.join(SELECTORS)})")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per selector (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    parser.add_argument("--t1", action="store_true", help="also time the first token through generate per selector")
    parser.add_argument("--t1-reps", type=int, default=5, help="timed generate calls per variant (default: 5)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    model = args.model or ("qwen3_vl_8b" if cuda else "tiny_qwen3_vl")
    kinds = [k for k in args.inputs.split(",") if k]
    if model in BUNDLED:
        kinds = ["image"]
    return run(model, args.device, kinds, [s for s in args.selectors.split(",") if s], args.reps, args.warmup,
               args.t1, args.t1_reps, args.out, command="python -m raincheck_hf.bench selectors " + " ".join(
                   argv if argv is not None else sys.argv[1:]))
