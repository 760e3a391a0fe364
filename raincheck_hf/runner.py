"""The engine's two halves: the scheduler decides rows, a runner executes them.

`generation.ChunkScheduler` decides which rows a forward holds (the decode token, the chunk of deferred rows
that rides along with it, how big) and hands them over as `ForwardRows`; a `Runner` executes them on its
cache and answers what the scheduler may ask about execution (the measured step costs
``chunk_size="auto"`` weighs, whether a step would pause for a CUDA-graph capture, the room a turn needs).
The decoding loop (`generation.raincheck_sample`) talks to the `Runner` protocol only.

Two implementations:

- `EagerRunner` (here): a `DeferredDynamicCache` and the HF text model called eagerly with a 4-D
  visibility mask (`ModelAdapter.forward`). No preparation ahead, no step figures, no captures.
- `fast.runner.StaticRunner`: a `fast.static_cache.StaticDeferredCache` and its captured steps
  (`fast.graphs.StepGraphs`), the CUDA fast path.

Which one runs a call is decided once, where the cache is made (`open_runner`; `ModelAdapter.execution_path`
picks the engine for a new cache); an existing cache gets the runner of its kind (`runner_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .cache_utils import DeferredDynamicCache
from .fast.runner import StaticRunner
from .fast.static_cache import StaticDeferredCache
from .models.base import RowBatch


@dataclass
class ForwardRows:
    """One forward's rows, as the scheduler hands them to a runner.

    Attributes:
        batch: the rows' embeddings ``[n, D]``, 3-D positions ``[3, n]`` and DeepStack features.
        keys: ``[n]`` order keys (`cache_utils.order_key`): who sees whom.
        sources: ``[n]`` source positions.
        kinds: ``[n]`` int8 `cache_utils` row kinds (``INPUT`` / ``DEFERRED`` / ``GENERATED``); one kind given
            for every row is expanded.
        want_logits: return the logits of the last row.
        pad_to: pad the forward's deferred rows to this many (a chunk step's fixed shape, so that one captured
            graph serves every chunk of a size); None: unpadded. The eager runner ignores it.
    """

    batch: RowBatch
    keys: torch.Tensor
    sources: torch.Tensor
    kinds: torch.Tensor | int
    want_logits: bool
    pad_to: int | None = None

    def __post_init__(self):
        self.kinds = torch.as_tensor(self.kinds, dtype=torch.int8).expand(self.keys.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.batch.embeds.shape[0])


class CaptureWatch(Protocol):
    """The CUDA-graph captures a runner's forwards made since the last look."""

    def new(self, forward_index: int) -> list[tuple[int, int, float]]:
        """``(forward_index, rows, seconds)`` per capture made since the last call (`RaincheckTrace.captures`)."""


@runtime_checkable
class Runner(Protocol):
    """Executes the rows the scheduler decided, on one cache; answers what the scheduler may ask.

    Attributes:
        adapter: the model's `ModelAdapter`.
        cache: the `DeferredDynamicCache` (or subclass) the forwards write to.
    """

    adapter: object
    cache: DeferredDynamicCache

    def begin_call(self, config) -> None:
        """Settings of the `generate` call about to run its forwards here (`RaincheckConfig`)."""

    def reserve(self, rows: int, chunk_size: int) -> None:
        """Room for ``rows`` more rows, and padding for chunks of up to ``chunk_size`` rows."""

    def prepare(self, rows: ForwardRows) -> object | None:
        """The forward made ready ahead (its inputs written where it will read them) without touching the cache's
        bookkeeping, or None: nothing to do ahead. Give the result to `run` as ``prepared``; no other forward
        may run in between."""

    def run(self, rows: ForwardRows, prepared: object | None = None) -> torch.Tensor | None:
        """One forward over ``rows`` (``prepared``: from `prepare`); the logits ``[1, V]`` of its last real row
        when ``rows.want_logits``, else None."""

    def run_ahead(self, rows: ForwardRows, sources) -> torch.Tensor | None:
        """`run` for rows whose sources the host learns later: ``sources()`` returns them (``rows.sources`` is not
        read), called once, before the forward or after it was launched (the runner decides: after, where launching
        needs nothing from the host, as a captured step's replay)."""

    def step_figures(self, rows: int, want_logits: bool, real_rows: int | None = None, pending_after: int = 1):
        """What ``chunk_size="auto"`` may weigh about a ``rows``-row step run now (`fast.graphs.StepFigures`:
        its measured cost, whether it is captured where it would run, what its capture cost), measuring and
        capturing nothing; None: no figures (the step would run unmeasured)."""

    def capture_watch(self) -> CaptureWatch:
        """A watch over the captures this runner's forwards make from now on."""


