"""`raincheck_hf.warm_up`: after it, a conversation within its bounds captures nothing during its answers (the
trace's ``captures`` stay empty) and answers exactly as a cold one. On CPU with the `cpu_graphs` stand-in for
CUDA-graph capture (tests/test_fast_path.py), which runs the fast path's capture / replay code as on CUDA."""

from __future__ import annotations

import pytest
import torch

import raincheck_hf
from raincheck_hf import RaincheckConfig, restore_pending
from raincheck_hf.fast.static_cache import _POOLS, release_storage
from raincheck_hf.warmup import buckets, capacities, step_keys
from raincheck_hf.tiny import draw_test_image

from conftest import INPUT_CASES, make_inputs, no_placeholder_ids
from families import family_params
from test_batched_graphs import replay_log  # noqa: F401 (the fixture)
from test_fast_path import cpu_graphs  # noqa: F401 (the fixture)
from test_families import follow_up

FAMILIES = family_params(["qwen3_vl", "qwen3_5"])
MAX_NEW = (3, 6, 5)  # answer lengths of the three turns


def _conversation(model, processor, config):
    """Three turns (two images; a text follow-up with leftovers; another text follow-up), idle-time chunks
    between them. Returns the outputs and the captures made outside the answers (idle-time restoration)."""
    kw = dict(do_sample=False, return_dict_in_generate=True, output_logits=True,
              suppress_tokens=no_placeholder_ids(model))
    outs, idle_captures = [], 0
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    cache = None
    for turn, max_new in enumerate(MAX_NEW):
        if turn:
            inputs = follow_up(model, processor, outs[-1].sequences, text=f"And the colours of part {turn}?")
        out = model.generate(**inputs, cache=cache, raincheck=config, max_new_tokens=max_new, **kw)
        outs.append(out)
        cache = out.cache
        if turn == 0:  # one idle-time chunk after the first answer, the rest carried into the next prefill
            log = cache.graphs.capture_log
            before = len(log)
            assert cache.num_pending > config.idle_chunk_size  # leftovers for the next prefill too
            restore_pending(model, cache, max_tokens=config.idle_chunk_size)
            idle_captures += len(cache.graphs.capture_log) - before
    return outs, idle_captures


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_warm_up_leaves_no_capture_to_the_answers(family, cpu_graphs):  # noqa: F811
    _, model, processor = family
    config = RaincheckConfig(fast_path=True, chunk_size=3, decode_guard=2, compile_steps=False)
    cold, cold_idle = _conversation(model, processor, config)
    assert any(out.raincheck.captures for out in cold)  # without warm_up the answers capture
    assert any(out.raincheck.restored_during_decode for out in cold)  # chunks rode along
    del cold[-1].cache
    _POOLS.clear()

    summary = raincheck_hf.warm_up(model, processor, config, max_tokens=512, max_new_tokens=MAX_NEW[0],
                                   cache_dir=False, progress=False)
    assert summary.path == "fast" and summary.graphs and summary.captured and summary.capacities == [256, 512]
    warm, warm_idle = _conversation(model, processor, config)
    for out in warm:
        assert out.raincheck.captures == []
    assert warm_idle == 0 and cold_idle > 0
    for a, b in zip(cold, warm):  # warm_up changes no answer
        assert torch.equal(a.sequences, b.sequences)
        for x, y in zip(a.logits, b.logits):
            assert torch.equal(x, y)
        assert [r.tolist() for r in a.raincheck.restored_per_forward] == [
            r.tolist() for r in b.raincheck.restored_per_forward]

    del warm, b, out  # the conversation's cache holds its storage: a live conversation's storage is its own
    again = raincheck_hf.warm_up(model, processor, config, max_tokens=512, max_new_tokens=MAX_NEW[0],
                                 cache_dir=False, progress=False)
    assert again.captured == [] and again.already_captured == len(summary.captured)  # the kept storages
    assert release_storage(model) == 2

    # two conversations at once lease two storages: `conversations=2` warms both
    _POOLS.clear()
    raincheck_hf.warm_up(model, processor, config, max_tokens=256, max_new_tokens=MAX_NEW[0], conversations=2,
                         cache_dir=False, progress=False)
    first = _conversation(model, processor, config)[0]
    second = _conversation(model, processor, config)[0]
    assert first[-1].cache.storage is not second[-1].cache.storage
    assert all(out.raincheck.captures == [] for out in first + second)


