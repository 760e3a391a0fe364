"""The server's Prometheus metrics, through `prometheus_client`, in a registry of each app's own (two apps
in one process, e.g. tests, count apart). The registry also has the client's process, platform and GC
collectors; held-conversation figures are read from the store at scrape time."""

from __future__ import annotations

# seconds; TTFT spans a tiny model on a CPU to a long video on a GPU, TPOT a few ms to a few hundred
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# how the batching loop's steps ran (`batch_engine.StepRecord.kind`; a step's several forwards join with "+": serial
# mode's chunk forward, prompt pieces beside a replayed decode step)
STEP_KINDS = ("replayed", "captured", "eager")


class _HeldConversations:
    """Collector of the store's figures (``snapshot``: `ConversationStore.snapshot`)."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        store = self.snapshot()
        yield CounterMetricFamily("raincheck_restored_after_answer",
                                  "Deferred tokens prefilled in idle time after answers.",
                                  value=store["restored_after_answer"])
        yield CounterMetricFamily("raincheck_evictions", "Conversations evicted to fit --max-cache-gb or to free "
                                  "device memory for answers.",
                                  value=store["evictions"])
        held = GaugeMetricFamily("raincheck_conversations", "Conversations held (busy: answering now).",
                                 labels=["state"])
        held.add_metric(["held"], store["conversations"])
        held.add_metric(["busy"], store["busy"])
        yield held
        yield GaugeMetricFamily("raincheck_cache_bytes", "Bytes of the held conversations' caches.",
                                value=store["cache_bytes"])
        if store["max_bytes"] is not None:  # (none: unbounded)
            yield GaugeMetricFamily("raincheck_cache_budget_bytes", "Budget of the held conversations' caches "
                                    "(--max-cache-gb; auto: what the GPU had left after the warm-up, less a "
                                    "reserve).", value=store["max_bytes"])
        yield GaugeMetricFamily("raincheck_pending_tokens", "Deferred tokens not yet restored, all held conversations.",
                                value=store["pending"])


class _Admission:
    """Collector of the admission control's figures (``snapshot``: `Admission.snapshot`)."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = self.snapshot()
        yield GaugeMetricFamily("raincheck_queue_length", "Requests waiting for a running place (being prepared "
                                "or queued; --max-queue bounds them).", value=now["queued"])
        yield GaugeMetricFamily("raincheck_running", "Turns holding a running place: generating (--max-running "
                                "bounds them).", value=now["running"])
        yield CounterMetricFamily("raincheck_rejected", "Requests refused with 429 because the running places "
                                  "and the queue were full.", value=now["rejected"])
        yield CounterMetricFamily("raincheck_queue_abandoned", "Queued requests whose client went away before "
                                  "they got a running place.", value=now["abandoned"])


