"""The fast path's code (static KV slots and GDN state buffers, padded chunks, DeepStack through hooks)
computes what the eager engine computes. On CPU it runs without CUDA graphs; tests/test_gpu.py checks
graph replay. The conversation-level checks run for every family with a fast path (`FAST_FAMILIES`):
Qwen3-VL (attention only) and Qwen3.5 / Qwen3.5-MoE (Gated DeltaNet states in static buffers)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import threading
import weakref

import pytest
import torch

from raincheck_hf import Conversation, RaincheckConfig, restore_pending
from raincheck_hf.fast import StaticDeferredCache
from raincheck_hf.tiny import draw_test_image, draw_test_video

from conftest import INPUT_CASES, count_compiled_calls, in_threads, make_inputs, no_placeholder_ids
from families import family_model, family_params, family_processor

KW = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
FAST_FAMILIES = family_params(["qwen3_vl", "qwen3_5", "qwen3_5_moe"])
MODES = ["raincheck", "serial", "full", "hard", "post_answer"]


def _kw(model, **extra):
    return dict(KW, suppress_tokens=no_placeholder_ids(model), **extra)


def _pair(model, inputs, kw=None, **cfg):
    kw = _kw(model) if kw is None else kw
    slow = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    fast = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, **cfg), **kw)
    return slow, fast


def _assert_same(slow, fast):
    assert isinstance(fast.cache, StaticDeferredCache) and not isinstance(slow.cache, StaticDeferredCache)
    assert torch.equal(slow.sequences, fast.sequences)
    for a, b in zip(slow.logits, fast.logits):
        assert (a - b).abs().max() <= 1e-5
    assert [r.tolist() for r in slow.raincheck.restored_per_forward] == [
        r.tolist() for r in fast.raincheck.restored_per_forward]


def _assert_same_state(slow_cache, fast_cache):
    """Every layer's stored state: attention KV rows, or a GDN layer's live recurrent state and conv window."""
    from raincheck_hf.gdn.algebra import hf_conv_state_to_history

    n = slow_cache.num_rows
    for i, (ls, lf) in enumerate(zip(slow_cache.layers, fast_cache.layers)):
        if i in fast_cache.storage.gdn:
            gdn = fast_cache.gdn_state(i)
            assert torch.allclose(slow_cache.get_recurrent_state(i), gdn.state, atol=1e-5)
            history = hf_conv_state_to_history(slow_cache.get_conv_state(i), gdn.width + 1)
            assert torch.allclose(history, gdn.conv, atol=1e-6)
        else:
            assert torch.allclose(ls.keys, lf.keys[:, :, :n], atol=1e-5)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
@pytest.mark.parametrize("mode", MODES)
def test_fast_path_matches_eager_engine(family, case, mode):
    _, model, processor = family
    # chunk 4 over 3-row leftovers exercises the padded last chunk
    slow, fast = _pair(model, make_inputs(processor, **INPUT_CASES[case]), mode=mode, chunk_size=4, decode_guard=2)
    _assert_same(slow, fast)
    if mode == "raincheck":
        sizes = [r.numel() for r in fast.raincheck.restored_per_forward[1:] if r.numel()]
        assert sizes and max(sizes) == 4
    if mode != "hard":
        while fast.cache.num_pending:  # the idle-time chunk step, the last one short
            assert torch.equal(restore_pending(model, slow.cache, max_tokens=4),
                               restore_pending(model, fast.cache, max_tokens=4))
        _assert_same_state(slow.cache, fast.cache)


def test_fast_path_eager_attention(eager_model, processor):
    _assert_same(*_pair(eager_model, make_inputs(processor, **INPUT_CASES["two_images"]), chunk_size=3,
                        decode_guard=1))


def test_fast_path_eager_attention_gdn(eager_qwen35, processor):
    _assert_same(*_pair(eager_qwen35, make_inputs(processor, **INPUT_CASES["two_images"]), chunk_size=3,
                        decode_guard=1))


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_fast_path_matches_eager_engine_over_three_turns(family, mode):
    """Turn 1: an image and a video; turn 2: a four-frame video with turn 1's leftovers in its prefill; turn 3:
    text only (a chunk of 2 leaves a short last chunk; the guard holds chunks back for two tokens)."""
    _three_turns_fast_equals_eager(family, mode=mode, retention=0.3, chunk_size=2, decode_guard=3)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
@pytest.mark.parametrize("order", ["relevance", "attention"])
def test_fast_path_restore_orders_match_eager_engine_over_three_turns(family, order):
    """The same with the deferred rows restored out of source order: the static slots and GDN buffers take the
    chunks in restoration order, as the eager engine does (the eager engine against the reference: test_families)."""
    outs = _three_turns_fast_equals_eager(family, mode="raincheck", retention=0.3, chunk_size=2, decode_guard=3,
                                          restore_order=order)
    trace = outs[0][1].raincheck
    restored = torch.cat([r for r in trace.restored_per_forward[1:]] + [trace.pending]).tolist()
    assert sorted(restored) == trace.deferred.tolist() and restored != trace.deferred.tolist()


def _three_turns_fast_equals_eager(family, **cfg):
    from test_families import follow_up

    _, model, processor = family
    mode = cfg["mode"]
    kw = _kw(model, max_new_tokens=6)
    turns = [make_inputs(processor, **INPUT_CASES["image_and_video"])]
    outs = [_pair(model, turns[0], _kw(model, max_new_tokens=5), **cfg)]
    turns.append(follow_up(model, processor, outs[0][0].sequences, videos=(draw_test_video(4, 64, 96, seed=8),),
                           text="What happens now?", video_fps=4.0))
    outs.append(tuple(model.generate(**turns[1], cache=prev.cache, raincheck=RaincheckConfig(fast_path=fast, **cfg),
                                     **kw) for prev, fast in zip(outs[0], (False, True))))
    turns.append(follow_up(model, processor, outs[1][0].sequences, text="And the colours?"))
    outs.append(tuple(model.generate(**turns[2], cache=prev.cache, raincheck=RaincheckConfig(fast_path=fast, **cfg),
                                     **kw) for prev, fast in zip(outs[1], (False, True))))
    for slow, fast in outs:
        _assert_same(slow, fast)
    if mode not in ("hard", "full"):
        assert outs[1][1].raincheck.restored_per_forward[0].numel() > 0  # leftovers rode on the prefill
    _assert_same_state(outs[2][0].cache, outs[2][1].cache)
    return outs


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_fast_path_second_turn_and_growth(family, monkeypatch):
    from test_generation import second_turn

    import raincheck_hf.fast.static_cache as static_cache

    _, model, processor = family
    monkeypatch.setattr(static_cache, "SLOT_ROUNDING", 16)  # so that the second turn must grow the buffers
    first = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = dict(retention=0.25, chunk_size=3, decode_guard=7)
    slow1, fast1 = _pair(model, first, **cfg)
    restore_pending(model, slow1.cache, max_tokens=3)
    restore_pending(model, fast1.cache, max_tokens=3)
    capacity, storage = fast1.cache.capacity, fast1.cache.storage
    # a long second answer forces the slot buffers to grow (and captured graphs to be dropped)
    second = second_turn(processor, slow1.sequences, images=(draw_test_image(256, 256, seed=4),))
    kw = _kw(model, max_new_tokens=20)
    slow2 = model.generate(**second, cache=slow1.cache, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    fast2 = model.generate(**second, cache=fast1.cache, raincheck=RaincheckConfig(fast_path=True, **cfg), **kw)
    assert fast2.cache.capacity > capacity and fast2.cache.storage is not storage
    _assert_same(slow2, fast2)
    _assert_same_state(slow2.cache, fast2.cache)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_fast_path_conversation(family):
    _, model, processor = family
    results = {}
    for fast in (False, True):
        with Conversation(model, processor, RaincheckConfig(chunk_size=3, decode_guard=6, fast_path=fast),
                          background=False, max_new_tokens=8) as conv:
            streamed = conv.ask("What is in this image?", images=[draw_test_image(128, 96, seed=1)], stream=True,
                                suppress_tokens=no_placeholder_ids(model))
            assert "".join(streamed) == streamed.result.text
            conv.complete()
            results[fast] = conv.ask("And now?", suppress_tokens=no_placeholder_ids(model)).token_ids
    assert torch.equal(results[False], results[True])


def test_gdn_states_are_copied_with_the_cache(qwen35, processor):
    """A deep copy of a Qwen3.5 fast-path cache (pending rows, a recorded suffix) owns GDN buffers of its own
    with the same contents; both continue to the same answer."""
    import copy

    from test_generation import second_turn

    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = RaincheckConfig(fast_path=True, mode="post_answer", retention=0.25, chunk_size=3)
    first = qwen35.generate(**inputs, raincheck=cfg, **_kw(qwen35))
    assert first.cache.num_pending and first.cache.suffix_length > 3  # the map and the leading record are in use
    clone = copy.deepcopy(first.cache)
    for i, state in first.cache.storage.gdn.items():
        for a, b in zip(state.tensors(), clone.gdn_state(i).tensors()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    second = second_turn(processor, first.sequences)
    a = qwen35.generate(**second, cache=first.cache, raincheck=cfg, **_kw(qwen35))
    b = qwen35.generate(**second, cache=clone, raincheck=cfg, **_kw(qwen35))
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_fast_path_bucketed_prefill_matches_eager_engine(family, monkeypatch):
    """The CUDA prefill layout ([leftover deferred rows, padding, input rows], padded to a bucket), run on CPU;
    for a GDN family the padding in front of a turn's input rows is gated off and skipped by the conv."""
    import raincheck_hf.fast.graphs as graphs

    _, model, processor = family
    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 16)
    init = graphs.StepGraphs.__init__

    def padded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_prefill = True

    monkeypatch.setattr(graphs.StepGraphs, "__init__", padded)
    step_rows = []
    step = graphs.StepGraphs._step

    def logged(self, adapter, cache, buffers, *args, **kwargs):
        step_rows.append(buffers.rows)
        return step(self, adapter, cache, buffers, *args, **kwargs)

    monkeypatch.setattr(graphs.StepGraphs, "_step", logged)
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    for mode in ("raincheck", "full", "post_answer"):
        step_rows.clear()
        slow, fast = _pair(model, inputs, mode=mode, chunk_size=4, decode_guard=2)
        _assert_same(slow, fast)
        assert fast.cache.scratch == 16
        prefill = step_rows[0]
        assert prefill % 16 == 0 and prefill > slow.raincheck.restored_per_forward[0].numel()  # padded
        _assert_same_state(slow.cache, fast.cache)
    # a follow-up whose prefill carries leftovers in front of the padding
    from test_generation import second_turn

    cfg = dict(mode="post_answer", chunk_size=4, decode_guard=2)
    kw = _kw(model)
    slow, fast = _pair(model, inputs, kw=kw, **cfg)
    second = second_turn(processor, slow.sequences)
    slow2 = model.generate(**second, cache=slow.cache, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    fast2 = model.generate(**second, cache=fast.cache, raincheck=RaincheckConfig(fast_path=True, **cfg), **kw)
    assert slow2.raincheck.restored_per_forward[0].numel() > 0
    _assert_same(slow2, fast2)
    _assert_same_state(slow2.cache, fast2.cache)


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


def test_graphs_are_set_aside_while_the_attention_backend_differs(model, processor):
    """Graphs captured with one attention backend never run under another; switching back takes them up
    again (no second capture when settings alternate)."""
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = RaincheckConfig(fast_path=True, chunk_size=4, decode_guard=2)
    out = model.generate(**inputs, raincheck=cfg, **KW)
    graphs, logits = out.cache.graphs, out.logits
    from raincheck_hf.fast.graphs import StepBuffers

    stale = ("stale graph", StepBuffers.empty(1, 8, 0, torch.float32, "cpu"))  # (a capture: CPU runs no graphs)
    graphs._captured[(1, True)] = stale
    del out  # its storage (and these graphs) go to the next conversation
    model.set_attn_implementation("eager")
    try:
        again = model.generate(**inputs, raincheck=cfg, **KW)
    finally:
        model.set_attn_implementation("sdpa")
    assert again.cache.graphs is graphs and graphs._captured == {} and graphs.attn_implementation == "eager"
    for a, b in zip(logits, again.logits):
        assert (a - b).abs().max() <= 1e-4
    del again
    back = model.generate(**inputs, raincheck=cfg, **KW)
    assert back.cache.graphs is graphs and graphs.attn_implementation == "sdpa"
    assert graphs._captured == {(1, True): stale}


class _EagerReplay:
    """A stand-in for a captured CUDA graph on CPU: `replay` runs the captured step on its buffers."""

    def __init__(self, run):
        self.replay = run


class _ReplayLog(list):
    """`cpu_graphs`' log; ``ahead``: per replay launched by `StepGraphs.run_ahead`, whether the cache had not
    registered its rows yet (a turn's first forward, launched before the selection is read)."""

    def __init__(self):
        super().__init__()
        self.ahead = []

    def clear(self):
        super().clear()
        self.ahead.clear()


@pytest.fixture
def cpu_graphs(monkeypatch):
    """StepGraphs on CPU with graph capture replaced by `_EagerReplay`: the decode loop's prepare-ahead /
    launch path, static buffers refilled every step, and bucketed prefills run exactly as on CUDA.
    Yields the log of (rows, want_logits, launched-from-a-prepared-step) per replay."""
    import raincheck_hf.fast.graphs as graphs

    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 16)
    init = graphs.StepGraphs.__init__
    log = _ReplayLog()

    def with_graphs(self, adapter, *args, **kwargs):
        init(self, adapter, *args, **kwargs)
        self.use_graphs, self.pad_prefill = True, adapter.bucketed_prefill

    # the cache a replay works on (a real graph holds the storage's tensors, not the cache object), per thread:
    # conversations on several threads replay at once
    current = threading.local()

    def capture(self, adapter, cache, rows, want_logits, start, bucket=None, variant=None, timed=True):
        bucket = cache.capacity if bucket is None else bucket
        first = cache.total_slots - rows
        if first < start:
            return None
        buffers = graphs.StepBuffers.empty(rows, self.hidden, self.num_deepstack, adapter.dtype, adapter.device,
                                           step_info=adapter.has_linear_attention)
        torch.arange(first, cache.total_slots, out=buffers.slots)
        saved = graphs._recurrent_snapshot(cache)
        self._step(adapter, cache, buffers, want_logits, bucket, variant)  # the real capture's warm-up writes these slots
        graphs._recurrent_restore(cache, saved)  # ... and puts the GDN states back, as here
        storage = cache.storage  # (the graph's: it holds this storage's tensors)

        def replay():
            # a real replay runs no Python: the replaying cache's layer objects are left as they were (not
            # lazily pointed at the storage's tensors, which the graph reads and writes by address)
            log.append((rows, want_logits, current.prepared))
            cache = current.cache()
            if getattr(current, "ahead", None) is not None:  # launched before its rows were registered
                log.ahead.append(cache.num_rows == current.ahead)
            assert cache.storage is storage, "a graph replayed on another storage's cache"
            layers = [(layer.keys, layer.values, layer.is_initialized) for layer in cache.layers]
            self._step(current.adapter, cache, buffers, want_logits, bucket, variant)
            for layer, (keys, values, initialized) in zip(cache.layers, layers):
                layer.keys, layer.values, layer.is_initialized = keys, values, initialized

        key = graphs.StepKey(rows, want_logits, variant, bucket)
        self._captured[key] = (_EagerReplay(replay), buffers)
        return self._captured[key]

    run, run_ahead, launch = graphs.StepGraphs.run, graphs.StepGraphs.run_ahead, graphs.StepGraphs.launch

    def logged_run(self, adapter, cache, *args, **kwargs):
        current.adapter, current.cache, current.prepared = adapter, weakref.ref(cache), False  # (weak: it may die)
        return run(self, adapter, cache, *args, **kwargs)

    def logged_run_ahead(self, adapter, cache, *args, **kwargs):  # a turn's first forward, rows registered after
        current.adapter, current.cache, current.prepared = adapter, weakref.ref(cache), False
        before = cache.num_rows
        current.ahead = before
        try:
            return run_ahead(self, adapter, cache, *args, **kwargs)
        finally:
            current.ahead = None

    def prepare_then_launch(self, cache, step):
        current.cache, current.prepared = weakref.ref(cache), True
        return launch(self, cache, step)

    monkeypatch.setattr(graphs.StepGraphs, "__init__", with_graphs)
    monkeypatch.setattr(graphs.StepGraphs, "_capture", capture)
    monkeypatch.setattr(graphs.StepGraphs, "run", logged_run)
    monkeypatch.setattr(graphs.StepGraphs, "run_ahead", logged_run_ahead)
    monkeypatch.setattr(graphs.StepGraphs, "launch", prepare_then_launch)
    from raincheck_hf.fast.static_cache import _POOLS

    _POOLS.clear()  # storages pooled by other tests hold graphs captured without the stand-in
    yield log
    _POOLS.clear()


