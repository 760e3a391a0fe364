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
  PATH / ID  a real checkpoint of a supported family (Qwen3-VL, Qwen3.5, their MoE variants,
             Qwen2.5-VL): a local folder (config.json, *.safetensors and the processor's files, as
             `save_pretrained` writes them) or a Hub id, which is downloaded when the Hub can be
             reached and fails within seconds when it cannot (README.md, "A real checkpoint")

The bundled models know only the glyph task: n x n grids of 32 px cells, each a glyph g0..g11 in
one of 10 colours over a grey background (dark, dim, pale, light), and a word-level vocabulary of
a few dozen words (any other word reads as <unk>). Ask them, e.g.:
  what is the background of the red g3 ?
  list the backgrounds of the red and blue glyphs .

Interactive (``--interactive``, or an --image / --model checkpoint without --question): type a
question; ``/image PATH`` attaches an image to the next question, ``/grid N`` attaches the grid of
dev dialogue N (and shows its questions), ``/help`` lists the commands, ``/quit`` ends. A command
that fails (a missing or unreadable image, an unknown command) says why; the conversation goes on.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import unicodedata

# Nothing here imports torch or transformers at import time: `--help` and a bad option answer at once;
# the model, torch and the checks that need them come after the command line is parsed.

from .loading import DEFAULT_MODEL, load_or_exit, note_fallbacks, resolve_model
from .startup import add_warm_up_arguments, check_warm_up_args, run_warm_up, start_caches
from .loading import CheckpointError, locate_checkpoint  # noqa: F401 (the CLI's names before `loading` existed)

_load = load_or_exit  # the chat's loader (tests stand in their own)
_note_fallbacks = note_fallbacks


def _open_image(path):
    """The image at ``path`` as RGB, or a ValueError saying why not."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(f"there is no file {path!r}")
    try:
        with Image.open(os.path.expanduser(path)) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise ValueError(f"{path!r} is not a readable image ({error})") from error


def printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) escaped, e.g. ``\\x1b``: a
    random-weight model's answer may hold any byte, which a terminal would otherwise act on."""
    return "".join(c if c in "\n\t" or not unicodedata.category(c).startswith("C") else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in text)


def unknown_words(tokenizer, text: str) -> list[str]:
    """The words of ``text`` a word-level tokenizer reads as ``<unk>`` (none for a subword tokenizer)."""
    from .quality.references import words_of

    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    return list(dict.fromkeys(w for w in words_of(text) if tokenizer.convert_tokens_to_ids(w) == unk))


# ---- the chat -------------------------------------------------------------------------------------

COMMANDS = ("Commands: /image PATH (attach an image to the next question), /grid N (attach the glyph grid of dev "
            "dialogue N and list its questions), /help (this list), /quit (end). Anything else is a question.")
BANNER = "[raincheck] interactive chat: type a question and press Enter. " + COMMANDS

def turn_summary(result) -> str:
    """The figures line printed after each answer."""
    tpot = result.time_per_output_token
    tokens = int(result.token_ids.numel())
    timing = (f"tpot {tpot * 1e3:.1f} ms" if tpot == tpot else  # nan: fewer than two tokens
              f"{tokens} token{'s' if tokens != 1 else ''}, no tpot")
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
    ttft = result.time_to_first_token
    first = f"ttft {ttft * 1e3:.1f} ms" if ttft == ttft else "no tokens"
    return f"  [{first} | {timing} | {visual} | {restoration}]"


def _dev_dialogue(index: int):
    from .quality.glyphs import SPLITS, benchmark_split

    size = SPLITS["dev"][1]
    if not 0 <= index < size:
        raise ValueError(f"--dialogue must be in [0, {size - 1}] (the dev split's dialogues), got {index}")
    return benchmark_split("dev", limit=index + 1)[index]


