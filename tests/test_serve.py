"""The OpenAI-compatible server (`raincheck_hf.serve`): the real server on 127.0.0.1 (uvicorn in a
thread), the official `openai` client, the bundled glyph Qwen3-VL; answers checked against
`Conversation` on the same model (greedy)."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import raincheck_hf  # noqa: E402
from raincheck_hf.quality.glyphs import benchmark_split  # noqa: E402

from conftest import in_threads, serve_settings, wait_for  # noqa: E402

KEY = "test-key"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def dialogues():
    return benchmark_split("dev", limit=3)


@pytest.fixture(scope="module")
def served(glyph, tmp_path_factory):
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = glyph
    media = tmp_path_factory.mktemp("media")
    app = create_app(model, processor, ServeSettings(model_name="glyph", api_key=KEY, media_root=media.resolve(),
                                                     max_tokens=MAX_TOKENS))
    with running(app) as base:
        yield base, app.state.server, media


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def first_message(image_url: str, question: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                        {"type": "text", "text": question}]}


def reference(glyph, image, questions, max_new_tokens=MAX_TOKENS, mode="raincheck", **settings) -> list[str]:
    """`Conversation`'s greedy answers to the same dialogue (the same model and settings), alone on the model."""
    model, processor = glyph
    config = raincheck_hf.RaincheckConfig(mode=mode, **settings)
    with raincheck_hf.Conversation(model, processor, config, background=False) as chat:
        return [chat.ask(q, images=[image] if i == 0 else [], max_new_tokens=max_new_tokens).text
                for i, q in enumerate(questions)]