def test_step_keys_follow_the_fast_paths_ladders(model):
    from raincheck_hf.fast.static_cache import slot_bucket
    from raincheck_hf.models import get_adapter

    assert capacities(4096) == [256, 512, 1024, 2048, 4096] and capacities(300) == [256, 512]
    assert buckets(2048) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert set(buckets(4096)) == {slot_bucket(r, 4096) for r in range(1, 4097)}
    adapter = get_adapter(model)
    auto = step_keys(adapter, RaincheckConfig(chunk_size="auto"), max_tokens=1024, max_new_tokens=64,
                     prompt_tokens=300, follow_up_tokens=64, pad_prefill=True)
    steps = {key.rows for keys in auto.values() for key, prefill in keys if not prefill}
    assert steps == {1, 8, 16, 32, 64, 63}  # decode, every fused ladder size, the idle-time chunk of 63
    full = step_keys(adapter, RaincheckConfig(mode="full"), max_tokens=1024, max_new_tokens=64, prompt_tokens=300,
                     follow_up_tokens=64, pad_prefill=False)
    assert {key.rows for keys in full.values() for key, _ in keys} == {1}  # no chunk, prefills not captured
    # a first turn of 300 prompt rows + 64 answer tokens starts on 512 slots, its prefill padded to 320
    first = [key for key, prefill in auto[512] if prefill and key.rows == 320]
    assert first and all(key.bucket == 512 for key in first)


def test_warm_up_on_the_eager_engine_returns_at_once(model, processor):
    summary = raincheck_hf.warm_up(model, processor, max_tokens=512, cache_dir=False, progress=False)
    assert summary.path == "eager" and not summary.graphs and summary.captured == []
    fast = raincheck_hf.warm_up(model, processor, RaincheckConfig(fast_path=True), max_tokens=512,
                                image_sizes=[(96, 128)], cache_dir=False, progress=False)
    assert fast.path == "fast" and not fast.graphs and fast.vision == []  # no CUDA: nothing to capture
    assert "eager" in str(summary)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens="4k"), "max_tokens must be an int >= 1, got '4k'"),
    (dict(max_new_tokens=600, max_tokens=512), r"max_new_tokens \(600\) must be below max_tokens \(512\)"),
    (dict(prompt_tokens=-3), "prompt_tokens must be an int >= 1, got -3"),
    (dict(follow_up_tokens=True), "follow_up_tokens must be an int >= 1, got True"),
    (dict(image_sizes=[(96,)]), r"image_sizes must hold \(height, width\) pairs of ints >= 1, got \(96,\)"),
    (dict(image_sizes=5), "image_sizes must be a list"),
    (dict(progress="yes"), "progress must be True or False, got 'yes'"),
    (dict(config={"chunk_size": 0}), "chunk_size"),
    (dict(cache_dir=3), "cache_dir must be a path, None or False, got 3"),
    (dict(batch=0), "batch must be an int >= 1, got 0"),
    (dict(batch=2.5), "batch must be an int >= 1, got 2.5"),
])
def test_bad_arguments_are_refused_before_any_compute(model, kwargs, match, monkeypatch):
    import raincheck_hf.warmup as warmup

    monkeypatch.setattr(warmup, "_warm_steps", lambda *a, **k: pytest.fail("computed before checking"))
    with pytest.raises(ValueError, match=match):
        raincheck_hf.warm_up(model, **kwargs)


def test_image_sizes_need_the_processor(model):
    with pytest.raises(ValueError, match=r"image_sizes=\[\(96, 128\)\] needs the model's processor"):
        raincheck_hf.warm_up(model, image_sizes=[(96, 128)], cache_dir=False)


def test_a_model_not_enabled_is_refused():
    from families import BY_NAME

    bare = BY_NAME["qwen3_vl"].build(seed=0)
    with pytest.raises(ValueError, match="not enabled: call raincheck_hf.enable"):
        raincheck_hf.warm_up(bare, cache_dir=False)


