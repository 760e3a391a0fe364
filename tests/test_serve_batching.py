"""The server's batching loop (``--batching``, `serve.scheduler.BatchScheduler`) on the bundled glyph Qwen3-VL:
answers equal to the same conversations run alone (greedy), turns sharing steps, a client that goes away freeing
its rows, a failing request (or step) leaving the others alone, the settings and the metrics."""

from __future__ import annotations

import asyncio
import contextlib


import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import fail_remove_many, gate_restoring_pieces, in_threads, serve_settings  # noqa: E402
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
                                                     batching=True, max_batch_tokens=48, max_preparing=2,
                                                     prepare_priority="high"))
    loop = app.state.server.scheduler  # (the settings given to the loop; the priority does nothing on a CPU)
    assert (loop.max_preparing, loop.prepare_priority, loop.token_budget) == (2, "high", 48)
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


def test_cli_memory_headroom_gb_is_parsed_and_checked(capsys):
    """``--memory-headroom-gb``: GiB on the command line, bytes in `ServeSettings.memory_headroom` (the loop's);
    ``auto`` (the default) and ``off`` (None: no wait for memory) as they are; a negative or non-finite number is
    refused naming the option and the value, a word that is none of them by argparse, before anything is loaded."""
    assert serve_settings([]).memory_headroom == "auto"
    assert serve_settings(["--batching", "--memory-headroom-gb", "auto"]).memory_headroom == "auto"
    assert serve_settings(["--batching", "--memory-headroom-gb", "off"]).memory_headroom is None
    assert serve_settings(["--batching", "--memory-headroom-gb", "1.5"]).memory_headroom == 1610612736  # 1.5 GiB
    assert serve_settings(["--batching", "--memory-headroom-gb", "4"]).memory_headroom == 4 << 30
    assert serve_settings(["--batching", "--memory-headroom-gb", "0"]).memory_headroom == 0
    for bad, shown in (("-1", "-1"), ("-0.5", "-0.5"), ("inf", "inf"), ("nan", "nan")):
        with pytest.raises(ValueError) as error:
            serve_settings(["--batching", "--memory-headroom-gb", bad])
        assert str(error.value) == f"--memory-headroom-gb must be a number of GiB >= 0, 'auto' or 'off', got {shown}"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        serve_settings(["--batching", "--memory-headroom-gb", "abc"])
    assert "argument --memory-headroom-gb: takes a number of GiB, 'auto' or 'off', got 'abc'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [-1, 1.5, True, "lots", "Auto"])
def test_settings_check_memory_headroom_with_the_loops_rule(bad, glyph):
    """`ServeSettings.memory_headroom` is checked by the loop's own rule (`batch_loop.check_memory_headroom`), with
    or without ``batching``; the error names the setting (and, from the command line, its option)."""
    from raincheck_hf.batch_loop import BatchLoop
    from raincheck_hf.serve import ServeSettings
    from raincheck_hf.serve.cli import _OPTIONS

    rule = "must be a number of bytes >= 0, 'auto', or None (no admission by device memory)"
    for batching in (True, False):
        with pytest.raises(ValueError) as error:
            ServeSettings(batching=batching, memory_headroom=bad)
        assert str(error.value) == f"memory_headroom {rule}, got {bad!r}"
    with pytest.raises(ValueError) as error:
        BatchLoop(glyph[0], memory_headroom=bad)
    assert str(error.value) == f"BatchLoop(memory_headroom={bad!r}) {rule}."
    assert _OPTIONS["memory_headroom"] == "--memory-headroom-gb"


@pytest.mark.parametrize("argv,want", [([], "auto"), (["--memory-headroom-gb", "off"], None),
                                       (["--memory-headroom-gb", "0.25"], 1 << 28)])