def ask(client, messages, stream=False, **kwargs):
    """``(text, usage, raincheck)`` of one request, streamed or not."""
    kwargs.setdefault("temperature", 0)
    if not stream:
        r = client.chat.completions.create(model="glyph", messages=messages, **kwargs)
        return r.choices[0].message.content, r.usage, r.model_extra["raincheck"], r.choices[0].finish_reason
    pieces, usage, rc, finish = [], None, None, None
    for chunk in client.chat.completions.create(model="glyph", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        rc = (chunk.model_extra or {}).get("raincheck", rc)
    return "".join(pieces), usage, rc, finish


def run_dialogue(client, image_url, questions, stream=False):
    messages, out = [], []
    for i, q in enumerate(questions):
        messages.append(first_message(image_url, q) if i == 0 else {"role": "user", "content": q})
        text, usage, rc, finish = ask(client, messages, stream=stream)
        out.append((text, usage, rc, finish))
        messages.append({"role": "assistant", "content": text})
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_three_turns_equal_conversation_and_reuse_the_cache(client, glyph, dialogues, stream):
    d = dialogues[0]
    questions = [t.question for t in d.turns[:3]]
    got = run_dialogue(client, data_url(d.image()), questions, stream=stream)
    assert [g[0] for g in got] == reference(glyph, d.image(), questions)
    (_, u1, rc1, f1), (_, u2, rc2, _), (_, u3, rc3, _) = got
    assert f1 in ("stop", "length")
    assert u1.prompt_tokens_details.cached_tokens == 0 and not rc1["reused"]
    assert rc1["selected"] > 0 and rc1["deferred"] > 0 and rc1["mode"] == "raincheck"
    # every earlier token but the last answer's last one, which the follow-up's prefill feeds
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1
    assert u3.prompt_tokens_details.cached_tokens == u2.prompt_tokens + u2.completion_tokens - 1
    assert rc2["reused"] and rc3["reused"] and rc1["conversation_id"] == rc2["conversation_id"] == rc3["conversation_id"]
    assert rc2["selected"] == rc2["deferred"] == 0  # no new image
    # every deferred token of turn 1 is restored exactly once: during its answer, in idle time, or at turn 2's prefill
    assert rc1["restored_during"] + rc1["restored_after"] + rc1["pending"] == rc1["deferred"]
    assert rc1["restored_during"] + rc2["restored_at_prefill"] <= rc1["deferred"]


def test_edited_history_or_another_image_is_not_reused(client, glyph, dialogues):
    """Three variants of a follow-up to a held one-turn conversation: each diverges from it (an earlier
    question edited, the image swapped for another of the same size, the earlier answer edited) and
    starts a conversation of its own; the genuine follow-up after them still continues the held one."""
    d, other = dialogues[0], dialogues[1]
    questions = [d.turns[1].question, d.turns[2].question]
    a1, u1, rc1, _ = ask(client, [first_message(data_url(d.image()), questions[0])])
    follow_up = {"role": "user", "content": questions[1]}
    edited = [first_message(data_url(d.image()), d.turns[0].question), {"role": "assistant", "content": a1}, follow_up]
    # the same tokens with another picture: only the content hash tells them apart
    assert other.image().size == d.image().size
    swapped = [first_message(data_url(other.image()), questions[0]), {"role": "assistant", "content": a1}, follow_up]
    changed = [first_message(data_url(d.image()), questions[0]), {"role": "assistant", "content": a1 + " dark"},
               follow_up]
    for messages in (edited, swapped, changed):
        _, usage, rc, _ = ask(client, messages)
        assert usage.prompt_tokens_details.cached_tokens == 0 and not rc["reused"]
        assert rc["conversation_id"] != rc1["conversation_id"]
    genuine = [first_message(data_url(d.image()), questions[0]), {"role": "assistant", "content": a1}, follow_up]
    a2, usage, rc, _ = ask(client, genuine)
    assert rc["reused"] and rc["conversation_id"] == rc1["conversation_id"]
    assert [a1, a2] == reference(glyph, d.image(), questions)


def test_file_url_and_re_encoded_image_reuse_by_content(client, glyph, dialogues, served):
    """A PNG file and a BMP data URL of the same picture are one image: the follow-up reuses the cache."""
    d = dialogues[2]
    path = served[2] / "grid.png"
    d.image().save(path)
    questions = [d.turns[0].question, d.turns[1].question]
    a1, u1, rc1, _ = ask(client, [first_message(path.as_uri(), questions[0])])
    buffer = io.BytesIO()
    d.image().save(buffer, "BMP")
    bmp = "data:image/bmp;base64," + base64.b64encode(buffer.getvalue()).decode()
    a2, u2, rc2, _ = ask(client, [first_message(bmp, questions[0]), {"role": "assistant", "content": a1},
                                  {"role": "user", "content": questions[1]}])
    assert rc2["reused"] and u2.prompt_tokens_details.cached_tokens > 0
    assert [a1, a2] == reference(glyph, d.image(), questions)


def test_two_clients_in_parallel(served, glyph, dialogues):
    answers = {}

    def run(i):
        c = openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)
        d = dialogues[i]
        answers[i] = run_dialogue(c, data_url(d.image()), [t.question for t in d.turns[:2]], stream=i == 1)

    errors = in_threads(run, 2)
    assert not errors, errors
    for i in (0, 1):
        d = dialogues[i]
        questions = [t.question for t in d.turns[:2]]
        assert [a[0] for a in answers[i]] == reference(glyph, d.image(), questions)
        assert answers[i][1][2]["reused"]
    assert answers[0][0][2]["conversation_id"] != answers[1][0][2]["conversation_id"]


