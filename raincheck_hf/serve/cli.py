"""``python -m raincheck_hf serve``: its options and the run (uvicorn in the foreground)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import sys

from ..configuration import PREPARE_PRIORITIES, RaincheckConfig, parse_chunk_size
from .media import Limits

DESCRIPTION = """\
An OpenAI-compatible chat server (POST /v1/chat/completions, GET /v1/models, /health, /metrics)
that keeps each conversation's Raincheck cache between requests: a follow-up that resends the
dialogue prefills only its new turn (usage.prompt_tokens_details.cached_tokens says how much was
reused), and the deferred visual tokens are restored in idle time between requests.

Models (--model): qwen3_vl (default, the bundled glyph Qwen3-VL, offline), qwen3_5, tiny (random
weights), or a local Qwen3-VL / Qwen3.5 checkpoint folder. Needs the serve extra:
pip install -e ".[serve]"."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="qwen3_vl (default) | qwen3_5 | tiny | a checkpoint folder")
    parser.add_argument("--served-model-name", default=None,
                        help="the id clients send as `model` (default: the --model value)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network: set --api-key)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    parser.add_argument("--max-cache-gb", type=_gb_or_auto, default="auto",
                        help="memory budget of the held conversations' caches, least recently used evicted first; "
                             "'auto' (the default): on a GPU, its memory left after the warm-up less a reserve of "
                             "10%% of it (at least 4 GiB) for the answers' own work, said at start; unbounded "
                             "elsewhere; 'none': unbounded")
    parser.add_argument("--media-root", default=None,
                        help="allow file:// image / video URLs under this folder (default: file URLs refused)")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length when a request sets none")
    parser.add_argument("--mode", default="raincheck", help="default mode: full | hard | post_answer | raincheck | serial")
    parser.add_argument("--selector", default="mmtok")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=parse_chunk_size, default=31,
                        help="deferred tokens per decode step, or 'auto' (sized from measured step costs)")
    parser.add_argument("--tpot-slack", type=float, default=0.02, help="with --chunk-size auto (default 0.02)")
    parser.add_argument("--compile-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the fast path's element-wise work (RaincheckConfig.compile_steps); "
                             "default: on where the steps are captured as CUDA graphs (a model on CUDA), "
                             "--no-compile-steps turns it off (no compile in the warm-up)")
    parser.add_argument("--decode-guard", type=int, default=RaincheckConfig.decode_guard,
                        help=f"decode steps before the first chunk (default: the library's, "
                             f"{RaincheckConfig.decode_guard})")
    parser.add_argument("--chunk-every", type=int, default=RaincheckConfig.chunk_every,
                        help="with a fixed --chunk-size, a chunk on every k-th decode step from the guard on "
                             f"(default: the library's, {RaincheckConfig.chunk_every}: every step)")
    parser.add_argument("--device", default=None)
    from ..startup import add_warm_up_arguments

    add_warm_up_arguments(parser)
    parser.add_argument("--warm-up-image-sizes", type=_image_sizes, default=(), metavar="WxH[,WxH...]",
                        help="image sizes (width x height, pixels) whose vision-tower and token-selection graphs the "
                             "warm-up captures, so a first request with an image of such a size meets them captured "
                             "(default: none; otherwise each is captured by the requests that first need it, holding "
                             "the batching loop that long)")
    parser.add_argument("--freeze-heap", action=argparse.BooleanOptionalAction, default=True,
                        help="after the warm-up, move every object alive (imports, model, graphs) out of the garbage "
                             "collector's full collections (gc.freeze): each one would pause every running answer "
                             "(default: on)")
    parser.add_argument("--log-level", default="info",
                        help="log level of uvicorn and the request log (debug | info | warning | error)")
    load = parser.add_argument_group("load (a request beyond the running places and the queue gets HTTP 429 with "
                                     "Retry-After at once; /metrics has the queue's figures)")
    load.add_argument("--max-running", type=int, default=4,
                      help="turns generating at once; more wait in the queue (default %(default)s)")
    load.add_argument("--max-queue", type=int, default=64,
                      help="turns waiting for a running place, first come first served (default %(default)s)")
    load.add_argument("--batching", action="store_true",
                      help="answer the running turns in one continuous-batching loop over the batched engine "
                           "(its decode steps captured on CUDA; --max-running is then the batch's most sequences); "
                           "default: a thread per turn on the batch-1 engine")
    load.add_argument("--restoring-places", type=int, default=None,
                      help="with --batching, places in a step beyond --max-running for held conversations restoring "
                           "their deferred tokens beside the answers; the batched engine is warmed for both (default: "
                           "2, or 0 where the engine's key / value storage for them would not fit the GPU's free "
                           "memory; with 0 they restore in places the answers leave free, and in idle time)")
    load.add_argument("--max-batch-tokens", type=int, default=2048,
                      help="with --batching, rows per step: decode rows first, then prompt pieces, so a long prompt "
                           "is prefilled over several steps (default %(default)s)")
    load.add_argument("--max-prompt-forwards", type=int, default=None,
                      help="with --batching on CUDA, the most prompt-piece forwards in one step (each prompt piece that "
                           "does not ride beside the decode rows runs in a forward of its own, a pass over the weights, "
                           "and a step's tokens come after all of them); more prompts wait for the next step (default: "
                           "as many as --max-batch-tokens gives)")
    load.add_argument("--max-preparing", type=_count_or_all, default=1,
                      help="with --batching, the most requests' turns prepared at once (HF's preparation; a first "
                           "turn's vision encoding, selection and plan), the others in line in the order they came; "
                           "'all': every request's at once (more tokens/s under a burst of new conversations, later "
                           "first tokens; default %(default)s)")
    load.add_argument("--prepare-priority", choices=PREPARE_PRIORITIES, default="normal",
                      help="with --batching on CUDA, the priority of the stream new turns are prepared on: 'high' "
                           "puts a new conversation's vision encoding and selection before the running answers' "
                           "queued steps (its first token sooner, theirs a step later; default %(default)s)")
    load.add_argument("--memory-headroom-gb", type=_gb_auto_or_off, default="auto",
                      help="with --batching on CUDA, GPU memory in GiB a new turn's preparation leaves free for the "
                           "loop's own work: before its image or video goes to the GPU it waits (idle held "
                           "conversations evicted first) until the turn's estimated bytes and this much more are "
                           "free; 'auto' (the default): 2 GiB, or 1/32 of a smaller GPU's memory; 'off': no such wait")
    limits = parser.add_argument_group("limits per request (each refused with a 4xx naming the limit, before any "
                                       "compute; GET /v1/models lists them)")
    limits.add_argument("--max-body-mb", type=float, default=Limits.max_body_bytes / 2**20,
                        help="request body size in MiB; larger: 413 before it is read whole (default %(default)g)")
    limits.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="prompt tokens, images and videos included (default: the model's context; the KV "
                             "budget of --max-cache-gb also bounds it)")
    limits.add_argument("--max-images", type=int, default=Limits.max_images,
                        help="images per request (default %(default)s)")
    limits.add_argument("--max-video-frames", type=int, default=Limits.max_video_frames,
                        help="video frames per request; a video file counts 64, the most it is sampled to "
                             "(default %(default)s)")
    limits.add_argument("--max-image-pixels", type=int, default=Limits.max_image_pixels,
                        help="pixels of one image or video frame, read from its header before decoding "
                             "(default %(default)s: 8192 x 8192)")
    limits.add_argument("--max-request-pixels", type=int, default=Limits.max_request_pixels,
                        help="pixels of all images and video frames of a request (default %(default)s)")
    limits.add_argument("--max-video-seconds", type=float, default=Limits.max_video_seconds,
                        help="duration of a video file (default %(default)g)")
    limits.add_argument("--media-timeout", type=float, default=Limits.media_timeout_s,
                        help="seconds for decoding a request's images and videos (default %(default)g)")


