"""The FastAPI app: OpenAI's ``/v1/chat/completions`` over held Raincheck conversations.

Each request is checked (`protocol.parse_chat_request`), tokenized whole with the processor's chat
template, matched against the held conversations (`store.ConversationStore.checkout`) and answered
by that conversation in a thread of its own: `Conversation`'s generate call continues the cache,
so a follow-up prefills only its new tokens; after the answer the conversation's worker restores
the deferred leftovers in idle time. Different conversations answer concurrently on the one model
(the engine is batch 1: their steps interleave on the device; the fast path keeps each thread's
state apart and runs graph captures one at a time, `fast.scoping`). A client that goes away sets
the turn's cancel event, `Conversation`'s own cancellation: generation stops at the next step,
between two forwards, so the cache stays consistent and the conversation stays held.
"""

import asyncio
import contextlib
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..configuration import RaincheckConfig
from .metrics import Metrics
from .protocol import APIError, ChatRequest, DecodedImages, bad, parse_chat_request
from .store import ConversationStore, ServedConversation


@dataclass
class ServeSettings:
    """Server-wide settings (the command line's).

    Attributes:
        model_name: the id clients send as ``model`` (and ``/v1/models`` lists).
        config: the default `RaincheckConfig`; a request's ``raincheck`` field overrides its fields.
        max_cache_bytes: budget of the held conversations' caches (None: unbounded).
        api_key: when set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <key>``.
        media_root: ``file://`` URLs are read only under this folder (None: file URLs refused).
        max_tokens: answer length limit when a request gives none.
        reuse: continue held conversations (False: every request prefills its whole dialogue and
            nothing is held, as a server without a conversation cache does; for comparisons).
    """

    model_name: str = "qwen3_vl"
    config: RaincheckConfig = field(default_factory=RaincheckConfig)
    max_cache_bytes: int | None = None
    api_key: str | None = None
    media_root: Path | None = None
    max_tokens: int = 256
    reuse: bool = True

    def __post_init__(self):
        if self.max_cache_bytes is not None and self.max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0 (or None: unbounded), got {self.max_cache_bytes}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string (or None: no key)")
        if self.media_root is not None and not Path(self.media_root).is_dir():
            raise ValueError(f"media_root must be an existing folder (or None: file URLs refused), got "
                             f"{str(self.media_root)!r}")


class _StopStrings(StoppingCriteria):
    """Stops at the step whose token completes one of ``stop`` in the answer's text."""

    def __init__(self, tokenizer, prompt_length: int, stop: list[str]):
        self.tokenizer, self.prompt_length, self.stop = tokenizer, prompt_length, stop
        self.stopped = False

    def __call__(self, input_ids, scores, **kwargs):
        if not self.stopped:
            text = self.tokenizer.decode(input_ids[0, self.prompt_length:], skip_special_tokens=True)
            self.stopped = any(s in text for s in self.stop)
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


class _Sampling(LogitsProcessor):
    """Temperature, top-k, top-p and the draw, with the request's own generator; leaves only the drawn
    token, which `generate` (run greedy) then takes. ``seed`` reproduces an answer whatever other
    requests sample meanwhile (the global RNG is shared by every thread)."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None, seed: int, device):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed % (1 << 63))

    def __call__(self, input_ids, scores):
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        choice = torch.multinomial(probs.to(self.generator.device), 1, generator=self.generator).to(scores.device)
        return torch.full_like(scores, float("-inf")).scatter(-1, choice, 0.0)


class _LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: a fixed value added to the logits of the given token ids."""

    def __init__(self, bias: dict[int, float]):
        self.ids, self.values = torch.tensor(list(bias)), torch.tensor(list(bias.values()))

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.ids.to(scores.device)] += self.values.to(scores.device, scores.dtype)
        return scores


class _Pieces(BaseStreamer):
    """Hands the answer's new text to ``emit`` after every token (from the generating thread); text that
    ends inside a multi-byte character waits for the token that completes it."""

    def __init__(self, tokenizer, emit):
        self.tokenizer, self.emit, self.ids, self.sent, self.prompt_seen = tokenizer, emit, [], 0, False

    def put(self, value):
        if not self.prompt_seen:  # the prompt comes first
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        self._flush(final=False)

    def end(self):
        self._flush(final=True)

    def _flush(self, final: bool):
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if (final or not text.endswith("\ufffd")) and len(text) > self.sent:
            self.emit(("text", text[self.sent:]))
            self.sent = len(text)


