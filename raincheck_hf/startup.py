"""What the CLI chat and the server do at start on CUDA: the persistent caches, then `warm_up`.

Shared by `raincheck_hf.__main__` (chat) and `raincheck_hf.serve.cli` (serve). Imports nothing heavy at import
time: the options are added and checked before torch or transformers load.
"""

from __future__ import annotations

import argparse
import sys


def add_warm_up_arguments(parser) -> None:
    """``--warm-up`` / ``--no-warm-up``, ``--warm-up-tokens``, ``--cache-dir`` (chat and serve)."""
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="before the first answer, capture every CUDA graph a conversation of up to "
                             "--warm-up-tokens rows can need (raincheck_hf.warm_up, with a progress bar; serve "
                             "--batching: the batched steps of up to --max-running answers instead), so no "
                             "answer pauses for one; nothing to do on a CPU")
    parser.add_argument("--warm-up-tokens", type=int, default=4096, metavar="N",
                        help="the conversation length (prompts, images and answers, in tokens) the warm-up covers")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="persistent cache folder for compiled and autotuned kernels, on CUDA (default: "
                             "$RAINCHECK_CACHE_DIR, else ~/.cache/raincheck_hf; python -m raincheck_hf cache info)")


def check_warm_up_args(args) -> None:
    if args.warm_up_tokens < 2:
        raise ValueError(f"--warm-up-tokens must be >= 2, got {args.warm_up_tokens}")


def start_caches(args, device: str) -> None:
    """The persistent caches (`persist.enable_persistent_caches`) for a CUDA run, before the model loads; a line when
    Python compiles torch's modules from source in every process (`bytecode_note`)."""
    if str(device).startswith("cuda"):
        from .persist import enable_persistent_caches

        caches = enable_persistent_caches(args.cache_dir)
        if caches.set_aside is not None:
            print(f"[raincheck] cache folder: the entries in {caches.root} were {caches.set_aside[1]}; set aside "
                  f"({caches.set_aside[0]}) and rebuilt", file=sys.stderr)
        note = bytecode_note()
        if note is not None:
            print(f"[raincheck] {note}", file=sys.stderr)


def bytecode_path(source: str) -> str | None:
    """Where this interpreter keeps the bytecode of the module at ``source`` (``__pycache__`` beside it, or under
    ``PYTHONPYCACHEPREFIX``), whether or not it is there; None for a module it keeps none of."""
    import importlib.util

    if not source.endswith(".py"):
        return None
    try:
        return importlib.util.cache_from_source(source)
    except (NotImplementedError, ValueError):
        return None


def bytecode_note(module_file: str | None = None, dont_write: bool | None = None,
                  writable: bool | None = None) -> str | None:
    """What to do, or None, when this interpreter neither finds nor writes the bytecode of torch's modules (of
    ``module_file``, default torch's ``__init__.py``): it then compiles them from source in every process, torch's,
    transformers' and their dependencies', about 1,400 modules, which took a second process ~11 s longer to its
    first answer (Qwen3-VL-8B on an H100, ``bench cold-start``). ``dont_write``: Python writes no bytecode
    (``sys.flags.dont_write_bytecode``: ``PYTHONDONTWRITEBYTECODE`` or ``-B``); ``writable``: its bytecode's folder
    can be written (default: asked of the file system)."""
    import os

    if module_file is None:
        torch = sys.modules.get("torch")
        module_file = getattr(torch, "__file__", None)
        if module_file is None:
            return None
    dont_write = bool(sys.flags.dont_write_bytecode) if dont_write is None else dont_write
    cached = bytecode_path(module_file)
    if cached is None or os.path.exists(cached):
        return None
    folder = os.path.dirname(cached)
    if writable is None:
        writable = os.access(folder if os.path.isdir(folder) else os.path.dirname(folder), os.W_OK)
    if dont_write:
        why = "Python writes no bytecode here (PYTHONDONTWRITEBYTECODE or -B)"
        fix = "unset PYTHONDONTWRITEBYTECODE" + ("" if writable else " and set PYTHONPYCACHEPREFIX to a folder you "
                                                 "can write")
    elif not writable:
        why = f"Python cannot write bytecode beside torch ({os.path.dirname(module_file)})"
        fix = "set PYTHONPYCACHEPREFIX to a folder you can write"
    else:
        return None  # (this process writes it: the next one finds it)
    return (f"{why}, so every start compiles torch's and transformers' modules from source again (seconds): {fix} "
            f"to keep them between runs")


