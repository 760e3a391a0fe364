"""The server's batching loop (``--batching``, `serve.scheduler.BatchScheduler`) on the bundled glyph Qwen3-VL:
answers equal to the same conversations run alone (greedy), turns sharing steps, a client that goes away freeing
its rows, a failing request (or step) leaving the others alone, the settings and the metrics."""

from __future__ import annotations


import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import in_threads, serve_settings  # noqa: E402
from test_serve_load import (LONG, data_url, first_message, dialogues, metric, reference, soak,  # noqa: E402,F401
                             wait_for)


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def long_stream(base, image_url, question):
    """A streamed answer that only a cancellation ends early, once its first piece came."""
    stream = client(base).chat.completions.create(model="glyph", messages=[first_message(image_url, question)],
                                                  stream=True, temperature=0, max_tokens=LONG,
                                                  extra_body={"min_tokens": LONG})
    for chunk in stream:
        if any(c.delta.content for c in chunk.choices):
            return stream
    raise AssertionError("the stream ended without text")


def dialogue(base, d, turns=2, stream=False) -> list[str]:
    """The dialogue's first ``turns`` turns through the server, each answer sent back as the client got it."""
    messages, texts = [], []
    for k, turn in enumerate(d.turns[:turns]):
        messages.append(first_message(data_url(d.image()), turn.question) if k == 0
                        else {"role": "user", "content": turn.question})
        if stream:
            text = "".join(c.delta.content or "" for chunk in client(base).chat.completions.create(
                model="glyph", messages=messages, temperature=0, stream=True) for c in chunk.choices)
        else:
            text = client(base).chat.completions.create(model="glyph", messages=messages,
                                                        temperature=0).choices[0].message.content
        texts.append(text)
        messages.append({"role": "assistant", "content": text})
    return texts


def dialogues_at_once(base, dialogues, count: int) -> dict:
    """The first ``count`` dialogues' first two turns, each from a client thread of its own, all at once (the even
    ones streamed): ``{i: answers}``."""
    got = {}

    def run(i):
        got[i] = dialogue(base, dialogues[i], turns=2, stream=i % 2 == 0)

    errors = in_threads(run, count)
    assert not errors, errors
    return got


@pytest.fixture()
def batching_server(glyph):
    """Two running places (the batch's sequences), prompts prefilled 48 rows a step."""
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = glyph
    app = create_app(model, processor, ServeSettings(model_name="glyph", max_tokens=16, max_running=2, max_queue=4,
                                                     batching=True, max_batch_tokens=48))
    with running(app) as base:
        yield base, app.state.server


# ---- settings ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,message", [("max_batch_tokens", 0, "max_batch_tokens must be an integer >= 1"),
                                                 ("max_batch_tokens", 2.5, "max_batch_tokens must be an integer"),
                                                 ("batching", "yes", "batching must be True or False")])
def test_settings_reject_bad_batching_values(field, value, message):
    from raincheck_hf.serve import ServeSettings

    with pytest.raises(ValueError, match=message):
        ServeSettings(**{field: value})


def test_cli_batching_options():
    with pytest.raises(ValueError) as error:
        serve_settings(["--batching", "--max-batch-tokens", "0"])
    assert str(error.value) == "--max-batch-tokens must be an integer >= 1, got 0"
    settings = serve_settings(["--batching", "--max-batch-tokens", "512"])
    assert settings.batching is True and settings.max_batch_tokens == 512
    assert serve_settings([]).batching is False  # the per-turn path stays the default


# ---- through HTTP ------------------------------------------------------------------------------------------

