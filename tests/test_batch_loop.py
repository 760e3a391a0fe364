"""`BatchLoop`: several `Conversation`s on one model share one continuous-batching loop (``Conversation(loop=)``).

The reference for every turn is the same dialogue run alone, without a loop, through batch-1 ``generate`` under the
same chunk schedule (``raincheck_chunk_schedule=`` replays the turn's ``trace.chunk_size_per_forward``: with a shared
chunk budget, several answers at once may carry smaller chunks): identical tokens and traces, logits within 1e-4
(fp32). Turns are made to meet in the loop by holding its thread (`held_loop`) until they were all handed over, so
the batching does not depend on thread timing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import types

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import raincheck_hf
from raincheck_hf import BatchLoop, Conversation, RaincheckConfig
from raincheck_hf.batch_loop import BatchTurn, turn_device_bytes
from raincheck_hf.models import get_adapter
from raincheck_hf.tiny import draw_test_image

from conftest import fail_remove_many, gate_restoring_pieces, in_threads, no_placeholder_ids, wait_for
from test_batched import assert_trace_equal
from test_conversation import _assert_every_deferred_token_once, _cancel_turn

TOL = 1e-4
CFG = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2)
SERIAL = RaincheckConfig(mode="serial", retention=0.3, chunk_size=2, decode_guard=1)
IMAGES = [draw_test_image(128, 96, seed=1), draw_test_image(96, 64, seed=2), draw_test_image(64, 128, seed=3)]
QUESTIONS = ["What is in this image?", "And the corner?"]


@contextlib.contextmanager
def held_loop(loop: BatchLoop, turns: int):
    """Hold the loop's thread (a task waiting on it) while the block hands ``turns`` turns over; on leaving the block
    they wait in the loop's queue and join together at its next iteration. On CUDA, graphs the turns' preparations
    would capture (the vision tower's, the selection's) must be captured before: a capture waits for the loop's
    iteration to end (`fast.scoping.device_work`), which the hold keeps from ending."""
    gate, inside = threading.Event(), threading.Event()

    def hold():
        inside.set()
        assert gate.wait(timeout=60)

    holder = threading.Thread(target=loop.call, args=(hold,))
    holder.start()
    assert inside.wait(timeout=60)
    try:
        yield
        deadline = time.monotonic() + 60
        while len(loop._incoming) < turns and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(loop._incoming) == turns
    finally:
        gate.set()
        holder.join()


def ask(conv, question, images=(), **kw):
    return conv.ask(question, images=images, output_logits=True, suppress_tokens=no_placeholder_ids(conv.model), **kw)


def ask_together(loop: BatchLoop, convs, kwargs: list[dict]) -> tuple[dict, dict]:
    """Conversation ``i`` asks the first question about ``IMAGES[i]`` (with ``kwargs[i]``) on a thread of its own, all
    the turns joining the loop at once (`held_loop`): ``({i: TurnResult}, {i: the error it raised})``."""
    got, errors = {}, {}

    def turn(i):
        try:
            got[i] = ask(convs[i], QUESTIONS[0], [IMAGES[i]], **kwargs[i])
        except BaseException as error:  # noqa: BLE001 - the caller's to check
            errors[i] = error

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(convs))]
    with held_loop(loop, len(convs)):
        for t in threads:
            t.start()
    for t in threads:
        t.join()
    return got, errors


class CancelsWhileStreaming:
    """A streamer that cancels ``conv``'s turn while its third token streams (the prompt is put first)."""

    def __init__(self, conv, at: int = 4):
        self.conv, self.at, self.puts = conv, at, 0

    def put(self, value):
        self.puts += 1
        if self.puts == self.at:
            self.conv.cancel()

    def end(self):
        pass


def alone(model, processor, config, turns, questions, images):
    """The dialogue of ``turns`` (TurnResults got on a loop) run alone, each turn under its chunk schedule."""
    with Conversation(model, processor, config, background=False, max_new_tokens=6) as conv:
        for k, (turn, question) in enumerate(zip(turns, questions)):
            ask(conv, question, images if k == 0 else (), max_new_tokens=turn.token_ids.numel(),
                raincheck_chunk_schedule=list(turn.trace.chunk_size_per_forward))
        return conv.turns


def assert_same_turn(got, want, what: str):
    assert torch.equal(got.token_ids, want.token_ids), f"{what}: {got.token_ids.tolist()} != {want.token_ids.tolist()}"
    assert got.text == want.text
    assert len(got.output.logits) == len(want.output.logits)
    for i, (a, b) in enumerate(zip(got.output.logits, want.output.logits)):
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"{what} forward {i}: max abs logit diff {diff:.2e}"
    assert_trace_equal(got.trace, want.trace)


def _assert_cancelled_dialogue_as_alone(model, processor, cfg, stopped, following):
    """A turn ``stopped`` by a cancel and the ``following`` one equal the same dialogue run alone: the first cut at
    the tokens it kept under its chunk schedule, the second under its own (tokens identical, logits within TOL)."""
    with Conversation(model, processor, cfg, background=False, max_new_tokens=8) as fresh:
        same = fresh.ask(QUESTIONS[0], images=[IMAGES[0]], max_new_tokens=stopped.token_ids.numel(),
                         raincheck_chunk_schedule=list(stopped.trace.chunk_size_per_forward))
        assert torch.equal(same.token_ids, stopped.token_ids)
        want = fresh.ask(QUESTIONS[1], output_logits=True,
                         raincheck_chunk_schedule=list(following.trace.chunk_size_per_forward))
    assert torch.equal(following.token_ids, want.token_ids)
    for a, b in zip(following.output.logits, want.output.logits):
        assert (a - b).abs().max() <= TOL


def test_conversations_from_several_threads_share_the_loop_and_answer_as_alone(model, processor):
    """Three conversations (two configs: two engines), two turns each, asked from three threads at once (one
    streamed): every turn equals its dialogue alone, follow-ups continue their held caches, and steps ran several
    sequences."""
    configs = [CFG, SERIAL, CFG]
    with BatchLoop(model, max_batch_tokens=48) as loop:
        convs = [Conversation(model, processor, configs[i], background=False, max_new_tokens=6, loop=loop)
                 for i in range(3)]
        streamed = {}

        def first(i):
            if i == 1:
                s = ask(convs[i], QUESTIONS[0], [IMAGES[i]], stream=True)
                streamed["text"] = "".join(s)
                streamed["result"] = s.result
            else:
                ask(convs[i], QUESTIONS[0], [IMAGES[i]])

        errors = []
        with held_loop(loop, 3):
            threads = threading.Thread(target=lambda: errors.extend(in_threads(first, 3)))
            threads.start()
        threads.join()
        assert not errors, errors
        assert loop.max_batch_size > 1 and loop.steps > 0
        assert {e.config.mode for e in loop._engines} == {"raincheck", "serial"}
        assert streamed["text"] == streamed["result"].text and streamed["result"] is convs[1].turns[0]
        caches = [c.cache for c in convs]

        with held_loop(loop, 3):
            threads = threading.Thread(target=lambda: errors.extend(
                in_threads(lambda i: ask(convs[i], QUESTIONS[1]), 3)))
            threads.start()
        threads.join()
        assert not errors, errors
        for i, conv in enumerate(convs):
            assert len(conv.turns) == 2 and conv.cache is not caches[i]
            _assert_every_deferred_token_once(conv)
            want = alone(model, processor, configs[i], conv.turns, QUESTIONS, [IMAGES[i]])
            for k in range(2):
                assert_same_turn(conv.turns[k], want[k], f"conversation {i} turn {k}")
            assert torch.equal(conv.sequences, want[1].output.sequences.cpu())
        assert loop.running == 0 and all(not e.sequences for e in loop._engines)
        for conv in convs:
            conv.close()
    assert not loop._thread.is_alive()


def test_a_loop_that_does_not_launch_ahead_gives_the_same_turns(model, processor):
    """``launch_ahead=False``: every step is launched after its predecessor's streaming (none ahead); the turns are
    those of the dialogues alone, as with launching ahead. A setting that is not a bool is refused."""
    with pytest.raises(ValueError, match="launch_ahead"):
        BatchLoop(model, launch_ahead="no")
    with BatchLoop(model, max_batch_tokens=48, launch_ahead=False) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=6, loop=loop) for _ in range(2)]
        errors = []
        with held_loop(loop, 2):
            thread = threading.Thread(target=lambda: errors.extend(in_threads(
                lambda i: ask(convs[i], QUESTIONS[0], [IMAGES[i]]), 2)))
            thread.start()
        thread.join()
        assert not errors, errors
        assert loop.steps > 0 and loop.steps_ahead == 0 and loop.step_stats()["steps_ahead"] == 0
        for i, conv in enumerate(convs):
            want = alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[i]])
            assert_same_turn(conv.turns[0], want[0], f"conversation {i}")