def test_a_failed_prefill_capture_leaves_the_steps_captured(qwen35, processor, cpu_graphs, monkeypatch):
    """A prefill bucket whose capture raises: a warning naming the prefill, that prefill and later ones run
    eagerly (unpadded), the decode and chunk steps are still captured and replayed, the answer unchanged."""
    import raincheck_hf.fast.graphs as graphs

    capture = graphs.StepGraphs._capture

    def failing(self, adapter, cache, rows, *args, **kwargs):
        if rows >= 16:  # the prefill buckets (16 rows each here); steps are 1, 4 or 5 rows
            raise RuntimeError("operation not permitted when stream is capturing")
        return capture(self, adapter, cache, rows, *args, **kwargs)

    monkeypatch.setattr(graphs.StepGraphs, "_capture", failing)
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cfg = dict(mode="raincheck", chunk_size=4, decode_guard=2)
    with pytest.warns(RuntimeWarning, match="prefill failed"):
        slow, fast = _pair(qwen35, inputs, kw=_kw(qwen35), **cfg)
    _assert_same(slow, fast)
    assert fast.cache.graphs.use_graphs and not fast.cache.graphs.pad_prefill
    assert cpu_graphs and all(rows in (1, 5) for rows, _, _ in cpu_graphs)  # decode and fused steps replayed


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_a_pooled_storage_carries_nothing_of_the_conversation_before(family, cpu_graphs, monkeypatch):
    """Issue 28: a conversation whose first forward replays a graph an earlier conversation captured on the same
    pooled storage, and which then grows into another pooled storage, keeps its own rows: the move to the bigger
    storage copied the KV rows only for layers that had run Python (a replay never does), so the earlier
    conversation's KV stayed in the new storage's slots and the follow-up read it."""
    from test_generation import second_turn

    import raincheck_hf.fast.static_cache as static_cache

    _, model, processor = family
    monkeypatch.setattr(static_cache, "SLOT_ROUNDING", 16)  # so that the second turn must grow the buffers
    cfg = dict(retention=0.3, chunk_size=3, decode_guard=2)
    kw = _kw(model, max_new_tokens=10)

    def dialogue(seed, fast_path):
        first = make_inputs(processor, images=(draw_test_image(128, 96, seed=seed),), text="What is in this image?")
        one = model.generate(**first, raincheck=RaincheckConfig(fast_path=fast_path, **cfg), **kw)
        second = second_turn(processor, one.sequences)
        two = model.generate(**second, cache=one.cache, raincheck=RaincheckConfig(fast_path=fast_path, **cfg), **kw)
        return one, two

    earlier = dialogue(1, True)
    storages = {id(earlier[0].cache.storage), id(earlier[1].cache.storage)}
    del earlier
    gc.collect()  # both storages (and their graphs) go back to the pool
    cpu_graphs.clear()
    slow, fast = dialogue(5, False), dialogue(5, True)
    assert {id(fast[0].cache.storage), id(fast[1].cache.storage)} == storages  # the pooled ones, in turn
    assert cpu_graphs and not cpu_graphs[0][2]  # the first forward (the prefill) replayed a graph captured before
    assert cpu_graphs.ahead and all(cpu_graphs.ahead)  # ... launched before its rows were registered
    for a, b in zip(slow, fast):
        _assert_same(a, b)
    _assert_same_state(slow[1].cache, fast[1].cache)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_schedule_fuzz_on_replayed_steps(family, cpu_graphs, monkeypatch):
    """A few cases of the GPU schedule fuzz (tests/schedule_fuzz.py) on the fast path's code with the stand-in
    replays, one after the other on one model (storages and their graphs carry over): each conversation equals
    the eager engine's."""
    from schedule_fuzz import check_cases, make_case

    from conftest import no_placeholder_ids

    import raincheck_hf.fast.static_cache as static_cache

    monkeypatch.setattr(static_cache, "SLOT_ROUNDING", 16)  # conversations grow into other pooled storages
    spec, model, processor = family
    cases = [make_case(seed, spec.name) for seed in (3, 11, 17, 28, 32)]  # (32: chunks every third step)
    problems = check_cases(model, processor, cases, fast_path=True, threads=False, suppress=no_placeholder_ids(model),
                           atol=1e-4)
    assert not problems, "\n".join(problems)
    assert cpu_graphs  # the steps replayed


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"])
def test_schedule_fuzz_on_replayed_steps_in_threads(name, cpu_graphs, monkeypatch):
    """The GPU schedule fuzz's threaded part on the fast path's code with the stand-in replays: a family's eight
    cases at once, one thread each on one model, small storages (conversations grow into pooled ones, a storage
    another thread's conversation used before); each conversation equals the eager engine's, and every replay ran
    on a cache of the storage the graph belongs to. (This checks the host's side; on CUDA such runs once differed
    for a reason only the device has, a capture's warm-up on a side stream: `fast.scoping`.)"""
    from schedule_fuzz import check_cases, family_cases

    from conftest import no_placeholder_ids

    import raincheck_hf.fast.static_cache as static_cache

    monkeypatch.setattr(static_cache, "SLOT_ROUNDING", 16)
    model, processor = family_model(name), family_processor(name)
    cases = family_cases(name, 8)
    problems = check_cases(model, processor, cases, fast_path=True, threads=True, suppress=no_placeholder_ids(model),
                           atol=1e-4)
    assert not problems, "\n".join(p[-300:] for p in problems)
    assert cpu_graphs


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
@pytest.mark.parametrize("mode", ["raincheck", "serial", "full", "post_answer"])
def test_prepared_steps_replay_what_the_eager_engine_computes(family, cpu_graphs, mode):
    _, model, processor = family
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
    # the prefill (input rows only) replayed its bucket's graph, padded in front; then decode and chunk steps
    assert cpu_graphs[0][0] % 16 == 0 and not cpu_graphs[0][2]
    assert all(rows in (1, 4, 5) for rows, _, _ in cpu_graphs[1:])
    if fast.cache.storage.gdn:
        while fast.cache.num_pending:  # the captured idle-time chunk (the last one short), on the replayed states
            restore_pending(model, slow.cache, max_tokens=4)
            restore_pending(model, fast.cache, max_tokens=4)
        _assert_same_state(slow.cache, fast.cache)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_spaced_chunks_on_replayed_steps_match_the_eager_engine(family, cpu_graphs):
    """``chunk_every=3``: the fast path's replayed steps (fused steps on every third forward, plain ones between; on
    Qwen3.5 plain steps that record their row while rows are pending) equal the eager engine's, and so does the
    state after the rest is restored in idle time."""
    _, model, processor = family
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cfg = dict(mode="raincheck", chunk_size=4, decode_guard=1, chunk_every=3)
    slow, fast = _pair(model, inputs, **cfg)
    _assert_same(slow, fast)
    carried = [i for i, r in enumerate(fast.raincheck.restored_per_forward[1:], start=1) if r.numel()]
    assert len(carried) > 1 and all((i - 1) % 3 == 0 for i in carried)
    assert cpu_graphs  # the steps replayed
    while fast.cache.num_pending:
        restore_pending(model, slow.cache, max_tokens=4)
        restore_pending(model, fast.cache, max_tokens=4)
    _assert_same_state(slow.cache, fast.cache)


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


