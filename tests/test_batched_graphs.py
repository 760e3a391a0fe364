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
from torch.utils._python_dispatch import TorchDispatchMode

from raincheck_hf import RaincheckConfig
from raincheck_hf.batch_engine import BatchEngine
from raincheck_hf.configuration import CHUNK_LADDER
from raincheck_hf.fast import batched_graphs, static_cache
from raincheck_hf.kv_pool import MAX_KEY
from raincheck_hf.models import get_adapter

from families import family_model, family_params, family_processor
from conftest import assert_same_output, no_placeholder_ids
from test_batch_engine import (Request, _drive_with_restoring, _held, _idle_restored, assert_some_chunks_cut, draw_case,
                               draw_restoring_case, draw_shared_case, drive, run_restoring_case)
from test_batched import IMAGE, TEXT, TWO_IMAGES, VIDEO, assert_cache_equal, batched_inputs, run

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
    """Count the forwards the graphs must run: ``"decode"`` those that carried decode rows only, ``"taken"`` those and
    the forwards where a short prompt's piece rode (`BatchedStepGraphs.accepts`), ``"rode"`` the prompt pieces in
    them."""
    counts = {"decode": 0, "taken": 0, "rode": 0}
    schedule = engine.scheduler.schedule

    def counted(adapter, sequences):
        prefilling = {seq for seq in sequences if not seq.prefilled}
        forwards = schedule(adapter, sequences)
        for f in forwards:
            decode = batched_graphs.decode_only(f)
            counts["decode"] += decode
            if decode or engine.graphs.accepts(f, engine.config):
                counts["taken"] += 1
                counts["rode"] += sum(1 for seq, _ in f if seq in prefilling)
        return forwards

    engine.scheduler.schedule = counted
    return counts


def run_restoring_fuzz(name: str, rng_seed: int, seed: int, replay_log) -> BatchEngine:
    """A drawn restoring case (`draw_restoring_case`: held conversations restoring beside random answers) on family
    ``name`` through an engine with the static-buffer steps: each answer equals its own eager batch-1 call, each
    restored cache equals idle-time restoration of its held cache, some restoring piece rode in a replayed step, and
    every decode-only forward was a replay. Returns the engine."""
    rng = random.Random(rng_seed)
    model, processor = family_model(name), family_processor(name)
    cfg, answers, held, max_rows, budget = draw_restoring_case(rng, model, processor, longest=7, most=3)
    engine = BatchEngine(model, _with(cfg, None), token_budget=budget, num_slots=1, capacity=16, graphs=True)
    counts = _decode_forwards(engine)
    restored, paths = run_restoring_case(model, engine, cfg, answers, held, max_rows, budget)
    what = f"{name} seed {seed} (mode {cfg.mode}, chunk {cfg.chunk_size}, pieces {max_rows}, budget {budget})"
    for i, r in enumerate(answers):
        r.check(f"{what} answer {i}")
    for cache, got in zip(held, restored):
        assert_cache_equal(got, _idle_restored(model, cache, cfg))
    assert ("replay", True, True) in paths, f"{what}: no restoring piece rode in a replayed decode step"
    assert [p for p, _, _ in paths].count("replay") == counts["taken"] == len(replay_log)
    return engine


def _run_captured_case(rng_seed: int, seed: int, draw, most: int):
    """A drawn case (``draw``, prompts of at most 7 rows, ``most`` sequences) on the attention family the seed picks,
    through an engine with the static-buffer steps, each sequence checked against its own eager batch-1 call;
    ``(family, config, requests, engine, decode-only forward counts)``."""
    rng = random.Random(rng_seed)
    name = GRAPH_FAMILIES[seed % len(GRAPH_FAMILIES)]
    model, processor = family_model(name), family_processor(name)
    cfg, requests, budget = draw(rng, model, processor, longest=7, most=most)
    engine = BatchEngine(model, _with(cfg, None), token_budget=budget, num_slots=1, capacity=16, graphs=True)
    counts = _decode_forwards(engine)
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"{name} seed {seed} sequence {i}")
    return name, cfg, requests, engine, counts


