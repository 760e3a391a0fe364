"""The server under load: admission control (running places, a FIFO queue, 429 with Retry-After), clients
that go away (queued or generating), the load metrics, and a soak test of concurrent multi-turn clients on the
bundled glyph Qwen3-VL (127.0.0.1, the official `openai` client), every completed answer checked against its
conversation run alone."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import sys
import threading
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

import raincheck_hf  # noqa: E402
from raincheck_hf.quality.glyphs import benchmark_split  # noqa: E402
from raincheck_hf.serve.admission import Admission, ClientGone  # noqa: E402
from raincheck_hf.serve.errors import APIError  # noqa: E402

from conftest import serve_settings  # noqa: E402
from test_serve import data_url, first_message, wait_for  # noqa: E402
from test_serve import reference as serve_reference  # noqa: E402

LONG = 4000  # min_tokens of an answer that only a cancellation ends early


@pytest.fixture(scope="module")
def dialogues():
    return benchmark_split("dev", limit=4)


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def reference(glyph, image, questions, mode="raincheck", max_new_tokens=16, **settings) -> list[str]:
    """test_serve's reference, at the 16 tokens of this file's servers."""
    return serve_reference(glyph, image, questions, max_new_tokens, mode, **settings)


# ---- the admission control on its own -------------------------------------------------------------------

def test_admission_is_fifo_bounded_and_passes_places_on():
    async def scenario():
        admission = Admission(max_running=1, max_queue=2)
        never = _never_gone
        a = admission.reserve()
        await a.run(never)  # a free place: granted at once
        b, c = admission.reserve(), admission.reserve()
        with pytest.raises(APIError) as refused:
            admission.reserve()
        error = refused.value
        assert error.status == 429 and error.code == "queue_full" and error.type == "rate_limit_error"
        assert "--max-running 1" in error.message and "--max-queue 2" in error.message
        assert int(error.headers["Retry-After"]) >= 1
        order = []

        async def run(ticket, name):
            await ticket.run(never, poll=0.01)
            order.append(name)

        tasks = [asyncio.create_task(run(b, "b")), asyncio.create_task(run(c, "c"))]
        await asyncio.sleep(0.05)
        now = admission.snapshot()
        assert order == [] and (now["running"], now["queued"], now["waiting"]) == (1, 2, 2)
        a.release()
        a.release()  # idempotent
        await asyncio.sleep(0.05)
        assert order == ["b"]  # first come, first served; one place
        b.release()
        await asyncio.gather(*tasks)
        assert order == ["b", "c"]
        c.release()
        assert admission.snapshot()["running"] == admission.snapshot()["queued"] == 0
        assert admission.snapshot()["rejected"] == 1

    asyncio.run(scenario())


async def _never_gone():
    return False


def test_a_queued_ticket_whose_client_goes_away_leaves_the_queue():
    async def scenario():
        admission = Admission(max_running=1, max_queue=1)
        a = admission.reserve()
        await a.run(_never_gone)
        b = admission.reserve()
        gone = asyncio.Event()

        async def disconnected():
            return gone.is_set()

        task = asyncio.create_task(b.run(disconnected, poll=0.01))
        await asyncio.sleep(0.03)
        gone.set()
        with pytest.raises(ClientGone):
            await task
        now = admission.snapshot()
        assert now["queued"] == 0 and now["waiting"] == 0 and now["abandoned"] == 1 and now["running"] == 1
        admission.reserve()  # its queue place is free again
        a.release()

    asyncio.run(scenario())


def test_retry_after_follows_the_recent_turns():
    admission = Admission(max_running=2, max_queue=0)
    assert admission.retry_after() == 1  # nothing measured, nothing running
    admission._durations.extend([6.0, 10.0])  # two turns of 8 s on average, two places: one ends every ~4 s
    assert admission.retry_after() == 4


@pytest.mark.parametrize("field,value", [("max_running", 0), ("max_running", 1.5), ("max_queue", -1),
                                         ("max_queue", True)])
def test_settings_reject_bad_load_values(field, value):
    from raincheck_hf.serve import ServeSettings

    with pytest.raises(ValueError, match=f"{field} must be an integer"):
        ServeSettings(**{field: value})


@pytest.mark.parametrize("argv,message", [(["--max-running", "0"], "--max-running must be an integer >= 1, got 0"),
                                          (["--max-queue", "-3"], "--max-queue must be an integer >= 0, got -3"),
                                          (["--max-prompt-forwards", "0"], "--max-prompt-forwards must be an integer "
                                           ">= 1, got 0 (unset: as many as the step's token budget gives)"),
                                          (["--max-preparing", "0"], "--max-preparing must be an integer >= 1, got 0 "
                                           "(None, 'all' on the command line: every request's turn prepared at "
                                           "once)"),
                                          (["--restoring-places", "-1"], "--restoring-places must be an integer >= 0 "
                                           "(or None: the default), got -1")])
def test_cli_load_options_are_checked_and_named(argv, message):
    with pytest.raises(ValueError) as error:
        serve_settings(argv)
    assert str(error.value) == message
    settings = serve_settings(["--max-running", "2", "--max-queue", "0", "--max-prompt-forwards", "2",
                               "--max-preparing", "3"])
    assert (settings.max_running, settings.max_queue, settings.max_prompt_forwards, settings.max_preparing) == (
        2, 0, 2, 3)
    assert serve_settings([]).max_prompt_forwards is None
    assert serve_settings([]).max_cache_bytes is None
    assert serve_settings(["--max-cache-gb", "none"]).max_cache_bytes is None
    assert serve_settings(["--max-cache-gb", "1.5"]).max_cache_bytes == 3 << 29
    for bad in ("-1", "inf"):
        with pytest.raises(ValueError, match=rf"--max-cache-gb must be >= 0, 'auto' or 'none', got {bad}"):
            serve_settings(["--max-cache-gb", bad])
    with pytest.raises(SystemExit):
        serve_settings(["--max-cache-gb", "lots"])
    assert serve_settings([]).restoring_places is None and serve_settings(["--restoring-places", "0"]).batch_places == 4
    assert serve_settings([]).max_preparing == 1 and serve_settings(["--max-preparing", "all"]).max_preparing is None
    with pytest.raises(SystemExit):  # argparse's own error for a value that is neither
        serve_settings(["--max-preparing", "some"])
    assert serve_settings([]).prepare_priority == "normal"
    assert serve_settings(["--prepare-priority", "high"]).prepare_priority == "high"
    with pytest.raises(SystemExit):
        serve_settings(["--prepare-priority", "urgent"])
    from raincheck_hf.serve import ServeSettings

    with pytest.raises(ValueError, match="prepare_priority must be 'normal' or 'high', got 'urgent'"):
        ServeSettings(prepare_priority="urgent")


# ---- through HTTP -----------------------------------------------------------------------------------------

@pytest.fixture()
def small_server(glyph):
    """One running place, one queue place."""
    from raincheck_hf.serve import ServeSettings, create_app, running

    model, processor = glyph
    app = create_app(model, processor, ServeSettings(model_name="glyph", max_tokens=16, max_running=1, max_queue=1))
    with running(app) as base:
        yield base, app.state.server


def _long_stream(base, image_url, question):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="glyph", messages=[first_message(image_url, question)], stream=True,
                                            temperature=0, max_tokens=LONG, extra_body={"min_tokens": LONG})
    for chunk in stream:  # the first piece: it is generating
        if any(c.delta.content for c in chunk.choices):
            return stream
    raise AssertionError("the stream ended without text")


def test_full_queue_gets_429_and_a_disconnect_frees_the_running_place(small_server, glyph, dialogues):
    """A generates (the one running place), B waits (the one queue place), C is refused at once with 429,
    Retry-After and OpenAI's error body; A's client goes away mid-stream: its turn stops, its conversation
    stays consistent, and B gets the place and answers as its conversation alone does."""
    base, server = small_server
    d, e = dialogues[0], dialogues[1]
    a = _long_stream(base, data_url(d.image()), d.turns[0].question)
    got = {}

    def queued():
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="glyph", temperature=0,
                                               messages=[first_message(data_url(e.image()), e.turns[0].question)])
        got["b"] = reply.choices[0].message.content

    b = threading.Thread(target=queued)
    b.start()
    wait_for(lambda: server.admission.snapshot()["waiting"] == 1)
    assert metric(base, "raincheck_queue_length") == 1 and metric(base, "raincheck_running") == 1
    began = time.monotonic()
    refused = httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": "glyph", "messages": [{"role": "user", "content": "Hello"}]})
    assert time.monotonic() - began < 30  # answered, not held until a place frees
    assert refused.status_code == 429
    retry = refused.headers["retry-after"]
    assert retry.isdigit() and int(retry) >= 1
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    assert "--max-queue 1" in error["message"] and "--max-running 1" in error["message"]
    # the official client sees a RateLimitError (no retry: max_retries=0)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="glyph", messages=[{"role": "user", "content": "Hello"}])
    assert "b" not in got  # still waiting behind A
    a.close()  # A's client goes away: its turn stops at the next token and B runs
    b.join(timeout=120)
    assert got["b"] == reference(glyph, e.image(), [e.turns[0].question])[0]
    wait_for(lambda: server.admission.snapshot()["running"] == 0)
    (conv,) = [server.store.get(i) for i in server.store.ids()
               if server.store.get(i).turns and server.store.get(i).turns[0].cancelled]
    assert conv.cache.source_length == conv.sequences.shape[1] - 1  # consistent, held, continuable
    assert 1 <= conv.turns[0].token_ids.numel() < LONG
    assert metric(base, "raincheck_rejected_total") == 2 and metric(base, "raincheck_cancelled_total") == 1
    assert metric(base, 'raincheck_requests_total{endpoint="/v1/chat/completions",status="429"}') == 2
    assert metric(base, "raincheck_queue_wait_seconds_count") == 2  # A and B got places


def test_a_queued_request_whose_client_goes_away_leaves_the_queue(small_server, dialogues):
    base, server = small_server
    d = dialogues[2]
    a = _long_stream(base, data_url(d.image()), d.turns[0].question)
    held = set(server.store.ids())
    with pytest.raises(httpx.TimeoutException):  # waits for a place, then gives up and closes the connection
        httpx.post(base + "/v1/chat/completions", timeout=0.5, json={
            "model": "glyph", "messages": [first_message(data_url(d.image()), d.turns[1].question)]})
    wait_for(lambda: server.admission.snapshot()["abandoned"] == 1)
    now = server.admission.snapshot()
    assert now["queued"] == now["waiting"] == 0 and now["running"] == 1
    assert set(server.store.ids()) == held  # it never started a conversation
    assert metric(base, "raincheck_queue_abandoned_total") == 1
    a.close()
    wait_for(lambda: server.admission.snapshot()["running"] == 0)


def test_load_metrics_are_exposed(small_server, dialogues):
    base, server = small_server
    before = metric(base, "raincheck_completion_tokens_total")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="glyph", temperature=0, max_tokens=7, extra_body={"min_tokens": 7},
                                           messages=[{"role": "user", "content": dialogues[0].turns[1].question}])
    assert reply.usage.completion_tokens == 7
    text = httpx.get(base + "/metrics").text
    for name in ("# TYPE raincheck_queue_length gauge", "# TYPE raincheck_running gauge",
                 "# TYPE raincheck_ttft_seconds histogram", "# TYPE raincheck_tpot_seconds histogram",
                 "# TYPE raincheck_queue_wait_seconds histogram", "# TYPE raincheck_rejected_total counter",
                 "# TYPE raincheck_completion_tokens_total counter", "# TYPE raincheck_queue_abandoned_total counter"):
        assert name in text, name
    assert metric(base, "raincheck_completion_tokens_total") == before + 7
    assert metric(base, "raincheck_tpot_seconds_count") >= 6


# ---- soak: concurrent multi-turn clients ------------------------------------------------------------------

def soak(model, processor, dialogues, clients: int, running_places: int, answer: int, config=None,
         dialogues_per_client: int = 2, duration_s: float | None = None, budget_conversations: int = 3,
         batching: bool = False, max_batch_tokens: int = 2048) -> dict:
    """``clients`` concurrent clients on one server, each running three-turn image dialogues (raincheck or full
    mode, streamed or not; every fifth client cancels every other dialogue mid-stream at turn 2, from its first
    or its second),
    ``dialogues_per_client`` of them, or as many as start within ``duration_s``. The server: ``running_places``,
    a queue that holds every client, a cache budget of ``budget_conversations`` conversations (so conversations
    are evicted and rebuilt). Checks: every completed answer equals its conversation run alone (`Conversation`,
    greedy; a raincheck dialogue from a follow-up whose conversation was evicted on: the same requests sent alone
    to the server with nothing held, the full prefill it then is; in full mode that prefill answers as the
    continued cache does); no 5xx and no 429 (nothing but 200 from the chat route); never more than
    ``running_places`` turns at once; the held caches within the budget once idle and, during the run, within it
    plus the conversations answering. ``batching``: the server's batching loop (`ServeSettings.batching`) with
    ``max_batch_tokens`` rows per step. Returns the figures."""
    from raincheck_hf.serve import ServeSettings, create_app, running
    from raincheck_hf.serve.store import cache_nbytes

    config = config or raincheck_hf.RaincheckConfig()
    modes = ("raincheck", "full")
    refs, biggest = {}, 0
    for i, d in enumerate(dialogues):
        questions = [t.question for t in d.turns[:3]]
        for mode in modes:
            moded = dataclasses.replace(config, mode=mode)
            with raincheck_hf.Conversation(model, processor, moded, background=False) as chat:
                refs[i, mode] = [chat.ask(q, images=[d.image()] if k == 0 else [], max_new_tokens=answer).text
                                 for k, q in enumerate(questions)]
                biggest = max(biggest, cache_nbytes(chat.cache))
    budget = budget_conversations * biggest
    urls = {i: data_url(d.image()) for i, d in enumerate(dialogues)}
    settings = ServeSettings(model_name="glyph", config=config, max_tokens=answer, max_running=running_places,
                             max_queue=clients, max_cache_bytes=budget, batching=batching,
                             max_batch_tokens=max_batch_tokens)
    app = create_app(model, processor, settings)
    server = app.state.server
    records, errors, statuses = [], [], []
    done = threading.Event()
    watch = {"running": 0, "busy": 0, "bytes": 0, "queued": 0}
    memory = []  # (seconds since the clients started, the process's resident MB, the device's allocated MB)
    deadline = None if duration_s is None else time.monotonic() + duration_s

    def watcher():
        started, sampled = time.monotonic(), 0.0
        while not done.is_set():
            adm, store = server.admission.snapshot(), server.store.snapshot()
            watch["running"] = max(watch["running"], adm["running"])
            watch["queued"] = max(watch["queued"], adm["queued"])
            watch["busy"] = max(watch["busy"], store["busy"])
            watch["bytes"] = max(watch["bytes"], store["cache_bytes"])
            now = time.monotonic() - started
            if now - sampled >= 0.25:
                memory.append((now, resident_mb(), device_allocated_mb(model)))
                sampled = now
            time.sleep(0.005)

    def client_run(c, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            j = 0
            while (j < dialogues_per_client) if deadline is None else (j == 0 or time.monotonic() < deadline):
                i, mode, stream = (c + j) % len(dialogues), modes[(c + j + c // 4) % 2], (c + j) % 3 != 0
                cancel_at = 1 if (c % 5 == 4 and j % 2 == (c // 5) % 2) else None
                messages, run = [], []
                records.append(("dialogue", i, mode, run))
                for k, turn in enumerate(dialogues[i].turns[:3]):
                    messages.append(first_message(urls[i], turn.question) if k == 0
                                    else {"role": "user", "content": turn.question})
                    extra = {"raincheck": {"mode": mode}}
                    if k == cancel_at:
                        s = client.chat.completions.create(model="glyph", messages=messages, stream=True,
                                                           temperature=0, max_tokens=LONG,
                                                           extra_body={**extra, "min_tokens": LONG})
                        for chunk in s:
                            if any(ch.delta.content for ch in chunk.choices):
                                break
                        s.close()
                        records.append(("cancelled", c))
                        break
                    if stream:
                        pieces, rc = [], None
                        for chunk in client.chat.completions.create(model="glyph", messages=messages, stream=True,
                                                                    temperature=0, extra_body=extra):
                            pieces += [ch.delta.content or "" for ch in chunk.choices]
                            rc = (chunk.model_extra or {}).get("raincheck", rc)
                        text = "".join(pieces)
                    else:
                        reply = client.chat.completions.create(model="glyph", messages=messages, temperature=0,
                                                               extra_body=extra)
                        text, rc = reply.choices[0].message.content, reply.model_extra["raincheck"]
                    run.append((text, rc["reused"], [dict(m) for m in messages]))
                    messages.append({"role": "assistant", "content": text})
                j += 1
        except openai.APIStatusError as error:
            statuses.append(error.status_code)
        except BaseException as error:  # surfaced below
            errors.append(error)

    with running(app) as base:
        watching = threading.Thread(target=watcher, daemon=True)
        watching.start()
        threads = [threading.Thread(target=client_run, args=(c, base)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_for(lambda: server.admission.snapshot()["running"] == 0 and server.store.snapshot()["busy"] == 0)
        done.set()
        watching.join()
        assert not errors and not statuses, (errors[:3], statuses[:10])
        # the clients' tokens and the batching loop's steps (before the replays below add their own)
        completion_tokens = metric(base, "raincheck_completion_tokens_total")
        steps = None if server.scheduler is None else server.scheduler.steps
        requests_by_status = {}
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith('raincheck_requests_total{endpoint="/v1/chat/completions"'):
                status = line.split('status="')[1].split('"')[0]
                requests_by_status[status] = float(line.rsplit(" ", 1)[1])
        runs = [r[1:] for r in records if r[0] == "dialogue"]
        cancelled = [r for r in records if r[0] == "cancelled"]
        answered = sum(len(run) for _, _, run in runs)
        assert answered + len(cancelled) == requests_by_status.get("200"), requests_by_status
        assert set(requests_by_status) == {"200"}, requests_by_status  # no 5xx, no 429, nothing else
        assert metric(base, "raincheck_cancelled_total") == len(cancelled)
        # bounded: the places, the held caches (idle: within the budget; the answering ones on top)
        assert watch["running"] <= running_places and watch["busy"] <= running_places
        assert server.store.snapshot()["cache_bytes"] <= budget
        assert watch["bytes"] <= budget + running_places * 2 * biggest, (watch, budget)
        # every completed answer equals its conversation run alone. A dialogue is answered by one held conversation
        # from its first turn, or, after its conversation was evicted, by a rebuilt one from the follow-up that
        # found it gone (`reused` false): in full mode that prefill answers as the continued cache does, in
        # raincheck mode it defers the image's tokens anew, so from there the reference is the same requests sent
        # alone to the server with nothing held.
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        replayed = set()
        for i, mode, run in runs:
            starts = [k for k, (_, reused, _) in enumerate(run) if k == 0 or not reused]
            library = len(run) if mode == "full" else (starts + [len(run)])[1] if len(starts) > 1 else len(run)
            assert [text for text, _, _ in run[:library]] == refs[i, mode][:library], (i, mode)
            for j, end in zip(starts, starts[1:] + [len(run)]):
                key = (mode, json.dumps(run[end - 1][2]))
                if j < library or key in replayed:
                    continue
                replayed.add(key)
                server.store.close()  # alone: nothing held, as the evicted conversation's follow-up found it
                for k in range(j, end):
                    text, _, messages = run[k]
                    alone = client.chat.completions.create(model="glyph", messages=messages, temperature=0,
                                                           extra_body={"raincheck": {"mode": mode}})
                    assert alone.model_extra["raincheck"]["reused"] == (k > j)
                    assert alone.choices[0].message.content == text, (i, mode, k)
    return {"answered": answered, "cancelled": len(cancelled), "dialogues": len(runs), "replayed": len(replayed),
            "evictions": server.store.evictions, "budget": budget, "completion_tokens": completion_tokens,
            "steps": steps,
            "restored_busy": None if server.scheduler is None else server.scheduler.restored_busy,
            "restored_idle": None if server.scheduler is None else server.scheduler.restored_idle,
            "memory": memory_halves(memory), **{f"max_{k}": v for k, v in watch.items()}}


def resident_mb() -> float | None:
    """This process's resident memory in MB (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def device_allocated_mb(model) -> float | None:
    """The CUDA memory held by live tensors on the model's device in MB (None off CUDA)."""
    device = next(model.parameters()).device
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def memory_halves(samples: list) -> dict:
    """The largest resident and device-allocated MB over the first and the second half of ``samples`` taken after the
    first quarter of the run (its warm-up: the first dialogues' caches, graphs and pools), and how many samples."""
    if not samples:
        return {"samples": 0}
    end = samples[-1][0]
    after = [s for s in samples if s[0] >= end / 4]
    first, second = after[:len(after) // 2], after[len(after) // 2:]

    def most(part, i):
        values = [s[i] for s in part if s[i] is not None]
        return max(values) if values else None

    return {"samples": len(samples), "seconds": end,
            "resident_mb": [most(first, 1), most(second, 1)], "device_mb": [most(first, 2), most(second, 2)]}


def test_soak_concurrent_clients_equal_their_conversations_alone(glyph, dialogues):
    """14 clients at once, two three-turn dialogues each, four running places (see `soak`)."""
    model, processor = glyph
    figures = soak(model, processor, dialogues, clients=14, running_places=4, answer=16)
    assert figures["cancelled"] == 14 // 5 and figures["answered"] == 6 * 14 - 2 * figures["cancelled"]
    assert figures["evictions"] > 0 and figures["max_running"] == 4  # the budget and the places were reached
    assert figures["memory"]["samples"] > 0 and all(v is not None for v in figures["memory"]["resident_mb"])


def test_memory_halves_compare_the_run_after_its_first_quarter():
    samples = [(0.0, 900.0, 10.0), (1.0, 100.0, 5.0), (2.0, 110.0, 6.0), (3.0, 120.0, 7.0), (4.0, 105.0, 8.0)]
    # after the first quarter (from 1.0 s): [1.0, 2.0] and [3.0, 4.0]; the warm-up's 900 MB left out
    assert memory_halves(samples) == {"samples": 5, "seconds": 4.0, "resident_mb": [110.0, 120.0],
                                      "device_mb": [6.0, 8.0]}
    assert memory_halves([(0.0, 1.0, None), (1.0, 2.0, None)])["device_mb"] == [None, None]
    assert memory_halves([]) == {"samples": 0}


def test_server_overhead_takes_medians_of_the_first_turns_and_splits_the_difference():
    """`serve_load.overhead`: the server's and the library's first-turn TTFT / TPOT as medians over their dialogues
    (later turns and a missing TPOT left out), their differences and ratios, and the server's part split into the
    client's request and response (TTFT less the server's own clock) and what the server did (its clock less the
    library's TTFT)."""
    from raincheck_hf.bench.serve_load import overhead

    served = [[{"ttft_s": t, "tpot_s": p, "server_t1_s": c}, {"ttft_s": 9.0, "tpot_s": 9.0, "server_t1_s": 9.0}]
              for t, p, c in ((0.100, 0.010, 0.090), (0.120, None, 0.100), (0.110, 0.012, 0.104))]
    runs = [[{"ttft_s": t, "tpot_s": p}, {"ttft_s": 5.0, "tpot_s": 5.0}] for t, p in ((0.080, 0.009), (0.084, 0.011))]
    got = overhead(served, runs)
    assert got["rounds"] == {"server": 3, "library": 2}
    assert got["server_ttft_s"] == pytest.approx(0.110) and got["library_ttft_s"] == pytest.approx(0.082)
    assert got["server_tpot_s"] == pytest.approx(0.011) and got["library_tpot_s"] == pytest.approx(0.010)
    assert got["ttft_s"] == pytest.approx(0.028) and got["ttft_ratio"] == pytest.approx(0.110 / 0.082)
    assert got["client_http_s"] == pytest.approx(0.110 - 0.100) and got["in_server_s"] == pytest.approx(0.100 - 0.082)
    assert got["client_http_s"] + got["in_server_s"] == pytest.approx(got["ttft_s"])
    assert "client_floor_s" not in got
    split = overhead(served, runs, {"client_s": 0.004})  # (what the client's part costs against a server at once)
    assert split["client_floor_s"] == 0.004 and split["server_http_s"] == pytest.approx(0.110 - 0.100 - 0.004)
    assert "client_floor_s" not in overhead(served, runs, {"error": "ConnectError: refused"})  # (a failed floor)


def test_serve_load_benchmark_smoke(tmp_path):
    """`python -m raincheck_hf.bench serve-load` on the tiny model, two client counts: the JSON's structure,
    answers of the requested length, reuse on the follow-ups, the plot."""
    pytest.importorskip("matplotlib")
    from raincheck_hf.bench import serve_load

    path = tmp_path / "load.json"
    serve_load.run(model_name="tiny_qwen3_vl", clients=(1, 2), modes=("raincheck", "full"), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, json_path=str(path), plot_path=str(tmp_path / "load.png"),
                   log=lambda *a: None)
    saved = json.loads(path.read_text())
    assert saved["benchmark"] == "serve-load" and saved["hardware"]["torch"]
    assert [(r["mode"], r["clients"]) for r in saved["rows"]] == [("raincheck", 1), ("raincheck", 2), ("full", 1),
                                                                   ("full", 2)]
    for row in saved["rows"]:
        assert row["completion_tokens"] == row["clients"] * (4 + 3 + 3) and row["errors"] == 0
        assert row["output_tokens_per_s"] > 0 and row["reused_follow_ups"] == 2 * row["clients"]
        for key in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s"):
            assert row[key] > 0, key
        assert row["ttft_p95_s"] >= row["ttft_p50_s"] and "loop" not in row  # (a thread per turn: no loop)
    for mode in ("raincheck", "full"):
        lib = saved["library"][mode]
        assert lib["ttft_s"] > 0 and lib["tpot_s"] > 0 and saved["overhead"][mode]["ttft_s"] is not None
        # (medians of three dialogues each side: the one-client round's, two more not counted as rows)
        assert len(lib["rounds"]) == 3 and saved["overhead"][mode]["rounds"] == {"server": 3, "library": 3}
        assert len(saved["server_one_client_rounds"][mode]) == 3 and saved["settings"]["overhead_dialogues"] == 3
        assert saved["overhead"][mode]["client_http_s"] > 0
        assert saved["overhead"][mode]["client_floor_s"] == saved["client_floor"]["client_s"]
    floor = saved["client_floor"]  # (the same first request to a server that answers it at once)
    assert floor["requests"] == serve_load.FLOOR_REPEATS - 1 and floor["ttft_s"] > floor["client_s"] > 0
    assert floor["ttft_s"] == pytest.approx(floor["in_app_s"] + floor["client_s"], rel=0.5)
    assert saved["jpeg_decode_s"] > 0
    assert (tmp_path / "load.png").stat().st_size > 0
    with pytest.raises(ValueError, match="clients"):
        serve_load.run(clients=(0,))
    for bad in (0, -1.0, 2.0, True, "0.001", (), (0.001, 0.001), (0.001, 0)):
        with pytest.raises(ValueError, match="switch_interval must be"):
            serve_load.run(clients=(1,), switch_interval=bad)
    for bad in (0, -2, 1.5, True, None, "3"):
        with pytest.raises(ValueError, match=f"overhead_dialogues must be an integer >= 1, got {bad!r}"):
            serve_load.run(clients=(1,), overhead_dialogues=bad)


def test_a_failed_client_floor_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    """The requests to the server answering at once are an extra figure: when they fail, the run records the error
    and still measures the library and the overhead (without the floor's split)."""
    from raincheck_hf.bench import serve_load

    def refused(pool, task):
        raise RuntimeError("the requests to a server answering at once failed: ['ConnectError']")

    monkeypatch.setattr(serve_load, "measure_client_floor", refused)
    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(1,), modes=("raincheck",), answer_tokens=3,
                   follow_up_tokens=2, warmup=False, json_path=str(path), log=lines.append)
    saved = json.loads(path.read_text())
    assert "ConnectError" in saved["client_floor"]["error"] and any("answering at once failed" in x for x in lines)
    assert saved["library"]["raincheck"]["ttft_s"] > 0 and saved["overhead"]["raincheck"]["client_http_s"] > 0
    assert "client_floor_s" not in saved["overhead"]["raincheck"]