# ---- the batched engine's decode steps (``batch``) ----

@pytest.mark.parametrize("name,mode,views", [("qwen3_vl", "raincheck", True), ("qwen3_vl", "full", True),
                                             ("qwen3_vl", "raincheck", False), ("qwen3_5", "raincheck", True),
                                             ("qwen3_5", "post_answer", True), ("qwen3_5", "raincheck", False)])
def test_batched_warm_up_leaves_no_capture_to_the_batch(name, mode, views, replay_log, monkeypatch):  # noqa: F811
    """``warm_up(batch=3)`` captures every decode-step key a batch of up to 3 sequences of ``max_tokens`` rows can
    take (here on CPU, where each "capture" runs the step once: made to count as capturing); a batched ``generate``
    of 3 rows afterwards finds its pool sized and every decode step it runs captured (no capture of its own), and
    answers as the eager engine does. ``views=False``: every step gathers its slots (padding in the scratch slot).
    """
    import dataclasses

    import raincheck_hf.warmup as warmup
    from raincheck_hf.fast import batched_graphs
    from raincheck_hf.models import get_adapter
    from families import family_model, family_processor
    from test_batched import IMAGE, TEXT, TWO_IMAGES, batched_inputs, run

    monkeypatch.setattr(warmup, "_batched_captures", lambda graphs: True)
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(mode=mode, retention=0.8, chunk_size=3, decode_guard=1, fast_path=True)
    summary = raincheck_hf.warm_up(model, processor, cfg, max_tokens=256, max_new_tokens=16, batch=3,
                                   conversations=0, cache_dir=False, progress=False)
    assert summary.capacities == [] and summary.coverage.startswith("batched steps of up to 3 sequences")
    (kept,) = batched_graphs._POOLED[get_adapter(model).text_model]
    keys = kept.warm_keys(cfg, 3)
    assert summary.batched == len(keys) == len(kept.capture_log) and summary.batched_already == 0
    assert {k.batch for k in keys} == {1, 2, 4} and kept.pool.num_slots >= 4 and kept.pool.capacity >= 256
    # (on the attention families short prompt pieces ride in these steps in every mode: `ride_rows`)
    decoding, alone = [k for k in keys if not k.prefill], [k for k in keys if k.prefill]
    assert {k.width for k in decoding} == ({1} if mode == "full" and name == "qwen3_5" else {1, 4})
    # (and a prompt piece alone: batch 1, gathered, every prefill width up to the pool's capacity, on every family)
    widths = [w for w in batched_graphs.PREFILL_WIDTHS if w <= kept.pool.capacity]
    assert sorted({k.width for k in alone}) == widths
    assert all(k.batch == 1 and not k.dense for k in alone)
    assert "3 sequences of up to 256 rows" in summary.coverage and "batched steps" in str(summary)
    again = raincheck_hf.warm_up(model, processor, cfg, max_tokens=256, max_new_tokens=16, batch=3,
                                 cache_dir=False, progress=False)
    assert again.batched == 0 and again.batched_already == len(keys)
    replay_log.clear()
    rows = [TWO_IMAGES, IMAGE, TEXT]
    want = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=False), 10)
    got = run(model, batched_inputs(processor, rows), cfg, 10)
    (kept,) = batched_graphs._POOLED[get_adapter(model).text_model]
    assert len(kept.capture_log) == len(keys)  # nothing captured during the answers
    assert replay_log and set(replay_log) <= set(keys)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max().item() <= 1e-4


def test_batched_warm_up_on_cpu_captures_nothing(model, processor):
    """Without CUDA the batched steps run eagerly on their buffers: ``batch`` pays nothing ahead."""
    summary = raincheck_hf.warm_up(model, processor, RaincheckConfig(fast_path=True), max_tokens=512, batch=4,
                                   cache_dir=False, progress=False)
    assert summary.batched == 0 and summary.batched_already == 0


