"""`StaticRunner`: the fast path's runner (the `raincheck_hf.runner.Runner` protocol) over a `StaticDeferredCache`.

It executes the rows the scheduler decided with the cache's captured steps (`graphs.StepGraphs`, made on first
use and kept with the cache's slot storage), and answers the scheduler from them: the measured step costs and
capture state ``chunk_size="auto"`` weighs (`StepGraphs.step_figures`), the slots and scratch padding a turn
or a chunk size needs, the captures a call's forwards made (its trace).
"""

from __future__ import annotations

from . import graphs
from .compiled import resolve_compile_steps
from .static_cache import StaticDeferredCache, round_capacity


class _CaptureLog:
    """The captures made on one `StepGraphs` (its ``capture_log``) since the watch was made."""

    def __init__(self, step_graphs):
        self.graphs = step_graphs
        self.seen = 0 if step_graphs is None else len(step_graphs.capture_log)

    def new(self, forward_index: int) -> list[tuple[int, int, float]]:
        if self.graphs is None:
            return []
        log = self.graphs.capture_log
        made, self.seen = log[self.seen:], len(log)
        return [(forward_index, key.rows, seconds) for key, seconds in made]


class StaticRunner:
    """The fast path: forwards on a `StaticDeferredCache`, replayed from captured CUDA graphs where they can be
    (on a CPU, or where a shape is not captured, the same step runs eagerly on the static buffers)."""

    def __init__(self, adapter, cache: StaticDeferredCache):
        self.adapter = adapter
        self.cache = cache

    @classmethod
    def new(cls, adapter, rows: int, chunk_size: int) -> "StaticRunner":
        """Over a new `StaticDeferredCache` with room for ``rows`` rows and padding for chunks of ``chunk_size``,
        drawn from the text model's pool of slot storages (a later conversation of the same size reuses the slots
        and their captured steps)."""
        cache = StaticDeferredCache(adapter.text_model.config.num_hidden_layers, round_capacity(rows),
                                    graphs.scratch_slots(chunk_size), adapter.device, pool_key=adapter.text_model,
                                    recurrent=adapter.static_recurrent_layout())
        return cls(adapter, cache)

    @property
    def step_graphs(self) -> graphs.StepGraphs:
        """The cache's `StepGraphs` (the captured steps of its slot storage), made on first use."""
        cache = self.cache
        if cache.graphs is None:
            cache.graphs = graphs.StepGraphs(self.adapter, use_graphs=self.adapter.step_graph_blocker() is None)
        return cache.graphs

    def begin_call(self, config) -> None:
        cache = self.cache
        # its steps (and idle-time chunks after the call) run so; None: compiled when they are captured
        cache.compile_steps = resolve_compile_steps(config.compile_steps, self.step_graphs.use_graphs)
        cache.time_steps = config.auto_chunk  # replays are timed only for a call that schedules from them

    def reserve(self, rows: int, chunk_size: int) -> None:
        self.cache.ensure_capacity(self.cache.num_rows + rows, graphs.scratch_slots(chunk_size))

    def prepare(self, rows) -> graphs.PreparedStep | None:
        """The forward's captured graph with its buffers filled (`StepGraphs.prepare`), or None (not captured yet,
        no room, no graphs made yet: `run` then does it all)."""
        step_graphs = self.cache.graphs
        if step_graphs is None:
            return None
        return step_graphs.prepare(self.adapter, self.cache, rows.batch, rows.keys, rows.sources, rows.kinds,
                                   rows.want_logits, pad_to=rows.pad_to)

    def run(self, rows, prepared: graphs.PreparedStep | None = None):
        if prepared is not None:
            return self.cache.graphs.launch(self.cache, prepared)
        return self.step_graphs.run(self.adapter, self.cache, rows.batch, rows.keys, rows.sources, rows.kinds,
                                    rows.want_logits, pad_to=rows.pad_to)

    def run_ahead(self, rows, sources):
        """`run` for rows whose sources are known later (``sources()``; ``rows.sources`` unread): a replay is
        launched before they are asked for (`StepGraphs.run_ahead`)."""
        return self.step_graphs.run_ahead(self.adapter, self.cache, rows.batch, rows.keys, sources, rows.kinds,
                                          rows.want_logits, pad_to=rows.pad_to)

    def step_figures(self, rows: int, want_logits: bool, real_rows: int | None = None,
                     pending_after: int = 1) -> graphs.StepFigures | None:
        step_graphs = self.cache.graphs
        if step_graphs is None:
            return None  # nothing ran here yet: nothing measured
        return step_graphs.step_figures(self.adapter, self.cache, rows, want_logits, real_rows=real_rows,
                                        pending_after=pending_after)

    def capture_watch(self) -> _CaptureLog:
        return _CaptureLog(self.cache.graphs)