@pytest.mark.parametrize("views", [True, False], ids=["views", "gather"])
@pytest.mark.parametrize("seed", range(9))
def test_fuzz_captured_steps_match_alone(seed, views, replay_log, monkeypatch):
    """Random join schedules, prompts, modes, chunk sizes, budgets and held conversations on the attention families,
    decode steps through the static-buffer step (attention reading views of the lowest slots, or gathering the
    step's slots with the bucket's padding in the scratch slot): each sequence equals its own eager batch-1 call
    (tokens, logits 1e-4, cache, trace), every decode-only forward was a replay, and the pool ends empty."""
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    name, cfg, requests, engine, counts = _run_captured_case(7000 + seed, seed, draw_case, most=6)
    assert counts["decode"] > 0 and len(replay_log) == counts["taken"]
    # (with views, a decode forward beside a prompt piece whose sequence holds a lower slot gathers its slots)
    assert any(key.dense for key in replay_log) == views and (views or not any(key.dense for key in replay_log))
    pool = engine.pool
    assert engine.sequences == [] and len(pool._free) == pool.num_slots
    assert bool((pool.slot_keys == MAX_KEY).all())  # the scratch slot's keys included


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_shared_chunk_budget_on_captured_steps(seed, replay_log):
    """The shared chunk budget's fuzz (`draw_shared_case`: chunks cut to ladder sizes) through the static-buffer
    steps: the cut chunks' widths are among the ladder's buckets, every decode-only forward was a replay, and each
    sequence equals its own eager batch-1 call under its schedule."""
    name, cfg, requests, engine, counts = _run_captured_case(8000 + seed, seed, draw_shared_case, most=5)
    assert_some_chunks_cut(cfg, requests, f"{name} seed {seed}")
    assert counts["decode"] > 0 and len(replay_log) == counts["taken"]
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


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_spaced_chunks_on_the_captured_steps_equal_the_eager_engine(name, replay_log):
    """``chunk_every=2``: the batch's replayed steps alternate fused ``[chunk, token]`` widths and plain decode ones,
    and the answer equals the eager engine's."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1, chunk_every=2)
    want, got = _eager_and_graphs(name, [TWO_IMAGES, TEXT], cfg, 8)
    assert_same_output(got, want, TOL, "step")
    assert {key.width for key in replay_log} >= {1, 4}


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
    assert all(key.dense for key in replay_log if not key.prefill)  # (a prompt piece alone gathers its slot)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_pools_and_their_graphs_serve_the_next_call(replay_log, name):
    """A second batched call on the model takes the first call's pool and replays its captured steps (none captured
    again); both answers equal the eager engine's; the kept pool is empty between calls. Three sequences: the decode
    steps run dense over a bucket of four slots, which the pool has before the first prompt step is captured (grown
    after it, the pool's new tensors dropped that capture and the second call captured it again)."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1)
    inputs = batched_inputs(processor, [IMAGE, TWO_IMAGES, TEXT])
    want = run(model, inputs, _with(cfg, False), 6)
    first = run(model, inputs, _with(cfg, True), 6)
    (kept,) = batched_graphs._POOLED[get_adapter(model).text_model]
    captured = list(kept.capture_log)
    assert captured and len(kept.pool._free) == kept.pool.num_slots and bool((kept.pool.slot_keys == MAX_KEY).all())
    second = run(model, inputs, _with(cfg, True), 6)
    assert batched_graphs._POOLED[model.model.language_model] == [kept] and kept.capture_log == captured
    assert_same_output(first, want, TOL, "step")
    assert_same_output(second, want, TOL, "step")


def test_settings_and_refusals(replay_log):
    """``graphs=None`` on a CPU model stays eager; ``graphs=True`` runs the captured steps; a contradiction with
    ``fast_path`` is refused with the setting named, before any compute. (The Gated DeltaNet families:
    tests/test_batched_gdn_graphs.py.)"""
    model = family_model("qwen3_vl")
    assert BatchEngine(model, RaincheckConfig()).graphs is None
    assert BatchEngine(model, RaincheckConfig(), graphs=False).graphs is None
    assert BatchEngine(model, RaincheckConfig(fast_path=True)).graphs is not None
    assert BatchEngine(model, RaincheckConfig(), graphs=True).graphs is not None
    with pytest.raises(ValueError, match="graphs=False contradicts RaincheckConfig.fast_path=True"):
        BatchEngine(model, RaincheckConfig(fast_path=True), graphs=False)
    with pytest.raises(ValueError, match="graphs must be None"):
        BatchEngine(model, RaincheckConfig(), graphs="yes")
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


def _padding_in_held_slots(monkeypatch) -> list:
    """Per prepared step, the ``(slot, start row)`` of its padding rows in slots held by sequences outside it (start
    row > 0; `PreparedBatchStep.padding`), in a list the caller reads."""
    padded = []
    prepare = batched_graphs.BatchedStepGraphs.prepare

    def noted(self, entries, config, gather=False):
        step = prepare(self, entries, config, gather)
        padded.append([(slot, start) for slot, start in step.padding if start])
        return step

    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "prepare", noted)
    return padded


def test_a_step_beside_a_paused_sequence_puts_a_padding_row_in_its_slot(replay_log, monkeypatch):
    """Four sequences in slots 0 .. 3; the one in slot 0 is not fed for a few steps (its caller holds its token).
    The others' step of slots 1 .. 3 still reads views of slots 0 .. 3: the bucket's padding row sits in slot 0
    after the paused sequence's rows. Once the 3-token sequence (slot 1) left and the highest moved into its slot,
    slots 1 and 2 are beyond their own bucket of 2: that step takes the pool's bucket of 4 (padding in slot 0 after
    its rows, and in the freed slot 3). No step gathers its slots. Each sequence equals its own call."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    suppressed = torch.tensor(no_placeholder_ids(model))
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    requests = [Request(model, processor, cfg, row, n=n, arrive=0)
                for row, n in ((IMAGE, 9), (TEXT, 3), (TWO_IMAGES, 8), (VIDEO, 6))]
    engine = BatchEngine(model, _with(cfg, None), num_slots=4, graphs=True)
    padded = _padding_in_held_slots(monkeypatch)
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
    decoding = [key for key in replay_log if not key.prefill]  # (step 0's prompts: each alone, its slot gathered)
    assert all(key.dense for key in decoding) and sum(key.prefill for key in replay_log) == 4
    # (replays from step 1: step 3's two sequences, in slots 1 and 2, read the pool's bucket of 4)
    assert [key.batch for key in decoding] == [4, 4, 4, 4, 4, 2, 2, 1, 1, 1]
    assert [p for p in padded if p] and all(slot == 0 and start > 0 for p in padded for slot, start in p)
    assert sum(1 for key in decoding if key.dense) > 4


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_padding_beside_a_turns_prompt_piece_sits_after_its_rows(name, replay_log, monkeypatch):
    """Three sequences decode in slots 0 .. 2 while a fourth, in slot 3, prefills its prompt piece by piece under the
    token budget (each piece in its own forward after the decode rows': `RowScheduler`'s ``separate_prefill``). The
    decode steps read views of slots 0 .. 3 (the warmed-up dense keys, no new gathered key to capture in the middle
    of the answers): the bucket's padding row sits in slot 3 after the fourth sequence's rows, which its next piece
    overwrites. Each sequence equals its own eager batch-1 call (the GDN family's states of slot 3 included:
    written back unchanged by the padding row)."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    rows = ((IMAGE, 12, 0), (TEXT, 12, 0), (TWO_IMAGES, 12, 0), (IMAGE, 4, 3))
    requests = [Request(model, processor, cfg, row, n=n, arrive=at) for row, n, at in rows]
    engine = BatchEngine(model, _with(cfg, None), token_budget=12, num_slots=4, graphs=True)
    padded = _padding_in_held_slots(monkeypatch)
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"{name} sequence {i}")
    beside = [p for p in padded if p]
    assert len(beside) >= 2 and all(slot == 3 for p in beside for slot, _ in p)
    assert sorted({start for p in beside for _, start in p}) == sorted(start for p in beside for _, start in p)
    assert all(key.dense for key in replay_log if not key.prefill)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("most", [1, 2])