# ---- several chats on one model: nothing a step does is visible to another thread ------------------

class _PauseInside:
    """Holds one thread's forward inside decoder layer ``layer`` (a pre-hook) until released: another thread
    then works on the same model while the first one's fast-path step is half done."""

    def __init__(self, model, layer: int = 1):
        import threading

        self.thread, self.inside, self.release = None, threading.Event(), threading.Event()
        self.handle = model.model.language_model.layers[layer].register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        import threading

        if threading.get_ident() == self.thread and not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(timeout=60), "the paused forward was never released"


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
@pytest.mark.parametrize("other", ["fast_path_chat", "stock_generate", "eager_chat"])
def test_a_half_done_fast_path_step_is_invisible_to_another_thread(family, other):
    """Thread A is paused inside a fast-path forward (its DeepStack addends and few-query attention in
    effect); thread B meanwhile runs a whole request on the same model: both get what they get alone."""
    import threading

    _, model, processor = family
    a_inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    b_inputs = make_inputs(processor, **INPUT_CASES["one_image"])  # other shapes than A's rows
    a_cfg = RaincheckConfig(fast_path=True, chunk_size=4, decode_guard=2)
    b_kw = {"fast_path_chat": dict(raincheck=RaincheckConfig(fast_path=True, chunk_size=3, decode_guard=1)),
            "eager_chat": dict(raincheck=RaincheckConfig(fast_path=False, chunk_size=3, decode_guard=1)),
            "stock_generate": {}}[other]
    want_a = model.generate(**a_inputs, raincheck=a_cfg, **KW)
    want_b = model.generate(**b_inputs, **b_kw, **KW)
    pause = _PauseInside(model)
    got = {}

    def run_a():
        pause.thread = threading.get_ident()
        got["a"] = model.generate(**a_inputs, raincheck=a_cfg, **KW)

    a = threading.Thread(target=run_a)
    try:
        a.start()
        assert pause.inside.wait(timeout=60)
        got["b"] = model.generate(**b_inputs, **b_kw, **KW)  # while A's step is half done
    finally:
        pause.release.set()
        a.join()
        pause.handle.remove()
    assert model.model.language_model.config._attn_implementation == "sdpa"
    for key, want in (("a", want_a), ("b", want_b)):
        assert torch.equal(got[key].sequences, want.sequences), key
        for x, y in zip(got[key].logits, want.logits):
            assert (x - y).abs().max() <= 1e-5, key


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_two_fast_path_conversations_in_two_threads_on_one_model(family):
    """Two chats interleaved step by step (each waits for the other at every token): both answer as alone."""
    import threading

    from transformers import LogitsProcessorList

    _, model, processor = family
    images = [draw_test_image(128, 96, seed=1), draw_test_image(64, 128, seed=3)]
    cfg = RaincheckConfig(fast_path=True, chunk_size=3, decode_guard=2)

    def chat(image, processors=()):
        # both chats answer exactly 8 tokens (no early end of sequence), so the lockstep pairs every token
        kw = dict(min_new_tokens=8, suppress_tokens=no_placeholder_ids(model))
        with Conversation(model, processor, cfg, background=False, max_new_tokens=8) as conv:
            first = conv.ask("What is in this image?", images=[image], logits_processor=LogitsProcessorList(processors),
                             **kw)
            second = conv.ask("And now?", logits_processor=LogitsProcessorList(processors), **kw)
        return first.token_ids, second.token_ids

    alone = [chat(image) for image in images]
    barrier = threading.Barrier(2, timeout=60)

    def lockstep(input_ids, scores):  # a token of one chat, then a token of the other, ...
        barrier.wait()
        return scores

    results = [None, None]

    def run(i):
        results[i] = chat(images[i], [lockstep])

    errors = in_threads(run, 2, on_error=barrier.abort)
    assert not errors, errors
    for got, want in zip(results, alone):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_graph_captures_never_overlap(model, processor, monkeypatch):
    """Step and vision-tower captures from two threads run one at a time (CUDA's capture API replaced by
    stand-ins that notice an overlap: each capture waits a moment for the other thread to start one)."""
    import contextlib
    import threading
    from types import SimpleNamespace

    import raincheck_hf.fast.graphs as graphs
    from raincheck_hf.fast import scoping
    from raincheck_hf.fast.vision_graphs import VisionGraphs
    from raincheck_hf.models import get_adapter

    state = {"capturing": 0, "overlaps": 0}
    lock, entered = threading.Lock(), threading.Event()

    def capture_begin(pool=None, capture_error_mode="global"):
        with lock:
            state["capturing"] += 1
            state["overlaps"] += state["capturing"] > 1
        if state["capturing"] == 1:
            entered.wait(timeout=0.5)  # would see the other capture begin, if it could
        entered.set()

    def capture_end():
        with lock:
            state["capturing"] -= 1

    stream = SimpleNamespace(wait_stream=lambda other: None)
    cuda = SimpleNamespace(Stream=lambda device=None, priority=0: stream, current_stream=lambda: stream,
                           current_device=lambda: 0, stream=lambda s: contextlib.nullcontext(),
                           synchronize=lambda: None,
                           CUDAGraph=lambda: SimpleNamespace(pool=lambda: None, capture_begin=capture_begin,
                                                             capture_end=capture_end))
    monkeypatch.setattr(graphs.torch, "cuda", cuda)  # the torch module: restored after the test
    monkeypatch.setattr(scoping, "_CAPTURE_STREAMS", {})  # (the fake streams are not kept past the test)
    adapter = get_adapter(model)
    caches = [StaticDeferredCache(4, 256, 64, "cpu"), StaticDeferredCache(4, 256, 64, "cpu")]
    steps = [graphs.StepGraphs(adapter, use_graphs=False) for _ in caches]
    towers = [VisionGraphs(adapter, use_graphs=False) for _ in caches]
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    barrier = threading.Barrier(2)

    def capture(i):
        barrier.wait()
        steps[i]._capture(adapter, caches[i], 1, True, 0)
        towers[i]._capture(model.model.visual, ("grid", i), inputs["pixel_values"], inputs["image_grid_thw"],
                           adapter.vision_grid_kwargs(model.model.visual, inputs["image_grid_thw"]))

    with torch.no_grad():
        errors = in_threads(capture, 2)
    assert not errors, errors
    assert state["overlaps"] == 0 and all(s._captured for s in steps) and all(t._captured for t in towers)


