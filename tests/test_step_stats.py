"""What the batched engine says its last step ran (`batch_engine.StepRecord`) and the batching loop's record of its
steps (`step_log.StepLog`, `BatchLoop.step_stats`), on CPU.

The engine's rows by kind are checked against what the sequences themselves recorded (their traces' chunk sizes,
their tokens, their plans' input rows, a restoring sequence's pieces) and its forwards' kinds against the captured
steps' own log (on CPU a "captured" step is the static-buffer callable, `fast.batched_graphs._EagerStep`). The
loop's figures must add up to its steps and to its turns; its arithmetic is checked on made-up times (no test
reads a wall clock's value).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from raincheck_hf import BatchLoop, Conversation, RaincheckConfig
from raincheck_hf.batch_engine import BatchEngine, StepRecord, StepRows
from raincheck_hf.step_log import StepLog
from raincheck_hf.fast import batched_graphs

from conftest import in_threads, no_placeholder_ids
from test_batch_engine import Request, _drive_with_restoring, _held
from test_batch_loop import IMAGES, QUESTIONS, held_loop
from test_batched import IMAGE, TEXT, TWO_IMAGES

CFG = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=1, fast_path=False)


@pytest.fixture()
def fresh_pools():
    """Kept pools (and their captured steps) dropped before and after: every key is captured anew."""
    batched_graphs.release_all()
    yield
    batched_graphs.release_all()


def _drive(engine, answers, restoring=()):
    """Step ``answers`` (and ``restoring`` sequences) to their ends; the engine's `StepRecord` of every step."""
    records = []
    model = engine.model
    _drive_with_restoring(engine, answers, list(restoring), torch.tensor(no_placeholder_ids(model)),
                          on_step=lambda step: records.append(engine.last_step))
    return records


def _totals(records) -> StepRows:
    return StepRows(*[sum(getattr(r.rows, f) for r in records) for f in StepRows._fields])


def _assert_rows_are_the_sequences(records, answers):
    """The records' rows add up to what each answer's sequence did: a decode row per token fed (all but its last
    token), its trace's chunk rows, its plan's input rows prefilled."""
    total = _totals(records)
    assert total.decode == sum(len(r.tokens) - 1 for r in answers)
    assert total.chunk == sum(sum(r.seq.trace.chunk_size_per_forward) for r in answers)
    assert total.prefill == sum(int(r.seq.plan.input_rows.numel()) for r in answers)


@pytest.mark.parametrize("mode", ["raincheck", "serial"])
def test_eager_engine_records_its_steps_rows(model, processor, mode):
    """Two image answers, prompts prefilled in pieces under a budget: every forward is eager; the first step is one
    sequence's prompt piece alone; decode steps carry a decode row per answer and the chunks their traces recorded
    (``serial``: in a forward of their own first)."""
    cfg = dataclasses.replace(CFG, mode=mode)
    answers = [Request(model, processor, cfg, IMAGE, n=8, arrive=0), Request(model, processor, cfg, TWO_IMAGES,
                                                                             n=8, arrive=2)]
    engine = BatchEngine(model, cfg, token_budget=40, num_slots=2)
    assert engine.last_step is None
    records = _drive(engine, answers)
    assert all(set(r.forwards) == {"eager"} and r.kind.split("+") == list(r.forwards) for r in records)
    first = records[0].rows
    assert first.sequences == 1 and first.decode == first.chunk == first.restoring == 0
    assert first.prefill == min(40, int(answers[0].seq.plan.input_rows.numel()))
    _assert_rows_are_the_sequences(records, answers)
    assert any(r.rows.chunk for r in records)  # raincheck: chunks rode with the tokens
    for r in records:
        assert len(r.forwards) == (2 if mode == "serial" and r.rows.chunk else 1)
        assert r.rows.total <= 40 or r.rows.decode + r.rows.chunk == r.rows.total
    assert max(r.rows.sequences for r in records) == 2