def test_a_step_runs_at_most_max_prompt_forwards_prompt_pieces(name, most, replay_log):
    """`RowScheduler.max_prompt_forwards` on captured steps: four prompts join while one answer decodes and at step
    0 together; no step runs more than ``most`` prompt pieces in forwards of their own (the others wait, a next step's
    decode rows first), every prompt still gets all its rows, and each answer equals its own eager batch-1 call."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    rows = ((IMAGE, 8, 0), (TEXT, 3, 0), (TWO_IMAGES, 4, 0), (IMAGE, 3, 2), (VIDEO, 3, 2), (TEXT, 2, 2))
    requests = [Request(model, processor, cfg, row, n=n, arrive=at) for row, n, at in rows]
    engine = BatchEngine(model, _with(cfg, None), num_slots=8, graphs=True, max_prompt_forwards=most)
    assert engine.scheduler.max_prompt_forwards == most and engine.scheduler.piece_forwards
    records = _step_records(engine)
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"{name} sequence {i}, at most {most} prompt forwards a step")
    pieces = [len(record.forwards) - (1 if record.rows.decode or record.rows.restoring else 0)
              for record, _ in records]
    assert max(pieces) == most and all(p <= most for p in pieces)  # (six prompts: the limit was reached)
    carried = [seq for _, prefilling in records for seq in prefilling]
    assert all(r.seq in carried for r in requests)


def test_max_prompt_forwards_is_checked_everywhere_it_is_set():
    """None or an int >= 1, refused with the setting's name before any compute: the engine, the loop, its attribute
    (which every engine of the loop follows), the server's settings and its command line."""
    from raincheck_hf.batch_loop import BatchLoop
    from raincheck_hf.serve import ServeSettings

    model = family_model("qwen3_vl")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"BatchEngine\(max_prompt_forwards=\.\.\.\) must be"):
            BatchEngine(model, RaincheckConfig(fast_path=False), max_prompt_forwards=bad)
        with pytest.raises(ValueError, match=r"BatchLoop\(max_prompt_forwards=\.\.\.\) must be"):
            BatchLoop(model, max_prompt_forwards=bad)
        with pytest.raises(ValueError, match="max_prompt_forwards must be"):
            ServeSettings(batching=True, max_prompt_forwards=bad)
    with BatchLoop(model, max_prompt_forwards=2) as loop:
        engine = loop._engine_for(RaincheckConfig(fast_path=False))
        assert engine.scheduler.max_prompt_forwards == 2
        loop.max_prompt_forwards = None
        assert engine.scheduler.max_prompt_forwards is None and loop.max_prompt_forwards is None
        with pytest.raises(ValueError, match="BatchLoop.max_prompt_forwards must be"):
            loop.max_prompt_forwards = 0
        assert engine.scheduler.max_prompt_forwards is None


# ---- short prompts ride in the captured steps (`BatchedStepGraphs.ride_rows`) ----

