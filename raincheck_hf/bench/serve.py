"""The server's cost and its conversation cache, measured from a client, side by side in one process.

    python -m raincheck_hf.bench serve --model qwen3_vl_8b --answer-tokens 256 --follow-up-tokens 64 \\
        --reps 3 --json serve.json

One model (random weights at the real shape, `bench/shapes.py`), one image prompt, a three-turn
conversation (the image and a question, then two text follow-ups, ``--think-s`` seconds after each
answer, as a user reading it), run by five variants, each repetition in a rotated order:

- ``library raincheck`` / ``library full``: `raincheck_hf.Conversation` called in the process
  (a PIL image in, the processor included in the timing): the reference for the server's overhead.
- ``server raincheck`` / ``server full``: the same dialogue through ``/v1/chat/completions`` of the
  server (uvicorn on 127.0.0.1, streamed SSE, the image as a PNG data URL, every request the whole
  dialogue so far), which continues its held conversation: a follow-up prefills only its new turn.
- ``server full re-prefill``: the same server with ``reuse=False``: every request prefills the whole
  dialogue, the image included, and nothing is held, as a server without a conversation cache does
  (``transformers serve``); mode ``full``.

Every answer has exactly ``--answer-tokens`` tokens (follow-ups ``--follow-up-tokens``): greedy,
``min_tokens``, and OpenAI's ``logit_bias`` of +100 on the words whose decoded text re-tokenizes to
the same ids, so a client's resent history matches what the server generated (random weights would
otherwise produce ids the tiny tokenizer cannot round-trip, and no follow-up could reuse anything).
The library variants get the same bias.

Metrics per turn k (seconds in the JSON, ms in the table; medians over repetitions): ``ttft`` from
just before the request (or the library call) to the first token (the first SSE chunk with text, or
the library's streamer), ``tpot`` = (last token - first token) / (n - 1), ``e2e``, and from the
server's response ``cached_tokens``, ``prompt_tokens`` and its ``raincheck`` object (``t1_ms``: the
server's own arrival-to-first-token, ``restored_at_prefill``). Derived: the server's overhead
(``server raincheck`` - ``library raincheck``, T1 and TPOT) and T2 / T3 of re-prefill over reuse.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import gc
import io
import json
import random
import statistics
import sys
import time

import torch
from transformers.generation.streamers import BaseStreamer

from ..configuration import RaincheckConfig
from . import shapes
from .latency import _write, hardware_info
from .load_client import timings, user_turn

VARIANTS = ("library raincheck", "library full", "server raincheck", "server full", "server full re-prefill")
QUESTION = shapes.QUESTIONS["image"]


def round_trip_tokens(tokenizer, check_length: int = 300, seed: int = 0) -> list[int]:
    """Ids of whole words (``Ġword``) that decode and re-encode to themselves, alone and in any sequence."""
    vocab = tokenizer.get_vocab()
    candidates = sorted(i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2)
    keep = [i for i in candidates if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]]
    rng = random.Random(seed)
    sequence = [rng.choice(keep) for _ in range(check_length)] if keep else []
    if not keep or tokenizer.encode(tokenizer.decode(sequence), add_special_tokens=False) != sequence:
        raise ValueError("this tokenizer has no set of words whose text re-tokenizes to the same ids; the benchmark "
                         "needs one to resend the generated answers.")
    return keep


class _Clock(BaseStreamer):
    """When each generated token reaches the host (the first put is the prompt)."""

    def __init__(self):
        self.times, self._prompt_seen = [], False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self):
        pass


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both server benchmarks take: the Raincheck settings, ``--device`` and ``--threads``."""
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=31)
    parser.add_argument("--decode-guard", type=int, default=RaincheckConfig.decode_guard)
    parser.add_argument("--selector", default=None,
                        help="a registered selector name (default: the library's default, RaincheckConfig().selector)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)


def setting_values(args: argparse.Namespace) -> dict:
    """The values of `add_setting_arguments`'s options, as keyword arguments of both benchmarks' ``run``."""
    return dict(retention=args.retention, chunk_size=args.chunk_size, decode_guard=args.decode_guard,
                selector=args.selector, device=args.device, threads=args.threads)


def raincheck_settings(retention: float, chunk_size: int, decode_guard: int, selector: str | None,
                       modes) -> tuple[dict, dict]:
    """``(settings, {mode: RaincheckConfig})``: the settings every request sends (the library's default selector
    when ``selector`` is None, what a user gets by default) and one config a mode, built (so checked) before any
    compute."""
    from ..configuration import RaincheckConfig

    selector = selector if selector is not None else RaincheckConfig().selector
    settings = dict(retention=retention, chunk_size=chunk_size, decode_guard=decode_guard, selector=selector)
    return settings, {mode: RaincheckConfig(mode=mode, **settings) for mode in modes}


def claim_device(device, threads: int | None) -> tuple[torch.device, int]:
    """``(device, torch's thread count before)``: ``device`` (default: CUDA when there is one) and torch's threads
    set to ``threads`` (default: 1 on CPU, torch's own on CUDA); the caller puts the count back when done."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    previous_threads = torch.get_num_threads()
    if threads is not None or device.type == "cpu":
        torch.set_num_threads(threads or 1)
    return device, previous_threads


def _png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def library_conversation(model, processor, config, image, questions, lengths, bias, think_s) -> list[dict]:
    from .. import Conversation
    from ..serve.app import _LogitBias
    from transformers import LogitsProcessorList

    records = []
    with Conversation(model, processor, config, system=shapes.SYSTEM_PROMPT) as chat:
        for k, (question, n) in enumerate(zip(questions, lengths)):
            if k:
                time.sleep(think_s)
            clock = _Clock()
            start = time.perf_counter()
            result = chat.ask(question, images=[image] if k == 0 else [], max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, streamer=clock,
                              logits_processor=LogitsProcessorList([_LogitBias(dict.fromkeys(bias, 100.0))] if bias else []))
            end = time.perf_counter()
            records.append({**timings(start, clock.times, end), "completion_tokens": int(result.token_ids.numel()),
                            "text": result.text, "restored_during": result.restored_during_answer,
                            "restored_at_prefill": int(result.trace.restored_per_forward[0].numel())})
    return records


def server_conversation(client, base: str, raincheck: dict, image_url: str, questions, lengths, bias, think_s,
                        model_name: str) -> list[dict]:
    messages = [{"role": "system", "content": shapes.SYSTEM_PROMPT}]
    records = []
    for k, (question, n) in enumerate(zip(questions, lengths)):
        if k:
            time.sleep(think_s)
        messages.append(user_turn(question, image_url if k == 0 else None))
        body = {"model": model_name, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, "max_tokens": n, "min_tokens": n, "raincheck": raincheck,
                "logit_bias": {str(i): 100 for i in bias}}
        times, pieces, usage, rc = [], [], None, None
        start = time.perf_counter()
        with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the server answered {response.status_code}: {response.read().decode()[:500]}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the server failed: {event['error']}")
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        times.append(time.perf_counter())
                        pieces.append(choice["delta"]["content"])
                usage = event.get("usage") or usage
                rc = event.get("raincheck") or rc
        end = time.perf_counter()
        text = "".join(pieces)
        messages.append({"role": "assistant", "content": text})
        records.append({**timings(start, times, end), "completion_tokens": usage["completion_tokens"],
                        "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text,
                        "server_t1_s": rc["t1_ms"] / 1e3, "engine_t1_s": rc["engine_t1_ms"] / 1e3,
                        "engine_tpot_s": rc["tpot_ms"] / 1e3 if rc["tpot_ms"] is not None else None,
                        "restored_during": rc["restored_during"], "restored_at_prefill": rc["restored_at_prefill"],
                        "reused": rc["reused"]})
    return records


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(reps: list[list[dict]]) -> list[dict]:
    """Per turn, the median of every numeric field over repetitions."""
    out = []
    for k in range(len(reps[0])):
        turn = {}
        for key, value in reps[0][k].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) and value is not None:
                continue
            turn[key] = _median([rep[k][key] for rep in reps])
        out.append(turn)
    return out


def derive(variants: dict) -> dict:
    def get(name, k, key):
        turns = variants.get(name, {}).get("median")
        return turns[k].get(key) if turns and k < len(turns) else None

    def diff(a, b):
        return None if a is None or b is None else a - b

    def ratio(a, b):
        return None if a is None or not b else a / b

    derived = {
        "server_overhead_t1_s": diff(get("server raincheck", 0, "ttft_s"), get("library raincheck", 0, "ttft_s")),
        "server_overhead_tpot_s": diff(get("server raincheck", 0, "tpot_s"), get("library raincheck", 0, "tpot_s")),
        "server_overhead_t1_full_s": diff(get("server full", 0, "ttft_s"), get("library full", 0, "ttft_s")),
    }
    for k in (1, 2):
        reprefill = get("server full re-prefill", k, "ttft_s")
        derived[f"t{k + 1}_reprefill_over_server_raincheck"] = ratio(reprefill, get("server raincheck", k, "ttft_s"))
        derived[f"t{k + 1}_reprefill_over_server_full"] = ratio(reprefill, get("server full", k, "ttft_s"))
    return derived


def _ms(x):
    return "–" if x is None else f"{x * 1e3:.1f}"


def print_table(result: dict, log=print) -> None:
    log("| variant | T1 (ms) | TPOT1 (ms) | T2 (ms) | T3 (ms) | TPOT2 (ms) | cached T2 / T3 | server T1 (ms) |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, entry in result["variants"].items():
        m = entry.get("median")
        if not m:
            log(f"| {name} | {entry.get('status')} |")
            continue
        cached = " / ".join(str(int(t["cached_tokens"])) for t in m[1:]) if "cached_tokens" in m[0] else "–"
        log(f"| {name} | {_ms(m[0]['ttft_s'])} | {_ms(m[0]['tpot_s'])} | {_ms(m[1]['ttft_s'] if len(m) > 1 else None)} "
            f"| {_ms(m[2]['ttft_s'] if len(m) > 2 else None)} | {_ms(m[1]['tpot_s'] if len(m) > 1 else None)} "
            f"| {cached} | {_ms(m[0].get('server_t1_s'))} |")
    d = result["derived"]
    log(f"server overhead: T1 {_ms(d['server_overhead_t1_s'])} ms, TPOT {_ms(d['server_overhead_tpot_s'])} ms; "
        f"re-prefill / reuse (raincheck): T2 {d['t2_reprefill_over_server_raincheck'] or float('nan'):.2f}x, "
        f"T3 {d['t3_reprefill_over_server_raincheck'] or float('nan'):.2f}x")


def run(model_name: str = "tiny_qwen3_vl", answer_tokens: int = 8, follow_up_tokens: int = 4, reps: int = 1,
        think_s: float = 1.0, warmup: bool = True, retention: float = 0.3, chunk_size: int = 31,
        decode_guard: int = RaincheckConfig.decode_guard, selector: str | None = None, variants=VARIANTS,
        device=None, threads: int | None = None,
        json_path: str | None = None, command: str | None = None, log=print) -> dict:
    """Run the benchmark in-process; returns (and writes to ``json_path``) the result dict."""
    import httpx

    from ..integration import enable
    from ..serve import ServeSettings, create_app, running

    if answer_tokens < 2 or follow_up_tokens < 2 or reps < 1 or think_s < 0:
        raise ValueError(f"answer and follow-up tokens must be >= 2 (a TPOT needs two tokens), reps >= 1 and think_s "
                         f">= 0; got {answer_tokens}, {follow_up_tokens}, {reps}, {think_s}.")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}.")
    settings, configs = raincheck_settings(retention, chunk_size, decode_guard, selector, ("raincheck", "full"))
    if model_name not in shapes.MODELS:
        raise ValueError(f"unknown model {model_name!r}; choose from {sorted(shapes.MODELS)}.")
    device, previous_threads = claim_device(device, threads)
    started = time.perf_counter()
    try:
        model, model_info = shapes.build_model(model_name, device)
        enable(model)
        processor = shapes.build_processor()
        spec = shapes.MODELS[model_name]
        image = shapes.draw_test_image(*spec.image_size, seed=0)
        _, prompt_info = shapes.build_prompt(processor, spec, "image")
        bias = round_trip_tokens(processor.tokenizer)
        image_url = _png_data_url(image)
        questions = [QUESTION, *shapes.FOLLOW_UPS[:2]]
        lengths = [answer_tokens, follow_up_tokens, follow_up_tokens]
        result = {
            "benchmark": "serve",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command or " ".join(["python -m raincheck_hf.bench serve"] + sys.argv[2:]),
            "hardware": hardware_info(device),
            "settings": dict(settings, model=model_name, answer_tokens=answer_tokens, follow_up_tokens=follow_up_tokens,
                             reps=reps, think_s=think_s, warmup=warmup, variants=list(variants),
                             biased_words=len(bias), image_png_bytes=len(image_url) * 3 // 4),
            "model_info": model_info, "prompt": prompt_info, "variants": {v: {"reps": []} for v in variants},
        }
        name = "bench"
        reuse_app = create_app(model, processor, ServeSettings(model_name=name))
        fresh_app = create_app(model, processor, ServeSettings(model_name=name, reuse=False))
        with running(reuse_app) as reuse_url, running(fresh_app) as fresh_url, httpx.Client(timeout=600) as client:

            def one(variant: str) -> list[dict]:
                mode = "full" if "full" in variant else "raincheck"
                if variant.startswith("library"):
                    records = library_conversation(model, processor, configs[mode], image, questions, lengths, bias,
                                                   think_s)
                else:
                    base = fresh_url if variant.endswith("re-prefill") else reuse_url
                    records = server_conversation(client, base, {"mode": mode, **settings}, image_url, questions,
                                                  lengths, bias, think_s, name)
                    reuse_app.state.server.store.close()  # the next conversation starts from nothing held
                gc.collect()  # the conversation's cache (and its slot storage) goes back before the next one
                return records

            if warmup:
                for variant in variants:
                    one(variant)
                    log(f"[serve] warmed up {variant}")
            for rep in range(reps):
                order = list(variants[rep % len(variants):]) + list(variants[:rep % len(variants)])
                for variant in order:
                    records = one(variant)
                    result["variants"][variant]["reps"].append(records)
                    log(f"[serve] rep {rep + 1}/{reps} {variant}: T1 {_ms(records[0]['ttft_s'])} ms, "
                        f"T2 {_ms(records[1]['ttft_s'])} ms, T3 {_ms(records[2]['ttft_s'])} ms")
                    _write(result, json_path)
        for entry in result["variants"].values():
            entry["median"] = summarize(entry["reps"])
            entry["status"] = "ok"
        result["derived"] = derive(result["variants"])
        result["lengths_ok"] = all(t["completion_tokens"] == n for e in result["variants"].values()
                                   for rep in e["reps"] for t, n in zip(rep, lengths))
        result["elapsed_s"] = time.perf_counter() - started
        _write(result, json_path)
        print_table(result, log)
        return result
    finally:
        torch.set_num_threads(previous_threads)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf.bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_qwen3_vl", help=f"one of {sorted(shapes.MODELS)} (Qwen3-VL shapes)")
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--follow-up-tokens", type=int, default=None, help="default: --answer-tokens")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--think-s", type=float, default=1.0, help="seconds between an answer and the next question")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    add_setting_arguments(parser)
    parser.add_argument("--json", default=None, help="write the results here (rewritten after every conversation)")
    args = parser.parse_args(argv)
    try:
        return run(model_name=args.model, answer_tokens=args.answer_tokens,
                   follow_up_tokens=args.follow_up_tokens or args.answer_tokens, reps=args.reps, think_s=args.think_s,
                   warmup=not args.no_warmup, variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
                   json_path=args.json, log=lambda *a: print(*a, flush=True), **setting_values(args))
    except ValueError as error:
        print(f"[serve] {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
