"""`BatchLoop` chooses the tokens of the turns that allow it together (`BatchLoop._choose_all`): greedy turns whose
processors have equal row keys (`batch_loop.row_key`: HF's ``suppress_tokens``, the server's ``logit_bias``) and
whose stopping criteria are a length, an EOS and a cancellation get one float copy, one call of their processors,
one argmax and one EOS check per step; the others (sampled, a stop string, an unkeyed processor) choose alone. Every
turn's tokens and streamed text equal its dialogue run alone (without a loop, under the same chunk schedule)."""

from __future__ import annotations

import threading

import torch
from transformers import (LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, SuppressTokensLogitsProcessor,
                          TextIteratorStreamer)

from raincheck_hf import BatchLoop, Conversation
from raincheck_hf.batch_loop import row_key
from raincheck_hf.serve.app import _LogitBias, _Sampling

from conftest import in_threads, no_placeholder_ids
from test_batch_loop import CFG, IMAGES, QUESTIONS, held_loop

TOKENS = 7


def _kwargs(model, processor, kind: str) -> dict:
    """A turn's generate arguments of the given kind (each builds its own processor objects, as a request does)."""
    suppress = no_placeholder_ids(model)
    if kind == "greedy":
        return dict(suppress_tokens=suppress)
    if kind == "bias":  # the server's logit_bias, equal in two turns
        return dict(suppress_tokens=suppress, logits_processor=LogitsProcessorList([_LogitBias({5: 2.5, 9: -1.0})]))
    if kind == "other_bias":
        return dict(suppress_tokens=suppress, logits_processor=LogitsProcessorList([_LogitBias({7: 3.0})]))
    if kind == "min":  # min_new_tokens (the server's min_tokens): with the others, each its own length
        return dict(suppress_tokens=suppress, min_new_tokens=TOKENS, min_length=2)
    if kind == "min_short":
        return dict(suppress_tokens=suppress, min_new_tokens=2, min_length=3)
    if kind == "sampled":  # the server's sampling: its own seeded generator, chosen alone
        return dict(suppress_tokens=suppress, logits_processor=LogitsProcessorList(
            [_Sampling(0.8, None, None, seed=7, device=torch.device("cpu"))]))
    if kind == "plain":  # no processor at all (a placeholder id would only upset a follow-up: there is none)
        return dict(max_new_tokens=TOKENS - 2)
    if kind == "stop":  # a stopping criterion of its own (the server's stop strings are one): chosen alone
        return dict(suppress_tokens=suppress, stopping_criteria=StoppingCriteriaList([_StopAt(3)]))
    raise AssertionError(kind)