def test_steps_launched_ahead_of_the_streaming_leave_every_answer_as_alone(model, processor, monkeypatch):
    """Three conversations of one config, two turns each, asked at once: while nothing waits to join that cannot
    join while a step runs, the loop launches the next step right after a step's tokens are read, before it streams
    them (``steps_ahead``; the turns that ended in the step leave first); every turn still equals its dialogue alone,
    every launched step's tokens were taken, and no step ran without an answer in it (the last turn's end launches
    nothing)."""
    empty = []
    launch = BatchLoop._launch

    def counted(self, engine):
        logits = launch(self, engine)
        if not any(not seq.restores_only for seq in engine.carried):
            empty.append(self.steps)
        return logits

    monkeypatch.setattr(BatchLoop, "_launch", counted)
    with BatchLoop(model, max_batch_tokens=48) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=6, loop=loop) for _ in range(3)]
        streamed = {}

        def turn(i, k):
            if i == 0:
                s = ask(convs[i], QUESTIONS[k], [IMAGES[i]] if k == 0 else (), stream=True)
                streamed[k] = "".join(s)
            else:
                ask(convs[i], QUESTIONS[k], [IMAGES[i]] if k == 0 else ())

        errors = []
        for k in range(2):
            with held_loop(loop, 3):
                threads = threading.Thread(target=lambda: errors.extend(in_threads(lambda i: turn(i, k), 3)))
                threads.start()
            threads.join()
            assert not errors, errors
        assert loop.steps_ahead > 0 and loop.steps_completed == loop.steps and not empty
        assert loop.step_stats()["steps_ahead"] == loop.steps_ahead  # (no reset since the loop began)
        assert [streamed[k] for k in range(2)] == [t.text for t in convs[0].turns]
        for i, conv in enumerate(convs):
            want = alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[i]])
            for k in range(2):
                assert_same_turn(conv.turns[k], want[k], f"conversation {i} turn {k}")
            _assert_every_deferred_token_once(conv)
            conv.close()
        assert loop.running == 0


@pytest.mark.parametrize("name, in_flight", [("qwen3_vl", True), ("qwen3_vl", False), ("qwen3_5", True)])
def test_turns_that_arrive_while_a_step_runs_join_before_the_next_step_and_equal_their_dialogues_alone(
        name, in_flight):
    """While a long answer runs, a new conversation's first turn and a held conversation's follow-up arrive (handed
    over while the loop streams a token, a step launched ahead running): with ``join_in_flight`` on both
    join during the next step, before the step after it is prepared (``joins_in_flight``), and that step, carrying
    their prompts, is launched ahead too; with it off they join between steps, and no step is launched ahead of
    their joining. Every turn equals its dialogue alone either way, on both families (Qwen3.5: the joining
    sequences' Gated DeltaNet states loaded while the step runs); a setting that is not a bool is refused."""
    from families import family_model, family_processor

    model, processor = family_model(name), family_processor(name)
    with pytest.raises(ValueError, match="join_in_flight"):
        BatchLoop(model, join_in_flight=1)
    cfg = RaincheckConfig(retention=0.25, chunk_size=64, decode_guard=1)  # (every deferred row back in one chunk)
    with BatchLoop(model, max_batch_tokens=None, join_in_flight=in_flight) as loop:
        long, new, held = (Conversation(model, processor, cfg, background=False, max_new_tokens=6, loop=loop)
                           for _ in range(3))
        ask(held, QUESTIONS[0], [IMAGES[2]])
        assert held.pending == 0
        others, errors = [], []
        ahead_at = {}

        class HandsOver:  # at the long answer's third token: the other two turns asked, and waiting in the queue
            def __init__(self):
                self.puts = 0

            def put(self, value):
                self.puts += 1
                if self.puts == 4:
                    ahead_at["before"] = loop.steps_ahead
                    others.extend(threading.Thread(target=lambda c=c, q=q, im=im: errors.extend(
                        in_threads(lambda _: ask(c, q, im), 1))) for c, q, im in (
                            (new, QUESTIONS[0], [IMAGES[1]]), (held, QUESTIONS[1], ())))
                    for t in others:
                        t.start()
                    deadline = time.monotonic() + 60
                    while len(loop._incoming) < 2 and time.monotonic() < deadline:
                        time.sleep(0.002)
                    assert len(loop._incoming) == 2

            def end(self):
                pass

        ask(long, QUESTIONS[0], [IMAGES[0]], max_new_tokens=12, streamer=HandsOver())
        for t in others:
            t.join()
        assert not errors, errors
        assert loop.joins_in_flight == (2 if in_flight else 0)
        if in_flight:  # (the steps after the hand-over: every one but the last of the long answer launched ahead)
            assert loop.steps_ahead - ahead_at["before"] >= 12 - 4 - 1
        for conv, image in ((long, IMAGES[0]), (new, IMAGES[1]), (held, IMAGES[2])):
            want = alone(model, processor, cfg, conv.turns, QUESTIONS, [image])
            for k, turn in enumerate(conv.turns):
                assert_same_turn(turn, want[k], f"turn {k}")
            conv.close()
        assert loop.running == 0


def test_an_answer_cancelled_in_a_step_leaves_before_the_next_step_which_goes_ahead(model, processor, monkeypatch):
    """Two answers at once; one client cancels while a token of its streams: at the next step its answer ends (the
    cancellation read on the host) and leaves before the step after it is prepared again, and that step, the other
    answer's, is launched ahead of the streaming all the same. Both turns equal their dialogues alone (the cancelled
    one cut at the tokens it kept)."""
    launched_after = []
    launch_ahead = BatchLoop._launch_ahead

    def recorded(self, engine, gone=()):
        launch_ahead(self, engine, gone)
        if gone:
            launched_after.append(self._ahead is not None)

    monkeypatch.setattr(BatchLoop, "_launch_ahead", recorded)
    cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2)
    with BatchLoop(model, max_batch_tokens=None) as loop:
        convs = [Conversation(model, processor, cfg, background=False, loop=loop) for _ in range(2)]

        got, errors = ask_together(loop, convs, [dict(streamer=CancelsWhileStreaming(convs[0]), max_new_tokens=10),
                                                 dict(max_new_tokens=12)])
        assert not errors, errors
        assert got[0].cancelled and got[0].token_ids.numel() < 10 and got[1].token_ids.numel() == 12
        assert launched_after[:1] == [True], launched_after  # (the cancelled answer's end: the next step went ahead)
        for i, conv in enumerate(convs):
            want = alone(model, processor, cfg, conv.turns, QUESTIONS, [IMAGES[i]])
            assert_same_turn(conv.turns[0], want[0], f"conversation {i}")
            conv.close()


def test_a_turn_that_fails_or_is_cancelled_while_a_step_runs_ahead_leaves_a_consistent_conversation(model, processor):
    """A step launched ahead may carry a turn whose streamer then fails on the token before it, or whose client
    cancels while it streams: the failed turn leaves its conversation as it was, the cancelled one keeps the tokens
    it got (the step ahead's included) with a consistent cache, and the next turns equal their dialogues alone."""
    from raincheck_hf.batch_loop import BatchLoop as Loop

    failed_ahead = []
    fail = Loop._fail

    def recorded(self, seq, error):
        failed_ahead.append(self._ahead is not None)
        return fail(self, seq, error)

    cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2)
    with BatchLoop(model, max_batch_tokens=48) as loop, \
            Conversation(model, processor, cfg, background=False, max_new_tokens=8, loop=loop) as conv:
        first = ask(conv, QUESTIONS[0], [IMAGES[0]])

        class Breaks:  # the prompt's put, then a token each: fails at the second token
            def __init__(self):
                self.puts = 0

            def put(self, value):
                self.puts += 1
                if self.puts == 3:
                    raise OSError("the terminal went away")

            def end(self):
                pass

        cache = conv.cache
        Loop._fail = recorded
        try:
            with pytest.raises(OSError, match="terminal"):
                conv.ask(QUESTIONS[1], streamer=Breaks())
        finally:
            Loop._fail = fail
        assert failed_ahead == [True]  # (the step after that token was already running)
        assert conv.cache is cache and conv.turns == [first]
        following = ask(conv, QUESTIONS[1])
        want = alone(model, processor, cfg, conv.turns, QUESTIONS, [IMAGES[0]])
        for k in range(2):
            assert_same_turn(conv.turns[k], want[k], f"turn {k}")

    with BatchLoop(model, max_batch_tokens=48) as loop, \
            Conversation(model, processor, cfg, background=False, max_new_tokens=8, loop=loop) as conv:
        # (cancels while the third token streams, the step after it running ahead)
        stopped = conv.ask(QUESTIONS[0], images=[IMAGES[0]], streamer=CancelsWhileStreaming(conv))
        assert stopped.cancelled and stopped.token_ids.numel() == 4 and loop.steps_ahead > 0
        assert conv.cache.source_length == conv.sequences.shape[1] - 1  # the last token is not fed yet
        _assert_every_deferred_token_once(conv)
        following = conv.ask(QUESTIONS[1], output_logits=True)
    _assert_cancelled_dialogue_as_alone(model, processor, cfg, stopped, following)