def test_serve_load_compares_switch_intervals_side_by_side(tmp_path):
    """``switch_interval`` with several values (``--switch-interval 0.0005,default``): each client count's rounds
    under each, in turn, each row with its interval and series; the interpreter's own interval put back after."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    before = sys.getswitchinterval()
    serve_load.run(model_name="tiny_qwen3_vl", clients=(1,), modes=("raincheck",), answer_tokens=3,
                   follow_up_tokens=2, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, switch_interval=(0.0005, None), rounds=2)
    saved = json.loads(path.read_text())
    assert saved["settings"]["switch_interval_s"] == [pytest.approx(0.0005), pytest.approx(before)]
    got = [(row["round"], row["switch_interval_s"]) for row in saved["rows"]]
    assert got == [(0, pytest.approx(0.0005)), (0, pytest.approx(before)), (1, pytest.approx(before)),
                   (1, pytest.approx(0.0005))]  # (every other round in reverse order)
    assert {row["series"] for row in saved["rows"]} == {"raincheck, switch interval 0.5 ms",
                                                        f"raincheck, switch interval {1e3 * before:g} ms"}
    assert len(saved["medians"]) == 2 and all(row["errors"] == 0 for row in saved["rows"])
    assert sys.getswitchinterval() == before
    assert serve_load._intervals("0.0005, default") == (0.0005, None)


def test_serve_load_benchmark_drives_the_batching_loop(tmp_path):
    """``--batching``: the same dialogues through the server's continuous-batching loop; every answer of the
    requested length, follow-ups reuse their conversations, the setting is recorded; the row has the loop's step
    figures over its round (steps by kind adding up, a join per turn, its last steps) and the log a line of them."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    before = sys.getswitchinterval()
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, switch_interval=0.001)
    saved = json.loads(path.read_text())
    assert saved["settings"]["batching"] is True and saved["settings"]["client_processes"] is True
    assert saved["settings"]["switch_interval_s"] == [pytest.approx(0.001)] and sys.getswitchinterval() == before
    (row,) = saved["rows"]
    assert row["switch_interval_s"] == pytest.approx(0.001)
    assert row["completion_tokens"] == 2 * (4 + 3 + 3) and row["errors"] == 0 and row["reused_follow_ups"] == 4
    loop = row["loop"]  # the loop's step figures over the round (`BatchLoop.step_stats`)
    assert loop["steps"] > 0 and sum(k["steps"] for k in loop["kinds"].values()) == loop["steps"]
    assert loop["joins"] == 6 and loop["rows"]["prefill"] > 0 and loop["rows"]["decode"] > 0
    assert 0 < len(loop["recent"]) <= serve_load.LOOP_RECENT_STEPS and "gap_ms" in loop["recent"][-1]
    # (the next step prepared inside the choosing, after the tokens were fed: timed as a part of it)
    assert any(0 < s["prepare_ms"] <= s["choose_ms"] for s in loop["recent"])
    assert [line for line in lines if " loop: " in line] == [f"[serve-load] raincheck x2 loop: "
                                                              f"{serve_load.loop_summary(loop)}"]
    assert serve_load.loop_summary(loop).startswith(
        f"{loop['steps']} steps ({loop['steps_ahead']} launched ahead): eager {loop['steps']} (")
    # the heap frozen after the warm-up as serve does (and unfrozen after the run), the collector's pauses counted
    assert saved["settings"]["freeze_heap"] is True and saved["frozen_objects"] > 0 and gc.get_freeze_count() == 0
    assert set(row["gc"]) == {"collections", "full_pause_ms_max", "full_pause_ms_total", "pause_ms_total"}
    assert len(row["gc"]["collections"]) == 3 and any("garbage collector" in line for line in lines)
    # the round's memory (`MemoryWatch`): the 2 conversations' caches held at most (no budget: none evicted)
    memory = row["memory"]
    assert memory["held_conversations_then"] == 2 and memory["held_cache_bytes_max"] > 0 and memory["evictions"] == 0
    assert [line for line in lines if " memory: " in line] == [f"[serve-load] raincheck x2 memory: "
                                                                f"{serve_load.memory_summary(memory)}"]


