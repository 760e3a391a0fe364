"""Where a conversation's first turn waits for the device while it is prepared for the batching loop: a CUDA
diagnosis of `BatchLoop.prepare_ahead` (HF's preparation, the vision tower, the selection, the plan).

    python benchmarks/prepare_syncs.py --model qwen3_vl_8b --json prepare_syncs.json
    python benchmarks/prepare_syncs.py --model tiny_qwen3_vl            # a CPU smoke run (no synchronization)

Why it matters: under load the loop's thread holds the interpreter most of the time, and each call of a preparing
thread that waits for the device gives the interpreter up; taking it back can wait for the loop's thread (up to the
interpreter's switch interval, 5 ms by default). A first turn's preparation took ~45-50 ms alone and 80-86 ms under
8 clients (`bench serve-load`'s record), about half of it with its CUDA stream idle.

The script builds ``--model`` (`raincheck_hf.bench.shapes`: random weights at the real shape, or a tiny one), asks
``--turns`` first turns one after the other, each a new `Conversation` on one `BatchLoop` with a picture of
``--image-size`` (the first ones capture the tower's and the selection's graphs), and for the last one counts the
synchronizing CUDA calls of its preparation (torch's sync debug mode, ``warn``: one warning per call that waits for
the device) by the Python line that made them, with the preparation's wall and CPU time. Its answer is one token
(the loop's own steps stay out of the count: the preparation runs on the asking thread before the loop gets it).
Each conversation then asks a text follow-up, and the last one's join on the loop's thread (`BatchLoop._join`: the
held cache loaded into the engine's pool, the turn's rows encoded) is counted the same way (``follow_up_join``).
The JSON carries the hardware.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package

from raincheck_hf import BatchLoop, Conversation, RaincheckConfig, batch_loop, enable  # noqa: E402
from raincheck_hf.bench import shapes  # noqa: E402
from raincheck_hf.bench.latency import write_script_result  # noqa: E402
from raincheck_hf.serve.cli import _image_sizes  # noqa: E402
from raincheck_hf.tiny import draw_test_image  # noqa: E402


def _size(text: str) -> tuple[int, int]:
    """``--image-size``: one ``WxH`` (`serve --warm-up-image-sizes`' parser), at least 32x32 pixels."""
    sizes = _image_sizes(text)
    if len(sizes) != 1 or min(sizes[0]) < 32:
        raise argparse.ArgumentTypeError(f"--image-size takes one WxH of at least 32x32 pixels, got {text!r}")
    return sizes[0]


def count_syncs(fn, thread: str | None = None):
    """``(fn's result, Counter of 'file:line' -> synchronizing calls)``: torch's sync debug mode in ``warn`` while
    ``fn`` runs (process-wide); ``thread``: only the calls made on the thread of that name (others may use the
    device meanwhile), else every thread's (run it while no other thread uses the device)."""
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.synchronize()
    where: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def show(message, category, filename, lineno, file=None, line=None):  # (on the thread that made the call)
        if "synchronizing CUDA operation" in str(message) and thread in (None, threading.current_thread().name):
            with lock:
                where[f"{os.path.relpath(filename)}:{lineno}"] += 1

    before = torch.cuda.get_sync_debug_mode() if on_cuda else None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if on_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode(before)
    return out, where


def run(model_name: str, image_size: tuple[int, int], turns: int, mode: str) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, info = shapes.build_model(model_name, device)
    model = enable(model)
    processor = shapes.build_processor() if shapes.MODELS[model_name].real_shape else None
    if processor is None:
        from raincheck_hf.tiny import build_tiny_processor

        processor = build_tiny_processor(max_pixels=image_size[0] * image_size[1])
    config = RaincheckConfig(mode=mode)
    record = {}
    real = batch_loop.BatchLoop.prepare_ahead

    def measured(self, job):
        started, cpu = time.perf_counter(), time.thread_time()
        _, where = count_syncs(lambda: real(self, job))
        record.update(wall_ms=1e3 * (time.perf_counter() - started), cpu_ms=1e3 * (time.thread_time() - cpu),
                      syncs=sum(where.values()), where=dict(where.most_common()))

    joined = {}
    real_join = batch_loop.BatchLoop._join

    def join_measured(self, job):
        if job.conversation.cache is None:  # (a first turn's join: not counted)
            return real_join(self, job)
        started, cpu = time.perf_counter(), time.thread_time()
        _, where = count_syncs(lambda: real_join(self, job))
        joined.update(wall_ms=1e3 * (time.perf_counter() - started), cpu_ms=1e3 * (time.thread_time() - cpu),
                      syncs=sum(where.values()), where=dict(where.most_common()))

    rows = []
    batch_loop.BatchLoop.prepare_ahead = measured
    batch_loop.BatchLoop._join = join_measured
    try:
        with BatchLoop(model, config=config) as loop:
            for i in range(turns):
                picture = draw_test_image(image_size[0], image_size[1], seed=i)
                with Conversation(model, processor, config, background=False, loop=loop) as conv:
                    conv.ask("What is in this image?", images=[picture], max_new_tokens=1)
                    row = dict(record, turn=i)
                    conv.ask("And what colour is it?", max_new_tokens=1)
                    row["follow_up_join"] = dict(joined)
                rows.append(row)
    finally:
        batch_loop.BatchLoop.prepare_ahead = real
        batch_loop.BatchLoop._join = real_join
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"model_info": info, "rows": rows, "device": str(device), "gpu": gpu}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_qwen3_vl", choices=sorted(shapes.MODELS))
    parser.add_argument("--image-size", type=_size, default=(1344, 1024), metavar="WxH")
    parser.add_argument("--turns", type=int, default=3, help="first turns in a row; the last one is reported")
    parser.add_argument("--mode", default="raincheck", choices=("raincheck", "full", "serial", "post_answer", "hard"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error(f"--turns must be at least 1, got {args.turns}")
    out = run(args.model, args.image_size, args.turns, args.mode)
    for row in out["rows"]:
        fj = row["follow_up_join"]
        print(f"turn {row['turn']}: preparation {row['wall_ms']:.1f} ms (its thread's CPU {row['cpu_ms']:.1f} ms), "
              f"{row['syncs']} synchronizing calls; its follow-up's join {fj.get('wall_ms', 0):.1f} ms (CPU "
              f"{fj.get('cpu_ms', 0):.1f} ms), {fj.get('syncs', 0)} synchronizing calls")
    for where, n in out["rows"][-1]["where"].items():
        print(f"  {n:4d}  {where}")
    print("the last follow-up's join:")
    for where, n in out["rows"][-1]["follow_up_join"].get("where", {}).items():
        print(f"  {n:4d}  {where}")
    what = "synchronizing CUDA calls of a first turn's preparation for the loop (a diagnosis)"
    return 0 if write_script_result("prepare_syncs.py", argv, args.json, rows=out["rows"], model_info=out["model_info"],
                                    device=out["device"], gpu=out["gpu"], what=what) else 1


if __name__ == "__main__":
    sys.exit(main())