@pytest.mark.parametrize("family", FAST_FAMILIES, indirect=True)
def test_a_larger_chunk_size_in_a_later_turn_grows_the_padding_room(family):
    """The static cache's scratch slots were sized for the first turn's chunk; a config changed between turns
    (chunk 3 -> 80, beyond the 64 scratch slots) moves the cache to a storage with room, for the idle-time
    chunk and for the next turn, and the answers stay the eager engine's (Qwen3.5: an 80-row chunk step runs
    the chunked GDN rule, its padding gated off)."""
    _, model, processor = family
    results = {}
    for fast in (False, True):
        cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=6, fast_path=fast)
        with Conversation(model, processor, cfg, background=False, max_new_tokens=8) as conv:
            conv.ask("What is in this image?", images=[draw_test_image(256, 256, seed=4)],
                     suppress_tokens=no_placeholder_ids(model))
            while conv.pending > 10:
                restore_pending(model, conv.cache, max_tokens=3)
            conv.config.chunk_size = 80  # the last <= 10 rows padded to 80: more padding than 64 scratch slots
            restored = conv.complete()
            second = conv.ask("And now?", images=[draw_test_image(256, 192, seed=5)], max_new_tokens=12,
                              suppress_tokens=no_placeholder_ids(model))
            if fast:
                assert conv.cache.scratch >= 81
            results[fast] = (restored, second.token_ids, second.trace.restored_per_forward)
    assert results[False][0] == results[True][0] > 0
    assert torch.equal(results[False][1], results[True][1])
    assert [r.tolist() for r in results[False][2]] == [r.tolist() for r in results[True][2]]