class Metrics:
    """Counters of requests and finished turns, TTFT / TPOT histograms; ``render`` is the exposition."""

    COUNTERS = {
        "prompt_tokens": "Prompt tokens of answered requests.",
        "cached_tokens": "Prompt tokens served from a held conversation's cache (not prefilled again).",
        "completion_tokens": "Generated tokens, counted as they are generated (a rate is output tokens/s).",
        "restored_during_answer": "Deferred visual tokens prefilled fused into decode steps.",
        "restored_at_prefill": "Deferred tokens of earlier turns prefilled in a follow-up's first forward.",
        "cancelled": "Generations stopped because the client disconnected.",
    }

    def __init__(self, snapshot=None, admission=None, batching: bool = False):
        """``snapshot``: a callable returning the store's figures (`ConversationStore.snapshot`), or None;
        ``admission``: one returning the admission control's (`Admission.snapshot`), or None; ``batching``: the
        batching loop's figures too (`raincheck_batch_size`, `raincheck_steps_total`,
        `raincheck_step_kinds_total` by ``kind``, `raincheck_join_seconds`, `raincheck_restored_held_total` by
        ``step``, `raincheck_memory_wait_seconds`)."""
        from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector,
                                       ProcessCollector)

        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._requests = Counter("raincheck_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                 registry=self.registry)
        self._counters = {name: Counter(f"raincheck_{name}", text, registry=self.registry)
                          for name, text in self.COUNTERS.items()}
        self._ttft = Histogram("raincheck_ttft_seconds", "Time to first token (from the request's arrival).",
                               buckets=TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram("raincheck_tpot_seconds", "Time between consecutive generated tokens.",
                               buckets=TPOT_BUCKETS, registry=self.registry)
        self._queue_wait = Histogram("raincheck_queue_wait_seconds", "Time a request waited for a running place.",
                                     buckets=QUEUE_BUCKETS, registry=self.registry)
        self._completion = self._counters["completion_tokens"]
        self._batch_size = self._steps = self._restored_held = self._step_kinds = self._join = None
        self._memory_wait = None
        if batching:
            self._batch_size = Gauge("raincheck_batch_size", "Sequences in the batching loop's last step.",
                                     registry=self.registry)
            self._steps = Counter("raincheck_steps", "Steps (packed forwards) of the batching loop.",
                                  registry=self.registry)
            self._step_kinds = Counter(
                "raincheck_step_kinds", "Steps of the batching loop by how they ran: replayed (a captured decode "
                "step), captured (its graph captured at that step), eager (the packed eager forward: prompt pieces); "
                "a step of several forwards joins them with + (replayed+eager: decode rows, then prompt pieces).",
                ["kind"], registry=self.registry)
            for kind in STEP_KINDS:
                self._step_kinds.labels(kind=kind)
            self._join = Histogram("raincheck_join_seconds", "Time a new turn took to join the batching loop on its "
                                   "thread (its sequence handed into the engine; a turn prepared on its request's "
                                   "thread joins while a step runs, others between steps).",
                                   buckets=TTFT_BUCKETS, registry=self.registry)
            self._restored_held = Counter(
                "raincheck_restored_held", "Deferred tokens of held conversations restored by the batching loop: in "
                "the spare budget of steps beside answers (step=busy) or while no answer ran (step=idle).", ["step"],
                registry=self.registry)
            for step in ("busy", "idle"):  # both series from the start (a rate of a missing series is no rate)
                self._restored_held.labels(step=step)
            self._memory_wait = Histogram(
                "raincheck_memory_wait_seconds", "Time a request's preparation waited for device memory before its "
                "media went to the GPU (held conversations evicted, answers ending; only requests that found the "
                "device short).", buckets=QUEUE_BUCKETS, registry=self.registry)
        if snapshot is not None:
            self.registry.register(_HeldConversations(snapshot))
        if admission is not None:
            self.registry.register(_Admission(admission))

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()

    def add(self, **counts) -> None:
        for name, n in counts.items():
            if n:
                self._counters[name].inc(int(n))

    def tokens(self, n: int) -> None:
        """``n`` tokens just generated (from the answering thread, token by token)."""
        self._completion.inc(n)

    def step(self, sequences: int, kind: str | None = None) -> None:
        """A step of the batching loop ran with rows of ``sequences`` sequences, as ``kind`` says
        (`batch_engine.StepRecord.kind`)."""
        self._batch_size.set(sequences)
        self._steps.inc()
        if kind is not None:
            self._step_kinds.labels(kind=kind).inc()

    def joined(self, seconds: float) -> None:
        """A new turn took ``seconds`` to join the batching loop (on its thread)."""
        self._join.observe(seconds)

    def restored(self, rows: int, busy: bool) -> None:
        """The batching loop restored ``rows`` deferred tokens of held conversations, in a step beside answers
        (``busy``) or in idle time."""
        self._restored_held.labels(step="busy" if busy else "idle").inc(rows)

    def memory_waited(self, seconds: float) -> None:
        """A request's preparation found the device short of memory and waited ``seconds`` for it."""
        self._memory_wait.observe(seconds)

    def queued(self, seconds: float) -> None:
        self._queue_wait.observe(seconds)

    def turn(self, ttft: float, token_times: list[float]) -> None:
        if ttft == ttft:  # not NaN (no token)
            self._ttft.observe(ttft)
        for t in token_times:
            self._tpot.observe(t)

    @property
    def counters(self) -> dict[str, int]:
        """The counters' current values, by name (``cancelled``, ...)."""
        return {name: int(next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total")))
                for name, counter in self._counters.items()}

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