def test_the_loop_restores_held_conversations_in_idle_time(model, processor):
    """No worker of the conversation's own: the loop restores its leftovers once no answer runs; the follow-up then
    has nothing left to restore and equals the dialogue alone (whose leftovers ride with the follow-up)."""
    late = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=16)  # the answer ends before any chunk
    with BatchLoop(model, max_batch_tokens=64) as loop, \
            Conversation(model, processor, late, max_new_tokens=6, loop=loop) as conv:
        assert conv._restorer is None
        first = ask(conv, QUESTIONS[0], [IMAGES[0]])
        deferred = first.trace.deferred.numel()
        assert deferred > 0 and first.restored_during_answer == 0
        deadline = time.monotonic() + 60
        # the turn's figures, not conv.pending: they change under the conversation's lock once a chunk is stored,
        # while the cache's pending count drops as the chunk is taken
        while first.restored_after_answer < deferred and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conv.pending == 0 and first.restored_after_answer == deferred and first.pending == 0
        assert loop.restored_idle == deferred and loop.restored_busy == 0
        follow = ask(conv, QUESTIONS[1])
        assert follow.trace.restored_per_forward[0].numel() == 0
        want = alone(model, processor, late, conv.turns, QUESTIONS, [IMAGES[0]])
        assert want[1].trace.restored_per_forward[0].numel() == deferred
        assert torch.equal(follow.token_ids, want[1].token_ids) and torch.equal(first.token_ids, want[0].token_ids)
        for a, b in zip(follow.output.logits, want[1].output.logits):
            assert (a - b).abs().max() <= TOL
        _assert_every_deferred_token_once(conv)


def _first_turn_beside_a_long_answer(model, processor, config, loop):
    """Three conversations on ``loop``: A's first turn (6 tokens, on ``IMAGES[0]``) and B's 400-token streamed answer
    join in one step; C waits. Returns ``((a, b, c), B's stream, A's first turn)`` once A's answer ended (B still
    answering)."""
    a = Conversation(model, processor, config, max_new_tokens=6, loop=loop)
    b = Conversation(model, processor, config, background=False, max_new_tokens=400, loop=loop)
    c = Conversation(model, processor, config, background=False, max_new_tokens=6, loop=loop)
    box = {}
    with held_loop(loop, 2):
        long = b.ask("Tell me everything.", stream=True, suppress_tokens=no_placeholder_ids(model),
                     min_new_tokens=400)
        asking = threading.Thread(target=lambda: box.setdefault("first", ask(a, QUESTIONS[0], [IMAGES[0]])))
        asking.start()
    asking.join()
    return (a, b, c), long, box["first"]


def test_a_held_conversation_restores_beside_another_answer_and_complete_goes_through_the_loop(model, processor):
    """A's first turn and B's long answer join together; once A's answer ends, the loop restores A's leftovers in
    the spare budget of B's steps (B still answering, so never in idle time); A's follow-up then equals its dialogue
    alone. `complete` on C runs on the loop's thread and restores all of C's leftovers."""
    late = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=16)  # answers end before any chunk
    with BatchLoop(model, max_batch_tokens=64) as loop:
        (a, b, c), long, first = _first_turn_beside_a_long_answer(model, processor, late, loop)
        deferred = first.trace.deferred.numel()
        assert deferred > 0 and first.restored_during_answer == 0
        deadline = time.monotonic() + 60
        while first.restored_after_answer < deferred and time.monotonic() < deadline:  # (see the test above)
            time.sleep(0.01)
        assert loop.running == 1  # B still answers: A was restored beside it
        assert a.pending == 0 and first.restored_after_answer == deferred
        assert loop.restored_busy == deferred and loop.restored_idle == 0
        long.close()
        assert long.result.cancelled
        ask(c, QUESTIONS[0], [IMAGES[1]])
        left = c.pending
        assert left > 0 and c.complete() == left and c.pending == 0 and c.turns[0].restored_after_answer == left
        follow = ask(a, QUESTIONS[1])
        assert follow.trace.restored_per_forward[0].numel() == 0
        want = alone(model, processor, late, a.turns, QUESTIONS, [IMAGES[0]])
        assert torch.equal(first.token_ids, want[0].token_ids) and torch.equal(follow.token_ids, want[1].token_ids)
        for x, y in zip(follow.output.logits, want[1].output.logits):
            assert (x - y).abs().max() <= TOL
        for conv in (a, b, c):
            conv.close()


def test_restoring_beside_the_answers_keeps_to_max_sequences(model, processor, monkeypatch):
    """``max_sequences=2`` (the places a server warmed its engine for): A's first turn answers beside B's long answer,
    then A's leftovers restore beside it (2 sequences; held after two pieces). C's turn then needs A's place: A leaves
    with the 6 rows restored so far, C answers beside B, and once C's answer ends A restores the rest beside B. No
    step carries more than 2 sequences; A's and C's follow-ups equal their dialogues alone."""
    from raincheck_hf.batch_engine import BatchEngine

    sizes, step = [], BatchEngine.step

    def counted(self, *args, **kwargs):
        sizes.append(len(self.sequences))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(BatchEngine, "step", counted)
    gate = gate_restoring_pieces(monkeypatch, 2)  # two pieces, then none until the gate opens again
    late = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=16)  # (pieces of 3 rows: the idle chunk)
    with pytest.raises(ValueError, match="max_sequences=0"):
        BatchLoop(model, max_sequences=0)
    with BatchLoop(model, max_batch_tokens=64, max_sequences=2) as loop:
        (a, b, c), long, first = _first_turn_beside_a_long_answer(model, processor, late, loop)
        deferred = first.trace.deferred.numel()
        assert deferred > 6
        deadline = time.monotonic() + 60
        while (gate["left"] > 0 or loop.restored_busy < 6) and time.monotonic() < deadline:  # (counted at launch)
            time.sleep(0.005)
        assert a in loop._restoring and loop.restored_busy == 6
        third = ask(c, QUESTIONS[0], [IMAGES[1]])  # (joins beside B: A's place is taken back)
        # (A left with its 6 rows; once C's answer ended it may be restoring again, the gate giving it no pieces)
        assert first.restored_after_answer == 6 and a.pending == deferred - 6
        assert loop.running == 1  # B still answers
        gate["left"] = deferred  # A's restoration goes on beside B
        deadline = time.monotonic() + 60
        while first.restored_after_answer < deferred and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.pending == 0 and loop.restored_busy == deferred + c.turns[0].restored_after_answer
        long.close()
        assert max(sizes) == 2 and sizes.count(2) > 0
        follows = {conv: ask(conv, QUESTIONS[1]) for conv in (a, c)}
        for conv, image, turn in ((a, IMAGES[0], first), (c, IMAGES[1], third)):
            want = alone(model, processor, late, conv.turns, QUESTIONS, [image])
            assert torch.equal(turn.token_ids, want[0].token_ids)
            assert torch.equal(follows[conv].token_ids, want[1].token_ids)
            for x, y in zip(follows[conv].output.logits, want[1].output.logits):
                assert (x - y).abs().max() <= TOL
        for conv in (a, b, c):
            conv.close()


@pytest.mark.parametrize("how", ["conversation.cancel", "break", "close"])
def test_a_cancelled_turn_on_the_loop_is_left_as_conversation_cancel_leaves_it(model, processor, how):
    """Stopped at its 5th token (the gate holds the loop's thread there until the cancel): the history keeps those
    5 tokens, the cache is consistent, and the next turn continues from there as alone."""
    cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2)
    with BatchLoop(model, max_batch_tokens=48) as loop, \
            Conversation(model, processor, cfg, background=False, max_new_tokens=8, loop=loop) as conv:
        stopped = _cancel_turn(conv, how, QUESTIONS[0], [IMAGES[0]])
        assert stopped.cancelled and stopped.token_ids.numel() == 5
        assert conv.turns[-1] is stopped and torch.equal(conv.sequences[0, -5:], stopped.token_ids)
        assert conv.cache.source_length == conv.sequences.shape[1] - 1  # the last token is not fed yet
        _assert_every_deferred_token_once(conv)
        following = conv.ask(QUESTIONS[1], output_logits=True)
        assert not following.cancelled
        _assert_every_deferred_token_once(conv)
        assert loop.running == 0
    _assert_cancelled_dialogue_as_alone(model, processor, cfg, stopped, following)


def test_a_turn_cancelled_before_it_joins_stops_at_its_first_token(model, processor):
    """As on the per-turn path (the stopping criterion is checked after each sampled token): one token, kept."""
    with BatchLoop(model) as loop, Conversation(model, processor, CFG, background=False, loop=loop) as conv:
        with held_loop(loop, 1):
            streamed = conv.ask(QUESTIONS[0], images=[IMAGES[0]], stream=True)
            deadline = time.monotonic() + 60
            while not loop._incoming and time.monotonic() < deadline:
                time.sleep(0.005)
            streamed.cancel()
        result = streamed.result
        assert result.cancelled and result.token_ids.numel() == 1 and conv.turns == [result]
        assert conv.cache.source_length == conv.sequences.shape[1] - 1