@pytest.mark.parametrize("bucket", [16, 48, 10**6])
def test_attention_over_the_used_slots_only(model, processor, monkeypatch, bucket):
    """Steps attend over their slot bucket (the used slots rounded up), not the whole storage: outputs equal the
    eager engine's whatever the bucket (10**6: every slot, as before buckets), and a step's attention and mask
    are as long as its bucket."""
    import raincheck_hf.fast.static_cache as static_cache
    from test_generation import second_turn

    monkeypatch.setattr(static_cache, "SLOT_BUCKET", bucket)
    seen = []
    update = static_cache.StaticDeferredLayer.update

    def spy(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        owner = self.owner
        if self.layer_idx == 0:
            seen.append((keys.shape[2], owner.attention_slots, owner.num_rows, owner.capacity))
        return keys, values

    monkeypatch.setattr(static_cache.StaticDeferredLayer, "update", spy)
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cfg = dict(chunk_size=4, decode_guard=2, retention=0.3)
    slow, fast = _pair(model, inputs, **cfg)
    _assert_same(slow, fast)
    second = second_turn(processor, slow.sequences)
    slow2 = model.generate(**second, cache=slow.cache, raincheck=RaincheckConfig(fast_path=False, **cfg), **KW)
    fast2 = model.generate(**second, cache=fast.cache, raincheck=RaincheckConfig(fast_path=True, **cfg), **KW)
    _assert_same(slow2, fast2)
    for length, attended, used, capacity in seen:
        assert length == attended == static_cache.slot_bucket(used, capacity) and used <= attended
    if bucket < 256:
        lengths = sorted({length for length, *_ in seen})
        assert len(lengths) >= 2 and lengths[0] < seen[-1][3]  # several buckets, the first below the capacity
    else:
        assert {length for length, *_ in seen} == {seen[-1][3]}


def test_slot_bucket():
    from raincheck_hf.fast.static_cache import SLOT_BUCKET, slot_bucket

    assert SLOT_BUCKET == 256
    assert [slot_bucket(n, 8192) for n in (1, 256, 257, 1024, 1025, 1402, 1914, 2048, 2049, 2100, 6541)] == [
        256, 256, 512, 1024, 1280, 1536, 2048, 2048, 2560, 2560, 7168]
    assert slot_bucket(4000, 4096) == 4096 and slot_bucket(100, 64) == 64
    for n in range(1, 20000, 37):  # never below the rows; above by less than a quarter of them or one SLOT_BUCKET
        b = slot_bucket(n, 1 << 15)
        assert n <= b < n + max(n / 4, SLOT_BUCKET) and b % SLOT_BUCKET == 0


def test_prepared_steps_across_slot_buckets(model, processor, cpu_graphs, monkeypatch):
    """Prepared-ahead steps pick the graph of the bucket their rows will be in (small buckets: several per answer)."""
    import raincheck_hf.fast.static_cache as static_cache

    monkeypatch.setattr(static_cache, "SLOT_BUCKET", 16)
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cfg = dict(mode="raincheck", chunk_size=4, decode_guard=2)
    first = _pair(model, inputs, **cfg)[1]
    buckets = {key[-1] for key in first.cache.graphs._captured}
    assert len(buckets) >= 2
    del first
    gc.collect()
    cpu_graphs.clear()
    _assert_same(*_pair(model, inputs, **cfg))
    assert sum(entry[2] for entry in cpu_graphs) >= 10


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("targets", ["fused_layers", "modules"])
def test_compiled_steps_match_the_eager_engine(model, processor, monkeypatch, targets):
    """compile_steps=True: the fast path's steps run compiled code (Inductor on CPU here): Qwen3-VL's decoder
    layers fused around their cache write and attention (``fused_layers``), or the default of other families,
    the compiled norms and MLPs (``modules``), with the few-query attention's core; they compute what the eager
    engine computes, and the compiled forms act only inside those steps."""
    from raincheck_hf.fast import compiled as compiled_module
    from raincheck_hf.fast.attention import _few_query_rows
    from raincheck_hf.fast.compiled import RowWise
    from raincheck_hf.models import get_adapter
    from raincheck_hf.models.base import ModelAdapter
    from raincheck_hf.models.qwen3_vl import Qwen3VLAdapter, fused_decoder_layer

    if targets == "modules":
        monkeypatch.setattr(Qwen3VLAdapter, "compile_targets", ModelAdapter.compile_targets)

    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cfg = dict(chunk_size=4, decode_guard=2)
    slow = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **KW)
    graphs = torch._C._dynamo.eval_frame._debug_get_cache_entry_list

    def graph_counts() -> dict:  # (code object -> Dynamo graphs) of every compiled form made so far in this process
        forms = [k for k in compiled_module._COMPILED if callable(k)]
        forms += [fn for v in compiled_module._COMPILED.values() if isinstance(v, RowWise) for fn in v.copies.values()]
        return {fn.__code__: len(graphs(fn.__code__)) for fn in forms}

    # other tests' models (of other widths, or the same) may have compiled these forms already: their graphs dropped
    # (they compile again when next called), so that what this call's steps make is counted from nothing
    for code in graph_counts():
        torch._C._dynamo.eval_frame.reset_code(code)
    before = graph_counts()
    with monkeypatch.context() as patch:
        calls = count_compiled_calls(patch)
        fast = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, compile_steps=True, **cfg), **KW)
    _assert_same(slow, fast)
    pairs = get_adapter(model).compile_targets()
    layers = len(model.model.language_model.layers)
    if targets == "modules":
        assert len(pairs) == 5 * layers and all(isinstance(impl, RowWise) for _, impl in pairs)  # 4 RMSNorms, MLP
        assert len(set(calls)) >= 3 and len(calls) > 5 * layers  # norms, MLPs and the attention, every step
        compiled_fns = set(calls) | {fn for _, impl in pairs for fn in impl.copies.values()}
    else:
        assert [impl for _, impl in pairs] == [fused_decoder_layer] * layers
        assert len(set(calls)) == 3 and len(calls) > 2 * layers  # the two regions per layer, and the attention
        compiled_fns = set(calls)
    # every compiled form compiled (none fell back to its plain function), and one Dynamo graph per region and per
    # row-wise copy for the prompt's rows, the chunk steps' and the one-row decode steps alike
    # (`fast.compiled.mark_rows`: a row count of 1 would otherwise take a graph, and a trace, of its own)
    # (the attention's core: a graph for one row, the decode step's, and one for several, `_few_query_rows`)
    assert any(fn.__qualname__ == _few_query_rows.__qualname__ for fn in compiled_fns)
    assert all(compiled_module._COMPILED[fn].error is None for fn in compiled_fns)
    made = {fn: len(graphs(fn.__code__)) - before.get(fn.__code__, 0) for fn in compiled_fns}
    most = {fn: 2 if fn.__qualname__ == _few_query_rows.__qualname__ else 1 for fn in made}
    assert set(before.values()) <= {0} and made and all(1 <= made[fn] <= most[fn] for fn in made), {
        fn.__code__.co_name: n for fn, n in made.items()}
    assert all("forward" not in vars(m) for m, _ in pairs)  # the dispatchers are gone after the steps
    stock = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, **cfg), **KW)  # graphs recaptured
    _assert_same(slow, stock)
    assert not stock.cache.graphs.compiled