def test_disconnect_mid_stream_cancels_and_the_conversation_continues(client, served, glyph, dialogues):
    """The client drops a long streamed answer after its first pieces; the server stops at the next step
    and keeps the conversation: a follow-up resent with what the server generated reuses it, and its
    answer equals `Conversation`'s for the same dialogue cut at the same length."""
    server = served[1]
    d = dialogues[1]
    q1, q2 = d.turns[0].question, d.turns[1].question
    cancelled_before = server.metrics.counters["cancelled"]
    held_before = set(server.store.ids())
    limit = 4000  # min_tokens keeps it from ending by itself: only the cancellation can stop it early
    messages = [first_message(data_url(d.image()), q1)]
    stream = client.chat.completions.create(model="glyph", messages=messages, stream=True, temperature=0,
                                            max_tokens=limit, extra_body={"min_tokens": limit})
    received = 0
    for chunk in stream:
        received += sum(bool(c.delta.content) for c in chunk.choices)
        if received >= 2:
            break
    stream.close()
    wait_for(lambda: server.metrics.counters["cancelled"] > cancelled_before)
    (conv,) = [server.store.get(i) for i in server.store.ids() if i not in held_before]
    generated = conv.turns[0].token_ids
    assert 2 <= generated.numel() < limit and conv.turns[0].cancelled
    assert conv.cache.source_length == conv.sequences.shape[1] - 1  # consistent: the last token is not fed yet
    length = conv.length
    # what the server generated, special tokens included, so that the resent history has the same ids
    partial = glyph[1].tokenizer.decode(generated, skip_special_tokens=False)
    text, usage, rc, _ = ask(client, messages + [{"role": "assistant", "content": partial},
                                                 {"role": "user", "content": q2}])
    assert rc["reused"] and rc["conversation_id"] == conv.id
    assert usage.prompt_tokens_details.cached_tokens == length - 1
    model, processor = glyph
    n = int(generated.numel())
    with raincheck_hf.Conversation(model, processor, raincheck_hf.RaincheckConfig(), background=False) as chat:
        first = chat.ask(q1, images=[d.image()], max_new_tokens=n, min_new_tokens=n)
        assert torch.equal(first.token_ids, generated)
        assert chat.ask(q2, max_new_tokens=MAX_TOKENS).text == text