def test_closing_the_loop_ends_it_cleanly(model, processor):
    """Closed while a turn runs (from inside the turn, between two steps): the turn gets an error naming the loop
    and the conversation stays as it was; the loop's thread ends; later turns and new conversations are refused."""
    with BatchLoop(model, max_batch_tokens=48) as loop:
        conv = Conversation(model, processor, CFG, background=False, max_new_tokens=20, loop=loop)
        ask(conv, QUESTIONS[0], [IMAGES[0]], max_new_tokens=3)
        cache, sequences = conv.cache, conv.sequences

        class CloseAtThird:
            calls = 0

            def __call__(self, input_ids, scores):
                self.calls += 1
                if self.calls == 3:
                    loop.close()  # from the loop's own thread: it does not wait for itself
                return scores

        with pytest.raises(RuntimeError, match="BatchLoop was closed while this turn was running"):
            conv.ask(QUESTIONS[1], logits_processor=LogitsProcessorList([CloseAtThird()]))
        loop._thread.join(timeout=60)
        assert not loop._thread.is_alive() and loop.closed
        assert conv.cache is cache and torch.equal(conv.sequences, sequences) and len(conv.turns) == 1
        with pytest.raises(RuntimeError, match="BatchLoop is closed"):
            conv.ask(QUESTIONS[1])
        with pytest.raises(ValueError, match="closed BatchLoop"):
            Conversation(model, processor, CFG, loop=loop)
        assert all(not e.sequences for e in loop._engines)
        conv.close()


def test_a_pool_growth_short_of_memory_makes_room_and_the_turn_equals_its_dialogue_alone(model, processor,
                                                                                         monkeypatch):
    """A step whose engine's pool grows (a prompt longer than its slots) and finds no device memory for a layer asks
    the loop to make room (`_relieve_memory`, through `kv_pool.SlotKVPool.on_short`: the server evicts held
    conversations), tries again, and the turn goes on: it equals its dialogue alone. Before, the step failed and so
    did every answer in it."""
    from conftest import failing_slot_resize

    asked, picture = [], draw_test_image(448, 448, seed=1)

    class Relieving(BatchLoop):
        def _relieve_memory(self, nbytes):
            asked.append(nbytes)
            return True

    failed = failing_slot_resize(monkeypatch, lambda layer, slots, size: layer.layer_idx == 1 and not failed)
    from raincheck_hf.batch_engine import BatchEngine

    init = BatchEngine.__init__
    monkeypatch.setattr(BatchEngine, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "capacity": 64}))
    with Relieving(model) as loop, Conversation(model, processor, CFG, loop=loop, background=False,
                                                max_new_tokens=12) as conv:
        got = ask(conv, QUESTIONS[0], [picture])  # (its rows outgrow the 64 slots in the answer)
        engines = list(loop._engines)
    assert failed == [1] and len(asked) == 1 and asked[0] > 0, (failed, asked)
    assert engines and all(e.pool.on_short() is not None for e in engines)
    (want,) = alone(model, processor, CFG, [got], QUESTIONS[:1], [picture])
    assert_same_turn(got, want, "the turn whose step's pool grew after room was made")


def test_a_loops_engines_ask_it_for_room_for_their_pool_and_states():
    """Every engine a loop makes points its pool's and (Gated DeltaNet families) its per-slot states' `on_short` at the
    loop's `_relieve_memory`, weakly (a kept pool may outlive the loop)."""
    import functools
    import gc

    from families import family_model

    model = family_model("qwen3_5")
    with BatchLoop(model) as loop:
        engine = loop.call(functools.partial(loop._engine_for, RaincheckConfig()))
        assert engine.recurrent is not None
        assert engine.pool.on_short() == loop._relieve_memory and engine.recurrent.on_short() == loop._relieve_memory
    del loop
    gc.collect()
    assert engine.pool.on_short() is None and engine.recurrent.on_short() is None


def test_the_completion_barrier_on_the_loop(model, processor):
    """``early_follow_up=False``: the loop restores every leftover before the follow-up joins (on its own thread),
    and the follow-up equals the same dialogue alone with the barrier."""
    late = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=16)
    kw = dict(background=False, early_follow_up=False, max_new_tokens=6)
    with BatchLoop(model) as loop, Conversation(model, processor, late, loop=loop, **kw) as conv:
        first = ask(conv, QUESTIONS[0], [IMAGES[0]])
        deferred = first.pending
        assert deferred > 0
        follow = ask(conv, QUESTIONS[1])
        assert first.restored_after_answer == deferred and follow.trace.restored_per_forward[0].numel() == 0
    with Conversation(model, processor, late, **kw) as fresh:
        want = [ask(fresh, QUESTIONS[0], [IMAGES[0]]), ask(fresh, QUESTIONS[1])]
    for got, expected in zip((first, follow), want):
        assert torch.equal(got.token_ids, expected.token_ids)
        for a, b in zip(got.output.logits, expected.output.logits):
            assert (a - b).abs().max() <= TOL


def test_asking_from_the_loops_own_thread_or_with_a_failing_streamer(model, processor):
    """A turn's processor that asks another conversation on the loop gets a clear error (it would wait for itself);
    a turn whose streamer raises fails alone, its conversation as it was, and the loop goes on."""
    with BatchLoop(model) as loop, \
            Conversation(model, processor, CFG, background=False, max_new_tokens=3, loop=loop) as conv, \
            Conversation(model, processor, CFG, background=False, max_new_tokens=3, loop=loop) as other:
        seen = []

        class AsksOther:
            def __call__(self, input_ids, scores):
                if not seen:
                    try:
                        other.ask("hi")
                    except RuntimeError as error:
                        seen.append(str(error))
                return scores

        ask(conv, QUESTIONS[0], [IMAGES[0]], logits_processor=LogitsProcessorList([AsksOther()]))
        assert len(seen) == 1 and "BatchLoop's own thread" in seen[0] and other.turns == []

        class Broken:
            def put(self, value):
                raise OSError("the terminal went away")

            def end(self):
                pass

        cache = conv.cache
        with pytest.raises(OSError, match="terminal"):
            conv.ask(QUESTIONS[1], streamer=Broken())
        assert conv.cache is cache and len(conv.turns) == 1 and loop.running == 0
        assert not ask(conv, QUESTIONS[1]).cancelled and len(conv.turns) == 2


def test_bad_loop_settings_are_rejected_before_compute(model, eager_model, processor):
    for value in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"BatchLoop\(max_batch_tokens=\.\.\.\) must be an integer >= 1 .*"
                                             rf"got {value!r}"):
            BatchLoop(model, max_batch_tokens=value)
    with pytest.raises(ValueError, match="BatchLoop\\(config='fast'\\) must be a RaincheckConfig"):
        BatchLoop(model, config="fast")
    with pytest.raises(ValueError, match="Conversation\\(loop='shared'\\) must be a raincheck_hf.BatchLoop"):
        Conversation(model, processor, CFG, loop="shared")
    with BatchLoop(eager_model) as other:
        with pytest.raises(ValueError, match="BatchLoop on another model"):
            Conversation(model, processor, CFG, loop=other)
    with BatchLoop(model) as loop, Conversation(model, processor, CFG, background=False, loop=loop) as conv:
        with pytest.raises(ValueError, match="raincheck_chunk_schedule"):
            conv.ask("hi", raincheck_chunk_schedule=[0, 1])
        assert conv.turns == [] and conv.cache is None and loop._thread is None  # nothing ran
    assert "BatchLoop" in raincheck_hf.__all__


def test_a_step_of_several_answers_reads_the_device_once(model, processor, monkeypatch):
    """After a step, the loop chooses every sequence's token and runs its stopping criteria on the device, then reads
    them all back in one copy: one host read per step of several answers (it was two per sequence), counted on the
    loop's own thread by `HostReads` (test_batched_graphs) while a step's tokens are completed (`BatchLoop._complete`,
    a next step launched ahead excluded), in the steps where no answer ends (an answer that ends gives its cache
    back, which reads its rows). The answers equal their dialogues alone."""
    from raincheck_hf.batch_loop import BatchLoop as Loop
    from test_batched_graphs import HostReads

    counter = HostReads(model)
    counter.patch(monkeypatch)
    per_step = []  # (sequences that got logits, reads, whether an answer ended)
    complete, launch = Loop._complete, Loop._launch
    counting = []

    def launched(self, engine):  # a launch (on its own or ahead): its logits are device data, its reads not counted
        before = counter.reads
        if counting:
            out = launch(self, engine)
        else:
            with counter:
                out = launch(self, engine)
        counter.reads = before
        return out

    def counted(self, engine, logits):
        jobs = len(self._jobs)
        counter.reads = 0
        counting.append(True)
        try:
            with counter:
                complete(self, engine, logits)
        finally:
            counting.pop()
        per_step.append((len(logits), counter.reads, len(self._jobs) < jobs))

    monkeypatch.setattr(Loop, "_complete", counted)
    monkeypatch.setattr(Loop, "_launch", launched)
    with BatchLoop(model) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=6, loop=loop) for _ in range(3)]
        errors = []
        with held_loop(loop, 3):
            threads = threading.Thread(target=lambda: errors.extend(
                in_threads(lambda i: ask(convs[i], QUESTIONS[0], [IMAGES[i]]), 3)))
            threads.start()
        threads.join()
        assert not errors, errors
        several = [(n, reads) for n, reads, ended in per_step if n > 1 and not ended]
        assert several and all(reads == 1 for _, reads in several), per_step
        for i, conv in enumerate(convs):
            want = alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[i]])
            assert_same_turn(conv.turns[0], want[0], f"conversation {i}")
            conv.close()


