"""`Conversation`: multi-turn state, idle-time restoration, the completion barrier, streaming."""

from __future__ import annotations

import time

import pytest
import torch

import raincheck_hf
from raincheck_hf import Conversation, RaincheckConfig
from raincheck_hf.tiny import draw_test_image, draw_test_video

from reference import TurnRecord, reference_logits

CFG = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=6)


def _records(conv, turn_inputs):
    return [TurnRecord(ids, t.output, pv, grid) for t, (ids, pv, grid) in zip(conv.turns, turn_inputs)]


def _wait_until_restored(conv, timeout=30.0):
    deadline = time.monotonic() + timeout
    while conv.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    with conv._lock:  # (a chunk's rows are stored, then counted for its turn, under the lock: the count done too)
        assert conv.pending == 0


def _two_turns(model, processor, background, early_follow_up, idle):
    conv = Conversation(model, processor, CFG, background=background, early_follow_up=early_follow_up,
                        max_new_tokens=8)
    img1, img2 = draw_test_image(128, 96, seed=1), draw_test_image(64, 96, seed=9)
    r1 = conv.ask("What is in this image?", images=[img1], output_logits=True)
    assert r1.trace.pending.numel() > 0  # what generate left (r1.pending is live: the worker may be done already)
    if idle:
        _wait_until_restored(conv)
    r2 = conv.ask("And what colour is the corner?", images=[img2], output_logits=True)
    conv.close()
    return conv, (img1, img2)


@pytest.mark.parametrize(
    "background,early_follow_up,idle",
    [(True, True, True), (False, True, False), (False, False, False)],
    ids=["worker-finishes-in-idle-time", "leftovers-ride-with-follow-up", "barrier-then-follow-up"],
)
def test_two_turns_match_reference(model, processor, background, early_follow_up, idle):
    conv, (img1, img2) = _two_turns(model, processor, background, early_follow_up, idle)
    t1, t2 = conv.turns
    p1 = processor.image_processor(images=[img1], return_tensors="pt")
    p2 = processor.image_processor(images=[img2], return_tensors="pt")
    records = [
        TurnRecord(t1.output.sequences[:, : t1.output.sequences.shape[1] - t1.token_ids.numel()], t1.output,
                   p1["pixel_values"], p1["image_grid_thw"]),
        TurnRecord(t2.output.sequences[:, : t2.output.sequences.shape[1] - t2.token_ids.numel()], t2.output,
                   p2["pixel_values"], p2["image_grid_thw"]),
    ]
    for k, (rec, ref) in enumerate(zip(records, reference_logits(model, records))):
        for i, (got, want) in enumerate(zip(rec.output.logits, ref)):
            assert (got[0] - want).abs().max() <= 1e-4, f"turn {k} forward {i}"
    assert t1.restored_during_answer + t1.restored_after_answer == t1.trace.deferred.numel()
    if early_follow_up and not idle:
        assert t2.trace.restored_per_forward[0].numel() > 0


def test_worker_and_complete_leave_the_same_cache(model, processor):
    caches = []
    for background in (True, False):
        conv = Conversation(model, processor, CFG, background=background, max_new_tokens=8)
        conv.ask("What is in this image?", images=[draw_test_image(128, 96, seed=1)])
        if background:
            _wait_until_restored(conv)
        else:
            assert conv.complete() > 0
        conv.close()
        caches.append(conv.cache)
    a, b = caches
    assert torch.equal(torch.sort(a.row_keys).values, torch.sort(b.row_keys).values)
    assert torch.equal(a.row_sources, b.row_sources)
    for la, lb in zip(a.layers, b.layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5)


def test_streaming_matches_the_answer(model, processor):
    with Conversation(model, processor, CFG, max_new_tokens=10) as conv:
        streamed = conv.ask("Describe it.", images=[draw_test_image(64, 64, seed=2)], stream=True)
        text = "".join(streamed)
        result = streamed.result
    assert text == result.text
    assert len(result.token_times) == result.token_ids.numel() - 1
    assert result.time_to_first_token > 0


def test_video_turn_then_text_turn(model, processor):
    with Conversation(model, processor, CFG, background=False, max_new_tokens=6) as conv:
        r1 = conv.ask("What happens?", videos=[draw_test_video(4, 64, 64, seed=3)])
        leftovers = r1.pending
        r2 = conv.ask("Anything else?")
        assert r2.trace.restored_per_forward[0].numel() == leftovers > 0
        assert r1.pending == 0 and r1.restored_after_answer == leftovers  # updated live
        assert conv.cache.num_pending == 0


