"""Admission control: at most ``max_running`` turns generating at once, at most ``max_queue`` waiting (FIFO).

A request takes a `Ticket` when it arrives (`Admission.reserve`), before its body is checked and its media
decoded: with ``max_running + max_queue`` tickets out, it is refused at once (HTTP 429 with ``Retry-After``),
so the requests in memory at any time are bounded. A ticket is *queued* until `Ticket.run` gets it a running
place (first come, first served, in the order the requests are ready to run), and gives the place back with
`Ticket.release` when its turn ends (any thread: the answering thread ends the turn). A client that goes away
while its ticket is queued leaves the queue (`Ticket.run` raises `ClientGone`); a place handed to a ticket at
the moment its client went away passes on to the next one.

The figures (queued, running, the recent turns' durations) feed ``/metrics`` and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time

from .errors import APIError


class ClientGone(Exception):
    """The client disconnected while its request waited for a running place."""


class Admission:
    """The running places and the queue of one server (thread-safe; waiters are asyncio futures)."""

    RECENT = 32  # turn durations kept for the Retry-After estimate

    def __init__(self, max_running: int, max_queue: int):
        self.max_running, self.max_queue = max_running, max_queue
        self._lock = threading.Lock()
        self._running = 0
        self._queued = 0  # tickets out and not running: being prepared or waiting
        self._waiters: collections.deque[Ticket] = collections.deque()
        self._durations: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self._started: dict[int, float] = {}  # running ticket id -> when it got its place
        self.rejected = 0
        self.abandoned = 0

    # ---- tickets ------------------------------------------------------------------------------------
    def reserve(self) -> Ticket:
        """A queued ticket, or `APIError` 429 (with ``retry_after``) when running and queue places are all taken."""
        with self._lock:
            if self._running + self._queued >= self.max_running + self.max_queue:
                self.rejected += 1
                retry = self._retry_after_locked()
                raise APIError(
                    429, f"The server is at capacity: {self._running} requests are generating (--max-running "
                         f"{self.max_running}) and {self._queued} are waiting (--max-queue {self.max_queue}). Retry "
                         f"after about {retry} s.", code="queue_full", type="rate_limit_error",
                    headers={"Retry-After": str(retry)})
            self._queued += 1
            return Ticket(self)

    def _grant_locked(self, ticket: Ticket) -> None:
        ticket.state = "running"
        self._queued -= 1
        self._running += 1
        self._started[id(ticket)] = time.monotonic()

    def _pass_on_locked(self) -> list:
        """Hand free places to the oldest waiters; returns the futures to wake (set outside the lock)."""
        wake = []
        while self._waiters and self._running < self.max_running:
            ticket = self._waiters.popleft()
            self._grant_locked(ticket)
            wake.append(ticket)
        return wake

    @staticmethod
    def _wake(tickets) -> None:
        for ticket in tickets:
            loop, future = ticket._loop, ticket._future

            def resolve(future=future):
                if not future.done():
                    future.set_result(None)

            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # its event loop is closed (shutdown): nobody will run the turn
                ticket.release()

    # ---- figures ------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            return {"running": self._running, "queued": self._queued, "waiting": len(self._waiters),
                    "rejected": self.rejected, "abandoned": self.abandoned,
                    "max_running": self.max_running, "max_queue": self.max_queue}

    def retry_after(self) -> int:
        with self._lock:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        """Seconds until a place is likely free, rounded up, at least 1: the mean duration of the recent turns
        (from their running place to their end) over the running places, i.e. the mean interval between two
        turns ending when all places are busy. Before any turn has ended, the longest-running turn's time so
        far stands for the duration (a lower bound of it)."""
        if self._durations:
            duration = sum(self._durations) / len(self._durations)
        elif self._started:
            duration = time.monotonic() - min(self._started.values())
        else:
            duration = 1.0
        return max(1, math.ceil(duration / max(1, self.max_running)))


class Ticket:
    """One request's claim: queued, then running, then released (each step once)."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self.state = "queued"
        self._loop = self._future = None
        self.waited = 0.0  # seconds between asking for a running place and getting it

    async def run(self, disconnected, poll: float = 0.25) -> None:
        """Wait for a running place, first come first served; ``disconnected``: an async callable, polled every
        ``poll`` seconds while waiting, true once the client has gone (then `ClientGone`, the ticket released)."""
        admission, began = self.admission, time.monotonic()
        with admission._lock:
            if self.state != "queued":
                raise RuntimeError(f"a ticket runs once (this one is {self.state})")
            if not admission._waiters and admission._running < admission.max_running:
                admission._grant_locked(self)
                return
            self._loop = asyncio.get_running_loop()
            self._future = self._loop.create_future()
            admission._waiters.append(self)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(self._future), timeout=poll)
                    break
                except asyncio.TimeoutError:
                    if await disconnected():
                        raise ClientGone() from None
        except BaseException:  # gone, or the handler cancelled: leave the queue (or pass on a place just granted)
            with admission._lock:
                admission.abandoned += 1
                admission._started.pop(id(self), None)  # a place granted just now: no turn ran, nothing to time
            self.release()
            raise
        finally:
            self.waited = time.monotonic() - began

    def release(self) -> None:
        """Give back the ticket's place (running or queued); idempotent, from any thread."""
        admission = self.admission
        with admission._lock:
            if self.state == "released":
                return
            if self.state == "running":
                admission._running -= 1
                started = admission._started.pop(id(self), None)
                if started is not None:
                    admission._durations.append(time.monotonic() - started)
            else:
                admission._queued -= 1
                try:
                    admission._waiters.remove(self)
                except ValueError:
                    pass
            self.state = "released"
            wake = admission._pass_on_locked()
        Admission._wake(wake)