def test_an_engine_takes_the_kept_pool_with_the_most_captured_steps(replay_log, monkeypatch):  # noqa: F811
    """Two kept pools of one model (a warmed one, and one an engine of another config made meanwhile): the next engine
    takes the warmed one whichever was given back last, so its steps replay instead of being captured again."""
    import raincheck_hf.warmup as warmup
    from raincheck_hf.batch_engine import BatchEngine
    from raincheck_hf.fast import batched_graphs
    from raincheck_hf.models import get_adapter
    from families import family_model, family_processor

    monkeypatch.setattr(warmup, "_batched_captures", lambda graphs: True)
    model = family_model("qwen3_vl")
    adapter = get_adapter(model)
    cfg = RaincheckConfig(retention=0.8, chunk_size=3, decode_guard=1, fast_path=True)
    raincheck_hf.warm_up(model, family_processor("qwen3_vl"), cfg, max_tokens=256, max_new_tokens=16, batch=2,
                         conversations=0, cache_dir=False, progress=False)
    (warmed,) = batched_graphs._POOLED[adapter.text_model]
    first = BatchEngine(model, cfg)  # takes the warmed pool
    other = BatchEngine(model, cfg)  # a new one, none being free
    assert first.graphs is warmed and other.graphs is not warmed
    first.close()
    other.close()  # given back last
    assert len(batched_graphs._POOLED[adapter.text_model]) == 2
    assert BatchEngine(model, cfg).graphs is warmed


def test_a_loop_hands_its_idle_engines_pool_to_another_configs_turn(replay_log, monkeypatch):  # noqa: F811
    """A server warms its batched steps up for its default config, and an empty engine of the default config stays
    on its loop between answers. A turn of another config (a request asking ``mode="full"``) that comes when no
    answer of the default config runs gets the warmed pool, not a fresh one: its decode steps replay keys captured
    ahead (none captured during its answer), where it used to capture them mid-answer on a pool of its own (on the
    H200, `full`'s rounds of `bench serve-load` after `raincheck`'s: 4 and 7 captures of ~190 ms each)."""
    import raincheck_hf.warmup as warmup
    from raincheck_hf import BatchLoop, Conversation
    from raincheck_hf.fast import batched_graphs
    from raincheck_hf.models import get_adapter
    from families import family_model, family_processor
    from test_batched import IMAGE

    monkeypatch.setattr(warmup, "_batched_captures", lambda graphs: True)
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    adapter = get_adapter(model)
    cfg = RaincheckConfig(retention=0.8, chunk_size=3, decode_guard=1, fast_path=True)
    full = RaincheckConfig(mode="full", fast_path=True)
    raincheck_hf.warm_up(model, processor, cfg, max_tokens=256, max_new_tokens=16, batch=2, conversations=0,
                         cache_dir=False, progress=False)
    (warmed,) = batched_graphs._POOLED[adapter.text_model]
    captured = len(warmed.capture_log)
    kw = dict(max_new_tokens=6, min_new_tokens=6, suppress_tokens=no_placeholder_ids(model))
    with torch.no_grad(), BatchLoop(model, max_batch_tokens=512, config=cfg) as loop:
        first = Conversation(model, processor, cfg, background=False, loop=loop)
        first.ask("Describe it.", images=list(IMAGE["images"]), **kw)
        replay_log.clear()
        other = Conversation(model, processor, full, background=False, loop=loop)
        other.ask("Describe it.", images=list(IMAGE["images"]), **kw)
        engines = loop.call(lambda: [e for e in loop._engines if e.config == full])
        assert [e.graphs for e in engines] == [warmed]  # the full turn's engine runs on the warmed pool
        first.ask("And then?", **kw)  # the default config's turn after it: the pool back, still warmed
    assert replay_log
    assert len(warmed.capture_log) == captured  # no capture during either answer
    alone = Conversation(model, processor, full, background=False)
    want = alone.ask("Describe it.", images=list(IMAGE["images"]), **kw)
    assert torch.equal(other.sequences, alone.sequences), (want, other)


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_warm_up_covers_a_prefill_on_the_storage_its_deferred_rows_size(family, cpu_graphs):  # noqa: F811
    """A first turn's storage is sized for every prompt row (the deferred ones are stored later) plus the answer,
    not for the rows it prefills: two pictures' ~120 prompt rows + 150 answer tokens take a 512-slot storage while
    the ~55 rows prefilled (one 64-row bucket) + 150 would fit 256 slots; a prompt sized for that storage alone
    prefills at least 107 rows (a 128-row bucket). The 64-row prefill's graph on the 512-slot storage is warmed."""
    _, model, processor = family
    config = RaincheckConfig(fast_path=True, compile_steps=False)
    inputs = make_inputs(processor, images=(draw_test_image(256, 192, seed=1), draw_test_image(256, 192, seed=2)))
    _POOLS.clear()
    # follow_up_tokens=1: no follow-up prefill (64-row keys at every bucket) covers the first turn's by chance
    summary = raincheck_hf.warm_up(model, processor, config, max_tokens=512, max_new_tokens=150, follow_up_tokens=1,
                                   image_sizes=[(192, 256)], cache_dir=False, progress=False)
    assert summary.captured
    out = model.generate(**inputs, raincheck=config, max_new_tokens=150, do_sample=False,
                         return_dict_in_generate=True, suppress_tokens=no_placeholder_ids(model))
    trace = out.raincheck
    prompt = inputs["input_ids"].shape[1]
    prefilled = prompt - trace.deferred.numel()
    assert prefilled <= 64 and prefilled + 150 <= 256 < prompt + 150 and out.cache.capacity == 512
    assert trace.captures == []
    del out
    _POOLS.clear()