def test_bad_questions_are_rejected_before_compute(model, processor):
    with Conversation(model, processor, CFG, background=False) as conv:
        with pytest.raises(ValueError, match="non-empty"):
            conv.ask("   ")
        with pytest.raises(ValueError, match="cache"):
            conv.ask("hi", cache=None)
        assert conv.turns == [] and conv.cache is None
    with pytest.raises(ValueError, match="boolean selector mask"):
        Conversation(model, processor, RaincheckConfig(selector=torch.ones(3, dtype=torch.bool)))


def test_close_detaches_from_the_restorer_and_its_thread_ends(model, processor):
    from raincheck_hf.restorer import restorer_for

    restorer = restorer_for(model)
    conv = Conversation(model, processor, CFG, max_new_tokens=4)
    assert conv._restorer is restorer and restorer.attached >= 1 and restorer.running
    before = restorer.attached
    conv.close()
    assert restorer.attached == before - 1
    if before == 1:  # no other conversation on the model: the thread ends
        deadline = time.monotonic() + 10
        while restorer.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not restorer.running
    with pytest.raises(RuntimeError, match="closed"):
        conv.ask("hi")


def test_conversations_on_one_model_share_one_restorer_thread(model, processor):
    """Several conversations holding leftovers at once are all restored in idle time by the model's one restorer
    thread (not a thread each: every CUDA thread costs a cuBLAS workspace), and each ends with the cache
    `complete()` gives (the same rows, keys within rounding)."""
    import threading

    def restore_threads():
        return sum(t.name == "raincheck-restore" and t.is_alive() for t in threading.enumerate())

    images = [draw_test_image(128, 96, seed=s) for s in (1, 4, 7)]
    convs = [Conversation(model, processor, CFG, max_new_tokens=6) for _ in images]
    alone = [Conversation(model, processor, CFG, background=False, max_new_tokens=6) for _ in images]
    try:
        for conv, twin, image in zip(convs, alone, images):
            assert restore_threads() == 1
            conv.ask("What is in this image?", images=[image])
            twin.ask("What is in this image?", images=[image])
            assert twin.pending > 0
        for conv in convs:
            _wait_until_restored(conv)
        assert restore_threads() == 1
        for conv, twin in zip(convs, alone):
            deferred = conv.turns[0].trace.deferred.numel()
            assert conv.turns[0].restored_during_answer + conv.turns[0].restored_after_answer == deferred
            assert twin.complete() > 0
            assert torch.equal(conv.cache.row_sources, twin.cache.row_sources)
            for la, lb in zip(conv.cache.layers, twin.cache.layers):
                assert torch.allclose(la.keys, lb.keys, atol=1e-5)
        follow = [conv.ask("And the corner?", output_logits=True) for conv in convs]
        again = [twin.ask("And the corner?", output_logits=True) for twin in alone]
        for a, b in zip(follow, again):
            assert torch.equal(a.token_ids, b.token_ids)
    finally:
        for conv in convs + alone:
            conv.close()


# ---- stopping an answer early ----------------------------------------------------------------------

class _Gate:
    """A logits processor that holds the answer at its ``at``-th token until the conversation's answer is
    cancelled: the reader stops while generation is mid-way, every time (no race with a fast model)."""

    def __init__(self, conv, at: int):
        import threading

        self.conv, self.at, self.calls, self.reached = conv, at, 0, threading.Event()

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            request = self.conv._request  # the answer being generated (what cancel() sets)
            assert request is not None and request.event.wait(timeout=60), "the answer was never cancelled"
        return scores


def _cancel_turn(conv, how: str, question: str, images=(), at: int = 5):
    """Ask ``question``, stop its answer at token ``at`` in one of the ways a user can; returns the TurnResult."""
    import gc
    import threading

    from transformers import LogitsProcessorList

    gate = _Gate(conv, at)
    kw = dict(images=images, logits_processor=LogitsProcessorList([gate]), max_new_tokens=40)
    if how == "conversation.cancel":  # a plain ask in another thread, cancelled from this one
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("result", conv.ask(question, **kw)))
        worker.start()
        assert gate.reached.wait(timeout=60)
        assert conv.cancel()
        worker.join()
        return box["result"]
    streamed = conv.ask(question, stream=True, **kw)
    if how == "break":
        for i, _ in enumerate(streamed):
            if i == 1:  # two pieces read; the answer waits at its 5th token, so it stops there
                assert gate.reached.wait(timeout=60)
                break
    elif how == "close":
        assert gate.reached.wait(timeout=60)
        streamed.close()
    elif how == "dropped":  # never read, garbage-collected
        assert gate.reached.wait(timeout=60)
        turns = len(conv.turns)
        del streamed
        gc.collect()
        deadline = time.monotonic() + 60
        while len(conv.turns) == turns and time.monotonic() < deadline:
            time.sleep(0.01)
        return conv.turns[-1]
    return streamed.result


