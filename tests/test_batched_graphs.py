"""`fast.batched_graphs`: the batched engine's decode steps on static buffers, replayed per (batch bucket, width,
span bucket), on CPU.

Without CUDA a "captured" step is the same callable run eagerly on its static buffers (`_EagerStep`); the fixture
`replay_log` records every replay and, after each one, overwrites every input buffer with garbage, so a step that
read anything its fill did not rewrite (a departed sequence's rows, the last step's keys or DeepStack addends)
would differ. References: each sequence run alone through batch-1 ``generate`` on the eager engine, and the same
schedule on the eager `ForwardRunner` (tokens identical, logits within 1e-4 in fp32).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from raincheck_hf import RaincheckConfig
from raincheck_hf.batch_engine import BatchEngine
from raincheck_hf.configuration import CHUNK_LADDER
from raincheck_hf.fast import batched_graphs, static_cache
from raincheck_hf.kv_pool import MAX_KEY

from families import family_model, family_params, family_processor
from conftest import assert_same_output, no_placeholder_ids
from test_batch_engine import Request, assert_some_chunks_cut, draw_case, draw_shared_case, drive
from test_batched import IMAGE, TEXT, TWO_IMAGES, VIDEO, batched_inputs, run

TOL = 1e-4
GRAPH_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")


def _with(cfg: RaincheckConfig, fast_path) -> RaincheckConfig:
    return dataclasses.replace(cfg, fast_path=fast_path)


@pytest.fixture
def replay_log(monkeypatch):
    """Every replay's `BatchStepKey`, in order; every input buffer is overwritten with garbage after each replay.
    Kept pools (with their graphs) are dropped before and after."""
    log = []
    capture = batched_graphs.BatchedStepGraphs._capture
    gen = torch.Generator().manual_seed(0)

    def logged(self, key, buffers):
        graph = capture(self, key, buffers)
        assert isinstance(graph, batched_graphs._EagerStep)  # no CUDA here

        def replay():
            graph.run()
            log.append(key)
            for t in buffers.tensors():
                if t.is_floating_point():
                    t.copy_(1e3 * torch.randn(t.shape, generator=gen))
                else:
                    t.copy_(torch.randint(0, 1 << 20, t.shape, generator=gen))

        return batched_graphs._EagerStep(replay)

    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "_capture", logged)
    monkeypatch.setattr(static_cache, "SLOT_BUCKET", 16)  # several span buckets on the tiny prompts
    batched_graphs.release_all()
    yield log
    batched_graphs.release_all()


def _decode_forwards(engine):
    """Count the forwards that carried decode rows only (what the graphs must run)."""
    counts = {"decode": 0}
    schedule = engine.scheduler.schedule

    def counted(adapter, sequences):
        forwards = schedule(adapter, sequences)
        counts["decode"] += sum(1 for f in forwards if batched_graphs.decode_only(f))
        return forwards

    engine.scheduler.schedule = counted
    return counts


@pytest.mark.parametrize("views", [True, False], ids=["views", "gather"])
@pytest.mark.parametrize("seed", range(9))
def test_fuzz_captured_steps_match_alone(seed, views, replay_log, monkeypatch):
    """Random join schedules, prompts, modes, chunk sizes, budgets and held conversations on the attention families,
    decode steps through the static-buffer step (attention reading views of the lowest slots, or gathering the
    step's slots with the bucket's padding in the scratch slot): each sequence equals its own eager batch-1 call
    (tokens, logits 1e-4, cache, trace), every decode-only forward was a replay, and the pool ends empty."""
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    rng = random.Random(7000 + seed)
    name = GRAPH_FAMILIES[seed % len(GRAPH_FAMILIES)]
    model, processor = family_model(name), family_processor(name)
    cfg, requests, budget = draw_case(rng, model, processor, longest=7, most=6)
    engine = BatchEngine(model, _with(cfg, None), token_budget=budget, num_slots=1, capacity=16, graphs=True)
    counts = _decode_forwards(engine)
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"{name} seed {seed} sequence {i}")
    assert counts["decode"] > 0 and len(replay_log) == counts["decode"]
    assert all(key.dense == views for key in replay_log)
    pool = engine.pool
    assert engine.sequences == [] and len(pool._free) == pool.num_slots
    assert bool((pool.slot_keys == MAX_KEY).all())  # the scratch slot's keys included


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_shared_chunk_budget_on_captured_steps(seed, replay_log):
    """The shared chunk budget's fuzz (`draw_shared_case`: chunks cut to ladder sizes) through the static-buffer
    steps: the cut chunks' widths are among the ladder's buckets, every decode-only forward was a replay, and each
    sequence equals its own eager batch-1 call under its schedule."""
    rng = random.Random(8000 + seed)
    name = GRAPH_FAMILIES[seed % len(GRAPH_FAMILIES)]
    model, processor = family_model(name), family_processor(name)
    cfg, requests, budget = draw_shared_case(rng, model, processor, longest=7, most=5)
    engine = BatchEngine(model, _with(cfg, None), token_budget=budget, num_slots=1, capacity=16, graphs=True)
    counts = _decode_forwards(engine)
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"{name} seed {seed} sequence {i}")
    assert_some_chunks_cut(cfg, requests, f"{name} seed {seed}")
    assert counts["decode"] > 0 and len(replay_log) == counts["decode"]
    allowed = {1, cfg.chunk_size + 1} | {c + 1 for c in CHUNK_LADDER}  # `width_bucket`'s sizes: nothing new
    assert {key.width for key in replay_log} <= allowed


def _eager_and_graphs(name, rows, cfg, n, monkeypatch=None, **patches):
    """A batched greedy generate of ``rows`` on the eager engine and with the captured steps (``patches``: module
    attributes of `fast.batched_graphs` to replace for the second run)."""
    model, processor = family_model(name), family_processor(name)
    inputs = batched_inputs(processor, rows)
    want = run(model, inputs, _with(cfg, False), n)
    for attr, value in patches.items():
        monkeypatch.setattr(batched_graphs, attr, value)
    got = run(model, inputs, _with(cfg, True), n)
    return want, got


@pytest.mark.parametrize("name", family_params(GRAPH_FAMILIES))
def test_generate_batch_with_fast_path_true_equals_the_eager_engine(name, replay_log):
    """``generate(**batch, raincheck=RaincheckConfig(fast_path=True))`` with B = 3 (images, video, text): the decode
    steps replay the static-buffer step (batch bucket 4: one padding row) and the answer equals the eager engine's."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1)
    want, got = _eager_and_graphs(name, [TWO_IMAGES, VIDEO, TEXT], cfg, 8)
    assert_same_output(got, want, TOL, "step")
    assert replay_log and all(key.batch in (1, 2, 4) for key in replay_log)
    assert any(key.batch == 4 for key in replay_log) and any(key.width == 4 for key in replay_log)


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen2_5_vl")))
def test_padding_rows_of_a_bucket_change_nothing(name, replay_log, monkeypatch):
    """Many padding sequences (batch bucket n + 5) and padding rows (width + 3) per step: the same tokens, logits
    within 1e-4 of the eager engine, and the scratch slot's keys stay empty."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1)
    want, got = _eager_and_graphs(name, [IMAGE, TWO_IMAGES], cfg, 7, monkeypatch,
                                  batch_bucket=lambda n: n + 5,
                                  width_bucket=lambda widest, config: widest + 3)
    assert_same_output(got, want, TOL, "step")
    assert replay_log and all(key.batch in (6, 7) for key in replay_log)
    widths = {key.width for key in replay_log}
    assert 6 in widths and min(widths) >= 4  # a token with a 2-row chunk (3 + 3), at least 3 padding rows each
    (pool,) = batched_graphs._POOLED[family_model(name).model.language_model]
    assert bool((pool.pool.slot_keys == MAX_KEY).all())


def test_replays_after_sequences_leave_and_join_read_nothing_stale(replay_log):
    """Three sequences decode; one leaves (the sequence in the highest slot moves into its hole), garbage is written
    over every row no sequence holds, and a new sequence joins; the same captured keys replay across the change
    (their buffers poisoned after every replay): each sequence equals its own call, and every decode step read
    views of slots 0 .. B - 1."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    first = [Request(model, processor, cfg, row, n=n, arrive=0) for row, n in ((IMAGE, 10), (TWO_IMAGES, 3),
                                                                                (TEXT, 10))]
    late = Request(model, processor, cfg, VIDEO, n=5, arrive=5)
    engine = BatchEngine(model, _with(cfg, None), num_slots=4, graphs=True)
    remove = engine.remove
    gen = torch.Generator().manual_seed(1)

    def remove_and_soil(seq):
        cache = remove(seq)
        pool = engine.pool
        for layer in pool.layers:  # every row no sequence holds: free slots, the scratch slot, rows past a length
            if layer.is_initialized:
                for slot in range(pool.total_slots):
                    past = 0 if slot >= pool.num_slots or slot in pool._free else pool.lengths[slot]
                    for t in (layer.keys, layer.values):
                        t[slot, :, past:] = 1e3 * torch.randn(t[slot, :, past:].shape, generator=gen)
        return cache

    engine.remove = remove_and_soil
    drive(model, engine, first + [late])
    for i, r in enumerate(first + [late]):
        r.check(f"sequence {i}")
    assert late.seq.slot is None
    # the 3-sequence bucket (4) ran before the leave and again with the late one in the freed slot
    fours = [i for i, key in enumerate(replay_log) if key.batch == 4]
    twos = [i for i, key in enumerate(replay_log) if key.batch == 2]
    assert fours and twos and fours[0] < twos[0] < fours[-1]
    assert all(key.dense for key in replay_log)


