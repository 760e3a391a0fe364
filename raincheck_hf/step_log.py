"""`StepLog`: a batching loop's record of its steps, for finding where its time goes (`BatchLoop.step_stats`).

Each step's `batch_engine.StepRecord` (replayed, captured or eager; its rows by kind) with the time from its launch
to the next one, split where the loop marks it (the launch, choosing and preparing ahead, the wait for the device,
streaming, the rest of the iteration with its joins); the last ``keep`` steps one by one and running totals per
(kind, sequences). And each turn's way to its first token (`TurnRecord`): how long it waited for the loop, its
join, and the steps until its first token was read, by kind; first turns and follow-ups apart. A few
`time.perf_counter` calls and one lock per step; nothing waits for the device for them.
"""

from __future__ import annotations

import collections
import statistics
import threading
from typing import NamedTuple

from .batch_engine import StepRecord

__all__ = ["LoopStep", "StepLog", "TurnRecord"]


class LoopStep(NamedTuple):
    """One step in `BatchLoop`'s record of its recent steps (`StepLog`), with where the loop's time went from its
    launch to the next one (seconds of `time.perf_counter`; nothing waits for the device to take them):

    ``launch_s``: `BatchEngine.step` (deciding the step unless it was prepared, filling and launching its forwards:
    on a GPU the host's launch time, the forwards run on behind it); ``choose_s``: choosing the tokens on the device,
    feeding them and preparing the next step (host work while the device runs; all of the host's work after the
    launch for a step that gave no token); ``wait_s``: the read of the tokens, the step's one wait for the device;
    ``stream_s``: after the read, the stopping checks, streaming and turns that ended; ``between_s``: the rest of
    the loop's iteration until the next launch (handing the tokens to the consumers, new turns joining,
    cancellations, restoring conversations joining or leaving), or until the loop found no step to run. From the
    read to the next launch (``gap_s``: ``stream_s + between_s``) the device has nothing queued. A step launched
    ahead (`BatchLoop._launch_ahead`: right after the read, before the streaming) closes its predecessor there, whose
    ``stream_s`` and ``between_s`` are then near 0; the streaming falls in the ahead step's ``choose_s``. ``join_s`` /
    ``restore_s``: the part of ``between_s`` spent in new turns' `BatchLoop._join` (vision encoding and
    preparation) and in restoring conversations joining or leaving the engine. ``launch_cpu_s``: the loop thread's
    own CPU time in the launch (`time.thread_time`): a launch much longer than it waited, for the device (a read
    inside the forward) or for the interpreter's lock (other threads' Python: requests being prepared, streaming);
    ``choose_cpu_s``: the same for ``choose_s``, up to the read. ``prepare_s`` / ``prepare_cpu_s``: the part of
    ``choose_s`` (and of its CPU time) spent preparing the next step (`BatchEngine.prepare`: deciding its rows and
    filling its captured step's buffers), the rest being the tokens' choosing and feeding."""

    record: StepRecord  # the engine's (`BatchEngine.last_step`)
    launch_s: float
    choose_s: float
    wait_s: float
    stream_s: float
    between_s: float
    join_s: float
    restore_s: float
    launch_cpu_s: float = 0.0
    choose_cpu_s: float = 0.0
    prepare_s: float = 0.0
    prepare_cpu_s: float = 0.0

    @property
    def gap_s(self) -> float:
        return self.stream_s + self.between_s

    @property
    def step_s(self) -> float:
        """From this step's launch to the next one's."""
        return self.launch_s + self.choose_s + self.wait_s + self.stream_s + self.between_s

    def as_dict(self) -> dict:
        rows = self.record.rows
        return {"kind": self.record.kind, "sequences": rows.sequences, "decode_rows": rows.decode,
                "chunk_rows": rows.chunk, "prefill_rows": rows.prefill, "restoring_rows": rows.restoring,
                **{f"{name}_ms": 1e3 * getattr(self, f"{name}_s") for name in StepLog.TIMES}}