@dataclass
class _Turn:
    """One request in flight: its prompt, the conversation answering it and what came back."""

    request: ChatRequest
    inputs: dict
    digests: tuple
    prompt_tokens: int
    arrived: float
    cancel: threading.Event = field(default_factory=threading.Event)
    conversation: ServedConversation | None = None
    cached: int = 0
    reused: bool = False
    result: object = None
    error: BaseException | None = None
    stopper: _StopStrings | None = None
    started: float = 0.0


class Server:
    """The model, its held conversations and the metrics; `create_app` routes HTTP to it."""

    def __init__(self, model, processor, settings: ServeSettings):
        self.model, self.processor, self.settings = model, processor, settings
        self.store = ConversationStore(model, processor, settings.max_cache_bytes, reuse=settings.reuse)
        self.metrics = Metrics()
        self.images = DecodedImages()  # a follow-up resends the conversation's images: decoded once
        self.created = int(time.time())
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        tok = processor.tokenizer
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.eos_ids.add(tok.convert_tokens_to_ids("<|im_end|>"))

    # ---- preparing a turn (CPU, before the model) ------------------------------------------------
    def prepare(self, body, arrived: float) -> _Turn:
        """Check the request and tokenize it (``arrived``: when the handler got it, `time.perf_counter`)."""
        request = parse_chat_request(body, model_names=(self.settings.model_name,), defaults=self.settings.config,
                                     max_tokens_default=self.settings.max_tokens, media_root=self.settings.media_root,
                                     vocab_size=self.vocab_size, images=self.images)
        prompt = self.processor.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
        kwargs = {}
        if request.images:
            kwargs["images"] = request.images
        if request.videos:
            from transformers.video_utils import VideoMetadata

            kwargs["videos"] = [v.value for v in request.videos]
            kwargs["videos_kwargs"] = {"video_metadata": [
                VideoMetadata(total_num_frames=len(v.value), fps=v.fps, frames_indices=list(range(len(v.value))))
                for v in request.videos]}
        try:
            inputs = dict(self.processor(text=[prompt], return_tensors="pt", **kwargs))
        except (ValueError, TypeError, RuntimeError) as error:
            raise bad(f"the processor could not read this request's media: {error}", param="messages") from None
        inputs.pop("mm_token_type_ids", None)
        digests = tuple(f"{m.kind}:{m.digest}" for m in request.media)
        return _Turn(request, inputs, digests, int(inputs["input_ids"].shape[1]), arrived)

    def _new_media_only(self, turn: _Turn) -> dict:
        """The inputs with only the media the held conversation has not seen (HF's continuation convention)."""
        held = turn.conversation.digests
        inputs = dict(turn.inputs)
        for kind, values, grids in (("image", "pixel_values", "image_grid_thw"),
                                    ("video", "pixel_values_videos", "video_grid_thw")):
            seen = sum(d.startswith(kind + ":") for d in held)
            if grids not in inputs or seen == 0:
                continue
            thw = inputs[grids]
            rows = int(thw[:seen].prod(dim=-1).sum())
            if seen == thw.shape[0]:
                inputs.pop(values)
                inputs.pop(grids)
            else:
                inputs[values], inputs[grids] = inputs[values][rows:], thw[seen:]
        return inputs

    # ---- answering (a thread per request) -----------------------------------------------------
    def start(self, turn: _Turn, emit) -> threading.Thread:
        """Check out the conversation and answer in a thread; ``emit`` gets ("text", piece) and ("end", turn)."""
        lent = self.store.checkout(turn.inputs["input_ids"][0], turn.digests, turn.request.config)
        turn.conversation, turn.cached, turn.reused = lent.conversation, lent.cached, lent.reused
        request = turn.request
        kwargs = dict(request.generate_kwargs)
        turn.stopper = _StopStrings(self.processor.tokenizer, turn.prompt_tokens, request.stop)
        if request.stop:
            kwargs["stopping_criteria"] = StoppingCriteriaList([turn.stopper])
        kwargs["logits_processor"] = LogitsProcessorList(self._processors(request, kwargs))
        inputs = self._new_media_only(turn) if turn.reused else turn.inputs

        def work():
            conv = turn.conversation
            try:
                turn.started = time.perf_counter()
                turn.result = conv.answer(inputs, turn.digests, _Pieces(self.processor.tokenizer, emit), kwargs,
                                          turn.cancel)
            except BaseException as error:  # reported to the client; the cache may be half-written: drop it
                turn.error = error
                self.store.discard(conv)
            else:
                self.store.checkin(conv)
                self._count(turn)
            finally:
                emit(("end", turn))

        thread = threading.Thread(target=work, name=f"raincheck-serve-{turn.conversation.id}", daemon=True)
        thread.start()
        return thread

    def _processors(self, request: ChatRequest, kwargs: dict) -> list:
        """``logit_bias``, then sampling by `_Sampling` (the request's or the model's settings); pops
        the sampling settings from ``kwargs``, so that `generate` runs greedy over the drawn token."""
        processors = [_LogitBias(request.logit_bias)] if request.logit_bias else []
        defaults = self.model.generation_config
        sample = kwargs.pop("do_sample", defaults.do_sample)
        temperature = kwargs.pop("temperature", defaults.temperature or 1.0)
        top_p, top_k = kwargs.pop("top_p", defaults.top_p), kwargs.pop("top_k", defaults.top_k)
        if sample:
            seed = request.seed if request.seed is not None else secrets.randbits(63)
            device = next(self.model.parameters()).device
            device = device if device.type != "meta" else torch.device("cpu")
            processors.append(_Sampling(temperature, top_k, top_p, seed, device))
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return processors

    def _count(self, turn: _Turn) -> None:
        result = turn.result
        self.metrics.add(prompt_tokens=turn.prompt_tokens, cached_tokens=turn.cached,
                         completion_tokens=len(result.token_ids), restored_during_answer=result.restored_during_answer,
                         restored_at_prefill=int(result.trace.restored_per_forward[0].numel()),
                         cancelled=int(result.cancelled))
        self.metrics.turn(self.time_to_first_token(turn), result.token_times)

    def time_to_first_token(self, turn: _Turn) -> float:
        """Seconds from the request's arrival to its first generated token."""
        return (turn.started - turn.arrived) + turn.result.time_to_first_token

    # ---- the response -------------------------------------------------------------------------
    def finish_reason(self, turn: _Turn) -> str:
        ids = turn.result.token_ids
        if turn.stopper.stopped or (len(ids) and int(ids[-1]) in self.eos_ids):
            return "stop"
        if len(ids) >= turn.request.generate_kwargs["max_new_tokens"]:
            return "length"
        return "stop"

    def usage(self, turn: _Turn) -> dict:
        n = len(turn.result.token_ids)
        return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n, "total_tokens": turn.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": turn.cached}}

    def raincheck(self, turn: _Turn) -> dict:
        result, trace = turn.result, turn.result.trace
        return {
            "conversation_id": turn.conversation.id,
            "reused": turn.reused,
            "mode": trace.mode,
            "selected": int(trace.selected.numel()),
            "deferred": int(trace.deferred.numel()),
            "dropped": int(trace.dropped.numel()),
            "restored_at_prefill": int(trace.restored_per_forward[0].numel()),
            "restored_during": result.restored_during_answer,
            "restored_after": result.restored_after_answer,
            "pending": result.pending,
            "t1_ms": round(self.time_to_first_token(turn) * 1e3, 3),
            "engine_t1_ms": round(result.time_to_first_token * 1e3, 3),
            "tpot_ms": round(result.time_per_output_token * 1e3, 3) if result.token_times else None,
        }

    def close(self) -> None:
        self.store.close()


