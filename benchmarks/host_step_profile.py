"""Host time of one batched decode step, by part: a CPU diagnosis tool for the batched engine's fixed per-step cost.

    python benchmarks/host_step_profile.py --batch 1,8,32 --tokens 48 --json out.json
    python benchmarks/host_step_profile.py --batch 8 --mode raincheck --cprofile 30   # + the top functions

It runs batched ``generate`` on the tiny Qwen3-VL model (`raincheck_hf.tiny`, fp32, CPU) through the batched engine
at every batch size, B = 1 included (`batch_engine.batched_sample`, called as `integration.enable`'s wrapper calls it
for B > 1: the server runs even one client there), with captured decode steps requested (``fast_path=True``: on a
CPU the static-buffer step of `fast.batched_graphs` runs eagerly, which is the captured path's host side), each row
its own image prompt and exactly ``--tokens`` answer tokens (``min_new_tokens``), greedy, for ``full`` and the
default ``raincheck`` settings.

Per decode iteration (from one `BatchEngine.step` call to the next: the step, then choosing the tokens and feeding
them) it times the parts with ``time.perf_counter`` and the model forward itself (the text model and the LM head,
through forward hooks). ``host_ms`` is the iteration minus the model forward; ``host_outside_replay_ms`` the
iteration minus the whole step callable of `fast.batched_graphs` (the forward, the slot keys and the visibility
mask: on CUDA one asynchronous graph replay), i.e. the host time around the replay: the figure to cut. The parts
(inclusive, so they nest: ``prepare_ahead`` holds the ``schedule`` and ``graphs_prepare`` of a step launched as
prepared, ``step`` those of a step decided when it runs, and ``graphs_launch`` the forward):

- ``schedule``: `RowScheduler.schedule` (each sequence's decode rows, its chunk, its trace);
- ``prepare_ahead``: `BatchEngine.prepare`, the next step decided and its buffers filled before the driver reads
  the tokens (it holds ``schedule`` and ``graphs_prepare`` of the steps launched as prepared);
- ``graphs_prepare``: `BatchedStepGraphs.prepare` (placement, the fill), ``fill``: its `BatchedStepGraphs._fill`;
  ``graphs_launch``: `BatchedStepGraphs.launch` (the step, the logits' gather);
  ``graphs_step_host``: the step callable without the model forward (the slot keys,
  the visibility mask, the logits copy);
- ``eager_run``: `ForwardRunner.run` (steps that are not decode-only run there);
- ``sample``: `generation.choose_next_tokens` (logits processors, argmax);
- ``run_other``: `BatchedStepGraphs.prepare` and `launch` outside the fill and the step callable;
- ``driver``: the rest of the iteration (stopping criteria, the one read of the tokens, feeding: ``feed`` is
  `BatchEngine.feed` / `feed_all`).

Medians over the decode iterations of ``--reps`` timed calls (after one untimed warm-up call, so nothing is
created for the first time); for the iteration, ``host`` and ``host_outside_replay`` also the 20th percentile
(``_p20_ms``): on a machine shared with other work, the OS's preemptions add spikes of milliseconds to random
iterations and parts, which a low quantile leaves out. CPU timings of a tiny model: they say where the host's time
goes and how a change moves it, not what a GPU step costs. The JSON carries the hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package

from raincheck_hf import RaincheckConfig, batch_engine, integration  # noqa: E402
from raincheck_hf.bench.latency import write_script_result  # noqa: E402
from raincheck_hf.fast import batched_graphs  # noqa: E402
from raincheck_hf.models import get_adapter  # noqa: E402
from raincheck_hf.tiny import build_tiny_processor, build_tiny_qwen3_vl, draw_test_image  # noqa: E402

PARTS = ("step", "schedule", "prepare_ahead", "graphs_prepare", "graphs_launch", "fill", "graphs_step", "eager_run",
         "sample", "feed", "remove")


class StepClock:
    """Per decode iteration (`BatchEngine.step` entry to the next entry), the seconds of each part and of the model
    forward (``model``), gathered through wrappers installed by `installed`."""

    def __init__(self):
        self.iterations: list[dict] = []
        self._start = None
        self.on = False
        self.profiler = None  # a cProfile.Profile to run over the decode iterations only (from the second step on)

    def mark(self):
        if self.profiler is not None and len(self.iterations) == 1:  # the prefill step ran: decode from here
            self.profiler.enable()
        now = time.perf_counter()
        if self._start is not None and self.iterations:
            self.iterations[-1]["total"] = now - self._start
        self._start = now
        self.iterations.append({"total": None})

    def end(self):  # the call returned: the open iteration ends here
        if self.profiler is not None:
            self.profiler.disable()
        self.mark()
        self.iterations.pop()
        self._start = None

    def add(self, part: str, seconds: float):
        if self.on and self.iterations:
            it = self.iterations[-1]
            it[part] = it.get(part, 0.0) + seconds


@contextlib.contextmanager
def installed(clock: StepClock, model):
    """Wrap the parts (class attributes, restored on exit) and hook the model forward."""
    targets = [
        (batch_engine.RowScheduler, "schedule", "schedule"),
        (batched_graphs.BatchedStepGraphs, "prepare", "graphs_prepare"),
        (batched_graphs.BatchedStepGraphs, "launch", "graphs_launch"),
        (batched_graphs.BatchedStepGraphs, "_fill", "fill"),
        (batch_engine.BatchEngine, "prepare", "prepare_ahead"),
        (batch_engine.BatchEngine, "feed_all", "feed"),
        (batched_graphs.BatchedStepGraphs, "_step", "graphs_step"),
        (batch_engine.ForwardRunner, "run", "eager_run"),
        (batch_engine.BatchEngine, "feed", "feed"),
        (batch_engine.BatchEngine, "remove", "remove"),
        (batch_engine, "choose_next_tokens", "sample"),
    ]
    saved = []

    def timed(fn, part):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.add(part, time.perf_counter() - t)
        return wrapper

    for owner, name, part in targets:
        original = owner.__dict__[name]
        saved.append((owner, name, original))
        setattr(owner, name, timed(original, part))
    step = batch_engine.BatchEngine.step  # not among the parts above: it marks each step's start and times it

    @functools.wraps(step)
    def marked(self):
        clock.mark()
        t = time.perf_counter()
        try:
            return step(self)
        finally:
            clock.add("step", time.perf_counter() - t)

    saved.append((batch_engine.BatchEngine, "step", step))
    batch_engine.BatchEngine.step = marked

    adapter = get_adapter(model)
    starts = {}
    handles = []
    for module in (adapter.text_model, adapter.lm_head):
        handles.append(module.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter())))
        handles.append(module.register_forward_hook(
            lambda m, a, o: clock.add("model", time.perf_counter() - starts.pop(id(m)))))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, name, original in saved:
            setattr(owner, name, original)


def generate_batched(model, inputs: dict, config: RaincheckConfig, tokens: int):
    """``generate(**inputs, raincheck=config)`` through the batched engine at any batch size (B = 1 too), as
    `integration.enable`'s wrapper runs a batch."""
    kwargs = dict(inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    kwargs = integration.validate_request(model, config, (), kwargs)
    grids = {name: kwargs.get(name) for name in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    original = vars(model)[integration._ORIGINAL]
    with contextlib.ExitStack() as stack:
        captures = None
        if integration._needs_vision_attention(config):
            captures = stack.enter_context(integration.VisionAttentionCapture(model, grids))
        return original(custom_generate=batch_engine.batched_sample, raincheck_config=config, raincheck_grids=grids,
                        raincheck_streamer=None, raincheck_captures=captures, raincheck_pixels=None, **kwargs)


def build_inputs(processor, batch: int, image_size=(192, 160)) -> dict:
    """``batch`` left-padded image prompts, a different picture each (same size: every row does the same work)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [draw_test_image(*image_size, seed=i) for i in range(batch)]
    processor.tokenizer.padding_side = "left"
    return dict(processor(text=[prompt] * batch, images=images, padding=True, return_tensors="pt"))


def summarize(iterations: list[dict]) -> dict:
    """Medians (ms) over the decode iterations (the first, the prefill's, and any without a following step are
    dropped by the caller)."""
    def med(values):
        return 1e3 * statistics.median(values) if values else 0.0

    rows = []
    for it in iterations:
        row = {p: it.get(p, 0.0) for p in PARTS}
        row["total"] = it["total"]
        row["model"] = it.get("model", 0.0)
        row["host"] = it["total"] - row["model"]
        row["graphs_step_host"] = max(row["graphs_step"] - row["model"], 0.0) if row["graphs_step"] else 0.0
        row["driver"] = row["total"] - row["step"] - row["sample"] - row["prepare_ahead"]
        graphs = row["graphs_prepare"] + row["graphs_launch"]
        row["run_other"] = graphs - row["fill"] - row["graphs_step"] if graphs else 0.0
        # on CUDA the whole step callable is one asynchronous graph replay: what the host adds outside it
        row["host_outside_replay"] = row["total"] - row["graphs_step"] - (0.0 if row["graphs_step"] else row["model"])
        rows.append(row)
    keys = ("total", "model", "host", "host_outside_replay", *PARTS, "graphs_step_host", "run_other", "driver")
    out = {"iterations": len(rows), **{f"{k}_ms": med([r[k] for r in rows]) for k in keys}}
    for k in ("total", "host", "host_outside_replay"):  # a low quantile: the cost without the host's preemptions
        values = sorted(r[k] for r in rows)
        out[f"{k}_p20_ms"] = 1e3 * values[len(values) // 5] if values else 0.0
    return out


def profile_case(model, processor, batch: int, mode: str, tokens: int, reps: int, cprofile: int = 0) -> dict:
    config = RaincheckConfig(mode=mode, fast_path=True)
    inputs = build_inputs(processor, batch)
    clock = StepClock()
    with torch.no_grad(), installed(clock, model):
        generate_batched(model, inputs, config, tokens)  # warm-up (untimed)
        clock.end()
        clock.iterations.clear()
        decode = []
        clock.on = True
        for _ in range(reps):
            generate_batched(model, inputs, config, tokens)
            clock.end()
            decode += [it for it in clock.iterations[1:] if it["total"] is not None]  # [0]: the prefill step
            clock.iterations.clear()
        clock.on = False
        top = None
        if cprofile:
            prof = cProfile.Profile()
            clock.profiler = prof
            generate_batched(model, inputs, config, tokens)
            clock.end()
            clock.profiler = None
            clock.iterations.clear()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(cprofile)
            top = out.getvalue()
    result = {"batch": batch, "mode": mode, "tokens": tokens, "reps": reps, **summarize(decode)}
    if top is not None:
        result["cprofile_top"] = top
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,8,32", help="batch sizes, comma-separated")
    parser.add_argument("--mode", default="full,raincheck", help="modes, comma-separated (full, raincheck, ...)")
    parser.add_argument("--tokens", type=int, default=48, help="answer tokens per row")
    parser.add_argument("--reps", type=int, default=2, help="timed calls per case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: host timings less noisy)")
    parser.add_argument("--cprofile", type=int, default=0,
                        help="also print the top N functions (by own time) of one more call's decode iterations")
    parser.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. before / after)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = integration.enable(build_tiny_qwen3_vl(seed=0).eval())
    processor = build_tiny_processor()
    rows = []
    for mode in args.mode.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            row = profile_case(model, processor, batch, mode, args.tokens, args.reps, args.cprofile)
            top = row.pop("cprofile_top", None)
            rows.append(row)
            parts = " ".join(f"{k[:-3]}={row[k]:.2f}" for k in row if k.endswith("_ms") and k not in
                             ("total_ms", "model_ms", "host_ms", "host_outside_replay_ms"))
            parts = " ".join(p for p in parts.split() if "_p20" not in p)
            print(f"{mode:>9} B={batch:<3} host outside the replay {row['host_outside_replay_ms']:.2f} ms/step "
                  f"(p20 {row['host_outside_replay_p20_ms']:.2f}), "
                  f"host {row['host_ms']:.2f} (iteration {row['total_ms']:.2f}, "
                  f"model {row['model_ms']:.2f}) | {parts}", flush=True)
            if top:
                print(top, flush=True)
    return write_script_result("host_step_profile.py", argv, args.json, label=args.label, rows=rows,
                               what="host ms per batched decode step (tiny Qwen3-VL, CPU; a diagnosis, not a GPU "
                                    "figure)")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