def settings_from(args):
    """`ServeSettings` from the parsed options; ValueError naming a bad one, before anything is loaded."""
    from ..configuration import RaincheckConfig
    from .app import ServeSettings
    from .protocol import media_root_from

    config = RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, decode_guard=args.decode_guard,
                             selector=args.selector, mode=args.mode, tpot_slack=args.tpot_slack,
                             compile_steps=args.compile_steps, chunk_every=args.chunk_every)
    from ..startup import check_warm_up_args

    check_warm_up_args(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    gb = args.max_cache_gb if isinstance(args.max_cache_gb, (int, float)) else None  # (else 'auto' or None)
    if gb is not None and not (math.isfinite(gb) and gb >= 0):  # in GB here, in bytes for ServeSettings
        raise ValueError(f"--max-cache-gb must be >= 0, 'auto' or 'none', got {args.max_cache_gb}")
    headroom = args.memory_headroom_gb  # in GiB here, in bytes for ServeSettings ('auto' and None as they are)
    if isinstance(headroom, float):
        if not (math.isfinite(headroom) and headroom >= 0):
            raise ValueError(f"--memory-headroom-gb must be a number of GiB >= 0, 'auto' or 'off', got "
                             f"{headroom:g}")
        headroom = int(headroom * 2**30)
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):  # in MiB here, in bytes for Limits
        raise ValueError(f"--max-body-mb must be a number > 0, got {args.max_body_mb}")
    try:  # ServeSettings and Limits check their fields; the message names the option that set one
        limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20),
                        max_prompt_tokens=args.max_prompt_tokens, max_images=args.max_images,
                        max_video_frames=args.max_video_frames, max_image_pixels=args.max_image_pixels,
                        max_request_pixels=args.max_request_pixels, max_video_seconds=args.max_video_seconds,
                        media_timeout_s=args.media_timeout)
        return ServeSettings(
            model_name=args.served_model_name or args.model or "qwen3_vl",
            config=config,
            # ('auto': set after the warm-up, `with_cache_budget`)
            max_cache_bytes=None if gb is None else int(gb * 2**30),
            api_key=args.api_key,
            media_root=media_root_from(args.media_root),
            max_tokens=args.max_tokens,
            limits=limits,
            max_running=args.max_running,
            max_queue=args.max_queue,
            batching=args.batching,
            max_batch_tokens=args.max_batch_tokens,
            max_prompt_forwards=args.max_prompt_forwards,
            max_preparing=args.max_preparing,
            prepare_priority=args.prepare_priority,
            restoring_places=args.restoring_places,
            memory_headroom=headroom,
        )
    except ValueError as error:
        message = str(error)
        for field_name, option in _OPTIONS.items():
            if message.startswith(field_name + " "):
                message = option + message[len(field_name):]
        raise ValueError(message) from None


