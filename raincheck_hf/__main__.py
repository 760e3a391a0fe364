"""Command line: ``python -m raincheck_hf chat [--model NAME_OR_PATH] [--image FILE ...] [--video FILE ...]``.

Without ``--model`` it runs offline on the bundled glyph Qwen3-VL (``raincheck_hf/checkpoints/glyph-qwen3-vl``:
a 3.3 M-parameter `Qwen3VLForConditionalGeneration` trained on the project's glyph-grid benchmark).
Without ``--image`` and ``--question`` as well, it replays a dialogue of the benchmark's dev split
on that dialogue's glyph grid (the first two questions: a list question and a follow-up, or a
fact and a follow-up) and prints, per turn, the answer, the reference answer and Raincheck's
figures: visual tokens prefilled first (selected) and deferred, restored during and after the
answer, time to first token.

Models (``--model``):
  qwen3_vl   the bundled glyph Qwen3-VL (default)
  qwen3_5    the bundled glyph Qwen3.5 (Gated DeltaNet + attention)
  tiny       a tiny Qwen3-VL built in code with RANDOM weights (gibberish; the mechanics are real)
  PATH / ID  a real Qwen3-VL or Qwen3.5 checkpoint (a local folder; these machines cannot download)

The bundled models know only the glyph task: n x n grids of 32 px cells, each a glyph g0..g11 in
one of 10 colours over a grey background (dark, dim, pale, light), and a word-level vocabulary of
a few dozen words (any other word reads as <unk>). Ask them, e.g.:
  what is the background of the red g3 ?
  list the backgrounds of the red and blue glyphs .

Interactive (``--interactive``, or an --image / --model checkpoint without --question): type a
question; ``/image PATH`` attaches an image to the next question, ``/grid N`` attaches the grid of
dev dialogue N (and shows its questions), ``/quit`` ends.
"""

from __future__ import annotations

import argparse
import sys
import time

from .quality.references import glyph_reference, judge, missing_from_grid, read_glyph_grid, words_of

# names of the bundled models (raincheck_hf.quality.BUNDLED) and of the random tiny model
BUNDLED_ALIASES = {"qwen3_vl": "qwen3_vl", "qwen3-vl": "qwen3_vl", "glyph-qwen3-vl": "qwen3_vl",
                   "qwen3_5": "qwen3_5", "qwen3.5": "qwen3_5", "qwen3-5": "qwen3_5", "glyph-qwen3_5": "qwen3_5"}
TINY_ALIASES = ("tiny", "tiny-random")
DEFAULT_MODEL = "qwen3_vl"
BUNDLED_TITLES = {"qwen3_vl": "glyph Qwen3-VL", "qwen3_5": "glyph Qwen3.5"}


def resolve_model(name: str | None) -> tuple[str, str]:
    """``(kind, name)``: ``("bundled", "qwen3_vl" | "qwen3_5")``, ``("tiny", "tiny")`` or ``("checkpoint", path_or_id)``.

    A bundled name wins over a local folder of the same name; write ``./qwen3_vl`` for the folder.
    """
    key = (name or DEFAULT_MODEL).strip()
    if key.lower() in BUNDLED_ALIASES:
        return "bundled", BUNDLED_ALIASES[key.lower()]
    if key.lower() in TINY_ALIASES:
        return "tiny", "tiny"
    return "checkpoint", key


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def bundled_description(name: str, model) -> str:
    from .quality import BUNDLED

    return (f"the bundled {BUNDLED_TITLES[name]} ({type(model).__name__}, {count_parameters(model) / 1e6:.2f} M "
            f"parameters, trained on the glyph-grid benchmark; it knows only that task's words; "
            f"card: raincheck_hf/checkpoints/{BUNDLED[name]}/README.md)")


def _load(model_id: str | None, device: str):
    """``(model, processor, kind, name)``."""
    kind, name = resolve_model(model_id)
    if kind == "tiny":
        from .tiny import build_tiny_processor, build_tiny_qwen3_vl

        print("[raincheck] --model tiny: a tiny Qwen3-VL built in code with RANDOM weights "
              "(answers are gibberish; the timings and restoration are real).", file=sys.stderr)
        return build_tiny_qwen3_vl(seed=0), build_tiny_processor(), kind, name
    if kind == "bundled":
        from .quality import load_bundled

        try:
            model, processor = load_bundled(name, device=device)
        except FileNotFoundError as error:
            raise SystemExit(f"[raincheck] {error}")
        print(f"[raincheck] model: {bundled_description(name, model)}.", file=sys.stderr)
        return model, processor, kind, name
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(name)
        model = AutoModelForImageTextToText.from_pretrained(
            name, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32, attn_implementation="sdpa"
        ).to(device)
    except OSError as error:
        raise SystemExit(f"[raincheck] could not load {name!r}: {error}\n"
                         "Pass a local directory (these machines cannot download from the Hub), or a bundled "
                         f"model ({', '.join(BUNDLED_TITLES)}), or omit --model.")
    return model.eval(), processor, kind, name