def test_a_decode_step_on_captured_steps_is_replayed_and_so_is_a_prompt_piece(model, processor, fresh_pools):
    """With ``graphs=True`` (on CPU the static-buffer step): every forward goes through the captured steps on an
    attention family; a step with decode rows beside a prompt piece too long to ride replays them and then the
    piece alone in a forward of its own (``"replayed+replayed"``: a prefill key); "captured" exactly when that
    launch captured its key (the captured steps' own log), "replayed" after."""
    cfg = dataclasses.replace(CFG, fast_path=None)
    answers = [Request(model, processor, cfg, IMAGE, n=10, arrive=0), Request(model, processor, cfg, TEXT, n=6,
                                                                              arrive=3)]
    engine = BatchEngine(model, cfg, num_slots=2, graphs=True)
    graphs = engine.graphs
    records = _drive(engine, answers)
    assert all(set(r.forwards) <= {"captured", "replayed"} for r in records), records
    for r in records:
        if r.rows.prefill and (r.rows.decode or r.rows.restoring):
            assert len(r.forwards) == 2, r
    assert any(len(r.forwards) == 2 for r in records)  # the second answer's prompt beside the first's decode row
    assert any(key.prefill for key in graphs.capture_log)  # (each prompt alone: a prefill key)
    forwards = [f for r in records for f in r.forwards]
    assert forwards.count("captured") == len(graphs.capture_log) > 0 and forwards.count("replayed") > 0
    assert forwards.count("captured") + forwards.count("replayed") == graphs.replays  # (a capture's launch replays)
    _assert_rows_are_the_sequences(records, answers)


def test_restoring_rows_beside_an_answer_are_counted_and_replayed(model, processor, fresh_pools):
    """A held conversation restores beside an answer: its pieces count as restoring rows (the rows it restored),
    and the steps of decode rows and restoring pieces run through the captured steps."""
    cfg = RaincheckConfig(retention=0.2, chunk_size=2, decode_guard=2, fast_path=None)
    cache, _ = _held(model, processor, cfg, TWO_IMAGES)
    answer = Request(model, processor, cfg, TEXT, n=8, arrive=0)
    engine = BatchEngine(model, cfg, num_slots=2, graphs=True)
    state = engine.restore(cache, max_rows=2)
    records = _drive(engine, [answer], [state])
    restored = sum(len(p) for p in state.restored)
    assert _totals(records).restoring == restored == cache.num_pending - state.num_pending > 0
    beside = [r for r in records if r.rows.restoring and r.rows.decode]
    assert beside and all(r.kind in ("captured", "replayed") and r.rows.sequences == 2 for r in beside)
    _assert_rows_are_the_sequences(records, [answer])


# ---- the loop's record ---------------------------------------------------------------------------------------

def _record(kind="replayed", sequences=2, decode=2, chunk=3, prefill=0, restoring=0) -> StepRecord:
    return StepRecord(tuple(kind.split("+")), StepRows(sequences, decode, chunk, prefill, restoring))


