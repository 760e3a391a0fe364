"""Raincheck demo: a multi-turn image / video chat that shows what deferred prefill does.

    python -m demo.app [--model qwen3_vl | qwen3_5 | tiny | PATH_OR_HUB_ID] [--host 127.0.0.1] [--port 7860] [--share]

Each browser session gets its own `raincheck_hf.Conversation` (held in a `gr.State`, closed when
the session ends). An answer streams token by token from ``Conversation.ask(stream=True)``; the
conversation's background worker restores what is left after the answer, and a follow-up that
arrives early is handled by the conversation itself (docs/method.md §6). A second tab runs one
question through the four modes side by side (`compare_modes`); under the picture, a timeline
replays which patch came back at which generated token (`build_timeline`).

The picture beside the chat is the turn's image (a video: one frame per temporal slice) at the
size the processor resized it to, with every merged vision token (patch 16 px × merge 2 = one
32 px cell) shaded by what the cache holds for it: prefilled first, deferred, restored, or
dropped (``hard``). It is drawn from the cache while the answer streams and, through a
`gr.Timer`, while idle-time restoration finishes.

Without ``--model`` the demo runs offline on the bundled glyph Qwen3-VL
(`raincheck_hf.quality.load_bundled("qwen3_vl")`, ~3.3 M parameters trained on the project's
glyph-grid benchmark). It knows only that task and its word-level vocabulary, so the examples are
glyph grids with benchmark questions; when a turn's image is a glyph grid, the reference answer is
read off its pixels and shown after the model's. ``qwen3_5`` is the bundled glyph Qwen3.5;
``tiny`` is the tiny Qwen3-VL of `raincheck_hf.tiny` with random weights (gibberish answers; the
selection, timings and restoration are real). Models are loaded in functions (`load_model`),
never at import, so the app is testable.
"""

import argparse
import sys

from raincheck_hf.__main__ import plain
from raincheck_hf.configuration import RaincheckConfig
from raincheck_hf.startup import add_warm_up_arguments, check_warm_up_args, run_warm_up, start_caches

from .layout import build_demo
from .media import MediaLimits
from .session import MODES_SHOWN

# what `demo.app` offered before the demo became a package (its modules: demo/README.md, "Layout")
from .cache_map import (LEGEND_LABELS, PICTURE_WIDTH, STATES, LiveStatus, VisualTurn, draw_picture,  # noqa: F401
                        live_status)
from .compare import COMPARE_HEADERS, COMPARE_MODES, ModeRun, compare_modes, small_model_note  # noqa: F401
from .examples import make_examples, make_glyph_examples  # noqa: F401
from .media import MAX_VIDEO_FRAMES, PreparedTurn, SegmentView, prepare_turn, read_media  # noqa: F401
from .models import (DEFAULT_MODEL, MODEL_LABELS, TINY_MODEL, LoadedModel, ModelLoadError, is_loaded,  # noqa: F401
                     load_model, model_choices, model_key)
from .panels import FIGURE_HEADERS  # noqa: F401
from .session import Session, Settings  # noqa: F401
from .streaming import STREAM_PICTURE_EVERY_S, STREAM_TEXT_EVERY_S, Step, pace  # noqa: F401
from .timeline import (TIMELINE_WAITING, TimelineStep, build_timeline, describe_step, draw_timeline,  # noqa: F401
                       live_restored_order, timeline_states)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.app", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                        help="qwen3_vl (default: the bundled glyph Qwen3-VL) | qwen3_5 (the bundled glyph Qwen3.5) | "
                             "tiny (random weights) | a local checkpoint folder or Hub id (demo/README.md, "
                             "\"A real checkpoint\")")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=None, help="port (default 7860, or the next free one)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    parser.add_argument("--mode", default="raincheck", choices=MODES_SHOWN,
                        help="the chat's starting mode (default raincheck; the page can change it)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="the starting answer length (default 64; the page can change it)")
    parser.add_argument("--slow-motion-ms", type=int, default=0, metavar="MS",
                        help="the starting pause per generated token, to watch the picture fill in (default 0)")
    add_warm_up_arguments(parser)
    args = parser.parse_args(argv)
    # checked before the model loads
    try:
        check_warm_up_args(args)
    except ValueError as error:
        parser.error(str(error))
    if not 1 <= args.max_new_tokens <= 512:
        parser.error(f"--max-new-tokens must be in [1, 512] (the page's slider), got {args.max_new_tokens}")
    if not 0 <= args.slow_motion_ms <= 200:
        parser.error(f"--slow-motion-ms must be in [0, 200] (the page's slider), got {args.slow_motion_ms}")
    if args.port is not None and not 0 < args.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    start_caches(args, _device())  # persistent compile / autotune caches on CUDA, before the model loads
    demo = build_demo(args.model, mode=args.mode, max_new_tokens=args.max_new_tokens,
                      slow_motion_ms=args.slow_motion_ms)
    warm_up_loaded(args)  # the fast path's captures before the first answer, not in it (nothing to do on a CPU)
    # quiet: Gradio's own banner would say "set `share=True` in `launch()`", where this command's flag is --share
    demo.launch(server_name=args.host, server_port=args.port, share=bool(args.share), quiet=True,
                prevent_thread_lock=True, max_file_size=MediaLimits().max_file_bytes)
    where = f"[raincheck demo] running at {demo.local_url}"
    if demo.share_url:
        where += f" and at the public link {demo.share_url}"
    elif args.share:
        where += " (no public link could be made: see the message above)"
    else:
        where += (" (this machine only)" if args.host in ("127.0.0.1", "localhost", "::1") else "") + \
            "; --share adds a public gradio.live link"
    print(where, file=sys.stderr, flush=True)
    demo.block_thread()
    return 0


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def warm_up_loaded(args) -> None:
    """`raincheck_hf.warm_up` (through the CLI's `startup.run_warm_up`: progress bar, ``--no-warm-up``) for the model
    the page starts with, at its starting settings."""
    from .models import _MODELS

    for loaded in list(_MODELS.values()):
        config = Settings(loaded.name, args.mode, RaincheckConfig().selector).config()
        run_warm_up(args, loaded.model, loaded.processor, config, args.max_new_tokens)


if __name__ == "__main__":
    sys.exit(main())
