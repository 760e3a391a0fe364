"""The FastAPI app: OpenAI's ``/v1/chat/completions`` over held Raincheck conversations.

Each request takes its place in line (`admission.Admission`: running places, a bounded FIFO queue, 429
beyond it), is checked (`protocol.parse_chat_request`), tokenized whole with the processor's chat
template, waits for a running place, is matched against the held conversations
(`store.ConversationStore.checkout`) and answered by that conversation in a thread of its own (`Server.start`,
the one place where a turn starts and its tokens come out): `Conversation`'s generate call continues the cache,
so a follow-up prefills only its new tokens; after the answer the model's restorer thread
(`restorer.IdleRestorer`, one for all held conversations) restores the deferred leftovers in idle time. Different conversations answer concurrently on the one model
(the engine is batch 1: their steps interleave on the device; the fast path keeps each thread's
state apart and runs graph captures one at a time, `fast.scoping`). A client that goes away sets
the turn's cancel event, `Conversation`'s own cancellation: generation stops at the next step,
between two forwards, so the cache stays consistent and the conversation stays held.

With ``ServeSettings.batching`` one scheduler thread answers every running turn instead, on the batched engine
(`scheduler.BatchScheduler`): a turn joins the running batch at its next step and leaves when its answer ends.
"""

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..cache_utils import to_device
from ..configuration import PREPARE_PRIORITIES, RaincheckConfig, is_limit
from ..kv_pool import kv_bytes_per_token
from .admission import Admission, ClientGone, Ticket
from .detok import IncrementalDetokenizer
from .metrics import Metrics
from .protocol import (APIError, ChatRequest, DecodedImages, Limits, ProcessedImages, bad, parse_chat_request,
                       with_processed_images)
from .store import ConversationStore, ServedConversation