def check_device(name: str | None) -> str:
    """The torch device ``--device`` names (default: cuda when available, else cpu), or a ValueError
    saying why it cannot be used here, before anything is loaded."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r} is not a torch device: use cpu, cuda or cuda:N "
                         "(or leave --device out: cuda when available, else cpu)") from None
    if device.type == "cpu":
        return str(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
            raise ValueError(f"--device {name}: CUDA is not available (torch {torch.__version__}, {build}, sees no "
                             "GPU); use --device cpu, or leave --device out")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: there {'is' if count == 1 else 'are'} {count} CUDA device"
                             f"{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1})")
        return str(device)
    backend = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    if backend is None or not callable(getattr(backend, "is_available", None)) or not backend.is_available():
        raise ValueError(f"--device {name}: no {device.type} device is available here; use cpu or cuda")
    return str(device)


def check_chat_args(args):
    """Every ``chat`` option checked before the model loads: ``(config, device, dialogue, images)``, or a
    ValueError naming the option and the value."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.turns < 0:
        raise ValueError(f"--turns must be >= 0 (0: all of the dialogue's questions), got {args.turns}")
    if not (math.isfinite(args.idle_wait) and args.idle_wait >= 0):
        raise ValueError(f"--idle-wait must be a number of seconds >= 0, got {args.idle_wait}")
    config = chat_config(args)  # retention, chunk size, slack, guard, selector, mode
    dialogue = _dev_dialogue(args.dialogue)
    try:
        images = [_open_image(p) for p in args.image]
    except ValueError as error:
        raise ValueError(f"--image: {error}") from error
    for path in args.video:
        if not os.path.isfile(os.path.expanduser(path)):
            raise ValueError(f"--video: there is no file {path!r}")
    if args.save_image:
        from PIL import Image

        folder = os.path.dirname(os.path.abspath(os.path.expanduser(args.save_image)))
        extension = os.path.splitext(args.save_image)[1].lower()
        if not os.path.isdir(folder):
            raise ValueError(f"--save-image {args.save_image!r}: there is no folder {folder!r}")
        if extension not in Image.registered_extensions():
            raise ValueError(f"--save-image {args.save_image!r}: give a file name ending in an image format's "
                             "extension, e.g. .png or .jpg")
    if args.glyphs and resolve_model(args.model)[0] == "checkpoint":
        raise ValueError(f"--glyphs is for --model tiny (the bundled models use the glyph grid anyway), not for "
                         f"a checkpoint ({args.model}): give the grid with --image (see --save-image)")
    check_warm_up_args(args)
    device = check_device(args.device)
    return config, device, dialogue, images


def chat(args) -> int:
    # every option is checked before anything is loaded (and before transformers is imported: a bad option
    # answers in the time torch takes to import)
    config, device, dialogue, images = check_chat_args(args)
    from .quality.references import read_glyph_grid
    from .tiny import draw_test_image

    start_caches(args, device)
    model, processor, kind, _ = _load(args.model, device)
    bundled = kind == "bundled"
    _note_fallbacks(model)
    attached = [os.path.basename(p) for p in args.image]  # names of the images waiting for the next question
    videos = list(args.video)
    attached += [os.path.basename(p) for p in videos]
    questions = list(args.question)
    cells = read_glyph_grid(images[0]) if len(images) == 1 else None  # references for the user's own grid
    scripted = False  # replaying the dev dialogue's own questions
    if not images and not videos and kind != "checkpoint":
        if bundled or args.glyphs:
            images, cells = [dialogue.image()], dialogue.cells
            attached = [f"the grid of {dialogue.uid}"]
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
            attached = ["a generated 256x192 test image"]
            print("[raincheck] no --image given: using a generated 256x192 test image.", file=sys.stderr)
    if args.save_image and images:
        images[0].save(args.save_image)
        print(f"[raincheck] the first image is saved to {args.save_image}", file=sys.stderr)
    # what the first answer needs (its storage's steps, the first image's tower and selection) before the first
    # question; the rest of the chat's graphs in idle time: while it waits for a question, paused while it answers
    idle = run_warm_up(args, model, processor, config, args.max_new_tokens,
                       [(image.height, image.width) for image in images[:1]], first_turn=True)
    interactive = args.interactive or not questions
    if interactive:
        print(BANNER + (f"\n[raincheck] attached to the first question: {', '.join(attached)}" if attached else ""))
    try:
        return _chat_loop(args, model, processor, config, idle, questions, interactive, scripted, bundled, images,
                          videos, attached, cells, kind)
    finally:
        if idle is not None:
            idle.pause()


