"""Command line: ``python -m raincheck_hf chat [--model PATH_OR_ID] [--image FILE ...] [--video FILE ...]``.

Without ``--model`` it runs offline on a tiny Qwen3-VL built in code with random weights (its
answers are meaningless; it shows the mechanics: selection, time to first token, restoration).
"""

from __future__ import annotations

import argparse
import sys
import time


def _load(model_id: str | None, device: str):
    if model_id is None:
        from .tiny import build_tiny_processor, build_tiny_qwen3_vl

        print("[raincheck] no --model given: a tiny Qwen3-VL built in code with RANDOM weights "
              "(answers are gibberish; the timings and restoration are real).", file=sys.stderr)
        return build_tiny_qwen3_vl(seed=0), build_tiny_processor()
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_id)
        model = AutoModelForImageTextToText.from_pretrained(
            model_id, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32, attn_implementation="sdpa"
        ).to(device)
    except OSError as error:
        raise SystemExit(f"[raincheck] could not load {model_id!r}: {error}\n"
                         "Pass a local directory (these machines cannot download from the Hub) or omit --model.")
    return model.eval(), processor


def _open_image(path):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise SystemExit(f"[raincheck] --image {path!r} is not a readable image: {error}")


def _print_turn(result, conversation):
    tpot = result.time_per_output_token * 1e3
    print(f"\n  [ttft {result.time_to_first_token * 1e3:.1f} ms | tpot {tpot:.1f} ms | "
          f"{len(result.trace.selected)} visual tokens first, {len(result.trace.deferred)} deferred | "
          f"restored during answer {result.restored_during_answer}, pending {result.pending}]")


def chat(args) -> int:
    import torch

    from . import Conversation, RaincheckConfig
    from .tiny import draw_test_image

    # settings are validated before anything is loaded
    config = RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, decode_guard=args.decode_guard,
                             selector=args.selector, mode=args.mode)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, processor = _load(args.model, device)
    images = [_open_image(p) for p in args.image]
    if not images and not args.video and args.model is None:
        images = [draw_test_image(256, 192, seed=0)]
        print("[raincheck] no --image given: using a generated 256x192 test image.", file=sys.stderr)
    videos = list(args.video)
    questions = list(args.question)
    interactive = not questions
    with Conversation(model, processor, config, max_new_tokens=args.max_new_tokens) as conversation:
        turn = 0
        while True:
            if interactive:
                try:
                    text = input("\nyou> ").strip()
                except EOFError:
                    break
                if text in ("/quit", "/exit"):
                    break
                if text.startswith("/image "):
                    images.append(_open_image(text.split(" ", 1)[1].strip()))
                    print(f"[raincheck] image attached to the next question ({len(images)} pending)")
                    continue
                if not text:
                    continue
            else:
                if turn >= len(questions):
                    break
                text = questions[turn]
                print(f"\nyou> {text}")
            print("assistant> ", end="", flush=True)
            streamed = conversation.ask(text, images=images, videos=videos,
                                        stream=True)
            for piece in streamed:
                print(piece, end="", flush=True)
            result = streamed.result
            _print_turn(result, conversation)
            images, videos = [], []
            turn += 1
            if conversation.pending:
                start = time.perf_counter()
                while conversation.pending and time.perf_counter() - start < args.idle_wait:
                    time.sleep(0.01)
                print(f"  [idle-time restoration: {result.restored_after_answer} restored after the answer, "
                      f"{conversation.pending} still pending]")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("chat", help="multi-turn chat with Raincheck")
    c.add_argument("--model", default=None, help="local path or Hub id (default: tiny offline model)")
    c.add_argument("--image", action="append", default=[], help="image file for the first question (repeatable)")
    c.add_argument("--video", action="append", default=[], help="video file for the first question (repeatable)")
    c.add_argument("--question", action="append", default=[],
                   help="ask these questions in order instead of reading from stdin (repeatable)")
    c.add_argument("--mode", default="raincheck", help="full | hard | post_answer | raincheck | serial")
    c.add_argument("--selector", default="mmtok")
    c.add_argument("--retention", type=float, default=0.3)
    c.add_argument("--chunk-size", type=int, default=31)
    c.add_argument("--decode-guard", type=int, default=16)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--idle-wait", type=float, default=5.0, help="seconds to let restoration run between turns")
    c.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    try:
        return chat(args)
    except ValueError as error:  # bad settings: say what and stop, no traceback
        print(f"[raincheck] {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
