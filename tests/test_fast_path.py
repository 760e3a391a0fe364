"""The fast path's code (static KV slots, padded chunks, DeepStack through hooks) computes what the
eager engine computes. On CPU it runs without CUDA graphs; tests/test_gpu.py checks graph replay."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from raincheck_hf import Conversation, RaincheckConfig, restore_pending
from raincheck_hf.fast import StaticDeferredCache
from raincheck_hf.tiny import draw_test_image

from conftest import INPUT_CASES, make_inputs

KW = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _pair(model, inputs, **cfg):
    slow = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **KW)
    fast = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, **cfg), **KW)
    return slow, fast


def _assert_same(slow, fast):
    assert isinstance(fast.cache, StaticDeferredCache) and not isinstance(slow.cache, StaticDeferredCache)
    assert torch.equal(slow.sequences, fast.sequences)
    for a, b in zip(slow.logits, fast.logits):
        assert (a - b).abs().max() <= 1e-5
    assert [r.tolist() for r in slow.raincheck.restored_per_forward] == [
        r.tolist() for r in fast.raincheck.restored_per_forward]


@pytest.mark.parametrize("mode", ["raincheck", "serial", "full", "hard", "post_answer"])
def test_fast_path_matches_eager_engine(model, case_inputs, mode):
    # chunk 4 over 3-row leftovers exercises the padded last chunk
    _assert_same(*_pair(model, case_inputs, mode=mode, chunk_size=4, decode_guard=2))


def test_fast_path_eager_attention(eager_model, processor):
    _assert_same(*_pair(eager_model, make_inputs(processor, **INPUT_CASES["two_images"]), chunk_size=3,
                        decode_guard=1))


def test_fast_path_second_turn_and_growth(model, processor, monkeypatch):
    from test_generation import second_turn

    import raincheck_hf.fast.static_cache as static_cache

    monkeypatch.setattr(static_cache, "SLOT_ROUNDING", 16)  # so that the second turn must grow the buffers
    first = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = dict(retention=0.25, chunk_size=3, decode_guard=7)
    slow1, fast1 = _pair(model, first, **cfg)
    restore_pending(model, slow1.cache, max_tokens=3)
    restore_pending(model, fast1.cache, max_tokens=3)
    capacity = fast1.cache.capacity
    # a long second answer forces the slot buffers to grow (and captured graphs to be dropped)
    second = second_turn(processor, slow1.sequences, images=(draw_test_image(256, 256, seed=4),))
    kw = dict(KW, max_new_tokens=20)
    slow2 = model.generate(**second, cache=slow1.cache, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    fast2 = model.generate(**second, cache=fast1.cache, raincheck=RaincheckConfig(fast_path=True, **cfg), **kw)
    assert fast2.cache.capacity > capacity
    _assert_same(slow2, fast2)
    for ls, lf in zip(slow2.cache.layers, fast2.cache.layers):
        n = slow2.cache.num_rows
        assert torch.allclose(ls.keys, lf.keys[:, :, :n], atol=1e-5)


def test_fast_path_conversation(model, processor):
    results = {}
    for fast in (False, True):
        with Conversation(model, processor, RaincheckConfig(chunk_size=3, decode_guard=6, fast_path=fast),
                          background=False, max_new_tokens=8) as conv:
            conv.ask("What is in this image?", images=[draw_test_image(128, 96, seed=1)])
            conv.complete()
            results[fast] = conv.ask("And now?").token_ids
    assert torch.equal(results[False], results[True])


def test_fast_path_bucketed_prefill_matches_eager_engine(model, processor, monkeypatch):
    """The CUDA prefill layout ([leftover deferred rows, padding, input rows], padded to a bucket), run on CPU."""
    import raincheck_hf.fast.graphs as graphs

    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 16)
    init = graphs.StepGraphs.__init__

    def padded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_prefill = True

    monkeypatch.setattr(graphs.StepGraphs, "__init__", padded)
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    for mode in ("raincheck", "full", "post_answer"):
        slow, fast = _pair(model, inputs, mode=mode, chunk_size=4, decode_guard=2)
        _assert_same(slow, fast)
        assert fast.cache.scratch == 16
    # a follow-up whose prefill carries leftovers in front of the padding
    from test_generation import second_turn

    cfg = dict(mode="post_answer", chunk_size=4, decode_guard=2)
    slow, fast = _pair(model, inputs, **cfg)
    second = second_turn(processor, slow.sequences)
    slow2 = model.generate(**second, cache=slow.cache, raincheck=RaincheckConfig(fast_path=False, **cfg), **KW)
    fast2 = model.generate(**second, cache=fast.cache, raincheck=RaincheckConfig(fast_path=True, **cfg), **KW)
    assert slow2.raincheck.restored_per_forward[0].numel() > 0
    _assert_same(slow2, fast2)


def test_slot_storage_is_reused_only_when_free(model, processor):
    import copy

    from raincheck_hf.fast import release_storage

    release_storage(model)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = RaincheckConfig(fast_path=True, chunk_size=4, decode_guard=2)
    first = model.generate(**inputs, raincheck=cfg, **KW)
    storage = first.cache.storage
    second = model.generate(**inputs, raincheck=cfg, **KW)  # the first cache is alive: its own storage
    assert second.cache.storage is not storage
    assert torch.equal(first.sequences, second.sequences)
    clone = copy.deepcopy(second.cache)  # a copy owns other tensors with the same contents
    assert clone.storage is not second.cache.storage and clone.storage is not storage
    assert torch.equal(clone.slot_keys, second.cache.slot_keys)
    for a, b in zip(clone.layers, second.cache.layers):
        assert torch.equal(a.keys, b.keys) and a.keys.data_ptr() != b.keys.data_ptr()
    del first, clone  # no gc.collect(): a dropped cache frees its storage at once (no reference cycle)
    third = model.generate(**inputs, raincheck=cfg, **KW)  # the first conversation is gone: its storage is reused
    assert third.cache.storage is storage
    assert torch.equal(third.sequences, second.sequences)
    for a, b in zip(third.logits, second.logits):
        assert (a - b).abs().max() <= 1e-6
    assert release_storage(model) >= 2


def test_storage_pool_reuses_free_storages_and_evicts_the_oldest_free_one(monkeypatch):
    import raincheck_hf.fast.static_cache as static_cache

    monkeypatch.setattr(static_cache, "POOLED_PER_MODEL", 2)
    key = torch.nn.Linear(1, 1)  # any module: the pool is keyed by the text model

    class User:  # what a cache is to the pool: something weakly referenced
        pass

    a_user, b_user = User(), User()
    a = static_cache.acquire_storage(key, a_user, 2, 256, 64, "cpu")
    b = static_cache.acquire_storage(key, b_user, 2, 256, 64, "cpu")
    assert a is not b and a.busy and b.busy  # both in use: two storages of the same size
    a.slot_keys[:3] = 7
    del a_user
    c_user = User()
    assert static_cache.acquire_storage(key, c_user, 2, 256, 64, "cpu") is a  # a's user is gone: reused
    assert bool((a.slot_keys == static_cache.MAX_KEY).all())  # with every slot invisible again
    del b_user
    d_user = User()
    d = static_cache.acquire_storage(key, d_user, 2, 512, 64, "cpu")  # another size, pool full: b (free) evicted
    assert static_cache._POOLS[key] == [a, d]
    e_user = User()
    e = static_cache.acquire_storage(key, e_user, 2, 1024, 64, "cpu")  # nothing free to evict: not pooled
    assert e not in static_cache._POOLS[key] and e.busy
    assert static_cache.round_capacity(1) == 256 and static_cache.round_capacity(1914) == 2048
    assert static_cache.round_capacity(2048) == 2048 and static_cache.round_capacity(2049) == 4096


def test_graphs_are_dropped_when_the_attention_backend_changes(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = RaincheckConfig(fast_path=True, chunk_size=4, decode_guard=2)
    out = model.generate(**inputs, raincheck=cfg, **KW)
    graphs, logits = out.cache.graphs, out.logits
    graphs._captured[(1, True)] = ("stale graph", None)  # stands in for a capture (CPU runs no graphs)
    del out  # its storage (and these graphs) go to the next conversation
    model.set_attn_implementation("eager")
    try:
        again = model.generate(**inputs, raincheck=cfg, **KW)
    finally:
        model.set_attn_implementation("sdpa")
    assert again.cache.graphs is graphs and graphs._captured == {} and graphs.attn_implementation == "eager"
    for a, b in zip(logits, again.logits):
        assert (a - b).abs().max() <= 1e-4


class _EagerReplay:
    """A stand-in for a captured CUDA graph on CPU: `replay` runs the captured step on its buffers."""

    def __init__(self, run):
        self.replay = run


@pytest.fixture
def cpu_graphs(monkeypatch):
    """StepGraphs on CPU with graph capture replaced by `_EagerReplay`: the decode loop's prepare-ahead /
    launch path, static buffers refilled every step, and bucketed prefills run exactly as on CUDA.
    Yields the log of (rows, want_logits, launched-from-a-prepared-step) per replay."""
    import raincheck_hf.fast.graphs as graphs

    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 16)
    init = graphs.StepGraphs.__init__
    log = []

    def with_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_graphs = self.pad_prefill = True

    current = {}  # the cache a replay works on: a real graph holds the storage's tensors, not the cache object

    def capture(self, adapter, cache, rows, want_logits, start):
        first = cache.total_slots - rows
        if first < start:
            return None
        buffers = graphs.StepBuffers.empty(rows, self.hidden, self.num_deepstack, adapter.dtype, adapter.device)
        torch.arange(first, cache.total_slots, out=buffers.slots)
        self._step(adapter, cache, buffers, want_logits)  # the real capture's warm-up writes these slots too

        def replay():
            log.append((rows, want_logits, current["prepared"]))
            self._step(current["adapter"], current["cache"](), buffers, want_logits)

        self._captured[(rows, want_logits)] = (_EagerReplay(replay), buffers)
        return self._captured[(rows, want_logits)]

    run, launch = graphs.StepGraphs.run, graphs.StepGraphs.launch

    def logged_run(self, adapter, cache, *args, **kwargs):
        current.update(adapter=adapter, cache=weakref.ref(cache), prepared=False)  # weak: the cache may die
        return run(self, adapter, cache, *args, **kwargs)

    def prepare_then_launch(self, cache, step):
        current.update(cache=weakref.ref(cache), prepared=True)
        return launch(self, cache, step)

    monkeypatch.setattr(graphs.StepGraphs, "__init__", with_graphs)
    monkeypatch.setattr(graphs.StepGraphs, "_capture", capture)
    monkeypatch.setattr(graphs.StepGraphs, "run", logged_run)
    monkeypatch.setattr(graphs.StepGraphs, "launch", prepare_then_launch)
    from raincheck_hf.fast.static_cache import _POOLS

    _POOLS.clear()  # storages pooled by other tests hold graphs captured without the stand-in
    yield log
    _POOLS.clear()


@pytest.mark.parametrize("mode", ["raincheck", "serial", "full", "post_answer"])
def test_prepared_steps_replay_what_the_eager_engine_computes(model, processor, cpu_graphs, mode):
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cfg = dict(mode=mode, chunk_size=4, decode_guard=2)
    _pair(model, inputs, **cfg)  # captures every shape (the first replay of a shape comes from `run`)
    gc.collect()  # its cache gives the storage (and the graphs) back to the pool
    cpu_graphs.clear()
    slow, fast = _pair(model, inputs, **cfg)
    _assert_same(slow, fast)
    prepared = [entry for entry in cpu_graphs if entry[2]]
    # every decode forward after the first was prepared ahead (serial: its chunk forward; the token's follows)
    generated = fast.sequences.shape[1] - inputs["input_ids"].shape[1]
    assert generated > 4 and len(prepared) == generated - 1
    if mode in ("raincheck", "serial"):
        chunk_rows = 4 if mode == "serial" else 5
        assert any(rows == chunk_rows for rows, _, was_prepared in prepared)


def test_concurrent_conversations_never_lease_the_same_storage(monkeypatch):
    import threading
    import time

    import raincheck_hf.fast.static_cache as static_cache

    key = torch.nn.Linear(1, 1)  # stands for a text model (the pool's key)
    first = static_cache.acquire_storage(key, _Owner(), 2, 256, 64, torch.device("cpu"))
    first.release()  # a free storage of the right size, which both threads will want
    matches = static_cache.SlotStorage.matches

    def slow_matches(self, *args):
        time.sleep(0.05)  # the other thread looks at the pool meanwhile
        return matches(self, *args)

    monkeypatch.setattr(static_cache.SlotStorage, "matches", slow_matches)
    owners, leased = [_Owner(), _Owner()], [None, None]

    def acquire(i):
        leased[i] = static_cache.acquire_storage(key, owners[i], 2, 256, 64, torch.device("cpu"))

    threads = [threading.Thread(target=acquire, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert leased[0] is not leased[1] and first in leased


class _Owner:
    """Anything a storage can be leased to (it holds its user weakly)."""
