"""`Conversation`: multi-turn chat on one cache, with restoration finished in idle time.

Every turn goes through ``model.generate(..., raincheck=config, cache=...)`` with the whole
conversation as ``input_ids`` (HF's convention for continuing from a cache) and the new turn's
images only. Between turns the model's restorer (`restorer.IdleRestorer`: one thread per model for all its
conversations, the most recently used first) prefills the leftover deferred rows one chunk at a time, taking the
conversation's lock per chunk, so a follow-up waits at most one chunk. When a follow-up
arrives before restoration is done, the leftovers are prefilled in the same forward as the new
turn, ahead of it in physical order (docs/method.md §6, "early follow-up"); with
``early_follow_up=False`` the conversation instead completes restoration first (the plain
completion barrier). Both give the same logits: the leftovers never see the new turn either way.

Turns run one at a time, in the order they were asked: `ask` waits for an answer still being
generated (a streamed one included) before it reads the history. An answer stops early at its next
step when it is cancelled (`Conversation.cancel`, `StreamingTurn.close` / ``cancel``, breaking out of
the stream, or dropping it unread): a stopping criterion the conversation owns ends the decoding
loop, the history keeps exactly the tokens generated up to there, pending deferred rows stay pending
(none is lost or prefilled twice), and the next turn continues from that history as usual.

With ``loop=`` (a `batch_loop.BatchLoop` on the same model) a turn is handed to the loop instead of its own
``generate`` call: the loop's thread runs it in one forward per step with the turns of the other conversations on
the loop (continuous batching), and restores the leftovers in idle time or in the steps' spare budget (no worker
of the conversation's own). `ask` blocks (or streams) until the turn ends; its `TurnResult`, the history, the held
cache and cancellation are as without the loop (the tokens and logits are those of the same dialogue run alone;
with a `RaincheckConfig.batch_chunk_rows` cap, only under the same chunk schedule: several answers at once may
then carry smaller chunks).
A turn that fails on the loop leaves the conversation as it was before it (the loop ran it on a copy of the cache).

Positions are never taken from ``model.rope_deltas``: the engine builds every turn's 3-D
positions from the cache's own position counter.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .batch_loop import BatchLoop, BatchTurn, _CancelRequest
from .configuration import RaincheckConfig
from .generation import RaincheckTrace, restore_pending
from .integration import enable
from .models import get_adapter
from .restorer import restorer_for


@dataclass
class TurnResult:
    """One answer and what it cost.

    Attributes:
        text: the decoded answer (special tokens removed).
        token_ids: ``[n]`` generated ids.
        trace: the `RaincheckTrace` of the turn's `generate` call.
        time_to_first_token: seconds from `ask` to the first generated token.
        token_times: seconds between consecutive generated tokens (``n - 1`` values).
        restored_during_answer: deferred tokens prefilled while the answer was generated.
        restored_after_answer: deferred tokens of this turn prefilled after it (updated live by the
            restorer, or at the next turn's prefill).
        pending: deferred tokens of this turn not yet prefilled (live).
        cancelled: the answer was stopped early (`Conversation.cancel`, `StreamingTurn.close`); ``text``
            and ``token_ids`` hold what was generated until then, which is what the history keeps.
    """

    text: str
    token_ids: torch.Tensor
    trace: RaincheckTrace
    time_to_first_token: float
    token_times: list[float]
    restored_during_answer: int
    restored_after_answer: int = 0
    pending: int = 0
    wall_time: float = 0.0
    cancelled: bool = False
    output: object = field(default=None, repr=False)  # the RaincheckGenerateOutput (logits with output_logits=True)

    @property
    def time_per_output_token(self) -> float:
        return sum(self.token_times) / len(self.token_times) if self.token_times else float("nan")


class _TokenClock(BaseStreamer):
    """Records when each generated token arrives, forwarding everything to an optional streamer."""

    def __init__(self, start: float, inner: BaseStreamer | None = None):
        self.start, self.inner, self.times, self._prompt_seen = start, inner, [], False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


class StreamingTurn:
    """Iterator over the text pieces of an answer; ``.result`` is the `TurnResult` once it ends.

    Stopping early cancels the answer at its next step: `close()` (waits until it has stopped),
    `cancel()` (does not wait), breaking out of a ``for`` loop over it, or dropping it unread. The
    conversation keeps what was generated until then (``result.cancelled``); the next `ask` goes on
    from there.
    """

    def __init__(self, pieces, thread, holder, request: _CancelRequest):
        self._pieces, self._thread, self._holder, self._request = pieces, thread, holder, request

    def __iter__(self):
        finished = False
        try:
            for piece in self._pieces:
                yield piece
            finished = True
        finally:
            if not finished:  # the reader stopped: break, close() of this iterator, an error, garbage collection
                self.close()
        self._thread.join()
        if "error" in self._holder:
            raise self._holder["error"]

    def cancel(self) -> None:
        """Ask the answer to stop at its next step (returns at once)."""
        self._request.event.set()

    def close(self) -> None:
        """Stop the answer at its next step and wait until it has stopped (``result`` is then ready)."""
        self.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self):  # dropped unread: stop generating for nobody (never waits: any thread may collect it)
        request = getattr(self, "_request", None)
        if request is not None:
            request.event.set()

    @property
    def result(self) -> TurnResult:
        self._thread.join()
        if "error" in self._holder:
            raise self._holder["error"]
        return self._holder["result"]


class Conversation:
    """Multi-turn image/video chat that keeps the Raincheck cache between turns.

    Args:
        model: a supported model (enabled here if it is not yet).
        processor: its processor (chat template, image and video processors).
        config: the `RaincheckConfig` for every turn (default: `RaincheckConfig()`).
        system: optional system prompt for the first turn.
        background: restore leftovers between turns in the background (by the model's one restorer thread, shared
            with its other conversations; with ``loop``: by the loop's thread); False: only on `complete()` or at the
            next turn.
        early_follow_up: prefill leftovers together with a follow-up instead of waiting for them.
        max_new_tokens: default answer length limit (a per-call ``max_new_tokens`` wins).
        loop: a `BatchLoop` on the same model: the turns run in its batch, beside the other conversations' on it
            (default None: each turn is its own ``generate`` call).
    """

    def __init__(self, model, processor, config: RaincheckConfig | None = None, *, system: str | None = None,
                 background: bool = True, early_follow_up: bool = True, max_new_tokens: int = 256,
                 loop: BatchLoop | None = None):
        if loop is not None:
            if not isinstance(loop, BatchLoop):
                raise ValueError(f"Conversation(loop={loop!r}) must be a raincheck_hf.BatchLoop or None.")
            if loop.model is not model:
                raise ValueError(f"Conversation(loop=...) got a BatchLoop on another model (the loop's is a "
                                 f"{type(loop.model).__name__} at {id(loop.model):#x}, this conversation's a "
                                 f"{type(model).__name__} at {id(model):#x}); make the loop with this model.")
            if loop.closed:
                raise ValueError("Conversation(loop=...) got a closed BatchLoop; make a new one (or leave loop=None).")
        self.model = enable(model)
        self.loop = loop
        self.processor = processor
        self.config = config if config is not None else RaincheckConfig()
        if not isinstance(self.config, RaincheckConfig):
            raise ValueError(f"Conversation(config={config!r}) must be a RaincheckConfig.")
        if isinstance(self.config.selector, torch.Tensor):
            raise ValueError("Conversation(config=...) cannot pin a boolean selector mask: every turn has its own "
                             "multimodal tokens. Use a selector name or object.")
        self.system = system
        self.early_follow_up = early_follow_up
        self.max_new_tokens = max_new_tokens
        self.turns: list[TurnResult] = []
        self.cache = None
        self.sequences: torch.Tensor | None = None
        self._lock = threading.RLock()  # the cache and the history: one forward (or turn) at a time
        self._ask_lock = threading.Lock()  # turns start in the order they were asked
        self._in_flight: threading.Thread | None = None  # a streamed answer's thread
        self._request: _CancelRequest | None = None  # the answer being generated
        self._failed: BaseException | None = None  # a turn failed after it changed the cache
        self._closed = False
        self._background = background
        self._last_used = time.monotonic()  # the loop restores the most recently used conversation first
        self._restorer = None
        if loop is not None:
            loop.attach(self)  # the loop restores its leftovers, between its steps
        elif background:
            self._restorer = restorer_for(self.model)  # (one thread per model, for all its conversations)
            self._restorer.attach(self)

    # ---- public API -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return 0 if self.cache is None else self.cache.num_pending

    def ask(self, text: str, images=(), videos=(), stream: bool = False, video_fps: float = 2.0, **generate_kwargs):
        """Ask one question (with optional images / videos, this turn only).

        Returns a `TurnResult`, or with ``stream=True`` a `StreamingTurn` that yields text pieces.
        ``generate_kwargs`` go to `generate` (sampling settings, logits processors, stopping criteria,
        ...). An answer still being generated (streamed, or in another thread) is waited for first.
        """
        if self._closed:
            raise RuntimeError("this Conversation is closed")
        if self.loop is not None and self.loop.closed:
            raise RuntimeError("this Conversation's BatchLoop is closed: it takes no more turns (make a new "
                               "Conversation, on a new BatchLoop or with loop=None).")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("Conversation.ask(text=...) needs a non-empty question.")
        for name in ("input_ids", "cache", "raincheck", "return_dict_in_generate"):
            if name in generate_kwargs:
                raise ValueError(f"Conversation.ask() sets {name} itself; do not pass it.")
        if self.loop is not None and "raincheck_chunk_schedule" in generate_kwargs:
            raise ValueError("Conversation.ask(raincheck_chunk_schedule=...) replays a chunk schedule in a turn of "
                             "its own; a turn on a BatchLoop gets its chunks from the batch. Ask it on a Conversation "
                             "without loop=.")
        self._check_config()
        with self._ask_lock:
            in_flight = self._in_flight
            if in_flight is threading.current_thread():
                raise RuntimeError("Conversation.ask() was called from inside the answer being generated.")
            if in_flight is not None:
                in_flight.join()  # a streamed answer (cancelled or not) finishes first: it writes the history
            if self._failed is not None:
                raise RuntimeError(
                    f"an earlier turn of this Conversation (or the restoration of its deferred tokens) failed while "
                    f"it was running ({type(self._failed).__name__}: "
                    f"{self._failed}), so its cache no longer matches its history; start a new Conversation."
                ) from self._failed
            with self._lock:
                inputs = self._turn_inputs(text, list(images), list(videos), video_fps)
            request = self._request = _CancelRequest()
            if not stream:
                return self._run(inputs, None, generate_kwargs, request)
            from transformers import TextIteratorStreamer

            pieces = TextIteratorStreamer(self.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
            holder: dict = {}

            def work():
                try:
                    holder["result"] = self._run(inputs, pieces, generate_kwargs, request)
                except BaseException as error:  # surfaced to the reader of the stream
                    holder["error"] = error
                    pieces.end()

            thread = threading.Thread(target=work, name="raincheck-answer", daemon=True)
            self._in_flight = thread
            thread.start()
            return StreamingTurn(pieces, thread, holder, request)

    def cancel(self) -> bool:
        """Stop the answer being generated (streamed or not) at its next step; False when none is.

        Does not wait: a later `ask` (or the stream's ``result``) does. The history keeps what was
        generated until the answer stopped.
        """
        request = self._request
        if request is None:
            return False
        request.event.set()
        return True

    def complete(self) -> int:
        """Prefill every leftover deferred token now (chunk by chunk); returns how many. With a loop, its thread
        does it, between steps."""
        if self.loop is not None and not self.loop.closed:
            return self.loop.complete(self)
        return self._complete_here()

    def _complete_here(self) -> int:
        total = 0
        while True:
            n = self._restore_one_chunk()
            if n == 0:
                return total
            total += n

    def close(self) -> None:
        """Cancel an answer being generated and wait for it; stop restoring in the background (a chunk in
        progress finishes first)."""
        self._closed = True
        self.cancel()
        in_flight = self._in_flight
        if in_flight is not None and in_flight is not threading.current_thread():
            in_flight.join()
        if self._restorer is not None:
            self._restorer.detach(self)
        if self.loop is not None:
            self.loop.detach(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals --------------------------------------------------------------------------
    def _turn_inputs(self, text, images, videos, video_fps):
        content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
        content.append({"type": "text", "text": text})
        messages = [{"role": "user", "content": content}]
        if self.system and self.sequences is None:
            messages.insert(0, {"role": "system", "content": self.system})
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kwargs = {}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = videos
            from transformers.video_utils import VideoMetadata

            metadata = [VideoMetadata(total_num_frames=int(len(v)), fps=video_fps,
                                      frames_indices=list(range(int(len(v))))) if not isinstance(v, str) else None
                        for v in videos]
            if all(m is not None for m in metadata):
                kwargs["videos_kwargs"] = {"video_metadata": metadata}
        inputs = dict(self.processor(text=[prompt], return_tensors="pt", **kwargs))
        inputs.pop("mm_token_type_ids", None)  # positions come from input_ids (see integration.validate_request)
        if self.sequences is not None:
            glue = get_adapter(self.model).turn_glue(self.processor.tokenizer, int(self.sequences[0, -1]))
            ids = torch.cat([self.sequences, torch.tensor([glue], dtype=torch.long), inputs["input_ids"]], dim=1)
            inputs["input_ids"] = ids
            inputs["attention_mask"] = torch.ones_like(ids)
        return inputs

    def _check_config(self) -> None:
        """The config as this conversation uses it, checked before every turn (it may have been changed)."""
        if not isinstance(self.config, RaincheckConfig):
            raise ValueError(f"Conversation.config={self.config!r} must be a RaincheckConfig.")
        self.config.validate()
        if isinstance(self.config.selector, torch.Tensor):
            raise ValueError("Conversation(config=...) cannot pin a boolean selector mask: every turn has its own "
                             "multimodal tokens. Use a selector name or object.")

    def _run(self, inputs, streamer, generate_kwargs, request: _CancelRequest) -> TurnResult:
        try:
            if self.loop is not None:
                return self._loop_turn(inputs, streamer, generate_kwargs, request)
            return self._generate_turn(inputs, streamer, generate_kwargs, request)
        finally:
            if self._request is request:
                self._request = None
            if self.loop is not None:
                self.loop.notify()  # its leftovers may be restored now
            elif self._restorer is not None:
                self._restorer.wake()  # (now that no turn runs: the restorer passes over a conversation in a turn)

    def _loop_turn(self, inputs, streamer, generate_kwargs, request: _CancelRequest) -> TurnResult:
        """The turn on the loop: handed over, then waited for (the loop writes the history, `_record_turn`)."""
        if self.loop.on_loop_thread():
            raise RuntimeError("Conversation.ask() was called from its BatchLoop's own thread (a logits processor, "
                               "stopping criterion or streamer of a turn on the loop): the turn would wait for the "
                               "thread that runs it. Ask from another thread.")
        start = time.perf_counter()
        generate_kwargs, streamer = self._turn_kwargs(generate_kwargs, streamer)
        generate_kwargs["return_dict_in_generate"] = True
        ended = threading.Event()
        turn = BatchTurn(self, copy.copy(self.config), inputs, generate_kwargs, streamer, request.event,
                         lambda _: ended.set(), started=start, request=request)
        self.loop.submit(turn)
        try:
            ended.wait()
        except BaseException:  # interrupted while waiting (KeyboardInterrupt): the answer stops at its next step
            request.event.set()
            ended.wait()
            raise
        if turn.error is not None:
            raise turn.error
        return turn.result

    def _turn_kwargs(self, generate_kwargs: dict, streamer) -> tuple[dict, object]:
        """A turn's own copy of the user's ``generate`` arguments (``max_new_tokens`` defaulting to the
        conversation's) and the one streamer it reports to: ``ask(stream=True)``'s, else the user's ``streamer``
        (both: refused)."""
        generate_kwargs = dict(generate_kwargs)
        generate_kwargs.setdefault("max_new_tokens", self.max_new_tokens)
        user_streamer = generate_kwargs.pop("streamer", None)
        if streamer is not None and user_streamer is not None:
            raise ValueError("Conversation.ask(stream=True) streams itself; do not pass a streamer as well.")
        return generate_kwargs, streamer if streamer is not None else user_streamer

    def _generate_turn(self, inputs, streamer, generate_kwargs, request: _CancelRequest) -> TurnResult:
        generate_kwargs, streamer = self._turn_kwargs(generate_kwargs, streamer)
        generate_kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*(generate_kwargs.get("stopping_criteria") or []), request])
        start = time.perf_counter()
        clock = _TokenClock(start, streamer)
        with self._lock:
            if not self.early_follow_up:
                self.complete()  # the completion barrier
            previous_pending = self.pending
            # The embedding's execution device, not model.device (a parameter's device: `meta` under
            # accelerate offload); accelerate's hooks move the inputs on to each split part's device.
            device = get_adapter(self.model).device
            moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
            turn_before = None if self.cache is None else self.cache.turn
            try:
                out = self.model.generate(**moved, cache=self.cache, raincheck=self.config, streamer=clock,
                                          return_dict_in_generate=True, **generate_kwargs)
            except BaseException as error:
                # Checks fail before the cache changes and leave the conversation as it was; a failure
                # after the turn began (the cache's turn counter moved) leaves rows the history lacks.
                if self.cache is not None and self.cache.turn != turn_before:
                    self._failed = error
                raise
            # the turn's record is made under the lock too: the restorer's next chunk counts for this turn
            result = self._record_turn(out.cache, out.sequences, out.raincheck, inputs["input_ids"].shape[1],
                                       clock.times, start, previous_pending, request.stopped, output=out)
        return result

    def _record_turn(self, cache, sequences: torch.Tensor, trace, prompt_length: int, times: list[float],
                     started: float, previous_pending: bool, cancelled: bool, output=None) -> TurnResult:
        """Under the lock, after a turn's answer: the conversation continues from ``cache`` (its whole ``sequences``),
        the earlier turn's leftovers that this turn's prefill restored count for the earlier turn, and the turn
        joins the history (also the turns of a `BatchLoop`, the batching server's included)."""
        wall = time.perf_counter() - started
        self._last_used = time.monotonic()
        if self.turns and previous_pending:
            earlier = self.turns[-1]
            earlier.restored_after_answer += int(trace.restored_per_forward[0].numel())
            earlier.pending = 0
        self.cache, self.sequences = cache, sequences.cpu()
        new_ids = self.sequences[0, prompt_length:]
        result = TurnResult(
            text=self.processor.tokenizer.decode(new_ids, skip_special_tokens=True),
            token_ids=new_ids,
            trace=trace,
            time_to_first_token=(times[0] - started) if times else float("nan"),
            token_times=[b - a for a, b in zip(times, times[1:])],
            restored_during_answer=trace.restored_during_decode,
            pending=0 if cache is None else cache.num_pending,
            wall_time=wall,
            cancelled=cancelled,
            output=output,
        )
        self.turns.append(result)
        return result

    def _restore_one_chunk(self) -> int:
        with self._lock:
            if self.cache is None or self.cache.num_pending == 0:
                return 0
            restored = restore_pending(self.model, self.cache, max_tokens=self.config.idle_chunk_size)
            self._count_restored(int(restored.numel()))
            return int(restored.numel())

    def restored_beside(self, cache) -> int:
        """A `BatchLoop` restored some of the leftover deferred rows in the spare budget of its steps
        (`batch_engine.BatchEngine.restore`): ``cache``, the held one with them stored, becomes the conversation's.
        Returns how many."""
        with self._lock:
            restored = self.pending - cache.num_pending
            self.cache = cache
            self._count_restored(restored)
        return restored

    def _count_restored(self, n: int) -> None:
        """Under the lock: ``n`` leftover deferred rows were just restored after the last answer (the cache holds
        them); they count for the last turn (also a `BatchLoop`'s restoration)."""
        if self.turns:
            self.turns[-1].restored_after_answer += n
            self.turns[-1].pending = self.cache.num_pending