def test_step_keys_put_a_deferring_prefill_on_every_storage_its_prompt_can_size(model):
    from raincheck_hf.fast.static_cache import slot_bucket
    from raincheck_hf.models import get_adapter

    adapter = get_adapter(model)
    kw = dict(max_tokens=4096, max_new_tokens=64, prompt_tokens=1600, follow_up_tokens=64, pad_prefill=True)
    # 461 rows prefilled of a 1,402-row prompt: the storage is round_capacity(1402 + 64) = 2048 slots
    keys = step_keys(adapter, RaincheckConfig(), **kw)
    assert any(prefill and key.rows == 512 and key.bucket == slot_bucket(461, 2048) for key, prefill in keys[2048])
    assert any(prefill and key.rows == 512 for key, prefill in keys[1024])  # a 461-row prompt with nothing deferred
    # no storage beyond what the longest prompt sizes: 1,600 + 64 rows -> 2048
    assert not any(prefill for key, prefill in keys[4096] if key.rows > 64)
    # mode="full" prefills every prompt row: the storage is sized by them alone
    full = step_keys(adapter, RaincheckConfig(mode="full"), **kw)
    assert not any(prefill and key.rows == 512 for key, prefill in full[2048])


def test_warm_up_selects_each_image_size_at_every_question_bucket_a_prompt_can_take(model, processor, monkeypatch):
    """`warmup._warm_selection`: for each image size, the selector's graph shapes (`selection.kernels`: one per
    method, k and input shape; mmtok's text rows padded to `TEXT_BUCKET`) at every question bucket up to
    `TEXT_ALLOWANCE` rows, the longest first, at most the kernels' `MAX_GRAPHS`; a real prompt of that size then
    selects at a warmed shape. On a CPU the kernels keep no graphs: the table is kept here by a stand-in that
    records each shape as `greedy_select` would capture it."""
    from raincheck_hf import warmup
    from raincheck_hf.models import get_adapter
    from raincheck_hf.plan import select_visual_rows
    from raincheck_hf.selection import base, kernels
    from raincheck_hf.selection.mmtok import TEXT_BUCKET

    table = {}
    monkeypatch.setattr(kernels, "_GRAPHS", {"device": table})

    def recording(self, segments, k, context):
        features = torch.stack([s.features for s in segments])
        table.setdefault(kernels._key(self.kernel, self.kernel_inputs(features, context), k), True)
        return [torch.arange(k) for _ in segments]

    monkeypatch.setattr(base.GreedySelector, "select_group", recording)
    adapter, config = get_adapter(model), RaincheckConfig(fast_path=True)
    grids = warmup._image_grids(processor, [(128, 96), (64, 64), (96, 128)])
    tokens = [t for _, t in grids]
    summary = warmup.WarmUpSummary(path="fast")
    warmup._warm_selection(adapter, config, grids[:1], summary)
    buckets_ = list(range(warmup.TEXT_ALLOWANCE, 0, -TEXT_BUCKET))
    assert [(n, m) for n, m, _ in summary.selection] == [(tokens[0], m) for m in buckets_]
    assert len(table) == len(buckets_)
    # a prompt with that image: its selection's shape is one of them
    ids, grid, pixels = _prompt(processor, (128, 96))
    turn = adapter.encode_turn(ids, 0, image_grid_thw=grid, pixel_values=pixels)
    before = set(table)
    select_visual_rows(turn, config, config.build_selector(), model=model)
    assert set(table) == before
    # three sizes: no more than the kernels keep, the longest questions first
    table.clear()
    summary = warmup.WarmUpSummary(path="fast")
    warmup._warm_selection(adapter, config, grids, summary)
    assert len(summary.selection) == kernels.MAX_GRAPHS == len(table)
    assert summary.selection[0][1] == warmup.TEXT_ALLOWANCE and {n for n, _, _ in summary.selection} == set(tokens)
    # nothing for a mode that selects nothing, or a selector without kernels
    for other in (RaincheckConfig(mode="full", fast_path=True), RaincheckConfig(selector="fastv", fast_path=True)):
        table.clear()
        summary = warmup.WarmUpSummary(path="fast")
        warmup._warm_selection(adapter, other, grids, summary)
        assert summary.selection == [] and table == {}