def test_compiled_inputs_are_dense_non_views_of_the_same_elements():
    """`fast.compiled.dense`: a contiguous tensor whose size-1 dimension carries another stride (one query row
    transposed out of ``[B, heads, 1, head_dim]``) gets a contiguous tensor's strides; a non-contiguous one keeps
    its strides; neither is a view afterwards, and both hold the same elements. `mark_rows` marks only tensors."""
    from raincheck_hf.fast.compiled import dense, mark_rows

    g = torch.Generator().manual_seed(0)
    one_row = torch.randn(2, 4, 1, 8, generator=g).transpose(1, 2)  # [2, 1, 4, 8], its row dimension's stride 8
    assert one_row.is_contiguous() and one_row.stride() != (32, 32, 8, 1)
    got = dense(one_row)
    assert got.stride() == (32, 32, 8, 1) and got._base is None and torch.equal(got, one_row)
    assert got.data_ptr() == one_row.data_ptr()  # (no copy)
    half = torch.randn(5, 16, generator=g)[:, :8]  # the query half of a projection: rows 16 apart
    got = dense(half)
    assert got.stride() == half.stride() and got._base is None and torch.equal(got, half)
    mark_rows(got, (0,))
    assert 0 in got._dynamo_unbacked_indices  # (torch's own record of the mark)
    assert dense(None) is None and dense(3) == 3
    mark_rows(None, (0,))  # (nothing to mark)


@pytest.mark.parametrize("setting", [None, True, False])
@pytest.mark.parametrize("graphs_in_use", [True, False])
def test_compile_steps_resolve_to_the_setting_or_to_whether_graphs_are_captured(setting, graphs_in_use):
    from raincheck_hf.fast.compiled import resolve_compile_steps

    want = graphs_in_use if setting is None else setting
    assert resolve_compile_steps(setting, graphs_in_use) is want