def test_a_turn_joins_a_running_answer_and_they_share_steps(batching_server, glyph, dialogues):
    """B's two-turn dialogue (its image prompt prefilled in pieces of the step's budget) runs beside A's long
    answer: B answers as its conversation alone does, and the steps meanwhile carried both (more tokens came out
    than steps ran); B's follow-up continued its held conversation."""
    base, server = batching_server
    a = long_stream(base, data_url(dialogues[0].image()), dialogues[0].turns[0].question)
    d = dialogues[1]
    tokens, steps = metric(base, "raincheck_completion_tokens_total"), server.scheduler.steps
    got = dialogue(base, d, turns=2, stream=True)
    tokens, steps = metric(base, "raincheck_completion_tokens_total") - tokens, server.scheduler.steps - steps
    assert got == reference(glyph, d.image(), [t.question for t in d.turns[:2]])
    assert tokens > steps + 2, (tokens, steps)  # at most one token per sequence and step: two sequences per step
    assert metric(base, "raincheck_batch_size") in (1, 2) and metric(base, "raincheck_steps_total") >= steps
    a.close()
    wait_for(lambda: server.admission.snapshot()["running"] == 0 and server.scheduler.running == 0)
    assert server.store.snapshot()["busy"] == 0
    assert all(not e.sequences for e in server.scheduler._engines)  # every row freed


def test_concurrent_dialogues_equal_their_conversations_alone(batching_server, glyph, dialogues):
    """Four clients (two running places, two queued), streamed and not, two turns each."""
    base, _ = batching_server
    got = dialogues_at_once(base, dialogues, 4)
    for i in range(4):
        d = dialogues[i]
        assert got[i] == reference(glyph, d.image(), [t.question for t in d.turns[:2]]), i


def test_idle_time_restoration_by_the_loop(batching_server, glyph, dialogues):
    """With no answer running, the loop restores a held conversation's deferred tokens (a chunk at a time; the
    conversations have no worker of their own); the follow-up then continues with nothing left to restore and
    answers as its conversation alone does. Guard 16: the short answer ends before any chunk runs in it."""
    base, server = batching_server
    d = dialogues[0]
    guard = {"raincheck": {"decode_guard": 16}}
    reply = client(base).chat.completions.create(model="glyph", temperature=0, extra_body=guard,
                                                 messages=[first_message(data_url(d.image()), d.turns[0].question)])
    deferred = reply.model_extra["raincheck"]["deferred"]
    assert deferred > 0 and reply.model_extra["raincheck"]["restored_during"] == 0
    conv = server.store.get(reply.model_extra["raincheck"]["conversation_id"])
    assert conv._worker is None
    wait_for(lambda: conv.turns[0].restored_after_answer == deferred)  # counted once its chunk's forward ran
    assert conv.pending == 0 and conv.turns[0].pending == 0
    text = reply.choices[0].message.content
    follow = client(base).chat.completions.create(model="glyph", temperature=0, extra_body=guard, messages=[
        first_message(data_url(d.image()), d.turns[0].question), {"role": "assistant", "content": text},
        {"role": "user", "content": d.turns[1].question}])
    assert follow.model_extra["raincheck"]["reused"] and follow.model_extra["raincheck"]["restored_at_prefill"] == 0
    assert [text, follow.choices[0].message.content] == reference(glyph, d.image(), [t.question for t in d.turns[:2]],
                                                                  decode_guard=16)


def test_a_client_gone_mid_stream_frees_its_rows(batching_server, glyph, dialogues):
    """A's client goes away mid-answer: its sequence leaves the batch before the next step, its conversation keeps
    what was answered (consistent, held, continuable), and a follow-up continues it as `Conversation` would."""
    base, server = batching_server
    d = dialogues[2]
    a = long_stream(base, data_url(d.image()), d.turns[0].question)
    assert server.scheduler.running == 1
    a.close()
    wait_for(lambda: server.scheduler.running == 0 and server.admission.snapshot()["running"] == 0)
    assert all(not e.sequences for e in server.scheduler._engines)
    (conv,) = [server.store.get(i) for i in server.store.ids() if server.store.get(i).turns[0].cancelled]
    assert conv.cache.source_length == conv.sequences.shape[1] - 1  # consistent: the last token is not yet fed
    assert 1 <= conv.turns[0].token_ids.numel() < LONG
    assert metric(base, "raincheck_cancelled_total") == 1