def _prompt(processor, size):
    """``(input_ids [L], image_grid_thw, pixel_values)`` of a one-image question."""
    height, width = size
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[draw_test_image(width, height, seed=3)], return_tensors="pt")
    return inputs["input_ids"][0], inputs["image_grid_thw"], inputs["pixel_values"]


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_a_first_turn_warm_up_covers_the_first_answer_and_idle_time_the_rest(family, cpu_graphs):  # noqa: F811
    """``warm_up(first_turn=True)`` captures only the first turn's storage (its steps at every slot bucket, its
    prefills; not the other storage of the bounds): the first answer captures nothing. `IdleWarmUp` captures the rest on
    its thread (skipping what is captured): paused before it is done, resumed, waited for; after it a whole conversation
    captures nothing, and the two calls together captured what one full `warm_up` does. ``stop`` set before a call
    captures nothing; set after two captures, two."""
    import threading

    from raincheck_hf import IdleWarmUp
    from raincheck_hf.fast import graphs as fast_graphs
    from raincheck_hf.models import get_adapter
    from raincheck_hf.fast.static_cache import round_capacity

    _, model, processor = family
    config = RaincheckConfig(fast_path=True, chunk_size=3, decode_guard=2, compile_steps=False)
    prompt = make_inputs(processor, **INPUT_CASES["two_images"])["input_ids"].shape[1]
    bounds = dict(max_tokens=512, max_new_tokens=MAX_NEW[0], prompt_tokens=prompt, cache_dir=False)
    _POOLS.clear()
    full = raincheck_hf.warm_up(model, processor, config, progress=False, **bounds)
    _POOLS.clear()

    first = raincheck_hf.warm_up(model, processor, config, progress=False, first_turn=True, **bounds)
    assert first.first_turn and first.captured and not first.stopped
    assert first.capacities == [round_capacity(prompt + MAX_NEW[0])] and len(first.captured) < len(full.captured)
    assert "a first turn of up to" in first.coverage
    outs, _ = _conversation(model, processor, config)
    assert outs[0].raincheck.captures == []
    del outs
    _POOLS.clear()

    # stop: set before (nothing captured), set after two captures (two)
    stop = threading.Event()
    stop.set()
    none = raincheck_hf.warm_up(model, processor, config, progress=False, stop=stop, **bounds)
    assert none.stopped and none.captured == [] and "stopped" in none.coverage
    warm, made = fast_graphs.StepGraphs.warm, []

    def counted(self, *args, **kwargs):
        made.append(1)
        if len(made) == 2:
            stop.set()
        return warm(self, *args, **kwargs)

    stop.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_graphs.StepGraphs, "warm", counted)
        two = raincheck_hf.warm_up(model, processor, config, progress=False, stop=stop, **bounds)
    assert two.stopped and len(two.captured) == 2
    _POOLS.clear()

    # the rest in idle time while the first turn's conversation holds its storage: that storage counts as warmed (no
    # second one of its size), and its follow-ups (in the first turn's plan) capture nothing
    first = raincheck_hf.warm_up(model, processor, config, progress=False, first_turn=True, **bounds)
    kw = dict(do_sample=False, return_dict_in_generate=True, output_logits=True,
              suppress_tokens=no_placeholder_ids(model))
    out = model.generate(**make_inputs(processor, **INPUT_CASES["two_images"]), raincheck=config,
                         max_new_tokens=MAX_NEW[0], **kw)
    held = out.cache.storage
    rest = IdleWarmUp(model, processor, config, **bounds).finish(progress=False)
    assert first.capacities[0] not in rest.capacities and len(rest.capacities) == len(full.capacities) - 1
    sizes = [s.capacity for s in _POOLS[get_adapter(model).text_model]]
    assert sorted(sizes) == sorted(full.capacities) and held.kept  # (one storage a size: the held one is the first's)
    follow = model.generate(**follow_up(model, processor, out.sequences, text="And the colours of part 1?"),
                            cache=out.cache, raincheck=config, max_new_tokens=MAX_NEW[1], **kw)
    assert follow.cache.storage is held and follow.raincheck.captures == []
    del out, follow, held
    _POOLS.clear()

    # the chat's way: the first turn's warm-up, then the rest in idle time, paused and resumed
    first = raincheck_hf.warm_up(model, processor, config, progress=False, first_turn=True, **bounds)
    idle = IdleWarmUp(model, processor, config, **bounds)
    idle.resume()
    idle.pause()  # (before it is done, or just after: either way nothing is lost)
    idle.resume()
    assert idle.wait(timeout=120) and idle.error is None and idle.done
    assert len(first.captured) + idle.captured == len(full.captured)
    assert idle.finish() is None  # (nothing left)
    warm_outs, idle_captures = _conversation(model, processor, config)
    assert all(out.raincheck.captures == [] for out in warm_outs) and idle_captures == 0
    with pytest.raises(ValueError, match="first_turn"):
        IdleWarmUp(model, processor, config, first_turn=True)
    failing = IdleWarmUp(model, processor, config, max_tokens=0)  # (warm_up refuses it: on its thread)
    with pytest.warns(RuntimeWarning, match="idle-time warm-up failed .*max_tokens"):
        failing.resume()
        failing.wait(timeout=60)
    assert failing.done and isinstance(failing.error, ValueError)
    with pytest.raises(ValueError, match="max_tokens"):
        IdleWarmUp(model, processor, config, max_tokens=0).finish()
    with pytest.raises(ValueError, match="first_turn=True warms"):
        raincheck_hf.warm_up(model, processor, config, first_turn=True, batch=2)
    with pytest.raises(ValueError, match="stop must be"):
        raincheck_hf.warm_up(model, processor, config, stop="now")