class _StopAt(StoppingCriteria):
    """Stops at the answer's ``at``-th token (counted by its calls: one per token)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.at, dtype=torch.bool, device=input_ids.device)


KINDS = ["greedy", "bias", "greedy", "sampled", "bias", "plain", "stop", "other_bias", "min", "min_short"]


def _alone(model, processor, kind, i, turn):
    with Conversation(model, processor, CFG, background=False, max_new_tokens=TOKENS) as conv:
        kw = _kwargs(model, processor, kind)
        kw["max_new_tokens"] = turn.token_ids.numel()
        return conv.ask(QUESTIONS[0], images=[IMAGES[i % len(IMAGES)]],
                        raincheck_chunk_schedule=list(turn.trace.chunk_size_per_forward), **kw)


def test_mixed_turns_chosen_together_or_alone_answer_as_alone_and_stream_the_same_text(model, processor):
    with BatchLoop(model, max_batch_tokens=None) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=TOKENS, loop=loop)
                 for _ in KINDS]
        streamed, results = {}, {}

        def run(i):
            kw = _kwargs(model, processor, KINDS[i])
            if i % 2 == 0:  # every other turn streamed (a transformers streamer of its own)
                streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
                box = {}

                def work():
                    try:
                        box["r"] = convs[i].ask(QUESTIONS[0], images=[IMAGES[i % len(IMAGES)]], streamer=streamer,
                                                **kw)
                    except BaseException as error:  # noqa: BLE001 - raised below (the reader must not wait)
                        box["error"] = error
                        streamer.end()

                worker = threading.Thread(target=work)
                worker.start()
                streamed[i] = "".join(streamer)
                worker.join()
                if "error" in box:
                    raise box["error"]
                results[i] = box["r"]
            else:
                results[i] = convs[i].ask(QUESTIONS[0], images=[IMAGES[i % len(IMAGES)]], **kw)

        errors = []
        with held_loop(loop, len(KINDS)):
            starter = threading.Thread(target=lambda: errors.extend(in_threads(run, len(KINDS))))
            starter.start()
        starter.join()
        assert not errors, errors
        assert loop.max_batch_size == len(KINDS)
        sequences = [conv.sequences for conv in convs]
        for conv in convs:
            conv.close()
    for i, kind in enumerate(KINDS):
        want = _alone(model, processor, kind, i, results[i])
        got = results[i]
        assert torch.equal(got.token_ids, want.token_ids), (i, kind, got.token_ids.tolist(), want.token_ids.tolist())
        assert got.text == want.text
        assert torch.equal(sequences[i], want.output.sequences.cpu())
        assert got.token_ids.numel() == (3 if kind == "stop" else TOKENS - 2 if kind == "plain" else TOKENS) \
            or want.token_ids[-1].item() == model.generation_config.eos_token_id
        if i in streamed:
            assert streamed[i] == got.text, (i, kind)


def test_equal_processors_of_several_turns_run_once_per_step(model, processor, monkeypatch):
    """Three greedy turns with equal ``suppress_tokens`` (each its own processor object) together: one processor call
    per step for the three (the per-turn path made three), and each answer as alone."""
    calls = []
    original = SuppressTokensLogitsProcessor.__call__

    def counted(self, input_ids, scores):
        if threading.current_thread().name == "raincheck-batch-loop":
            calls.append((loop.steps, scores.shape[0]))
        return original(self, input_ids, scores)

    monkeypatch.setattr(SuppressTokensLogitsProcessor, "__call__", counted)
    with BatchLoop(model) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=5, loop=loop) for _ in range(3)]
        results = {}
        errors = []
        with held_loop(loop, 3):
            starter = threading.Thread(target=lambda: errors.extend(in_threads(
                lambda i: results.__setitem__(i, convs[i].ask(QUESTIONS[0], images=[IMAGES[i]],
                                                              **_kwargs(model, processor, "greedy"))), 3)))
            starter.start()
        starter.join()
        assert not errors, errors
        for conv in convs:
            conv.close()
    per_step = {}
    for step, rows in calls:
        per_step.setdefault(step, []).append(rows)
    assert any(rows == [3] for rows in per_step.values()), per_step
    assert all(len(rows) == 1 for rows in per_step.values()), per_step
    for i in range(3):
        want = _alone(model, processor, "greedy", i, results[i])
        assert torch.equal(results[i].token_ids, want.token_ids)


def test_row_keys():
    a, b = _LogitBias({5: 2.5, 9: -1.0}), _LogitBias({9: -1.0, 5: 2.5})
    assert row_key(a) == row_key(b) != row_key(_LogitBias({5: 2.5}))
    assert row_key(SuppressTokensLogitsProcessor([3, 1])) == row_key(SuppressTokensLogitsProcessor([1, 3, 3]))
    assert row_key(_Sampling(1.0, None, None, seed=1, device=torch.device("cpu"))) is None


def test_logit_bias_moves_its_tensors_once_per_device_and_dtype(monkeypatch):
    """OpenAI's ``logit_bias`` adds its values to its ids' logits, and moves its host tensors to the logits' device
    once (through `cache_utils.to_device`: pinned, non-blocking), not at every token: a pageable copy to a GPU waits
    for the step before it, which took every step of a server's batching loop out of its overlap with the device."""
    from raincheck_hf.serve import app

    moves = []
    real = app.to_device
    monkeypatch.setattr(app, "to_device", lambda t, device: moves.append(t) or real(t, device))
    bias = _LogitBias({5: 2.5, 9: -1.0})
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        scores = torch.randn(2, 12, generator=gen)
        want = scores.clone()
        want[:, 5] += 2.5
        want[:, 9] -= 1.0
        got = bias(None, scores)
        assert torch.equal(got, want) and not torch.equal(got, scores)  # (a new tensor: the scores stay as given)
    assert len(moves) == 2  # ids and values, the first time
    half = bias(None, torch.zeros(1, 12, dtype=torch.float16))
    assert half.dtype == torch.float16 and half[0, 5].item() == 2.5 and len(moves) == 4


def test_a_group_whose_processors_raise_chooses_turn_by_turn(model, processor):
    """Two turns whose processors have equal row keys but cannot take several rows at once: the group's call raises,
    its turns are chosen one by one (as alone) from then on, and both answer as alone."""

    class OneRow(SuppressTokensLogitsProcessor):
        def raincheck_row_key(self):
            return ("one_row", tuple(self.suppress_tokens.tolist()))

        def __call__(self, input_ids, scores):
            if scores.shape[0] != 1:
                raise RuntimeError("one row at a time")
            return super().__call__(input_ids, scores)

    suppress = no_placeholder_ids(model)
    with BatchLoop(model) as loop:
        convs = [Conversation(model, processor, CFG, background=False, max_new_tokens=5, loop=loop) for _ in range(2)]
        results = {}
        errors = []
        with held_loop(loop, 2):
            starter = threading.Thread(target=lambda: errors.extend(in_threads(
                lambda i: results.__setitem__(i, convs[i].ask(QUESTIONS[0], images=[IMAGES[i]], logits_processor=
                                                              LogitsProcessorList([OneRow(suppress)]))), 2)))
            starter.start()
        starter.join()
        assert not errors, errors
        for conv in convs:
            conv.close()
    for i in range(2):
        want = _alone(model, processor, "greedy", i, results[i])
        assert torch.equal(results[i].token_ids, want.token_ids)
