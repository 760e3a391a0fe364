"""Idle-time restoration of held conversations' leftover deferred rows: one thread per model, shared by every
`Conversation` on it that restores in the background without a `BatchLoop`.

Between a conversation's turns its leftovers are prefilled a chunk (``RaincheckConfig.idle_chunk_size`` rows) at
a time, so that its next follow-up finds them in the cache. One restorer per model does it for all of them, the
most recently used conversation first (as a `BatchLoop` restores its idle conversations), one chunk at a time, and
a conversation whose turn is running (or about to) is passed over, never waited for.

One thread, not one per conversation: each thread that runs CUDA work gets a cuBLAS handle of its own, and torch
keeps a workspace (32 MB on a Hopper GPU) for each handle and stream while the handle lives, so a worker thread per
held conversation cost 32 MB of device memory for every conversation held at once (a server holding dozens: a
gigabyte, growing with its most held at once), besides a thread each. The restorer's thread ends once no
conversation is attached, and starts again with the next one.
"""

from __future__ import annotations

import logging
import threading
import weakref

logger = logging.getLogger("raincheck_hf.restorer")

_RESTORERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its IdleRestorer
_RESTORERS_LOCK = threading.Lock()


def restorer_for(model) -> "IdleRestorer":
    """The model's restorer (made on first need; it lives as long as the model)."""
    with _RESTORERS_LOCK:
        restorer = _RESTORERS.get(model)
        if restorer is None:
            restorer = _RESTORERS[model] = IdleRestorer()
        return restorer


class IdleRestorer:
    """Restores the leftovers of the conversations attached to it, one chunk at a time, on a thread of its own.

    A conversation is attached while it lives (`attach` at its start, `detach` at its `close`); it is held weakly, so
    one dropped without ``close()`` is let go. A chunk is restored only for a conversation that is open, has no turn
    running (``_request is None``), no failure, leftovers, and whose lock is free at once (a turn that starts while a
    chunk runs waits for that one chunk, as it did for its own worker). A chunk that fails leaves the conversation
    failed (its cache may be half-written: its next `ask` says so) and detached; the others go on."""

    WAIT_BUSY_S = 0.02  # with leftovers only in conversations busy with a turn: look again after this long
    WAIT_IDLE_S = 0.5  # with nothing to restore: wait this long for a `wake` (a turn's end wakes it at once)

    def __init__(self):
        self._cond = threading.Condition()
        self._attached: list[weakref.ref] = []
        self._current = None  # the conversation whose chunk is being restored
        self._thread: threading.Thread | None = None
        self.chunks = 0  # chunks restored so far (all conversations)

    @property
    def attached(self) -> int:
        """How many live conversations are attached."""
        with self._cond:
            return len(self._live())

    @property
    def running(self) -> bool:
        """Whether the restorer's thread is running."""
        with self._cond:
            return self._thread is not None

    def attach(self, conversation) -> None:
        with self._cond:
            self._attached.append(weakref.ref(conversation))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raincheck-restore", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def detach(self, conversation) -> None:
        """Stop restoring ``conversation``; a chunk of it in progress finishes first (waited for)."""
        with self._cond:
            self._attached = [r for r in self._attached if r() is not None and r() is not conversation]
            if threading.current_thread() is not self._thread:
                while self._current is conversation:
                    self._cond.wait()
            self._cond.notify_all()

    def wake(self) -> None:
        """Something may be restorable now (a turn ended)."""
        with self._cond:
            self._cond.notify_all()

    def _live(self) -> list:
        """Under the condition's lock: the attached conversations still alive (the dead ones forgotten)."""
        live = [r() for r in self._attached]
        if None in live:
            self._attached = [r for r in self._attached if r() is not None]
            live = [c for c in live if c is not None]
        return live

    def _next(self):
        """Under the condition's lock: the conversation to restore a chunk of (its lock taken), or None after
        waiting; raises `StopIteration` once none is attached (the thread ends)."""
        live = self._live()
        if not live:
            self._thread = None
            raise StopIteration
        wanted = [c for c in live
                  if not c._closed and c._failed is None and c._request is None and c.pending > 0]
        for conversation in sorted(wanted, key=lambda c: c._last_used, reverse=True):
            if conversation._lock.acquire(blocking=False):
                self._current = conversation
                return conversation
        timeout = self.WAIT_BUSY_S if wanted else self.WAIT_IDLE_S
        live = wanted = conversation = None  # (none held alive while waiting: one dropped meanwhile is let go)
        self._cond.wait(timeout=timeout)
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                try:
                    conversation = self._next()
                except StopIteration:
                    return
            if conversation is None:
                continue
            failed = None
            try:
                if not conversation._closed and conversation._request is None:
                    if conversation._restore_one_chunk():
                        self.chunks += 1
            except BaseException as error:  # its cache may be half-written: the conversation says so at its next ask
                failed = error
                conversation._failed = error
                logger.exception("restoring the leftovers of a held conversation failed; it is marked failed")
            finally:
                conversation._lock.release()
                with self._cond:
                    self._current = None
                    if failed is not None:
                        self._attached = [r for r in self._attached if r() is not conversation]
                    self._cond.notify_all()
                del conversation
