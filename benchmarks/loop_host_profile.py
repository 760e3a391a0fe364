"""Host time of one step of the continuous-batching loop (`batch_loop.BatchLoop`) with N turns at once, split at the
step's one read of the tokens: a CPU diagnosis tool for the loop's per-step cost beside batched ``generate``'s.

    python benchmarks/loop_host_profile.py --turns 1,8,32 --tokens 32 --json out.json
    python benchmarks/loop_host_profile.py --turns 32 --variant server --cprofile 30   # + the top functions
    python benchmarks/loop_host_profile.py --model qwen3_vl_8b --turns 8,32 --variant server --syncs --cprofile 40

On a GPU (``--model`` a real shape, random bf16 weights, its 1,344-token image; or a tiny one) the loop's steps are
the captured ones a user gets, and the parts below say where the host's time per step goes while the device runs the
step before: ``--syncs`` counts, in one more round, the synchronizing CUDA calls the loop's own thread makes per step
(torch's sync debug mode; the step's one intended wait is its read of the tokens in `BatchLoop._complete`) by the
line that made them, and each part's thread CPU time is kept beside its wall time (a wait for the device spins: CPU
time that is not Python).

It runs N `Conversation`s on one `BatchLoop` over the tiny Qwen3-VL model (`raincheck_hf.tiny`, fp32, CPU, captured
decode steps requested: ``fast_path=True``, whose static-buffer step runs eagerly on a CPU), each its own image
prompt, all handed to the loop while its thread is held so that they join together, each answering ``--tokens``
tokens (greedy; the end-of-text id is one the tiny model never picks: every answer runs to its length). Variants:

- ``plain``: no logits processor, no streamer (what the loop does for a bare greedy turn);
- ``server``: as the server's batching mode sets a turn up for `bench serve-load`'s requests: ``min_tokens`` (HF's
  ``min_new_tokens`` processor), an OpenAI ``logit_bias`` processor (`serve.app`'s ``_LogitBias``, the same bias in
  every request) and a streamer per turn (`serve.app`'s ``_Pieces``, which decodes
  the answer's text after each token and hands the new piece to a callback; here a list).

Per decode iteration (one `BatchEngine.step` entry to the next) the parts, from ``time.perf_counter`` marks:

- ``step``: `BatchEngine.step` (the launch of the prepared step; ``model``: the text model and LM head inside it);
- ``before_read``: from the step's return to the end of `BatchEngine.prepare` (choosing every turn's token with
  its processors, its stopping criteria, feeding the engine, preparing the next step): on a GPU this host work
  overlaps the device's step;
- ``choose``: the part of ``before_read`` spent choosing tokens and running stopping criteria;
- ``prepare``: `BatchEngine.prepare` (the next step decided and its buffers filled);
- ``after_read``: from there to the next `BatchEngine.step` entry (the one read of the tokens, streaming each
  turn's token, turns that end, the loop's top: cancellations, restoration, the hand-off): on a GPU the device
  waits for this.

Only iterations with all N turns in the step and none ending are kept (the last step of each answer, where every
turn leaves with its cache, is not a per-token cost). Medians over ``--reps`` timed rounds after one warm-up round,
and the 20th percentile of ``host`` (the iteration minus the model): a machine shared with other work adds spikes to
random iterations. CPU timings of a tiny model: they say where the loop's host time goes and how a change moves
it, not what a GPU step costs. ``--generate`` adds batched ``generate`` at the same N
(`benchmarks/host_step_profile.py`) for comparison. The JSON carries the hardware.
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
import threading
import time

import torch
from transformers import LogitsProcessorList

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling scripts)

from raincheck_hf import BatchLoop, Conversation, RaincheckConfig, batch_engine, batch_loop, integration  # noqa: E402
from raincheck_hf.bench import shapes  # noqa: E402
from raincheck_hf.bench.latency import write_script_result  # noqa: E402
from raincheck_hf.models import get_adapter  # noqa: E402
from raincheck_hf.tiny import build_tiny_processor, draw_test_image  # noqa: E402
from prepare_syncs import _size, count_syncs  # noqa: E402 (the --image-size parser, the sync counter)

VARIANTS = ("plain", "server")


class LoopClock:
    """Marks of each loop iteration (`BatchEngine.step` entry to the next), from wrappers installed by `installed`."""

    def __init__(self):
        self.iterations: list[dict] = []
        self.on = False
        self.profiler = None

    def start_step(self):
        now, cpu = time.perf_counter(), time.thread_time()
        if self.iterations and "next" not in self.iterations[-1]:
            self.iterations[-1]["next"], self.iterations[-1]["next_cpu"] = now, cpu
        if self.on:
            self.iterations.append({"entry": now, "entry_cpu": cpu, "model": 0.0, "choose": 0.0, "choose_cpu": 0.0,
                                    "prepare_cpu": 0.0})

    def current(self):
        return self.iterations[-1] if self.on and self.iterations and "next" not in self.iterations[-1] else None


@contextlib.contextmanager
def installed(clock: LoopClock, model):
    saved = []

    def wrap(owner, name, wrapper_of):
        original = owner.__dict__[name]
        saved.append((owner, name, original))
        setattr(owner, name, functools.wraps(original)(wrapper_of(original)))

    def step_wrapper(step):
        def wrapper(self):
            clock.start_step()
            out = step(self)
            it = clock.current()
            if it is not None:
                it["returned"], it["returned_cpu"] = time.perf_counter(), time.thread_time()
                it["rows"] = len(out)
                it["sequences"] = len(self.sequences)
            return out
        return wrapper

    def prepare_wrapper(prepare):
        def wrapper(self):
            t, cpu = time.perf_counter(), time.thread_time()
            try:
                return prepare(self)
            finally:
                it = clock.current()
                if it is not None:
                    it["prepare"] = it.get("prepare", 0.0) + time.perf_counter() - t
                    it["prepare_cpu"] += time.thread_time() - cpu
                    it["prepared"], it["prepared_cpu"] = time.perf_counter(), time.thread_time()
        return wrapper

    def timed(part):
        def wrapper_of(fn):
            def wrapper(*args, **kwargs):
                t, cpu = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    it = clock.current()
                    if it is not None:
                        it[part] = it.get(part, 0.0) + time.perf_counter() - t
                        it[f"{part}_cpu"] = it.get(f"{part}_cpu", 0.0) + time.thread_time() - cpu
            return wrapper
        return wrapper_of

    wrap(batch_engine.BatchEngine, "step", step_wrapper)
    wrap(batch_engine.BatchEngine, "prepare", prepare_wrapper)
    # the loop's choosing: `_choose_all` (every turn's), or before it existed `_choose` (one turn's)
    name = "_choose_all" if "_choose_all" in batch_loop.BatchLoop.__dict__ else "_choose"
    wrap(batch_loop.BatchLoop, name, timed("choose"))
    adapter = get_adapter(model)
    starts = {}
    handles = []
    for module in (adapter.text_model, adapter.lm_head):
        handles.append(module.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter())))

        def post(m, a, o):
            it = clock.current()
            if it is not None:
                it["model"] += time.perf_counter() - starts.pop(id(m))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, name, original in saved:
            setattr(owner, name, original)


class _Sink:
    """The server's streamer's consumer: the pieces it hands over, kept."""

    def __init__(self):
        self.pieces, self.tokens = [], 0

    def emit(self, item):
        self.pieces.append(item)

    def count(self, n):
        self.tokens += n


def one_round(loop, convs, prompts, tokens: int, variant: str, eos: int):
    """Every conversation asks its prompt at once (the loop's thread held until all were handed over)."""
    from raincheck_hf.serve.app import _LogitBias, _Pieces

    gate, inside = threading.Event(), threading.Event()

    def hold():
        inside.set()
        gate.wait()

    holder = threading.Thread(target=loop.call, args=(hold,))
    holder.start()
    inside.wait()
    errors, sinks = [], []

    def ask(i):
        kw = dict(max_new_tokens=tokens, eos_token_id=eos)
        if variant == "server":
            kw["min_new_tokens"] = tokens  # (as `bench serve-load` asks: min_tokens)
            kw["logits_processor"] = LogitsProcessorList([_LogitBias({11: -2.0, 12: 1.5, 13: 0.5})])
            sink = _Sink()
            sinks.append(sink)
            kw["streamer"] = _Pieces(convs[i].processor.tokenizer, sink.emit, sink.count)
        try:
            convs[i].ask(prompts[i][0], images=[prompts[i][1]], **kw)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    while len(loop._incoming) < len(convs):
        time.sleep(0.002)
    gate.set()
    holder.join()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [c.turns[-1] for c in convs], sinks


def summarize(iterations: list[dict], turns: int) -> dict:
    rows = []
    for it in iterations:
        if "next" not in it or "prepared" not in it or it.get("rows") != turns or it.get("sequences") != turns:
            continue
        total = it["next"] - it["entry"]
        row = {"total": total, "model": it["model"], "step": it["returned"] - it["entry"],
               "before_read": it["prepared"] - it["returned"], "choose": it["choose"], "prepare": it["prepare"],
               "after_read": it["next"] - it["prepared"]}
        row["host"] = total - row["model"]
        # the loop's thread's CPU time in each part (beside the wall times: a wait for the device spins)
        row.update(total_cpu=it["next_cpu"] - it["entry_cpu"], step_cpu=it["returned_cpu"] - it["entry_cpu"],
                   before_read_cpu=it["prepared_cpu"] - it["returned_cpu"], choose_cpu=it["choose_cpu"],
                   prepare_cpu=it["prepare_cpu"], after_read_cpu=it["next_cpu"] - it["prepared_cpu"])
        rows.append(row)
    out = {"iterations": len(rows)}
    for k in ("total", "model", "host", "step", "before_read", "choose", "prepare", "after_read"):
        out[f"{k}_ms"] = 1e3 * statistics.median(r[k] for r in rows) if rows else 0.0
    for k in ("total", "step", "before_read", "choose", "prepare", "after_read"):
        out[f"{k}_cpu_ms"] = 1e3 * statistics.median(r[f"{k}_cpu"] for r in rows) if rows else 0.0
    hosts = sorted(r["host"] for r in rows)
    out["host_p20_ms"] = 1e3 * hosts[len(hosts) // 5] if hosts else 0.0
    out["host_per_turn_ms"] = out["host_ms"] / turns
    return out


def loop_syncs(loop, run_round) -> dict:
    """One ``run_round()`` under torch's sync debug mode: the synchronizing CUDA calls made on the loop's own thread,
    by the line that made them (`prepare_syncs.count_syncs`; the asking threads' calls are not counted), and the
    steps it ran."""
    steps = loop.steps
    _, where = count_syncs(run_round, thread=loop._thread.name if loop._thread is not None else None)
    steps = loop.steps - steps
    return {"steps": steps, "syncs": sum(where.values()), "per_step": sum(where.values()) / max(steps, 1),
            "where": dict(where.most_common())}


def profile_case(model, processor, turns: int, variant: str, tokens: int, reps: int, mode: str,
                 cprofile: int = 0, image_size: tuple[int, int] = (192, 160), syncs: bool = False) -> dict:
    config = RaincheckConfig(mode=mode, fast_path=True)
    prompts = [("Describe the image.", draw_test_image(*image_size, seed=i)) for i in range(turns)]
    eos = model.config.text_config.vocab_size - 1 if hasattr(model.config, "text_config") else 0
    clock = LoopClock()
    top, synced = None, None
    with torch.no_grad(), installed(clock, model), BatchLoop(model, max_batch_tokens=None, config=config) as loop:
        def fresh():  # a new conversation per turn and round (each round a first turn)
            return [Conversation(model, processor, config, background=False, loop=loop) for _ in range(turns)]

        def close(convs):
            for c in convs:
                c.close()

        convs = fresh()
        one_round(loop, convs, prompts, tokens, variant, eos)  # warm-up (untimed)
        close(convs)
        answered = []
        for _ in range(reps):
            convs = fresh()
            clock.on = True
            got, _ = one_round(loop, convs, prompts, tokens, variant, eos)
            clock.on = False
            answered += [t.token_ids.numel() for t in got]
            close(convs)
        if cprofile:
            convs = fresh()
            prof = cProfile.Profile()
            loop.call(prof.enable)  # (the loop's own thread)
            one_round(loop, convs, prompts, tokens, variant, eos)
            loop.call(prof.disable)
            close(convs)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(cprofile)
            top = out.getvalue()
        if syncs and torch.cuda.is_available():
            convs = fresh()
            synced = loop_syncs(loop, lambda: one_round(loop, convs, prompts, tokens, variant, eos))
            close(convs)
    result = {"turns": turns, "variant": variant, "mode": mode, "tokens": tokens, "reps": reps,
              "image_size": list(image_size), "answer_tokens_min": min(answered),
              **summarize(clock.iterations, turns)}
    if synced is not None:
        result["loop_syncs"] = synced
    if top is not None:
        result["cprofile_top"] = top
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_qwen3_vl", choices=sorted(shapes.MODELS),
                        help="a tiny model (CPU, or a GPU when there is one) or a real shape with random bf16 "
                             "weights (a GPU)")
    parser.add_argument("--image-size", type=_size, default=None, metavar="WxH",
                        help="each turn's picture (default: 192x160 on a tiny model, the shape's 1,344-token "
                             "picture on a real one)")
    parser.add_argument("--syncs", action="store_true",
                        help="one more round counting the loop thread's synchronizing CUDA calls per step (a GPU)")
    parser.add_argument("--turns", default="1,8,32", help="concurrent turns, comma-separated")
    parser.add_argument("--variant", default=",".join(VARIANTS), help="plain, server (comma-separated)")
    parser.add_argument("--mode", default="raincheck",
                        help="RaincheckConfig modes (raincheck, full, ...), comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="answer tokens per turn")
    parser.add_argument("--reps", type=int, default=2, help="timed rounds per case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: host timings less noisy)")
    parser.add_argument("--generate", action="store_true",
                        help="also batched generate at the same N (benchmarks/host_step_profile.py)")
    parser.add_argument("--cprofile", type=int, default=0,
                        help="also print the top N functions (by own time) of one more round on the loop's thread")
    parser.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. before / after)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = shapes.MODELS[args.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, model_info = shapes.build_model(args.model, device, dtype=None if device.type == "cuda" else torch.float32)
    model = integration.enable(model.eval())
    image_size = args.image_size or (tuple(spec.image_size) if spec.real_shape else (192, 160))
    processor = (shapes.build_processor() if spec.real_shape
                 else build_tiny_processor(max_pixels=max(image_size[0] * image_size[1], 192 * 160)))
    rows, generate_rows, warmed = [], [], {}
    if device.type == "cuda":  # every batched step a case can take captured first, as `serve --batching` does at start
        from raincheck_hf.warmup import DEFAULT_MAX_TOKENS, warm_up

        for mode in args.mode.split(","):
            began = time.perf_counter()
            summary = warm_up(model, processor, RaincheckConfig(mode=mode, fast_path=True), max_tokens=DEFAULT_MAX_TOKENS,
                              max_new_tokens=args.tokens, batch=max(int(n) for n in args.turns.split(",")),
                              conversations=0, image_sizes=[(image_size[1], image_size[0])], cache_dir=False,
                              progress=False)
            warmed[mode] = {"batched_captured": summary.batched, "seconds": round(time.perf_counter() - began, 1)}
            print(f"warm-up ({mode}): {summary.batched} batched steps captured in {warmed[mode]['seconds']} s",
                  flush=True)
    for variant in args.variant.split(","):
        if variant not in VARIANTS:
            raise ValueError(f"--variant must be among {VARIANTS}, got {variant!r}")
        for mode, turns in ((m, int(n)) for m in args.mode.split(",") for n in args.turns.split(",")):
            row = profile_case(model, processor, turns, variant, args.tokens, args.reps, mode, args.cprofile,
                               image_size, args.syncs)
            top = row.pop("cprofile_top", None)
            rows.append(row)
            print(f"{variant:>7} {mode} N={turns:<3} host {row['host_ms']:.2f} ms/step (p20 {row['host_p20_ms']:.2f}, "
                  f"{row['host_per_turn_ms']:.3f} per turn) | before the read {row['before_read_ms']:.2f} "
                  f"(choose {row['choose_ms']:.2f}, prepare {row['prepare_ms']:.2f}) | after the read "
                  f"{row['after_read_ms']:.2f} | step {row['step_ms']:.2f} (model {row['model_ms']:.2f}) "
                  f"[{row['iterations']} steps]", flush=True)
            print(f"{'':>7} thread CPU ms: before the read {row['before_read_cpu_ms']:.2f} (choose "
                  f"{row['choose_cpu_ms']:.2f}, prepare {row['prepare_cpu_ms']:.2f}) | after the read "
                  f"{row['after_read_cpu_ms']:.2f} | step {row['step_cpu_ms']:.2f} | iteration "
                  f"{row['total_cpu_ms']:.2f}", flush=True)
            if "loop_syncs" in row:
                synced = row["loop_syncs"]
                print(f"{'':>7} loop thread: {synced['syncs']} synchronizing calls in {synced['steps']} steps",
                      flush=True)
                for where, n in synced["where"].items():
                    print(f"{'':>9}{n:6d}  {where}", flush=True)
            if top:
                print(top, flush=True)
    if args.generate:
        import host_step_profile

        for turns in (int(n) for n in args.turns.split(",")):
            row = host_step_profile.profile_case(model, processor, turns, args.mode.split(",")[0], args.tokens,
                                                 args.reps)
            generate_rows.append(row)
            print(f"generate B={turns:<3} host {row['host_ms']:.2f} ms/step (p20 {row['host_p20_ms']:.2f}) "
                  f"(iteration {row['total_ms']:.2f}, model {row['model_ms']:.2f})", flush=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return write_script_result("loop_host_profile.py", argv, args.json, label=args.label, rows=rows,
                               generate_rows=generate_rows, model_info=model_info, device=str(device), gpu=gpu,
                               batched_warm_up=warmed,
                               what=f"host ms per step of the batching loop with N turns ({args.model} on "
                                    f"{device.type}; a diagnosis of where the loop's host time goes)")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