def test_pools_and_their_graphs_serve_the_next_call(replay_log):
    """A second batched call on the model takes the first call's pool and replays its captured steps (none captured
    again); both answers equal the eager engine's; the kept pool is empty between calls."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1)
    inputs = batched_inputs(processor, [IMAGE, TWO_IMAGES])
    want = run(model, inputs, _with(cfg, False), 6)
    first = run(model, inputs, _with(cfg, True), 6)
    (kept,) = batched_graphs._POOLED[model.model.language_model]
    captured = list(kept.capture_log)
    assert captured and len(kept.pool._free) == kept.pool.num_slots and bool((kept.pool.slot_keys == MAX_KEY).all())
    second = run(model, inputs, _with(cfg, True), 6)
    assert batched_graphs._POOLED[model.model.language_model] == [kept] and kept.capture_log == captured
    assert_same_output(first, want, TOL, "step")
    assert_same_output(second, want, TOL, "step")


def test_settings_and_refusals(replay_log):
    """``graphs=None`` on a CPU model stays eager; ``graphs=True`` runs the captured steps; a contradiction with
    ``fast_path`` and the Gated DeltaNet families are refused with the setting named, before any compute."""
    model = family_model("qwen3_vl")
    assert BatchEngine(model, RaincheckConfig()).graphs is None
    assert BatchEngine(model, RaincheckConfig(), graphs=False).graphs is None
    assert BatchEngine(model, RaincheckConfig(fast_path=True)).graphs is not None
    assert BatchEngine(model, RaincheckConfig(), graphs=True).graphs is not None
    with pytest.raises(ValueError, match="graphs=False contradicts RaincheckConfig.fast_path=True"):
        BatchEngine(model, RaincheckConfig(fast_path=True), graphs=False)
    with pytest.raises(ValueError, match="graphs must be None"):
        BatchEngine(model, RaincheckConfig(), graphs="yes")
    gdn = family_model("qwen3_5")
    assert BatchEngine(gdn, RaincheckConfig()).graphs is None
    with pytest.raises(ValueError, match="fast_path=True .* Gated DeltaNet"):
        BatchEngine(gdn, RaincheckConfig(), graphs=True)
    engine = BatchEngine(model, RaincheckConfig(), graphs=True)
    engine.close()
    with pytest.raises(ValueError, match="after close"):
        engine.add(torch.ones(3, dtype=torch.long))


def test_buckets():
    assert [batched_graphs.batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65, 130)] == \
        [1, 2, 4, 8, 8, 16, 64, 64, 128, 192]
    auto, fixed = RaincheckConfig(chunk_size="auto"), RaincheckConfig(chunk_size=3)
    assert [batched_graphs.width_bucket(w, auto) for w in (1, 2, 8, 9, 33, 64)] == [1, 8, 8, 16, 64, 64]
    assert [batched_graphs.width_bucket(w, fixed) for w in (1, 2, 3, 4, 5)] == [1, 4, 4, 4, 8]


def test_a_kept_pool_does_not_keep_its_model_alive(replay_log):
    """The pool a batched call leaves for the model's next call holds no reference to the model: once the model is
    gone, so is its entry."""
    import gc

    import raincheck_hf
    from families import BY_NAME

    model = raincheck_hf.enable(BY_NAME["qwen3_vl"].build(seed=0))
    inputs = batched_inputs(family_processor("qwen3_vl"), [IMAGE, TEXT])
    run(model, inputs, RaincheckConfig(chunk_size=2, fast_path=True), 3)
    assert len(batched_graphs._POOLED) == 1 and replay_log
    del model
    gc.collect()
    assert len(batched_graphs._POOLED) == 0


def test_a_step_beside_a_paused_sequence_gathers_its_slots(replay_log):
    """Four sequences in slots 0 .. 3; the one in slot 0 is not fed for a few steps (its caller holds its token),
    so the others' steps (slots 1 .. 3) gather their slots, the bucket's padding in the scratch slot; with every
    sequence fed again, and after leaves (the highest slot moving into the hole), steps read views. Each sequence
    equals its own call."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    suppressed = torch.tensor(no_placeholder_ids(model))
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    requests = [Request(model, processor, cfg, row, n=n, arrive=0)
                for row, n in ((IMAGE, 9), (TEXT, 3), (TWO_IMAGES, 8), (VIDEO, 6))]
    engine = BatchEngine(model, _with(cfg, None), num_slots=4, graphs=True)
    for r in requests:
        r.seq = engine.add(r.ids, **r.media)
    active = {r.seq: r for r in requests}
    held, step = None, 0
    while active:
        if step == 4 and held is not None:  # the paused sequence is fed again
            engine.feed(*held)
            held = None
        for seq, logits in engine.step().items():
            r = active[seq]
            if r.take(logits, suppressed):
                r.cache = engine.remove(seq)
                del active[seq]
            elif step == 1 and seq is requests[0].seq:
                held = (seq, r.tokens[-1])  # not fed at steps 2 and 3
            else:
                engine.feed(seq, r.tokens[-1])
        step += 1
        assert step < 100
    for i, r in enumerate(requests):
        r.check(f"sequence {i}")
    gathered = [key for key in replay_log if not key.dense]
    assert [key.batch for key in gathered] == [4, 2]  # steps 2 and 3 (the 3-token sequence left after step 2)
    assert sum(1 for key in replay_log if key.dense) > 4
