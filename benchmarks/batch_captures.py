"""How many batched decode steps a server-like load captures in the middle of its answers, and how often the KV pool
grows (each growth drops every captured step), with and without `raincheck_hf.warm_up(batch=N)`.

    python benchmarks/batch_captures.py --clients 1,8,32 --json out.json

A CUDA-graph capture of a batched decode step costs 0.1-0.5 s on an 8B/9B model (more when its first shape at a
batch compiles), and it happens inside the answers of every conversation in the batch. Which steps are captured is
decided on the host from the batch's shape alone (`fast.batched_graphs.BatchStepKey`: batch bucket, width, slot
span, ...), so the count is the same on any device: this tool counts them on the CPU with the tiny Qwen3-VL model
(``--model qwen3_5``: the tiny Qwen3.5, Gated DeltaNet layers) (``fast_path=True``: the static-buffer steps, run
eagerly here, each new key recorded as a capture would be).

The load mirrors ``bench serve-load``'s: ``N`` conversations on one `BatchLoop` (as ``serve --batching`` runs
them), all starting together, each a three-turn dialogue: a photo-sized image (``--image``, 1,344 visual tokens
by default) with a question and a ``--answer-tokens`` answer, then two text follow-ups of ``--follow-up-tokens``
(answers forced to their length). Variants: ``cold`` (a fresh process's first load: no kept pool), ``after_one``
(after one client's dialogue, as ``bench serve-load`` warms a mode up before its timed rounds: what its timed rounds
met) and ``warmed`` (the kept pool captured ahead for ``N`` sequences of ``--max-tokens`` rows, as ``serve
--batching`` does at start).
Per (N, variant): captures during the dialogues, pool reallocations, steps, the keys' batch buckets and widths, how
many of the captured keys gather their slots (decode steps beside sequences the warm-up's dense keys do not cover)
and how many are a prompt piece alone (``prefill`` keys, which gather their one slot by design).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package

from raincheck_hf import BatchLoop, Conversation, RaincheckConfig  # noqa: E402
from raincheck_hf.bench.latency import write_script_result  # noqa: E402
from raincheck_hf.fast import batched_graphs  # noqa: E402
from raincheck_hf.models import get_adapter  # noqa: E402
from raincheck_hf.tiny import (build_tiny_processor, build_tiny_qwen3_5, build_tiny_qwen3_vl,  # noqa: E402
                               draw_test_image)

MODELS = {"qwen3_vl": build_tiny_qwen3_vl, "qwen3_5": build_tiny_qwen3_5}

FOLLOW_UPS = ("And the colours?", "Anything else?")


def _watch(loop: BatchLoop, baseline: dict) -> dict:
    """The loop's engines' graphs seen so far, each with what it held before the load: a kept pool warmed ahead, its
    captures and pool version after the warm-up (``baseline``); a pool the load made, nothing."""
    seen = {}
    for engine in loop._engines:
        graphs = engine.graphs
        if graphs is not None:
            seen[id(graphs)] = (graphs, *baseline.get(id(graphs), (0, 0)))
    return seen


def dialogues(model, processor, config, clients: int, image, answer_tokens: int, follow_up_tokens: int,
              baseline: dict) -> dict:
    """``clients`` three-turn dialogues at once on one loop; the batched captures and pool growths they caused."""
    eos = model.config.text_config.vocab_size - 1
    firsts = {}
    with torch.no_grad(), BatchLoop(model, max_batch_tokens=2048, config=config) as loop:
        convs = [Conversation(model, processor, config, background=False, loop=loop) for _ in range(clients)]
        stop = threading.Event()

        def watch():  # the engines come and go with the load: note each pool's state when first seen
            while not stop.is_set():
                for key, entry in loop.call(lambda: _watch(loop, baseline)).items():
                    firsts.setdefault(key, entry)
                stop.wait(0.01)

        def talk(conv):
            for text, n, images in ((QUESTION, answer_tokens, [image]), (FOLLOW_UPS[0], follow_up_tokens, ()),
                                    (FOLLOW_UPS[1], follow_up_tokens, ())):
                conv.ask(text, images=images, max_new_tokens=n, min_new_tokens=n, eos_token_id=eos)

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=talk, args=(c,)) for c in convs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        steps = loop.steps
        for c in convs:
            c.close()
    captured, grown, keys = 0, 0, []
    for graphs, log_at, version_at in firsts.values():
        captured += len(graphs.capture_log) - log_at
        grown += graphs.pool.version - version_at
        keys += graphs.capture_log[log_at:]
    return {"captures": captured, "pool_reallocations": grown, "steps": steps,
            "capture_batches": sorted({k.batch for k in keys}), "capture_widths": sorted({k.width for k in keys}),
            "gathered_captures": sum(not k.dense and not k.prefill for k in keys),
            "prefill_captures": sum(k.prefill for k in keys)}


QUESTION = "Describe the image."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_vl", choices=sorted(MODELS), help="the tiny model's family")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--mode", default="raincheck")
    parser.add_argument("--image", default="1344x1024", help="WIDTHxHEIGHT of each client's image")
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--follow-up-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4096, help="the warm-up's rows per sequence")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    width, height = (int(v) for v in args.image.lower().split("x"))
    model = MODELS[args.model](seed=0)
    processor = build_tiny_processor(max_pixels=width * height)  # (the image's own grid, not a smaller one)
    import raincheck_hf

    raincheck_hf.enable(model)
    config = RaincheckConfig(mode=args.mode, fast_path=True)
    adapter = get_adapter(model)
    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        for variant in ("cold", "after_one", "warmed"):
            batched_graphs.release_all()
            warmed, baseline = 0, {}
            if variant == "after_one":  # the one-client round first; the kept pool it leaves is the baseline
                dialogues(model, processor, config, 1, draw_test_image(width, height, seed=0), args.answer_tokens,
                          args.follow_up_tokens, {})
                for graphs in batched_graphs._POOLED.get(adapter.text_model, []):
                    baseline[id(graphs)] = (len(graphs.capture_log), graphs.pool.version)
            if variant == "warmed":  # what `warm_up(batch=clients)` does on CUDA (`warmup._warm_batched`)
                graphs = batched_graphs.acquire(adapter, adapter.text_model.config.num_hidden_layers, clients,
                                                args.max_tokens)
                warmed = graphs.warm(config, clients)
                baseline[id(graphs)] = (len(graphs.capture_log), graphs.pool.version)
                batched_graphs.release(graphs)
            image = draw_test_image(width, height, seed=clients)
            row = {"clients": clients, "variant": variant, "warmed_keys": warmed,
                   **dialogues(model, processor, config, clients, image, args.answer_tokens, args.follow_up_tokens,
                             baseline)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    batched_graphs.release_all()
    write_script_result("batch_captures.py", argv, args.json, benchmark="batch-captures", settings=vars(args),
                        rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