def test_memory_headroom_reaches_the_servers_loop(glyph, argv, want):
    """The command line's headroom is the server's `BatchScheduler`'s (`BatchLoop.memory_headroom`, what its
    preparations wait for); without ``--batching`` there is no loop and it does nothing, as the loop's other
    options."""
    from dataclasses import replace

    from raincheck_hf.serve import create_app

    model, processor = glyph
    settings = replace(serve_settings(["--batching", *argv]), model_name="glyph")
    assert settings.memory_headroom == want
    server = create_app(model, processor, settings).state.server
    try:
        assert server.scheduler.memory_headroom == want and type(server.scheduler.memory_headroom) is type(want)
    finally:
        server.close()
    off = create_app(model, processor, replace(serve_settings(argv), model_name="glyph")).state.server
    try:
        assert off.scheduler is None and off.settings.memory_headroom == want
    finally:
        off.close()


# ---- through HTTP ------------------------------------------------------------------------------------------

def test_a_turn_joins_a_running_answer_and_they_share_steps(batching_server, glyph, dialogues):
    """B's two-turn dialogue (its image prompt prefilled in pieces of the step's budget) runs beside A's long
    answer: B answers as its conversation alone does, and the steps meanwhile carried both (the loop's step record:
    steps of two sequences, B's prompt pieces and its answers' tokens beside A's); B's follow-up continued its held
    conversation. (Counting tokens against steps instead, more tokens than steps + 2, passed by B's few tokens alone
    and failed once under load, when two of B's steps ran without A.)"""
    base, server = batching_server
    a = long_stream(base, data_url(dialogues[0].image()), dialogues[0].turns[0].question)
    d = dialogues[1]
    server.scheduler.reset_step_stats()
    steps = server.scheduler.steps
    got = dialogue(base, d, turns=2, stream=True)
    steps = server.scheduler.steps - steps
    assert got == reference(glyph, d.image(), [t.question for t in d.turns[:2]])
    kinds = server.scheduler.step_stats()["kinds"]
    both = sum(figures["by_sequences"].get(2, {}).get("steps", 0) for figures in kinds.values())
    assert both >= 2, kinds  # (six when the test runs alone: B's 48-row prompt pieces and its tokens, beside A's)
    assert metric(base, "raincheck_batch_size") in (1, 2) and metric(base, "raincheck_steps_total") >= steps
    a.close()
    wait_for(lambda: server.admission.snapshot()["running"] == 0 and server.scheduler.running == 0)
    assert server.store.snapshot()["busy"] == 0
    assert all(not e.sequences for e in server.scheduler._engines)  # every row freed


def labelled(base: str, name: str) -> dict[str, float]:
    """``{label value: value}`` of a metric with one label (``name{label="value"} value`` lines)."""
    found = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('"')[1]] = float(value)
    return found


def test_metrics_count_steps_by_kind_and_time_the_joins(batching_server, dialogues):
    """Two dialogues of two turns: `raincheck_step_kinds_total` by kind adds up to `raincheck_steps_total` and to
    the loop's own steps by kind (`BatchLoop.step_stats`; on a CPU every step eager), every kind's series there from
    the start; `raincheck_join_seconds` observed each turn's joining once."""
    base, server = batching_server
    kinds = labelled(base, "raincheck_step_kinds_total")
    assert kinds == {"replayed": 0, "captured": 0, "eager": 0}
    assert metric(base, "raincheck_join_seconds_count") == 0
    dialogues_at_once(base, dialogues, 2)
    wait_for(lambda: server.scheduler.running == 0)
    kinds = labelled(base, "raincheck_step_kinds_total")
    steps = server.scheduler.step_stats()
    assert sum(kinds.values()) == metric(base, "raincheck_steps_total") == server.scheduler.steps == steps["steps"]
    assert kinds["eager"] == steps["kinds"]["eager"]["steps"] > 0 and set(steps["kinds"]) == {"eager"}
    assert metric(base, "raincheck_join_seconds_count") == steps["joins"] == 4
    assert metric(base, "raincheck_join_seconds_sum") == pytest.approx(steps["join_total_s"])


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
    assert conv._restorer is None
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


