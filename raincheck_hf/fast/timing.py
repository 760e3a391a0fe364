"""Device time of captured steps, measured with CUDA events and read without waiting.

`chunk_size="auto"` (`generation.auto_chunk_size`) needs what a plain decode step and a step carrying
a chunk of each ladder size cost on the running device. A graph's replay is bracketed by two
timing events on the stream; the events are read later (`torch.cuda.Event.query`, which never
blocks), when the device has passed them, typically one step later. A shape's first figures
come from its capture, which synchronises anyway: the captured graph is replayed a few times there
and timed. Shapes are captured only when a step runs them (`StepGraphs.step_figures` never captures
to time); a shape not measured at a slot bucket takes the nearest measured bucket's figure.

Each shape keeps its last `WINDOW` samples; its cost is their median (one slow replay, e.g. behind
another thread's work, does not move it).

Captures are timed too, on the host's wall clock (`add_capture`, `capture_cost`): a capture is a pause of
the answer it happens in (warm-up runs, the capture, a synchronisation and the timed replays), which
`chunk_size="auto"` weighs before it picks a chunk size whose step is not captured yet at its slot bucket.
"""

from __future__ import annotations

import collections
import statistics

import torch

WINDOW = 15  # samples kept per shape
MAX_IN_FLIGHT = 64  # unread event pairs kept; beyond that new replays go unmeasured until the device catches up
CAPTURE_REPLAYS = 3  # timed replays right after a capture


class StepTimings:
    """Per graph key, recent device seconds of its replays (`record` around a replay, `cost` to read)."""

    def __init__(self, enabled: bool = True, event=None):
        self.enabled = enabled  # False (no CUDA graphs): replays run untimed and nothing is measured
        self._event = event  # the event class (tests pass a stand-in); None: torch.cuda.Event
        self._samples: dict = {}
        self._captures: dict = {}  # a key without its slot bucket -> wall seconds of its latest capture
        self._in_flight: collections.deque = collections.deque()

    def add(self, key, seconds: float) -> None:
        self._samples.setdefault(key, collections.deque(maxlen=WINDOW)).append(float(seconds))

    def replay(self, key, graph) -> None:
        """``graph.replay()`` between two timing events (read later by `poll`); never waits for the device."""
        if not self.enabled:
            graph.replay()
            return
        self.poll()
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            graph.replay()
            return
        start, end = self._new_event(), self._new_event()
        start.record()
        graph.replay()
        end.record()
        self._in_flight.append((key, start, end))

    def _new_event(self):
        return (self._event or torch.cuda.Event)(enable_timing=True)

    def poll(self) -> None:
        """Take the samples of every replay the device has finished (in order; stops at the first unfinished)."""
        while self._in_flight and self._in_flight[0][2].query():
            key, start, end = self._in_flight.popleft()
            self.add(key, start.elapsed_time(end) / 1e3)

    def time_replays(self, key, graph, replays: int = CAPTURE_REPLAYS) -> None:
        """Replay ``graph`` ``replays`` times and wait for it (capture time only: it synchronises)."""
        if not self.enabled:
            return
        events = [self._new_event() for _ in range(replays + 1)]
        events[0].record()
        for i in range(replays):
            graph.replay()
            events[i + 1].record()
        events[-1].synchronize()
        for a, b in zip(events, events[1:]):
            self.add(key, a.elapsed_time(b) / 1e3)

    def cost(self, key) -> float | None:
        """Median device seconds of ``key``'s recent replays, or None before any was measured."""
        self.poll()
        samples = self._samples.get(key)
        return statistics.median(samples) if samples else None

    def nearest_cost(self, key) -> float | None:
        """`cost` of the measured key that differs from ``key`` only in its last entry (a slot bucket), the
        nearest one; None when there is none."""
        self.poll()
        near = [k for k, v in self._samples.items() if v and k[:-1] == key[:-1]]
        if not near:
            return None
        return statistics.median(self._samples[min(near, key=lambda k: abs(k[-1] - key[-1]))])

    def add_capture(self, key, seconds: float) -> None:
        """Wall seconds that capturing ``key`` took (kept per shape, whatever its bucket: the latest)."""
        self._captures[key[:-1]] = float(seconds)

    def capture_cost(self, key) -> float | None:
        """Wall seconds of the latest capture of ``key``'s shape at any slot bucket, or None: never captured.

        A shape's first capture also pays its lazy initialisation (two warm-up runs instead of one, kernel
        tuning, compiles), so the figure overstates a later bucket's capture until that one is measured."""
        return self._captures.get(key[:-1])