def test_on_handoff_runs_on_the_loop_thread_after_every_step_and_a_failing_one_is_contained(model, processor, caplog):
    """``on_handoff`` is called on the loop's thread after each step (so a caller whose streamers buffer hands a
    step's pieces over once): every step that streamed a token is followed by a call before the next step's tokens
    are streamed (the next step may be running, launched ahead); a hook that raises is logged and the answer still
    ends as it does without the hook."""
    calls = []

    def hook():
        calls.append((threading.current_thread().name, loop.steps_completed))

    with BatchLoop(model, max_batch_tokens=48, on_handoff=hook) as loop:
        with Conversation(model, processor, CFG, background=False, max_new_tokens=6, loop=loop) as conv:
            first = ask(conv, QUESTIONS[0], [IMAGES[0]])
        steps = loop.steps
    assert {name for name, _ in calls} == {"raincheck-batch-loop"}
    handed = {s for _, s in calls}
    assert steps >= first.token_ids.numel() and all(s in handed for s in range(1, steps + 1)), (steps, handed)

    def failing():
        raise RuntimeError("the caller's hand-off failed")

    with BatchLoop(model, max_batch_tokens=48, on_handoff=failing) as loop:
        with Conversation(model, processor, CFG, background=False, max_new_tokens=6, loop=loop) as conv:
            again = ask(conv, QUESTIONS[0], [IMAGES[0]])
    assert torch.equal(again.token_ids, first.token_ids)
    assert "handing a step's output to its consumers failed" in caplog.text


def test_a_first_turn_is_prepared_on_the_askers_thread_and_its_error_comes_back(model, processor, monkeypatch):
    """A conversation's first turn on a loop is prepared (HF's preparation, its images encoded, its sequence made:
    selection and plan) on the asking thread before the loop gets it (`BatchLoop.prepare_ahead`), so the loop's
    thread goes on stepping the running answers; a follow-up gets HF's preparation there too, and with
    ``follow_ups_ahead`` its sequence from the held cache as it is then (nothing restores it here:
    ``background=False``; by default the loop's thread makes it when it joins). A first
    turn or a follow-up whose preparation raises fails alone with that error, as when the loop prepared it (the
    follow-up's conversation keeps its held cache), and the loop answers the next one; both dialogues equal
    themselves alone."""
    from raincheck_hf import batch_engine, batch_loop

    where, made = [], []
    prepare, validate = BatchLoop._prepare, batch_loop.validate_request
    for module in (batch_engine, batch_loop):  # (the loop makes a first turn's sequence, the engine a follow-up's)
        monkeypatch.setattr(module, "new_sequence", lambda *a, _made=module.new_sequence, **k: made.append(
            threading.current_thread()) or _made(*a, **k))

    def recorded(self, job, stack, inputs=None):
        where.append(threading.current_thread())
        return prepare(self, job, stack, inputs)

    def failing(model, config, args, kwargs):
        if kwargs.get("max_new_tokens") == 3:  # (the marked turn)
            raise ValueError("generate(max_new_tokens=3) refused here")
        return validate(model, config, args, kwargs)

    monkeypatch.setattr(BatchLoop, "_prepare", recorded)
    monkeypatch.setattr(batch_loop, "validate_request", failing)
    with BatchLoop(model, follow_ups_ahead=True) as loop:
        conv = Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop)
        ask(conv, QUESTIONS[0], [IMAGES[0]])
        ask(conv, QUESTIONS[1])
        assert where == [threading.current_thread()] * 2 and made == [threading.current_thread()] * 2
        assert (loop.follow_ups_made_ahead, loop.follow_ups_made_again) == (1, 0)
        held = conv.cache
        with pytest.raises(ValueError, match="max_new_tokens=3"):  # a follow-up's preparation fails on the asker's
            ask(conv, QUESTIONS[1], max_new_tokens=3)             # thread: it fails alone, the held cache kept
        assert where[-1] is threading.current_thread() and len(conv.turns) == 2 and conv.cache is held
        bad = Conversation(model, processor, CFG, background=False, loop=loop)
        with pytest.raises(ValueError, match="max_new_tokens=3"):
            ask(bad, QUESTIONS[0], [IMAGES[1]], max_new_tokens=3)
        assert where[-1] is threading.current_thread() and not bad.turns and bad.cache is None
        other = Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop)
        ask(other, QUESTIONS[0], [IMAGES[1]])
        for c in (conv, bad, other):
            c.close()
    for dialogue, images in ((conv, [IMAGES[0]]), (other, [IMAGES[1]])):
        want = alone(model, processor, CFG, dialogue.turns, QUESTIONS, images)
        for k, turn in enumerate(dialogue.turns):
            assert_same_turn(turn, want[k], f"turn {k}")
    made.clear()
    with BatchLoop(model) as loop:  # by default a follow-up's sequence is made by the loop's thread when it joins
        with Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop) as conv:
            ask(conv, QUESTIONS[0], [IMAGES[0]])
            ask(conv, QUESTIONS[1])
        assert made[0] is threading.current_thread() and made[1].name == "raincheck-batch-loop", made
        assert (loop.follow_ups_made_ahead, loop.follow_ups_made_again) == (0, 0)
    for k, turn in enumerate(alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[0]])):
        assert_same_turn(conv.turns[k], turn, f"turn {k}")


def test_arrival_gate_lets_threads_in_by_arrival_and_its_limit(model):
    """`batch_loop.ArrivalGate`: with limit 1 the threads waiting enter one at a time in the order they arrived;
    raising the limit (None: no limit) lets the waiting ones in at once; a bad limit is refused naming the setting."""
    from raincheck_hf.batch_loop import ArrivalGate

    gate, order, inside, most = ArrivalGate(1, "max_preparing"), [], [0], [0]
    lock = threading.Lock()

    def worker(i):
        with gate:
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                order.append(i)
            time.sleep(0.002)
            with lock:
                inside[0] -= 1

    def wait_for(test):
        deadline = time.monotonic() + 10
        while not test():
            assert time.monotonic() < deadline, "the gate's threads did not get where they should"
            time.sleep(0.001)

    threads = []
    with gate:  # (held here: each thread started waits in line, in the order started)
        for i in range(5):
            threads.append(threading.Thread(target=worker, args=(i,)))
            threads[-1].start()
            wait_for(lambda: gate.waiting == i + 1)
    for t in threads:
        t.join()
    assert order == [0, 1, 2, 3, 4] and most[0] == 1 and gate.inside == 0 and gate.waiting == 0

    order.clear()
    entered = threading.Barrier(4, timeout=10)  # three threads and this one: all inside together
    free = [threading.Thread(target=lambda i=i: (gate.__enter__(), order.append(i), entered.wait(), gate.__exit__()))
            for i in range(3)]
    with gate:
        for t in free:
            t.start()
        wait_for(lambda: gate.waiting == 3)
        gate.limit = None  # the three wait no more, though one is inside
        entered.wait()
    for t in free:
        t.join()
    assert sorted(order) == [0, 1, 2] and gate.limit is None
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"max_preparing: must be None or an int >= 1"):
            gate.limit = bad
        with pytest.raises(ValueError, match=r"BatchLoop\(max_preparing=\.\.\.\): must be None or an int >= 1"):
            BatchLoop(model, max_preparing=bad)


def test_first_turns_asked_at_once_are_prepared_one_at_a_time_with_max_preparing(model, processor, monkeypatch):
    """``BatchLoop(max_preparing=1)``: conversations asked from three threads at once are prepared one at a time on
    their threads (never two `_prepare` calls at once), each turn's record splits the time in line from the rest,
    and every dialogue equals itself alone; the attribute can be changed between turns."""
    prepare, lock, busy, most = BatchLoop._prepare, threading.Lock(), [0], [0]

    def counted(self, job, stack, inputs=None):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.01)  # (a preparation that takes a while: the others would overlap it without the gate)
            return prepare(self, job, stack, inputs)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(BatchLoop, "_prepare", counted)
    with BatchLoop(model, max_batch_tokens=48, max_preparing=1) as loop:
        assert loop.max_preparing == 1
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop) for _ in range(3)]
        errors = in_threads(lambda i: ask(convs[i], QUESTIONS[0], [IMAGES[i]]), 3)
        assert not errors, errors
        assert most[0] == 1
        turns = loop.step_stats()["turns"]["first"]
        assert turns["turns"] == 3 and turns["ahead_wait_ms_p50"] <= turns["ahead_ms_p50"]
        loop.max_preparing = None
        assert loop.max_preparing is None and loop._preparing.limit is None
        for i, conv in enumerate(convs):
            ask(conv, QUESTIONS[1])
            conv.close()
    for i, conv in enumerate(convs):
        want = alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[i]])
        for k, turn in enumerate(conv.turns):
            assert_same_turn(turn, want[k], f"conversation {i} turn {k}")