def cut_at_stop(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


class _Guard:
    """ASGI middleware: the API key and the request counter. (Plain ASGI, so that a handler still sees
    the client's disconnect in ``receive``.)"""

    def __init__(self, app, server: Server, routes: set):
        self.app, self.server, self.routes = app, server, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.routes else "other"
        key = self.server.settings.api_key
        if key is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {key}".encode()):
                self.server.metrics.request(endpoint, 401)
                response = _error_response(APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (the key given to the "
                         "server's --api-key).", code="invalid_api_key"))
                return await response(scope, receive, send)
        status = {"code": 500}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.server.metrics.request(endpoint, status["code"])


def _error_response(error: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status)


def create_app(model, processor, settings: ServeSettings | None = None):
    """The FastAPI app serving ``model`` (a supported model) with ``processor``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    server = Server(model, processor, settings or ServeSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(server.close)  # stop the conversations' restoration workers

    app = FastAPI(title="raincheck_hf", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server
    routes = {"/v1/chat/completions", "/v1/models", "/health", "/metrics"}

    app.add_middleware(_Guard, server=server, routes=routes)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = (f"Unknown route {request.method} {request.url.path}; this server has POST /v1/chat/completions, "
                   "GET /v1/models, GET /health, GET /metrics." if error.status_code in (404, 405) else str(error.detail))
        return _error_response(APIError(error.status_code, message, code="not_found" if error.status_code == 404 else None))

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return _error_response(error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        return _error_response(_server_error(error))

    @app.get("/health")
    async def health():
        snapshot = server.store.snapshot()
        return {"status": "ok", "model": server.settings.model_name, "conversations": snapshot["conversations"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.settings.model_name, "object": "model",
                                            "created": server.created, "owned_by": "raincheck_hf"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.store.snapshot()),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise bad(f"the request body is not valid JSON ({error}).") from None
        turn = await asyncio.to_thread(server.prepare, body, arrived)  # media decoding and the processor: off the loop
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown); the thread still checks its conversation in
                pass

        server.start(turn, emit)
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        name = server.settings.model_name

        def chunk(delta: dict, finish=None, **extra) -> str:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(body)}\n\n"

        if turn.request.stream:
            return StreamingResponse(_events(server, turn, queue, chunk, completion_id, created),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        # not streamed: wait for the end, cancelling if the client goes away meanwhile
        checked = time.monotonic()
        while True:
            try:
                kind, _ = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                kind = None
            if kind == "end":
                break
            if time.monotonic() - checked >= 0.25:  # pieces arrive every token: look at the connection now and then
                checked = time.monotonic()
                if await request.is_disconnected():
                    turn.cancel.set()
        if turn.error is not None:
            return _error_response(_server_error(turn.error))
        text = cut_at_stop(turn.result.text, turn.request.stop)
        return JSONResponse({
            "id": completion_id, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": server.finish_reason(turn), "logprobs": None}],
            "usage": server.usage(turn), "raincheck": server.raincheck(turn),
        })

    return app


def _server_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):  # the engine's own checks (e.g. a setting this model cannot use)
        return bad(str(error))
    return APIError(500, f"the model failed on this request: {type(error).__name__}: {error}", type="server_error")


async def _events(server: Server, turn: _Turn, queue: asyncio.Queue, chunk, completion_id: str, created: int):
    """The SSE stream; text that could still become a stop string is held back until it cannot."""
    stop = turn.request.stop
    hold = max((len(s) for s in stop), default=1) - 1
    text, sent, stopped = "", 0, False
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = await queue.get()
            if kind == "end":
                break
            if stopped:
                continue
            text += value
            cut = cut_at_stop(text, stop)
            if len(cut) < len(text):
                stopped, upto = True, len(cut)
            else:
                upto = len(text) - hold
            if upto > sent:
                yield chunk({"content": text[sent:upto]})
                sent = upto
        if turn.error is not None:
            yield f"data: {json.dumps(_server_error(turn.error).body())}\n\n"
            return
        final = cut_at_stop(text, stop)
        if len(final) > sent:
            yield chunk({"content": final[sent:]})
        extra = {"raincheck": server.raincheck(turn)}
        yield chunk({}, server.finish_reason(turn), **extra)
        if turn.request.include_usage:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": server.settings.model_name, "choices": [], "usage": server.usage(turn)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if turn.result is None and turn.error is None:
            turn.cancel.set()  # the client went away mid-answer: stop at the next step


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Serve ``app`` with uvicorn in a background thread for the span of the block; yields the base
    URL (``http://host:port``; port 0 picks a free one). For tests, benchmarks and notebooks."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="raincheck-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout)