def test_a_failing_request_does_not_affect_the_others(batching_server, glyph, dialogues, monkeypatch):
    """A request whose logits processor raises gets a 500 and leaves; the answer running beside it goes on, and a
    later request answers as its conversation alone does. Then a step that raises: the sequences in it get an
    error, the loop goes on and the next request is answered correctly."""
    from transformers import LogitsProcessor

    from raincheck_hf.batch_engine import ForwardRunner

    base, server = batching_server

    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise RuntimeError("boom")

    processors = server._processors
    monkeypatch.setattr(server, "_processors", lambda request, kwargs: processors(request, kwargs) + (
        [Boom()] if request.user == "boom" else []))
    a = long_stream(base, data_url(dialogues[0].image()), dialogues[0].turns[0].question)
    with pytest.raises(openai.InternalServerError):
        client(base).chat.completions.create(model="glyph", temperature=0, user="boom",
                                             messages=[first_message(data_url(dialogues[1].image()), "Hi")])
    pieces = 0
    for chunk in a:  # A still answers after B failed beside it
        pieces += any(c.delta.content for c in chunk.choices)
        if pieces == 3:
            break
    assert pieces == 3
    d = dialogues[3]
    assert dialogue(base, d, turns=1) == reference(glyph, d.image(), [d.turns[0].question])
    a.close()
    wait_for(lambda: server.scheduler.running == 0 and server.admission.snapshot()["running"] == 0)

    run, failed = ForwardRunner.run, []

    def failing_once(runner, entries):  # the forward raises (after the step took its rows)
        if not failed:
            failed.append(True)
            raise RuntimeError("a step failed")
        return run(runner, entries)

    monkeypatch.setattr(ForwardRunner, "run", failing_once)
    with pytest.raises(openai.InternalServerError):
        client(base).chat.completions.create(model="glyph", temperature=0,
                                             messages=[first_message(data_url(d.image()), d.turns[0].question)])
    assert failed and server.scheduler.running == 0
    assert dialogue(base, d, turns=1) == reference(glyph, d.image(), [d.turns[0].question])
    assert all(not e.sequences for e in server.scheduler._engines)


def test_soak_with_batching(glyph, dialogues):
    """`test_serve_load.soak` on the batching loop: ten clients, three-turn image dialogues in `raincheck` and
    `full` modes (one engine each), streamed and not, one cancelling, four running places, prompts prefilled 64
    rows a step: every completed answer equals its conversation alone, nothing but 200; the turns shared steps."""
    model, processor = glyph
    figures = soak(model, processor, dialogues, clients=10, running_places=4, answer=16, dialogues_per_client=1,
                   batching=True, max_batch_tokens=64)
    assert figures["cancelled"] == 1 and figures["answered"] == 3 * 10 - 2
    assert figures["evictions"] > 0 and figures["max_running"] == 4
    assert figures["steps"] < figures["completion_tokens"], figures  # several sequences per step


def test_batching_on_the_gated_deltanet_family(dialogues):
    """The bundled glyph Qwen3.5 (Gated DeltaNet layers: per-sequence recurrent states in the batch): three
    concurrent two-turn dialogues answer as their conversations alone do."""
    import raincheck_hf
    from raincheck_hf.quality import load_bundled
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = load_bundled("qwen3_5")
    model = raincheck_hf.enable(model)
    app = create_app(model, processor, ServeSettings(model_name="glyph", max_tokens=16, max_running=3,
                                                     batching=True, max_batch_tokens=64))
    with running(app) as base:
        got = dialogues_at_once(base, dialogues, 3)
    for i in range(3):
        d = dialogues[i]
        assert got[i] == reference((model, processor), d.image(), [t.question for t in d.turns[:2]]), i