TURN_TIMES = ("ahead", "ahead_wait", "ahead_cpu", "queue", "join", "first", "ttft")  # `TurnRecord`'s, in ms


class TurnRecord(NamedTuple):
    """One turn's way to its first token in `BatchLoop` (`StepLog.turns`; times of `time.perf_counter`, seconds):

    ``ahead_s``: the turn's preparation on the asking thread (`BatchLoop.prepare_ahead`: HF's preparation; a first
    turn's vision tower, selection and plan too; 0 for a turn prepared when it joins); ``queue_s``: the rest of the
    time from when it was asked (`BatchTurn.started`) to its join's start on the loop's thread (waiting for the step running
    then and for the turns joining before it); ``join_s``: its `BatchLoop._join`; ``first_s``: from the
    join to the read of its first token; ``steps``: the steps launched in that time, the one that gave the token
    included, and ``kinds``: how many of them ran each way (`StepRecord.kind`); ``follow_up``: it continued a held
    conversation's cache (else it prefilled from nothing); ``prompt_rows``: the rows it had to prefill (its prompt,
    and a follow-up's leftover deferred rows); ``ahead_wait_s`` / ``ahead_cpu_s``: of ``ahead_s``, the wait for its
    place among the preparations (`BatchLoop.max_preparing`) and the asking thread's CPU time (the rest: waiting
    for the device or the interpreter's lock)."""

    follow_up: bool
    prompt_rows: int
    ahead_s: float
    queue_s: float
    join_s: float
    first_s: float
    kinds: tuple  # ((kind, steps), ...), sorted
    ahead_wait_s: float = 0.0
    ahead_cpu_s: float = 0.0

    @property
    def steps(self) -> int:
        return sum(n for _, n in self.kinds)

    @property
    def ttft_s(self) -> float:
        return self.ahead_s + self.queue_s + self.join_s + self.first_s

    def as_dict(self) -> dict:
        return {"follow_up": self.follow_up, "prompt_rows": self.prompt_rows, "steps": self.steps,
                "kinds": dict(self.kinds), **{f"{name}_ms": 1e3 * getattr(self, f"{name}_s")
                                               for name in TURN_TIMES}}


class _OpenTurn(NamedTuple):
    """A turn that joined and has no token yet: its times, and the loop's steps by kind launched before it joined
    (`StepLog`'s running count: the steps towards its token are the difference at its token)."""

    follow_up: bool
    prompt_rows: int
    asked: float
    ahead: float
    began: float
    joined: float
    launched_before: collections.Counter
    ahead_wait: float = 0.0
    ahead_cpu: float = 0.0

    def close(self, now: float, launched: collections.Counter) -> TurnRecord:
        kinds = launched - self.launched_before
        return TurnRecord(self.follow_up, self.prompt_rows, self.ahead, self.began - self.asked - self.ahead,
                          self.joined - self.began, now - self.joined, tuple(sorted(kinds.items())),
                          self.ahead_wait, self.ahead_cpu)