def test_serve_load_sizes_the_batched_places_by_warm_up_tokens(tmp_path, monkeypatch):
    """``--warm-up-tokens`` (with ``--batching`` and the warm-up): the batched engine's places are warmed at that many
    rows, the restoring places are fitted at them, and the setting is recorded; a value not above the answer's tokens
    is refused before any compute, naming the option."""
    from raincheck_hf import batch_loop, warmup
    from raincheck_hf.bench import serve_load

    warmed, fitted, real = [], [], warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: warmed.append(k["max_tokens"]) or real(*a, **k))
    monkeypatch.setattr(batch_loop, "restoring_places_that_fit", lambda model, places, rows: fitted.append(rows) or 0)
    path = tmp_path / "load.json"
    serve_load.run(model_name="tiny_qwen3_vl", clients=(1,), modes=("raincheck",), answer_tokens=4, follow_up_tokens=3,
                   library=False, json_path=str(path), log=lambda *a: None, batching=True, warm_up_tokens=256)
    saved = json.loads(path.read_text())
    assert warmed == [256] and fitted == [256] and saved["settings"]["warm_up_tokens"] == 256
    assert saved["rows"][0]["errors"] == 0
    for bad in (4, 0, "many", True):
        with pytest.raises(ValueError, match=r"warm_up_tokens \(--warm-up-tokens\) must be an integer above"):
            serve_load.run(model_name="tiny_qwen3_vl", clients=(1,), answer_tokens=4, batching=True,
                           warm_up_tokens=bad)
    assert serve_load.main(["--model", "tiny_qwen3_vl", "--batching", "--answer-tokens", "8",
                            "--warm-up-tokens", "8"]) == 2