def with_restoring_places(args, model, settings):
    """``settings`` with ``restoring_places`` set for a batching server whose warm-up sizes its engine
    (``--batching`` without ``--restoring-places``): `BatchLoop.MAX_RESTORING` when the batched pool for
    ``--max-running`` answers and them fits the GPU's free memory, else 0, said on stderr."""
    if not (settings.batching and settings.restoring_places is None and args.warm_up):
        return settings
    from dataclasses import replace

    from ..batch_loop import BatchLoop, restoring_places_that_fit
    from ..startup import warm_up_max_tokens

    max_tokens = warm_up_max_tokens(args, settings.max_tokens)
    places = restoring_places_that_fit(model, settings.max_running, max_tokens)
    if places < BatchLoop.MAX_RESTORING:
        print(f"[raincheck] --max-running {settings.max_running} with {BatchLoop.MAX_RESTORING} places for held "
              f"conversations restoring beside the answers would not fit the GPU's free memory at "
              f"--warm-up-tokens {max_tokens}: they restore in places the answers leave free "
              f"(--restoring-places {places})", file=sys.stderr)
    return replace(settings, restoring_places=places)


def _gb_or(*none_words: str):
    """An option's parser of a number of GiB (a float; `settings_from` checks its range), ``auto``, or one of
    ``none_words`` (None); the first of them is the one its error names."""
    def parse(text: str):
        word = text.strip().lower()
        if word == "auto":
            return "auto"
        if word in none_words:
            return None
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a number of GiB, 'auto' or '{none_words[0]}', got {text!r}") \
                from None

    return parse


_gb_or_auto = _gb_or("none")  # --max-cache-gb: None is unbounded
_gb_auto_or_off = _gb_or("off", "none")  # --memory-headroom-gb: None is no wait for memory ("none" as --max-cache-gb)