class _OpenStep:
    """The step the loop runs now: its engine record and the times taken so far (the loop's thread alone writes)."""

    __slots__ = ("record", "launched", "stepped", "cpu", "cpu_at", "preparing", "preparing_cpu", "reading",
                 "reading_cpu", "read", "done", "join_s", "restore_s")

    def __init__(self, record: StepRecord, launched: float, stepped: float, cpu: float = 0.0,
                 cpu_at: float | None = None):
        self.record, self.launched, self.stepped, self.cpu, self.cpu_at = record, launched, stepped, cpu, cpu_at
        self.preparing = self.preparing_cpu = self.reading = self.reading_cpu = self.read = self.done = None
        self.join_s = self.restore_s = 0.0

    def close(self, end: float) -> LoopStep:
        done = end if self.done is None else self.done
        # (a step with no token to read, or whose read failed: its host work after the launch is all ``choose_s``)
        reading = done if self.reading is None else self.reading
        read = reading if self.read is None else self.read
        chosen = (0.0 if self.cpu_at is None or self.reading_cpu is None
                  else max(self.reading_cpu - self.cpu_at, 0.0))  # (the loop thread's CPU seconds up to the read)
        prepared = 0.0 if self.preparing is None else max(reading - self.preparing, 0.0)
        prepared_cpu = (0.0 if self.preparing_cpu is None or self.reading_cpu is None
                        else max(self.reading_cpu - self.preparing_cpu, 0.0))
        return LoopStep(self.record, self.stepped - self.launched, reading - self.stepped, read - reading,
                        done - read, end - done, self.join_s, self.restore_s, self.cpu, chosen, prepared, prepared_cpu)