def _chat_loop(args, model, processor, config, idle, questions, interactive, scripted, bundled, images, videos,
               attached, cells, kind) -> int:
    """`chat`'s turns (``idle``: the `warmup.IdleWarmUp` of the graphs the first turn's warm-up left, or None)."""
    from . import Conversation
    from .quality.references import glyph_reference, judge, missing_from_grid, read_glyph_grid

    with Conversation(model, processor, config, max_new_tokens=args.max_new_tokens) as conversation:
        turn = 0
        while True:
            if turn < len(questions):
                text = questions[turn]
                if turn and idle is not None:  # (a scripted follow-up comes at once: no idle time before it)
                    idle.finish()
                print(f"\nyou> {text}")
            elif interactive:
                if idle is not None:
                    idle.resume()
                try:
                    text = input("\nyou> ").strip()
                except EOFError:
                    break
                finally:
                    if idle is not None:
                        idle.pause()
                if not text:
                    continue
                if text.startswith("/"):
                    command, _, rest = text.partition(" ")
                    if command in ("/quit", "/exit"):
                        break
                    if command == "/help":
                        print(COMMANDS)
                    elif command == "/image" and rest.strip():
                        path = rest.strip()
                        try:
                            image = _open_image(path)
                        except ValueError as error:
                            print(f"[raincheck] /image: {error}; nothing attached. "
                                  + (f"Pending: {', '.join(attached)}." if attached else ""))
                            continue
                        images.append(image)
                        attached.append(os.path.basename(path))
                        cells = read_glyph_grid(image) if len(images) == 1 else None
                        print(f"[raincheck] attached to the next question: {', '.join(attached)} "
                              f"({len(attached)} pending)")
                    elif command == "/grid":
                        try:
                            grid = _dev_dialogue(int(rest) if rest.strip() else 0)
                        except ValueError as error:
                            print(f"[raincheck] /grid N: {str(error).replace('--dialogue', 'N')}")
                            continue
                        images, videos, cells = [grid.image()], [], grid.cells
                        attached = [f"the grid of {grid.uid}"]
                        print(f"[raincheck] the grid of {grid.uid} is attached to the next question (it replaces "
                              "anything attached before); its questions:\n  "
                              + "\n  ".join(t.question for t in grid.turns))
                    else:
                        print(f"[raincheck] unknown command {printable(text)!r} (not sent to the model). {COMMANDS}")
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
                print(printable(piece), end="", flush=True)
            result = streamed.result
            if not result.text.strip():
                print("(empty answer)", end="")
            print()
            reference = glyph_reference(cells, asked)
            if reference is not None:
                print(f"reference> {reference.answer}   [{judge(reference, result.text)}]")
            elif missing_from_grid(cells, asked):
                print(f"reference> none: {missing_from_grid(cells, asked)}")
            print(turn_summary(result))
            images, videos, attached = [], [], []
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each option's default after its help (unless the help
    already says it, or there is none: a flag, a list that starts empty)."""

    def _get_help_string(self, action):
        text = action.help or ""
        empty = action.default is None or action.default is False or action.default == [] or \
            action.default == argparse.SUPPRESS
        if "default" not in text and not empty:
            text += " (default: %(default)s)"
        return text


# RaincheckConfig's modes, selectors and defaults, written out so that `--help` and a bad option need no torch
# (tests/test_cli.py checks them against raincheck_hf.configuration)
CHAT_MODES = ("full", "hard", "post_answer", "raincheck", "serial")
CHAT_SELECTORS = ("cdpruner", "divprune", "fastv", "mmtok", "random", "uniform", "visionzip")
CHAT_DEFAULTS = {"retention": 0.3, "chunk_size": 31, "decode_guard": 1, "tpot_slack": 0.02, "selector": "mmtok",
                 "mode": "raincheck", "compile_steps": None, "chunk_every": 1}


def _chunk_size(value: str) -> int | str:
    """``--chunk-size``: ``auto`` or an integer (RaincheckConfig checks its range)."""
    value = value.strip()
    return value if value == "auto" else int(value)


_chunk_size.__name__ = "chunk size"  # argparse: "invalid chunk size value: 'x'"


def plain(text: str) -> str:
    """``text`` for a terminal: the docstrings' reST double backticks and Markdown single ones dropped."""
    return re.sub(r"`([^`\n]+)`", r"\1", re.sub(r"``(.+?)``", r"\1", text))