class _QuietFallbacks:
    """Drops transformers' "falling back to its reference PyTorch implementation" warnings, which
    would land in the middle of a streamed answer; `_note_fallbacks` says it once instead."""

    def filter(self, record) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


def _note_fallbacks(model) -> None:
    import importlib.util
    import logging

    if getattr(model.config, "model_type", None) != "qwen3_5":
        return
    logging.getLogger("transformers.integrations.hub_kernels").addFilter(_QuietFallbacks())
    missing = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"[raincheck] Qwen3.5's Gated DeltaNet layers run on transformers' PyTorch fallbacks ("
              f"{' and '.join(missing)} not installed): correct, slower.", file=sys.stderr)


def _open_image(path):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise SystemExit(f"[raincheck] --image {path!r} is not a readable image: {error}")


def unknown_words(tokenizer, text: str) -> list[str]:
    """The words of ``text`` a word-level tokenizer reads as ``<unk>`` (none for a subword tokenizer)."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    return list(dict.fromkeys(w for w in words_of(text) if tokenizer.convert_tokens_to_ids(w) == unk))


# ---- the chat -------------------------------------------------------------------------------------

def _print_turn(result):
    tpot = result.time_per_output_token * 1e3
    trace = result.trace
    selected, deferred, dropped = len(trace.selected), len(trace.deferred), len(trace.dropped)
    if selected + deferred == 0:
        visual = "no new visual tokens"
    else:
        visual = f"visual tokens {selected + deferred}: {selected} selected (prefilled first), {deferred} deferred"
    if dropped:
        restoration = f"{dropped} dropped (mode hard)"
    else:
        restoration = (f"restored during the answer {result.restored_during_answer}, "
                       f"after it {result.restored_after_answer}, pending {result.pending}")
    print(f"  [ttft {result.time_to_first_token * 1e3:.1f} ms | tpot {tpot:.1f} ms | {visual} | {restoration}]")


def _dev_dialogue(index: int):
    from .quality.glyphs import SPLITS, benchmark_split

    size = SPLITS["dev"][1]
    if not 0 <= index < size:
        raise ValueError(f"--dialogue must be in [0, {size - 1}] (the dev split's dialogues), got {index}")
    return benchmark_split("dev", limit=index + 1)[index]


def chat(args) -> int:
    import torch

    from . import Conversation, RaincheckConfig
    from .tiny import draw_test_image

    # settings are validated before anything is loaded
    config = RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, decode_guard=args.decode_guard,
                             selector=args.selector, mode=args.mode)
    if args.turns < 0:
        raise ValueError(f"--turns must be >= 0 (0: all of the dialogue's questions), got {args.turns}")
    dialogue = _dev_dialogue(args.dialogue)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, processor, kind, _ = _load(args.model, device)
    bundled = kind == "bundled"
    _note_fallbacks(model)
    images = [_open_image(p) for p in args.image]
    videos = list(args.video)
    questions = list(args.question)
    cells = read_glyph_grid(images[0]) if len(images) == 1 else None  # references for the user's own grid
    scripted = False  # replaying the dev dialogue's own questions
    if not images and not videos and kind != "checkpoint":
        if bundled or args.glyphs:
            images, cells = [dialogue.image()], dialogue.cells
            what = f"the {dialogue.grid}x{dialogue.grid} glyph grid of dev dialogue {dialogue.uid}"
            if not questions:
                asked = dialogue.turns[:args.turns or None]
                questions = [t.question for t in asked]
                scripted = True
                what += (f" and its first {len(asked)} of {len(dialogue.turns)} questions "
                         "(--dialogue N and --turns N pick others)")
            print(f"[raincheck] no --image given: using {what}.", file=sys.stderr)
        else:
            images = [draw_test_image(256, 192, seed=0)]
            print("[raincheck] no --image given: using a generated 256x192 test image.", file=sys.stderr)
    if args.save_image and images:
        images[0].save(args.save_image)
        print(f"[raincheck] the first image is saved to {args.save_image}", file=sys.stderr)
    interactive = args.interactive or not questions
    with Conversation(model, processor, config, max_new_tokens=args.max_new_tokens) as conversation:
        turn = 0
        while True:
            if turn < len(questions):
                text = questions[turn]
                print(f"\nyou> {text}")
            elif interactive:
                try:
                    text = input("\nyou> ").strip()
                except EOFError:
                    break
                if text in ("/quit", "/exit"):
                    break
                if text.startswith("/image "):
                    image = _open_image(text.split(" ", 1)[1].strip())
                    images.append(image)
                    cells = read_glyph_grid(image) if len(images) == 1 else None
                    print(f"[raincheck] image attached to the next question ({len(images)} pending)")
                    continue
                if text.startswith("/grid"):
                    try:
                        grid = _dev_dialogue(int(text.split()[1]) if len(text.split()) > 1 else 0)
                    except ValueError as error:
                        print(f"[raincheck] /grid N: {error}")
                        continue
                    images, cells = [grid.image()], grid.cells
                    print(f"[raincheck] the grid of {grid.uid} is attached to the next question; its questions:\n  "
                          + "\n  ".join(t.question for t in grid.turns))
                    continue
                if not text:
                    continue
            else:
                break
            turn += 1
            asked = text
            if bundled:  # the word-level vocabulary is lowercase
                asked = text.lower()
                unknown = unknown_words(processor.tokenizer, asked)
                if unknown:
                    print(f"[raincheck] the bundled model does not know {', '.join(map(repr, unknown))} "
                          "(read as <unk>); it knows only the glyph task's words, e.g. "
                          "'what is the background of the red g3 ?'")
            print("assistant> ", end="", flush=True)
            streamed = conversation.ask(asked, images=images, videos=videos, stream=True)
            for piece in streamed:
                print(piece, end="", flush=True)
            result = streamed.result
            print()
            reference = glyph_reference(cells, asked)
            if reference is not None:
                print(f"reference> {reference.answer}   [{judge(reference, result.text)}]")
            elif missing_from_grid(cells, asked):
                print(f"reference> none: {missing_from_grid(cells, asked)}")
            _print_turn(result)
            images, videos = [], []
            if conversation.pending:
                start = time.perf_counter()
                # the turn's own count is updated just after the cache's (a consistent read: wait for both)
                while (conversation.pending or result.pending) and time.perf_counter() - start < args.idle_wait:
                    time.sleep(0.01)
                print(f"  [idle-time restoration: {result.restored_after_answer} restored after the answer, "
                      f"{conversation.pending} still pending]")
    if scripted and config.mode != "hard":
        print("\n[raincheck] compare with pruning: add --mode hard (the deferred tokens are dropped, and the "
              "follow-ups ask about cells the first question's selection had no reason to keep).", file=sys.stderr)
    if kind == "tiny":
        print("\n[raincheck] (random weights: the words are gibberish, the figures are real.)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("chat", help="multi-turn chat with Raincheck", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", default=None,
                   help="qwen3_vl (default) | qwen3_5 (the bundled glyph models) | tiny (random weights) | "
                        "a local checkpoint folder or Hub id")
    c.add_argument("--image", action="append", default=[], help="image file for the first question (repeatable)")
    c.add_argument("--video", action="append", default=[], help="video file for the first question (repeatable)")
    c.add_argument("--question", action="append", default=[],
                   help="ask these questions in order instead of reading from stdin (repeatable)")
    c.add_argument("--interactive", action="store_true",
                   help="after the given (or default) questions, keep reading questions from stdin")
    c.add_argument("--dialogue", type=int, default=0,
                   help="without --image: the dev-split dialogue whose grid (and questions) to use (default 0)")
    c.add_argument("--turns", type=int, default=2,
                   help="without --image and --question: how many of its questions to ask (0: all; default 2)")
    c.add_argument("--glyphs", action="store_true", help="with --model tiny: use the glyph grid as the default image")
    c.add_argument("--save-image", default=None, metavar="FILE", help="save the first image (e.g. the default grid)")
    c.add_argument("--mode", default="raincheck", help="full | hard | post_answer | raincheck | serial")
    c.add_argument("--selector", default="mmtok")
    c.add_argument("--retention", type=float, default=0.3)
    c.add_argument("--chunk-size", type=int, default=31)
    c.add_argument("--decode-guard", type=int, default=16)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--idle-wait", type=float, default=5.0, help="seconds to let restoration run between turns")
    c.add_argument("--device", default=None)
    from .serve.cli import DESCRIPTION as SERVE_DESCRIPTION, add_arguments as add_serve_arguments

    s = sub.add_parser("serve", help="OpenAI-compatible server that keeps each conversation's cache",
                       description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(s)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from .serve.cli import serve

            return serve(args)
        return chat(args)
    except ValueError as error:  # bad settings: say what and stop, no traceback
        print(f"[raincheck] {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