def test_step_log_arithmetic_on_made_up_times():
    """Each part of a step is the time between its marks, a step closes at the next launch (or when the loop finds
    nothing to run), a failed launch closes the last step and counts nothing, the means are per kind and per
    sequence count, and the record keeps only its last steps while the totals keep counting."""
    log = StepLog(keep=2)
    log.launched(_record(), 0.0, 1.0, cpu=0.5, cpu_at=100.0)
    log.open.preparing, log.open.reading, log.open.read = 1.5, 2.0, 4.0
    log.open.preparing_cpu = 100.5  # (the next step's preparation: 0.5 s of the choosing, 0.25 s of its CPU time)
    log.open.reading_cpu = 100.75  # (0.75 s of the loop thread's CPU time in its 1 s of choosing)
    log.finished(5.0)
    log.spent("join", 0.5)
    log.spent("restore", 0.25)
    log.launched(_record("eager", sequences=1, decode=0, chunk=0, prefill=7), 10.0, 13.0)  # no token read
    log.spent("idle", 2.0)  # (idle-time restoration: in the totals only)
    log.launched(None, 20.0)  # raised: closes the eager step, counts nothing
    log.launched(_record(), 30.0, 30.5)
    log.open.reading, log.open.read = 31.0, 31.5
    log.finished(32.0)
    log.idle(34.0)
    stats = log.snapshot(recent=10)
    assert stats["steps"] == stats["timed"] == 3
    assert stats["rows"] == {"decode": 4, "chunk": 6, "prefill": 7, "restoring": 0}
    assert stats["joins"] == 1 and stats["join_total_s"] == 0.5 and stats["restore_beside_total_s"] == 0.25
    assert stats["idle_restorations"] == 1 and stats["restore_idle_total_s"] == 2.0
    replayed, eager = stats["kinds"]["replayed"], stats["kinds"]["eager"]
    assert replayed["steps"] == 2 and replayed["sequences"] == 2 and eager["sequences"] == 1
    # step 1: launch 1, choose 1, wait 2, stream 1, between 5; step 3: 0.5 each, between 2
    assert replayed["step_ms"] == pytest.approx(7000.0) and replayed["wait_ms"] == pytest.approx(1250.0)
    assert replayed["gap_ms"] == pytest.approx(4250.0) and replayed["join_ms"] == pytest.approx(250.0)
    assert replayed["launch_cpu_ms"] == pytest.approx(250.0)  # (0.5 s of the first step's launch, 0 of the third's)
    assert replayed["choose_cpu_ms"] == pytest.approx(375.0)  # (0.75 s of the first step's choosing, none known after)
    assert replayed["prepare_ms"] == pytest.approx(250.0) and replayed["prepare_cpu_ms"] == pytest.approx(125.0)
    assert eager["prepare_ms"] == 0.0  # (no token read: nothing prepared)
    assert eager["launch_ms"] == pytest.approx(3000.0) and eager["choose_ms"] == pytest.approx(7000.0)
    assert eager["wait_ms"] == eager["gap_ms"] == 0.0 and eager["prefill_rows"] == 7
    assert list(replayed["by_sequences"]) == [2] and replayed["by_sequences"][2]["steps"] == 2
    assert stats["seconds"]["step"] == pytest.approx(24.0)  # 10 + 10 (to the failed launch) + 4
    assert [s["kind"] for s in stats["recent"]] == ["eager", "replayed"]  # (only the last two kept)
    assert stats["recent"][1]["between_ms"] == pytest.approx(2000.0)
    log.launched(_record(), 40.0, 41.0)
    log.reset()  # the step running now counts in neither
    log.launched(_record("captured"), 50.0, 51.0)
    stats = log.snapshot(recent=10)
    assert stats["steps"] == 1 and stats["timed"] == 0 and list(stats["kinds"]) == ["captured"]
    assert stats["recent"] == [] and stats["kinds"]["captured"]["step_ms"] is None


def test_turn_records_on_made_up_times():
    """A turn's preparation ahead, wait for the loop, join and time to its first token are the gaps between its marks; the steps
    launched between its join and its token count towards it, by kind (not those before its join, nor after its
    token); a turn that ends without a token leaves no record; first turns and follow-ups are summed apart (medians);
    a reset keeps the turns still waiting for their token."""
    log = StepLog(keep=8)
    log.launched(_record("eager", sequences=1, decode=0, chunk=0, prefill=7), 0.0, 0.5)  # before any join
    log.turn_joined("a", 1.0, 2.0, 2.5, False, 100, ahead_s=0.25, ahead_wait_s=0.125, ahead_cpu_s=0.0625)
    log.turn_joined("b", 1.5, 2.5, 3.0, True, 20)
    log.turn_joined("c", 1.5, 3.0, 3.25, True, 30)
    log.launched(_record("eager", sequences=2, decode=0, chunk=0, prefill=9), 4.0, 4.5)
    log.turn_first_token("b", 5.0)
    log.turn_ended("c")  # (cancelled before its token)
    log.launched(_record(), 6.0, 6.5)
    log.turn_first_token("a", 7.0)
    log.launched(_record(), 8.0, 8.5)  # after both tokens: counts for neither
    log.turn_first_token("a", 9.0)  # (not awaited any more: nothing)
    stats = log.snapshot(recent=5)
    first, follow = stats["turns"]["first"], stats["turns"]["follow_up"]
    assert first["turns"] == follow["turns"] == 1
    assert first["ahead_ms_p50"] == pytest.approx(250.0) and first["queue_ms_p50"] == pytest.approx(750.0)
    assert first["join_ms_p50"] == pytest.approx(500.0) and follow["ahead_ms_p50"] == 0.0
    assert first["ahead_wait_ms_p50"] == pytest.approx(125.0) and first["ahead_cpu_ms_p50"] == pytest.approx(62.5)
    assert first["first_ms_p50"] == pytest.approx(4500.0) and first["ttft_ms_p50"] == pytest.approx(6000.0)
    assert first["steps_p50"] == first["steps_max"] == 2 and first["kinds"] == {"eager": 1, "replayed": 1}
    assert follow["steps_p50"] == 1 and follow["kinds"] == {"eager": 1} and follow["prompt_rows_p50"] == 20
    assert follow["ttft_ms_p50"] == pytest.approx(3500.0)
    assert [t["follow_up"] for t in stats["recent_turns"]] == [True, False]
    log.turn_joined("d", 10.0, 10.0, 10.5, False, 50)
    log.reset()
    log.launched(_record(), 11.0, 11.5)
    log.turn_first_token("d", 12.0)
    stats = log.snapshot()
    assert stats["turns"]["first"]["turns"] == 1 and stats["turns"]["first"]["steps_max"] == 1
    assert stats["turns"]["follow_up"] == {"turns": 0, "prompt_rows_p50": None, "steps_p50": None,
                                           "steps_max": None, "kinds": {}, "ahead_ms_p50": None,
                                           "ahead_wait_ms_p50": None, "ahead_cpu_ms_p50": None, "queue_ms_p50": None,
                                           "join_ms_p50": None, "first_ms_p50": None, "ttft_ms_p50": None}
    assert stats["recent_turns"] == []