def test_a_preparations_tensors_are_all_found_to_hand_to_the_loops_stream(model, processor, monkeypatch):
    """`BatchLoop.prepare_stream` hands a turn prepared on a stream of its own to the loop's stream by recording
    that stream on each of its CUDA tensors (`fast.scoping.used_on`); a tensor missed would have its memory given to
    the next preparation while the loop still reads it. `tensors_in` finds every tensor an exhaustive walk of the
    garbage collector's referents finds in a first turn's and a follow-up's preparation (sequence, HF's preparation,
    processors and criteria included). On the CPU the setting changes nothing (no streams): answers as alone; a bad
    value is refused naming it."""
    import gc
    import types

    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    from raincheck_hf.fast.scoping import tensors_in

    opaque = (torch.nn.Module, PreTrainedTokenizerBase, ProcessorMixin, types.ModuleType, type, types.FunctionType,
              types.MethodType, types.BuiltinFunctionType, types.CodeType, types.FrameType)

    def every_tensor(obj) -> dict:
        seen, out, stack = set(), {}, [obj]
        while stack:
            item = stack.pop()
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, torch.Tensor):
                out[id(item)] = item
            elif not isinstance(item, opaque):
                stack.extend(gc.get_referents(item))
        return out

    prepared, prepare = [], BatchLoop.prepare_ahead

    def kept(self, job):
        prepare(self, job)
        prepared.append(job.ahead)

    monkeypatch.setattr(BatchLoop, "prepare_ahead", kept)
    with BatchLoop(model, prepare_stream=True) as loop:
        with Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop) as conv:
            ask(conv, QUESTIONS[0], [IMAGES[0]])
            ask(conv, QUESTIONS[1])
    assert len(prepared) == 2 and prepared[0][1] is not None  # (a first turn's sequence, a follow-up's none)
    for ahead in prepared:
        want = every_tensor(ahead)
        found = {id(t) for t in tensors_in(ahead)}
        assert len(want) > 5 and set(want) <= found, [tuple(t.shape) for k, t in want.items() if k not in found]
    want = alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[0]])
    for k, turn in enumerate(conv.turns):
        assert_same_turn(turn, want[k], f"turn {k}")
    with pytest.raises(ValueError, match=r"BatchLoop\(prepare_stream='yes'\) must be True or False"):
        BatchLoop(model, prepare_stream="yes")
    for bad in ("highest", 1, None):
        with pytest.raises(ValueError, match=r"BatchLoop\(prepare_priority=.*\) must be 'normal' or 'high'"):
            BatchLoop(model, prepare_priority=bad)
    with BatchLoop(model, prepare_priority="high") as loop:  # (on the CPU no stream is made: the setting is kept)
        assert loop.prepare_priority == "high"
        loop.prepare_priority = "normal"
        with pytest.raises(ValueError, match="prepare_priority"):
            loop.prepare_priority = "low"
        assert loop.prepare_priority == "normal"


@pytest.mark.parametrize("ahead", [True, False], ids=["prepared_ahead", "prepared_on_the_loop"])
def test_a_first_turn_on_the_loop_encodes_its_pixels_as_the_same_turn_alone(model, processor, monkeypatch, ahead):
    """With ``fast_path=True`` a batch-1 ``generate`` encodes its pixels through `fast.vision_graphs` (the tower
    replayed per grid on CUDA): a first turn on the loop goes through it too, whether its sequence was made on the
    asking thread (`BatchLoop.prepare_ahead`) or on the loop's; one whose selector reads the tower's attention does
    not (it needs the eager tower and its hooks). Answers equal the dialogue alone."""
    from raincheck_hf.fast import vision_graphs as vg

    encoded = []
    real = vg.VisionGraphs.encode

    def counting(self, pixel_values, grid_thw):
        encoded.append(tuple(tuple(int(v) for v in r) for r in grid_thw.tolist()))
        return real(self, pixel_values, grid_thw)

    monkeypatch.setattr(vg.VisionGraphs, "encode", counting)
    if not ahead:
        monkeypatch.setattr(BatchLoop, "prepare_ahead", lambda self, job: None)
    fast = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2, fast_path=True)
    with BatchLoop(model) as loop:
        with Conversation(model, processor, fast, background=False, max_new_tokens=5, loop=loop) as conv:
            got = ask(conv, QUESTIONS[0], [IMAGES[0]])
    assert len(encoded) == 1
    want = alone(model, processor, fast, [got], QUESTIONS[:1], [IMAGES[0]])
    assert len(encoded) == 2 and encoded[0] == encoded[1]  # the turn alone: the same tower call
    assert_same_turn(got, want[0], "first turn")
    encoded.clear()
    vz = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2, fast_path=True, selector="visionzip")
    with BatchLoop(model) as loop:
        with Conversation(model, processor, vz, background=False, max_new_tokens=3, loop=loop) as conv:
            ask(conv, QUESTIONS[0], [IMAGES[1]])
    assert encoded == []


def test_a_turns_pixels_are_staged_in_the_towers_dtype_before_its_preparation(model, processor, monkeypatch):
    """`BatchLoop._staged`: a turn's floating host pixels in the vision tower's dtype (rounded as the tower's own
    cast rounds them), other inputs and the caller's dict untouched; `prepare_ahead` hands the staged pixels to the
    preparation and the answer equals the same turn alone."""
    pixels = torch.randn(8, 12, dtype=torch.float32)
    ids = torch.arange(5)[None]
    with BatchLoop(model) as loop:
        given = {"pixel_values": pixels, "input_ids": ids, "image_grid_thw": torch.tensor([[1, 2, 4]])}
        staged = loop._staged(given)
        assert staged["pixel_values"] is pixels and staged["input_ids"] is ids  # (an fp32 tower: nothing to do)
        with monkeypatch.context() as m:  # (a bf16 tower, as the model's own dtype says; its weights left as they are)
            m.setattr(type(model.model.visual), "dtype", property(lambda self: torch.bfloat16))
            staged = loop._staged(given)
            assert staged["pixel_values"].dtype == torch.bfloat16
            assert torch.equal(staged["pixel_values"], pixels.to(torch.bfloat16))
            assert staged["input_ids"] is ids and given["pixel_values"] is pixels
            assert loop._staged({"pixel_values": ids})["pixel_values"] is ids  # (not floating: left alone)
        seen = []
        real = BatchLoop._prepare

        def spying(self, job, stack, inputs=None):
            seen.append(inputs)
            return real(self, job, stack, inputs)

        monkeypatch.setattr(BatchLoop, "_prepare", spying)
        with Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop) as conv:
            got = ask(conv, QUESTIONS[0], [IMAGES[0]])
    assert len(seen) == 1 and seen[0] is not None and "pixel_values" in seen[0]
    want = alone(model, processor, CFG, [got], QUESTIONS[:1], [IMAGES[0]])
    assert_same_turn(got, want[0], "first turn")


def test_preparations_at_once_each_take_a_stream_of_their_own(model, monkeypatch):
    """`BatchLoop._preparation_stream` (CUDA only in use; here with stand-in streams): preparations held at once get
    distinct streams, one given back is taken again before a new one is made, at most `MAX_PREPARATION_STREAMS` per
    priority (then shared in turn, free again only once no holder is left), and each priority has streams of its
    own."""
    import torch.cuda

    made = []

    class Stream:
        def __init__(self, device=None, priority=0):
            self.priority = priority
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    with BatchLoop(model) as loop, contextlib.ExitStack() as held:
        monkeypatch.setattr(BatchLoop, "MAX_PREPARATION_STREAMS", 2)
        first = contextlib.ExitStack()
        a = first.enter_context(loop._preparation_stream())
        b = held.enter_context(loop._preparation_stream())
        assert a is not b and len(made) == 2 and a.priority == 0
        first.close()
        assert held.enter_context(loop._preparation_stream()) is a and len(made) == 2  # (given back: taken again)
        c = held.enter_context(loop._preparation_stream())  # (both held and the most made: shared)
        assert c in (a, b) and len(made) == 2
        held.close()
        assert sorted(map(id, loop._free_streams["normal"])) == sorted(map(id, (a, b)))  # each free once
        loop.prepare_priority = "high"
        with loop._preparation_stream() as high:
            assert high not in (a, b) and high.priority == -100


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_a_follow_up_gets_its_sequence_on_the_askers_thread_and_a_changed_cache_makes_it_again(name, monkeypatch):
    """A follow-up's sequence is made on the asking thread from its held cache (`BatchLoop._follow_up_ahead`), its
    leftover deferred rows riding ahead of it; the loop only copies the cache in when it joins. Where the held cache
    changed after that (here: one chunk of the leftovers restored in place, as idle-time restoration does, right
    after the sequence was made), the loop makes the sequence again from the cache as it is when the turn joins. Each
    dialogue equals the same one alone (with that chunk restored between its turns), on Qwen3-VL and Qwen3.5 (whose
    held Gated DeltaNet states the follow-up continues)."""
    from families import family_model, family_processor

    from raincheck_hf import batch_loop

    model, processor = family_model(name), family_processor(name)
    late = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=16)  # (the answers end before any chunk)
    made, original = [], BatchLoop._follow_up_ahead
    monkeypatch.setattr(batch_loop, "new_sequence", lambda *a, _made=batch_loop.new_sequence, **k: made.append(
        (threading.current_thread(), k.get("cache") is not None)) or _made(*a, **k))

    def then_restore_a_chunk(self, job, prepared, grids, stream):
        state = original(self, job, prepared, grids, stream)
        if job.conversation in changed:
            assert job.conversation._restore_one_chunk() > 0
        return state

    monkeypatch.setattr(BatchLoop, "_follow_up_ahead", then_restore_a_chunk)
    changed = []
    with BatchLoop(model, max_batch_tokens=None, follow_ups_ahead=True) as loop:
        kept, moved = (Conversation(model, processor, late, background=False, max_new_tokens=5, loop=loop)
                       for _ in range(2))
        changed.append(moved)
        for conv, image in ((kept, IMAGES[0]), (moved, IMAGES[1])):
            ask(conv, QUESTIONS[0], [image])
            assert conv.pending > 0
            ask(conv, QUESTIONS[1])
        follow_ups = [m for m in made if m[1]]
        assert follow_ups == [(threading.current_thread(), True)] * 2  # both made on the asking thread
        assert (loop.follow_ups_made_ahead, loop.follow_ups_made_again) == (2, 1)
        logged = loop.step_log.snapshot()
        assert (logged["follow_ups_made_ahead"], logged["follow_ups_made_again"]) == (1, 1)  # (used / made again)
        for conv in (kept, moved):
            conv.close()
    for conv, image, chunk in ((kept, IMAGES[0], False), (moved, IMAGES[1], True)):
        with Conversation(model, processor, late, background=False, max_new_tokens=5) as solo:
            for k, turn in enumerate(conv.turns):
                if k == 1 and chunk:
                    solo._restore_one_chunk()
                ask(solo, QUESTIONS[k], [image] if k == 0 else (), max_new_tokens=turn.token_ids.numel(),
                    raincheck_chunk_schedule=list(turn.trace.chunk_size_per_forward))
            for k, (got, want) in enumerate(zip(conv.turns, solo.turns)):
                assert_same_turn(got, want, f"{'moved' if chunk else 'kept'} turn {k}")
        assert conv.turns[1].trace.restored_per_forward[0].numel() > 0  # leftovers rode with the follow-up


