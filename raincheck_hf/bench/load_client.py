"""`bench serve-load`'s clients: one streamed three-turn dialogue through the official `openai` client, and the
processes that run them.

This module imports only the standard library (and `openai` when a dialogue runs): a client process started with
``spawn`` imports it without torch or transformers. Real clients are remote, so by default each client of the load
benchmark runs in a process of its own (`ClientPool`): its SSE parsing and the openai client's pydantic models then
do not compete for the server process's GIL with the server's own threads (the batching loop, the event loop), which
is what is measured.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import threading
import time


def user_turn(question: str, image_url: str | None = None) -> dict:
    """A user message of the OpenAI chat API: the image (first turn only) then the question."""
    content = [{"type": "image_url", "image_url": {"url": image_url}}] if image_url is not None else []
    return {"role": "user", "content": content + [{"type": "text", "text": question}]}


def timings(start: float, times: list[float], end: float) -> dict:
    """TTFT, TPOT and end-to-end seconds of one answer from its request's start, its pieces' arrival times and its
    end."""
    return {"ttft_s": times[0] - start if times else None,
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "e2e_s": end - start}


def streamed(client, **request) -> dict:
    """One streamed chat completion through the official client (``request``: its ``create`` arguments, ``stream``
    set here): ``begin`` / ``end`` (`time.perf_counter` just before the request and after its last chunk),
    ``times`` and ``pieces`` (each piece with text and when it came), ``usage`` (the last chunk's that had one) and
    ``raincheck`` (the last ``raincheck`` extension seen)."""
    times, pieces, usage, rc = [], [], None, None
    begin = time.perf_counter()
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            if choice.delta.content:
                times.append(time.perf_counter())
                pieces.append(choice.delta.content)
        usage = chunk.usage or usage
        rc = (chunk.model_extra or {}).get("raincheck") or rc
    return {"begin": begin, "end": time.perf_counter(), "times": times, "pieces": pieces, "usage": usage,
            "raincheck": rc}


def client_dialogue(base: str, name: str, mode: str, settings: dict, system: str, image_url: str, questions,
                    lengths, bias, think_s: float, start=None) -> list[dict]:
    """One client's streamed three-turn dialogue through the official client; a record per turn. ``start()``
    (if given) is called once the client is built, before the first request: it waits for the round's start."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
    messages = [{"role": "system", "content": system}]
    records = []
    if start is not None:
        start()
    for k, (question, n) in enumerate(zip(questions, lengths)):
        if k and think_s:
            time.sleep(think_s)
        messages.append(user_turn(question, image_url if k == 0 else None))
        got = streamed(client, model=name, messages=messages, stream_options={"include_usage": True}, temperature=0,
                       max_tokens=n, extra_body={"min_tokens": n, "raincheck": {"mode": mode, **settings}},
                       **({"logit_bias": {str(i): 100 for i in bias}} if bias else {}))
        begin, end, usage, rc = got["begin"], got["end"], got["usage"], got["raincheck"]
        messages.append({"role": "assistant", "content": "".join(got["pieces"])})
        records.append({"start": begin, "end": end, **timings(begin, got["times"], end),
                        "completion_tokens": usage.completion_tokens,
                        "prompt_tokens": usage.prompt_tokens,
                        "cached_tokens": usage.prompt_tokens_details.cached_tokens, "reused": rc["reused"],
                        "server_t1_s": rc["t1_ms"] / 1e3})
    return records


def client_floor(base: str, name: str, system: str, image_url: str, question: str, repeats: int,
                 start=None) -> list[dict]:
    """The first turn's request, ``repeats`` times, to a server that answers it at once (`serve_load.at_once_app`):
    what the client's request and the first piece of the response cost with no model behind them (the official
    client building and sending the request, HTTP on the loopback, the piece parsed). A record per request:
    ``ttft_s`` from just before the request to the first piece with text, ``server_t1_s`` the server's own clock."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": system}, user_turn(question, image_url)]
    if start is not None:
        start()
    records = []
    for _ in range(repeats):
        got = streamed(client, model=name, messages=messages, temperature=0, max_tokens=1)
        records.append({"ttft_s": got["times"][0] - got["begin"], "server_t1_s": got["raincheck"]["t1_ms"] / 1e3})
    return records


_KINDS = {"dialogue": client_dialogue, "floor": client_floor}


def _worker(tasks, results, ready, go) -> None:
    """A client process: runs the dialogues it is given (None ends it), each starting when ``go`` is set.

    ``time.perf_counter`` is the system's monotonic clock on Linux and macOS, so its records compare with the other
    processes'."""
    while True:
        task = tasks.get()
        if task is None:
            return
        index, kind, kwargs = task

        def start():
            with ready.get_lock():
                ready.value += 1
            go.wait()

        try:
            results.put((index, _KINDS[kind](**kwargs, start=start), None))
        except BaseException as error:  # counted in the row, the first few kept
            results.put((index, None, f"{type(error).__name__}: {str(error)[:300]}"))


class ClientPool:
    """``size`` client processes (``spawn``: nothing of the server's process is inherited), started once and reused
    for every round, so a round's timing never includes a process's start or its imports."""

    def __init__(self, size: int):
        context = multiprocessing.get_context("spawn")
        self._tasks = [context.Queue() for _ in range(size)]
        self._results = context.Queue()
        self._ready = context.Value("i", 0)
        self._go = context.Event()
        self._processes = [context.Process(target=_worker, args=(t, self._results, self._ready, self._go),
                                           name=f"serve-load-client-{i}", daemon=True)
                           for i, t in enumerate(self._tasks)]
        for process in self._processes:
            process.start()

    def round(self, tasks: list[dict], timeout: float = 3600.0, kind: str = "dialogue") -> tuple[list, list[str]]:
        """Run ``client_dialogue(**task)`` (``kind="floor"``: `client_floor`) for each task, one per process, all
        starting together once every client is built; returns ``(records per client in order, None for a failed one;
        error messages)``."""
        if len(tasks) > len(self._processes):
            raise ValueError(f"{len(tasks)} clients in a round, but the pool has {len(self._processes)} processes")
        self._go.clear()
        with self._ready.get_lock():
            self._ready.value = 0
        for i, task in enumerate(tasks):
            self._tasks[i].put((i, kind, task))
        out, errors, answered = [None] * len(tasks), [], 0
        deadline = time.monotonic() + timeout
        while answered < len(tasks):  # start them together once all are built (or some failed before that)
            if not self._go.is_set() and self._ready.value + len(errors) >= len(tasks):
                self._go.set()
            try:
                index, records, error = self._results.get(timeout=0.01 if not self._go.is_set() else 1.0)
            except queue_module.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self._processes):
                    raise RuntimeError("serve-load's client processes stopped answering") from None
                continue
            answered += 1
            if error is not None:
                errors.append(error)
            else:
                out[index] = records
        return out, errors

    def close(self) -> None:
        for t in self._tasks:
            t.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def thread_round(tasks: list[dict], kind: str = "dialogue") -> tuple[list, list[str]]:
    """The same round with each client in a thread of the calling process (``--in-process-clients``)."""
    barrier, out, errors = threading.Barrier(len(tasks)), [None] * len(tasks), []

    def one(c):
        try:
            out[c] = _KINDS[kind](**tasks[c], start=barrier.wait)
        except BaseException as error:  # counted in the row, the first few kept
            errors.append(f"{type(error).__name__}: {str(error)[:300]}")
            barrier.abort()

    workers = [threading.Thread(target=one, args=(c,), name=f"serve-load-client-{c}") for c in range(len(tasks))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out, errors