def _sync(loop: BatchLoop) -> None:
    """Two of the loop's iterations: the one running finishes, and the next one found no step (its last step
    closed)."""
    loop.call(lambda: None)
    loop.call(lambda: None)


def test_the_loops_figures_add_up_to_its_steps_and_turns(model, processor, monkeypatch):
    """Three conversations (two configs: two engines) asked at once, then follow-ups: the loop's steps by kind add
    up to `BatchLoop.steps`, every step timed once the loop is idle, rows to the turns' own records, a join per
    turn; the record of recent steps is bounded; a reset starts afresh."""
    monkeypatch.setattr(BatchLoop, "RECENT_STEPS", 5)
    serial = RaincheckConfig(mode="serial", retention=0.3, chunk_size=2, decode_guard=1)
    configs = [CFG, serial, CFG]
    with BatchLoop(model, max_batch_tokens=48) as loop:
        convs = [Conversation(model, processor, configs[i], background=False, max_new_tokens=6, loop=loop)
                 for i in range(3)]

        def ask(conv, question, images=()):
            return conv.ask(question, images=images, suppress_tokens=no_placeholder_ids(model))

        with held_loop(loop, 3):
            thread = threading.Thread(target=lambda: in_threads(lambda i: ask(convs[i], QUESTIONS[0], [IMAGES[i]]),
                                                                3))
            thread.start()
        thread.join()
        for conv in convs:
            ask(conv, QUESTIONS[1])
        _sync(loop)
        stats = loop.step_stats(recent=100)
        turns = [t for conv in convs for t in conv.turns]
        assert stats["steps"] == loop.steps == stats["timed"] > 0
        assert sum(k["steps"] for k in stats["kinds"].values()) == loop.steps
        assert set(stats["kinds"]) <= {"eager", "eager+eager"} and "eager+eager" in stats["kinds"]  # serial's
        for kind in stats["kinds"].values():
            assert sum(b["steps"] for b in kind["by_sequences"].values()) == kind["steps"]
        assert stats["rows"]["decode"] == sum(t.token_ids.numel() - 1 for t in turns)
        assert stats["rows"]["chunk"] == sum(sum(t.trace.chunk_size_per_forward) for t in turns)
        assert stats["joins"] == len(turns) == 6 and stats["join_total_s"] > 0
        assert len(stats["recent"]) == 5 and all(v >= 0 for s in stats["recent"] for k, v in s.items()
                                                 if k.endswith("_ms"))
        assert max(n for k in stats["kinds"].values() for n in k["by_sequences"]) >= 2  # answers shared steps
        first, follow = stats["turns"]["first"], stats["turns"]["follow_up"]
        assert first["turns"] == follow["turns"] == 3 and len(stats["recent_turns"]) == 6
        for turn in stats["recent_turns"]:
            assert turn["steps"] == sum(turn["kinds"].values()) >= 1 and turn["prompt_rows"] > 0
            assert min(turn[f"{name}_ms"] for name in ("ahead", "queue", "join", "first")) >= 0
        assert first["prompt_rows_p50"] > follow["prompt_rows_p50"]  # (an image prompt against a question)
        steps = loop.steps
        loop.reset_step_stats()
        ask(convs[0], "One more?")
        _sync(loop)
        stats = loop.step_stats()
        assert stats["steps"] == loop.steps - steps > 0 and stats["joins"] == 1 and stats["recent"] == []
        for conv in convs:
            conv.close()