def test_serve_load_compares_launching_ahead_side_by_side(tmp_path):
    """``--launch-ahead both``: each client count's round once with the loop launching steps ahead and once without,
    one after the other, each row named by its series and setting; without the loop, or with another value, a clear
    error before any compute."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(1, 2), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, launch_ahead="both", plot_path=str(tmp_path / "load.png"))
    saved = json.loads(path.read_text())
    assert saved["settings"]["launch_ahead"] == "both"
    assert [(r["clients"], r["launch_ahead"], r["series"]) for r in saved["rows"]] == [
        (1, True, "raincheck, launched ahead"), (1, False, "raincheck, not ahead"),
        (2, True, "raincheck, launched ahead"), (2, False, "raincheck, not ahead")]
    for row in saved["rows"]:
        assert row["completion_tokens"] == row["clients"] * (4 + 3 + 3) and row["errors"] == 0
        assert (row["loop"]["steps_ahead"] > 0) == row["launch_ahead"]  # (off: no step launched ahead)
    assert any(line.startswith("| raincheck, not ahead | 2 |") for line in lines)
    for bad, kwargs in (("sometimes", dict(batching=True)), ("both", {})):
        with pytest.raises(ValueError, match="launch_ahead must be"):
            serve_load.run(clients=(1,), launch_ahead=bad, **kwargs)


def test_serve_load_compares_joins_in_flight_side_by_side(tmp_path):
    """``--join-in-flight both``: each client count's round with turns joining while a step runs and only between
    steps, rows named and recording it, the loop's record counting the joins made while a step ran (none when off);
    without the loop, or with another value, a clear error before any compute."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(3,), modes=("raincheck",), answer_tokens=6,
                   follow_up_tokens=4, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, join_in_flight="both", plot_path=str(tmp_path / "load.png"))
    saved = json.loads(path.read_text())
    assert saved["settings"]["join_in_flight"] == "both"
    assert [(r["join_in_flight"], r["series"]) for r in saved["rows"]] == [
        (True, "raincheck, joins in flight"), (False, "raincheck, joins between steps")]
    on, off = saved["rows"]
    for row in (on, off):
        assert row["completion_tokens"] == 3 * (6 + 4 + 4) and row["errors"] == 0 and row["loop"]["joins"] == 9
    assert off["loop"]["joins_in_flight"] == 0 and 0 <= on["loop"]["joins_in_flight"] <= 9
    assert any("while a step ran; follow-ups' sequences " in line for line in lines)
    for bad, kwargs in (("sometimes", dict(batching=True)), ("both", {})):
        with pytest.raises(ValueError, match="join_in_flight must be"):
            serve_load.run(clients=(1,), join_in_flight=bad, **kwargs)