def _assert_every_deferred_token_once(conv):
    deferred = sorted(s for t in conv.turns for s in t.trace.deferred.tolist())
    restored, pending = conv.cache.restored_sources().tolist(), conv.cache.pending_sources.tolist()
    assert sorted(restored + pending) == deferred  # each restored or pending, exactly once


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl-fast_path", "qwen3_5"])
@pytest.mark.parametrize("how,streamed_turn", [("break", 0), ("close", 1), ("dropped", 0), ("conversation.cancel", 1)])
def test_a_stopped_answer_keeps_what_was_generated_and_the_next_turn_goes_on(
        request, processor, family, how, streamed_turn):
    model = request.getfixturevalue("qwen35" if family == "qwen3_5" else "model")
    image = draw_test_image(128, 96, seed=1)
    questions = [("What is in this image?", [image]), ("And the corner?", []), ("Anything else?", [])]
    cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2, fast_path=family.endswith("fast_path"))
    with Conversation(model, processor, cfg, background=False, max_new_tokens=8) as conv:
        for question, images in questions[:streamed_turn]:
            conv.ask(question, images=images)
        stopped = _cancel_turn(conv, how, *questions[streamed_turn])
        assert stopped.cancelled and stopped.token_ids.numel() == 5  # stopped at the step after the cancel
        assert conv.turns[-1] is stopped
        assert torch.equal(conv.sequences[0, -5:], stopped.token_ids)  # the history holds exactly that
        assert conv.cache.source_length == conv.sequences.shape[1] - 1  # the last token is not fed yet
        _assert_every_deferred_token_once(conv)
        following = conv.ask(*questions[streamed_turn + 1][:1], output_logits=True)
        assert not following.cancelled and conv.pending == 0
        _assert_every_deferred_token_once(conv)
    # a fresh conversation whose history is the same: the stopped turn as an answer of 5 tokens
    with Conversation(model, processor, cfg, background=False, max_new_tokens=8) as fresh:
        for question, images in questions[:streamed_turn]:
            fresh.ask(question, images=images)
        same = fresh.ask(questions[streamed_turn][0], images=questions[streamed_turn][1], max_new_tokens=5)
        assert torch.equal(same.token_ids, stopped.token_ids)
        want = fresh.ask(questions[streamed_turn + 1][0], output_logits=True)
    assert torch.equal(following.token_ids, want.token_ids)
    for a, b in zip(following.output.logits, want.output.logits):
        assert (a - b).abs().max() <= 1e-5


def test_cancel_without_an_answer_and_close_cancels_the_answer(model, processor):
    with Conversation(model, processor, CFG, background=False, max_new_tokens=8) as conv:
        assert conv.cancel() is False
        done = conv.ask("What is in this image?", images=[draw_test_image(64, 64, seed=2)])
        assert not done.cancelled and conv.cancel() is False  # nothing running: the next turn is not affected
        from transformers import LogitsProcessorList

        gate = _Gate(conv, 3)
        streamed = conv.ask("And now?", stream=True, logits_processor=LogitsProcessorList([gate]), max_new_tokens=40)
        assert gate.reached.wait(timeout=60)
    # leaving the block closed the conversation: the answer stopped, and close() waited for it
    assert streamed.result.cancelled and streamed.result.token_ids.numel() == 3


def test_a_turn_that_fails_mid_answer_says_so_on_the_next_ask(model, processor):
    from transformers import LogitsProcessorList

    class Failing:
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                raise KeyError("a logits processor failed")
            return scores

    with Conversation(model, processor, CFG, background=False, max_new_tokens=8) as conv:
        conv.ask("What is in this image?", images=[draw_test_image(64, 64, seed=2)])
        with pytest.raises(KeyError, match="failed"):
            conv.ask("And now?", logits_processor=LogitsProcessorList([Failing()]))
        with pytest.raises(RuntimeError, match="start a new Conversation") as info:
            conv.ask("Still there?")
        assert isinstance(info.value.__cause__, KeyError)


def test_the_restorer_starts_as_soon_as_a_turn_ends(model, processor, monkeypatch):
    """A turn's end wakes the model's restorer once the turn no longer counts as running (it passes over a
    conversation in a turn): with its idle wait made longer than the test's, the leftovers are still restored, so the
    wake-up, not the wait running out, started them."""
    from raincheck_hf.restorer import IdleRestorer

    monkeypatch.setattr(IdleRestorer, "WAIT_IDLE_S", 600.0)
    turn = Conversation._generate_turn

    def slow_to_end(self, *args):  # the turn's record made, a moment passes before the turn stops counting as running
        result = turn(self, *args)
        time.sleep(0.2)
        return result

    monkeypatch.setattr(Conversation, "_generate_turn", slow_to_end)
    with Conversation(model, processor, CFG, max_new_tokens=4) as conv:
        r = conv.ask("What is in this image?", images=[draw_test_image(128, 96, seed=5)])
        assert r.trace.pending.numel() > 0
        _wait_until_restored(conv, timeout=60.0)