def _step_records(engine) -> list:
    """Every step's `StepRecord` with the sequences whose prompt pieces it carried, in order."""
    records = []
    step = engine.step

    def recorded():
        prefilling = {seq for seq in engine.sequences if not seq.prefilled}
        out = step()
        records.append((engine.last_step, {seq for seq in engine.carried if seq in prefilling}))
        return out

    engine.step = recorded
    return records


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_a_short_follow_up_rides_in_the_replayed_step(name, replay_log):
    """A held conversation's follow-up (its leftover deferred image rows, then a short text turn) joins while another
    answer decodes: its prompt fits in the widest warmed width and the step stays narrow (`ride_rows`), so it rides,
    whole, in the decode rows' replayed step instead of a forward of its own. The first answer's image prompt, alone
    at step 0, ran in a prefill step (batch 1, its slot gathered; on Qwen3-VL its DeepStack rows between the text
    rows placed row by row). Each answer equals its own eager batch-1 call (the follow-up: from its held cache)."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=31, decode_guard=1, fast_path=False)
    answer = Request(model, processor, cfg, IMAGE, n=12, arrive=0)
    follow = Request(model, processor, cfg, TWO_IMAGES, n=4, arrive=3, follow_up=True)
    engine = BatchEngine(model, _with(cfg, None), num_slots=2, graphs=True)
    width = engine.graphs.ride_width(engine.config)
    assert width == 32
    records = _step_records(engine)
    prompt_rows, add = {}, engine.add

    def added(*args, **kwargs):
        seq = add(*args, **kwargs)
        prompt_rows[seq] = len(seq.prefill)
        return seq

    engine.add = added
    drive(model, engine, [answer, follow])
    answer.check(f"{name} answer")
    follow.check(f"{name} follow-up beside it")
    follow_rows = prompt_rows[follow.seq]
    assert 0 < follow_rows <= width  # (the case this test is about)
    rode = [r for r, carried in records if follow.seq in carried]
    assert len(rode) == 1 and len(rode[0].forwards) == 1 and rode[0].kind in ("captured", "replayed")
    assert rode[0].rows.decode == 1 and rode[0].rows.prefill == follow_rows
    first = [key for key in replay_log if key.prefill]
    assert len(first) == 1 and first[0].batch == 1 and not first[0].dense
    assert first[0].width == batched_graphs.prefill_width(prompt_rows[answer.seq])


def test_a_prompt_rides_while_the_step_stays_narrow(replay_log):
    """`ride_rows`: a prompt rides whole when it fits in the widest warmed width (32 rows at chunk 31) and the step
    stays within `RIDE_MAX_ROWS` (batch bucket x width: its pass over the weights), or is already as wide (a chunk
    rides in it); else it runs in a forward of its own, as on the Gated DeltaNet families always."""
    model = family_model("qwen3_vl")
    cfg = RaincheckConfig(chunk_size=31)
    engine = BatchEngine(model, cfg, num_slots=2, graphs=True)
    rides = engine.graphs.ride_rows
    prompt = [None] * 20  # (only its length counts)
    assert batched_graphs.RIDE_MAX_ROWS == 1024
    assert rides(prompt, cfg, 1, 2) == 20  # 2 x 32 rows
    assert rides(prompt, cfg, 1, 32) == 20  # 32 x 32 = 1,024
    assert rides(prompt, cfg, 1, 33) == 0  # 64 x 32 > 1,024: a forward of its own
    assert rides(prompt, cfg, 32, 64) == 20  # the step is 32 wide already (chunks ride in it)
    assert rides(prompt, cfg, 8, 64) == 0
    assert rides([None] * 33, cfg, 32, 2) == 0  # wider than any warmed step
    assert rides(prompt, cfg, 1, 4, 128) == 20 and rides(prompt, cfg, 1, 5, 128) == 0  # 8 x 32 > 128
    assert rides(prompt, cfg, 1, 5, 256) == 20 and rides(prompt, cfg, 1, 9, 256) == 0  # 8 x 32 <= 256 < 16 x 32
    engine.close()


def test_ride_max_rows_is_checked_everywhere_it_is_set_and_reaches_the_engines_steps(replay_log):
    """``ride_max_rows`` (engine, loop): bad values refused with the setting named; the loop's value reaches its
    engines, also when set between steps; the engine's scheduler asks `ride_rows` with it: a 20-row prompt beside 5
    decoding sequences (batch bucket 8 x width 32 = 256 rows) rides at 256 and not at 128."""
    from raincheck_hf.batch_loop import BatchLoop

    model = family_model("qwen3_vl")
    for bad in (0, -1, 2.5, True, "256"):
        with pytest.raises(ValueError, match=r"BatchEngine\(ride_max_rows=\.\.\.\) must be"):
            BatchEngine(model, RaincheckConfig(fast_path=False), ride_max_rows=bad)
        with pytest.raises(ValueError, match=r"BatchLoop\(ride_max_rows=\.\.\.\) must be"):
            BatchLoop(model, ride_max_rows=bad)
    cfg = RaincheckConfig(chunk_size=31)
    engine = BatchEngine(model, cfg, num_slots=2, graphs=True)
    asked = []
    original = engine.graphs.ride_rows
    engine.graphs.ride_rows = lambda *args: asked.append(args[-1]) or original(*args)
    try:
        ride = engine.scheduler.ride
        prompt = [None] * 20
        assert ride(prompt, 1, 5) == 20 and asked[-1] == batched_graphs.RIDE_MAX_ROWS
        engine.ride_max_rows = 128
        assert ride(prompt, 1, 5) == 0 and asked[-1] == 128
        engine.ride_max_rows = 256
        assert ride(prompt, 1, 5) == 20 and asked[-1] == 256
        with pytest.raises(ValueError, match="BatchEngine.ride_max_rows must be"):
            engine.ride_max_rows = 0
        assert engine.ride_max_rows == 256
    finally:
        del engine.graphs.ride_rows
        engine.close()
    with BatchLoop(model, ride_max_rows=256) as loop:
        engine = loop._engine_for(RaincheckConfig(fast_path=False))
        assert engine.ride_max_rows == 256 and loop.ride_max_rows == 256
        loop.ride_max_rows = None
        assert engine.ride_max_rows is None and loop.ride_max_rows is None
        with pytest.raises(ValueError, match="BatchLoop.ride_max_rows must be"):
            loop.ride_max_rows = 0
        assert engine.ride_max_rows is None


@pytest.mark.parametrize("seed", range(6))
def test_deepstack_rows_of_a_prompt_piece_land_on_its_visual_rows(seed, replay_log):
    """`BatchedStepGraphs._fill` on random steps: each DeepStack addend equals the reference made row by row (a
    sequence's k-th visual row gets its k-th feature row, every other row zero: what HF's boolean-masked add does),
    for decode groups (features on the leading deferred rows), restoring pieces (every row visual) and prompt pieces
    whose visual rows lie anywhere (placed row by row on the device), in dense and gathered layouts."""
    from raincheck_hf.batched import RowGroup
    from raincheck_hf.cache_utils import DEFERRED, GENERATED, INPUT
    from raincheck_hf.models.base import RowBatch

    model = family_model("qwen3_vl")
    cfg = RaincheckConfig(chunk_size=15, fast_path=False)
    engine = BatchEngine(model, _with(cfg, None), num_slots=4, graphs=True)
    graphs = engine.graphs
    layers, hidden = graphs.num_deepstack, graphs.hidden
    assert layers > 0
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    class Seq:
        def __init__(self, slot, restores_only=False):
            self.slot, self.restores_only = slot, restores_only

    entries, want = [], []
    for slot in sorted(rng.sample(range(4), rng.randint(1, 4))):
        kind = rng.choice(("decode", "restoring", "prompt")) if entries else "prompt"  # (one prompt at least)
        n = rng.randint(1, 16) if kind != "decode" else rng.randint(1, 8)
        if kind == "decode":
            visual = torch.zeros(n, dtype=torch.bool)
            visual[:n - 1] = torch.rand(1, generator=gen).item() < 0.7  # its chunk's deferred rows, or none
            kinds = torch.full((n,), DEFERRED, dtype=torch.int8)
            kinds[-1] = GENERATED
        elif kind == "restoring":
            visual = torch.ones(n, dtype=torch.bool)
            kinds = torch.full((n,), DEFERRED, dtype=torch.int8)
        else:
            visual = torch.rand(n, generator=gen) < 0.5
            visual[rng.randrange(n)] = True  # (some visual row, anywhere)
            kinds = torch.full((n,), INPUT, dtype=torch.int8)
        v = int(visual.sum())
        features = [torch.randn(v, hidden, generator=gen) for _ in range(layers)] if v else None
        batch = RowBatch(torch.randn(n, hidden, generator=gen), torch.zeros(3, n, dtype=torch.long), visual, features)
        group = RowGroup(batch, torch.arange(n), torch.arange(n), kinds, want_logits=kind == "decode")
        entries.append((Seq(slot, kind == "restoring"), group))
        reference = [torch.zeros(n, hidden) for _ in range(layers)]
        for i in range(layers):
            if v:
                reference[i][visual] = features[i]
        want.append(reference)
    width = max(len(g) for _, g in entries)
    slots = [seq.slot for seq, _ in entries]
    for dense in (True, False):  # dense: batch row = slot, padding rows in the other slots; else rows 0 .. n - 1
        batch = 4 if dense else len(entries)
        key = batched_graphs.BatchStepKey(batch, width, 64, dense)
        buffers = batched_graphs.BatchStepBuffers.empty(key, hidden, layers, torch.float32, torch.device("cpu"))
        for t in buffers.deepstack:
            t.fill_(7.0)  # (stale values: every fill rewrites them)
        rows = slots if dense else list(range(len(entries)))
        pads = [(r, r, 0) for r in range(4) if r not in slots] if dense else []
        graphs._fill(buffers, entries, [0] * len(entries), rows, pads)
        for row, (_, group), reference in zip(rows, entries, want):
            n = len(group)
            for addend, expected in zip(buffers.deepstack, reference):
                assert torch.equal(addend[row, :n], expected), (seed, row)
                assert not addend[row, n:].any()
        for row, _, _ in pads:
            assert not any(addend[row].any() for addend in buffers.deepstack)
    engine.close()


def test_no_prompt_rides_on_the_gated_deltanet_families(replay_log):
    """A prompt's rows advance the Gated DeltaNet states as the captured step's ``[deferred, token]`` layout does
    not: on Qwen3.5 no prompt piece rides (`ride_width` 0; a step with one beside decode rows is not taken by the
    graphs), but a piece alone runs in a captured prefill step (`PackedGDNState.static_prefill`), up to the widest
    of `PREFILL_WIDTHS`: input rows, a continued conversation's leftover deferred rows then input rows, or leftover
    deferred rows only; no other layout."""
    from raincheck_hf.batched import RowGroup
    from raincheck_hf.cache_utils import DEFERRED, GENERATED, INPUT
    from raincheck_hf.models.base import RowBatch

    model = family_model("qwen3_5")
    cfg = RaincheckConfig(retention=0.3, chunk_size=15, decode_guard=1)
    engine = BatchEngine(model, cfg, num_slots=2, graphs=True)
    graphs = engine.graphs
    assert graphs.ride_width(cfg) == 0 and not graphs.rides and engine.scheduler.piece_forwards
    prompt = engine.add(torch.tensor([1, 2, 3]))
    assert graphs.ride_rows(prompt.prefill, cfg, 1, 2) == 0
    assert graphs.accepts([(prompt, prompt.prefill)], cfg)

    class Seq:
        restores_only = False

    def group(*kinds):
        n = len(kinds)
        batch = RowBatch(torch.zeros(n, graphs.hidden), torch.zeros(3, n, dtype=torch.long),
                         torch.zeros(n, dtype=torch.bool), None)
        return RowGroup(batch, torch.arange(n), torch.arange(n), torch.tensor(kinds, dtype=torch.int8))

    longest = batched_graphs.PREFILL_WIDTHS[-1]
    assert graphs.accepts([(Seq(), group(*[INPUT] * longest))], cfg)
    assert not graphs.accepts([(Seq(), group(*[INPUT] * (longest + 1)))], cfg)
    assert graphs.accepts([(Seq(), group(DEFERRED, DEFERRED, INPUT, INPUT))], cfg)  # leftover deferred rows in front
    assert graphs.accepts([(Seq(), group(DEFERRED, DEFERRED))], cfg)
    assert not graphs.accepts([(Seq(), group(INPUT, DEFERRED, INPUT))], cfg)
    decode = (Seq(), group(DEFERRED, GENERATED))
    assert graphs.accepts([decode], cfg)
    assert not graphs.accepts([decode, (Seq(), group(INPUT, INPUT))], cfg)  # no prompt rides
    engine.discard(prompt)
    engine.close()


@pytest.fixture
def extent_log(monkeypatch):
    """Every few-query attention call of a captured step (on the CPU its matmul form, `fast.attention._few_query`):
    ``(batch rows, slots, rows hidden by the mask and past the extent?, the step's key extents)``; checks each call
    keeps the promise the extents make to the Triton kernel (`fast.context.StepScope.key_extent`: no row of batch row
    ``b`` sees a slot at or past ``extent[b]``)."""
    from raincheck_hf.fast import attention
    from raincheck_hf.fast.context import active_scope

    log = []
    few_query = attention._few_query

    def checked(query, key, value, attention_mask, scale, low_precision_reads=False):
        scope = active_scope()
        extent = None if scope is None else scope.key_extent
        assert extent is not None and extent.shape == (query.shape[0],), "a batched step's attention without extents"
        slots = attention_mask.shape[-1]
        assert bool((extent >= 1).all()) and bool((extent <= slots).all()), (extent.tolist(), slots)
        past = torch.arange(slots)[None, :] >= extent[:, None]  # [B, S]
        hidden = not bool((attention_mask.expand(query.shape[0], -1, -1, -1) & past[:, None, None, :]).any())
        assert hidden, f"a row sees a slot past its sequence's extent {extent.tolist()} (span {slots})"
        log.append((query.shape[0], slots, extent.tolist()))
        return few_query(query, key, value, attention_mask, scale, low_precision_reads)

    monkeypatch.setattr(attention, "_few_query", checked)
    return log


@pytest.mark.parametrize("views", [True, False], ids=["views", "gather"])
@pytest.mark.parametrize("seed", range(3))
def test_every_captured_steps_attention_keeps_within_its_key_extents(seed, views, replay_log, extent_log,
                                                                    monkeypatch):
    """The key extents a captured step gives its attention (``write[:, -1] + 1``: each batch row's last row + 1,
    which the Triton kernel stops at) hide nothing the mask shows, in random join schedules with held conversations
    and prompt pieces, and with held conversations restoring beside answers (dense views and gathered slots): every
    call's mask is empty past each sequence's extent, and some extent falls short of the span (so the kernel skips
    reads)."""
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    _run_captured_case(9100 + seed, seed, draw_case, most=5)
    replay_log.clear()  # (the restoring case counts its own replays)
    run_restoring_fuzz(GRAPH_FAMILIES[(seed + 1) % len(GRAPH_FAMILIES)], 9200 + seed, seed, replay_log)
    assert extent_log and any(min(extent) < slots for _, slots, extent in extent_log)


def test_the_gated_deltanet_families_attention_keeps_within_its_key_extents(replay_log, extent_log):
    """Qwen3.5's gated attention layers in a batch's captured steps: the same promise (`extent_log`)."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1)
    want, got = _eager_and_graphs("qwen3_5", [TWO_IMAGES, TEXT, IMAGE], cfg, 6)
    assert_same_output(got, want, TOL, "step")
    assert extent_log and any(min(extent) < slots for _, slots, extent in extent_log)


KERNEL_STEPS_SCRIPT = r"""
import json, sys, dataclasses, torch
sys.path.insert(0, "tests")
from raincheck_hf import RaincheckConfig
from raincheck_hf.fast import attention, batched_graphs
from families import family_model, family_processor
from test_batched import IMAGE, TEXT, TWO_IMAGES, batched_inputs, run
calls = []  # per kernel call: (bounded, some block of padding rows only)
kernel = attention._few_query_triton
def counted(q, k, v, mask, scale, extent=None, real=None):
    group = q.shape[1] // k.shape[1]
    per_block = attention._block_m(group * q.shape[2]) // group
    skips = real is not None and any(first >= n for n in real.tolist() for first in range(0, q.shape[2], per_block))
    calls.append((extent is not None and real is not None, skips))
    return kernel(q, k, v, mask, scale, extent, real)
attention._few_query_triton = counted
name = sys.argv[1]
model, processor = family_model(name), family_processor(name)
inputs = batched_inputs(processor, [TWO_IMAGES, TEXT, IMAGE])
# (63-row chunks: a step 64 rows wide, two row blocks a sequence, the second skipped for one carrying no chunk)
cfg = RaincheckConfig(retention=0.1, chunk_size=63, decode_guard=1)
want = run(model, inputs, dataclasses.replace(cfg, fast_path=False), 6)
got = run(model, inputs, dataclasses.replace(cfg, fast_path=True), 6)
err = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
print(json.dumps({"same": torch.equal(got.sequences, want.sequences), "err": err, "kernel_calls": len(calls),
                  "bounded": sum(b for b, _ in calls), "skipping": sum(k for _, k in calls),
                  "finite": all(bool(torch.isfinite(l).all()) for l in got.logits)}))
"""


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_captured_steps_through_the_triton_kernel_equal_the_eager_engine(name):
    """A batch's captured steps with their attention in the few-query Triton kernel (Triton's interpreter on the CPU),
    bounded per sequence (its key extent, its padding rows' blocks skipped): the same tokens as the eager engine,
    logits within 1e-4, every logit finite."""
    import json
    import os
    import subprocess
    import sys

    from raincheck_hf._triton import triton_available

    if not triton_available():
        pytest.skip("needs Triton (its interpreter runs the kernel on CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", KERNEL_STEPS_SCRIPT, name], capture_output=True, text=True, env=env,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["same"] and r["finite"] and r["err"] <= TOL, r
    assert r["kernel_calls"] > 0 and r["bounded"] == r["kernel_calls"] and r["skipping"] > 0, r


# ---- restoring sequences (held conversations restored in the spare budget) in the captured steps ----

@pytest.mark.parametrize("views", [True, False], ids=["views", "gather"])
@pytest.mark.parametrize("seed", range(10))
def test_fuzz_restoring_sequences_ride_in_replayed_steps(seed, views, replay_log, monkeypatch):
    """Held conversations restore from step 0 beside random answers (`draw_restoring_case`: modes that defer, chunk
    sizes, budgets, shared chunk budgets, answers held or not, arriving at random steps) on the attention families,
    every step without a prompt piece through the static-buffer step (its buffers poisoned after every replay):
    restoring pieces ride in replayed decode steps (batch bucket counting them, pieces padded to the step's width),
    every forward without a prompt piece was a replay, each answer equals its own eager batch-1 call, and each
    restored cache equals idle-time restoration of its held cache; the pool ends empty."""
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    engine = run_restoring_fuzz(GRAPH_FAMILIES[seed % len(GRAPH_FAMILIES)], 7600 + seed, seed, replay_log)
    assert any(key.dense for key in replay_log) == views
    pool = engine.pool
    assert len(pool._free) == pool.num_slots and bool((pool.slot_keys == MAX_KEY).all())


def test_a_restoring_sequence_given_no_rows_holds_a_padding_row(replay_log):
    """A held conversation joins first (slot 0), an answer after it (slot 1). In the first step the held
    conversation's piece replays alone (batch 1, dense) before the answer's prompt runs alone in a forward of its own
    (a prefill key: batch 1, its slot gathered). For three steps the token budget is 1:
    the answer's token fills each, the restoring sequence gets no rows but holds slot 0, so those steps read views
    of slots 0 .. 1 (batch 2, dense) with a padding row in slot 0 after the restoring sequence's rows; with the
    budget lifted its pieces ride again in the same steps (batch 2); once the answer is done its pieces alone replay
    (batch 1, dense). The answer equals its own call, the restored cache idle-time restoration's."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.2, chunk_size=2, decode_guard=2, fast_path=False)
    cache, _ = _held(model, processor, cfg, TWO_IMAGES)
    answer = Request(model, processor, cfg, TEXT, n=8, arrive=0)
    engine = BatchEngine(model, _with(cfg, None), num_slots=2, graphs=True)
    state = engine.restore(cache)

    def budget(step):  # after step ``step``: the next step's budget
        engine.scheduler.token_budget = 1 if 1 <= step < 4 else None

    _, per_step = _drive_with_restoring(engine, [answer], [state], torch.tensor(no_placeholder_ids(model)),
                                        on_step=budget)
    answer.check("answer beside a restoring sequence held back by the budget")
    assert per_step == [2, 0, 0, 0, 2, 2, 2, 2] and state.slot == 0 and state.num_pending == 3
    while state.num_pending:
        assert engine.step() == {}
    got = engine.remove(state)
    # (the answer's prompt alone in its own forward, its slot gathered: a prefill key)
    assert [(key.batch, key.dense) for key in replay_log if not key.prefill] == ([(1, True)] + [(2, True)] * 7
                                                                                 + [(1, True)] * 2)
    assert sum(key.prefill for key in replay_log) == 1
    assert_cache_equal(got, _idle_restored(model, cache, cfg))


# ---- the host waits for the device once per decode step (issue 29) ----

class HostReads(TorchDispatchMode):
    """Counts, on a CPU model, the host's reads of what the device computed: each would make a GPU host wait.

    *Device data* is what derives from the model's parameters and buffers (every forward's output, the logits, the
    sampled tokens, the stopping criteria's flags, anything computed from them, and buffers they are copied into).
    A read is ``item`` / ``int`` / ``bool`` of device data (``_local_scalar_dense``), an op whose output size depends
    on device values (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` by a tensor, indexing with a
    boolean mask), or ``tolist`` / ``cpu`` / ``numpy`` of device data (`patch`: on a CPU these do not dispatch).
    What it cannot see: tensors the host makes on the device itself (``torch.full(..., device=...)``) and host to
    device copies, which are no copies on a CPU; tests/test_gpu.py counts those on CUDA."""

    SIZED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}

    def __init__(self, model):
        super().__init__()
        self.reads = 0
        for t in [*model.parameters(), *model.buffers()]:
            t._raincheck_device = True

    @staticmethod
    def on_device(t) -> bool:
        return isinstance(t, torch.Tensor) and getattr(t, "_raincheck_device", False)

    def patch(self, monkeypatch):
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _original=original, _name=name, **kwargs):
                if not self.on_device(t):
                    return _original(t, *args, **kwargs)
                self.reads += 1
                if _name != "cpu":
                    return _original(t, *args, **kwargs)
                host = t.detach().clone()  # what a GPU gives back: a new host tensor, host data from then on
                host._raincheck_device = False
                return host

            monkeypatch.setattr(torch.Tensor, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]  # (index's list of indices)
        device = any(self.on_device(t) for t in flat)
        name = func.overloadpacket.__name__
        if device and (name == "_local_scalar_dense" or name in self.SIZED
                       or (name == "repeat_interleave" and isinstance(args[-1] if args else None, torch.Tensor))):
            self.reads += 1
        if device and name in ("index", "index_put", "index_put_") and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1]):
            self.reads += 1
        out = func(*args, **kwargs)
        if device:
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor):
                    t._raincheck_device = True
            if name.endswith("_") or "out" in kwargs:  # in place: the written tensor now holds device data
                for t in ([args[0]] if args and isinstance(args[0], torch.Tensor) else []) + (
                        [kwargs["out"]] if isinstance(kwargs.get("out"), torch.Tensor) else []):
                    t._raincheck_device = True
        return out


def test_host_reads_counts_what_would_wait_for_the_device(monkeypatch):
    """The counter itself: reads of data derived from parameters count, host bookkeeping does not."""
    layer = torch.nn.Linear(3, 3)
    reads = HostReads(layer)
    reads.patch(monkeypatch)
    host = torch.arange(3)
    with torch.no_grad(), reads:
        out = layer(torch.ones(3))
        host.tolist(), int(host[0]), host.cpu(), host[host > 0]  # noqa: B018 (host data: free)
        assert reads.reads == 0
        out.argmax().tolist()
        int(out[0] > 0)
        out.cpu()
        out[out > 0]
        torch.nonzero(out)
        buffer = torch.zeros(3)
        buffer.copy_(out)
        buffer.tolist()
    assert reads.reads == 6


@pytest.mark.parametrize("mode,fast_path", [(None, True), ("full", True), ("full", False)],
                         ids=["default-captured", "full-captured", "full-eager"])  # None: the default mode (raincheck)
def test_batched_generate_reads_the_device_once_per_decode_step(mode, fast_path, monkeypatch):
    """``generate`` with B = 4 and ``fast_path=True`` (the captured decode steps, run eagerly on a CPU; in ``full``
    mode also the eager engine): the host reads what the device computed at most once per decode step (the sampled
    tokens and the rows still going, together), plus what the call does once (planning, prefill, leaving): 12
    answer tokens cost no more reads than 4 tokens plus 8. `HostReads` counts the reads; tests/test_gpu.py counts
    the real synchronizations on CUDA. (The eager engine's chunk steps are not bound: transformers' Qwen3-VL adds
    DeepStack features by boolean-mask indexing, a read per DeepStack layer.)"""
    batched_graphs.release_all()
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    inputs = batched_inputs(processor, [IMAGE, TWO_IMAGES, TEXT, IMAGE])
    kw = {} if mode is None else {"mode": mode}
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, fast_path=fast_path, **kw)
    counter = HostReads(model)
    counter.patch(monkeypatch)
    replays = []
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "launch",
                        lambda self, *a, _run=batched_graphs.BatchedStepGraphs.launch: replays.append(1) or _run(self, *a))

    def reads(n: int) -> int:
        counter.reads = 0
        with counter:
            out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, raincheck=cfg,
                                 return_dict_in_generate=True)
        assert out.sequences.shape[1] == inputs["input_ids"].shape[1] + n
        if mode is None:  # deferred chunks rode along with the decode steps
            assert all(t.restored_during_decode for t in out.raincheck if t.deferred.numel())
        return counter.reads

    short, long = 4, 12
    counts = {short: reads(short), long: reads(long)}
    print(f"host reads of device data: {counts}")
    assert bool(replays) == fast_path  # the decode steps ran as captured steps (fast_path=True)
    assert counts[short] >= short  # the counter sees the per-step read of the tokens
    assert counts[long] - counts[short] <= long - short, counts
    batched_graphs.release_all()


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_a_failed_prompt_capture_leaves_the_decode_steps_captured(name, monkeypatch):
    """A prompt step's capture that fails on CUDA (here: made to fail, the buffers on the CPU) warns, runs that piece
    eagerly on its buffers and every later prompt piece on the eager forward (``prefill_failed``; `accepts` says
    False for them), while the decode steps keep being captured and replayed (``failed`` stays False); the answers
    equal the eager engine's."""
    from raincheck_hf.models import get_adapter

    capture, capture_new = batched_graphs.BatchedStepGraphs._capture, batched_graphs.BatchedStepGraphs._capture_new

    def failing(self, key, buffers):
        if key.prefill:
            raise RuntimeError("capture failed")
        return capture(self, key, buffers)

    def as_on_cuda(self, key, buffers):  # (as on CUDA: a failed capture warns and falls back instead of raising)
        self.use_cuda = key.prefill
        try:
            return capture_new(self, key, buffers)
        finally:
            self.use_cuda = False

    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "_capture", failing)
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "_capture_new", as_on_cuda)
    batched_graphs.release_all()
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.5, chunk_size=3, decode_guard=1, fast_path=False)
    rows = [TWO_IMAGES, IMAGE]
    want = run(model, batched_inputs(processor, rows), cfg, 8)
    with pytest.warns(RuntimeWarning, match="capture of the prompt step .* failed"):
        got = run(model, batched_inputs(processor, rows), _with(cfg, True), 8)
    (kept,) = batched_graphs._POOLED[get_adapter(model).text_model]
    assert kept.prefill_failed and not kept.failed and kept.replays > 0
    assert kept.capture_log and not any(key.prefill for key in kept.capture_log)
    batched_graphs.release_all()
    assert_same_output(got, want, TOL, "step")


def test_warm_outside_no_grad_keeps_no_autograd_record():
    """`BatchedStepGraphs.warm` called directly (outside `generate` and `warm_up`, which run under ``no_grad``) runs its
    steps without autograd: no captured step's outputs hold a graph of the forward's activations (on a CPU each kept
    step's logits would otherwise keep every intermediate tensor of its forward alive)."""
    from raincheck_hf.models import get_adapter

    batched_graphs.release_all()
    model = family_model("qwen3_5")
    adapter = get_adapter(model)
    graphs = batched_graphs.acquire(adapter, adapter.text_model.config.num_hidden_layers, 2, 128)
    assert torch.is_grad_enabled()
    assert graphs.warm(RaincheckConfig(fast_path=True), 2) > 0
    logits = [buffers.logits for _, buffers in graphs._captured.values()]
    assert logits and all(t is not None and t.grad_fn is None and not t.requires_grad for t in logits)
    batched_graphs.release_all()


@pytest.mark.parametrize("name", family_params(["qwen3_vl", "qwen3_5"]))
def test_the_batched_pools_size_is_known_before_it_is_allocated(name, monkeypatch):
    """`batched_graphs.pool_bytes` is what a pool of that many places and rows allocates in its attention layers (Gated
    DeltaNet layers hold no keys); `check_pool_fits` refuses, before allocating, a pool larger than the free memory
    it is given (naming the sequences, the rows and the sizes), and warm_up's caller in the server names its options."""
    from raincheck_hf.kv_pool import SlotKVPool

    adapter = get_adapter(family_model(name))
    config = adapter.text_model.config
    need = batched_graphs.pool_bytes(adapter, 3, 100)
    pool = SlotKVPool(config.num_hidden_layers, batched_graphs.batch_bucket(3), 100, scratch_slot=True)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    for layer, kind in zip(pool.layers, kinds):
        if kind == "full_attention":
            states = torch.zeros(1, need["kv_heads"], 1, need["head_dim"], dtype=adapter.dtype)
            layer.lazy_initialization(states, states)
    allocated = sum(t.numel() * t.element_size() for layer in pool.layers if layer.is_initialized
                    for t in (layer.keys, layer.values))
    assert allocated == need["bytes"] > 0 and need["places"] == batched_graphs.batch_bucket(3) + 1
    assert need["layers"] == sum(1 for kind in kinds if kind == "full_attention")
    assert need["layers"] < len(kinds) if name == "qwen3_5" else need["layers"] == len(kinds)
    batched_graphs.check_pool_fits(adapter, 3, 100, free_bytes=need["bytes"])  # (fits exactly: no error)
    with pytest.raises(ValueError, match=r"3 sequences at once of up to 100 rows each need .* GiB"):
        batched_graphs.check_pool_fits(adapter, 3, 100, free_bytes=need["bytes"] - 1)

    import argparse

    import raincheck_hf.warmup as warmup
    from raincheck_hf.startup import run_warm_up

    def refused(*args, batch=None, **kwargs):
        batched_graphs.check_pool_fits(adapter, batch, kwargs["max_tokens"], free_bytes=0)

    monkeypatch.setattr(warmup, "warm_up", refused)
    args = argparse.Namespace(warm_up=True, warm_up_tokens=4096, cache_dir=False, max_running=64)
    with pytest.raises(SystemExit, match=r"--max-running 64 .* --warm-up-tokens 4096: 66 sequences .* Lower"):
        run_warm_up(args, family_model(name), None, RaincheckConfig(), 256, batch=66)


def test_restoring_places_are_those_the_device_holds():
    """`batch_loop.restoring_places_that_fit`: `BatchLoop.MAX_RESTORING` places beside ``max_running`` answers when
    the pool for both fits the free memory, else 0 (at 64 answers the 2 places would double the pool: a bucket of
    128); `ServeSettings.batch_places` adds them to ``max_running`` and refuses a bad value by name."""
    from raincheck_hf.batch_loop import BatchLoop, restoring_places_that_fit
    from raincheck_hf.serve import ServeSettings

    model = family_model("qwen3_vl")
    adapter = get_adapter(model)
    both = batched_graphs.pool_bytes(adapter, 64 + BatchLoop.MAX_RESTORING, 4096)["bytes"]
    answers = batched_graphs.pool_bytes(adapter, 64, 4096)["bytes"]
    assert both > 1.9 * answers
    assert restoring_places_that_fit(model, 64, 4096, free_bytes=both) == BatchLoop.MAX_RESTORING
    assert restoring_places_that_fit(model, 64, 4096, free_bytes=both - 1) == 0
    assert restoring_places_that_fit(model, 62, 4096, free_bytes=answers) == BatchLoop.MAX_RESTORING  # (one bucket)
    assert ServeSettings(max_running=64).batch_places == 64 + BatchLoop.MAX_RESTORING
    assert ServeSettings(max_running=64, restoring_places=0).batch_places == 64
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"restoring_places must be an integer >= 0 .*got {bad!r}"):
            ServeSettings(restoring_places=bad)


@pytest.mark.parametrize("ahead", [False, True], ids=["prepared-at-the-step", "prepared-ahead"])
@pytest.mark.parametrize("name,riding", [("qwen3_vl", False), ("qwen3_vl", True), ("qwen3_5", False)],
                         ids=["piece-alone", "beside-a-full-slot", "qwen3_5-piece-alone"])
def test_padding_short_of_memory_runs_narrower_and_evicts_nobody(name, riding, ahead, replay_log, monkeypatch):
    """A forward whose padding would outgrow the pool's slots while every entry's own rows fit them (a prompt's last
    piece at its prefill width; or an answer on a nearly full slot beside a prompt piece riding at its width) grows
    the slots without asking for room: padding is no reason to evict a held conversation. Where that growth finds no
    device memory, the forward runs as narrower eager forwards the slots hold, the pool keeps its size and nobody is
    asked for room; each answer equals its own batch-1 call. (Before, the step failed and so did every answer in it:
    an 80 GB H100 at 64 clients, `full` mode, 61 failed requests.)"""
    import weakref

    from conftest import Room, draw_test_image, failing_slot_resize

    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(mode="full", decode_guard=1)
    picture = dict(images=(draw_test_image(256, 256, seed=1),), text="Describe it.")  # (87 prompt rows)
    requests = [Request(model, processor, cfg, picture, n=8, arrive=0)]
    if riding:  # (the picture's answer fills its slot to 95 of 96 rows; a short prompt rides beside its last token)
        requests.append(Request(model, processor, cfg, dict(text="Hi"), n=2, arrive=7))
    capacity = 96 if riding else 128
    engine = BatchEngine(model, _with(cfg, None), token_budget=40, num_slots=2, capacity=capacity, graphs=True)
    room, narrowed, narrow = Room(), [], engine._narrowed
    engine.pool.on_short = weakref.WeakMethod(room.relieve)
    failed = failing_slot_resize(monkeypatch, lambda layer, slots, size: size > capacity)
    monkeypatch.setattr(engine, "_narrowed", lambda entries: narrowed.append(len(entries)) or narrow(entries))
    monkeypatch.setattr(engine, "NARROW_S", 1e9)  # (no second try within the test, however slow the machine)
    drive(model, engine, requests, ahead=ahead)
    for i, r in enumerate(requests):
        r.check(f"sequence {i}")
    assert narrowed and engine.pool.capacity == capacity and room.asked == []
    assert len(failed) == 1  # (one growth tried; the forwards after it ran narrower without trying again)
    if riding:
        assert 2 in narrowed  # (the answer and the riding piece, each in a forward the slots hold)