def test_serve_load_compares_follow_ups_made_ahead_side_by_side(tmp_path):
    """``--follow-ups-ahead both``: each client count's round with follow-ups' sequences made on their request's
    thread and by the loop when they join, rows named and recording it, the loop's record counting the sequences
    made ahead (every one when on: ``full`` leaves nothing to restore, which would make the loop make it; none when
    off); without the loop, or with another value, a clear error before any compute."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("full",), answer_tokens=5,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, follow_ups_ahead="both")
    saved = json.loads(path.read_text())
    assert saved["settings"]["follow_ups_ahead"] == "both"
    assert [(r["follow_ups_ahead"], r["series"]) for r in saved["rows"]] == [
        (True, "full, follow-ups made ahead"), (False, "full, follow-ups made on joining")]
    on, off = saved["rows"]
    for row in (on, off):
        assert row["completion_tokens"] == 2 * (5 + 3 + 3) and row["errors"] == 0
    assert on["loop"]["follow_ups_made_ahead"] == 4 and off["loop"]["follow_ups_made_ahead"] == 0
    for bad, kwargs in (("sometimes", dict(batching=True)), ("both", {})):
        with pytest.raises(ValueError, match="follow_ups_ahead must be"):
            serve_load.run(clients=(1,), follow_ups_ahead=bad, **kwargs)


def test_serve_load_compares_prompt_forward_limits_side_by_side(tmp_path):
    """``--prompt-forwards any,1``: each client count's round with the loop's ``max_prompt_forwards`` unset and at 1,
    rows named by it and recording it, the loop set back between rounds; bad values refused before any compute."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, prompt_forwards=(None, 1))
    saved = json.loads(path.read_text())
    assert saved["settings"]["prompt_forwards"] == [None, 1]
    assert [(r["series"], r["max_prompt_forwards"]) for r in saved["rows"]] == [
        ("raincheck, prompt forwards any", None), ("raincheck, prompt forwards 1", 1)]
    assert all(r["errors"] == 0 and r["completion_tokens"] == 2 * (4 + 3 + 3) for r in saved["rows"])
    assert serve_load._forwards("any,1, 2") == (None, 1, 2)
    for bad, kwargs in (((0,), dict(batching=True)), ((), dict(batching=True)), ((1,), {})):
        with pytest.raises(ValueError, match="prompt_forwards"):
            serve_load.run(clients=(1,), prompt_forwards=bad, **kwargs)


