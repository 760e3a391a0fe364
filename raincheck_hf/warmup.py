"""`warm_up`: pay a process's one-time costs before its first answer, not inside it.

On the CUDA fast path a step shape is captured as a CUDA graph the first time a forward runs it at its slot
bucket (`fast.graphs`), and that first run also compiles (``compile_steps``) and autotunes its Triton / fla
kernels; the vision tower is captured per image grid on its second sighting (`fast.vision_graphs`). Each is a
pause of the answer it happens in (0.1-0.5 s a capture on an 8B/9B model, tens of seconds for the first
compile). `warm_up` makes those captures ahead, on the pooled slot storages the conversations will lease, so
that a conversation within the warmed bounds replays only (its `RaincheckTrace.captures` stay empty).

Which step keys (`fast.graphs.StepKey`: rows, logits or not, the family's step variant, slot bucket) a
conversation can need comes from the code that picks them, not from a list kept here:

- storages: a conversation starts on a storage of `round_capacity` (prompt + answer rows) slots and moves to
  the next power-of-two capacity when it grows (`StaticDeferredCache.ensure_capacity`), so every capacity from
  `SLOT_ROUNDING` up to ``round_capacity(max_tokens)``, each with `scratch_slots` of the config's largest
  chunk (and of its idle-time chunk);
- slot buckets: `slot_bucket` of every row count a storage can hold;
- shapes: the decode step (1 row), the fused ``[chunk, token]`` step of each chunk size the config can pick
  (``chunk_size``, or `CHUNK_LADDER` with ``"auto"``; ``raincheck`` mode), the chunk-only step (``serial``
  mode, and idle-time restoration with ``idle_chunk_size``; modes that defer), each with every variant the
  family's adapter gives for its rows (`ModelAdapter.static_step_variant` over the suffix lengths and
  pending counts a conversation reaches; Qwen3.5: whether a generated row is recorded in the suffix map),
  kept only where the adapter captures it (`ModelAdapter.capturable`);
- prefills (padded to a multiple of `PREFILL_BUCKET` rows, where the family captures them): a prefill's rows
  depend on the prompt, so what is covered is bounded by arguments: first turns of 1 to ``prompt_tokens``
  prefilled rows with answers of ``max_new_tokens`` (each such first turn's padded shape at the slot bucket
  and storage it runs at: a storage is sized for the whole prompt, deferred rows included, so with a mode that
  defers every storage from the prefilled rows' own up to the one a ``prompt_tokens`` prompt takes), and
  follow-up turns of up to ``follow_up_tokens`` rows (leftover deferred rows included) at every slot bucket.
  Longer follow-ups, first turns beyond ``prompt_tokens`` or whose answer limit puts them in another storage,
  are captured when they first run, as without `warm_up`. Qwen3.5's prefills carrying leftover deferred rows
  run eagerly (never captured).

The vision tower is warmed for the image sizes given (``image_sizes``, with the processor): the grid the
processor makes of each is encoded twice, so its graph is captured; so is the selector's graph for a prompt of one
such image with questions of up to `TEXT_ALLOWANCE` text rows (a greedy selector on CUDA: one graph per image size
and question-length bucket; several pictures of one size in a prompt are selected together, a shape of its own,
captured when first met).

With ``batch`` the batched engine's steps (`fast.batched_graphs`: `generate` with a batch, the server's
``--batching``) are captured too, on the model's kept batched pool sized for ``batch`` sequences of ``max_tokens``
rows: `BatchedStepGraphs.warm_keys` lists the keys, from the same rules the steps take them by (`batch_bucket`,
`width_bucket`, `slot_bucket`; a prompt piece alone, `prefill_width`), and each is
captured on padding-only buffers (nothing stored, no state moved).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from .cache_utils import DEFERRED, GENERATED, INPUT
from .configuration import CHUNK_LADDER, RaincheckConfig

DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_FOLLOW_UP_TOKENS = 64
TEXT_ALLOWANCE = 256  # prompt rows besides the images, when ``prompt_tokens`` is derived from ``image_sizes``


@dataclass
class WarmUpSummary:
    """What `warm_up` did.

    Attributes:
        path: ``"fast"`` (the CUDA fast path's graphs) or ``"eager"`` (nothing to capture: a CPU model, the
            eager engine, an accelerate-split model).
        graphs: whether the steps are captured as CUDA graphs on this model (False: nothing was captured).
        captured: ``(capacity, rows, want_logits, variant, bucket, seconds)`` per step graph captured now.
        already_captured: step keys that were captured before this call (an earlier `warm_up` or conversation).
        not_captured: step keys that this storage runs eagerly (not capturable, no room), or whose capture failed.
        vision: ``(grid, seconds)`` per image grid whose tower graph was captured now.
        vision_failure: why the vision tower's capture failed (a warning says so too; the tower then runs eagerly on
            this model), or None.
        capacities: the slot-storage capacities warmed (kept in the model's pool from now on).
        seconds: wall seconds of the whole call.
        persistent_cache: the cache folder in use (`persist.enable_persistent_caches`), or None.
        coverage: what is and is not covered, in words.
        compiled_ahead: autotuned Triton kernels' configurations compiled on threads beside the autotuner
            (`fast.autotune_ahead`; on a cache that already holds them, none).
    """

    path: str
    graphs: bool = False
    captured: list = field(default_factory=list)
    already_captured: int = 0
    not_captured: int = 0
    vision: list = field(default_factory=list)
    capacities: list = field(default_factory=list)
    seconds: float = 0.0
    persistent_cache: str | None = None
    coverage: str = ""
    batched: int = 0  # batched decode-step graphs captured now (``batch``: `fast.batched_graphs`)
    batched_already: int = 0  # batched decode-step keys captured before this call
    batched_seconds: float = 0.0
    selection: list = field(default_factory=list)  # (visual tokens, text rows, seconds) per selection graph captured
    first_turn: bool = False  # only what a first turn within the bounds needs (``first_turn=True``)
    stopped: bool = False  # ``stop`` was set before every capture was made (a later call goes on from there)
    vision_failure: str | None = None  # why the vision tower's capture failed (it runs eagerly from then on), or None
    compiled_ahead: int = 0

    @property
    def capture_seconds(self) -> float:
        return float(sum(entry[-1] for entry in self.captured) + sum(s for _, s in self.vision)
                     + sum(entry[-1] for entry in self.selection))

    def __str__(self) -> str:
        batched = (f", {self.batched} batched steps ({self.batched_already} already were, "
                   f"{self.batched_seconds:.1f} s)" if self.batched or self.batched_already else "")
        if not self.graphs and not batched:
            return f"warm-up: nothing to capture ({self.coverage}); {self.seconds:.2f} s"
        failed = (f" (the vision tower's capture failed, it runs eagerly: {self.vision_failure})"
                  if self.vision_failure else "")
        return (f"warm-up: {len(self.captured)} step graphs captured ({self.already_captured} already were, "
                f"{self.not_captured} run eagerly) on {len(self.capacities)} slot storages "
                f"({', '.join(map(str, self.capacities))} slots), {len(self.vision)} vision grids{failed}, "
                f"{len(self.selection)} selection graphs{batched}; "
                f"{self.seconds:.1f} s")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"warm_up: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_sizes(image_sizes) -> list[tuple[int, int]]:
    if image_sizes is None:
        return []
    try:
        sizes = [tuple(size) for size in image_sizes]
    except TypeError:
        raise ValueError(f"warm_up: image_sizes must be a list of (height, width) pairs, got {image_sizes!r}") from None
    for size in sizes:
        if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size):
            raise ValueError(f"warm_up: image_sizes must hold (height, width) pairs of ints >= 1, got {size!r}")
    return sizes


# ---- the step keys a conversation can need ------------------------------------------------------

def capacities(max_tokens: int) -> list[int]:
    """The slot-storage capacities a conversation of at most ``max_tokens`` rows can use (`round_capacity`'s
    ladder)."""
    from .fast.static_cache import SLOT_ROUNDING, round_capacity

    out, capacity = [], SLOT_ROUNDING
    while capacity <= round_capacity(max_tokens):
        out.append(capacity)
        capacity *= 2
    return out


def buckets(capacity: int) -> list[int]:
    """Every slot bucket (`slot_bucket`) a step on a storage of ``capacity`` slots can attend over."""
    from .fast.static_cache import slot_bucket

    return sorted({slot_bucket(rows, capacity) for rows in range(1, capacity + 1)})


def _variants(adapter, kinds: list[int], pendings, suffixes, rows: int | None = None) -> list:
    """The adapter's step variants for rows of ``kinds`` over the pending counts and suffix lengths given,
    those it captures at ``rows`` rows (padding included; default ``len(kinds)``) only."""
    rows = len(kinds) if rows is None else rows
    kinds_t = torch.tensor(kinds, dtype=torch.int8)
    out = []
    for pending_after in pendings:
        for suffix in suffixes:
            variant = adapter.static_step_variant(kinds_t, pending_after, suffix)
            if variant not in out and adapter.capturable(variant, rows):
                out.append(variant)
    return out


def _suffixes(adapter, max_tokens: int) -> range:
    """The suffix lengths (generated rows since a turn's input) to probe the variants over. A family's variant
    depends on the suffix length only up to its conv window (Qwen3.5: ``linear_conv_kernel_dim - 1``); probing
    up to twice that (and at least 16) finds every value a threshold there gives, without probing every length."""
    width = int(getattr(adapter.text_model.config, "linear_conv_kernel_dim", 0) or 0)
    return range(0, min(max_tokens, max(16, 2 * width)) + 1)


def step_keys(adapter, config: RaincheckConfig, *, max_tokens: int, max_new_tokens: int, prompt_tokens: int,
              follow_up_tokens: int, pad_prefill: bool, first_turn=None) -> dict[int, list[tuple]]:
    """Capacity -> ``[(StepKey, prefill)]``: the step shapes a conversation within the bounds can run on a storage
    of that capacity (see the module docstring). ``pad_prefill``: the family's prefills are padded and captured.
    ``first_turn``: None (every turn), or the prefilled row counts a first turn can have (a collection of ints):
    only what such a turn with a prompt of ``prompt_tokens`` rows needs and its conversation's later turns on the
    same storage, i.e. the storage that prompt and its answer take (`first_turn_capacity`) with its decode / chunk /
    idle-time steps at every slot bucket from the fewest rows such a turn prefills on (a conversation's slots only
    grow), the prefills of those row counts and the follow-ups' on it."""
    from .fast import graphs
    from .fast.static_cache import round_capacity, slot_bucket

    StepKey, bucket_rows = graphs.StepKey, graphs.PREFILL_BUCKET
    pendings = (0, 1) if config.defers else (0,)
    suffixes = _suffixes(adapter, max_tokens)
    # (rows, logits, kinds, the least suffix length it runs at): decode forward i runs after i - 1 generated rows,
    # and a chunk rides along from forward ``decode_guard`` on (`generation.chunk_size_for_forward`)
    shapes = [(1, True, [GENERATED], 0)]  # every mode decodes
    chunks = CHUNK_LADDER if config.auto_chunk else (config.chunk_size,)
    guarded = max(config.decode_guard, 1) - 1
    if config.mode == "raincheck":
        shapes += [(c + 1, True, [DEFERRED] * c + [GENERATED], guarded) for c in chunks]
    elif config.mode == "serial":
        shapes += [(c, False, [DEFERRED] * c, guarded) for c in chunks]
    if config.defers:
        c = config.idle_chunk_size
        shapes.append((c, False, [DEFERRED] * c, 0))
    steps = []
    for rows, want_logits, kinds, least in dict.fromkeys((r, w, tuple(k), m) for r, w, k, m in shapes):
        for variant in _variants(adapter, list(kinds), pendings, [t for t in suffixes if t >= least] or [least]):
            if (rows, want_logits, variant) not in steps:
                steps.append((rows, want_logits, variant))
    caps = capacities(max_tokens)
    if first_turn is not None:
        caps = [first_turn_capacity(prompt_tokens, max_new_tokens, max_tokens)]

    def reached(capacity: int) -> list[int]:
        # a conversation's slots only grow: after a first turn's prefill of n rows its steps attend over n or more
        # slots, so the buckets below the fewest rows it can prefill serve no step of its storage's conversation
        # (another conversation on that storage later, a short text prompt say, gets them from a later warm-up)
        low = 1 if first_turn is None else slot_bucket(min(first_turn, default=1), capacity)
        return [bucket for bucket in buckets(capacity) if bucket >= low]

    out: dict[int, list[tuple]] = {c: [] for c in caps}
    for capacity in caps:
        for bucket in reached(capacity):
            out[capacity] += [(StepKey(rows, w, v, bucket), False) for rows, w, v in steps]
    if not pad_prefill:
        return out

    def padded(n: int) -> int:
        return n if n == 1 else -(-n // bucket_rows) * bucket_rows

    def prefill_variants(kinds: list[int]) -> list:
        return _variants(adapter, kinds, pendings, (0,), rows=padded(len(kinds)))  # a prefill resets the suffix

    # first turns: n prefilled rows at the bucket of n rows, on the storage sized for the whole prompt and the answer
    # (`generation`'s rows_needed): round_capacity(n + answer) when nothing is deferred, and with deferred rows (stored
    # later, so counted now) any larger storage up to the one the longest prompt takes
    largest = round_capacity(prompt_tokens + max_new_tokens)
    seen = set()
    for n in (range(1, prompt_tokens + 1) if first_turn is None else sorted(first_turn)):
        rows = padded(n)
        least = round_capacity(n + max_new_tokens)
        for capacity in (c for c in caps if least <= c <= (largest if config.defers else least)):
            bucket = slot_bucket(n, capacity)
            if (rows, bucket, capacity) in seen:
                continue
            seen.add((rows, bucket, capacity))
            for variant in prefill_variants([INPUT] * n):
                key = (StepKey(rows, True, variant, bucket), rows > 1)
                if key not in out[capacity]:
                    out[capacity].append(key)
    # follow-ups of up to follow_up_tokens rows (a first turn's plan too: its conversation holds that storage from
    # then on, so a later warm-up cannot capture on it) (a text question, the last answer's final token, leftover deferred
    # rows in front), after at least one earlier row, at every bucket
    for n_rows in range(bucket_rows, padded(follow_up_tokens) + 1, bucket_rows):
        kinds_seen = []
        for n in (max(n_rows - bucket_rows + 1, 2), n_rows):  # (one row is not padded: a decode-like step)
            for leftovers in dict.fromkeys((0, 1, n // 2, n - 1)):  # at least one input row follows them
                kinds_seen.append([DEFERRED] * leftovers + [INPUT] * (n - leftovers))
        variants = []
        for kinds in kinds_seen:
            variants += [v for v in prefill_variants(kinds) if v not in variants]
        for capacity in caps:
            for bucket in reached(capacity):
                if bucket < slot_bucket(n_rows - bucket_rows + 2, capacity):
                    continue  # no follow-up of this size (after at least one row) attends over so few slots
                for variant in variants:
                    key = (StepKey(n_rows, True, variant, bucket), True)
                    if key not in out[capacity]:
                        out[capacity].append(key)
    return out


def first_turn_capacity(prompt_tokens: int, max_new_tokens: int, max_tokens: int) -> int:
    """The slot storage a first turn of ``prompt_tokens`` prompt rows (deferred ones included: they are stored later)
    and an answer of ``max_new_tokens`` starts on (`round_capacity`), within the storages of ``max_tokens``."""
    from .fast.static_cache import round_capacity

    return min(round_capacity(prompt_tokens + max_new_tokens), capacities(max_tokens)[-1])


def first_turn_rows(config: RaincheckConfig, visual_tokens: list[int], prompt_tokens: int) -> list[int]:
    """The prefilled row counts of a first turn (`step_keys`' ``first_turn``): with images of ``visual_tokens``
    tokens each (one a prompt), the tokens the config selects of it (every one in ``full`` mode) plus 1 to
    `TEXT_ALLOWANCE` rows of text; without images, 1 to ``prompt_tokens``; never more than ``prompt_tokens``."""
    from .selection.base import keep_count

    if not visual_tokens or isinstance(config.selector, torch.Tensor):  # (a keep-mask: its own count)
        return list(range(1, prompt_tokens + 1))
    rows = set()
    for tokens in visual_tokens:
        kept = tokens if config.mode == "full" else keep_count(config.retention, tokens)
        rows.update(range(kept + 1, min(kept + TEXT_ALLOWANCE, prompt_tokens) + 1))
    return sorted(rows) or list(range(1, prompt_tokens + 1))


# ---- the call ----------------------------------------------------------------------------------

def _bar(total: int, progress: bool, desc: str):
    from tqdm.auto import tqdm  # a dependency of transformers

    return tqdm(total=total, desc=desc, unit="graph", disable=not progress, file=sys.stderr, leave=True)


def warm_up(model, processor=None, config: RaincheckConfig | dict | None = None, *,
            max_tokens: int = DEFAULT_MAX_TOKENS, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
            prompt_tokens: int | None = None, follow_up_tokens: int = DEFAULT_FOLLOW_UP_TOKENS,
            image_sizes=None, conversations: int = 1, cache_dir=None, progress: bool = True,
            batch: int | None = None, first_turn: bool = False, stop=None) -> WarmUpSummary:
    """Pay the one-time costs that a conversation within the given bounds can need before its first answer.

    On the CUDA fast path this captures every step graph such a conversation can run (decode, fused chunk,
    idle-time chunk and padded prefill steps, at every slot bucket of every slot storage it can use), which also
    compiles the steps (``compile_steps``) and autotunes their Triton / fla kernels, and the vision tower's graph
    for each of ``image_sizes``. The captures land on the model's pooled slot storages, kept from now on, so
    later conversations replay them: their `RaincheckTrace.captures` stay empty. Nothing else about an answer
    changes (the same graphs would be captured by the first forward that needs them). On the eager engine (a
    CPU, ``fast_path=False``, an accelerate-split model) there is nothing to capture and it returns at once.

    What a prompt's prefill needs depends on its length: see the module docstring (`raincheck_hf.warmup`) for
    what the bounds below cover and what they do not.

    Args:
        model: a supported model, enabled with `raincheck_hf.enable`.
        processor: its processor; needed for ``image_sizes`` (the image processor makes their grids).
        config: the `RaincheckConfig` (or dict) the conversations will use (default `RaincheckConfig()`): its
            mode, chunk size (``"auto"``: every ladder size), ``compile_steps`` and ``fast_path`` decide the shapes.
        max_tokens: the most rows a conversation holds (prompts, images and answers of all its turns).
        max_new_tokens: the answer limit of the first turn (it decides the storage a first turn starts on).
        prompt_tokens: first-turn prompts of up to this many prefilled rows are covered (default: the largest
            image of ``image_sizes`` plus 256 rows of text, else 256).
        follow_up_tokens: follow-up turns of up to this many new rows (leftover deferred rows included) are
            covered at every slot bucket.
        image_sizes: ``(height, width)`` pixel sizes of the images to warm the vision tower for.
        conversations: how many conversations may hold a slot storage of one size at once (each live
            conversation's cache leases a storage of its own, with its own graphs; a server keeps a conversation's
            cache between its requests): that many storages per size are warmed. 0: none (with ``batch``, only the
            batched steps: what the server's ``--batching`` runs, every turn in the batched engine).
        cache_dir: the persistent cache folder for a model on CUDA (`persist.enable_persistent_caches`: Triton's
            kernels and autotuning results, torch's compile artifacts): a path, None (the default:
            ``RAINCHECK_CACHE_DIR`` or the user's cache folder), or False (none). Call
            `persist.enable_persistent_caches` yourself before loading the model so that kernels compiled while it
            loads are cached too.
        progress: show a progress bar on stderr.
        batch: also capture the batched engine's decode steps (`generate` with a batch, the server's
            ``--batching``) for up to this many sequences at once, each of up to ``max_tokens`` rows: every step
            key such a batch can take with ``config`` (`fast.batched_graphs.BatchedStepGraphs.warm_keys`: batch
            buckets, chunk widths, slot spans, the prompt pieces' prefill widths),
            captured on the model's kept batched pool, sized for them from now
            on (no later growth drops its graphs); a ValueError, before any compute, where that pool's keys and values
            would not fit the device's free memory (`fast.batched_graphs.check_pool_fits`). None (default): not
            warmed; they are captured when they first run.
        first_turn: only what a first turn needs before its answer (a prompt of ``prompt_tokens`` rows, by default
            an image of ``image_sizes`` and its question, and its answer of ``max_new_tokens``): its slot storage's
            steps at every slot bucket, the prefills such a prompt takes on it, the vision tower's and the
            selection's graphs; not the other storages nor the follow-ups' prefills, which a later call captures
            (the same call without ``first_turn``, or an `IdleWarmUp` in idle time: it skips what is captured).
            The single-sequence steps only (with ``batch``: a ValueError).
        stop: a ``threading.Event``; once set, the call returns before its next capture (``stopped`` in the
            summary): what `IdleWarmUp` pauses with. None: every capture is made.

    Returns:
        A `WarmUpSummary` (what was captured, in how many seconds; ``str()`` gives a one-line account).

    Raises:
        ValueError: a bad argument, naming it and its value, before any compute.
    """
    from .fast.autotune_ahead import compiling_configs_ahead
    from .integration import is_enabled
    from .models import get_adapter

    started = time.perf_counter()
    # every argument is checked before anything runs
    if isinstance(config, dict):
        config = RaincheckConfig(**config)
    elif config is None:
        config = RaincheckConfig()
    elif not isinstance(config, RaincheckConfig):
        raise ValueError(f"warm_up: config must be a RaincheckConfig, a dict or None, got {type(config).__name__}")
    max_tokens = _check_int("max_tokens", max_tokens, 1)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    follow_up_tokens = _check_int("follow_up_tokens", follow_up_tokens, 1)
    conversations = _check_int("conversations", conversations, 0)
    if batch is not None:
        batch = _check_int("batch", batch, 1)
    sizes = _check_sizes(image_sizes)
    if sizes and processor is None:
        raise ValueError(f"warm_up: image_sizes={image_sizes!r} needs the model's processor (processor=None)")
    if prompt_tokens is not None:
        prompt_tokens = _check_int("prompt_tokens", prompt_tokens, 1)
    if max_new_tokens >= max_tokens:
        raise ValueError(f"warm_up: max_new_tokens ({max_new_tokens}) must be below max_tokens ({max_tokens})")
    if not isinstance(progress, bool):
        raise ValueError(f"warm_up: progress must be True or False, got {progress!r}")
    if not isinstance(first_turn, bool):
        raise ValueError(f"warm_up: first_turn must be True or False, got {first_turn!r}")
    if first_turn and batch is not None:
        raise ValueError(f"warm_up: first_turn=True warms a conversation's first turn; batch={batch!r} warms the "
                         "batched engine's steps (call it without first_turn)")
    if stop is not None and not (callable(getattr(stop, "is_set", None))):
        raise ValueError(f"warm_up: stop must be a threading.Event (or None), got {stop!r}")
    if cache_dir is not None and cache_dir is not False and not isinstance(cache_dir, (str, bytes)) \
            and not hasattr(cache_dir, "__fspath__"):
        raise ValueError(f"warm_up: cache_dir must be a path, None or False, got {cache_dir!r}")
    adapter = get_adapter(model)  # a ValueError naming the supported classes
    if not is_enabled(model):
        raise ValueError(f"warm_up: {type(model).__name__} is not enabled: call raincheck_hf.enable(model) first")
    if batch is not None:  # (a batched pool the device cannot hold: said now, not as out-of-memory errors later)
        from .fast import batched_graphs

        if batched_graphs.resolve_graphs(adapter, config, None):
            try:
                batched_graphs.check_pool_fits(adapter, batch, max_tokens)
            except batched_graphs.PoolTooLarge as error:
                raise batched_graphs.PoolTooLarge(f"warm_up(batch={batch}, max_tokens={max_tokens}): {error}") from None

    summary = WarmUpSummary(path=adapter.execution_path(config), first_turn=first_turn)
    persistent = cache_dir is not False and adapter.device.type == "cuda"  # Triton / Inductor compile on CUDA
    if persistent:
        from .persist import enable_persistent_caches

        summary.persistent_cache = str(enable_persistent_caches(cache_dir).root)

    grids = _image_grids(processor, sizes) if sizes else []
    if prompt_tokens is None:
        prompt_tokens = (max(tokens for _, tokens in grids) + TEXT_ALLOWANCE) if grids else TEXT_ALLOWANCE
    prompt_tokens = min(prompt_tokens, max_tokens - max_new_tokens)

    # (an autotuned kernel's configurations compiled side by side the first time it is tuned: what a first start pays)
    with torch.no_grad(), compiling_configs_ahead(enabled=adapter.device.type == "cuda") as ahead:
        if grids and adapter.use_vision_graphs(config):
            _warm_vision(adapter, grids, summary)
        if grids and summary.path == "fast" and adapter.device.type == "cuda":
            _warm_selection(adapter, config, grids, summary)
        if summary.path == "fast" and conversations:
            rows = first_turn_rows(config, [tokens for _, tokens in grids], prompt_tokens) if first_turn else None
            _warm_steps(adapter, config, summary, max_tokens=max_tokens, max_new_tokens=max_new_tokens,
                        prompt_tokens=prompt_tokens, follow_up_tokens=follow_up_tokens, conversations=conversations,
                        progress=progress, first_turn=rows, stop=stop)
        if batch is not None:
            _warm_batched(adapter, config, summary, batch=batch, max_tokens=max_tokens, progress=progress)
    summary.compiled_ahead = 0 if ahead is None else ahead.submitted
    parts = []  # (conversations=0: the single-sequence steps were not asked for)
    if conversations and summary.graphs and first_turn:
        parts.append(f"a first turn of up to {prompt_tokens} prompt rows with an answer of up to {max_new_tokens} "
                     f"tokens (its storage of {first_turn_capacity(prompt_tokens, max_new_tokens, max_tokens)} "
                     "slots); the rest of the conversation's steps not yet")
    elif conversations and summary.graphs:
        parts.append(f"conversations of up to {max_tokens} rows: every decode / chunk step; first-turn prefills of up "
                     f"to {prompt_tokens} rows with answers of up to {max_new_tokens} tokens; follow-ups of up to "
                     f"{follow_up_tokens} new rows")
    elif conversations and summary.path == "fast":
        parts.append("the fast path's steps run without CUDA graphs on this model")
    elif conversations:
        parts.append("the eager engine runs this model")
    if batch is not None:
        parts.append(f"batched steps of up to {batch} sequences of up to {max_tokens} rows"
                     if summary.batched or summary.batched_already else "no batched step to capture")
    if summary.stopped:
        parts.append("stopped before every capture was made")
    summary.coverage = "; ".join(parts)
    if persistent and (summary.graphs or summary.batched):
        from .persist import save_compile_artifacts

        save_compile_artifacts(cache_dir)
    summary.seconds = time.perf_counter() - started
    return summary


class IdleWarmUp:
    """The rest of a warm-up, captured in idle time on a thread of its own.

    After ``warm_up(..., first_turn=True)`` captured what a first answer needs, `resume` starts (or goes on with) the
    same call without ``first_turn`` in the background, and `pause` stops it before its next capture and waits for
    the one under way (a fraction of a second). Pause it while an answer runs and resume it while nothing does (a
    chat waiting for the next question), so that no capture competes with an answer; each call skips what is
    captured already, so pausing loses nothing. `finish` captures what is left in the calling thread. The
    `raincheck_hf` CLI's chat does this.

    Args:
        model, processor, config: as for `warm_up`.
        **kwargs: `warm_up`'s other keyword arguments (its bounds, ``image_sizes``, ``conversations``,
            ``cache_dir``), the ones the first-turn call had; not ``first_turn``, ``stop`` or ``batch``.

    Attributes:
        summaries: each background or `finish` call's `WarmUpSummary`, in order.
        done: nothing is left to capture (or a call failed: ``error``; it is not tried again).
        error: the exception a call raised, or None (a background call's is kept here, not raised).
    """

    def __init__(self, model, processor=None, config=None, **kwargs):
        for name in ("first_turn", "stop", "batch", "progress"):
            if name in kwargs:
                raise ValueError(f"IdleWarmUp takes warm_up's bounds; {name}= is its own to set, got {kwargs[name]!r}")
        self.model, self.processor, self.config, self.kwargs = model, processor, config, kwargs
        self.summaries: list[WarmUpSummary] = []
        self.done = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # (resume / pause / finish from several threads: one at a time)

    def _call(self, stop, progress: bool) -> None:
        try:
            summary = warm_up(self.model, self.processor, self.config, stop=stop, progress=progress, **self.kwargs)
        except BaseException as error:  # (a background call's error is kept and said, not lost in its thread)
            self.error, self.done = error, True
            if stop is not None:
                warnings.warn(f"raincheck_hf: the idle-time warm-up failed ({type(error).__name__}: {error}); the "
                              "graphs it did not capture are captured when an answer first needs them.",
                              RuntimeWarning, stacklevel=1)
            return
        self.summaries.append(summary)
        self.done = not summary.stopped

    def resume(self) -> None:
        """Capture what is left on a background thread (nothing if all is done or it runs already)."""
        with self._lock:
            if self.done or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._call, args=(self._stop, False), daemon=True,
                                            name="raincheck-idle-warm-up")
            self._thread.start()

    def pause(self) -> None:
        """Stop the background captures before the next one and wait for the one under way."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the background call to end without stopping it; whether all is done
        (False also while it still runs, or after a pause left some)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.done

    def finish(self, progress: bool = True) -> WarmUpSummary | None:
        """Capture what is left now, in the calling thread (the background call paused first); its summary, or None
        when nothing was left. A failure raises here."""
        self.pause()
        if self.done:
            return None
        self._call(None, progress)
        if self.error is not None:
            raise self.error
        return self.summaries[-1]

    @contextlib.contextmanager
    def paused(self):
        """The block runs with the background captures paused; they resume after it (unless all is done)."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    @property
    def captured(self) -> int:
        """Step graphs the calls captured so far."""
        return sum(len(s.captured) for s in self.summaries)


def _image_grids(processor, sizes) -> list[tuple[dict, int]]:
    """``(inputs, visual tokens)`` per image size: the processor's ``pixel_values`` / ``image_grid_thw``."""
    from .tiny import draw_test_image

    image_processor = getattr(processor, "image_processor", processor)
    out = []
    for height, width in sizes:
        inputs = image_processor(images=[draw_test_image(width, height, seed=0)], return_tensors="pt")
        grid = inputs["image_grid_thw"]
        merge = int(getattr(image_processor, "merge_size", 2))
        out.append(({"pixel_values": inputs["pixel_values"], "image_grid_thw": grid},
                    int(grid.prod(-1).sum()) // merge ** 2))
    return out


def _warm_vision(adapter, grids, summary: WarmUpSummary) -> None:
    from .fast.vision_graphs import vision_graphs_for

    vision = vision_graphs_for(adapter)
    for inputs, _ in grids:
        grid = tuple(tuple(int(v) for v in row) for row in inputs["image_grid_thw"].tolist())
        before = len(vision._captured)
        started = time.perf_counter()
        # captured on its second sighting (`vision_graphs.CAPTURE_ON_SIGHTING`): encode until it is, at most that often
        from .fast.vision_graphs import CAPTURE_ON_SIGHTING

        for _ in range(CAPTURE_ON_SIGHTING):
            vision.encode(inputs["pixel_values"], inputs["image_grid_thw"])
            if len(vision._captured) > before:
                break
        if vision.use_graphs and len(vision._captured) > before:
            summary.vision.append((grid, time.perf_counter() - started))
        elif vision.failure is not None:
            summary.vision_failure = vision.failure


def _warm_selection(adapter, config: RaincheckConfig, grids, summary: WarmUpSummary) -> None:
    """The selector's graphs for each image of ``grids``: a greedy selector on CUDA replays one graph per method,
    ``k`` and input shape (`selection.kernels.greedy_select`), captured the first time a prompt needs it, and its
    inputs' shape depends on the image's visual tokens and on the question's text rows (`mmtok` pads those to a
    multiple of `selection.mmtok.TEXT_BUCKET`). Each image's selection runs here on stand-in features of its shape
    with questions of every bucket up to `TEXT_ALLOWANCE` rows, through the selector's own `select` (the shapes are
    the ones a prompt's selection takes, not a list kept here), at most `selection.kernels.MAX_GRAPHS` of them (what
    the kernels keep). Nothing to do for a mode that selects nothing or a selector without graphs."""
    from .selection.base import GreedySelector, Segment, SelectionContext, keep_count
    from .selection.kernels import MAX_GRAPHS, captured_shapes, triton_available
    from .selection.mmtok import TEXT_BUCKET

    if config.mode == "full" or config.retention >= 1.0 or isinstance(config.selector, torch.Tensor):
        return
    selector = config.build_selector()
    if not isinstance(selector, GreedySelector) or config.fast_path is False or not triton_available():
        return
    hidden = int(adapter.text_model.embed_tokens.weight.shape[-1])
    generator = torch.Generator().manual_seed(0)

    def stand_in(rows: int) -> torch.Tensor:
        return torch.randn(rows, hidden, generator=generator).to(device=adapter.device, dtype=adapter.dtype)

    segments = [Segment(0, "image", stand_in(tokens), (1, 1, tokens), torch.arange(tokens))
                for tokens in dict.fromkeys(t for _, t in grids)
                if 0 < keep_count(config.retention, tokens) < tokens]
    # the longest questions first: the kernels keep `MAX_GRAPHS` shapes, the least recently used evicted, so that
    # with many sizes the short questions' graphs (the common ones) are the ones kept
    for text_rows in range(TEXT_ALLOWANCE, 0, -TEXT_BUCKET):
        for segment in segments:
            if len(summary.selection) >= MAX_GRAPHS:
                return
            before, started = captured_shapes(), time.perf_counter()
            context = SelectionContext(text_embeds=stand_in(text_rows), model=adapter.model,
                                       extras={"turn": None, "vision_captures": None, "fast_path": config.fast_path})
            selector.select([segment], config.retention, context)
            if captured_shapes() - before:
                summary.selection.append((segment.num_tokens, text_rows, time.perf_counter() - started))


def _batched_captures(graphs) -> bool:
    """Whether ``graphs`` (a `fast.batched_graphs.BatchedStepGraphs`) captures CUDA graphs (elsewhere its steps run
    eagerly on their buffers: nothing to pay ahead)."""
    return graphs.use_cuda


def _warm_batched(adapter, config: RaincheckConfig, summary: WarmUpSummary, *, batch: int, max_tokens: int,
                  progress: bool) -> None:
    """`warm_up`'s ``batch``: the model's kept batched pool (`batched_graphs.acquire`) sized for ``batch`` sequences of
    ``max_tokens`` rows, its decode-step keys captured (`BatchedStepGraphs.warm`), and the pool given back for the
    model's next `BatchEngine`."""
    from .batch_engine import SPLIT_ROWS, split_batches
    from .fast import batched_graphs

    if not batched_graphs.resolve_graphs(adapter, config, None):
        return  # (the eager batched engine: nothing to capture)
    # (the wide halves of steps split by width, as the engines' default rule splits them)
    split = split_batches(batch, batched_graphs.split_width(config), SPLIT_ROWS)
    graphs = batched_graphs.acquire(adapter, adapter.text_model.config.num_hidden_layers, batch, max_tokens)
    bar = None
    try:
        if not _batched_captures(graphs):
            return
        keys = graphs.warm_keys(config, batch, split)
        summary.batched_already = sum(1 for key in keys if key in graphs._captured)
        bar = _bar(len(keys) - summary.batched_already, progress, "raincheck batched warm-up")
        started = time.perf_counter()
        summary.batched = graphs.warm(config, batch, on_capture=lambda i, total: bar.update(1), split_batches=split)
        summary.batched_seconds = time.perf_counter() - started
    finally:
        if bar is not None:
            bar.close()
        batched_graphs.release(graphs)


def _warm_steps(adapter, config: RaincheckConfig, summary: WarmUpSummary, *, max_tokens, max_new_tokens,
                prompt_tokens, follow_up_tokens, conversations, progress, first_turn=None, stop=None) -> None:
    """Capture `step_keys`' steps on pooled storages. The first turn's storage first (`first_turn_capacity`), then
    the larger ones a conversation grows into, then the smaller ones (shorter prompts): what a conversation needs
    soonest is captured first, which matters when ``stop`` ends the call early."""
    from .fast.compiled import resolve_compile_steps
    from .fast.graphs import scratch_slots
    from .fast.static_cache import StaticDeferredCache, keep_storage, kept_in_use
    from .fast.runner import StaticRunner

    scratch = max(scratch_slots(config.max_chunk_size), scratch_slots(config.idle_chunk_size))
    layers = adapter.text_model.config.num_hidden_layers
    recurrent = adapter.static_recurrent_layout()
    plan = None
    bar = None
    first = first_turn_capacity(prompt_tokens, max_new_tokens, max_tokens)
    order = sorted(capacities(max_tokens), key=lambda c: (c < first, c if c >= first else -c))
    stopping = (lambda: False) if stop is None else stop.is_set
    try:
        for capacity in order:
            if plan is not None and capacity not in plan:  # (a first turn's plan: its storage only)
                continue
            if stopping():
                summary.stopped = True
                break
            # the storages conversations of this size lease (`runner.open_runner`), kept in the pool; held
            # together, so each of them is another storage. Kept ones a live conversation holds count among them
            # (nothing can be captured on those now, and another beside them would serve no conversation)
            held = kept_in_use(adapter.text_model, layers, capacity, scratch, adapter.device, recurrent)
            caches = [StaticDeferredCache(layers, capacity, scratch, adapter.device, pool_key=adapter.text_model,
                                          recurrent=recurrent) for _ in range(max(0, conversations - held))]
            try:
                for cache in caches:
                    graphs = StaticRunner(adapter, cache).step_graphs  # the storage's graphs, made on first use
                    if not graphs.use_graphs:
                        return
                    summary.graphs = True
                    cache.compile_steps = resolve_compile_steps(config.compile_steps, graphs.use_graphs)
                    graphs._use_setting(adapter, cache)  # the graphs of this attention backend and compile setting
                    if plan is None:
                        plan = step_keys(adapter, config, max_tokens=max_tokens, max_new_tokens=max_new_tokens,
                                         prompt_tokens=prompt_tokens, follow_up_tokens=follow_up_tokens,
                                         pad_prefill=graphs.pad_prefill, first_turn=first_turn)
                        bar = _bar(sum(map(len, plan.values())) * conversations, progress, "raincheck warm-up")
                    if capacity not in plan:  # (a first turn's plan, its storage held by a conversation now)
                        break
                    keep_storage(adapter.text_model, cache.storage)
                    if capacity not in summary.capacities:
                        summary.capacities.append(capacity)
                    for key, prefill in plan[capacity]:
                        if key in graphs._captured:
                            summary.already_captured += 1
                        elif stopping():
                            summary.stopped = True
                            break
                        else:
                            # (timed replays after each capture only for chunk_size="auto", which weighs them)
                            seconds = graphs.warm(adapter, cache, key, prefill, timed=config.auto_chunk)
                            if seconds is None:
                                summary.not_captured += 1
                            else:
                                summary.captured.append((capacity, key.rows, key.want_logits, key.variant, key.bucket,
                                                         seconds))
                        bar.update(1)
                    if summary.stopped:
                        break
            finally:
                for cache in caches:  # (back to the pool, kept: the next lease of this size takes one)
                    cache.storage.release()
                del caches
                cache = None  # (no reference to a released storage's cache kept)
            if summary.stopped:
                break
    finally:
        summary.capacities.sort()
        if bar is not None:
            bar.close()