def test_a_first_turns_plan_is_its_storages_steps_and_its_prompts_prefills(model):
    """`step_keys(first_turn=...)`: for a first turn of a 1,344-token image and its question, the storage that prompt
    and its answer take (2,048 slots) with every decode / chunk / idle-time step at every slot bucket the full plan
    has there from the bucket of the fewest rows such a turn prefills (its slots only grow: none below), the
    prefills of the rows such a turn prefills (the selected tokens plus 1 to 256 text rows, padded to 64) and the
    follow-ups' (the conversation keeps that storage): a subset of the full plan; ``full`` mode
    prefills every visual token."""
    from raincheck_hf.models import get_adapter
    from raincheck_hf.selection.base import keep_count
    from raincheck_hf.warmup import TEXT_ALLOWANCE, first_turn_capacity, first_turn_rows

    adapter = get_adapter(model)
    cfg = RaincheckConfig()
    kept = keep_count(cfg.retention, 1344)
    rows = first_turn_rows(cfg, [1344], prompt_tokens=1600)
    assert rows == list(range(kept + 1, kept + TEXT_ALLOWANCE + 1))
    assert first_turn_rows(RaincheckConfig(mode="full"), [1344], 1600) == list(range(1345, 1601))  # (capped)
    assert first_turn_rows(cfg, [], 300) == list(range(1, 301))  # no image: any prompt up to its bound
    assert first_turn_capacity(1600, 256, 4096) == 2048 and first_turn_capacity(1600, 256, 1024) == 1024
    bounds = dict(max_tokens=4096, max_new_tokens=256, prompt_tokens=1600, follow_up_tokens=64, pad_prefill=True)
    plan = step_keys(adapter, cfg, first_turn=rows, **bounds)
    full = step_keys(adapter, cfg, **bounds)
    from raincheck_hf.fast.static_cache import slot_bucket

    assert list(plan) == [2048] and set(plan[2048]) < set(full[2048])
    low = slot_bucket(min(rows), 2048)
    assert low == 512 and min(k.bucket for k, _ in full[2048]) == 256  # (the 256-slot bucket is never reached)
    reached = {k for k in full[2048] if k[0].bucket >= low}
    assert {k for k in plan[2048] if not k[1]} == {k for k in reached if not k[1]}  # every step, every bucket reached
    assert not any(k.bucket < low for k, _ in plan[2048])
    prefills = {key.rows for key, prefill in plan[2048] if prefill}
    assert prefills == {-(-n // 64) * 64 for n in rows} | {64}  # (and the follow-ups', 64 rows, at every bucket)
    follow_ups = {k for k in reached if k[1] and k[0].rows == 64}
    assert follow_ups and follow_ups <= set(plan[2048])
    # a first turn without an image can prefill a single row: every bucket, as before
    text_only = step_keys(adapter, cfg, first_turn=first_turn_rows(cfg, [], 300), **bounds)
    assert {k for k in text_only[2048] if not k[1]} == {k for k in full[2048] if not k[1]}
    assert sum(map(len, plan.values())) < sum(map(len, full.values())) / 3


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_batched_warm_up_covers_the_wide_halves_of_steps_split_by_width(name, replay_log, monkeypatch):  # noqa: F811
    """With a rule that splits every mixed decode forward (``SPLIT_ROWS = 1``): ``warm_up(batch=3)`` also captures
    the wide halves' keys (their slots gathered, at the largest chunk's width, at each batch bucket
    `batch_engine.split_batches` gives), and a batched ``generate`` of an image row and two text rows afterwards
    splits its steps (a one-row forward beside a gathered wide one), captures nothing of its own and answers as the
    eager engine does."""
    import dataclasses

    import raincheck_hf.warmup as warmup
    from raincheck_hf import batch_engine
    from raincheck_hf.fast import batched_graphs
    from raincheck_hf.models import get_adapter
    from families import family_model, family_processor
    from test_batched import BIG_IMAGE, TEXT, batched_inputs, run

    monkeypatch.setattr(warmup, "_batched_captures", lambda graphs: True)
    monkeypatch.setattr(batch_engine, "SPLIT_ROWS", 1)
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1, fast_path=True)
    raincheck_hf.warm_up(model, processor, cfg, max_tokens=256, max_new_tokens=16, batch=3, conversations=0,
                         cache_dir=False, progress=False)
    (kept,) = batched_graphs._POOLED[get_adapter(model).text_model]
    width = batched_graphs.split_width(cfg)
    wide = {k for k in kept.capture_log if not k.dense and not k.prefill and k.width == width}
    assert {k.batch for k in wide} == set(batch_engine.split_batches(3, width, 1)) == {1, 2}
    captured = len(kept.capture_log)
    replay_log.clear()
    rows = [BIG_IMAGE, TEXT, TEXT]
    want = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=False), 10)
    got = run(model, batched_inputs(processor, rows), cfg, 10)
    (kept,) = batched_graphs._POOLED[get_adapter(model).text_model]
    assert len(kept.capture_log) == captured  # nothing captured during the answers
    assert any(k in wide for k in replay_log)  # (the wide halves replayed)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max().item() <= 1e-4