def with_cache_budget(args, device, settings, model):
    """``settings`` with the held caches' budget of ``--max-cache-gb auto`` (`startup.auto_cache_budget`, taken
    after the warm-up), said on stderr; as they are for a number or ``none``. With ``--batching`` and
    ``--no-warm-up`` the batched pool is not made yet: what the warm-up would have made for ``--max-running``
    (`fast.batched_graphs.pool_bytes`) is kept out of the budget too, so that the budget is the same either way."""
    if args.max_cache_gb != "auto":
        return settings
    from dataclasses import replace

    from ..startup import auto_cache_budget, warm_up_max_tokens

    later = 0
    if settings.batching and not args.warm_up:
        from ..fast.batched_graphs import pool_bytes
        from ..models import get_adapter

        later = pool_bytes(get_adapter(model), settings.batch_places,
                           warm_up_max_tokens(args, settings.max_tokens))["bytes"]
    budget = auto_cache_budget(device, later)
    if budget == 0:
        print("[raincheck] --max-cache-gb auto: no GPU memory is left after the warm-up for held conversations, and "
              "a prompt must fit the held caches' budget: every request would be refused. Lower --max-running or "
              "--warm-up-tokens, or give --max-cache-gb.", file=sys.stderr)
    elif budget is not None:
        print(f"[raincheck] held conversations' caches: up to {budget / 2**30:.1f} GiB (--max-cache-gb auto: the "
              f"GPU's memory left after the warm-up, less a reserve for the answers; least recently used evicted "
              f"first)", file=sys.stderr)
    return replace(settings, max_cache_bytes=budget)


def _image_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``--warm-up-image-sizes``: ``WxH`` pairs (pixels, each >= 1), comma-separated."""
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            width, height = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes WxH pairs such as 1344x1024, comma-separated, got {part!r}") \
                from None
        if width < 1 or height < 1:
            raise argparse.ArgumentTypeError(f"takes sizes of at least 1x1 pixels, got {part!r}")
        sizes.append((width, height))
    return tuple(sizes)


def _count_or_all(text: str):
    """``--max-preparing``: an integer, or ``all`` (None: no limit)."""
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes an integer >= 1 or 'all', got {text!r}") from None


_OPTIONS = {"max_tokens": "--max-tokens", "max_running": "--max-running", "max_queue": "--max-queue",
            "max_batch_tokens": "--max-batch-tokens", "max_prompt_forwards": "--max-prompt-forwards",
            "max_preparing": "--max-preparing", "prepare_priority": "--prepare-priority",
            "restoring_places": "--restoring-places", "memory_headroom": "--memory-headroom-gb",
            "api_key": "--api-key", "media_root": "--media-root",
            "max_body_bytes": "--max-body-mb", "max_prompt_tokens": "--max-prompt-tokens",
            "max_images": "--max-images", "max_video_frames": "--max-video-frames",
            "max_image_pixels": "--max-image-pixels", "max_request_pixels": "--max-request-pixels",
            "max_video_seconds": "--max-video-seconds", "media_timeout_s": "--media-timeout"}


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _log_requests(level: str) -> None:
    """The request log on stderr (uvicorn configures only its own loggers)."""
    import logging

    log = logging.getLogger("raincheck_hf.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    known = isinstance(logging.getLevelName(level.upper()), int)  # getLevelNamesMapping is Python 3.11+
    log.setLevel(level.upper() if known else "INFO")


def serve(args) -> int:
    settings = settings_from(args)
    try:
        import uvicorn

        from .app import create_app
    except ImportError as error:
        raise SystemExit(f"[raincheck] serve needs FastAPI and uvicorn ({error}): pip install -e \".[serve]\"")
    import torch

    from ..loading import load_or_exit, note_fallbacks

    from ..startup import run_warm_up, start_caches

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start_caches(args, device)
    model, processor, _, _ = load_or_exit(args.model, device)
    note_fallbacks(model)
    # before the port opens; with --batching the batched decode steps of up to --max-running answers and the held
    # conversations restoring beside them (--restoring-places, unset: as many as fit)
    settings = with_restoring_places(args, model, settings)
    run_warm_up(args, model, processor, settings.config, settings.max_tokens,
                image_sizes=[(height, width) for width, height in args.warm_up_image_sizes],
                batch=settings.batch_places if settings.batching else None)
    settings = with_cache_budget(args, device, settings, model)
    if not _loopback(args.host) and settings.api_key is None:
        print(f"[raincheck] serving on {args.host} without --api-key: anyone who can reach it can use it.",
              file=sys.stderr)
    print(f"[raincheck] OpenAI-compatible API at http://{args.host}:{args.port}/v1 (model id "
          f"{settings.model_name!r}; API docs at /docs)", file=sys.stderr)
    _log_requests(args.log_level)
    if args.freeze_heap:
        from ..startup import freeze_heap

        freeze_heap()
    # the request log (method, path, status, conversation, cached tokens, T1, duration) replaces uvicorn's access log
    uvicorn.run(create_app(model, processor, settings), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0