logger = logging.getLogger("raincheck_hf.serve")


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
        limits: what one request may cost (`Limits`: body size, prompt tokens, images, pixels, video).
        max_running: turns generating at once; more wait in the queue.
        max_queue: turns waiting for a running place (first come, first served); a request beyond them is
            refused at once with HTTP 429 and ``Retry-After``.
        batching: answer the running turns in one continuous-batching loop over the batched engine (its decode
            steps captured as CUDA graphs on CUDA, `fast_path=None`; `scheduler.BatchScheduler`; ``max_running`` is then the batch's most sequences) instead of a thread
            per turn on the batch-1 engine.
        max_batch_tokens: with ``batching``, rows per step (decode rows first, then prompt pieces: a long prompt
            is prefilled over several steps while the others keep decoding).
        max_prompt_forwards: with ``batching`` on captured steps, the most prompt-piece forwards in one step
            (`BatchLoop.max_prompt_forwards`); None: as many as ``max_batch_tokens`` gives.
        max_preparing: with ``batching``, the most turns prepared at once on the request threads (HF's preparation;
            a first turn's vision tower, selection and plan: `BatchLoop.max_preparing`; default 1), the others in
            line in the order they came; None: all at once.
        prepare_priority: with ``batching`` on CUDA, the priority of the stream turns are prepared on
            (`BatchLoop.prepare_priority`): ``"normal"`` or ``"high"`` (a new turn's vision tower and selection go
            before the running answers' queued steps).
        restoring_places: with ``batching``, places in a step beyond ``max_running`` for held conversations
            restoring their deferred tokens beside the answers (`batch_places`; None: `BatchLoop.MAX_RESTORING`).
            With 0 they restore only in places the answers leave free (a turn that needs the place takes it back)
            and in idle time. `serve` warms the batched engine for `batch_places` sequences and, left unset, picks 0
            where the engine's key / value pool for the 2 would not fit the GPU
            (`batch_loop.restoring_places_that_fit`).
        memory_headroom: with ``batching`` on CUDA, the device memory in bytes a new turn's preparation leaves free
            for the loop's own work (`BatchLoop.memory_headroom`: before a turn's media go to the device it waits,
            evicting idle held conversations first, until the turn's estimated bytes and this much more are free);
            ``"auto"`` (the default): 2 GiB, or 1/32 of a smaller GPU's memory; None: no such wait.
    """

    model_name: str = "qwen3_vl"
    config: RaincheckConfig = field(default_factory=RaincheckConfig)
    max_cache_bytes: int | None = None
    api_key: str | None = None
    media_root: Path | None = None
    max_tokens: int = 256
    reuse: bool = True
    limits: Limits = field(default_factory=Limits)
    max_running: int = 4
    max_queue: int = 64
    batching: bool = False
    max_batch_tokens: int = 2048
    max_prompt_forwards: int | None = None
    max_preparing: int | None = 1
    prepare_priority: str = "normal"
    restoring_places: int | None = None
    memory_headroom: int | str | None = "auto"

    @property
    def batch_places(self) -> int:
        """With ``batching``, the most sequences in one step: ``max_running`` answers and ``restoring_places`` held
        conversations restoring beside them (the `BatchLoop.max_sequences` of the server's loop)."""
        from ..batch_loop import BatchLoop

        return self.max_running + (BatchLoop.MAX_RESTORING if self.restoring_places is None else self.restoring_places)

    def __post_init__(self):
        if not isinstance(self.batching, bool):
            raise ValueError(f"batching must be True or False, got {self.batching!r}")
        if self.prepare_priority not in PREPARE_PRIORITIES:
            raise ValueError(f"prepare_priority must be 'normal' or 'high', got {self.prepare_priority!r}")
        for name, none_means in (("max_prompt_forwards", "unset: as many as the step's token budget gives"),
                                 ("max_preparing", "None, 'all' on the command line: every request's turn prepared "
                                                   "at once")):
            if not is_limit(getattr(self, name)):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r} ({none_means})")
        if self.restoring_places is not None and (isinstance(self.restoring_places, bool)
                                                  or not isinstance(self.restoring_places, int)
                                                  or self.restoring_places < 0):
            raise ValueError(f"restoring_places must be an integer >= 0 (or None: the default), got "
                             f"{self.restoring_places!r}")
        from ..batch_loop import check_memory_headroom

        check_memory_headroom(self.memory_headroom, "memory_headroom")
        for name, low in (("max_running", 1), ("max_queue", 0), ("max_batch_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"limits must be a Limits, got {type(self.limits).__name__}")
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
    """Stops at the step whose token completes one of ``stop`` in the answer's text.

    The text comes a token at a time (`detok.IncrementalDetokenizer`), and only the part that can hold a new match is
    searched: the token's new text after the ``max(len(stop)) - 1`` characters before it. That stops at the same
    token as searching the whole decoded answer after every token."""

    def __init__(self, tokenizer, prompt_length: int, stop: list[str]):
        self.tokenizer, self.prompt_length, self.stop = tokenizer, prompt_length, stop
        self.stopped = False
        self._text: IncrementalDetokenizer | None = None

    def __call__(self, input_ids, scores, **kwargs):
        self.raincheck_host_stop(input_ids[0, self.prompt_length:].tolist())
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)

    def raincheck_host_stop(self, answer: list[int]) -> bool:
        """The same check on the answer's token ids as host ints: the batching loop calls it after its one read of
        the step's tokens (``__call__`` reads ``input_ids`` back from the device, which would make the loop wait for
        the device before it prepares the next step)."""
        if not self.stopped and self.stop:
            text = self._text
            seen = len(text.ids) if text is not None else 0
            # each call's answer extends the last one's; one that does not (a caller's own) starts the text again
            if text is None or len(answer) < seen or (seen and answer[seen - 1] != text.ids[-1]):
                text = self._text = IncrementalDetokenizer(self.tokenizer, max(0, *(len(s) - 1 for s in self.stop)))
                seen = 0
            text.add(answer[seen:])
            self.stopped = any(s in text.recent for s in self.stop)
        return self.stopped


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
        self._moved: dict = {}  # (device, dtype) -> (ids, values) there: moved once per request, not per token

    def __call__(self, input_ids, scores):
        key = (scores.device, scores.dtype)
        moved = self._moved.get(key)
        if moved is None:  # (pinned and non-blocking: a pageable copy to a GPU would wait for the step it follows)
            moved = self._moved[key] = (to_device(self.ids, scores.device),
                                        to_device(self.values.to(scores.dtype), scores.device))
        ids, values = moved
        scores = scores.clone()
        scores[:, ids] += values
        return scores

    def raincheck_row_key(self):
        """Row-wise and blind to ``input_ids``: the batching loop applies equal biases to several requests' rows at
        once (`batch_loop.row_key`)."""
        return ("logit_bias", tuple(sorted(zip(self.ids.tolist(), self.values.tolist()))))


class _Pieces(BaseStreamer):
    """Hands the answer's new text to ``emit`` after every token (from the generating thread); text that
    ends inside a multi-byte character waits for the token that completes it (`detok.IncrementalDetokenizer`)."""

    def __init__(self, tokenizer, emit, on_tokens=None):
        self.emit, self.on_tokens, self.prompt_seen = emit, on_tokens, False
        self.text = IncrementalDetokenizer(tokenizer)

    def put(self, value):
        if not self.prompt_seen:  # the prompt comes first
            self.prompt_seen = True
            return
        new = value.reshape(-1).tolist()
        if self.on_tokens is not None:
            self.on_tokens(len(new))
        self._hand_out(self.text.add(new))

    def end(self):
        self._hand_out(self.text.finish())

    def _hand_out(self, piece: str) -> None:
        if piece:
            self.emit(("text", piece))


class _Handoff:
    """Pieces for the event loop's consumers, handed over together (``flush``) rather than one at a time.

    The batching loop's thread streams a token to every running request after each step; handing each one over
    with its own `loop.call_soon_threadsafe` costs a wake-up of the event loop (a write to its self-pipe, and the
    GIL taken back afterwards) per token per request: measured as a large part of the loop thread's time with 32
    requests. Here the pieces wait in a list until the loop calls ``flush`` (after each of its iterations:
    `BatchLoop`'s ``on_handoff``), which hands them all over in one call per event loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list = []  # (event loop, queue, item)

    def put(self, loop, queue, item) -> None:
        with self._lock:
            self._items.append((loop, queue, item))

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        by_loop: dict = {}
        for loop, queue, item in items:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is gone (shutdown): nobody reads these pieces
                pass


def _deliver(batch) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


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
    ticket: Ticket | None = None  # its place in the admission control, released when the turn ends


class Server:
    """The model, its held conversations and the metrics; `create_app` routes HTTP to it."""

    def __init__(self, model, processor, settings: ServeSettings):
        # (its own copy of the processor, whose image processor keeps what it made of a picture: a follow-up
        # resends the conversation's images, `ProcessedImages`)
        self.model, self.processor, self.settings = model, with_processed_images(processor), settings
        self.store = ConversationStore(model, processor, settings.max_cache_bytes, reuse=settings.reuse,
                                       background=not settings.batching)
        self.admission = Admission(settings.max_running, settings.max_queue)
        self.metrics = Metrics(self.store.snapshot, self.admission.snapshot, batching=settings.batching)
        self.scheduler = None
        self.handoff = None  # batching: the loop's pieces, handed to the event loop once per step (`_Handoff`)
        if settings.batching:
            self.handoff = _Handoff()
            from .scheduler import BatchScheduler

            self.scheduler = BatchScheduler(model, self.store, settings.max_batch_tokens, settings.config,
                                            on_step=self.metrics.step, on_restore=self.metrics.restored,
                                            on_handoff=self.handoff.flush, on_join=self.metrics.joined,
                                            max_prompt_forwards=settings.max_prompt_forwards,
                                            max_preparing=settings.max_preparing,
                                            prepare_priority=settings.prepare_priority,
                                            max_sequences=settings.batch_places,
                                            memory_headroom=settings.memory_headroom)
        self.images = DecodedImages()  # a follow-up resends the conversation's images: decoded once
        self.created = int(time.time())
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.context = int(getattr(text, "max_position_embeddings", 0) or 0) or None
        self.kv_bytes_per_token = kv_bytes_per_token(model)
        self.kv_tokens = (None if settings.max_cache_bytes is None or not self.kv_bytes_per_token
                          else settings.max_cache_bytes // self.kv_bytes_per_token)
        tok = processor.tokenizer
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.eos_ids.add(tok.convert_tokens_to_ids("<|im_end|>"))

    def forget_media(self) -> None:
        """Forget the images decoded and processed so far (`protocol.DecodedImages`, `protocol.ProcessedImages`): the
        next request's images are decoded and processed as a new client's are. Conversations held keep their caches
        (a benchmark's rounds each start as new clients do: `bench serve-load`)."""
        self.images.clear()
        processed = getattr(self.processor, "image_processor", None)
        if isinstance(processed, ProcessedImages):
            processed.clear()

    # ---- preparing a turn (CPU, before the model) ------------------------------------------------
    def prepare(self, body, arrived: float) -> _Turn:
        """Check the request (the raw body or its parsed JSON) and tokenize it (``arrived``: when the handler
        got it, `time.perf_counter`)."""
        request = parse_chat_request(body, model_names=(self.settings.model_name,), defaults=self.settings.config,
                                     max_tokens_default=self.settings.max_tokens, media_root=self.settings.media_root,
                                     vocab_size=self.vocab_size, images=self.images, limits=self.settings.limits,
                                     check_text=self.check_text)
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
        except (ValueError, TypeError, RuntimeError, IndexError, ZeroDivisionError, OverflowError) as error:
            # e.g. an image below the processor's smallest size or of an extreme aspect ratio
            raise bad(f"the processor could not read this request's images / videos: {str(error)[:300]}",
                      param="messages", code="invalid_media") from None
        inputs.pop("mm_token_type_ids", None)
        digests = tuple(f"{m.kind}:{m.digest}" for m in request.media)
        prompt_tokens = int(inputs["input_ids"].shape[1])
        self._fit(request, prompt_tokens)
        return _Turn(request, inputs, digests, prompt_tokens, arrived)

    def limits(self) -> dict:
        """The limits in force (``/v1/models`` lists them): `Limits` with the prompt's token limits resolved."""
        out = self.settings.limits.as_dict()
        out.update(context_tokens=self.context, kv_budget_tokens=self.kv_tokens)
        return out

    def _bounds(self) -> tuple[list, int | None]:
        """``([(tokens, what says so)], the --max-prompt-tokens limit)``: the context and the KV budget bound the
        prompt and its answer, the option the prompt."""
        bounds = []
        if self.context:
            bounds.append((self.context, f"the model's context is {self.context:,} tokens"))
        if self.kv_tokens is not None:
            bounds.append((self.kv_tokens, f"the server's KV budget (--max-cache-gb) holds {self.kv_tokens:,} tokens "
                                           f"({self.kv_bytes_per_token:,} bytes each)"))
        return bounds, self.settings.limits.max_prompt_tokens

    def _too_long(self, size: str) -> APIError:
        bounds, limit = self._bounds()
        said = [f"the server's limit is {limit:,} prompt tokens (--max-prompt-tokens)"] if limit is not None else []
        return bad(f"this request's prompt is {size}; {'; '.join(said + [w for _, w in bounds])}, and the answer "
                   "needs at least one more. Shorten the conversation or send fewer or smaller images.",
                   param="messages", code="context_length_exceeded")

    def _fit(self, request: ChatRequest, prompt_tokens: int) -> None:
        """The prompt within the model's context, --max-prompt-tokens and the KV budget (400 naming them); the
        answer's length capped at the room left (it then ends with finish_reason "length")."""
        bounds, limit = self._bounds()
        room = min((b for b, _ in bounds), default=None)
        if (limit is not None and prompt_tokens > limit) or (room is not None and prompt_tokens >= room):
            raise self._too_long(f"{prompt_tokens:,} tokens (the messages in the chat template, images and videos "
                                 "as their visual tokens)")
        if room is not None:
            kwargs = request.generate_kwargs
            kwargs["max_new_tokens"] = min(kwargs["max_new_tokens"], room - prompt_tokens)
            if "min_new_tokens" in kwargs:
                kwargs["min_new_tokens"] = min(kwargs["min_new_tokens"], kwargs["max_new_tokens"])

    TEXT_CHUNK = 1 << 16  # characters tokenized at a time by `check_text`

    def check_text(self, texts: list[str]) -> None:
        """A prompt whose text alone is over the bounds, refused before its media are decoded and without
        tokenizing more of it than the bounds allow: the text is tokenized a chunk at a time, cut before a
        whitespace (where the tokenizer's pre-tokenization cuts anyway; one token per cut is allowed for), and
        the count stops once it is over. (8 MB of text took 8 s to tokenize whole on a CPU.)"""
        bounds, limit = self._bounds()
        bound = min([b - 1 for b, _ in bounds] + ([limit] if limit is not None else []), default=None)
        if bound is None or sum(map(len, texts)) <= bound:  # short: the exact check after the processor suffices
            return
        tokenizer, total = self.processor.tokenizer, 0
        for text in texts:
            start = 0
            while start < len(text):
                end = start + self.TEXT_CHUNK
                if end < len(text):
                    cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                    end = cut if cut > start else end
                total += len(tokenizer(text[start:end], add_special_tokens=False)["input_ids"]) - 1
                start = end
                if total > bound:
                    raise self._too_long(f"more than {total:,} tokens (its text alone, counted up to the limit)")

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
        """Check out the conversation and answer in a thread; ``emit`` gets ("text", piece) and ("end", turn).

        The one place where a turn starts and its tokens come out: the turn holds a running place
        (``turn.ticket``, from `Admission`), given back when it ends, before ("end", turn) is emitted; its
        tokens are counted as they come. With ``batching`` the turn goes to the batching loop instead of a
        thread of its own (`_start_batched`), and None is returned."""
        try:
            if self.scheduler is not None:
                return self._start_batched(turn, emit)
            return self._start(turn, emit)
        except BaseException:
            if turn.ticket is not None:
                turn.ticket.release()
            raise

    def _checkout(self, turn: _Turn) -> tuple[dict, dict]:
        """Lend the turn its conversation; ``(inputs, generate kwargs)`` of its generate call (both paths')."""
        lent = self.store.checkout(turn.inputs["input_ids"][0], turn.digests, turn.request.config)
        turn.conversation, turn.cached, turn.reused = lent.conversation, lent.cached, lent.reused
        request = turn.request
        kwargs = dict(request.generate_kwargs)
        turn.stopper = _StopStrings(self.processor.tokenizer, turn.prompt_tokens, request.stop)
        if request.stop:
            kwargs["stopping_criteria"] = StoppingCriteriaList([turn.stopper])
        kwargs["logits_processor"] = LogitsProcessorList(self._processors(request, kwargs))
        inputs = self._new_media_only(turn) if turn.reused else turn.inputs
        return inputs, kwargs

    def _start_batched(self, turn: _Turn, emit) -> None:
        from .scheduler import BatchJob

        inputs, kwargs = self._checkout(turn)
        conv = turn.conversation

        def done(job):  # from the loop's thread, once
            turn.started = job.started
            if job.memory_wait_s:  # (its preparation found the device short of memory)
                self.metrics.memory_waited(job.memory_wait_s)
            if job.error is None:
                turn.result = job.result
            # after an error the held conversation was not changed; a new one holds nothing
            self._end(turn, emit, job.error, keep=conv.cache is not None)

        pieces = _Pieces(self.processor.tokenizer, emit, self.metrics.tokens)
        self.scheduler.submit(BatchJob(conv, turn.request.config, inputs, kwargs, pieces, turn.cancel, done,
                                       digests=turn.digests))

    def _start(self, turn: _Turn, emit) -> threading.Thread:
        inputs, kwargs = self._checkout(turn)

        def work():
            error = None
            try:
                turn.started = time.perf_counter()
                pieces = _Pieces(self.processor.tokenizer, emit, self.metrics.tokens)
                turn.result = turn.conversation.answer(inputs, turn.digests, pieces, kwargs, turn.cancel)
            except BaseException as failure:  # reported to the client; the cache may be half-written: drop it
                error = failure
            self._end(turn, emit, error, keep=False)

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

    def _end(self, turn: _Turn, emit, error: BaseException | None, keep: bool) -> None:
        """A turn's end, on either path: its error (logged unless it is the request's) or its counted result; its
        conversation back to the store (after an error only if ``keep``, else dropped); its running place given
        back (the next queued turn may start); then ("end", turn) emitted."""
        conv = turn.conversation
        try:
            if error is not None:  # reported to the client
                turn.error = error
                if not isinstance(error, (APIError, ValueError)):
                    logger.error("conversation %s failed on a request", conv.id, exc_info=error)
                if keep:
                    self.store.checkin(conv)
                else:
                    self.store.discard(conv)
            else:
                self.store.checkin(conv)
                self._count(turn)
        finally:
            if turn.ticket is not None:
                turn.ticket.release()
            emit(("end", turn))

    def _count(self, turn: _Turn) -> None:
        result = turn.result
        self.metrics.add(prompt_tokens=turn.prompt_tokens, cached_tokens=turn.cached,
                         restored_during_answer=result.restored_during_answer,
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
        if self.scheduler is not None:
            self.scheduler.close()
        self.store.close()


def cut_at_stop(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


class _Guard:
    """ASGI middleware: the API key, the body size limit, the request counter and the request log. (Plain
    ASGI, so that a handler still sees the client's disconnect in ``receive``.)

    The log's line per request: method, path, status, then what the handler noted in ``scope["state"]``
    (``raincheck_log``: the conversation, cached tokens, T1, an error's code) and the duration."""

    OPEN = ("/health", "/docs", "/openapi.json")  # no key needed

    def __init__(self, app, server: Server, routes: set):
        self.app, self.server, self.routes = app, server, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began = time.perf_counter()
        path = scope["path"]
        endpoint = path if path in self.routes else "other"
        note = scope.setdefault("state", {}).setdefault("raincheck_log", {})
        status = {"code": 500, "started": False}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        try:
            refused = self._refuse(scope, path)
            if refused is not None:
                note["error"] = refused.code
                return await _error_response(refused)(scope, receive, send_and_note)
            await self.app(scope, self._limited(receive, note), send_and_note)
        except Exception as error:  # a server fault: logged once here, the client told no more than that
            answer = _server_error(error)
            note["error"] = answer.code or answer.type
            if not status["started"]:
                await _error_response(answer)(scope, receive, send_and_note)
        finally:
            self.server.metrics.request(endpoint, status["code"])
            self._log(scope, status["code"], note, time.perf_counter() - began)

    def _refuse(self, scope, path: str) -> APIError | None:
        headers = dict(scope["headers"])
        key = self.server.settings.api_key
        if key is not None and path not in self.OPEN:
            if not secrets.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode()):
                return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (the key given "
                                     "to the server's --api-key).", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            limit = self.server.settings.limits.max_body_bytes
            if not length.isdigit():
                return APIError(400, f"Content-Length must be a number of bytes, got {length[:40]!r}.",
                                param="Content-Length")
            if int(length) > limit:
                return _too_large(int(length), limit)
        return None

    def _limited(self, receive, note: dict):
        """``receive`` that stops a body (one sent without Content-Length, or longer than it said) at the limit."""
        limit, seen = self.server.settings.limits.max_body_bytes, 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_large(None, limit)
            return message

        return limited

    def _log(self, scope, status: int, note: dict, seconds: float) -> None:
        fields = [f"{k}={note[k]}" for k in ("conversation", "cached", "t1_ms", "user", "error") if k in note]
        if scope.get("client"):  # uvicorn's access log, which this one replaces, said who asked
            fields.append(f"client={scope['client'][0]}")
        fields.append(f"duration_ms={seconds * 1e3:.1f}")
        level = logging.WARNING if status >= 500 else logging.INFO
        logger.log(level, "%s %s %d %s", scope["method"], scope["path"], status, " ".join(fields))


def _too_large(length: int | None, limit: int) -> APIError:
    size = f"{length:,} bytes" if length is not None else f"over {limit:,} bytes"
    return APIError(413, f"the request body is {size}; the server's limit is {limit:,} bytes (--max-body-mb "
                         f"{limit / 2**20:g}). Send a smaller request (fewer or smaller images and videos, less "
                         "text).", code="request_too_large")


def _error_response(error: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


def _openapi(app):
    """OpenAPI with the chat request's schema (the handler reads the body itself: `protocol.read_json`)."""
    from fastapi.openapi.utils import get_openapi

    from .schema import ChatCompletionRequest

    def build():
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.pop("$defs", {}))
            components["ChatCompletionRequest"] = schema
            error = {"type": "object", "properties": {"error": {"type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}}}}
            components["Error"] = error
            post = spec["paths"]["/v1/chat/completions"]["post"]
            post["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}}
            responses = post.setdefault("responses", {})
            for code, what in (("400", "Bad request: the message names the parameter and the value"),
                               ("401", "Missing or wrong API key"), ("404", "Model not served here"),
                               ("413", "Request body over --max-body-mb"),
                               ("429", "Every running place (--max-running) and queue place (--max-queue) taken: "
                                       "retry after the Retry-After header's seconds")):
                responses[code] = {"description": what, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Error"}}}}
            app.openapi_schema = spec
        return app.openapi_schema

    return build


DOC = """OpenAI's chat completions over held Raincheck conversations: a follow-up that resends the dialogue
continues the held conversation (`usage.prompt_tokens_details.cached_tokens`); the `raincheck` object in a
request sets Raincheck's settings, the one in a response reports selected / deferred / restored tokens and T1.
Limits (body size, prompt tokens, images, pixels, video): `GET /v1/models`."""


def create_app(model, processor, settings: ServeSettings | None = None):
    """The FastAPI app serving ``model`` (a supported model) with ``processor``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    server = Server(model, processor, settings or ServeSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(server.close)  # stop the conversations' restoration workers

    app = FastAPI(title="raincheck_hf", description=DOC, lifespan=lifespan, redoc_url=None)
    app.state.server = server
    routes = {"/v1/chat/completions", "/v1/models", "/health", "/metrics"}

    app.add_middleware(_Guard, server=server, routes=routes)

    def noted(request: Request, error: APIError):
        request.scope.setdefault("state", {}).setdefault("raincheck_log", {})["error"] = error.code or error.type
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = (f"Unknown route {request.method} {request.url.path}; this server has POST /v1/chat/completions, "
                   "GET /v1/models, GET /health, GET /metrics, GET /docs." if error.status_code in (404, 405)
                   else str(error.detail))
        return noted(request, APIError(error.status_code, message,
                                       code="not_found" if error.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):  # FastAPI's 422, as OpenAI's 400
        first = (error.errors() or [{}])[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")) or None
        return noted(request, bad(f"{param or 'the request'}: {first.get('msg', 'invalid')}.", param=param))

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return noted(request, error)

    @app.get("/health")
    async def health():
        snapshot = server.store.snapshot()
        return {"status": "ok", "model": server.settings.model_name, "conversations": snapshot["conversations"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.settings.model_name, "object": "model",
                                            "created": server.created, "owned_by": "raincheck_hf",
                                            "max_model_len": server.context, "limits": server.limits()}]}

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        note = request.scope.setdefault("state", {}).setdefault("raincheck_log", {})
        raw = await request.body()
        ticket = server.admission.reserve()  # 429 at once when the running places and the queue are full
        try:
            # parsing, media decoding and the processor: off the event loop
            turn = await asyncio.to_thread(server.prepare, raw, arrived)
            await ticket.run(request.is_disconnected)  # a running place, first come first served
        except ClientGone:  # the client went away while its request waited: it left the queue
            note["error"] = "client_gone"
            return Response(status_code=499)
        finally:
            if ticket.state != "running":
                ticket.release()
        server.metrics.queued(ticket.waited)
        turn.ticket = ticket
        if turn.request.user is not None:
            note["user"] = json.dumps(turn.request.user[:64])
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item):
            if server.scheduler is not None and server.scheduler.on_loop_thread():
                server.handoff.put(loop, queue, item)  # handed over with the step's others (`_Handoff`)
                return
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown); the thread still checks its conversation in
                pass

        # off the event loop: with batching a turn is prepared (HF's preparation; a first turn's images encoded too)
        # before it is handed to the loop (`BatchLoop.prepare_ahead`)
        try:
            await asyncio.to_thread(server.start, turn, emit)
        except asyncio.CancelledError:  # (the request's task cancelled meanwhile: its answer stops at its next step)
            turn.cancel.set()
            raise
        note.update(conversation=turn.conversation.id, cached=turn.cached)
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        name = server.settings.model_name

        def chunk(delta: dict, finish=None, **extra) -> str:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(body)}\n\n"

        if turn.request.stream:
            return StreamingResponse(_events(server, turn, queue, chunk, completion_id, created, note),
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
            error = _server_error(turn.error, logged=True)
            note["error"] = error.code or error.type
            return _error_response(error)
        _note_turn(server, turn, note)
        text = cut_at_stop(turn.result.text, turn.request.stop)
        return JSONResponse({
            "id": completion_id, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": server.finish_reason(turn), "logprobs": None}],
            "usage": server.usage(turn), "raincheck": server.raincheck(turn),
        })

    app.openapi = _openapi(app)
    return app


def _note_turn(server: Server, turn: _Turn, note: dict) -> None:
    if turn.result is not None and turn.result.token_times is not None:
        t1 = server.time_to_first_token(turn)
        if t1 == t1:
            note["t1_ms"] = f"{t1 * 1e3:.1f}"


def _server_error(error: BaseException, logged: bool = False) -> APIError:
    """The client's view of an error: an `APIError` as is, the engine's ValueError (a setting this model cannot
    use) as a 400, anything else a 500 that says no more than that (logged here once, with its traceback,
    unless ``logged``: the answering thread logged it)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return bad(str(error)[:500])
    if not logged:
        logger.error("unexpected error serving a request", exc_info=error)
    return APIError(500, "The server failed on this request (its log has the details); the conversation that was "
                         "answering it is dropped, the others are unaffected.", type="server_error",
                    code="internal_error")


async def _events(server: Server, turn: _Turn, queue: asyncio.Queue, chunk, completion_id: str, created: int,
                  note: dict):
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
            error = _server_error(turn.error, logged=True)
            note["error"] = error.code or error.type
            yield f"data: {json.dumps(error.body())}\n\n"
            return
        _note_turn(server, turn, note)
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