def test_serve_load_compares_preparation_limits_side_by_side(tmp_path):
    """``--preparing any,1 --prepare-stream both``: each client count's round with the loop's ``max_preparing`` unset
    and at 1, each on the default stream and on streams of its own, rows named by both and recording them, the first turns' preparation split (in line, CPU) in the loop's record; bad values
    refused before any compute."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, preparing=(None, 1), prepare_stream="both")
    saved = json.loads(path.read_text())
    assert saved["settings"]["preparing"] == [None, 1] and saved["settings"]["prepare_stream"] == "both"
    assert [(r["series"], r["max_preparing"], r["prepare_stream"]) for r in saved["rows"]] == [
        ("raincheck, preparing any, one stream", None, False), ("raincheck, preparing any, own streams", None, True),
        ("raincheck, preparing 1, one stream", 1, False), ("raincheck, preparing 1, own streams", 1, True)]
    for row in saved["rows"]:
        assert row["errors"] == 0 and row["completion_tokens"] == 2 * (4 + 3 + 3)
        first = row["loop"]["turns"]["first"]
        assert first["turns"] == 2 and 0 <= first["ahead_wait_ms_p50"] <= first["ahead_ms_p50"]
        assert 0 < first["ahead_cpu_ms_p50"] and row["loop"]["join_cpu_s"] >= 0
    assert any("(in line " in line for line in lines)
    assert serve_load._forwards("any,2") == (None, 2)
    for bad, kwargs in (((0,), dict(batching=True)), ((), dict(batching=True)), ((1,), {})):
        with pytest.raises(ValueError, match="preparing"):
            serve_load.run(clients=(1,), preparing=bad, **kwargs)
    for bad, kwargs in (("sometimes", dict(batching=True)), ("on", {}), ("on,on", dict(batching=True)),
                        ("high,", dict(batching=True))):
        with pytest.raises(ValueError, match="prepare_stream must be"):
            serve_load.run(clients=(1,), prepare_stream=bad, **kwargs)
    assert serve_load._stream_values("on,high", True) == (True, "high")
    assert serve_load._stream_values("both", True) == (False, True)
    assert serve_load._stream_values("off", False) == (False,)
    loop = types.SimpleNamespace()
    interval = sys.getswitchinterval()
    serve_load._apply_variant(loop, (True, None, 1, "high", None, interval, None, 256, True, True))
    assert (loop.prepare_stream, loop.prepare_priority, loop.max_preparing) == (True, "high", 1)
    assert loop.follow_ups_ahead
    serve_load._apply_variant(loop, (True, None, 1, False, None, interval, None, None, False, False))
    assert (loop.prepare_stream, loop.prepare_priority, loop.split_rows, loop.join_in_flight,
            loop.follow_ups_ahead) == (False, "normal", None, False, False)


def test_serve_load_compares_ride_limits_side_by_side(tmp_path):
    """``--ride-rows any,256``: each client count's round with the loop's ``ride_max_rows`` at its default and at 256,
    rows named by it and recording it (the loop left at the first variant's); bad values refused before compute."""
    from raincheck_hf.bench import serve_load

    path = tmp_path / "load.json"
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lambda *a: None,
                   batching=True, ride_rows=(None, 256))
    saved = json.loads(path.read_text())
    assert saved["settings"]["ride_rows"] == [None, 256]
    assert [(r["series"], r["ride_max_rows"]) for r in saved["rows"]] == [
        ("raincheck, riding up to default rows", None), ("raincheck, riding up to 256 rows", 256)]
    assert all(r["errors"] == 0 and r["completion_tokens"] == 2 * (4 + 3 + 3) for r in saved["rows"])
    # (the preparation settings left unset: the server's defaults)
    assert saved["settings"]["preparing"] == [1] and saved["settings"]["prepare_stream"] == "on"
    assert all(r["max_preparing"] == 1 and r["prepare_stream"] is True for r in saved["rows"])
    for bad, kwargs in (((0,), dict(batching=True)), ((True,), dict(batching=True)), ((), dict(batching=True)),
                        ((256,), {})):
        with pytest.raises(ValueError, match="ride_rows"):
            serve_load.run(clients=(1,), ride_rows=bad, **kwargs)


def test_serve_load_compares_chunk_caps_side_by_side(tmp_path, monkeypatch):
    """``--chunk-rows none,8``: each client count's round with the server config's ``batch_chunk_rows`` unset (every
    answer its full chunk) and at 8, rows named by it and recording it, the requests' configs made from it (the
    engines the loop ran had that cap), the server left at the first variant's; bad values refused before compute."""
    from raincheck_hf.batch_loop import BatchLoop
    from raincheck_hf.bench import serve_load

    caps, engine_for = [], BatchLoop._engine_for
    monkeypatch.setattr(BatchLoop, "_engine_for",
                        lambda self, config: caps.append(config.batch_chunk_rows) or engine_for(self, config))
    path = tmp_path / "load.json"
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lambda *a: None,
                   batching=True, chunk_rows=(None, 8))
    saved = json.loads(path.read_text())
    assert saved["settings"]["batch_chunk_rows"] == [None, 8]
    assert [(r["series"], r["batch_chunk_rows"]) for r in saved["rows"]] == [
        ("raincheck, chunk cap none", None), ("raincheck, chunk cap 8", 8)]
    assert all(r["errors"] == 0 and r["completion_tokens"] == 2 * (4 + 3 + 3) for r in saved["rows"])
    assert 8 in caps and set(caps[:caps.index(8)]) == {None} and set(caps[caps.index(8):]) == {8}  # (in round order)
    assert serve_load._caps("none,64") == (None, 64)
    for bad, kwargs in (((0,), dict(batching=True)), ((True,), dict(batching=True)), ((), dict(batching=True)),
                        ((8,), {})):
        with pytest.raises(ValueError, match="chunk_rows"):
            serve_load.run(clients=(1,), chunk_rows=bad, **kwargs)


def test_serve_load_compares_width_splits_side_by_side(tmp_path, monkeypatch):
    """``--split-rows default,never``: each client count's round with the loop's ``split_rows`` at the engine's
    default and at None (no step split by width), rows named by it and recording it, the loop's engines following
    it; bad values refused before compute."""
    from raincheck_hf.batch_engine import SPLIT_ROWS, BatchEngine
    from raincheck_hf.bench import serve_load

    seen, step = [], BatchEngine.step
    monkeypatch.setattr(BatchEngine, "step", lambda self: seen.append(self.split_rows) or step(self))
    path = tmp_path / "load.json"
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lambda *a: None,
                   batching=True, split_rows=("default", None))
    saved = json.loads(path.read_text())
    assert saved["settings"]["split_rows"] == [SPLIT_ROWS, None]
    assert [(r["series"], r["split_rows"]) for r in saved["rows"]] == [
        (f"raincheck, split at {SPLIT_ROWS}", SPLIT_ROWS), ("raincheck, split at never", None)]
    assert all(r["errors"] == 0 and r["completion_tokens"] == 2 * (4 + 3 + 3) for r in saved["rows"])
    assert None in seen and SPLIT_ROWS in seen and seen.index(None) > seen.index(SPLIT_ROWS)
    assert serve_load._splits("default,never,64") == ("default", None, 64)
    for bad, kwargs in (((0,), dict(batching=True)), (("default", "default"), dict(batching=True)),
                        ((), dict(batching=True)), ((None,), {})):
        with pytest.raises(ValueError, match="split_rows"):
            serve_load.run(clients=(1,), split_rows=bad, **kwargs)


def test_serve_load_repeats_rounds_in_alternating_order_and_reports_their_medians(tmp_path, monkeypatch):
    """``--rounds 3 --prepare-stream on,high``: each client count's two variants three times, A B, B A, A B (a round's
    place in the order falls on both alike), a row each with its ``round``; the medians over the rounds per series
    and client count in ``medians``, equal to the median of its rows; every round's images decoded again (the server
    forgets them between rounds, as new clients bring theirs); ``rounds`` checked before compute."""
    import statistics

    from raincheck_hf.bench import serve_load
    from raincheck_hf.serve import protocol

    decoded, decode = [], protocol.decode_pixels
    monkeypatch.setattr(protocol, "decode_pixels", lambda *a, **k: decoded.append(1) or decode(*a, **k))
    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, prepare_stream="on,high", rounds=3)
    assert len(decoded) == 6 * 2  # (six rounds, two clients' pictures each: their follow-ups resend them, decoded once)
    saved = json.loads(path.read_text())
    assert saved["settings"]["rounds"] == 3
    own, high = "raincheck, own streams", "raincheck, own high-priority streams"
    assert [(r["series"], r["round"], r["prepare_stream"]) for r in saved["rows"]] == [
        (own, 0, True), (high, 0, "high"), (high, 1, "high"), (own, 1, True), (own, 2, True), (high, 2, "high")]
    assert all(r["errors"] == 0 and r["completion_tokens"] == 2 * (4 + 3 + 3) for r in saved["rows"])
    medians = {m["series"]: m for m in saved["medians"]}
    assert set(medians) == {own, high} and all(m["rounds"] == 3 and m["clients"] == 2 for m in medians.values())
    for series, m in medians.items():
        for key in serve_load.MEDIAN_KEYS:
            assert m[key] == statistics.median(r[key] for r in saved["rows"] if r["series"] == series), key
    assert any(line == "medians over the rounds" for line in lines)
    assert any("(round 3)" in line for line in lines)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
            serve_load.run(clients=(1,), rounds=bad)


