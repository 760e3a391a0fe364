"""`fast.scoping.DeviceGate`: device work of several threads at once, or one thread capturing alone.

The batching loop's thread and the threads preparing turns for it hold the shared side (`device_work`); every graph
capture holds the exclusive side (`CAPTURE_LOCK`). These tests drive the gate with plain threads and events (no
device), and check that the loop and its preparations hold the shared side while they work.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import types

import pytest

from raincheck_hf.fast.scoping import CAPTURE_LOCK, DeviceGate, device_work

WAIT = 5.0  # seconds a test waits for something that must happen (never reached when it works)


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_shared_holders_work_at_once_and_a_capture_waits_for_them_all():
    gate = DeviceGate()
    inside, release = threading.Barrier(3), threading.Event()
    order = []

    def worker(name):
        with gate.shared():
            inside.wait(WAIT)  # (both workers are inside at once, with the test's thread)
            release.wait(WAIT)
            order.append(name)

    workers = [_thread(lambda n=n: worker(n)) for n in ("a", "b")]
    inside.wait(WAIT)
    assert gate.holders == (2, None)

    def capture():
        with gate:
            order.append("capture")

    capturing = _thread(capture)
    _until(lambda: gate._waiting == 1, "the capture to wait")
    time.sleep(0.02)
    assert order == []  # (it waits while anyone is inside)
    release.set()
    for t in [*workers, capturing]:
        t.join(WAIT)
    assert sorted(order[:2]) == ["a", "b"] and order[2] == "capture"
    assert gate.holders == (0, None)


def test_new_shared_holders_wait_behind_a_waiting_capture():
    """A capture asked while a thread is inside goes before threads that ask for the shared side after it (a loop
    that steps without pause does not keep it waiting)."""
    gate = DeviceGate()
    entered, leave = threading.Event(), threading.Event()
    order = []

    def first():
        with gate.shared():
            entered.set()
            leave.wait(WAIT)
        order.append("first out")

    def capture():
        with gate:
            order.append("capture")

    def later():
        with gate.shared():
            order.append("later")

    threads = [_thread(first)]
    entered.wait(WAIT)
    threads.append(_thread(capture))
    _until(lambda: gate._waiting == 1, "the capture to wait")
    threads.append(_thread(later))
    time.sleep(0.02)
    assert "later" not in order  # (behind the waiting capture)
    leave.set()
    for t in threads:
        t.join(WAIT)
    assert order.index("capture") < order.index("later"), order


def test_a_capture_shuts_out_shared_work_and_is_reentrant():
    gate = DeviceGate()
    captured, done = threading.Event(), threading.Event()
    order = []

    def capture():
        with gate:
            with gate:  # (a capture inside a capture's bookkeeping: the same holder)
                with gate.shared():  # (the holder's own device work: nothing to wait for)
                    captured.set()
                    done.wait(WAIT)
                    order.append("capture")

    def work():
        with gate.shared():
            order.append("work")

    capturing = _thread(capture)
    captured.wait(WAIT)
    assert gate.holders == (0, capturing.ident)
    working = _thread(work)
    time.sleep(0.02)
    assert order == []  # (it waits for the capture)
    done.set()
    for t in (capturing, working):
        t.join(WAIT)
    assert order == ["capture", "work"] and gate.holders == (0, None)


def test_shared_holders_asking_to_capture_give_up_their_hold_meanwhile():
    """Two threads inside the shared side both ask for the exclusive side (each a capture in the middle of its work):
    each leaves its hold while it waits and captures (else each would wait for the other forever), one after the
    other, and each is back inside after its capture."""
    gate = DeviceGate()
    both_in = threading.Barrier(2)
    captures, after = [], {}

    def worker(name):
        with gate.shared():
            both_in.wait(WAIT)
            with gate:
                captures.append(name)
                assert gate.holders[0] == 0  # (no one inside while it captures)
            after[name] = gate._local.depth  # (its hold back: inside again)

    workers = [_thread(lambda n=n: worker(n)) for n in ("a", "b")]
    for t in workers:
        t.join(WAIT)
    assert not any(t.is_alive() for t in workers)
    assert sorted(captures) == ["a", "b"] and after == {"a": 1, "b": 1}
    assert gate.holders == (0, None)


def test_an_error_inside_either_side_leaves_the_gate_open():
    gate = DeviceGate()
    with pytest.raises(RuntimeError):
        with gate.shared():
            raise RuntimeError("a step failed")
    with pytest.raises(RuntimeError):
        with gate.shared():
            with gate:
                raise RuntimeError("a capture failed")
    assert gate.holders == (0, None) and gate._local.depth == 0
    finished = []
    t = _thread(lambda: (gate.__enter__(), gate.__exit__(None, None, None), finished.append(True)))
    t.join(WAIT)
    assert finished == [True]


def test_the_batching_loop_and_its_preparations_work_inside_the_shared_side(monkeypatch):
    """The loop's thread holds `device_work` while it steps and streams; a turn prepared on the asking thread
    (`BatchLoop.prepare_ahead`) holds it while it is made; the process's captures (`CAPTURE_LOCK`) are its exclusive
    side."""
    from raincheck_hf import BatchLoop, Conversation, batch_loop
    from raincheck_hf.tiny import build_tiny_processor, build_tiny_qwen3_vl, draw_test_image

    assert device_work.__self__ is CAPTURE_LOCK
    model, processor = build_tiny_qwen3_vl(), build_tiny_processor()
    seen = {"prepare": [], "stream": []}
    made = batch_loop.new_sequence

    def watched(*args, **kwargs):
        seen["prepare"].append(CAPTURE_LOCK._local.__dict__.get("depth", 0))
        return made(*args, **kwargs)

    monkeypatch.setattr(batch_loop, "new_sequence", watched)

    class Streamer:
        def put(self, value):
            seen["stream"].append(CAPTURE_LOCK._local.__dict__.get("depth", 0))

        def end(self):
            pass

    with BatchLoop(model) as loop, Conversation(model, processor, background=False, loop=loop) as conv:
        conv.ask("What is in this image?", images=[draw_test_image()], max_new_tokens=3, streamer=Streamer())
        assert seen["prepare"] == [1]  # (on the asking thread, inside)
        assert len(seen["stream"]) >= 3 and all(d >= 1 for d in seen["stream"])  # (on the loop's thread, inside)
    assert CAPTURE_LOCK.holders == (0, None)


def test_a_shared_holder_interrupted_while_it_waits_to_capture_keeps_its_hold(monkeypatch):
    """An exception while a shared holder waits for the exclusive side (an interrupt) leaves it inside as it was:
    the count its own shared section takes back on leaving stays right, and the gate opens for others after."""
    gate = DeviceGate()
    entered, leave = threading.Event(), threading.Event()

    def other():
        with gate.shared():
            entered.set()
            leave.wait(WAIT)

    t = _thread(other)
    entered.wait(WAIT)

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    with gate.shared():
        monkeypatch.setattr(gate._cond, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with gate:  # (the other thread is inside: it waits, and is interrupted)
                pass
        monkeypatch.undo()
        assert gate.holders == (2, None) and gate._waiting == 0
    leave.set()
    t.join(WAIT)
    assert gate.holders == (0, None)
    with gate:
        assert gate.holders[1] == threading.get_ident()


def test_captures_run_on_one_stream_per_device_and_warm_up_on_the_callers(monkeypatch):
    """`fast.scoping.capture_stream`: the one stream of a device that captures run on for the whole process (made on
    first need, per device: CUDA libraries keep per-stream state for good, cuBLAS a workspace per handle and stream,
    so a stream per capture or per storage grew the device memory with each one). Their warm-ups make no stream and
    take none: they run on the caller's current stream, so that what a warm-up allocates and keeps (a storage's KV
    tensors, a step's logits buffer) belongs to the stream that uses it afterwards; on a shared side stream, freed, it
    went to the next warm-up while the caller's copy out of it was still queued (`fast.scoping`)."""
    import inspect

    from raincheck_hf.fast import batched_graphs, graphs, scoping, vision_graphs
    from raincheck_hf.selection import kernels

    made = []

    class FakeStream:
        def __init__(self, device=None, priority=0):
            made.append(device)

    monkeypatch.setattr(scoping.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(scoping.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(scoping, "_CAPTURE_STREAMS", {})
    first = scoping.capture_stream("cuda:0")
    assert scoping.capture_stream("cuda") is first and scoping.capture_stream(None) is first
    threads = [threading.Thread(target=scoping.capture_stream, args=("cuda:1",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scoping.capture_stream("cuda:1") is not first and made == [0, 1]
    assert not hasattr(scoping, "warm_up_stream")
    # no capture path makes a stream of its own or switches to one (only `graph_capture` does, for the capture)
    for module in (graphs, vision_graphs, batched_graphs, kernels):
        source = inspect.getsource(module)
        assert "cuda.Stream(" not in source and "cuda.stream(" not in source, module.__name__
        assert "graph_capture(" in source, module.__name__


def test_a_capture_keeps_the_allocators_caches_and_ends_even_when_its_block_raises(monkeypatch):
    """`fast.scoping.graph_capture`: the graph's own ``capture_begin`` (the pool token given, ``thread_local``) and
    ``capture_end`` on the device's one capture stream (`capture_stream`, made once per device), after a device-wide
    synchronize, with the collector paused; never ``torch.cuda.empty_cache`` or the pinned
    host memory's emptying (which ``torch.cuda.graph`` does before every capture, so a warm-up of hundreds of
    captures gave back and allocated again its device blocks and pinned buffers each time); a block that raises still
    ends the capture, and its error reaches the caller."""
    import gc

    from raincheck_hf.fast import scoping

    calls = []

    class FakeStream:
        def __init__(self, device=None, priority=0):
            calls.append(("stream made", device))

    class FakeGraph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            assert not gc.isenabled()  # (the collector paused: `paused_collector`)
            calls.append(("begin", pool, capture_error_mode, current[-1]))

        def capture_end(self):
            calls.append(("end", current[-1]))

    current = [None]

    @contextlib.contextmanager
    def on_stream(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    def refused(*args, **kwargs):
        raise AssertionError("a capture emptied an allocator's cache")

    monkeypatch.setattr(scoping.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(scoping.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(scoping.torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize",)))
    monkeypatch.setattr(scoping.torch.cuda, "stream", on_stream)
    monkeypatch.setattr(scoping.torch.cuda, "empty_cache", refused)
    monkeypatch.setattr(scoping.torch._C, "_host_emptyCache", refused, raising=False)
    monkeypatch.setattr(scoping, "_CAPTURE_STREAMS", {})
    was_enabled = gc.isenabled()
    with scoping.graph_capture(FakeGraph(), pool=("pool", 7)):
        calls.append(("body", current[-1]))
    stream = scoping.capture_stream()
    assert isinstance(stream, FakeStream)
    assert calls == [("synchronize",), ("stream made", 0), ("begin", ("pool", 7), "thread_local", stream),
                     ("body", stream), ("end", stream)]
    assert gc.isenabled() == was_enabled and current == [None]
    calls.clear()
    with pytest.raises(ValueError, match="in the block"):
        with scoping.graph_capture(FakeGraph()):
            raise ValueError("in the block")
    assert calls == [("synchronize",), ("begin", None, "thread_local", stream), ("end", stream)]  # (the same stream)
    assert gc.isenabled() == was_enabled and current == [None]


class _FakeCuda:
    """CPU tensors that say they are on CUDA and log `record_stream` (`fast.scoping.used_on`)."""

    def __init__(self):
        import torch

        log = self.log = []

        class FakeCuda(torch.Tensor):
            @property
            def is_cuda(self):
                return True

            def record_stream(self, stream):
                log.append((self.data_ptr(), stream))

        self.cls = FakeCuda

    def __call__(self, *shape):
        import torch

        return torch.zeros(*shape).as_subclass(self.cls)


def test_used_on_marks_every_cuda_tensor_in_nested_values_on_the_current_stream(monkeypatch):
    """`fast.scoping.used_on`: every CUDA tensor in tensors, lists, tuples, dicts and objects' attributes (nested,
    `tensors_in`) gets `record_stream` on the given stream, or else the calling thread's current stream of the device;
    CPU tensors and other values are skipped, and with no CUDA tensor the current stream is never asked for (a
    CPU-only process has none)."""
    import torch

    from raincheck_hf.fast import scoping

    fake, asked = _FakeCuda(), []
    monkeypatch.setattr(scoping.torch.cuda, "current_stream", lambda device=None: asked.append(device) or "stream")
    a, b, c = fake(2), fake(3), fake(4)
    scoping.used_on((a, [b, {"x": (c, torch.zeros(2), 7, None)}], "text"), device="cuda:1")
    assert sorted(fake.log) == sorted((t.data_ptr(), "stream") for t in (a, b, c)) and asked == ["cuda:1"]
    scoping.used_on((torch.zeros(2), [torch.ones(1)], {"k": None}))
    assert len(fake.log) == 3 and asked == ["cuda:1"]
    scoping.used_on(types.SimpleNamespace(x=[a]), "given")  # (an object's attributes; a stream given: none asked)
    assert fake.log[-1] == (a.data_ptr(), "given") and len(fake.log) == 4 and asked == ["cuda:1"]


def test_replays_and_leases_mark_their_static_tensors_used_on_the_callers_stream(model, processor, monkeypatch):
    """What a captured graph reads and writes by address outside its pool was made on the capturing thread's stream;
    a replay or a lease on another stream marks it used there (`fast.scoping.used_on`), before the
    replay's own work: a vision tower replay its static pixels and precomputed grid tensors, a selection replay its
    run's inputs and buffers, a storage's lease its KV tensors, slot keys and the captured steps' buffers (when the
    lease's stream is not the last lease's: every turn on one stream marks nothing, nothing on a CPU). Freed (an
    evicted graph, an evicted storage) with a replay still queued, their blocks went to the capturing stream's next
    allocation at once."""
    import torch

    from raincheck_hf.fast import graphs as step_graphs
    from raincheck_hf.fast import static_cache, vision_graphs
    from raincheck_hf.fast.scoping import tensors_in
    from raincheck_hf.fast.vision_graphs import CapturedTower, VisionGraphs
    from raincheck_hf.models import get_adapter
    from raincheck_hf.selection import kernels

    from conftest import INPUT_CASES, make_inputs

    marked = []  # per call, the ids of the tensors it marks and the stream it names

    def used(obj, stream=None, device=None):
        marked.append(({id(t) for t in tensors_in(obj)}, stream))

    def ids(*objs):
        return {id(t) for t in tensors_in(objs)}

    # the vision tower
    monkeypatch.setattr(vision_graphs, "used_on", used)
    log = []

    class Graph:
        def replay(self):
            log.append(("replay", len(marked)))

    def capture(self, tower, key, pixel_values, grid_thw, kwargs):
        outputs = self._forward(tower, pixel_values.clone(), grid_thw, kwargs)
        return self._store(key, CapturedTower(Graph(), pixel_values.clone(), outputs, (kwargs, grid_thw)))

    monkeypatch.setattr(VisionGraphs, "_capture", capture)
    tower_graphs = VisionGraphs(get_adapter(model), use_graphs=True)
    x = make_inputs(processor, **INPUT_CASES["one_image"])
    with torch.no_grad():
        for _ in range(2):
            tower_graphs.encode(x["pixel_values"], x["image_grid_thw"])
    (entry,) = tower_graphs._captured.values()
    assert log == [("replay", 1)] and marked[0] == (ids(entry.pixels, entry.reads), None)

    # the selection's greedy run
    marked.clear()
    monkeypatch.setattr(kernels, "used_on", used)
    inputs = {"P": torch.rand(1, 8, 6), "W": torch.rand(1, 8)}
    run = kernels.GreedyRun("mmtok", {k: v.clone() for k, v in inputs.items()}, 3)  # (its buffers; never launched)
    captured = kernels._Captured(Graph(), run)
    table = collections.OrderedDict({kernels._key("mmtok", inputs, 3): captured})
    monkeypatch.setitem(kernels._GRAPHS, torch.device("cpu"), table)
    log.clear()
    kernels.greedy_select("mmtok", inputs, 3, use_graphs=True)
    assert log == [("replay", 1)]
    assert marked[0] == (ids(run.inputs, run.state, run.slots, run.taken, run.indices), None)

    # a pooled storage's lease: from another stream than the last lease's only (every turn on one stream: never)
    monkeypatch.setattr(static_cache, "used_on", used)
    storage = static_cache.SlotStorage(2, 64, 64, "cpu")
    storage.layer_tensors(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    storage.graphs = step_graphs.StepGraphs(get_adapter(model), use_graphs=False)
    buffers = step_graphs.StepBuffers.empty(3, 8, 0, torch.float32, "cpu")
    storage.graphs._captured[step_graphs.StepKey(3, False, None, 64)] = (Graph(), buffers)
    marked.clear()
    storage.lease(object.__new__(static_cache.StaticDeferredCache))
    assert marked == []  # (a CPU storage: no streams)
    streams = iter(["default", "default", "side", "side", "default"])
    monkeypatch.setattr(static_cache.torch.cuda, "current_stream", lambda device=None: next(streams))
    storage.device = torch.device("cuda")  # (stands in for a CUDA storage)
    leases = []
    for _ in range(5):
        storage.lease(object.__new__(static_cache.StaticDeferredCache))
        leases.append(len(marked))
    assert leases == [1, 1, 2, 2, 3]  # marked at the first lease and at each change of stream
    assert marked[-1] == (ids(storage.keys, storage.values, storage.slot_keys, vars(buffers)), "default")