def add_chat_arguments(c) -> None:
    """The ``chat`` subcommand's options (each with its help, default and choices)."""
    defaults = argparse.Namespace(**CHAT_DEFAULTS)
    c.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_PATH",
                   help="qwen3_vl or qwen3_5 (the bundled glyph models) | tiny (random weights) | "
                        "a local checkpoint folder or a Hub id")
    c.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="image file for the first question (repeatable; default: a glyph grid, or a generated "
                        "test image for --model tiny)")
    c.add_argument("--video", action="append", default=[], metavar="FILE",
                   help="video file for the first question (repeatable)")
    c.add_argument("--question", action="append", default=[], metavar="TEXT",
                   help="ask these questions in order instead of reading from stdin (repeatable; default: the "
                        "dev dialogue's questions with a bundled model)")
    c.add_argument("--interactive", action="store_true",
                   help="after the given (or default) questions, keep reading questions and /commands from stdin")
    c.add_argument("--dialogue", type=int, default=0, metavar="N",
                   help="without --image: the dev-split dialogue whose grid (and questions) to use")
    c.add_argument("--turns", type=int, default=2, metavar="N",
                   help="without --image and --question: how many of the dialogue's questions to ask (0: all)")
    c.add_argument("--glyphs", action="store_true", help="with --model tiny: use the glyph grid as the default image")
    c.add_argument("--save-image", default=None, metavar="FILE", help="save the first image (e.g. the default grid)")
    c.add_argument("--mode", default=defaults.mode, choices=CHAT_MODES,
                   help="full: no pruning · hard: drop the deferred tokens · post_answer: restore them after the "
                        "answer · raincheck: during and after it · serial: raincheck with each chunk in a forward "
                        "of its own")
    c.add_argument("--selector", default=defaults.selector, choices=CHAT_SELECTORS,
                   help="which visual tokens are prefilled first")
    c.add_argument("--retention", type=float, default=defaults.retention, metavar="R",
                   help="fraction of each image / video slice prefilled first, in [0, 1]")
    c.add_argument("--chunk-size", type=_chunk_size, default=defaults.chunk_size, metavar="C",
                   help="deferred tokens prefilled per decode step and per idle-time step (>= 1), or 'auto' "
                   "(sized per step from measured step costs, within --tpot-slack of plain decode)")
    c.add_argument("--tpot-slack", type=float, default=defaults.tpot_slack, metavar="S",
                   help="with --chunk-size auto: how much the answer's mean time per token may exceed plain "
                   "decode's (default 0.02)")
    c.add_argument("--decode-guard", type=int, default=defaults.decode_guard, metavar="G",
                   help="tokens generated before the first chunk rides along (>= 0)")
    c.add_argument("--chunk-every", type=int, default=defaults.chunk_every, metavar="K",
                   help="with a fixed --chunk-size, a chunk rides on every K-th decode step from the guard on "
                   "(default 1: every step)")
    c.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="answer length limit per question")
    c.add_argument("--idle-wait", type=float, default=5.0, metavar="SECONDS",
                   help="how long to let idle-time restoration run between turns before the figures are printed")
    c.add_argument("--compile-steps", action=argparse.BooleanOptionalAction, default=defaults.compile_steps,
                   help="torch.compile the fast path's element-wise work inside its CUDA graphs (default: on where "
                   "the steps are captured, i.e. on CUDA; the first answer pays the compile, --no-compile-steps "
                   "skips it)")
    c.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    add_warm_up_arguments(c)