@pytest.mark.parametrize("fast_path", [None, True], ids=["auto", "captured"])
def test_batching_on_the_gated_deltanet_family(dialogues, fast_path, monkeypatch):
    """The bundled glyph Qwen3.5 (Gated DeltaNet layers: per-sequence recurrent states in the batch): three
    concurrent two-turn dialogues answer as their conversations alone do; with ``fast_path=True`` (the captured
    batched steps; on a CPU the same static-buffer steps run eagerly) the prompt pieces of input rows run alone in
    prefill steps (`PackedGDNState.static_prefill`) and the decode steps replay too."""
    import raincheck_hf
    from raincheck_hf import RaincheckConfig
    from raincheck_hf.quality import load_bundled
    from raincheck_hf.serve import ServeSettings, create_app, running

    paths = watch_paths(monkeypatch)
    model, processor = load_bundled("qwen3_5")
    model = raincheck_hf.enable(model)
    app = create_app(model, processor, ServeSettings(model_name="glyph", max_tokens=16, max_running=3,
                                                     batching=True, max_batch_tokens=64,
                                                     config=RaincheckConfig(fast_path=fast_path)))
    with running(app) as base:
        got = dialogues_at_once(base, dialogues, 3)
    for i in range(3):
        d = dialogues[i]
        assert got[i] == reference((model, processor), d.image(), [t.question for t in d.turns[:2]]), i
    if fast_path:  # prompts alone in replayed prefill steps (none beside decode rows), decode steps replayed
        assert any(p == ("replay", False, False, True) for p in paths)
        assert not any(path == "replay" and decoding and prompt for path, _, decoding, prompt in paths)
        assert any(p[0] == "replay" and p[2] for p in paths)
    else:  # (auto on a CPU: the eager engine)
        assert paths and all(p[0] == "eager" for p in paths)


# ---- held conversations restored in the spare budget of busy steps -------------------------------------

GUARD16 = {"decode_guard": 16}  # the 16-token answers end before any chunk runs in them: every deferred row waits


def watch_steps(monkeypatch) -> dict:
    """Record the batching loop's steps that carried a restoring sequence: ``steps`` (how many), ``missing`` (fed
    sequences whose decode row was left out of such a step), ``over`` (such steps with more rows than the budget)."""
    import torch

    from raincheck_hf.batch_engine import RowScheduler
    from raincheck_hf.batched import RestoringState
    from raincheck_hf.cache_utils import GENERATED

    schedule, seen = RowScheduler.schedule, {"steps": 0, "missing": [], "over": []}

    def watched(self, adapter, sequences):
        fed = [s for s in sequences if s.prefilled and s.token is not None]
        forwards = schedule(self, adapter, sequences)
        entries = [(s, g) for f in forwards for s, g in f]
        if any(isinstance(s, RestoringState) for s, _ in entries):
            seen["steps"] += 1
            tokens = {s for s, g in entries if int(torch.as_tensor(g.kinds)[-1]) == GENERATED}
            seen["missing"] += [s for s in fed if s not in tokens]
            rows = sum(len(g) for _, g in entries)
            if self.token_budget is not None and rows > self.token_budget:
                seen["over"].append(rows)
        return forwards

    monkeypatch.setattr(RowScheduler, "schedule", watched)
    return seen