@pytest.mark.parametrize("fast_path", [None, True])
def test_default_compile_steps_stay_off_without_graphs(model, processor, fast_path):
    """On CPU no step is captured: the default config compiles nothing, on the eager engine (``fast_path=None``
    picks it here) and on the fast path's code without graphs; a cache that ran compiled before resolves
    again at the next call."""
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = dict(chunk_size=4, decode_guard=2, fast_path=fast_path)
    out = model.generate(**inputs, raincheck=RaincheckConfig(**cfg), **KW)
    assert getattr(out.cache, "compile_steps", False) is False
    assert isinstance(out.cache, StaticDeferredCache) == (fast_path is True)
    if fast_path:
        assert not out.cache.graphs.use_graphs and not out.cache.graphs.compiled
        out.cache.compile_steps = True  # as a compile_steps=True call leaves it
        ids = torch.cat([out.sequences, out.sequences[:, -1:]], dim=1)
        again = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=out.cache,
                               raincheck=RaincheckConfig(**cfg), **KW)
        assert again.cache is out.cache and out.cache.compile_steps is False and not out.cache.graphs.compiled


def test_compile_steps_fall_back_to_the_stock_step_when_compiling_fails(model, processor, monkeypatch):
    """A failed torch.compile (no C++ compiler, an op Inductor cannot lower) warns once per compiled function
    and runs it uncompiled: compile_steps=True then answers as the eager engine does."""
    from torch._dynamo.exc import TorchDynamoException

    from raincheck_hf.fast import compiled as compiled_module

    def failing_compile(fn, **kwargs):
        def run(*args, **kw):
            raise TorchDynamoException("no compiler here")

        return run

    monkeypatch.setattr(compiled_module, "_COMPILED", {})
    monkeypatch.setattr(compiled_module.torch, "compile", failing_compile)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = dict(chunk_size=4, decode_guard=2)
    slow = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **KW)
    with pytest.warns(RuntimeWarning, match="compile_steps: torch.compile of .* failed"):
        fast = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, compile_steps=True, **cfg), **KW)
    _assert_same(slow, fast)
    assert compiled_module._COMPILED and all(entry.error is not None for entry in compiled_module._COMPILED.values())


def test_compiled_forms_act_only_inside_the_scoped_thread(model, monkeypatch):
    """The compiled-forward dispatchers are per module instance and act only for the thread whose step scope asks
    for them; another thread calling the same module meanwhile runs its stock forward; the block undoes them."""
    import threading

    from raincheck_hf.fast import compiled as compiled_module
    from raincheck_hf.fast.scoping import step_scope
    from raincheck_hf.models import get_adapter
    from raincheck_hf.models.base import ModelAdapter

    calls = []

    def fake_compiled(fn, rows=None):  # stands in for torch.compile: records who ran the "compiled" form
        def run(*args, **kwargs):
            calls.append(threading.get_ident())
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(compiled_module, "compiled", fake_compiled)
    targets = ModelAdapter.compile_targets(get_adapter(model))  # the modules' own forwards, compiled
    norm = targets[0][0]
    x = torch.randn(1, 3, norm.weight.shape[0])
    want = norm(x)
    got = {}
    with step_scope(model.model.language_model, [], few_query=False, compile_targets=targets):
        got["inside"] = norm(x)
        other = threading.Thread(target=lambda: got.setdefault("other", norm(x)))
        other.start()
        other.join()
    assert calls == [threading.get_ident()]
    assert torch.equal(got["inside"], want) and torch.equal(got["other"], want)
    assert all("forward" not in vars(m) for m, _ in targets)
    with step_scope(model.model.language_model, [], few_query=False):  # a step without compile_steps
        norm(x)
    assert calls == [threading.get_ident()]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("family", family_params(["qwen3_vl_moe", "qwen2_5_vl"]))
def test_compiled_steps_of_other_families_match_the_eager_engine(family):
    """The default compile targets (RMSNorms, dense MLPs) on the other fast-path families."""
    from conftest import no_placeholder_ids

    model, processor = family_model(family), family_processor(family)
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    kw = dict(KW, suppress_tokens=no_placeholder_ids(model))
    cfg = dict(chunk_size=4, decode_guard=2)
    slow = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    fast = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, compile_steps=True, **cfg), **kw)
    assert fast.cache.graphs.compiled
    _assert_same(slow, fast)


@pytest.mark.parametrize("family", family_params(["qwen3_5", "qwen3_5_moe"]), indirect=True)
def test_gdn_restore_everything_at_once(family):
    """`restore_pending` without a chunk size: one unpadded chunk step of every pending row (more than
    `RECURRENT_CHUNK_MAX`: the chunked GDN rule, not captured) joins as the eager engine's does."""
    from raincheck_hf.gdn.dispatch import RECURRENT_CHUNK_MAX

    _, model, processor = family
    inputs = make_inputs(processor, images=(draw_test_image(256, 256, seed=4), draw_test_image(256, 192, seed=5)))
    slow, fast = _pair(model, inputs, mode="post_answer", retention=0.25)
    assert fast.cache.num_pending > RECURRENT_CHUNK_MAX
    assert torch.equal(restore_pending(model, slow.cache), restore_pending(model, fast.cache))
    _assert_same_state(slow.cache, fast.cache)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_steps_on_the_gdn_fast_path(qwen35, processor):
    """compile_steps=True on Qwen3.5: the compiled norms and MLPs around the static-buffer GDN layers compute
    what the eager engine computes."""
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    slow, fast = (qwen35.generate(**inputs, raincheck=RaincheckConfig(chunk_size=4, decode_guard=2, **extra),
                                  **_kw(qwen35)) for extra in (dict(fast_path=False),
                                                               dict(fast_path=True, compile_steps=True)))
    assert fast.cache.graphs.compiled
    _assert_same(slow, fast)


def _deepstack_batch(n_deferred: int, n_rest: int, hidden: int = 4, layers: int = 2, seed: int = 0):
    """A forward's rows ``[n_deferred visual (deferred) rows, n_rest text rows]`` with DeepStack features."""
    from raincheck_hf.models.base import RowBatch

    g = torch.Generator().manual_seed(seed)
    n = n_deferred + n_rest
    visual = torch.arange(n) < n_deferred
    features = [torch.randn(n_deferred, hidden, generator=g) + 1.0 for _ in range(layers)]
    return RowBatch(torch.randn(n, hidden, generator=g), torch.zeros(3, n, dtype=torch.long), visual, features)