def batched_pools(loop, model) -> list:
    """The batched pools (`fast.batched_graphs.BatchedStepGraphs`, with their captured steps) of ``loop``'s engines,
    then those the model keeps for its next engines."""
    from raincheck_hf.fast import batched_graphs

    live = [e.graphs for e in loop._engines if e.graphs is not None]
    return live + list(batched_graphs._POOLED.get(get_adapter(model).text_model, []))


def test_an_unexpected_error_in_the_loop_ends_its_turns_and_the_loop_goes_on(model, processor, monkeypatch, caplog):
    """An error the loop does not expect (here the engine's `remove_many` raising once, as a bug or a device error
    would) used to end the loop's thread: the turn in the step and every later one waited forever. Now the turns in the
    loop's engines end with the error (their conversations as they were before the turn), and the loop goes on with
    new engines: the same conversation's next ask, and a held conversation's follow-up, equal their dialogues alone.
    The failed engine is closed empty (its sequences discarded), so that its pool and captured steps go back to the
    model for the next engine rather than being dropped with it."""
    from raincheck_hf.batch_engine import BatchEngine

    close, closed_with = BatchEngine.close, []

    def recording_close(self):
        closed_with.append(len(self.sequences))
        close(self)

    monkeypatch.setattr(BatchEngine, "close", recording_close)
    with BatchLoop(model, max_batch_tokens=None) as loop:
        held = Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop)
        ask(held, QUESTIONS[0], [IMAGES[2]])
        broken = fail_remove_many(monkeypatch)["failed"]
        hit = Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop)
        outcome = {}

        def first_turn():  # (in a thread: before the fix it never came back)
            try:
                ask(hit, QUESTIONS[0], [IMAGES[0]])
            except RuntimeError as error:
                outcome["error"] = error

        with caplog.at_level("ERROR", logger="raincheck_hf.batch_loop"):
            asker = threading.Thread(target=first_turn, daemon=True)
            asker.start()
            asker.join(timeout=120)
        assert not asker.is_alive(), "the turn never ended: the loop stopped"
        assert "batching loop failed while this turn was in it" in str(outcome.get("error"))
        assert broken and loop.failures == 1 and "remove broke" in caplog.text
        assert closed_with == [0], closed_with  # the failed engine closed with no sequence in it
        assert hit.turns == [] and hit.cache is None  # as before the turn
        thread = loop._thread
        ask(hit, QUESTIONS[0], [IMAGES[0]])
        ask(held, QUESTIONS[1])
        assert loop._thread is thread and thread.is_alive() and loop.failures == 1
        for conv in (held, hit):
            conv.close()
    for conv, image in ((held, IMAGES[2]), (hit, IMAGES[0])):
        want = alone(model, processor, CFG, conv.turns, QUESTIONS, [image])
        for k, turn in enumerate(conv.turns):
            assert_same_turn(turn, want[k], f"turn {k}")


def test_after_an_unexpected_error_the_loop_gives_its_pool_back(model, processor, monkeypatch):
    """With batched steps on their static buffers (``fast_path=True``: the pool and its steps' buffers of
    `fast.batched_graphs`, run eagerly on a CPU), an unexpected error in the loop ends the turn, and by the time its
    error comes back the failed engine's pool is back with the model (its sequences discarded first), not dropped:
    the next conversation's turn runs on the same pool and answers as the first conversation did."""
    from raincheck_hf.fast import batched_graphs

    batched_graphs.release_all()
    cfg = dataclasses.replace(CFG, fast_path=True)
    with BatchLoop(model, config=cfg) as loop:
        with Conversation(model, processor, cfg, background=False, max_new_tokens=5, loop=loop) as first:
            want = ask(first, QUESTIONS[0], [IMAGES[0]]).token_ids
        (graphs,) = batched_pools(loop, model)
        broken = fail_remove_many(monkeypatch)["failed"]
        with Conversation(model, processor, cfg, background=False, max_new_tokens=5, loop=loop) as hit:
            with pytest.raises(RuntimeError, match="batching loop failed while this turn was in it"):
                ask(hit, QUESTIONS[0], [IMAGES[0]])
        assert broken and loop.failures == 1
        assert batched_pools(loop, model) == [graphs]  # given back (before the fix: dropped with the engine)
        with Conversation(model, processor, cfg, background=False, max_new_tokens=5, loop=loop) as again:
            got = ask(again, QUESTIONS[0], [IMAGES[0]]).token_ids
        assert batched_pools(loop, model) == [graphs]
    assert torch.equal(got, want), (got, want)
    batched_graphs.release_all()


@pytest.mark.parametrize("launch_ahead", [True, False])
def test_no_memory_for_an_ended_answers_cache_fails_that_turn_alone(model, processor, monkeypatch, launch_ahead):
    """The device has no memory to copy an ended answer's cache out of the pool and none can be made (the library's
    loop holds nothing it may evict): that turn fails with the error and its conversation stays as it was, while the
    answer beside it in the same steps goes on and equals its dialogue alone (before: every turn of the engine failed,
    as for an unexpected error). Where the ended answers leave before their last tokens stream (``launch_ahead``) and
    where they leave after."""
    failures = fail_remove_many(monkeypatch, lambda: torch.OutOfMemoryError("CUDA out of memory (a test's)"))
    with BatchLoop(model, max_batch_tokens=None, launch_ahead=launch_ahead) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=6, loop=loop) for _ in range(2)]
        got, errors = ask_together(loop, convs, [dict(max_new_tokens=4), dict(max_new_tokens=9)])
        assert failures["failed"] == [1] and loop.failures == 0
        assert list(errors) == [0] and isinstance(errors[0], torch.OutOfMemoryError)
        assert convs[0].turns == [] and convs[0].cache is None  # (as it was before the turn)
        assert got[1].token_ids.numel() == 9
        want = alone(model, processor, CFG, convs[1].turns, QUESTIONS, [IMAGES[1]])
        assert_same_turn(convs[1].turns[0], want[0], "the answer beside it")
        again = ask(convs[0], QUESTIONS[0], [IMAGES[0]], max_new_tokens=4)  # (and the conversation goes on)
        assert_same_turn(again, alone(model, processor, CFG, [again], QUESTIONS, [IMAGES[0]])[0], "the turn again")
        for conv in convs:
            conv.close()


def test_no_memory_for_a_cancelled_answers_cache_fails_that_turn_alone(model, processor, monkeypatch):
    """A client cancels while a token of its answer streams, with no step launched ahead, so its answer leaves
    before the next step (`BatchLoop._leave_cancelled`), and the device has no memory to copy its cache out of the
    pool: that turn fails with the error and its conversation stays as it was, while the other answer goes on and
    equals its dialogue alone (before, such a failure there ended every turn of the engine)."""
    failures = fail_remove_many(monkeypatch, lambda: torch.OutOfMemoryError("CUDA out of memory (a test's)"))
    left_cancelled, leave = [], BatchLoop._leave_cancelled

    def recorded(self):
        left_cancelled.extend(k for k, (seq, job) in enumerate(self._jobs.items())
                              if job.cancel.is_set() and seq.prefilled)
        leave(self)

    monkeypatch.setattr(BatchLoop, "_leave_cancelled", recorded)
    with BatchLoop(model, max_batch_tokens=None, launch_ahead=False) as loop:
        convs = [Conversation(model, processor, CFG, background=False, loop=loop) for _ in range(2)]

        got, errors = ask_together(loop, convs, [dict(streamer=CancelsWhileStreaming(convs[0]), max_new_tokens=10),
                                                 dict(max_new_tokens=12)])
        assert left_cancelled, "the cancelled answer did not leave through _leave_cancelled"
        assert failures["failed"] == [1] and loop.failures == 0
        assert list(errors) == [0] and isinstance(errors[0], torch.OutOfMemoryError)
        assert convs[0].turns == [] and convs[0].cache is None  # (as it was before the turn)
        assert got[1].token_ids.numel() == 12
        assert_same_turn(convs[1].turns[0], alone(model, processor, CFG, convs[1].turns, QUESTIONS, [IMAGES[1]])[0],
                         "the answer beside it")
        again = ask(convs[0], QUESTIONS[0], [IMAGES[0]], max_new_tokens=4)  # (and the conversation goes on)
        assert_same_turn(again, alone(model, processor, CFG, [again], QUESTIONS, [IMAGES[0]])[0], "the turn again")
        for conv in convs:
            conv.close()