class StepLog:
    """`BatchLoop`'s record of its steps: the last ``keep`` as `LoopStep`s and running totals per (kind, sequences)
    (a bounded number of keys), from the last `reset`. A step counts when it launched (so the counts always add up
    to the steps run); its times when the next launch, or the loop finding no step to run, closes it. And the last
    ``keep_turns`` turns' `TurnRecord`s (the turns' figures are their medians). Written by the loop's thread (a few
    `time.perf_counter` calls and one lock per step), read from any thread (`snapshot`)."""

    TIMES = ("step", "launch", "choose", "wait", "stream", "between", "gap", "join", "restore", "launch_cpu",
             "choose_cpu", "prepare", "prepare_cpu")
    ROWS = ("decode", "chunk", "prefill", "restoring")

    def __init__(self, keep: int = 256, keep_turns: int = 1024):
        self._lock = threading.Lock()
        self._recent: collections.deque[LoopStep] = collections.deque(maxlen=keep)
        self._turns: collections.deque[TurnRecord] = collections.deque(maxlen=keep_turns)  # (the medians' turns)
        self._awaiting: dict[object, _OpenTurn] = {}  # turns joined, no token yet (kept across a `reset`)
        self._launched: collections.Counter = collections.Counter()  # every step launched, by kind (never reset)
        self.open: _OpenStep | None = None
        self.reset()

    def reset(self) -> None:
        """Start the totals and the recent steps afresh (a step running now counts in neither)."""
        with self._lock:
            self._recent.clear()
            self._turns.clear()
            self.open = None
            # (kind, sequences) -> [steps, timed, decode, chunk, prefill, restoring rows, then a sum per time]
            self._totals: dict[tuple[str, int], list] = {}
            self._spent = {"joins": 0, "join_total_s": 0.0, "join_cpu_s": 0.0, "restore_beside_total_s": 0.0,
                           "idle_restorations": 0,
                           "restore_idle_total_s": 0.0, "steps_ahead": 0, "joins_in_flight": 0,
                           "follow_ups_made_ahead": 0, "follow_ups_made_again": 0}

    # ---- the loop's thread ----
    def launched(self, record: StepRecord | None, launched: float, stepped: float | None = None,
                 cpu: float = 0.0, cpu_at: float | None = None) -> None:
        """A step launched at ``launched`` (``record``: what it ran; None: it raised, it does not count) and returned
        at ``stepped``, the loop's thread using ``cpu`` seconds of CPU time in it (``cpu_at``: its `time.thread_time`
        then, against which the open step's ``reading_cpu`` counts the choosing's): the previous step closes at its
        launch."""
        with self._lock:
            if self.open is not None:
                self._close(self.open.close(launched))
            self.open = None
            if record is None:
                return
            totals = self._totals.get((record.kind, record.rows.sequences))
            if totals is None:
                totals = self._totals[(record.kind, record.rows.sequences)] = [0] * (6 + len(self.TIMES))
            rows = record.rows
            totals[0] += 1
            self._launched[record.kind] += 1
            totals[2] += rows.decode
            totals[3] += rows.chunk
            totals[4] += rows.prefill
            totals[5] += rows.restoring
            self.open = _OpenStep(record, launched, stepped, cpu, cpu_at)

    def finished(self, now: float) -> None:
        """The loop is done with the step's tokens (streamed, turns ended): the rest of its iteration begins."""
        step = self.open  # (once: `reset` on another thread may drop it meanwhile)
        if step is not None:
            step.done = now

    def idle(self, now: float) -> None:
        """The loop found no step to run: the last step closes now."""
        if self.open is not None:
            with self._lock:
                if self.open is not None:
                    self._close(self.open.close(now))
                self.open = None

    def ahead(self) -> None:
        """The step launched now went ahead of its predecessor's streaming (`BatchLoop._launch_ahead`)."""
        with self._lock:
            self._spent["steps_ahead"] += 1

    def joined_in_flight(self, turns: int) -> None:
        """``turns`` joined while a step ran (`BatchLoop._join_in_flight`; their times count as ``"join"`` too)."""
        with self._lock:
            self._spent["joins_in_flight"] += turns

    def follow_up_joined(self, made_ahead: bool) -> None:
        """A follow-up joined with its sequence made on its request's thread (``made_ahead``), or made again on the
        loop's because its held cache had changed since (`BatchLoop._follow_up_ahead`)."""
        with self._lock:
            self._spent["follow_ups_made_ahead" if made_ahead else "follow_ups_made_again"] += 1

    def spent(self, what: str, seconds: float, cpu: float = 0.0) -> None:
        """``seconds`` of the loop's thread in ``what``: ``"join"`` (a new turn's `BatchLoop._join`), ``"restore"``
        (restoring conversations joining or leaving an engine beside the answers), ``"idle"`` (a chunk of idle-time
        restoration); the first two count in the open step's too. ``cpu``: the loop thread's CPU time in it (kept for
        joins: ``join_cpu_s``; the rest of a join's time waits for the device or the interpreter's lock)."""
        step = self.open
        with self._lock:
            if what == "join":
                self._spent["joins"] += 1
                self._spent["join_total_s"] += seconds
                self._spent["join_cpu_s"] += cpu
                if step is not None:
                    step.join_s += seconds
            elif what == "restore":
                self._spent["restore_beside_total_s"] += seconds
                if step is not None:
                    step.restore_s += seconds
            else:
                self._spent["idle_restorations"] += 1
                self._spent["restore_idle_total_s"] += seconds

    def turn_joined(self, key, asked: float, began: float, joined: float, follow_up: bool, prompt_rows: int,
                    ahead_s: float = 0.0, ahead_wait_s: float = 0.0, ahead_cpu_s: float = 0.0) -> None:
        """A turn (``key``: any hashable that names it until its first token) asked at ``asked`` (``ahead_s`` of
        that time spent preparing it on the asking thread) joined from ``began`` to ``joined``; the steps launched
        from now count towards its first token."""
        asked = min(asked, began)
        with self._lock:
            ahead = min(ahead_s, began - asked)
            self._awaiting[key] = _OpenTurn(follow_up, prompt_rows, asked, ahead, began, joined,
                                            collections.Counter(self._launched), min(ahead_wait_s, ahead),
                                            min(ahead_cpu_s, ahead))

    def turn_first_token(self, key, now: float) -> None:
        """The turn's first token was read at ``now``: its `TurnRecord` is kept (nothing for a turn not awaited)."""
        with self._lock:
            turn = self._awaiting.pop(key, None)
            if turn is not None:
                self._turns.append(turn.close(now, self._launched))

    def turn_ended(self, key) -> None:
        """The turn ended without a token (an error, a cancellation): it is not awaited any more."""
        with self._lock:
            self._awaiting.pop(key, None)

    def _close(self, step: LoopStep) -> None:
        self._recent.append(step)
        totals = self._totals[(step.record.kind, step.record.rows.sequences)]
        totals[1] += 1
        for i, name in enumerate(self.TIMES):
            totals[6 + i] += getattr(step, f"{name}_s")

    # ---- any thread ----
    def snapshot(self, recent: int = 0) -> dict:
        """Plain data: ``steps`` (since the last reset), ``timed`` (of them, those whose time to the next launch is
        known: all but one still running), rows by kind, the seconds of the timed steps in each part
        (``seconds``: totals of `LoopStep`'s times), the loop's time in joins and restoration, ``steps_ahead`` (those
        launched ahead of their predecessor's streaming), ``joins_in_flight`` (turns that joined while a step ran),
        ``follow_ups_made_ahead`` / ``follow_ups_made_again`` (follow-ups that joined with their sequence made on
        their request's thread / made again on the loop's);
        ``kinds``: per `StepRecord.kind`, its steps, mean sequences, rows and the mean ms of each part over its timed
        steps, and ``by_sequences``: the same per number of sequences in the step; ``recent``: the last ``recent`` steps
        (`LoopStep.as_dict`), oldest first."""
        with self._lock:
            totals = {key: list(value) for key, value in self._totals.items()}
            spent = dict(self._spent)
            last = list(self._recent)[-recent:] if recent > 0 else []
            turns = list(self._turns)
        kinds = {}
        for kind in sorted({kind for kind, _ in totals}):
            mine = {n: values for (k, n), values in sorted(totals.items()) if k == kind}
            figures = self._figures(self._sum(mine.values()))
            figures["sequences"] = sum(n * values[0] for n, values in mine.items()) / figures["steps"]
            figures["by_sequences"] = {n: self._figures(values) for n, values in mine.items()}
            kinds[kind] = figures
        everything = self._sum(totals.values())
        return {
            "steps": everything[0], "timed": everything[1],
            "rows": {name: everything[2 + i] for i, name in enumerate(self.ROWS)},
            "seconds": {name: everything[6 + i] for i, name in enumerate(self.TIMES)},
            **spent,
            "kinds": kinds,
            "recent": [step.as_dict() for step in last],
            "turns": {"first": self._turn_figures([t for t in turns if not t.follow_up]),
                      "follow_up": self._turn_figures([t for t in turns if t.follow_up])},
            "recent_turns": [turn.as_dict() for turn in turns[-recent:]] if recent > 0 else [],
        }

    @staticmethod
    def _turn_figures(turns: list[TurnRecord]) -> dict:
        """The medians of the turns' `TurnRecord` times (ms) and rows, their steps (median, most) and those steps by
        kind (summed over the turns); None where there is no turn."""
        median = lambda values: statistics.median(values) if values else None  # noqa: E731
        kinds = collections.Counter()
        for turn in turns:
            kinds.update(dict(turn.kinds))
        figures = {"turns": len(turns), "prompt_rows_p50": median([t.prompt_rows for t in turns]),
                   "steps_p50": median([t.steps for t in turns]), "steps_max": max((t.steps for t in turns),
                                                                                 default=None),
                   "kinds": dict(sorted(kinds.items()))}
        for name in TURN_TIMES:
            values = [1e3 * getattr(t, f"{name}_s") for t in turns]
            figures[f"{name}_ms_p50"] = median(values)
        return figures

    def _sum(self, rows) -> list:
        return [sum(column) for column in zip(*rows)] or [0] * (6 + len(self.TIMES))

    def _figures(self, values: list) -> dict:
        steps, timed = values[0], values[1]
        figures = {"steps": steps, "timed": timed}
        figures.update({f"{name}_rows": values[2 + i] for i, name in enumerate(self.ROWS)})
        figures.update({f"{name}_ms": (1e3 * values[6 + i] / timed if timed else None)
                        for i, name in enumerate(self.TIMES)})
        return figures