def chat_config(args):
    """The `RaincheckConfig` of a ``chat`` command line (checked: a ValueError names the setting)."""
    from . import RaincheckConfig

    try:
        return RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, decode_guard=args.decode_guard,
                               tpot_slack=args.tpot_slack, selector=args.selector, mode=args.mode,
                               compile_steps=args.compile_steps, chunk_every=args.chunk_every)
    except ValueError as error:  # name the option the user typed, not the config field
        raise ValueError(re.sub(r"RaincheckConfig\.(\w+)=", lambda m: "--" + m.group(1).replace("_", "-") + " ",
                                str(error))) from None


DESCRIPTION = """\
Raincheck (deferred multimodal prefill) for Qwen vision-language models in transformers.
python -m raincheck_hf COMMAND --help lists a command's options."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; the ``serve`` options (which import the server's code) only for ``serve``."""
    parser = argparse.ArgumentParser(prog="python -m raincheck_hf", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    c = sub.add_parser("chat", help="a multi-turn chat in the terminal; without options it replays a two-turn dialogue of "
                            "the glyph benchmark on the bundled glyph Qwen3-VL (offline), with each answer's "
                            "reference and what was selected, deferred and restored",
                       description=plain(__doc__), formatter_class=_HelpFormatter)
    add_chat_arguments(c)
    serve_help = "an OpenAI-compatible server (/v1/chat/completions) that keeps each conversation's cache"
    if command == "serve":
        from .serve.cli import DESCRIPTION as SERVE_DESCRIPTION, add_arguments as add_serve_arguments

        s = sub.add_parser("serve", help=serve_help, description=plain(SERVE_DESCRIPTION),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_serve_arguments(s)
    else:
        sub.add_parser("serve", help=serve_help)
    k = sub.add_parser("cache", help="show (info) or empty (clear) the persistent cache folder of compiled and "
                                     "autotuned kernels",
                       description="The folder where Triton's kernels and autotuning results and torch's compile "
                                   "artifacts are kept between processes ($RAINCHECK_CACHE_DIR, else "
                                   "~/.cache/raincheck_hf). info: what it holds and whether it matches this "
                                   "installation (versions, GPU, CUDA); clear: delete its entries.")
    k.add_argument("action", choices=["info", "clear"])
    k.add_argument("--cache-dir", default=None, metavar="DIR", help="the folder (default: as above)")
    return parser


def cache_command(args) -> int:
    from . import persist

    if args.action == "clear":
        freed = persist.clear(args.cache_dir)
        print(f"[raincheck] cleared {persist.default_cache_dir() if args.cache_dir is None else args.cache_dir} "
              f"({freed / 2**20:.1f} MiB freed)")
        return 0
    info = persist.info(args.cache_dir)
    print(f"folder: {info['folder']}" + ("" if info["exists"] else " (does not exist yet)"))
    if info["manifest"] is None:
        print("entries: none" if not info["sizes"] else "entries: present, manifest unreadable (set aside at the "
              "next start)")
    else:
        print("built with: " + ", ".join(f"{k} {v}" for k, v in info["manifest"]["fingerprint"].items()))
        print("matches this installation: " + ("yes" if info["matches"] else f"no ({info['mismatch']}; set aside "
                                                                              "and rebuilt at the next start)"))
    for name, size in info["sizes"].items():
        print(f"  {name}: {size / 2**20:.1f} MiB")
    for name, size in info.get("stale", {}).items():
        print(f"  stale/{name}: {size / 2**20:.1f} MiB (python -m raincheck_hf cache clear deletes it)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from .serve.cli import serve

            return serve(args)
        if args.command == "cache":
            return cache_command(args)
        return chat(args)
    except ValueError as error:  # bad settings: say what and stop, no traceback
        print(f"[raincheck] {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