CACHE_RESERVE_FRACTION = 0.10  # of the device's memory, kept out of the held caches' automatic budget
CACHE_RESERVE_MIN = 4 << 30


def auto_cache_budget(device, later_bytes: int = 0) -> int | None:
    """The held conversations' budget of ``serve --max-cache-gb auto`` (the default), taken after the warm-up: on
    CUDA, the device's free memory and what PyTorch's allocator holds unused outside the CUDA graphs' pools
    (`fast.graphs.usable_device_memory`), less a reserve of
    `CACHE_RESERVE_FRACTION` of the device's memory (at least `CACHE_RESERVE_MIN`) for what the answers themselves
    allocate: prompt pieces run outside the captured steps, the vision tower of a new image size, and the caches of
    answers that just ended, copied out of the batched pool before the least recently used conversations are evicted.
    0 when nothing is left (nothing is held between turns). ``later_bytes``: memory the server will allocate after
    this and that is not free for the caches either (a batched pool no warm-up made). Elsewhere None: unbounded."""
    import torch

    from .fast.graphs import usable_device_memory

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.mem_get_info(device)[1]
    reserve = max(int(total * CACHE_RESERVE_FRACTION), CACHE_RESERVE_MIN)
    return max(0, usable_device_memory(device) - reserve - int(later_bytes))


def warm_up_max_tokens(args, max_new_tokens: int) -> int:
    """The rows a warm-up sizes its captures for: ``--warm-up-tokens``, at least an answer's ``max_new_tokens``
    plus one."""
    return max(args.warm_up_tokens, max_new_tokens + 1)


def run_warm_up(args, model, processor, config, max_new_tokens: int, image_sizes=(), batch: int | None = None,
                first_turn: bool = False):
    """`raincheck_hf.warm_up` with a progress bar, unless ``--no-warm-up``; one line on stderr. ``batch``: instead
    the batched engine's decode steps for up to that many sequences (the server's ``--batching``, where every turn
    runs in the batched engine). ``first_turn``: only what a first turn with an image of ``image_sizes`` needs
    before its answer; returns the `warmup.IdleWarmUp` that captures the rest (the caller resumes it while idle),
    or None (nothing was captured, or nothing is left)."""
    if not args.warm_up:
        return None
    from .integration import enable
    from .warmup import IdleWarmUp, warm_up

    enable(model)  # as `Conversation` and the server do (idempotent)
    max_tokens = warm_up_max_tokens(args, max_new_tokens)
    bounds = dict(max_tokens=max_tokens, max_new_tokens=max_new_tokens, image_sizes=list(image_sizes) or None,
                  cache_dir=args.cache_dir)
    from .fast.batched_graphs import PoolTooLarge

    try:
        summary = warm_up(model, processor, config, progress=True, batch=batch,
                          conversations=1 if batch is None else 0, first_turn=first_turn, **bounds)
    except PoolTooLarge as error:
        # (the server's batched engine: its places are --max-running's and the held conversations restoring beside
        # them, each of --warm-up-tokens rows)
        raise SystemExit(f"[raincheck] --max-running {getattr(args, 'max_running', batch)} (a batch of {batch} with "
                         f"the held conversations restoring, --restoring-places) with --warm-up-tokens {max_tokens}: "
                         f"{error}. Lower --max-running, --restoring-places or --warm-up-tokens.") from None
    if summary.graphs or summary.batched:
        print(f"[raincheck] {summary}", file=sys.stderr)
    if first_turn and summary.graphs:
        return IdleWarmUp(model, processor, config, **bounds)
    return None


def freeze_heap() -> int:
    """Move every object alive now (imported modules, the model, the processor, captured graphs and their buffers)
    out of reach of the garbage collector's full collections (`gc.freeze`, after one `gc.collect`); how many objects
    were frozen. A full collection walks every tracked object, and a server process holds hundreds of thousands
    from its imports alone: each one is a pause of every running answer's next token (about 0.2 s for the tiny
    test model's process on a CPU; `python -m raincheck_hf.bench serve-load` records the pauses of its rounds).
    After it they walk only what the process made since. What a frozen object later leaks in a reference cycle is
    not collected: the server does it once, after its warm-up, for what lives as long as it does (``serve
    --no-freeze-heap`` skips it); nothing in the library does it for a user's process."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