def restored_held(base: str, step: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f'raincheck_restored_held_total{{step="{step}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"raincheck_restored_held_total{{step={step!r}}} not in /metrics")


def ask_turns(base, d, turns: int, texts: list[str], settings: dict):
    """Turn ``turns`` of dialogue ``d`` (its earlier answers ``texts``): the reply."""
    messages = [first_message(data_url(d.image()), d.turns[0].question)]
    for k in range(1, turns):
        messages += [{"role": "assistant", "content": texts[k - 1]}, {"role": "user", "content": d.turns[k].question}]
    return client(base).chat.completions.create(model="glyph", temperature=0, messages=messages,
                                                extra_body={"raincheck": settings})


@contextlib.contextmanager
def busy_batching_server(glyph, dialogue, max_running: int):
    """A batching server on the glyph model (64-row steps, 16-token answers) kept busy by a long streamed answer to
    ``dialogue``'s first question: ``(base url, server, the long stream)``."""
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = glyph
    app = create_app(model, processor, ServeSettings(model_name="glyph", max_tokens=16, max_running=max_running,
                                                     batching=True, max_batch_tokens=64))
    with running(app) as base:
        yield base, app.state.server, long_stream(base, data_url(dialogue.image()), dialogue.turns[0].question)


def test_held_conversations_restore_beside_a_running_answer(glyph, dialogues, monkeypatch):
    """A long answer keeps the loop busy (the idle-time restoration never runs). Two dialogues' first turns answer
    beside it, leaving every deferred row pending; their held conversations then restore in the spare budget of the
    long answer's steps, down to nothing while it still streams. In every step that carried a restoring sequence,
    every fed sequence's decode row ran and the step stayed within the budget. The follow-ups then find nothing to
    restore and every answer equals its conversation alone."""
    seen = watch_steps(monkeypatch)
    with busy_batching_server(glyph, dialogues[0], max_running=3) as (base, server, a):
        firsts = {i: ask_turns(base, dialogues[i], 1, [], GUARD16) for i in (1, 2)}
        convs = {i: server.store.get(r.model_extra["raincheck"]["conversation_id"]) for i, r in firsts.items()}
        deferred = {i: r.model_extra["raincheck"]["deferred"] for i, r in firsts.items()}
        assert all(n > 0 for n in deferred.values())
        assert all(r.model_extra["raincheck"]["restored_during"] == 0 for r in firsts.values())
        # the turns' figures (recorded under the conversation's lock with the restored cache), not the live count
        wait_for(lambda: all(c.turns[0].restored_after_answer == deferred[i] for i, c in convs.items()))
        assert server.scheduler.running == 1  # the long answer still streams
        for i, conv in convs.items():
            assert conv.turns[0].restored_after_answer == deferred[i] and conv.turns[0].pending == 0
        assert restored_held(base, "busy") == sum(deferred.values()) and restored_held(base, "idle") == 0
        assert seen["steps"] > 0 and seen["missing"] == [] and seen["over"] == []
        texts = {i: [r.choices[0].message.content] for i, r in firsts.items()}
        for i in (1, 2):
            follow = ask_turns(base, dialogues[i], 2, texts[i], GUARD16)
            assert follow.model_extra["raincheck"]["reused"]
            assert follow.model_extra["raincheck"]["restored_at_prefill"] == 0
            texts[i].append(follow.choices[0].message.content)
        assert server.scheduler.running == 1
        a.close()
        wait_for(lambda: server.scheduler.running == 0 and all(not e.sequences for e in server.scheduler._engines))
    for i in (1, 2):
        d = dialogues[i]
        assert texts[i] == reference(glyph, d.image(), [t.question for t in d.turns[:2]], decode_guard=16), i


def test_a_follow_up_takes_its_conversation_back_from_restoration(glyph, dialogues, monkeypatch):
    """A held conversation restores beside a long answer; after two pieces (of its idle chunk, 2 rows) its
    restoration is held back, and its follow-up arrives: the loop takes its cache back with those 4 rows restored
    before the turn joins, the turn prefills the rest ahead of its question, and answers as its conversation
    alone does."""
    gate = gate_restoring_pieces(monkeypatch, 2)  # only the first two steps' pieces
    seen = watch_steps(monkeypatch)
    settings = {**GUARD16, "chunk_size": 2}
    with busy_batching_server(glyph, dialogues[0], max_running=2) as (base, server, a):
        d = dialogues[3]
        first = ask_turns(base, d, 1, [], settings)
        conv = server.store.get(first.model_extra["raincheck"]["conversation_id"])
        deferred = first.model_extra["raincheck"]["deferred"]
        assert deferred > 4
        wait_for(lambda: gate["left"] == 0)
        assert conv in server.scheduler._restoring and conv.pending == deferred  # restoring, not yet taken back
        text = first.choices[0].message.content
        follow = ask_turns(base, d, 2, [text], settings)
        assert follow.model_extra["raincheck"]["restored_at_prefill"] == deferred - 4
        assert conv.turns[0].restored_after_answer == deferred  # 4 beside the long answer, the rest at the prefill
        assert restored_held(base, "busy") == 4 and restored_held(base, "idle") == 0
        assert seen["steps"] == 2 and seen["missing"] == []
        a.close()
        wait_for(lambda: server.scheduler.running == 0)
    assert [text, follow.choices[0].message.content] == reference(
        glyph, d.image(), [t.question for t in d.turns[:2]], chunk_size=2, decode_guard=16)


def watch_paths(monkeypatch) -> list:
    """Every forward the batching loop's engines run, in order: ``(path, restoring, decoding, prompt)``: ``path``
    "replay" (a captured step, `fast.batched_graphs.BatchedStepGraphs.launch`) or "eager" (`ForwardRunner.run`), and
    whether it carried a restoring sequence's piece, a fed token, a prompt piece."""
    import torch

    from raincheck_hf.batch_engine import ForwardRunner
    from raincheck_hf.batched import RestoringState
    from raincheck_hf.cache_utils import GENERATED, INPUT
    from raincheck_hf.fast.batched_graphs import BatchedStepGraphs

    log = []

    def watched(cls, path, name="run", entries_of=lambda entries: entries):
        run = getattr(cls, name)

        def logged(self, entries, *args):
            listed = entries_of(entries)
            kinds = [torch.as_tensor(g.kinds) for _, g in listed]
            log.append((path, any(isinstance(s, RestoringState) for s, _ in listed),
                        any(int(k[-1]) == GENERATED for k in kinds), any(bool((k == INPUT).any()) for k in kinds)))
            return run(self, entries, *args)

        monkeypatch.setattr(cls, name, logged)

    watched(ForwardRunner, "eager")
    watched(BatchedStepGraphs, "replay", "launch", lambda step: step.entries)  # (`run` is prepare + launch)
    return log


def test_held_conversations_restore_in_the_captured_decode_steps(glyph, dialogues, monkeypatch):
    """The server with captured batched decode steps (``fast_path=True``; on a CPU the same static-buffer step runs
    eagerly): while a long answer streams, two held conversations restore in its decode steps' spare budget down to
    nothing. Those steps carry the restoring pieces and are still replayed (every step without a prompt piece was;
    only the prompts' steps ran eagerly), no fed token was left out of a step and none went over the budget; the
    follow-ups find nothing to restore and every answer equals its conversation alone."""
    from raincheck_hf import RaincheckConfig
    from raincheck_hf.serve import ServeSettings, create_app, running

    seen, paths = watch_steps(monkeypatch), watch_paths(monkeypatch)
    model, processor = glyph
    app = create_app(model, processor, ServeSettings(model_name="glyph", config=RaincheckConfig(fast_path=True),
                                                     max_tokens=16, max_running=3, batching=True,
                                                     max_batch_tokens=64))
    with running(app) as base:
        server = app.state.server
        a = long_stream(base, data_url(dialogues[0].image()), dialogues[0].turns[0].question)
        firsts = {i: ask_turns(base, dialogues[i], 1, [], GUARD16) for i in (1, 2)}
        convs = {i: server.store.get(r.model_extra["raincheck"]["conversation_id"]) for i, r in firsts.items()}
        deferred = {i: r.model_extra["raincheck"]["deferred"] for i, r in firsts.items()}
        assert all(n > 0 for n in deferred.values())
        wait_for(lambda: all(c.pending == 0 for c in convs.values()))
        assert server.scheduler.running == 1  # the long answer still streams
        assert restored_held(base, "busy") == sum(deferred.values()) and restored_held(base, "idle") == 0
        assert all(e.graphs is not None for e in server.scheduler._engines)
        # restoring pieces beside the long answer's tokens, in replayed steps; eager steps only for prompt pieces
        assert sum(1 for p in paths if p == ("replay", True, True, False)) >= 2
        assert all(path == "replay" for path, _, _, prompt in paths if not prompt)
        assert seen["steps"] > 0 and seen["missing"] == [] and seen["over"] == []
        texts = {i: [r.choices[0].message.content] for i, r in firsts.items()}
        for i in (1, 2):
            follow = ask_turns(base, dialogues[i], 2, texts[i], GUARD16)
            assert follow.model_extra["raincheck"]["restored_at_prefill"] == 0
            texts[i].append(follow.choices[0].message.content)
        a.close()
        wait_for(lambda: server.scheduler.running == 0 and all(not e.sequences for e in server.scheduler._engines))
    for i in (1, 2):
        d = dialogues[i]
        assert texts[i] == reference(glyph, d.image(), [t.question for t in d.turns[:2]], decode_guard=16), i


def test_handoff_hands_a_steps_pieces_to_the_event_loop_in_one_call(batching_server):
    """`_Handoff`: pieces put from another thread wait until ``flush``, which delivers them all, in order, to their
    queues with one `call_soon_threadsafe` per event loop (not one per piece); the batching server's loop flushes
    it after each iteration."""
    from raincheck_hf.serve.app import _deliver, _Handoff

    _, server = batching_server
    assert server.scheduler.on_handoff == server.handoff.flush

    async def scenario():
        loop = asyncio.get_running_loop()
        wakes = []
        original = loop.call_soon_threadsafe

        def counted(callback, *args):  # the hand-off's wake-ups (asyncio.to_thread has its own)
            if callback is _deliver:
                wakes.append(args)
            return original(callback, *args)

        loop.call_soon_threadsafe = counted
        handoff, a, b = _Handoff(), asyncio.Queue(), asyncio.Queue()

        def producer():  # as the loop's thread: a step's tokens for two requests, then one's end
            for i in range(3):
                handoff.put(loop, a, ("text", f"a{i}"))
                handoff.put(loop, b, ("text", f"b{i}"))
            handoff.put(loop, a, ("end", None))

        await asyncio.to_thread(producer)
        await asyncio.sleep(0.05)
        assert a.empty() and b.empty() and not wakes  # nothing before the flush
        await asyncio.to_thread(handoff.flush)
        got_a = [await asyncio.wait_for(a.get(), 5) for _ in range(4)]
        got_b = [await asyncio.wait_for(b.get(), 5) for _ in range(3)]
        assert got_a == [("text", "a0"), ("text", "a1"), ("text", "a2"), ("end", None)]
        assert got_b == [("text", "b0"), ("text", "b1"), ("text", "b2")]
        assert len(wakes) == 1
        await asyncio.to_thread(handoff.flush)  # nothing left: no wake-up
        assert len(wakes) == 1

    asyncio.run(scenario())


def test_stop_strings_are_checked_on_the_host_after_the_read(batching_server, dialogues, monkeypatch):
    """OpenAI ``stop`` on the batching loop: the answer is cut where the string completes (finish_reason "stop",
    streamed and not, the same text), and the loop checks it on the host after its one read of the step's tokens
    (`raincheck_host_stop`), never through the criterion's call on the device's input_ids, which would wait for the
    device before the next step is prepared."""
    from test_serve import ask

    from raincheck_hf.serve import app as serve_app

    device_calls = []
    original = serve_app._StopStrings.__call__
    monkeypatch.setattr(serve_app._StopStrings, "__call__",
                        lambda self, *a, **kw: device_calls.append(1) or original(self, *a, **kw))
    base, _ = batching_server
    openai_client = client(base)
    d = dialogues[0]
    messages = [first_message(data_url(d.image()), d.turns[0].question)]
    full, _, _, _ = ask(openai_client, messages)
    words = full.split()
    assert len(words) > 3, full
    cut, _, _, finish = ask(openai_client, messages, stop=[" " + words[2]])
    assert finish == "stop" and full.startswith(cut) and len(cut) < len(full) and (" " + words[2]) not in cut
    streamed, _, _, finish = ask(openai_client, messages, stream=True, stop=[" " + words[2]])
    assert streamed == cut and finish == "stop"
    assert device_calls == []


def test_a_first_turn_short_of_device_memory_evicts_the_least_recently_used_conversation(batching_server, glyph,
                                                                                         dialogues, monkeypatch):
    """The device has too little memory for a new conversation's media (the loop's `_device_memory` one byte short
    of the turn's bytes and the headroom until something is evicted): before its media go to the device the loop
    asks the store to evict the least recently used idle conversation (`BatchScheduler._relieve_memory`), not the
    other one, and the answer equals the dialogue alone. Before, nothing was evicted: the preparation ran out of
    memory and the request failed."""
    base, server = batching_server
    loop = server.scheduler
    held = [ask_turns(base, dialogues[i], 1, [], GUARD16) for i in (0, 1)]
    ids = [r.model_extra["raincheck"]["conversation_id"] for r in held]
    before, asked = server.store.evictions, []
    evict_bytes = server.store.evict_bytes
    monkeypatch.setattr(server.store, "evict_bytes", lambda need: asked.append(need) or evict_bytes(need))
    monkeypatch.setattr(loop, "_turn_bytes", lambda job, inputs: 1)
    loop.memory_headroom = 1 << 30
    monkeypatch.setattr(loop, "_device_memory", lambda: loop.memory_headroom + (
        (1 << 40) if server.store.evictions > before else 0))
    d = dialogues[2]
    third = ask_turns(base, d, 1, [], GUARD16)
    assert asked == [1] and loop.memory_waits == 1
    assert server.store.evictions == before + 1 and server.store.get(ids[0]) is None  # (the least recently used)
    assert server.store.get(ids[1]) is not None
    assert [third.choices[0].message.content] == reference(glyph, d.image(), [d.turns[0].question], decode_guard=16)
    waits = [line for line in httpx.get(base + "/metrics").text.splitlines()
             if line.startswith("raincheck_memory_wait_seconds_count ")]
    assert waits == ["raincheck_memory_wait_seconds_count 1.0"]


def test_a_pool_growth_short_of_memory_in_a_step_evicts_a_held_conversation(batching_server, glyph, dialogues,
                                                                           monkeypatch):
    """The server end to end: a step whose batched pool grows (a three-picture prompt longer than its slots) finds no
    device memory for a layer; the pool asks the loop (`kv_pool.SlotKVPool.on_short`), whose server evicts the least
    recently used idle conversations (`BatchScheduler._relieve_memory`, from inside the step on the loop's thread)
    until they held what the growth needs, and grows again: the answer equals its dialogue alone, and an evicted
    conversation's follow-up prefills its dialogue again and is still right."""
    from conftest import failing_slot_resize
    from raincheck_hf import Conversation, RaincheckConfig

    base, server = batching_server
    held = [ask_turns(base, dialogues[i], 1, [], {}) for i in (0, 1)]  # (the default config: its engine stays)
    ids = [r.model_extra["raincheck"]["conversation_id"] for r in held]
    (engine,) = server.scheduler._engines
    assert engine.pool.capacity < 3 * held[0].usage.prompt_tokens  # (the three pictures' prompt outgrows its slots)
    capacity, before = engine.pool.capacity, server.store.evictions
    held_bytes = {i: server.store.get(i).nbytes() for i in ids}
    asked = []
    failed = failing_slot_resize(monkeypatch, lambda layer, slots, size: layer.layer_idx == 1 and not failed)
    evict_bytes = server.store.evict_bytes
    monkeypatch.setattr(server.store, "evict_bytes", lambda need: asked.append(need) or evict_bytes(need))
    d, pictures = dialogues[2], [dialogues[i].image() for i in (2, 3, 1)]
    content = [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in pictures]
    reply = client(base).chat.completions.create(
        model="glyph", temperature=0,
        messages=[{"role": "user", "content": content + [{"type": "text", "text": d.turns[0].question}]}])
    assert failed == [1] and len(asked) == 1 and asked[0] > 0, (failed, asked)
    assert engine.pool.capacity > capacity  # (the step's growth went through after the eviction)
    # the least recently used first, until what they held reaches what the growth needs (here both: the pool's
    # slots double for every place at once)
    gone = next((n for n in (1, 2) if sum(held_bytes[i] for i in ids[:n]) >= asked[0]), 2)
    assert server.store.evictions == before + gone
    assert [server.store.get(i) is None for i in ids] == [True] * gone + [False] * (2 - gone)
    model, processor = glyph
    with Conversation(model, processor, RaincheckConfig(),
                                   background=False) as chat:
        want = chat.ask(d.turns[0].question, images=pictures, max_new_tokens=16).text
    assert reply.choices[0].message.content == want
    d0 = dialogues[0]
    follow = ask_turns(base, d0, 2, [held[0].choices[0].message.content], {})
    assert not follow.model_extra["raincheck"]["reused"]  # (evicted: its dialogue prefilled again)
    assert [held[0].choices[0].message.content, follow.choices[0].message.content] == reference(
        glyph, d0.image(), [t.question for t in d0.turns[:2]])


def test_no_memory_for_an_ended_answers_cache_evicts_held_conversations(batching_server, glyph, dialogues,
                                                                         monkeypatch):
    """The device has no memory for the cache of an answer that ended (copied out of the batched pool): the loop
    asks the store to evict the least recently used idle conversations holding at least its rows' bytes, copies it
    again, and the answer comes back whole and equal to its conversation alone; the evicted conversation's
    follow-up then prefills its dialogue again and is still right. With nothing to evict, the answer still comes
    back and its conversation is let go (not held: its follow-up prefills again)."""
    import torch

    base, server = batching_server
    held = [ask_turns(base, dialogues[i], 1, [], GUARD16) for i in (0, 1)]
    ids = [r.model_extra["raincheck"]["conversation_id"] for r in held]
    before = server.store.evictions
    failures = fail_remove_many(monkeypatch, lambda: torch.OutOfMemoryError("CUDA out of memory (a test's)"))
    asked = []
    evict_bytes = server.store.evict_bytes
    monkeypatch.setattr(server.store, "evict_bytes", lambda need: asked.append(need) or evict_bytes(need))
    d = dialogues[2]
    third = ask_turns(base, d, 1, [], GUARD16)
    assert failures["left"] == 0 and len(asked) == 1 and asked[0] > 0
    assert server.store.evictions == before + 1 and server.store.get(ids[0]) is None  # (the least recently used)
    assert server.store.get(ids[1]) is not None
    assert [third.choices[0].message.content] == reference(glyph, d.image(), [d.turns[0].question], decode_guard=16)
    d0 = dialogues[0]
    follow = ask_turns(base, d0, 2, [held[0].choices[0].message.content], GUARD16)
    assert not follow.model_extra["raincheck"]["reused"]  # (its conversation was evicted: prefilled again)
    assert [held[0].choices[0].message.content, follow.choices[0].message.content] == reference(
        glyph, d0.image(), [t.question for t in d0.turns[:2]], decode_guard=16)
    # nothing left to evict (the copy fails again after eviction too): the answer still comes back whole, and its
    # conversation is let go, as if evicted; its follow-up prefills the dialogue again and is still right
    monkeypatch.setattr(server.store, "evict_bytes", lambda need: 0)
    failures["left"] = 1
    evictions = server.store.evictions
    d3, full = dialogues[3], {"mode": "full"}  # (in full mode one prefill of the history answers as a kept cache)
    first = ask_turns(base, d3, 1, [], full)
    assert failures["left"] == 0 and server.store.evictions == evictions + 1
    assert server.store.get(first.model_extra["raincheck"]["conversation_id"]) is None
    follow = ask_turns(base, d3, 2, [first.choices[0].message.content], full)
    assert not follow.model_extra["raincheck"]["reused"]
    assert [first.choices[0].message.content, follow.choices[0].message.content] == reference(
        glyph, d3.image(), [t.question for t in d3.turns[:2]], mode="full")