def test_a_first_turn_waits_for_device_memory_until_an_answer_ends(model, processor, monkeypatch):
    """A device short of memory while an answer runs (`BatchLoop._device_memory` reporting less than the turn's
    bytes and the headroom while any answer is in the loop): a first turn asked then waits before its media go to
    the device (`_prepare`) until that answer ended, and equals its dialogue alone; ``memory_waits`` counts it. With
    no answer running or waiting, a turn short of memory goes ahead at once (nothing would free any), and
    ``memory_headroom=None`` never waits. Before, every turn asked at once put its media on the device together, and
    at 64 clients of the server the device ran out of memory."""
    events, prepare, end = [], BatchLoop._prepare, BatchLoop._end

    def prepared(self, job, stack, inputs=None):
        events.append(("prepare", job.conversation))
        return prepare(self, job, stack, inputs)

    def ended(self, job, result=None, error=None):
        events.append(("end", job.conversation))
        end(self, job, result=result, error=error)

    monkeypatch.setattr(BatchLoop, "_prepare", prepared)
    monkeypatch.setattr(BatchLoop, "_end", ended)
    with BatchLoop(model, max_batch_tokens=None) as loop:
        assert loop.memory_headroom == "auto"
        totals = {}  # (a device of 80 GB and one of 24: 2 GiB, and 1/32 of the smaller one)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: types.SimpleNamespace(total_memory=totals[0]))
        totals[0] = 80 << 30
        assert loop._headroom() == 2 << 30
        totals[0] = 24 << 30
        assert loop._headroom() == (24 << 30) // 32
        plenty = 1 << 50
        monkeypatch.setattr(loop, "_device_memory", lambda: 0 if loop._jobs else plenty)
        a = Conversation(model, processor, CFG, background=False, loop=loop)
        b = Conversation(model, processor, CFG, background=False, loop=loop)
        release, box = threading.Event(), {}

        class HoldsAtFirstToken(BaseStreamer):  # (b's answer stays in the loop until released)
            puts = 0

            def put(self, value):
                self.puts += 1
                if self.puts == 2:  # (the prompt, then its first token)
                    assert release.wait(timeout=60)

            def end(self):
                pass

        asking = [threading.Thread(target=lambda: ask(b, QUESTIONS[0], [IMAGES[1]], max_new_tokens=6,
                                                      streamer=HoldsAtFirstToken()))]
        asking[0].start()
        wait_for(lambda: loop.running == 1)  # (b went ahead: no answer ran when it asked)
        asking.append(threading.Thread(target=lambda: box.setdefault(
            "first", ask(a, QUESTIONS[0], [IMAGES[0]], max_new_tokens=5))))
        asking[1].start()
        wait_for(lambda: loop.memory_waits == 1)
        time.sleep(0.2)  # (a's preparation would have begun by now without the wait)
        assert ("prepare", a) not in events
        release.set()
        for thread in asking:
            thread.join()
        first = box["first"]
        assert events.index(("end", b)) < events.index(("prepare", a)), events
        assert loop.memory_waits == 1
        want = alone(model, processor, CFG, [first], QUESTIONS, [IMAGES[0]])[0]
        assert_same_turn(first, want, "the turn that waited")
        # nothing runs, and the device stays short: the turn goes ahead
        monkeypatch.setattr(loop, "_device_memory", lambda: 0)
        c = Conversation(model, processor, CFG, background=False, loop=loop)
        third = ask(c, QUESTIONS[0], [IMAGES[2]], max_new_tokens=5)
        assert_same_turn(third, alone(model, processor, CFG, [third], QUESTIONS, [IMAGES[2]])[0], "the turn alone")
        loop.memory_headroom = None  # (no admission by memory: not even a look)
        monkeypatch.setattr(loop, "_device_memory", lambda: pytest.fail("looked at the device's memory"))
        ask(a, QUESTIONS[1], max_new_tokens=3)
        for conv in (a, b, c):
            conv.close()
    for bad in (-1, "some", 1.5):
        with pytest.raises(ValueError, match=rf"memory_headroom={bad!r}"):
            BatchLoop(model, memory_headroom=bad)


def test_the_device_memory_a_preparation_can_have_leaves_out_the_graphs_pools(model, monkeypatch):
    """`BatchLoop._device_memory` on CUDA: the free memory and what the allocator holds unused, less what it holds
    free in the CUDA graphs' pools (read from its snapshot, again only after `POOL_REFRESH_S`); None off CUDA.
    CUDA's figures stand in here."""
    mib = 1 << 20
    reads, state = [], {"pools_free": 300 * mib}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: reads.append(1) or [
        dict(device=0, segment_pool_id=(3, 1), total_size=state["pools_free"], allocated_size=0)])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000 * mib, 80_000 * mib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 900 * mib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 400 * mib)
    loop = BatchLoop(model)
    assert loop._device_memory() is None  # (a CPU model)
    loop.adapter = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert loop._device_memory() == 1000 * mib + 500 * mib - 300 * mib and len(reads) == 1
    state["pools_free"] = 100 * mib
    assert loop._device_memory() == 1200 * mib and len(reads) == 1  # (within POOL_REFRESH_S: not read again)
    monkeypatch.setattr(BatchLoop, "POOL_REFRESH_S", 0.0)
    time.sleep(0.01)
    assert loop._device_memory() == 1400 * mib and len(reads) == 2
    loop.close()


def test_a_turns_estimated_device_bytes_cover_what_its_preparation_holds(model, processor, monkeypatch):
    """What a first turn's preparation holds when it joins (every tensor reachable from its result, the model's own
    weights and buffers aside) is within its estimate (`batch_loop.turn_device_bytes`, what `_wait_for_memory` waits
    for; its pixels' part counts their copies on the device while the vision tower runs), its rows' part is not more
    than three times it, and a follow-up without media is estimated at nothing."""
    from raincheck_hf.fast.scoping import tensors_in

    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    measured, join = [], BatchLoop._join

    def joined(self, job):
        if job.ahead is not None and not isinstance(job.ahead, BaseException):
            storages = {}
            for tensor in tensors_in(job.ahead):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in weights:
                    storages[storage.data_ptr()] = storage.nbytes()
            rows = job.inputs["input_ids"].shape[-1]
            measured.append((sum(storages.values()), self._turn_bytes(job, job.inputs), rows))
        join(self, job)

    monkeypatch.setattr(BatchLoop, "_join", joined)
    with BatchLoop(model, max_batch_tokens=None) as loop:
        with Conversation(model, processor, CFG, background=False, max_new_tokens=3, loop=loop) as conv:
            ask(conv, QUESTIONS[0], [IMAGES[0]])
            job = dataclasses.replace(BatchTurn(conv, CFG, {}, {}, None, threading.Event(), None),
                                      inputs={"input_ids": torch.ones(1, 50, dtype=torch.long)})
            assert loop._turn_bytes(job, job.inputs) == 0  # (a follow-up: its rows are text)
    (held, estimate, rows), = measured
    assert held <= estimate, (held, estimate)
    assert turn_device_bytes(get_adapter(model), rows, 0) <= 3 * held  # (the rows' part; pixels pass through)


def test_an_unexpected_error_while_a_turn_joins_ends_that_turn(model, processor, monkeypatch):
    """An unexpected error in the middle of a turn's join (after its sequence entered the engine, before the loop
    recorded the turn) ends that turn with the error too: it was taken off the queue and in no engine's record, and
    nothing answered it. The next turn on the loop runs as usual."""
    from raincheck_hf import batch_loop

    setup, broken = batch_loop.sampling_setup, []

    def failing_once(*args, **kwargs):
        if not broken:
            broken.append(True)
            raise RuntimeError("setup broke")
        return setup(*args, **kwargs)

    monkeypatch.setattr(batch_loop, "sampling_setup", failing_once)
    with BatchLoop(model, max_batch_tokens=None) as loop:
        conv = Conversation(model, processor, CFG, background=False, max_new_tokens=4, loop=loop)
        outcome = {}

        def first_turn():
            try:
                ask(conv, QUESTIONS[0], [IMAGES[0]])
            except RuntimeError as error:
                outcome["error"] = error

        asker = threading.Thread(target=first_turn, daemon=True)
        asker.start()
        asker.join(timeout=120)
        assert not asker.is_alive(), "the turn never ended"
        assert "setup broke" in str(outcome.get("error")) and loop.failures == 1
        assert conv.turns == [] and conv.cache is None
        ask(conv, QUESTIONS[0], [IMAGES[0]])
        conv.close()
    want = alone(model, processor, CFG, conv.turns, QUESTIONS, [IMAGES[0]])
    assert_same_turn(conv.turns[0], want[0], "turn 0")
