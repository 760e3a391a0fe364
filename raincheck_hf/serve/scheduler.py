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

Held conversations' leftover deferred rows are restored by this thread too (the conversations have no worker of
their own in this mode), in the order `ConversationStore.next_to_restore` gives them:

- while answers run, in the steps' spare budget: up to `MAX_RESTORING` held conversations with pending rows join
  the engine being stepped as restoring sequences (`BatchEngine.restore`, a copy of the held cache in a slot);
  each step gives them pieces of their pending rows (at most an idle chunk each, as idle-time restoration takes
  them) only from the rows its token budget has left after every decode row, chunk and prompt piece, so an
  answer's token is never left out of a step for them. A restoring conversation leaves with its cache (the held
  one, the restored rows stored) when its rows are done, when a follow-up for it arrives (before the turn joins,
  which then continues from that cache), and when the engine has no answer left; one evicted meanwhile
  (``max_cache_bytes``: eviction does not wait for the loop) or in a step that raised leaves without it, and
  its conversation stays as it was. With captured decode steps (``fast_path``) the restoring pieces ride in the
  captured decode steps too (a step of decode rows and restoring pieces is replayed, not run eagerly).
- while no engine has an answer's rows to run, one chunk at a time (`ServedConversation.restore_chunk`, then the
  loop looks for new turns again).

A held conversation's leftovers not restored by then are prefilled with its follow-up, ahead of it, as on the
per-turn path.
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
from ..batched import RestoringState
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
        on_restore: called with ``(rows, busy)`` when held conversations' deferred rows were restored: in a step
            beside answers (``busy``) or in idle time (the metrics).
    """

    IDLE_WAIT_S = 0.5
    MAX_RESTORING = 2  # held conversations restoring in an engine's spare budget at once (a slot and a copy each)

    def __init__(self, model, processor, store, token_budget: int | None, default_config, on_step=None,
                 on_restore=None):
        self.model, self.processor, self.store = enable(model), processor, store
        self.token_budget, self.default_config, self.on_step = token_budget, default_config, on_step
        self.on_restore = on_restore
        self.adapter = get_adapter(model)
        self._incoming: collections.deque[BatchJob] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._engines: list[BatchEngine] = []
        self._jobs: dict[object, BatchJob] = {}  # sequence -> its job
        self._restoring: dict[object, tuple[BatchEngine, RestoringState]] = {}  # conversation -> its restoring seq
        self.restored_busy = 0  # held conversations' rows restored in steps beside answers
        self.restored_idle = 0  # ... and in idle time
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
                    self._restore_beside(engine)
                    self._step(engine)
                    continue
                for conv in list(self._restoring):  # no answer left: back to idle-time restoration
                    self._stop_restoring(conv, keep=True)
                if self._restore_idle():
                    continue
                with self._wake:
                    if not self._incoming and not self._closed:
                        self._wake.wait(self.IDLE_WAIT_S)
            for conv in list(self._restoring):
                self._stop_restoring(conv, keep=False)
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
        if conv in self._restoring:  # its cache back (the rows restored so far stored) before the turn reads it
            self._stop_restoring(conv, keep=True)
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
        restoring = {conv: seq.num_pending for conv, (e, seq) in self._restoring.items() if e is engine}
        try:
            logits = engine.step()
        except BaseException as error:  # every sequence that had rows in the step fails; the loop goes on
            logger.error("a batched step failed; its sequences are answered with an error", exc_info=error)
            for seq, (fed, prefill) in before.items():
                if fed or seq.prefill is not prefill:
                    self._fail(seq, error)
            for conv in restoring:  # their slots may be half-written: their conversations keep their own caches
                self._stop_restoring(conv, keep=False)
            return
        self.steps += 1
        restored = 0
        for conv, pending in restoring.items():
            seq = self._restoring[conv][1]
            restored += pending - seq.num_pending
            if seq.num_pending == 0:
                self._stop_restoring(conv, keep=True)
        if restored:
            self.restored_busy += restored
            if self.on_restore is not None:
                self.on_restore(restored, True)
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
        conv = self.store.next_to_restore(skip=self._restoring)
        if conv is None:
            return False
        try:
            restored = conv.restore_chunk()
        except BaseException as error:  # its cache cannot be trusted any more
            logger.error("idle-time restoration of %s failed; the conversation is dropped", conv.id, exc_info=error)
            self.store.discard(conv)
            return True
        if restored:
            self.restored_idle += restored
            if self.on_restore is not None:
                self.on_restore(restored, False)
        return restored > 0

    # ---- restoring held conversations beside the answers ---------------------------------------------
    def _restore_beside(self, engine: BatchEngine) -> None:
        """Before ``engine``'s step: restoring conversations no longer held leave; held ones with pending rows join
        it as restoring sequences, up to `MAX_RESTORING` in it, while its answers leave rows of the budget (an
        estimate; the step itself gives them only the rows its budget has left)."""
        for conv in [c for c in self._restoring if not self._held(c)]:
            self._stop_restoring(conv, keep=False)
        scheduler = engine.scheduler
        answering = sum(1 for s in engine.sequences if not isinstance(s, RestoringState))
        if scheduler.token_budget is not None and answering >= scheduler.token_budget:
            return  # their decode rows alone fill the steps
        while sum(1 for e, _ in self._restoring.values() if e is engine) < self.MAX_RESTORING:
            conv = self.store.next_to_restore(skip=self._restoring)
            if conv is None:
                return
            try:
                seq = engine.restore(conv.cache, max_rows=conv.config.idle_chunk_size)
            except BaseException as error:  # e.g. no memory for its slot: it restores in idle time instead
                logger.error("%s could not join the batch to restore its deferred tokens", conv.id, exc_info=error)
                return
            self._restoring[conv] = (engine, seq)

    def _stop_restoring(self, conv, keep: bool) -> None:
        """``conv``'s restoring sequence leaves its engine; with ``keep`` (and the conversation still held) its cache,
        the rows restored so far stored, becomes the conversation's; else the conversation stays as it was."""
        engine, seq = self._restoring.pop(conv)
        if not (keep and self._held(conv)):
            engine.discard(seq)
            return
        try:
            cache = engine.remove(seq)
        except BaseException as error:  # its held cache is still whole: it stays
            logger.error("taking %s's restored rows back failed; it keeps its cache", conv.id, exc_info=error)
            if seq in engine.sequences:
                engine.discard(seq)
            return
        conv.restored_beside(cache)

    def _held(self, conv) -> bool:
        """The store still holds ``conv`` (it was not evicted or dropped)."""
        return self.store.get(conv.id) is conv

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
