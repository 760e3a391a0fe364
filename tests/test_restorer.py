"""`restorer.IdleRestorer`: the one thread per model that restores held conversations' leftovers in idle time, on
stand-in conversations (each chunk a counter: the order, the skipping and the failures, without a model)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from raincheck_hf.restorer import IdleRestorer


class Held:
    """What the restorer reads of a `Conversation`: its lock, whether it is closed / failed / in a turn, its
    leftovers and when it was last used; each chunk restores one row and is logged."""

    def __init__(self, name, pending, last_used, log, fail_at=None):
        self.name, self.pending, self._last_used, self.log = name, pending, last_used, log
        self._lock = threading.RLock()
        self._closed, self._failed, self._request = False, None, None
        self.fail_at = fail_at

    def _restore_one_chunk(self):
        with self._lock:
            if self.pending == 0:
                return 0
            if self.fail_at == self.pending:
                raise RuntimeError(f"{self.name} broke")
            self.pending -= 1
            self.log.append(self.name)
            return 1


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def test_the_most_recently_used_is_restored_first_one_chunk_at_a_time():
    log = []
    old, new = Held("old", 3, 1.0, log), Held("new", 2, 2.0, log)
    restorer = IdleRestorer()
    with old._lock, new._lock:  # held: nothing runs until both are attached
        restorer.attach(old)
        restorer.attach(new)
    wait_for(lambda: old.pending == new.pending == 0)
    assert log == ["new", "new", "old", "old", "old"]
    assert restorer.chunks == 5
    restorer.detach(old)
    restorer.detach(new)
    wait_for(lambda: not restorer.running)  # none attached: the thread ends


def test_a_conversation_in_a_turn_or_locked_is_passed_over_not_waited_for():
    log = []
    busy, locked, free = Held("busy", 2, 3.0, log), Held("locked", 2, 2.0, log), Held("free", 2, 1.0, log)
    busy._request = object()  # a turn is running (or about to)
    restorer = IdleRestorer()
    locked._lock.acquire()  # another thread holds it (a turn's forward)
    try:
        for conv in (busy, locked, free):
            restorer.attach(conv)
        wait_for(lambda: free.pending == 0)
        assert log == ["free", "free"] and busy.pending == 2 and locked.pending == 2
    finally:
        locked._lock.release()
    wait_for(lambda: locked.pending == 0)
    busy._request = None
    restorer.wake()
    wait_for(lambda: busy.pending == 0)
    assert log[2:] == ["locked", "locked", "busy", "busy"]
    for conv in (busy, locked, free):
        restorer.detach(conv)


def test_a_failed_chunk_marks_its_conversation_and_the_others_go_on(caplog):
    log = []
    broken, fine = Held("broken", 3, 2.0, log, fail_at=2), Held("fine", 2, 1.0, log)
    restorer = IdleRestorer()
    with broken._lock, fine._lock, caplog.at_level("ERROR", logger="raincheck_hf.restorer"):
        restorer.attach(broken)
        restorer.attach(fine)
    wait_for(lambda: fine.pending == 0)
    assert isinstance(broken._failed, RuntimeError) and broken.pending == 2
    assert log == ["broken", "fine", "fine"]
    assert restorer.attached == 1  # the failed one is detached
    assert "marked failed" in caplog.text
    restorer.detach(fine)


def test_detach_waits_for_a_chunk_in_progress_and_closed_ones_are_skipped():
    started, release = threading.Event(), threading.Event()
    log = []

    class Slow(Held):
        def _restore_one_chunk(self):
            with self._lock:
                started.set()
                release.wait(10)
                return super()._restore_one_chunk()

    slow, closed = Slow("slow", 5, 2.0, log), Held("closed", 2, 1.0, log)
    closed._closed = True
    restorer = IdleRestorer()
    restorer.attach(closed)
    restorer.attach(slow)
    assert started.wait(10)
    done = threading.Event()
    threading.Thread(target=lambda: (restorer.detach(slow), done.set()), daemon=True).start()
    wait_for(lambda: restorer.attached == 1)  # detached (no chunk after this one) ...
    time.sleep(0.05)
    assert not done.is_set()  # ... and the chunk in progress waited for
    release.set()
    assert done.wait(10)
    assert log == ["slow"] and slow.pending == 4  # no chunk after the detach
    time.sleep(0.05)
    assert closed.pending == 2
    restorer.detach(closed)
    wait_for(lambda: not restorer.running)


def test_a_conversation_dropped_without_close_is_let_go():
    restorer = IdleRestorer()
    conv = Held("dropped", 0, 1.0, [])
    restorer.attach(conv)
    assert restorer.attached == 1 and restorer.running
    del conv
    gc.collect()
    assert restorer.attached == 0
    restorer.wake()
    wait_for(lambda: not restorer.running)


@pytest.mark.parametrize("n", [1, 4])
def test_the_thread_starts_again_after_it_ended(n):
    restorer = IdleRestorer()
    log = []
    for round_ in range(2):
        convs = [Held(f"c{i}", 2, float(i), log) for i in range(n)]
        for conv in convs:
            restorer.attach(conv)
        wait_for(lambda: all(c.pending == 0 for c in convs))
        for conv in convs:
            restorer.detach(conv)
        wait_for(lambda: not restorer.running)
    assert len(log) == 2 * 2 * n