@pytest.mark.parametrize("first", [(12, 3), (5, 9), (0, 14), ("scattered", 14)])
def test_reused_step_buffers_hold_only_this_forwards_deepstack_features(first):
    """A captured step's buffers serve every forward of its shape: a prefill carrying a shorter leading block of
    leftover deferred (visual) rows than the forward before it must not leave that one's features on its own
    text rows (each row's addend is what fresh buffers would get)."""
    from raincheck_hf.fast import graphs
    from raincheck_hf.models.base import RowBatch

    rows, hidden = 16, 4
    buffers = graphs.StepBuffers.empty(rows, hidden, 2, torch.float32, torch.device("cpu"), step_info=False)
    if first[0] == "scattered":  # a prefill with visual rows among its input rows
        b = _deepstack_batch(0, 14, seed=1)
        visual = torch.zeros(14, dtype=torch.bool)
        visual[3:9] = True
        b = RowBatch(b.embeds, b.positions, visual, [torch.randn(6, hidden) for _ in range(2)])
    else:
        b = _deepstack_batch(*first, seed=1)
    n_first = int(b.embeds.shape[0])
    graphs.fill(buffers, b, torch.arange(n_first), 0, 100, first[0] if first[0] != "scattered" else 0,
                rows - n_first)
    second = _deepstack_batch(3, 10, seed=2)  # 3 leftover deferred rows, padding 3, 10 text rows
    graphs.fill(buffers, second, torch.arange(13), 0, 100, 3, 3)
    fresh = graphs.StepBuffers.empty(rows, hidden, 2, torch.float32, torch.device("cpu"), step_info=False)
    graphs.fill(fresh, second, torch.arange(13), 0, 100, 3, 3)
    real = torch.ones(rows, dtype=torch.bool)
    real[3:6] = False  # padding rows may hold anything: nobody sees them
    for used, want in zip(buffers.deepstack, fresh.deepstack):
        assert torch.equal(used[0, real], want[0, real])


@pytest.mark.parametrize("seed", range(4))
def test_deepstack_fill_from_host_known_visual_rows_equals_the_mask_read(seed):
    """A prefill's rows made by `ModelAdapter.rows` carry their visual rows' indices (``RowBatch.visual_rows``, known
    on the host), so the fill scatters DeepStack features without reading the visual mask back; against the fill
    that reads the mask (``visual_rows`` None), on random scattered visual rows, with and without padding."""
    from raincheck_hf.fast import graphs
    from raincheck_hf.models.base import RowBatch

    g = torch.Generator().manual_seed(seed)
    n, hidden, padding = 20, 4, seed % 3
    visual = torch.rand(n, generator=g) < 0.5
    visual[int(torch.randint(n, (1,), generator=g))] = True
    features = [torch.randn(int(visual.sum()), hidden, generator=g) for _ in range(2)]
    batch = RowBatch(torch.randn(n, hidden, generator=g), torch.zeros(3, n, dtype=torch.long), visual, features)
    known = dataclasses.replace(batch, visual_rows=visual.nonzero().flatten())
    filled = []
    for b in (batch, known):
        buffers = graphs.StepBuffers.empty(n + padding, hidden, 2, torch.float32, torch.device("cpu"), step_info=False)
        graphs.fill(buffers, b, torch.arange(n), 0, 100, 0, padding)
        filled.append(buffers.deepstack)
    for a, b in zip(*filled):
        assert torch.equal(a, b)
    assert all(bool(a[0, padding:][visual].abs().sum(-1).gt(0).all()) for a in filled[1])


def test_captures_pause_the_collector_and_give_it_back_as_it_was():
    """`fast.scoping.paused_collector` (every graph capture's, through `graph_capture`): the automatic collector is
    off inside, nested scopes included, and back as it was after the outermost one, on error too; a collector the
    caller had turned off stays off."""
    import gc

    from raincheck_hf.fast.scoping import paused_collector

    assert gc.isenabled()
    with paused_collector():
        assert not gc.isenabled()
        with paused_collector():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), paused_collector():
        raise ValueError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_collector():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_cycle_that_dies_inside_a_capture_waits_for_the_next_collection():
    """What `test_gpu.test_cuda_a_dead_graph_collected_during_a_capture_does_not_break_it` relies on, with an object
    whose finaliser notes where it ran in place of a dead CUDA graph: a cycle that becomes garbage while containers
    are allocated (and live on) under a low threshold is collected right there without `paused_collector`, and
    only at the next collection after the scope with it."""
    import gc

    from raincheck_hf.fast.scoping import paused_collector

    where = []

    class Dead:
        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

        def __del__(self):
            where.append(inside[0])

    inside = [False]

    def drop_and_allocate(scope):
        with scope():
            inside[0] = True
            Dead()
            alive = [[] for _ in range(2000)]
            del alive
            inside[0] = False

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10)
    try:
        drop_and_allocate(contextlib.nullcontext)
        assert where == [True]  # collected inside: what breaks a plain capture
        where.clear()
        drop_and_allocate(paused_collector)
        assert where == []
        gc.collect()
        assert where == [False]
    finally:
        gc.set_threshold(*threshold)


def test_a_held_caches_count_includes_the_steps_captured_on_its_storage(model, monkeypatch):
    """`serve.store.cache_nbytes` (what ``--max-cache-gb`` weighs) counts, beside the cache's tensors, the device
    memory of the steps captured on its slot storage: their graph pool's segments (`fast.graphs.graph_pool_bytes`,
    from the allocator's snapshot: that pool's segments only) and their static buffers, every setting's, each
    tensor once. A pool stands in here (no CUDA on a CPU)."""
    from raincheck_hf.fast import graphs
    from raincheck_hf.models import get_adapter
    from raincheck_hf.serve.store import cache_nbytes

    segments = [{"segment_pool_id": (0, 0), "total_size": 1 << 20}, {"segment_pool_id": (7, 1), "total_size": 3 << 20},
                {"segment_pool_id": (7, 1), "total_size": 2 << 20}, {"segment_pool_id": (8, 0), "total_size": 5}]
    monkeypatch.setattr(graphs.torch.cuda, "memory_snapshot", lambda: segments)
    assert graphs.graph_pool_bytes((7, 1)) == 5 << 20 and graphs.graph_pool_bytes(None) == 0

    cache = StaticDeferredCache(4, 256, 64, "cpu")
    alone = cache_nbytes(cache)
    step_graphs = graphs.StepGraphs(get_adapter(model), use_graphs=False)
    cache.storage.graphs = step_graphs
    assert cache_nbytes(cache) == alone  # nothing captured: nothing more
    step_graphs._pool, step_graphs._pool_bytes = (7, 1), None  # (as a capture leaves them)
    one = graphs.StepBuffers.empty(8, 16, 2, torch.float32, "cpu")
    one.logits = torch.zeros(1, 32)
    other = graphs.StepBuffers.empty(4, 16, 2, torch.float32, "cpu", step_info=False)
    step_graphs._captured[graphs.StepKey(8, True, None, 256)] = (None, one)
    step_graphs._other_settings[("eager", True)] = ({graphs.StepKey(4, False, None, 256): (None, other)}, None)
    tensors = [one.embeds, one.positions, one.query_keys, one.slots, one.step_info, one.logits, *one.deepstack,
               other.embeds, other.positions, other.query_keys, other.slots, *other.deepstack]
    expected = (5 << 20) + sum(t.untyped_storage().nbytes() for t in tensors)
    assert cache_nbytes(cache) == alone + expected
