"""Host time per answer token of the server's text handling: its streamer's ``put`` (`serve.app._Pieces`) and its
stop strings' check (`serve.app._StopStrings.raincheck_host_stop`, what the batching loop calls after every step),
decoding a window per token (`serve.detok.IncrementalDetokenizer`) against the rule before it, which decoded the
whole answer after every token (kept here as ``whole``).

    python benchmarks/detok_profile.py --lengths 128,512,2048 --json out.json

Per tokenizer and answer length L: one answer of L tokens fed a token at a time to a fresh streamer and stop-string
check (two stop strings that never occur, so every token is checked), microseconds per token over the answer (the
mean, so a long answer's late, costlier tokens count), the best of ``--reps`` rounds. Tokenizers: ``bpe``, the tiny
models' byte-level BPE (`raincheck_hf.tiny`; English text with CJK characters and emoji, several tokens each) and
``glyph``, the bundled glyph models' word-level one (random words of its vocabulary). The JSON carries the hardware.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package

from raincheck_hf.bench.latency import write_script_result  # noqa: E402
from raincheck_hf.serve.app import _Pieces, _StopStrings  # noqa: E402

STOP = ["</answer>", "\n\nUser:"]
_TEXT = ("The glyph in the top left corner is red, and the one below it is blue. 左上角的符号是红色的 🙂. "
         "A ball rolls across the table; then a cat 🐈 jumps onto the chair (quickly!). 日本語も少し. ")


class WholePieces:
    """The streamer before: the whole answer decoded after every token."""

    def __init__(self, tokenizer, emit):
        self.tokenizer, self.emit, self.ids, self.sent, self.prompt_seen = tokenizer, emit, [], 0, False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > self.sent:
            self.emit(("text", text[self.sent:]))
            self.sent = len(text)


class WholeStopStrings:
    """The stop strings' check before: searched in the whole answer decoded after every token."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop, self.stopped = tokenizer, stop, False

    def raincheck_host_stop(self, answer):
        if not self.stopped:
            text = self.tokenizer.decode(answer, skip_special_tokens=True)
            self.stopped = any(s in text for s in self.stop)
        return self.stopped


def answers(length: int) -> dict:
    """``{name: (tokenizer, ids)}``: an answer of ``length`` tokens per tokenizer."""
    from raincheck_hf.quality.bundled import bundled_path, load_word_tokenizer
    from raincheck_hf.tiny import build_tiny_tokenizer

    bpe = build_tiny_tokenizer()
    ids: list[int] = []
    while len(ids) < length:
        ids += bpe.encode(_TEXT, add_special_tokens=False)
    glyph = load_word_tokenizer(bundled_path("qwen3_vl"))
    words = [i for i in range(len(glyph)) if i not in set(glyph.all_special_ids) and i >= 8]
    rng = random.Random(0)
    return {"bpe": (bpe, ids[:length]), "glyph": (glyph, [rng.choice(words) for _ in range(length)])}


def per_token_us(tokenizer, ids: list[int], variant: str) -> float:
    """Microseconds per token of the streamer's put and the stop strings' check, over one answer."""
    sink = []
    if variant == "whole":
        pieces, stop = WholePieces(tokenizer, sink.append), WholeStopStrings(tokenizer, STOP)
    else:
        pieces, stop = _Pieces(tokenizer, sink.append), _StopStrings(tokenizer, 0, STOP)
    pieces.put(torch.tensor([[1, 2, 3]]))  # the prompt
    tokens = [torch.tensor([t]) for t in ids]
    answer: list[int] = []
    start = time.perf_counter()
    for token, value in zip(tokens, ids):
        answer.append(value)
        pieces.put(token)
        if stop.raincheck_host_stop(answer):
            raise RuntimeError("a stop string was found: the answer would end early")
    elapsed = time.perf_counter() - start
    if "".join(piece for _, piece in sink) != tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd"):
        raise RuntimeError(f"{variant}: the streamed text is not the answer's text")
    return elapsed / len(ids) * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,512,2048", help="answer lengths in tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="rounds per case; the best is kept")
    parser.add_argument("--json", default=None, help="write the rows and the hardware here")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths must be positive token counts, got {args.lengths!r}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    cases = answers(max(lengths))
    rows = []
    print(f"{'tokenizer':>9} {'tokens':>6} {'whole us/token':>15} {'window us/token':>16} {'speed-up':>9}")
    for name, (tokenizer, ids) in cases.items():
        for length in lengths:
            row = {"tokenizer": name, "tokens": length}
            for variant in ("whole", "window"):
                per_token_us(tokenizer, ids[:length], variant)  # warm-up
                row[f"{variant}_us_per_token"] = min(per_token_us(tokenizer, ids[:length], variant)
                                                     for _ in range(args.reps))
            rows.append(row)
            print(f"{name:>9} {length:>6} {row['whole_us_per_token']:>15.1f} {row['window_us_per_token']:>16.1f} "
                  f"{row['whole_us_per_token'] / row['window_us_per_token']:>8.1f}x", flush=True)
    return write_script_result("detok_profile.py", argv, args.json, rows=rows,
                               what="host microseconds per answer token of the server's streamer put + stop-string "
                                    "check, whole decode per token against a window per token (CPU)")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