def test_serve_load_profiles_the_loops_thread_in_a_round_of_its_own(tmp_path):
    """``--profile-loop``: after a mode's rounds, one more at the most clients with the loop's thread under cProfile:
    its functions (the loop's step among them) in the JSON's ``loop_profile``, not among the rows; refused without
    batching."""
    from raincheck_hf.bench import serve_load

    path, lines = tmp_path / "load.json", []
    serve_load.run(model_name="tiny_qwen3_vl", clients=(1, 2), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, profile_loop=True)
    saved = json.loads(path.read_text())
    assert [r["clients"] for r in saved["rows"]] == [1, 2]
    profile = saved["loop_profile"]["raincheck"]
    assert profile["clients"] == 2 and profile["errors"] == 0 and profile["output_tokens_per_s"] > 0
    names = [row[0] for row in profile["by_cumulative_time"]]
    assert any("batch_loop.py" in name and "(_step)" in name for name in names), names
    assert all(row[1] >= 1 and row[3] >= row[2] >= 0 for row in profile["by_own_time"])
    assert any("by cumulative time" in line for line in lines)
    with pytest.raises(ValueError, match="profile_loop .* needs batching"):
        serve_load.run(clients=(1,), profile_loop=True)


def test_freeze_heap_and_the_pause_counter():
    """`startup.freeze_heap` takes every live object out of the collector's reach (the serve CLI's default after its
    warm-up); `serve_load.GcPauses` counts a full collection made while it is entered, and its pause."""
    from raincheck_hf.bench.serve_load import GcPauses
    from raincheck_hf.serve import cli
    from raincheck_hf.startup import freeze_heap

    def build_parser():
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        return parser

    try:
        assert freeze_heap() > 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    with GcPauses() as pauses:
        gc.collect()
        first = pauses.summary()
        pauses.reset()
    assert first["collections"][2] == 1 and first["full_pause_ms_total"] == first["full_pause_ms_max"] >= 0
    assert pauses.summary()["collections"] == [0, 0, 0] and pauses._callback not in gc.callbacks
    assert build_parser().parse_args([]).freeze_heap is True
    assert build_parser().parse_args(["--no-freeze-heap"]).freeze_heap is False


def test_serve_load_clients_in_threads_of_the_server_process_with_in_process_clients(tmp_path, monkeypatch):
    """``--in-process-clients``: the clients are threads of the server's process (no client process is started),
    with the same answers; the JSON records it."""
    from raincheck_hf.bench import load_client, serve_load

    def no_pool(size):
        raise AssertionError("no client process should start with --in-process-clients")

    monkeypatch.setattr(serve_load, "ClientPool", no_pool)
    path = tmp_path / "load.json"
    status = serve_load.main(["--clients", "2", "--modes", "raincheck", "--answer-tokens", "4",
                              "--follow-up-tokens", "3", "--no-warmup", "--no-library", "--batching",
                              "--in-process-clients", "--json", str(path)])
    assert status is not None and status != 2
    saved = json.loads(path.read_text())
    assert saved["settings"]["client_processes"] is False
    (row,) = saved["rows"]
    assert row["completion_tokens"] == 2 * (4 + 3 + 3) and row["errors"] == 0 and row["reused_follow_ups"] == 4
    with pytest.raises(ValueError, match="3 clients in a round, but the pool has 2 processes"):
        load_client.ClientPool.round(type("P", (), {"_processes": [None, None]})(), [{}, {}, {}])


def test_client_pool_reports_a_failing_client_and_still_starts_the_others():
    """A client that fails (here: no server listening) is an error of the round, not a hang; the pool is reused."""
    from raincheck_hf.bench.load_client import ClientPool

    task = dict(base="http://127.0.0.1:9", name="bench", mode="raincheck", settings={}, system="s", image_url="x",
                questions=["q"], lengths=[2], bias=[], think_s=0.0)
    with ClientPool(2) as pool:
        for n in (2, 1):
            out, errors = pool.round([task] * n, timeout=120)
            assert out == [None] * n and len(errors) == n and all("Connection" in e for e in errors), errors


def test_trace_summary_reduces_a_trace_to_streams_and_preparation_windows():
    """`trace_round.trace_summary` on a hand-made trace: device events per stream with their busy time (overlaps
    counted once), the top kernels, each preparation range's wall time and each stream's busy time within it, and
    per kind the medians; operator events and ranges of other names are not preparations."""
    from raincheck_hf.bench.trace_round import PREPARE, trace_summary

    def x(name, cat, ts, dur, stream=None):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur,
                **({"args": {"stream": stream}} if stream is not None else {})}

    trace = {"traceEvents": [
        x(f"{PREPARE}.first", "user_annotation", 0, 1000),
        x(f"{PREPARE}.first", "user_annotation", 2000, 500),
        x(f"{PREPARE}.follow_up", "user_annotation", 3000, 100),
        x("raincheck.other", "user_annotation", 0, 5000),
        x("aten::mm", "cpu_op", 0, 5000),
        x("gemm", "kernel", 100, 300, stream=7),  # in the first window
        x("gemm", "kernel", 300, 300, stream=7),  # overlaps it: 100-600 busy in all
        x("tower", "kernel", 900, 200, stream=20),  # half in the first window
        x("copy", "gpu_memcpy", 2100, 100, stream=20),  # in the second window
        {"ph": "i", "name": "instant", "ts": 0},
    ]}
    out = trace_summary(trace)
    assert out["span_ms"] == 5.0 and out["preparations"] == 3
    assert out["streams"]["7"]["events"] == 2 and out["streams"]["7"]["busy_ms"] == 0.5
    assert out["streams"]["7"]["busy_share"] == 0.1
    assert out["streams"]["7"]["top_kernels_ms"] == [("gemm", 0.6)]
    assert out["streams"]["20"]["busy_ms"] == 0.3
    first, second, follow = out["preparation_windows"]
    assert (first["kind"], first["wall_ms"], first["busy_ms"]) == ("first", 1.0, {"7": 0.5, "20": 0.1})
    assert second["busy_ms"] == {"7": 0.0, "20": 0.1} and follow["busy_ms"] == {"7": 0.0, "20": 0.0}
    medians = out["preparation_medians"]
    assert medians["first"] == {"preparations": 2, "wall_ms": 0.75, "busy_ms": {"7": 0.25, "20": 0.1}}
    assert medians["follow_up"]["preparations"] == 1
    assert trace_summary({"traceEvents": []}) == {"span_ms": None, "streams": {}, "preparations": 0,
                                                  "preparation_medians": {}, "preparation_windows": []}


