"""The server's continuous-batching loop (``--batching``): one thread drives `batch_engine.BatchEngine`.

Each admitted turn is handed to `BatchScheduler.submit`; the loop's thread (the only one that runs the model in
this mode) takes it at its next iteration and

- prepares it as `generate(raincheck=...)` would: `integration.validate_request`, then HF's own preparation of
  the call through ``generate(custom_generate=...)`` (the generation config, HF's logits processors and stopping
  criteria merged with the request's, the vision encoder's outputs), with a callable that only records them;
- joins it to the running batch: ``engine.add(input_ids, cache=<the held conversation's cache>, ...)``; its prompt
  is prefilled under the step's token budget (``--max-batch-tokens``), beside the others' decode rows;
- after each step, chooses the tokens of the sequences that got logits with their own processors
  (`generation.choose_next_tokens`, the per-turn path's step; a request's processors see only its row), streams
  them, checks its stopping criteria (EOS, max_tokens, stop strings, the client gone) and either feeds the token
  back (`BatchEngine.feed`) or removes the sequence (`BatchEngine.remove`), whose `DeferredDynamicCache` becomes
  the held conversation's cache: its follow-up continues from it, as on the per-turn path.

A client that goes away: its sequence leaves before the next step (no row of it runs again); answered tokens stay
with the conversation, as `Conversation.cancel` leaves them; a turn still prefilling leaves the held conversation as
it was. A request whose preparation or processors fail leaves alone and is answered with its error; a step that
raises fails the sequences that had rows in it (each answered with the error) and the loop goes on.

Requests with different `RaincheckConfig`s run on one engine per config, the loop stepping the engines with work
in turn: the engine's config decides its row scheduling (``serial`` splits chunks into forwards of their own) and
every sequence's planning, so one engine per config keeps `BatchEngine` unchanged; the usual server has one
config and one engine. An engine left empty is dropped (its pool's memory with it), the default config's kept.

Idle-time restoration of held conversations runs in this thread only while no engine has rows to run (one chunk,
`ServedConversation.restore_chunk`, then the loop looks for new turns again), so it never delays an answer's
token; packing it into a busy step's spare budget is not done (a held conversation's leftovers are otherwise
prefilled with its follow-up, ahead of it, as on the per-turn path).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteriaList

from ..batch_engine import BatchEngine
from ..conversation import TurnResult, _CancelRequest
from ..generation import choose_next_tokens, sampling_setup
from ..integration import _ORIGINAL, VisionAttentionCapture, _needs_vision_attention, enable, validate_request
from ..models import get_adapter
from .errors import APIError

logger = logging.getLogger("raincheck_hf.serve")

GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
MEDIA = ("mm_encoder_outputs", "pixel_values", "pixel_values_videos")


def client_gone() -> APIError:
    """What a turn whose client went away before its first token gets (nobody reads it: logged as 499)."""
    return APIError(499, "The client closed the connection before the answer's first token.", code="client_gone")


@dataclass(eq=False)
class BatchJob:
    """One turn in the loop: what `Server` hands over and what the loop keeps of it while it runs.

    ``inputs``: the processor's outputs (the whole dialogue's ``input_ids``, this turn's new media only);
    ``generate_kwargs``: the per-turn path's (``max_new_tokens``, ``logits_processor``, ``stopping_criteria``,
    greedy settings); ``streamer``: the turn's `_Pieces`; ``done(job)``: called once when it ends (``result`` or
    ``error`` set), from the loop's thread."""

    conversation: object
    config: object
    inputs: dict
    digests: tuple
    generate_kwargs: dict
    streamer: object
    cancel: threading.Event
    done: object
    result: TurnResult | None = None
    error: BaseException | None = None
    started: float = 0.0
    # set when it joins
    engine: BatchEngine | None = None
    seq: object = None
    ids: torch.Tensor | None = None
    prompt_length: int = 0
    processors: object = None
    criteria: object = None
    generation_config: object = None
    finished_pad: object = None
    unfinished: torch.Tensor | None = None
    request: _CancelRequest = field(default_factory=_CancelRequest)
    times: list = field(default_factory=list)
    previous_pending: int = 0


