"""Host time a follow-up costs the continuous-batching loop's thread when it joins (`BatchLoop._join`), with its HF
preparation done on the asking thread (`BatchLoop.prepare_ahead`, ``ahead``) or on the loop's thread (``at_join``,
as before follow-ups were prepared ahead), side by side in one process: a CPU diagnosis tool.

    python benchmarks/join_profile.py --layers 36 --dialogues 6 --json out.json

A follow-up's join runs on the loop's thread between steps: while it runs, no running answer gets its next step. Its
parts: HF's preparation (`BatchLoop._prepare`: ``generate``'s own setup of processors, criteria and generation
config, and `integration.validate_request`), which ``ahead`` moves to the thread that asked, and its sequence
(`BatchEngine.add` from the held cache: the slot filled with the cache's rows, the plan), which stays at the join.
The model: the tiny Qwen3-VL (`raincheck_hf.tiny`) with ``--layers`` text layers (the real 8B model has 36), fp32,
one torch thread, ``fast_path=True`` (the captured steps' static-buffer form, run eagerly on a CPU); each dialogue
an image turn then a text follow-up on one `BatchLoop`, 8-token answers. Per variant: each follow-up's join time
and its median, and the median time of the preparation on the asking thread. CPU timings of a tiny model: they say
what the loop's thread is spared, not what a GPU host spends. The JSON carries the hardware.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package

from raincheck_hf import BatchLoop, Conversation, RaincheckConfig  # noqa: E402
from raincheck_hf.bench.latency import write_script_result  # noqa: E402
from raincheck_hf.tiny import build_tiny_processor, build_tiny_qwen3_vl, draw_test_image  # noqa: E402

VARIANTS = ("ahead", "at_join")


class FollowUpClock:
    """Times each follow-up's `BatchLoop._join` (a turn whose conversation holds a cache) and its preparation ahead."""

    def __init__(self, loop: BatchLoop, prepare_follow_ups_ahead: bool):
        self.joins, self.ahead = [], []
        join, ahead = loop._join, loop.prepare_ahead

        def timed_join(job):
            follow_up = job.conversation.cache is not None
            began = time.perf_counter()
            try:
                return join(job)
            finally:
                if follow_up:
                    self.joins.append(time.perf_counter() - began)

        def timed_ahead(job):
            if job.conversation.cache is not None and not prepare_follow_ups_ahead:
                return  # (the former rule: a follow-up is prepared when it joins)
            began = time.perf_counter()
            try:
                return ahead(job)
            finally:
                if job.conversation.cache is not None:
                    self.ahead.append(time.perf_counter() - began)

        loop._join, loop.prepare_ahead = timed_join, timed_ahead


def run_variant(model, processor, variant: str, dialogues: int) -> dict:
    config = RaincheckConfig(fast_path=True)
    with BatchLoop(model, config=config) as loop:
        clock = FollowUpClock(loop, variant == "ahead")
        for k in range(dialogues + 1):  # (the first dialogue warms the loop up: not counted)
            with Conversation(model, processor, config, loop=loop, background=False) as chat:
                chat.ask("What is in this image?", images=[draw_test_image(128, 96, seed=k)], max_new_tokens=8)
                chat.ask("And the corner?", max_new_tokens=8)
            if k == 0:
                clock.joins.clear()
                clock.ahead.clear()
    return {"variant": variant, "follow_ups": len(clock.joins),
            "join_ms": [round(1e3 * t, 3) for t in clock.joins],
            "join_ms_median": 1e3 * statistics.median(clock.joins),
            "ahead_ms_median": 1e3 * statistics.median(clock.ahead) if clock.ahead else 0.0}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=36, help="text layers of the tiny model")
    parser.add_argument("--dialogues", type=int, default=6, help="timed dialogues per variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_tiny_qwen3_vl(num_hidden_layers=args.layers)
    processor = build_tiny_processor()
    rows = []
    for variant in VARIANTS:
        row = run_variant(model, processor, variant, args.dialogues)
        rows.append(row)
        print(f"[join] {variant}: follow-up join {row['join_ms_median']:.2f} ms median on the loop's thread, "
              f"preparation ahead {row['ahead_ms_median']:.2f} ms on the asking thread", flush=True)
    return write_script_result("join_profile.py", argv, args.json, benchmark="join_profile",
                               what="a follow-up's join on the batching loop's thread", layers=args.layers,
                               dialogues=args.dialogues, rows=rows)


if __name__ == "__main__":
    main()