def test_bad_requests_get_openai_errors_and_disturb_nothing(client, served, glyph, dialogues):
    base = served[0]
    d = dialogues[0]
    questions = [d.turns[1].question, d.turns[2].question]
    a1, u1, rc1, _ = ask(client, [first_message(data_url(d.image()), questions[0])])
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = base + "/v1/chat/completions"
    good = {"model": "glyph", "messages": [{"role": "user", "content": "hi"}]}
    cases = {
        "malformed json": (b"{not json", 400),
        "no messages": (json.dumps({"model": "glyph", "messages": []}), 400),
        "unknown role": (json.dumps({**good, "messages": [{"role": "wizard", "content": "hi"}]}), 400),
        "unreadable image": (json.dumps({**good, "messages": [first_message("data:image/png;base64,aGVsbG8=", "x")]}), 400),
        "remote image": (json.dumps({**good, "messages": [first_message("https://example.com/a.png", "x")]}), 400),
        "outside media root": (json.dumps({**good, "messages": [first_message("file:///etc/hostname", "x")]}), 400),
        "unknown raincheck setting": (json.dumps({**good, "raincheck": {"retention": 0.5, "speed": 3}}), 400),
        "bad raincheck value": (json.dumps({**good, "raincheck": {"retention": 1.5}}), 400),
        "unknown model": (json.dumps({**good, "model": "gpt-9"}), 404),  # OpenAI's model_not_found
        "bad max_tokens": (json.dumps({**good, "max_tokens": 0}), 400),
        "bad logit_bias": (json.dumps({**good, "logit_bias": {"99999999": 5}}), 400),
        "tool role": (json.dumps({**good, "messages": [{"role": "tool", "content": "x"}]}), 400),
    }
    for name, (body, status) in cases.items():
        r = httpx.post(url, content=body, headers=headers, timeout=60)
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
    assert "speed" in httpx.post(url, content=cases["unknown raincheck setting"][0], headers=headers).json()["error"]["message"]
    assert "data URL" in httpx.post(url, content=cases["remote image"][0], headers=headers).json()["error"]["message"]
    # the official client raises its typed errors
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="glyph", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"raincheck": {"mode": "sometimes"}})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(url, content=json.dumps(good), headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(base + "/v1/nothing-here", headers=headers)
    assert r.status_code == 404 and "Unknown route" in r.json()["error"]["message"]
    # the conversation before the errors is still held and continues
    a2, u2, rc2, _ = ask(client, [first_message(data_url(d.image()), questions[0]), {"role": "assistant", "content": a1},
                                  {"role": "user", "content": questions[1]}])
    assert rc2["reused"] and rc2["conversation_id"] == rc1["conversation_id"]
    assert [a1, a2] == reference(glyph, d.image(), questions)


def test_stop_seed_models_health_and_metrics(client, served, dialogues):
    base = served[0]
    d = dialogues[0]
    messages = [first_message(data_url(d.image()), d.turns[0].question)]
    full, _, _, _ = ask(client, messages)
    word = full.split()[3]
    cut, _, _, finish = ask(client, messages, stop=[" " + word])
    assert finish == "stop" and full.startswith(cut) and len(cut) < len(full) and (" " + word) not in cut
    streamed, _, _, _ = ask(client, messages, stream=True, stop=[" " + word])
    assert streamed == cut
    sampled = [ask(client, messages, temperature=1.5, seed=7)[0] for _ in range(2)]
    assert sampled[0] == sampled[1]
    dark = served[1].processor.tokenizer.convert_tokens_to_ids("dark")
    biased, usage, _, finish = ask(client, messages, max_tokens=5, logit_bias={str(dark): 100})
    assert biased.split() == ["dark"] * 5 and finish == "length" and usage.completion_tokens == 5
    assert [m.id for m in client.models.list().data] == ["glyph"]
    health = httpx.get(base + "/health").json()  # no key needed
    assert health["status"] == "ok" and health["conversations"] >= 1
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("raincheck_requests_total", "raincheck_ttft_seconds_bucket", "raincheck_tpot_seconds_count",
                 "raincheck_cached_tokens_total", "raincheck_restored_during_answer_total",
                 "raincheck_restored_after_answer_total", "raincheck_conversations", "raincheck_evictions_total"):
        assert name in text
    counts = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(counts["raincheck_cached_tokens_total"]) > 0  # prometheus_client writes "12.0"
    assert float(counts["raincheck_ttft_seconds_count"]) >= 5


def test_idle_time_restoration_between_requests(client, served, dialogues):
    """A short first answer ends before the decode guard (16 here): its deferred tokens are restored after it, by
    the conversation's worker, before any follow-up."""
    server = served[1]
    d = dialogues[2]
    guard = {"raincheck": {"decode_guard": 16}}
    text, usage, rc, _ = ask(client, [first_message(data_url(d.image()), d.turns[1].question)], extra_body=guard)
    assert rc["restored_during"] == 0 and rc["deferred"] > 0
    conv = server.store.get(rc["conversation_id"])
    wait_for(lambda: conv.pending == 0 and conv.turns[-1].restored_after_answer == rc["deferred"])
    _, _, rc2, _ = ask(client, [first_message(data_url(d.image()), d.turns[1].question),
                                {"role": "assistant", "content": text}, {"role": "user", "content": d.turns[2].question}],
                          extra_body=guard)
    assert rc2["reused"] and rc2["restored_at_prefill"] == 0


def test_eviction_under_a_tiny_budget(client, served, glyph, dialogues):
    server = served[1]
    store = server.store
    d = dialogues[1]
    questions = [d.turns[1].question, d.turns[2].question]
    before = store.evictions
    full = {"raincheck": {"mode": "full"}}
    store.max_bytes = 1  # no cache fits: each conversation is evicted once it is checked in
    try:
        a1, _, rc1, _ = ask(client, [first_message(data_url(d.image()), questions[0])], extra_body=full)
        assert store.get(rc1["conversation_id"]) is None and store.evictions > before  # and every other one
        assert store.snapshot()["conversations"] == 0
        after_first = store.evictions
        history = [first_message(data_url(d.image()), questions[0]), {"role": "assistant", "content": a1},
                   {"role": "user", "content": questions[1]}]
        a2, usage, rc2, _ = ask(client, history, extra_body=full)
        assert usage.prompt_tokens_details.cached_tokens == 0 and not rc2["reused"]  # rebuilt from the messages
        assert store.snapshot()["conversations"] == 0 and store.evictions == after_first + 1
        budget = httpx.get(served[0] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert "raincheck_cache_budget_bytes 1.0" in budget
    finally:
        store.max_bytes = None
    # in full mode, one prefill of the whole history answers as the continued cache does
    model, processor = glyph
    with raincheck_hf.Conversation(model, processor, raincheck_hf.RaincheckConfig(mode="full"), background=False) as chat:
        assert [chat.ask(q, images=[d.image()] if i == 0 else [], max_new_tokens=MAX_TOKENS).text
                for i, q in enumerate(questions)] == [a1, a2]
    text = httpx.get(served[0] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert f"raincheck_evictions_total {store.evictions}" in text
    assert "raincheck_cache_budget_bytes" not in text  # (unbounded again)


def test_cli_rejects_bad_settings_before_loading():
    from raincheck_hf.__main__ import main

    assert main(["serve", "--retention", "2"]) == 2
    assert main(["serve", "--max-cache-gb", "-1"]) == 2
    assert main(["serve", "--port", "0"]) == 2


@pytest.mark.parametrize("argv, message", [(["--max-tokens", "0"], "--max-tokens must be >= 1"),
                                           (["--api-key", ""], "--api-key must be a non-empty"),
                                           (["--media-root", "/no/such/folder"], "--media-root must be an existing")])
def test_cli_settings_errors_name_the_option(argv, message):
    """ServeSettings checks its fields (for the library too); from the command line the error names the option."""
    from raincheck_hf.serve import ServeSettings

    with pytest.raises(ValueError, match=message):
        serve_settings(argv)
    with pytest.raises(ValueError, match="media_root must be an existing folder"):
        ServeSettings(media_root="/no/such/folder")


@pytest.mark.parametrize("argv, want", [([], None), (["--compile-steps"], True), (["--no-compile-steps"], False)])
def test_cli_compile_steps_is_auto_unless_forced(argv, want):
    """Neither flag: RaincheckConfig's default (None: compiled where the steps are captured as CUDA graphs)."""
    assert serve_settings(argv).config.compile_steps is want


def test_serve_benchmark_smoke(tmp_path):
    """`python -m raincheck_hf.bench serve` on the tiny model: the structure of its JSON and what must hold
    whatever the timings (answers equal between server and library, reuse only where it should be)."""
    from raincheck_hf.bench import serve as bench

    path = tmp_path / "serve.json"
    result = bench.run(model_name="tiny_qwen3_vl", answer_tokens=6, follow_up_tokens=3, reps=1, think_s=0.05,
                       warmup=False, json_path=str(path), log=lambda *a: None)
    assert json.loads(path.read_text())["benchmark"] == "serve" and result["hardware"]["torch"]
    assert result["lengths_ok"]
    variants = result["variants"]
    assert list(variants) == list(bench.VARIANTS)
    for name, entry in variants.items():
        (rep,) = entry["reps"]
        assert len(rep) == len(entry["median"]) == 3, name
        for turn in entry["median"]:
            assert turn["ttft_s"] > 0 and turn["tpot_s"] > 0 and turn["e2e_s"] >= turn["ttft_s"], name
    for mode in ("raincheck", "full"):
        assert [t["text"] for t in variants[f"server {mode}"]["reps"][0]] == \
            [t["text"] for t in variants[f"library {mode}"]["reps"][0]]
    for name in ("server raincheck", "server full"):
        turns = variants[name]["reps"][0]
        assert not turns[0]["reused"] and turns[1]["reused"] and turns[2]["reused"]
        for before, after in zip(turns, turns[1:]):
            assert after["cached_tokens"] == before["prompt_tokens"] + before["completion_tokens"] - 1
    assert all(t["cached_tokens"] == 0 and not t["reused"] for t in variants["server full re-prefill"]["reps"][0])
    assert all(v is not None for v in result["derived"].values())
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run(variants=("server turbo",))


def test_video_as_frames_equals_conversation(client, glyph, dialogues):
    """A video part (frames as image URLs, with their fps) answers as `Conversation.ask(videos=...)` does."""
    import numpy as np

    frames = [dialogues[0].image(), dialogues[0].image(), dialogues[1].image(), dialogues[1].image()]
    question = dialogues[0].turns[1].question
    part = {"type": "video", "video": [data_url(f) for f in frames], "fps": 2}
    text, usage, rc, _ = ask(client, [{"role": "user", "content": [part, {"type": "text", "text": question}]}])
    assert rc["selected"] + rc["deferred"] > 0
    video = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).contiguous()
    model, processor = glyph
    with raincheck_hf.Conversation(model, processor, raincheck_hf.RaincheckConfig(), background=False) as chat:
        assert chat.ask(question, videos=[video], video_fps=2.0, max_new_tokens=MAX_TOKENS).text == text


def test_client_gone_while_waiting_for_a_whole_answer_cancels_it(served, dialogues):
    server = served[1]
    before = server.metrics.counters["cancelled"]
    body = {"model": "glyph", "max_tokens": 4000, "min_tokens": 4000, "temperature": 0,
            "messages": [first_message(data_url(dialogues[0].image()), dialogues[0].turns[1].question)]}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
        httpx.post(served[0] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=0.5)
    wait_for(lambda: server.metrics.counters["cancelled"] > before)
    assert server.store.snapshot()["busy"] == 0


def test_qwen3_5_through_the_server_equals_conversation(dialogues):
    """The bundled glyph Qwen3.5 (Gated DeltaNet state continued across requests) served the same way."""
    from raincheck_hf.quality import load_bundled
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = load_bundled("qwen3_5")
    raincheck_hf.enable(model)
    d = dialogues[0]
    questions = [t.question for t in d.turns[:2]]
    with running(create_app(model, processor, ServeSettings(model_name="glyph"))) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = run_dialogue(c, data_url(d.image()), questions, stream=True)
    assert got[1][2]["reused"] and got[1][1].prompt_tokens_details.cached_tokens > 0
    assert [g[0] for g in got] == reference((model, processor), d.image(), questions)


def test_decoded_images_are_reused_by_their_encoded_bytes(monkeypatch):
    """A follow-up resends the conversation's images: the same bytes are decoded and hashed once; another
    encoding of the same picture is decoded again and gets the same pixel hash; the oldest entry goes first."""
    import io

    from raincheck_hf.serve import protocol
    from raincheck_hf.tiny import draw_test_image

    calls = []
    real = protocol.decode_pixels
    monkeypatch.setattr(protocol, "decode_pixels", lambda data, param: calls.append(param) or real(data, param))

    def encoded(image, fmt):
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        return buf.getvalue()

    a, b = draw_test_image(64, 48, seed=1), draw_test_image(64, 48, seed=2)
    cache = protocol.DecodedImages(capacity=2)
    first = cache.decode(encoded(a, "PNG"), "p")
    again = cache.decode(encoded(a, "PNG"), "p")
    assert len(calls) == 1 and again[1] == first[1] and again[0] is first[0]
    as_bmp = cache.decode(encoded(a, "BMP"), "p")
    assert len(calls) == 2 and as_bmp[1] == first[1]
    # the hash (worked out on the cache's hashing thread) is the pixels' and size's, whatever the encoding
    assert f"{first[1]}" == protocol.digest(b"(64, 48)", a.convert("RGB").tobytes())
    other = cache.decode(encoded(b, "PNG"), "p")  # a third entry: the PNG of `a`, least recently used, goes
    assert other[1] != first[1] and f"{other[1]}" != f"{first[1]}"
    cache.decode(encoded(a, "PNG"), "p")
    assert len(calls) == 4 and len(cache) == 2
    grey = cache.decode(encoded(a.convert("L"), "PNG"), "p")[0]  # decoded to RGB whatever the file's mode
    assert grey.mode == "RGB" and grey.tobytes() == a.convert("L").convert("RGB").tobytes()
    with pytest.raises(protocol.APIError):
        cache.decode(b"not an image", "p")
    assert len(cache) == 2


def test_processed_images_equal_the_processor_and_are_made_once_per_picture():
    """The server's processor copy (`protocol.with_processed_images`) gives what the processor gives (ids, pixels,
    grids) for one and for two pictures of different sizes, processes a picture seen before (the same decoded object)
    no more, a picture decoded again once more, and leaves the caller's processor as it was."""
    from families import family_processor

    from raincheck_hf.serve import protocol
    from raincheck_hf.tiny import draw_test_image

    processor = family_processor("qwen3_vl")
    original = processor.image_processor
    twin = protocol.with_processed_images(processor, capacity=2)
    cached = twin.image_processor
    assert processor.image_processor is original and isinstance(cached, protocol.ProcessedImages)
    assert twin.tokenizer is processor.tokenizer and cached.merge_size == original.merge_size
    a, b = draw_test_image(64, 48, seed=1), draw_test_image(40, 72, seed=2)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"

    def same(images):
        text = [" and ".join([pad] * len(images)) + " what?"]
        want = processor(text=text, images=images, return_tensors="pt")
        got = twin(text=text, images=images, return_tensors="pt")
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key

    same([a])
    assert cached.processed == 1
    same([a, b])  # (`a` kept: only `b` is processed)
    assert cached.processed == 2
    same([b, a])
    assert cached.processed == 2
    same([a.copy()])  # another object with the same pixels: processed again (entries are pictures, by identity)
    assert cached.processed == 3 and len(cached._entries) == 2


def test_a_follow_up_does_not_process_its_resent_image_again(client, served, glyph, dialogues):
    """Over HTTP: the first turn's picture is processed once; its follow-up resends it and the server's processor
    takes what it made of it then (`ProcessedImages`); the answers are the conversation's alone."""
    server = served[1]
    cached = server.processor.image_processor
    assert glyph[1].image_processor is not cached  # (the server's own copy of the processor)
    d = dialogues[2]
    questions = [t.question for t in d.turns[:2]]
    before = cached.processed
    messages = [first_message(data_url(d.image()), questions[0])]
    first = ask(client, messages)
    seen = cached.processed  # (one more, unless an earlier test of the module sent this picture)
    assert seen <= before + 1
    messages += [{"role": "assistant", "content": first[0]}, {"role": "user", "content": questions[1]}]
    second = ask(client, messages)
    assert cached.processed == seen and second[2]["reused"]
    assert [first[0], second[0]] == reference(glyph, d.image(), questions)
    # forgotten (what `bench serve-load` does between rounds): the same picture decoded and processed again, the
    # answer unchanged
    decoded = len(server.images)
    server.forget_media()
    assert len(server.images) == 0 and not cached._entries
    again = ask(client, [first_message(data_url(d.image()), questions[0])])
    assert cached.processed == seen + 1 and len(server.images) == 1 and decoded >= 1
    assert again[0] == first[0]


def test_a_request_may_ask_for_auto_chunks_and_keeps_the_servers_compile_setting():
    """A request's ``raincheck`` settings over the server's config: the server-wide ones (``compile_steps``,
    ``batch_chunk_rows``) stay the server's."""
    from raincheck_hf import RaincheckConfig
    from raincheck_hf.serve import protocol

    for server in (True, False, None):  # None: the default, auto
        defaults = RaincheckConfig(compile_steps=server)
        config = protocol._config({"raincheck": {"chunk_size": "auto", "tpot_slack": 0.05}}, defaults)
        assert (config.chunk_size, config.tpot_slack, config.compile_steps) == ("auto", 0.05, server)
    for rows in (None, 16):  # the batching loop's shared chunk budget: the server's too
        config = protocol._config({"raincheck": {"chunk_size": 15}}, RaincheckConfig(batch_chunk_rows=rows))
        assert (config.chunk_size, config.batch_chunk_rows) == (15, rows)
    with pytest.raises(protocol.APIError, match="compile_steps"):  # the server's setting, not a request's
        protocol._config({"raincheck": {"compile_steps": True}}, defaults)
    with pytest.raises(protocol.APIError, match="tpot_slack=-1"):
        protocol._config({"raincheck": {"tpot_slack": -1}}, defaults)
    spaced = RaincheckConfig(chunk_every=3)  # a server spacing its fixed-size chunks
    assert protocol._config({"raincheck": {"chunk_size": 15}}, spaced).chunk_every == 3
    assert protocol._config({"raincheck": {"chunk_every": 2}}, spaced).chunk_every == 2
    assert protocol._config({"raincheck": {"chunk_size": "auto"}}, spaced).chunk_every == 1  # "auto" decides itself
    with pytest.raises(protocol.APIError, match="chunk_every=2"):
        protocol._config({"raincheck": {"chunk_size": "auto", "chunk_every": 2}}, spaced)
    with pytest.raises(protocol.APIError, match="chunk_every=0"):
        protocol._config({"raincheck": {"chunk_every": 0}}, spaced)