class _NoCaptures:
    """The watch of a runner that captures nothing."""

    def new(self, forward_index: int) -> list[tuple[int, int, float]]:
        return []


class EagerRunner:
    """The eager engine: forwards on a `DeferredDynamicCache`, the HF text model called with a visibility mask."""

    def __init__(self, adapter, cache: DeferredDynamicCache):
        self.adapter = adapter
        self.cache = cache

    @classmethod
    def new(cls, adapter, text_config) -> "EagerRunner":
        """Over a new, empty `DeferredDynamicCache` (it grows as rows come)."""
        # adapter.device, not model.device: the latter is a parameter's device, `meta` under accelerate offload
        # (order keys must live where the masks are built)
        return cls(adapter, DeferredDynamicCache(config=text_config, device=adapter.device))

    def begin_call(self, config) -> None:
        return None

    def reserve(self, rows: int, chunk_size: int) -> None:
        return None  # the cache grows as rows come

    def prepare(self, rows: ForwardRows) -> None:
        return None

    def run(self, rows: ForwardRows, prepared: object | None = None) -> torch.Tensor | None:
        return self._forward(rows, rows.sources)

    def run_ahead(self, rows: ForwardRows, sources) -> torch.Tensor | None:
        return self._forward(rows, sources())  # the visibility comes from the rows' registration: sources first

    def _forward(self, rows: ForwardRows, sources: torch.Tensor) -> torch.Tensor | None:
        cache = self.cache
        visible = cache.add_rows(rows.keys, sources, rows.kinds)
        single_newest = rows.num_rows == 1 and bool(visible.all())
        return self.adapter.forward(cache, rows.batch, None if single_newest else visible, rows.want_logits,
                                    kinds=rows.kinds)

    def step_figures(self, rows: int, want_logits: bool, real_rows: int | None = None, pending_after: int = 1):
        return None  # nothing measured: "auto" takes its documented fallback

    def capture_watch(self) -> CaptureWatch:
        return _NoCaptures()


def runner_for(adapter, cache: DeferredDynamicCache) -> Runner:
    """The runner of an existing cache: the fast path's for a `StaticDeferredCache`, else the eager engine's."""
    if isinstance(cache, StaticDeferredCache):
        return StaticRunner(adapter, cache)
    if isinstance(cache, DeferredDynamicCache):
        return EagerRunner(adapter, cache)
    raise TypeError(f"no Raincheck runner for a {type(cache).__name__}: it runs forwards on a DeferredDynamicCache "
                    "(the `cache` a raincheck generate returns)")


def open_runner(model, adapter, given, config, rows_needed: int) -> Runner:
    """The runner of one `generate` call, ready for it: over ``given`` (a cache an earlier call returned), made room
    in for ``rows_needed`` more rows and padding for the call's chunk size (which may have grown since), or over a
    new cache of the engine `ModelAdapter.execution_path` picks (a static one sized for the turn, pooled per text
    model: a later conversation of the same size reuses its slots and captured steps). The one place a call's
    engine is chosen.

    Raises ValueError for a non-empty cache of another kind (Raincheck continues only its own).
    """
    if isinstance(given, DeferredDynamicCache):
        runner = runner_for(adapter, given)
        runner.reserve(rows_needed, config.max_chunk_size)
    elif given is not None and given.get_seq_length() > 0:
        raise ValueError(
            f"generate(raincheck=...) got a non-empty {type(given).__name__}; Raincheck continues only its own "
            "DeferredDynamicCache (the `cache` returned by an earlier raincheck generate)."
        )
    elif adapter.execution_path(config) == "fast":
        runner = StaticRunner.new(adapter, rows_needed, config.max_chunk_size)
    else:
        runner = EagerRunner.new(adapter, model.config.get_text_config())
    runner.begin_call(config)
    return runner