def test_serve_load_traces_a_round_of_its_own_with_the_preparations_marked(tmp_path):
    """``--trace-round --trace-file``: after the mode's rounds, one more at the most clients under torch.profiler,
    every thread's operators included: each turn's preparation a range of its kind (two first turns, four
    follow-ups), the summary in the JSON's ``trace`` (not among the rows), the trace kept gzipped; the loop's
    ``prepare_ahead`` is its class's again after; bad combinations refused before compute."""
    import gzip

    from raincheck_hf.bench import serve_load, trace_round

    path, lines, kept = tmp_path / "load.json", [], tmp_path / "trace.json.gz"
    serve_load.run(model_name="tiny_qwen3_vl", clients=(2,), modes=("raincheck",), answer_tokens=4,
                   follow_up_tokens=3, warmup=False, library=False, json_path=str(path), log=lines.append,
                   batching=True, trace_round=True, trace_path=str(kept))
    saved = json.loads(path.read_text())
    assert [r["clients"] for r in saved["rows"]] == [2]
    traced = saved["trace"]["raincheck"]
    assert traced["errors"] == 0 and traced["clients"] == 2 and traced["output_tokens_per_s"] > 0
    if traced["all_threads"]:  # (a torch that profiles every thread: the preparations' ranges are in the trace)
        assert traced["preparations"] == 6
        assert {k: m["preparations"] for k, m in traced["preparation_medians"].items()} == {"first": 2, "follow_up": 4}
    assert "raincheck.prepare" in traced["operators"] or not traced["all_threads"]
    file = tmp_path / "trace.json_raincheck.gz"
    assert traced["file"] == str(file) and json.loads(gzip.decompress(file.read_bytes()))["traceEvents"]
    assert any("preparations" in line for line in lines)
    for kwargs, message in ((dict(trace_round=True), "needs batching"),
                            (dict(batching=True, trace_path="x.gz"), "set trace_round too")):
        with pytest.raises(ValueError, match=message):
            serve_load.run(clients=(1,), **kwargs)

    class Loop:
        def prepare_ahead(self, job):
            return "class"

    loop = Loop()
    with trace_round.labelled_preparations(loop):
        assert "prepare_ahead" in vars(loop)
    assert "prepare_ahead" not in vars(loop) and loop.prepare_ahead(None) == "class"


def test_serve_warms_the_vision_tower_for_the_image_sizes_given(monkeypatch):
    """``serve --warm-up-image-sizes 1344x1024,640x480``: the warm-up is asked for those sizes as (height, width) (the
    tower's graph of each captured before the port opens), with the batched steps under ``--batching`` (for
    ``--max-running`` and the restoring places that fit, or ``--restoring-places``); none by default; a malformed
    size is argparse's error. The held caches' budget (``--max-cache-gb auto``) is taken after the warm-up."""
    import argparse

    import uvicorn

    from raincheck_hf import loading, startup
    from raincheck_hf.serve import cli

    asked = []
    monkeypatch.setattr(startup, "run_warm_up", lambda *a, **k: asked.append(k))
    monkeypatch.setattr(startup, "start_caches", lambda *a, **k: None)
    monkeypatch.setattr(loading, "load_or_exit", lambda name, device: ("model", "processor", None, None))
    monkeypatch.setattr(loading, "note_fallbacks", lambda model: None)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    made = []  # (the settings the app is made with)
    monkeypatch.setattr("raincheck_hf.serve.app.create_app", lambda model, processor, settings: made.append(settings))
    monkeypatch.setattr(cli, "_log_requests", lambda level: None)  # (nothing of the test process's logging changed)
    monkeypatch.setattr(startup, "freeze_heap", lambda: 0)  # (nor its garbage collector)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    from raincheck_hf import batch_loop

    fits = []  # (the places for restoring conversations: what the GPU holds, faked here)
    monkeypatch.setattr(batch_loop, "restoring_places_that_fit", lambda *a: fits.append(a) or 0)
    assert cli.serve(parser.parse_args(["--warm-up-image-sizes", "1344x1024, 640X480", "--batching",
                                        "--device", "cpu"])) == 0
    assert asked[-1]["image_sizes"] == [(1024, 1344), (480, 640)] and asked[-1]["batch"] == 4  # (--max-running)
    assert fits == [("model", 4, 4096)]
    assert cli.serve(parser.parse_args(["--batching", "--restoring-places", "3", "--device", "cpu"])) == 0
    assert asked[-1]["batch"] == 7 and len(fits) == 1  # (set: taken as given)
    assert made[-1].restoring_places == 3 and made[-1].max_cache_bytes is None  # ('auto' off a GPU: unbounded)
    monkeypatch.setattr(startup, "auto_cache_budget", lambda device, later_bytes=0: 5 << 30)  # (a GPU, 5 GiB left)
    assert cli.serve(parser.parse_args(["--device", "cpu"])) == 0
    assert made[-1].max_cache_bytes == 5 << 30
    assert cli.serve(parser.parse_args(["--device", "cpu", "--max-cache-gb", "2"])) == 0
    assert made[-1].max_cache_bytes == 2 << 30
    assert cli.serve(parser.parse_args(["--device", "cpu"])) == 0
    assert asked[-1]["image_sizes"] == [] and asked[-1]["batch"] is None
    for bad in ("1344", "0x10", "axb"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--warm-up-image-sizes", bad])


def test_the_automatic_budget_without_a_warm_up_keeps_the_batched_pool_out(monkeypatch):
    """``serve --batching --no-warm-up``: the batched pool is made by the first answers, not before the budget is
    taken, so what the warm-up would have made for the running and restoring places is kept out of the held caches'
    budget (`fast.batched_graphs.pool_bytes`): the same budget as with the warm-up. Without ``--batching``, or with
    the warm-up, nothing is taken off."""
    import argparse

    from raincheck_hf import startup
    from raincheck_hf.fast.batched_graphs import pool_bytes
    from raincheck_hf.models import get_adapter
    from raincheck_hf.serve import cli

    from families import family_model

    model = family_model("qwen3_vl")
    monkeypatch.setattr(startup, "auto_cache_budget", lambda device, later_bytes=0: (20 << 30) - later_bytes)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)

    def budget(*argv):
        args = parser.parse_args(["--device", "cpu", *argv])
        settings = cli.settings_from(args)
        return cli.with_cache_budget(args, "cpu", settings, model).max_cache_bytes, settings

    got, settings = budget("--batching", "--no-warm-up")
    pool = pool_bytes(get_adapter(model), settings.batch_places, 4096)["bytes"]
    assert settings.batch_places == 6 and 0 < pool and got == (20 << 30) - pool  # (4 answers + 2 restoring)
    assert budget("--batching")[0] == 20 << 30 and budget("--no-warm-up")[0] == 20 << 30
    assert budget("--batching", "--no-warm-up", "--max-cache-gb", "3")[0] == 3 << 30


def test_the_held_caches_automatic_budget(monkeypatch):
    """``--max-cache-gb auto``: on CUDA the free memory and what the allocator holds unused outside the CUDA graphs'
    pools (their free blocks read from its snapshot, this device's only), less a reserve of 10% of the device (at
    least 4 GiB), never below 0; off CUDA unbounded (None). Before, the graphs' pools' free blocks counted as
    unused: on an 80 GB H100 6.6 GiB that no held cache could have."""
    import torch

    from raincheck_hf import startup
    from raincheck_hf.fast.graphs import private_pools_free_bytes

    assert startup.auto_cache_budget("cpu") is None
    gib = 1 << 30
    state = {"free": 20 * gib, "total": 80 * gib}
    segments = [dict(device=0, segment_pool_id=(0, 0), total_size=2 * gib, allocated_size=gib // 2),
                dict(device=0, segment_pool_id=(7, 1), total_size=gib, allocated_size=gib // 4),
                dict(device=1, segment_pool_id=(7, 2), total_size=gib, allocated_size=0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 3 * gib // 4)
    assert private_pools_free_bytes("cuda:0") == private_pools_free_bytes() == 3 * gib // 4
    assert private_pools_free_bytes("cuda:1") == gib
    unused = 3 * gib - 3 * gib // 4 - 3 * gib // 4  # (1.5 GiB: what the default pool holds free)
    assert startup.auto_cache_budget("cuda") == 20 * gib + unused - 8 * gib
    state["total"] = 16 * gib  # (the reserve's floor: 4 GiB)
    assert startup.auto_cache_budget("cuda:0") == 20 * gib + unused - 4 * gib
    state["free"] = 0
    assert startup.auto_cache_budget("cuda") == 0