class BatchScheduler:
    """The loop's thread, its engines and its figures (``steps``, ``batch_size``: sequences in the last step).

    Args:
        model, processor: the served model (enabled) and its processor.
        store: the server's `ConversationStore` (idle-time restoration reads its held conversations).
        token_budget: rows per step (`BatchEngine`'s ``token_budget``).
        default_config: the server's default `RaincheckConfig` (its engine is kept while empty).
        on_step: called with the step's sequence count after every step (the metrics).
    """

    IDLE_WAIT_S = 0.5

    def __init__(self, model, processor, store, token_budget: int | None, default_config, on_step=None):
        self.model, self.processor, self.store = enable(model), processor, store
        self.token_budget, self.default_config, self.on_step = token_budget, default_config, on_step
        self.adapter = get_adapter(model)
        self._incoming: collections.deque[BatchJob] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._engines: list[BatchEngine] = []
        self._jobs: dict[object, BatchJob] = {}  # sequence -> its job
        self._turn = 0  # round robin over the engines with work
        self.steps = 0
        self.batch_size = 0

    # ---- the server's side ------------------------------------------------------------------
    def submit(self, job: BatchJob) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._incoming.append(job)
            if self._thread is None:  # started with the first turn (no thread for a server never asked)
                self._thread = threading.Thread(target=self._loop, name="raincheck-batch-loop", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def close(self) -> None:
        """Stop the loop (turns still running are ended with an error) and wait for it."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    @property
    def running(self) -> int:
        """Sequences in the engines (read from any thread)."""
        return len(self._jobs)

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                with self._wake:
                    if self._closed:
                        break
                    arrivals = list(self._incoming)
                    self._incoming.clear()
                for job in arrivals:
                    self._join(job)
                self._leave_cancelled()
                engine = self._next_engine()
                if engine is not None:
                    self._step(engine)
                    continue
                if self._restore_idle():
                    continue
                with self._wake:
                    if not self._incoming and not self._closed:
                        self._wake.wait(self.IDLE_WAIT_S)
            for job in list(self._jobs.values()) + list(self._incoming):
                self._end(job, error=RuntimeError("the server shut down while this turn was running"))

    def _engine_for(self, config) -> BatchEngine:
        for engine in self._engines:
            if engine.config == config:
                return engine
        engine = BatchEngine(self.model, config, token_budget=self.token_budget)
        self._engines.append(engine)
        return engine

    def _next_engine(self) -> BatchEngine | None:
        """The next engine (round robin) with rows to run; empty engines of other configs are dropped."""
        self._engines = [e for e in self._engines if e.sequences or e.config == self.default_config]
        busy = [e for e in self._engines if not e.idle]
        if not busy:
            return None
        self._turn += 1
        return busy[self._turn % len(busy)]

    # ---- joining ------------------------------------------------------------------------------
    def _join(self, job: BatchJob) -> None:
        """Prepare ``job`` as `generate(raincheck=...)` does and add it to its config's engine; an error ends it."""
        job.started = time.perf_counter()
        if job.cancel.is_set():
            self._end(job, error=client_gone())
            return
        conv, model = job.conversation, self.model
        try:
            kwargs = dict(job.generate_kwargs)
            job.request.event = job.cancel
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), job.request])
            device = self.adapter.device
            moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in job.inputs.items()}
            call = validate_request(model, job.config, (), {**moved, "cache": conv.cache, **kwargs})
            grids = {name: call.get(name) for name in GRIDS}
            prepared = {}

            def record(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                       streamer=None, raincheck_captures=None, **model_kwargs):
                prepared.update(input_ids=input_ids, processors=logits_processor, criteria=stopping_criteria,
                                generation_config=generation_config, model_kwargs=model_kwargs)
                return input_ids

            generate = vars(model).get(_ORIGINAL, model.generate)  # HF's own generate, under the raincheck wrapper
            with contextlib.ExitStack() as stack:
                captures = (stack.enter_context(VisionAttentionCapture(model, grids))
                            if _needs_vision_attention(job.config) else None)
                generate(**call, custom_generate=record, raincheck_captures=captures)
                media = {k: prepared["model_kwargs"].get(k) for k in MEDIA if prepared["model_kwargs"].get(k)
                         is not None}
                engine = self._engine_for(job.config)
                job.previous_pending = conv.pending
                seq = engine.add(prepared["input_ids"], cache=conv.cache, captures=captures, **media,
                                 **{k: v for k, v in grids.items() if v is not None})
        except BaseException as error:  # this request's media, settings or processors: it alone fails
            self._end(job, error=error)
            return
        job.engine, job.seq = engine, seq
        job.ids = prepared["input_ids"]
        job.prompt_length = int(job.ids.shape[1])
        job.processors, job.criteria = prepared["processors"], prepared["criteria"]
        job.generation_config = prepared["generation_config"]
        _, _, job.finished_pad = sampling_setup(job.ids, job.criteria, job.generation_config)
        job.unfinished = torch.ones(1, dtype=torch.long, device=job.ids.device)
        self._jobs[seq] = job
        job.streamer.put(job.ids.cpu())  # the prompt first, as generate gives it to a streamer

    # ---- stepping -----------------------------------------------------------------------------
    def _step(self, engine: BatchEngine) -> None:
        # who has rows to run: a fed token, or prefill left (whether the step reached it shows after it)
        before = {s: (s.token is not None, s.prefill) for s in engine.sequences
                  if not s.prefilled or s.token is not None}
        try:
            logits = engine.step()
        except BaseException as error:  # every sequence that had rows in the step fails; the loop goes on
            logger.error("a batched step failed; its sequences are answered with an error", exc_info=error)
            for seq, (fed, prefill) in before.items():
                if fed or seq.prefill is not prefill:
                    self._fail(seq, error)
            return
        self.steps += 1
        self.batch_size = sum(1 for s, (fed, prefill) in before.items() if fed or s.prefill is not prefill)
        if self.on_step is not None:
            self.on_step(self.batch_size)
        for seq, row in logits.items():
            job = self._jobs[seq]
            try:
                finished = self._next_token(job, row)
            except BaseException as error:  # its processors, criteria or streamer: it alone fails
                self._fail(seq, error)
                continue
            if finished:
                self._finish(job, engine.remove(seq))

    def _next_token(self, job: BatchJob, logits: torch.Tensor) -> bool:
        """Choose, record and stream the sequence's next token; True when its answer ends (else the token is fed)."""
        token, _, _ = choose_next_tokens(logits[None], job.ids, job.processors, job.generation_config, None, None,
                                         job.unfinished, job.finished_pad)
        job.ids = torch.cat([job.ids, token[:, None]], dim=-1)
        job.times.append(time.perf_counter())
        job.unfinished = job.unfinished & ~job.criteria(job.ids, None)
        host = token.cpu()
        job.streamer.put(host)
        if bool(job.unfinished.max() == 0):
            return True
        job.engine.feed(job.seq, host[0])
        return False

    def _leave_cancelled(self) -> None:
        """Sequences whose client went away leave before the next step: a decoding one with what it answered, one
        still prefilling with nothing (its held conversation stays as it was)."""
        for seq, job in list(self._jobs.items()):
            if not job.cancel.is_set():
                continue
            if seq.prefilled:
                job.request.stopped = True
                self._finish(job, job.engine.remove(seq))
            else:
                self._drop(seq)
                self._end(job, error=client_gone())

    def _restore_idle(self) -> bool:
        """One chunk of a held conversation's leftover deferred rows, while no engine has rows to run."""
        conv = self.store.next_to_restore()
        if conv is None:
            return False
        try:
            return conv.restore_chunk() > 0
        except BaseException as error:  # its cache cannot be trusted any more
            logger.error("idle-time restoration of %s failed; the conversation is dropped", conv.id, exc_info=error)
            self.store.discard(conv)
            return True

    # ---- leaving ------------------------------------------------------------------------------
    def _drop(self, seq) -> None:
        job = self._jobs.pop(seq)
        job.engine.discard(seq)

    def _fail(self, seq, error: BaseException) -> None:
        job = self._jobs[seq]
        self._drop(seq)
        self._end(job, error=error)

    def _finish(self, job: BatchJob, cache) -> None:
        """The answer ended (``cache``: the sequence's, from `BatchEngine.remove`): the conversation continues from
        it, with the turn in its history, as `Conversation`'s own turn leaves it."""
        self._jobs.pop(job.seq, None)
        conv = job.conversation
        try:
            job.streamer.end()
        except BaseException as error:
            self._end(job, error=error)
            return
        with conv._lock:
            result = conv._record_turn(cache, job.ids, job.seq.trace, job.prompt_length, job.times, job.started,
                                       job.previous_pending, job.request.stopped)
        conv.digests = job.digests
        self._end(job, result=result)

    def _end(self, job: BatchJob, result=None, error=None) -> None:
        job.result, job.error = result, error
        try:
            job.done(job)
        except BaseException as failure:  # the server's bookkeeping; the loop itself goes on
            logger.error("ending a batched turn failed", exc_info=failure)
