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


def test_close_stops_the_worker(model, processor):
    conv = Conversation(model, processor, CFG, max_new_tokens=4)
    conv.close()
    assert not conv._worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        conv.ask("hi")
