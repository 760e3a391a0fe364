"""`BatchLoop`: one thread drives `batch_engine.BatchEngine` for the turns of several conversations on one model.

Each turn is handed to `BatchLoop.submit` (a `BatchTurn`); `Conversation(..., loop=loop)` does it for its `ask`, the
server's batching mode (`serve.scheduler.BatchScheduler`, a thin layer over this class) for its requests. The loop's
thread (the only one that runs the model for them) takes the turn at its next iteration and

- prepares it as `generate(raincheck=...)` would: `integration.validate_request`, then HF's own preparation of
  the call through ``generate(custom_generate=...)`` (the generation config, HF's logits processors and stopping
  criteria merged with the turn's, the vision encoder's outputs), with a callable that only records them;
- joins it to the running batch: ``engine.add(input_ids, cache=<the conversation's cache>, ...)``; its prompt
  is prefilled under the step's token budget (``max_batch_tokens``), beside the others' decode rows;
- after each step, chooses the tokens of the sequences that got logits with their own processors
  (`generation.choose_next_tokens`, the per-turn path's step; a turn's processors see only its row; greedy turns
  whose processors act on each row alone with equal settings, `row_key`, and whose criteria are a length, an EOS and
  a cancellation are chosen together, one processor call and one argmax per group: `BatchLoop._choose_all`, the
  same tokens), streams them, checks its stopping criteria (EOS, ``max_new_tokens``, stop strings, a cancellation)
  and either feeds the token back (`BatchEngine.feed`) or removes the sequence (`BatchEngine.remove`), whose
  `DeferredDynamicCache` becomes the conversation's cache: its follow-up continues from it, as on the per-turn path.

A cancelled turn (its ``cancel`` event set): a decoding sequence leaves before the next step with the tokens it
answered, as `Conversation.cancel` leaves them. One still prefilling runs on to its first token, where its stopping
criterion ends it, as on the per-turn path (the server instead drops it: its client is gone). A turn whose
preparation or processors fail leaves alone and gets its error; a step that raises fails the sequences that had
rows in it and the loop goes on. The engine copies a conversation's cache when the turn joins, so a failed turn
leaves its conversation as it was.

Turns with different `RaincheckConfig`s run on one engine per config, the loop stepping the engines with work in
turn: the engine's config decides its row scheduling (``serial`` splits chunks into forwards of their own) and
every sequence's planning, so one engine per config keeps `BatchEngine` unchanged. An engine left empty is dropped
(its pool's memory with it) unless a conversation on the loop still uses its config (`_keeps`).

Conversations on the loop are not on the model's restorer thread (`restorer.IdleRestorer`): their leftover deferred rows are restored by the
loop's thread, in the order `_next_to_restore` gives them (the most recently used first):

- while answers run, in the steps' spare budget: up to `MAX_RESTORING` conversations with pending rows join the
  engine being stepped as restoring sequences (`BatchEngine.restore`, a copy of the cache in a slot); each step
  gives them pieces of their pending rows (at most an idle chunk each) only from the rows its token budget has left
  after every decode row, chunk and prompt piece, so an answer's token is never left out of a step for them. A
  restoring conversation leaves with its cache (the restored rows stored) when its rows are done, when a turn of
  it arrives (before the turn joins, which then continues from that cache), and when the engine has no answer
  left; one no longer held (closed, or evicted by the server) or in a step that raised leaves without it, and its
  conversation stays as it was. With captured decode steps (CUDA, ``fast_path`` not False) the restoring pieces
  ride in the captured decode steps too (a step of decode rows and restoring pieces is replayed, not run eagerly).
- while no engine has an answer's rows to run, one chunk at a time (then the loop looks for new turns again).

Leftovers not restored by then are prefilled with the conversation's next turn, ahead of it, as on the per-turn
path.

Where the loop's time goes: `BatchLoop.step_stats`, from its `step_log.StepLog` (the last `BatchLoop.RECENT_STEPS`
steps one by one and running totals per kind; each turn's wait, join and steps to its first token).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteriaList
from transformers.generation.logits_process import (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                                                    SuppressTokensLogitsProcessor)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria

from .batch_engine import SPLIT_ROWS, BatchEngine, check_prompt_forwards, check_ride_rows, check_split_rows
from .cache_utils import to_device, to_device_all
from .batched import RestoringState, SequenceState, new_sequence
from .configuration import PREPARE_PRIORITIES, RaincheckConfig, is_limit
from .fast.graphs import private_pools_free_bytes, usable_device_memory
from .fast.scoping import device_work, used_on
from .fast.vision_graphs import vision_graphs_for
from .generation import RaincheckGenerateOutput, choose_next_tokens, sampling_setup
from .integration import _ORIGINAL, VisionAttentionCapture, _needs_vision_attention, enable, validate_request
from .kv_pool import kv_bytes_per_token
from .models import get_adapter
from .step_log import StepLog

logger = logging.getLogger("raincheck_hf.batch_loop")

GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
PIXELS = ("pixel_values", "pixel_values_videos")
MEDIA = ("mm_encoder_outputs", *PIXELS)


def _media(prepared: dict, adapter) -> dict:
    """The turn's media among what HF's preparation gave (`BatchLoop._prepare`): `BatchEngine.add`'s arguments.
    Pixels held back from HF's preparation (where a batch-1 `generate(raincheck=...)` call's would be:
    `ModelAdapter.use_vision_graphs`, no precomputed encoder outputs, no selector reading the tower's attention) go
    through the vision tower replayed per grid (`fast.vision_graphs`), so a turn joining the loop encodes its media
    as the same turn asked alone does."""
    kwargs = prepared["model_kwargs"]
    media = {k: kwargs[k] for k in MEDIA if kwargs.get(k) is not None}
    if prepared.get("pixels"):
        media.update(prepared["pixels"], vision_graphs=vision_graphs_for(adapter))
    return media


@dataclass(frozen=True)
class _NoRoom:
    """In place of an ended answer's cache: no device memory could be made to copy it out of the batched pool
    (`BatchLoop._take_out`); ``error`` is what the copy raised (`BatchLoop._settle`)."""

    error: BaseException


class _CancelRequest(StoppingCriteria):
    """The stopping criterion a conversation adds to each turn: once ``event`` is set, the decoding
    loop stops at its next stopping check (after the token it just sampled)."""

    def __init__(self):
        self.event = threading.Event()
        self.stopped = False  # the event ended the answer

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        cancelled = self.event.is_set()
        self.stopped = self.stopped or cancelled
        return torch.full((input_ids.shape[0],), cancelled, dtype=torch.bool, device=input_ids.device)


@dataclass(eq=False)
class BatchTurn:
    """One turn in the loop: what its caller hands over and what the loop keeps of it while it runs.

    ``conversation``: the `Conversation` it continues (its ``cache`` is read when the turn joins, its history written
    when it ends); ``inputs``: the processor's outputs (the whole dialogue's ``input_ids``, this turn's new media
    only); ``generate_kwargs``: what its `generate` call would take (``max_new_tokens``, ``logits_processor``,
    ``stopping_criteria``, sampling settings, ``return_dict_in_generate`` / ``output_logits`` / ``output_scores``);
    ``streamer``: a transformers streamer or None (the prompt first, then each token, then ``end()``);
    ``cancel``: set, the answer stops at its next step; ``done(turn)``: called once when it ends (``result`` or
    ``error`` set), from the loop's thread; ``started``: `time.perf_counter` when it was asked (0: when it is
    submitted)."""

    conversation: object
    config: RaincheckConfig
    inputs: dict
    generate_kwargs: dict
    streamer: object
    cancel: threading.Event
    done: object
    result: object = None
    error: BaseException | None = None
    started: float = 0.0
    # set when it joins
    engine: BatchEngine | None = None
    seq: object = None
    ids: torch.Tensor | None = None
    host_ids: torch.Tensor | None = None  # the prompt's ids on the host, when its preparation read them
    prompt_length: int = 0
    processors: object = None
    criteria: object = None
    generation_config: object = None
    finished_pad: object = None
    unfinished: torch.Tensor | None = None
    scores: tuple | None = None
    raw_logits: tuple | None = None
    request: object = None  # the conversation's `_CancelRequest` (a new one when None), in its stopping criteria
    times: list = field(default_factory=list)
    previous_pending: int = 0
    # `BatchLoop.prepare_ahead`'s result (HF's preparation, its sequence or None, its grids), or the error it raised;
    # taken when it joins
    ahead: object = None
    ahead_s: float = 0.0  # the time `BatchLoop.prepare_ahead` took
    ahead_wait_s: float = 0.0  # of it, waiting for its place among the preparations (`BatchLoop.max_preparing`)
    ahead_cpu_s: float = 0.0  # of it, the asking thread's CPU time
    memory_wait_s: float = 0.0  # of it, waiting for device memory (`BatchLoop.memory_headroom`)
    # a turn chosen with others (`_shared_plan`): its group key, its answer's tokens so far (host ints, not yet in
    # ``ids``), its length with them, and what its stopping criteria check
    shared: tuple | None = None
    tail: list = field(default_factory=list)
    length: int = 0
    max_length: int | None = None
    eos: torch.Tensor | None = None
    cancels: tuple = ()
    host_stops: tuple = ()  # its criteria checked on the host after the read (`BatchLoop._host_stop`)
    answer: list = field(default_factory=list)  # the answer's tokens so far (host ints), for them


def _listed(tensor, reads: dict | None) -> list:
    """``tensor``'s values as a flat host list: from ``reads`` (`_host_reads`, made on the thread that prepared the
    turn) when it has them, else read here (from a device tensor: a wait for the device's queue)."""
    if reads is not None and id(tensor) in reads:
        return reads[id(tensor)]
    return torch.as_tensor(tensor).reshape(-1).tolist()


def _host_reads(prepared: dict) -> dict:
    """Host copies, by ``id`` of the tensor, of what the loop's thread reads when a prepared turn joins (`row_key`,
    `_shared_plan`: the suppressed tokens and EOS ids of its processors and criteria). Made by
    `BatchLoop.prepare_ahead` on the preparing thread (with the prompt's host ids, ``prepared["host_ids"]``), whose
    stream holds only the turn's own work: read on the loop's thread, a device tensor would wait for the step
    running there (`BatchLoop._join_in_flight`)."""
    tensors = []
    for processor in prepared.get("processors") or ():
        kind = type(processor)
        if kind is SuppressTokensLogitsProcessor:
            tensors.append(processor.suppress_tokens)
        elif kind in _EOS_FLOORS:
            tensors.append(processor.eos_token_id)
    for criterion in prepared.get("criteria") or ():
        if type(criterion) is EosTokenCriteria:
            tensors.append(criterion.eos_token_id)
    return {id(t): t.reshape(-1).tolist() for t in tensors if isinstance(t, torch.Tensor)}


def row_key(processor, reads: dict | None = None):
    """A hashable key for a logits processor that acts on each row of ``scores`` alone and reads nothing of
    ``input_ids`` (processors with equal keys give every row what each gives it alone, so the loop runs one of them
    on the rows of all the turns that have them), or None. HF's `SuppressTokensLogitsProcessor` has one; any
    processor may declare one with a ``raincheck_row_key()`` method (the server's ``logit_bias``). HF's
    `MinLengthLogitsProcessor` and `MinNewTokensLengthLogitsProcessor` (``min_length``, ``min_new_tokens``: the
    server's ``min_tokens``) have one too: they read only the length of their own turn, which the loop knows on the
    host (`_no_eos_yet`). ``reads``: host copies of the tensors it reads (`_host_reads`)."""
    own = getattr(processor, "raincheck_row_key", None)
    if own is not None:
        return own()
    kind = type(processor)
    if kind is SuppressTokensLogitsProcessor:
        return ("suppress_tokens", tuple(sorted(set(_listed(processor.suppress_tokens, reads)))))
    if kind in _EOS_FLOORS:
        return (kind.__name__, tuple(sorted(set(_listed(processor.eos_token_id, reads)))))
    return None


_EOS_FLOORS = {  # HF's processors that forbid EOS while a turn is shorter than a minimum: the minimum length
    MinLengthLogitsProcessor: lambda p: p.min_length,
    MinNewTokensLengthLogitsProcessor: lambda p: p.prompt_length_to_skip + p.min_new_tokens,
}


def _no_eos_yet(members: list, k: int, scores: torch.Tensor) -> torch.Tensor:
    """The group's ``k``-th processor, each member's `MinLengthLogitsProcessor` or
    `MinNewTokensLengthLogitsProcessor`, on the group's ``scores``: the EOS ids get -inf in the rows of the turns
    shorter than their minimum (what each one does to its own row: it reads only the length of the turn's
    ``input_ids``, ``BatchTurn.length``)."""
    floor = _EOS_FLOORS[type(members[0][1].processors[k])]
    active = [job.length < floor(job.processors[k]) for _, job, _ in members]
    if not any(active):
        return scores
    first = members[0][1].processors[k]
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    mask = torch.isin(vocab, torch.as_tensor(first.eos_token_id).to(scores.device))
    if not all(active):
        rows = to_device(torch.tensor(active), scores.device)
        mask = mask[None, :] & rows[:, None]
    return torch.where(mask, -math.inf, scores)


def _shared_plan(job: "BatchTurn", reads: dict | None = None):
    """``job``'s group key when its token can be chosen together with other turns' (`BatchLoop._choose_all`), else
    None: greedy, neither scores nor logits returned, every processor with a `row_key`, every stopping criterion a
    maximum length, an EOS check or a cancellation (whose checks the loop makes for the group). Sets what the
    group's checks read of the turn. ``reads``: host copies of the tensors it reads (`_host_reads`)."""
    if job.generation_config.do_sample or job.scores is not None or job.raw_logits is not None:
        return None
    keys = []
    for processor in job.processors or ():
        key = row_key(processor, reads)
        if key is None:
            return None
        keys.append(key)
    max_length, eos, cancels = None, None, []
    for criterion in job.criteria or ():
        kind = type(criterion)
        if kind is MaxLengthCriteria:
            limit = criterion.max_position_embeddings
            if limit is not None and criterion.max_length > limit:  # (its warning past the limit: left to it)
                return None
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif kind is EosTokenCriteria and eos is None:
            eos_ids = _listed(criterion.eos_token_id, reads)
            eos = criterion.eos_token_id.to(job.ids.device)
        elif kind is _CancelRequest:
            cancels.append(criterion)
        else:
            return None
    job.max_length, job.eos, job.cancels = max_length, eos, tuple(cancels)
    job.length = int(job.ids.shape[1])
    eos_key = None if eos is None else tuple(sorted(set(eos_ids)))
    return tuple(keys), eos_key, str(job.ids.device)


def _sequence(job: "BatchTurn") -> torch.Tensor:
    """The turn's whole sequence (prompt and answer): ``ids`` with the tokens kept on the host (`BatchTurn.tail`)."""
    if job.tail:
        tail = to_device(torch.tensor([job.tail], dtype=job.ids.dtype), job.ids.device)
        job.ids, job.tail = torch.cat([job.ids, tail], dim=-1), []
    return job.ids


def _host_sequence(job: "BatchTurn") -> torch.Tensor:
    """The turn's whole sequence on the host: its prompt's host ids (`BatchTurn.host_ids`) and the answer's tokens, read
    back step by step (`BatchTurn.answer`); without host ids, the device's copied back (a wait for the device)."""
    if job.host_ids is None:
        return _sequence(job).cpu()
    answer = torch.tensor([job.answer], dtype=job.host_ids.dtype)
    return torch.cat([job.host_ids.reshape(1, -1), answer], dim=-1)


class ArrivalGate:
    """A context manager that lets at most ``limit`` threads in at once, in the order they arrived (None: every
    thread at once). ``limit`` may be changed from any thread; the threads waiting then are let in by the new one.
    ``what`` names the setting in the error a bad limit raises."""

    def __init__(self, limit: int | None, what: str = "limit"):
        self._what = what
        self._limit = self._check(limit, what)
        self._changed = threading.Condition()
        self._waiting: collections.deque = collections.deque()  # the tickets of the threads waiting, oldest first
        self._inside = 0
        self._tickets = 0

    @staticmethod
    def _check(limit, what: str) -> int | None:
        if not is_limit(limit):
            raise ValueError(f"{what}: must be None or an int >= 1, got {limit!r}.")
        return limit

    @property
    def limit(self) -> int | None:
        return self._limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        value = self._check(value, self._what)
        with self._changed:
            self._limit = value
            self._changed.notify_all()

    @property
    def inside(self) -> int:
        return self._inside

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def __enter__(self):
        with self._changed:
            ticket = self._tickets
            self._tickets += 1
            self._waiting.append(ticket)
            try:
                while self._waiting[0] != ticket or (self._limit is not None and self._inside >= self._limit):
                    self._changed.wait()
            except BaseException:  # (interrupted while waiting: its place goes to the next one)
                self._waiting.remove(ticket)
                self._changed.notify_all()
                raise
            self._waiting.popleft()
            self._inside += 1
            self._changed.notify_all()  # (the next in line may fit too)
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._inside -= 1
            self._changed.notify_all()


def _made_from(prepared: dict, cache) -> bool:
    """Whether a follow-up's sequence made ahead (`BatchLoop._follow_up_ahead`) was made from ``cache`` as it is now:
    the same object with the same pending rows (restoring its leftovers in idle time changes them in place; an
    engine's restoration gives the conversation another cache)."""
    made = prepared.get("made_from")
    return made is not None and made[0]() is cache and made[1] == cache.num_pending


def _check_budget(value, what: str) -> None:
    if not is_limit(value):
        raise ValueError(f"{what} must be an integer >= 1 (rows per step) or None (no limit), got {value!r}.")


def turn_device_bytes(adapter, rows: int, pixel_bytes: int) -> int:
    """An estimate of the device memory a turn's preparation (`BatchLoop.prepare_ahead`) takes and holds until its
    prompt is prefilled: its pixels on the device and, per row of ``rows`` (a first turn's whole prompt), its
    embeddings and DeepStack features (Qwen3-VL), each twice (the vision tower's outputs and the sequence's copies
    of them, both alive while the sequence is made)."""
    text = adapter.text_config()
    element = torch.empty((), dtype=adapter.dtype).element_size()
    per_row = int(text.hidden_size) * element * (1 + adapter.num_deepstack_layers)
    return 2 * (int(rows) * per_row + int(pixel_bytes))


def check_memory_headroom(value, setting: str | None = None) -> None:
    """``memory_headroom`` (`BatchLoop`'s, the server's ``ServeSettings.memory_headroom``): an int of bytes >= 0 (a
    bool is not taken for one), ``"auto"`` or None. The error names ``setting`` (default: ``BatchLoop(...)``)."""
    if value is None or (isinstance(value, str) and value == "auto") or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    rule = "must be a number of bytes >= 0, 'auto', or None (no admission by device memory)"
    if setting is None:
        raise ValueError(f"BatchLoop(memory_headroom={value!r}) {rule}.")
    raise ValueError(f"{setting} {rule}, got {value!r}")


def restoring_places_that_fit(model, max_running: int, max_tokens: int, free_bytes: int | None = None) -> int:
    """Places for held conversations restoring beside ``max_running`` answers (`BatchLoop.max_sequences`) that a
    batched pool of ``max_tokens`` rows a place still fits on the model's device: `BatchLoop.MAX_RESTORING` when the
    pool for ``max_running`` plus them fits its free memory (``free_bytes``; None: what CUDA reports; off CUDA
    nothing is checked), else 0 (they then restore in places the answers leave free, and in idle time). The pool's
    places go by batch bucket (`fast.batched_graphs.batch_bucket`): at ``max_running=64`` two more places make a
    bucket of 128, twice the memory."""
    from .fast.batched_graphs import PoolTooLarge, check_pool_fits

    adapter = get_adapter(model)
    try:
        check_pool_fits(adapter, max_running + BatchLoop.MAX_RESTORING, max_tokens, free_bytes=free_bytes)
    except PoolTooLarge:
        return 0
    return BatchLoop.MAX_RESTORING


class BatchLoop:
    """Continuous batching for the `Conversation`s on one model: their turns run in one forward per step.

    Usage::

        with raincheck_hf.BatchLoop(model, max_batch_tokens=2048) as loop:
            a = raincheck_hf.Conversation(model, processor, loop=loop)
            b = raincheck_hf.Conversation(model, processor, loop=loop)
            # a.ask(...) and b.ask(...) from two threads share the steps

    Args:
        model: a supported model (enabled here if it is not yet); on the eager engine its attention implementation
            must be ``sdpa`` or ``eager`` (`batch_engine.BatchEngine`).
        max_batch_tokens: rows per step: every decode row (with its deferred chunk) first, then pieces of joining
            prompts, then held conversations' restoration in what is left; None: no limit (a prompt's whole
            prefill in its first step).
        config: a `RaincheckConfig` whose engine is kept while empty (default: none; an engine is kept while a
            conversation on the loop uses its config).
        on_handoff: called on the loop's thread after each iteration (a step's tokens chosen and streamed, turns
            ended; the next step may run on the device meanwhile, launched ahead) and before the loop waits for work:
            a caller whose streamers buffer what they get hands it all to its consumers there at once (the server:
            one wake-up of its event loop per step for every request, not one per token per request).
        launch_ahead: launch steps ahead of their predecessor's streaming where they can be (below).
        join_in_flight: turns prepared ahead (`prepare_ahead`) join while a step runs on the device, before the next
            step is prepared, instead of between steps (below); False (the default): only between steps (the tokens
            are the same).
        follow_ups_ahead: a follow-up's sequence (the held cache's leftover rows ahead of the turn, its embeddings, its
            plan) is made by `prepare_ahead` on the asking thread (`_follow_up_ahead`) instead of by the loop's thread
            when the turn joins (the `follow_ups_ahead` attribute). False (the default): on an H100 at the Qwen3-VL-8B
            shape a follow-up's first token came later with it (at 8 clients its preparation took 13.6 ms against 8.8,
            its join 3.1 against 4.0) and the server gave 5% fewer tokens/s.
        max_prompt_forwards: on captured steps, the most prompt-piece forwards in one step (the `max_prompt_forwards`
            attribute); None: as many as ``max_batch_tokens`` gives.
        prepare_stream: on CUDA (the default), prepare the turns on the asking threads (`prepare_ahead`) on a CUDA
            stream of their own, one for the loop (the `prepare_stream` attribute): a preparation's reads of the device (its
            selection's, its plan's) then wait for the preparations' work only, not for the steps the loop queued
            meanwhile on the default stream, and the loop's reads do not wait for the preparations' work either. Its
            tensors are handed to the loop's stream when it is done (`fast.scoping.used_on`). Off: every preparation
            queues on the default stream.
        prepare_priority: ``"normal"`` (the default) or ``"high"``: with ``prepare_stream`` on CUDA, the preparations'
            stream at the device's highest priority (the `prepare_priority` attribute): the device schedules their
            kernels (the vision tower's, the selection's) before the steps' kernels queued on the default stream, so a
            turn asked while answers run gets its first token sooner and the running answers' steps wait that long.
        ride_max_rows: on captured steps (attention families), the most rows (batch bucket x width) a decode step
            may grow to by a short prompt riding in it (the `ride_max_rows` attribute); None: the engine's default.
        split_rows: the engines' rule for splitting a decode forward by width (`batch_engine.width_split`; the
            `split_rows` attribute): rows to a pass over the weights, default `batch_engine.SPLIT_ROWS`; None: never.
        max_preparing: the most turns prepared at once on the threads that ask (`prepare_ahead`: HF's preparation, a
            first turn's vision tower, selection and plan; the `max_preparing` attribute; default 1); the others wait
            their turn in the order they asked, so the first asked joins first and the turns join one by one. None:
            every asking thread prepares at once (they share the interpreter's lock and the device with each other
            and with the loop's thread, so all of them finish late together and join in the same steps: more
            tokens/s, later first tokens).
        max_sequences: the most sequences in one engine's steps that held conversations restoring beside the answers
            may bring it to (the `max_sequences` attribute; answers themselves are not limited by it): a server
            warmed for N places (`warm_up(batch=N)`: its pool and captured steps) keeps its steps within them. None
            (the default): up to `MAX_RESTORING` restore beside any number of answers.
        memory_headroom: on CUDA, the device memory in bytes that a turn's preparation leaves free for the loop's
            own work (the steps' token choices, prompt pieces run eagerly, the caches of answers that end; the
            `memory_headroom` attribute). Before a turn's media go to the device (`prepare_ahead`), it waits until
            the device has the turn's estimated bytes (`turn_device_bytes`) and this much more free: held
            conversations are evicted first where the loop may evict them (`_relieve_memory`: the server's), then
            it waits for answers to end. With no answer running or waiting to join, it goes ahead. ``"auto"`` (the
            default): `MEMORY_HEADROOM` (2 GiB), or 1/32 of a smaller device's memory (a 24 GB GPU: 0.75 GB), so
            that on a small GPU turns are not kept waiting for memory it never has; None: no such wait (nor is there
            one off CUDA). ``memory_waits`` counts the turns that waited. Without it, turns asked together put their
            media on the device all at once: at 64 clients of the server on an 80 GB GPU the device ran out of memory
            and the answers failed.
        on_step, on_restore, on_join: called on the loop's thread with ``(sequences, kind)`` after each step (its
            sequences answering, `batch_engine.StepRecord.kind`), ``(rows, busy)`` when held conversations' rows
            were restored (beside answers, or in idle time), and the seconds each new turn took to join (the
            server's metrics).

    Steps are launched ahead where they can be: when no turn of a step ends and nothing waits to join, leave, restore
    beside the answers or run on the loop, the next step is launched right after the step's tokens are read, and
    the loop streams them and hands them over while the device runs it (`_launch_ahead`). ``launch_ahead=False``
    (or the attribute set so between steps) launches every step after its predecessor's streaming instead (the
    tokens are the same; `bench serve-load --launch-ahead both` compares the two). With ``join_in_flight=True`` a
    turn prepared ahead joins while a step runs (`_join_in_flight`: after the step's tokens were chosen on the
    device, before the next step is prepared, which then carries its prompt), so its arrival neither stops the next
    step from being launched ahead nor leaves the device idle while it joins; by default turns join between steps
    (`bench serve-load --join-in-flight both` compares the two: on an H100 at the Qwen3-VL-8B shape joins in flight
    gave 4% fewer tokens/s at 8 and 32 clients, a follow-up's join waiting there for the running step).

    Figures (read from any thread): ``steps`` (launched), ``steps_completed`` (their tokens streamed),
    ``steps_ahead`` (launched ahead), ``joins_in_flight`` (turns that joined while a step ran), ``batch_size``
    (sequences with rows in the last step), ``max_batch_size`` (the most in one step), ``memory_waits`` (turns
    whose preparation waited for device memory), ``running`` (sequences answering now), ``restored_busy`` /
    ``restored_idle`` (held conversations' deferred rows restored beside answers / in idle time), `step_stats`
    (where the steps' time went).

    The thread starts with the first turn; `close` ends turns still running with an error and stops it.
    """

    IDLE_WAIT_S = 0.5
    _logger = logger
    MAX_RESTORING = 2  # held conversations restoring in an engine's spare budget at once (a slot and a copy each)
    RECENT_STEPS = 256  # steps kept in `step_log` (its totals cover every step since its last reset)
    MEMORY_HEADROOM = 2 << 30  # device memory a turn's preparation leaves free (``memory_headroom="auto"``) ...
    MEMORY_HEADROOM_FRACTION = 1 / 32  # ... at most this much of the device's memory
    MEMORY_POLL_S = 0.05  # a preparation waiting for device memory looks again at least this often
    POOL_REFRESH_S = 5.0  # the CUDA graphs' pools' free bytes are read again after this long (`_device_memory`)

    def __init__(self, model, max_batch_tokens: int | None = 2048, *, config: RaincheckConfig | None = None,
                 on_step=None, on_restore=None, on_handoff=None, on_join=None, launch_ahead: bool = True,
                 max_prompt_forwards: int | None = None, max_preparing: int | None = 1,
                 prepare_stream: bool = True, prepare_priority: str = "normal", ride_max_rows: int | None = None,
                 split_rows: int | None = SPLIT_ROWS, join_in_flight: bool = False, follow_ups_ahead: bool = False,
                 max_sequences: int | None = None, memory_headroom: int | str | None = "auto"):
        _check_budget(max_batch_tokens, "BatchLoop(max_batch_tokens=...)")
        check_memory_headroom(memory_headroom)
        self.memory_headroom = memory_headroom
        self.memory_waits = 0  # turns whose preparation waited for device memory (`_wait_for_memory`)
        self._freed = threading.Condition()  # notified when a turn ends (its memory may be free)
        self._pools_free: tuple[int, float] | None = None  # (the graphs' pools' free bytes, when read)
        if max_sequences is not None and (isinstance(max_sequences, bool) or not isinstance(max_sequences, int)
                                          or max_sequences < 1):
            raise ValueError(f"BatchLoop(max_sequences={max_sequences!r}) must be an integer >= 1 (sequences in one "
                             "step) or None (no limit).")
        self.max_sequences = max_sequences
        check_prompt_forwards(max_prompt_forwards, "BatchLoop(max_prompt_forwards=...)")
        self._max_prompt_forwards = max_prompt_forwards
        check_ride_rows(ride_max_rows, "BatchLoop(ride_max_rows=...)")
        self._ride_max_rows = ride_max_rows
        check_split_rows(split_rows, "BatchLoop(split_rows=...)")
        self._split_rows = split_rows
        self._preparing = ArrivalGate(max_preparing, "BatchLoop(max_preparing=...)")
        if not isinstance(prepare_stream, bool):
            raise ValueError(f"BatchLoop(prepare_stream={prepare_stream!r}) must be True or False.")
        self.prepare_stream = prepare_stream
        self.prepare_priority = prepare_priority  # (checked by the property)
        # (`_preparation_stream`: per priority, the streams made so far and those no preparation holds now)
        self._side_streams: dict[str, list] = {}
        self._free_streams: dict[str, list] = {}
        self._stream_holders: dict[int, int] = {}  # held streams (by id): how many preparations hold each
        self._stream_turn = 0
        self._side_lock = threading.Lock()
        if not isinstance(launch_ahead, bool):
            raise ValueError(f"BatchLoop(launch_ahead={launch_ahead!r}) must be True or False.")
        self.launch_ahead = launch_ahead
        if not isinstance(join_in_flight, bool):
            raise ValueError(f"BatchLoop(join_in_flight={join_in_flight!r}) must be True or False.")
        self.join_in_flight = join_in_flight
        self.joins_in_flight = 0  # turns that joined while a step ran (`_join_in_flight`)
        if not isinstance(follow_ups_ahead, bool):
            raise ValueError(f"BatchLoop(follow_ups_ahead={follow_ups_ahead!r}) must be True or False.")
        self.follow_ups_ahead = follow_ups_ahead
        self.follow_ups_made_ahead = 0  # follow-ups whose sequence `prepare_ahead` made (`_follow_up_ahead`)
        self.follow_ups_made_again = 0  # of those, made again when they joined (their held cache had changed)
        if config is not None:
            if not isinstance(config, RaincheckConfig):
                raise ValueError(f"BatchLoop(config={config!r}) must be a RaincheckConfig or None.")
            config.validate()
        self.model = enable(model)
        self.token_budget, self.default_config, self.on_step = max_batch_tokens, config, on_step
        self.on_restore, self.on_handoff, self.on_join = on_restore, on_handoff, on_join
        self.adapter = get_adapter(model)
        self._incoming: collections.deque[BatchTurn] = collections.deque()
        self._tasks: collections.deque = collections.deque()  # (callable, holder, event): run on the loop's thread
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._engines: list[BatchEngine] = []
        self._jobs: dict[object, BatchTurn] = {}  # sequence -> its turn
        self._arriving: list[BatchTurn] = []  # turns taken from the queue whose join has not run yet
        self.failures = 0  # iterations that failed with an unexpected error (`_recover`)
        self._restoring: dict[object, tuple[BatchEngine, RestoringState]] = {}  # conversation -> its restoring seq
        self._conversations = weakref.WeakSet()  # the Conversations on this loop (`attach`)
        self._conversations_lock = threading.Lock()
        self.restored_busy = 0  # held conversations' rows restored in steps beside answers
        self.restored_idle = 0  # ... and in idle time
        self._turn = 0  # round robin over the engines with work
        # a step launched ahead (`_launch_ahead`): its engine and tokens' logits, completed first thing next iteration
        self._ahead: tuple[BatchEngine, dict] | None = None
        self.steps_ahead = 0  # steps launched ahead of their predecessor's streaming
        self.steps_completed = 0  # steps whose tokens were taken (chosen, read, streamed)
        self.steps = 0
        self.batch_size = 0
        self.max_batch_size = 0
        self.step_log = StepLog(self.RECENT_STEPS)

    # ---- the callers' side ------------------------------------------------------------------------
    @property
    def max_batch_tokens(self) -> int | None:
        return self.token_budget

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job: BatchTurn) -> None:
        """Hand a turn to the loop (``job.done`` is called when it ends). The turn is prepared here first, on the
        calling thread (`prepare_ahead`; a first turn's sequence too); then it returns at once."""
        if self._closed:
            raise self._closed_error(running=False)
        job.started = job.started or time.perf_counter()
        self.prepare_ahead(job)
        with self._wake:
            if self._closed:
                raise self._closed_error(running=False)
            self._incoming.append(job)
            self._start_thread()
            self._wake.notify_all()

    def call(self, fn):
        """Run ``fn()`` on the loop's thread, between steps, and return what it returns (raise what it raises)."""
        if self.on_loop_thread():
            return fn()
        holder, finished = {}, threading.Event()
        with self._wake:
            if self._closed:
                raise self._closed_error(running=False)
            self._tasks.append((fn, holder, finished))
            self._start_thread()
            self._wake.notify_all()
        finished.wait()
        if "error" in holder:
            raise holder["error"]
        return holder.get("result")

    def attach(self, conversation) -> None:
        """``conversation`` (a `Conversation` made with ``loop=``) is on this loop: the loop restores its leftover
        deferred rows (unless it was made with ``background=False``) and keeps its config's engine."""
        if self._closed:
            raise self._closed_error(running=False)
        with self._conversations_lock:
            self._conversations.add(conversation)

    def detach(self, conversation) -> None:
        """``conversation`` was closed: the loop no longer restores it (a restoration in progress is dropped)."""
        with self._conversations_lock:
            self._conversations.discard(conversation)
        self.notify()

    def complete(self, conversation) -> int:
        """Restore every leftover deferred row of ``conversation`` now, on the loop's thread (its restoration beside
        the answers, if any, taken back first); returns how many (`Conversation.complete` on a loop)."""

        def work():
            if conversation in self._restoring:
                self._stop_restoring(conversation, keep=True)
            return conversation._complete_here()

        return self.call(work)

    def on_loop_thread(self) -> bool:
        """The calling thread is the loop's (a turn's processor, criterion or streamer runs there)."""
        return threading.current_thread() is self._thread

    def notify(self) -> None:
        """Something changed for the idle-time restoration (a turn ended): look again without waiting."""
        with self._wake:
            self._wake.notify_all()

    def close(self) -> None:
        """Stop the loop (turns still running are ended with an error) and wait for it."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def running(self) -> int:
        """Sequences answering in the engines (read from any thread)."""
        return len(self._jobs)

    def step_stats(self, recent: int = 0) -> dict:
        """Where the loop's time went, step by step, since the last `reset_step_stats` (`StepLog.snapshot`: steps
        by kind, ``"replayed"`` / ``"captured"`` / ``"eager"``, with their rows and the mean ms from a launch to the
        next and of each part of it; the time in new turns' joins and restoration; ``turns``: first turns' and
        follow-ups' ways to their first token, `step_log.TurnRecord` medians; with ``recent``, the last steps and
        turns one by one). Plain data, read from any thread."""
        return self.step_log.snapshot(recent)

    def reset_step_stats(self) -> None:
        """Start `step_stats` afresh (``steps`` and the other figures of the loop are not reset)."""
        self.step_log.reset()

    def _start_thread(self) -> None:
        if self._thread is None:  # started with the first turn (no thread for a loop never asked)
            self._thread = threading.Thread(target=self._loop, name="raincheck-batch-loop", daemon=True)
            self._thread.start()

    # ---- what the server's layer changes (`serve.scheduler.BatchScheduler`) -------------------------------
    def _closed_error(self, running: bool) -> BaseException:
        if running:
            return RuntimeError("the BatchLoop was closed while this turn was running; its conversation stays as it "
                                "was before the turn.")
        return RuntimeError("this BatchLoop is closed: it takes no more turns (make a new BatchLoop, or a "
                            "Conversation without loop=).")

    def _gone(self, job: BatchTurn) -> BaseException | None:
        """What a turn cancelled before its first token gets: None, it runs on to its first token, where its
        stopping criterion ends it (as on the per-turn path); an error, it leaves at once with it."""
        return None

    def _conversations_now(self) -> list:
        with self._conversations_lock:
            return list(self._conversations)

    def _next_to_restore(self, skip=()):
        """A held conversation with leftover deferred rows and no turn in flight (the most recently used first: the
        likeliest to get a follow-up soon), or None; conversations in ``skip`` are passed over."""
        idle = [c for c in self._conversations_now()
                if c._background and not c._closed and c._request is None and c._failed is None
                and c.pending > 0 and c not in skip]
        return max(idle, key=lambda c: c._last_used) if idle else None

    def _held(self, conv) -> bool:
        """``conv`` is still on the loop (not closed)."""
        with self._conversations_lock:
            return not conv._closed and conv in self._conversations

    def _restore_failed(self, conv, error: BaseException) -> None:
        """Idle-time restoration of ``conv`` raised: its cache cannot be trusted any more."""
        self._logger.error("idle-time restoration of a conversation failed; its next turn will say so", exc_info=error)
        conv._failed = error
        self.detach(conv)

    def _keeps(self, engine: BatchEngine) -> bool:
        """An empty engine stays (its pool, and on CUDA its captured steps) while its config may be asked again, until
        a turn of another config needs an engine (`_engine_for`: the pool goes to that one)."""
        if engine.config == self.default_config:
            return True
        return any(c.config == engine.config for c in self._conversations_now() if not c._closed)

    def _recorded(self, job: BatchTurn, result) -> None:
        """After the turn joined its conversation's history."""

    def _name(self, conv) -> str:
        return getattr(conv, "id", None) or type(conv).__name__

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                # (its device work beside the preparing threads'; a capture on any thread waits for the iteration's
                # end, and the iteration for the capture: `fast.scoping.device_work`)
                with device_work():
                    try:
                        went = self._iteration()
                    except Exception as error:  # (a bug, or the device's error): its turns end with it, not the loop
                        self._logger.error("an iteration of the batching loop failed; the turns in its engines end "
                                           "with the error", exc_info=error)
                        self._recover(error)
                        went = "ran"
                if went == "closed":
                    break
                if went == "idle":
                    self._handoff()
                    with self._wake:
                        if not self._incoming and not self._tasks and not self._closed:
                            self._wake.wait(self.IDLE_WAIT_S)
            with device_work():
                self._wind_down()

    def _iteration(self) -> str:
        """One pass of the loop: ``"closed"`` (it stops), ``"idle"`` (nothing ran: it waits for work), or ``"ran"``."""
        self._handoff()  # what the last iteration streamed and ended, to the consumers at once
        if self._ahead is not None:
            # a step launched ahead runs on the device: its tokens first (arrivals, cancellations and tasks
            # wait for it: nothing joins or leaves an engine while it has a step in flight)
            engine, logits = self._ahead
            self._ahead = None
            # (a turn whose streamer failed while it ran has left: it takes no token)
            self._complete(engine, {seq: row for seq, row in logits.items() if seq in self._jobs})
            if self._ahead is None:
                self.step_log.finished(time.perf_counter())
            return "ran"
        with self._wake:
            if self._closed:
                return "closed"
            arrivals = list(self._incoming)
            self._incoming.clear()
            tasks = list(self._tasks)
            self._tasks.clear()
        for fn, holder, finished in tasks:
            self._run_task(fn, holder, finished)
        self._join_all(arrivals)
        self._leave_cancelled()
        engine = self._next_engine()
        if engine is not None:
            began = time.perf_counter()
            self._restore_beside(engine)
            self._spent("restore", time.perf_counter() - began)
            self._step(engine)
            if self._ahead is None:  # (else the step open now is the one launched ahead)
                self.step_log.finished(time.perf_counter())
            return "ran"
        self.step_log.idle(time.perf_counter())
        for conv in list(self._restoring):  # no answer left: back to idle-time restoration
            self._stop_restoring(conv, keep=True)
        if self._restore_idle():
            return "ran"
        return "idle"

    def _join_all(self, jobs) -> None:
        self._arriving = list(jobs)  # (what `_recover` ends if an error stops the joins midway, the one joining too)
        while self._arriving:
            job = self._arriving[0]
            began, cpu = time.perf_counter(), time.thread_time()
            self._join(job)
            self._arriving.pop(0)
            self._spent("join", time.perf_counter() - began, time.thread_time() - cpu)

    def _recover(self, error: BaseException) -> None:
        """After an unexpected error in an iteration (`_loop`), so that no turn waits for a loop that stopped: every
        turn in the loop's engines and every one it was about to join ends with the error (its conversation stays as
        it was before the turn: the engines ran on copies of the held caches), the conversations restoring in the
        engines keep their held caches as they were, a step launched ahead is dropped, and the engines are closed.
        Each engine's sequences are discarded first (their slots reset), so that its pool, with the steps captured
        for it, goes back to the model for the next engine (`BatchEngine.close`): a warmed server's later answers
        do not capture steps in their middle. An engine whose sequences cannot be discarded (say, the device is
        lost) is dropped with its pool. Turns still queued and tasks stay queued."""
        self.failures += 1
        failure = RuntimeError(f"the batching loop failed while this turn was in it ({type(error).__name__}: "
                               f"{error}); its conversation stays as it was before the turn.")
        failure.__cause__ = error
        self._ahead = None
        self._restoring.clear()  # (their held caches were never changed: each engine restored a copy)
        jobs = list(self._jobs.values())
        jobs += [job for job in self._arriving if all(job is not j for j in jobs)]  # (one joining may be in both)
        self._jobs.clear()
        self._arriving = []
        engines, self._engines = self._engines, []
        for engine in engines:
            try:
                for seq in list(engine.sequences):
                    engine.discard(seq)
            except Exception as failed:  # (close drops a pool that still has sequences in it)
                self._logger.error("clearing a batch engine after a failure failed; its pool is dropped",
                                   exc_info=failed)
            try:
                engine.close()
            except Exception as failed:  # (its pool is dropped with it)
                self._logger.error("closing a batch engine after a failure failed", exc_info=failed)
        for job in jobs:  # (last: a turn's error comes back once the loop is ready for the next turns)
            self._end(job, error=failure)

    def _joins_in_flight(self, job: BatchTurn, engine: BatchEngine) -> bool:
        """Whether ``job`` may join ``engine`` while a step of it runs on the device (`_join_in_flight`): prepared
        ahead on its own thread (`prepare_ahead`: nothing of it is left to run on the loop's thread but the hand-over
        into the engine's pool, whose copies queue behind the step), of ``engine``'s config, and of a conversation that
        neither restores in an engine nor completes its restoration before a follow-up (``early_follow_up=False``):
        those run model work on the loop's thread first, and join between steps as before; so does a turn that needs
        a restoring conversation's place (`_make_room`)."""
        conv = job.conversation
        return (job.ahead is not None and job.config == engine.config and conv not in self._restoring
                and conv.early_follow_up
                and (self.max_sequences is None or len(engine.sequences) < self.max_sequences))

    def _join_in_flight(self, engine: BatchEngine) -> None:
        """The turns waiting to join ``engine`` that may (`_joins_in_flight`) join now, while its step runs on the
        device, before the next step is prepared: that step then carries their prompts, and the loop may launch it
        ahead (`_launch_ahead`) instead of leaving the device idle while they join between steps. What a join queues
        on the device (the held cache copied into the pool, a first turn's embeddings) runs after the step, on its
        stream; nothing of the step changes (its rows were placed when it launched)."""
        if not self.join_in_flight or not self._incoming:  # (most steps: nothing waits; no lock taken)
            return
        with self._wake:
            if self._closed or self._tasks:
                return
            ready, left = [], []
            for job in self._incoming:
                (ready if self._joins_in_flight(job, engine) else left).append(job)
            if not ready:
                return
            self._incoming.clear()
            self._incoming.extend(left)
        self.joins_in_flight += len(ready)
        self.step_log.joined_in_flight(len(ready))
        self._join_all(ready)

    def _wind_down(self) -> None:
        """After the loop stops: every turn still running or waiting ends with an error, every task too, and the
        engines give their pools back."""
        for conv in list(self._restoring):
            self._stop_restoring(conv, keep=False)
        with self._wake:
            left, tasks = list(self._incoming), list(self._tasks)
            self._incoming.clear()
            self._tasks.clear()
        for job in list(self._jobs.values()):
            self._drop(job.seq)
            self._end(job, error=self._closed_error(running=True))
        for job in left:
            self._end(job, error=self._closed_error(running=False))
        for _, holder, finished in tasks:
            holder["error"] = self._closed_error(running=False)
            finished.set()
        for engine in self._engines:  # every sequence has left: pools and graphs back for the model
            engine.close()
        self._engines = []
        self._handoff()

    def _spent(self, what: str, seconds: float, cpu: float = 0.0) -> None:
        self.step_log.spent(what, seconds, cpu)
        if what == "join" and self.on_join is not None:
            try:
                self.on_join(seconds)
            except BaseException as error:  # the caller's; the loop itself goes on
                self._logger.error("recording a join's time failed", exc_info=error)

    def _handoff(self) -> None:
        if self.on_handoff is None:
            return
        try:
            self.on_handoff()
        except BaseException as error:  # the caller's; the loop itself goes on
            self._logger.error("handing a step's output to its consumers failed", exc_info=error)

    def _run_task(self, fn, holder: dict, finished: threading.Event) -> None:
        try:
            holder["result"] = fn()
        except BaseException as error:  # the caller's: raised in its thread
            holder["error"] = error
        finally:
            finished.set()

    def _engine_for(self, config) -> BatchEngine:
        for engine in self._engines:
            if engine.config == config:
                return engine
        # the empty engines (the default config's stays on the loop between answers) give their pools back first, so
        # the new engine takes the kept pool with the most captured steps (`warm_up`'s) rather than a fresh one and
        # its captures mid-answer; an engine of theirs made again later takes it back the same way
        self._close_engines(keep=lambda e: bool(e.sequences))
        engine = BatchEngine(self.model, config, token_budget=self.token_budget,
                             max_prompt_forwards=self._max_prompt_forwards, ride_max_rows=self._ride_max_rows,
                             split_rows=self._split_rows)
        # a growth of its pool without device memory makes room as ended answers' caches do (weak: a kept pool may
        # outlive this loop)
        engine.pool.on_short = weakref.WeakMethod(self._relieve_memory)
        if engine.recurrent is not None:  # (the Gated DeltaNet families' per-slot states, grown with the pool's slots)
            engine.recurrent.on_short = weakref.WeakMethod(self._relieve_memory)
        self._engines.append(engine)
        return engine

    @property
    def max_preparing(self) -> int | None:
        """The most turns prepared at once on the asking threads (`prepare_ahead`), the others waiting in the order
        they asked; None: no limit. May be set from any thread: waiting turns are let in by the new limit."""
        return self._preparing.limit

    @max_preparing.setter
    def max_preparing(self, value: int | None) -> None:
        self._preparing.limit = value

    @property
    def prepare_priority(self) -> str:
        """The preparations' stream priority with `prepare_stream` on CUDA: ``"normal"`` or ``"high"`` (may be changed
        between turns; a turn being prepared keeps the stream it started on)."""
        return self._prepare_priority

    @prepare_priority.setter
    def prepare_priority(self, value: str) -> None:
        if not isinstance(value, str) or value not in PREPARE_PRIORITIES:
            raise ValueError(f"BatchLoop(prepare_priority={value!r}) must be 'normal' or 'high'.")
        self._prepare_priority = value

    @property
    def ride_max_rows(self) -> int | None:
        """The most rows a captured decode step may grow to by a short prompt riding in it (`BatchEngine`'s
        ``ride_max_rows``; None: `fast.batched_graphs.RIDE_MAX_ROWS`). May be set between steps (every engine of
        the loop follows)."""
        return self._ride_max_rows

    @ride_max_rows.setter
    def ride_max_rows(self, value: int | None) -> None:
        check_ride_rows(value, "BatchLoop.ride_max_rows")
        self._ride_max_rows = value
        for engine in list(self._engines):
            engine.ride_max_rows = value

    @property
    def split_rows(self) -> int | None:
        """The engines' rows to a pass over the weights when they split a decode forward by width
        (`batch_engine.width_split`; None: never). May be set between steps (every engine of the loop follows)."""
        return self._split_rows

    @split_rows.setter
    def split_rows(self, value: int | None) -> None:
        check_split_rows(value, "BatchLoop.split_rows")
        self._split_rows = value
        for engine in list(self._engines):
            engine.split_rows = value

    @property
    def max_prompt_forwards(self) -> int | None:
        """The most prompt-piece forwards in one step (`batch_engine.RowScheduler`; on captured steps each prompt piece
        that does not ride beside the decode rows is a forward of its own); None: as many as the token budget gives.
        May be set between steps (every engine of the loop follows)."""
        return self._max_prompt_forwards

    @max_prompt_forwards.setter
    def max_prompt_forwards(self, value: int | None) -> None:
        check_prompt_forwards(value, "BatchLoop.max_prompt_forwards")
        self._max_prompt_forwards = value
        for engine in list(self._engines):
            engine.scheduler.max_prompt_forwards = value

    def _close_engines(self, keep) -> None:
        """Close the engines for which ``keep(engine)`` is False (their pools and captured graphs go back for the
        model's later engines) and drop them from the loop."""
        kept = [e for e in self._engines if keep(e)]
        for engine in self._engines:
            if engine not in kept:
                engine.close()
        self._engines = kept

    def _next_engine(self) -> BatchEngine | None:
        """The next engine (round robin) with rows to run; empty engines no longer needed (`_keeps`) are dropped."""
        self._close_engines(keep=lambda e: bool(e.sequences) or self._keeps(e))
        busy = [e for e in self._engines if not e.idle]
        if not busy:
            return None
        self._turn += 1
        return busy[self._turn % len(busy)]

    # ---- joining ------------------------------------------------------------------------------
    def _staged(self, inputs: dict) -> dict:
        """``inputs`` with their pixels (`PIXELS`, floating host tensors) in the vision tower's dtype already: what a
        turn's preparation then copies to the device is half the bytes of float32 pixels (~16 MB for a 1,344-token
        picture instead of ~33 MB). The tower casts its pixels to its dtype first thing, with the same rounding (to
        nearest even) on the host as on the device: what it computes is unchanged. Done before a turn takes its
        place among the preparations (`prepare_ahead`), on the asking thread; the caller's dict is left as it was."""
        tower = self.adapter.vision_tower.dtype
        if not tower.is_floating_point:
            return inputs
        staged = dict(inputs)
        for key in PIXELS:
            value = staged.get(key)
            if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_floating_point()
                    and value.dtype != tower):
                staged[key] = value.to(tower)
        return staged

    def _prepare(self, job: BatchTurn, stack: contextlib.ExitStack | None,
                 inputs: dict | None = None) -> tuple[dict, dict, object]:
        """What `generate(raincheck=...)` prepares for ``job`` before its loop (HF's own preparation: the logits
        processors and stopping criteria, the media encoded by the vision tower): ``(grids, prepared, captures)``,
        ``grids`` the call's grids that it has (`BatchEngine.add`'s arguments).
        ``stack`` holds the vision attention capture of a config whose selector needs it (open through the turn's
        `BatchEngine.add`); None: the config needs none. ``inputs``: the turn's inputs as `_staged` made them
        (default: ``job.inputs`` as they are)."""
        conv, model = job.conversation, self.model
        kwargs = dict(job.generate_kwargs)
        if job.request is None:
            job.request = _CancelRequest()
        job.request.event = job.cancel
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), job.request])
        device = self.adapter.device
        # the turn's inputs to the device without waiting for it: the ids, masks and grids in one pinned copy, the
        # pixels through pinned memory of their own (the block the host allocator's again once the copy is done: as
        # many at a time as turns are prepared at once); a pageable copy would hold this thread, each one
        given = job.inputs if inputs is None else inputs
        rest = [k for k, v in given.items() if isinstance(v, torch.Tensor) and k not in PIXELS]
        moved = {**given, **dict(zip(rest, to_device_all([given[k] for k in rest], device))),
                 **{k: to_device(given[k], device) for k in PIXELS if isinstance(given.get(k), torch.Tensor)}}
        call = validate_request(model, job.config, (), {**moved, "cache": conv.cache, **kwargs})
        grids = {name: call[name] for name in GRIDS if call.get(name) is not None}
        pixels = {}
        if (call.get("mm_encoder_outputs") is None and not _needs_vision_attention(job.config)
                and self.adapter.use_vision_graphs(job.config)):
            # as `integration.enable`'s wrapper does for a batch-1 call: the pixels skip HF's eager encoding in its
            # preparation and go to the tower replayed per grid when the sequence is made (`_media`)
            pixels = {k: call.pop(k) for k in PIXELS if call.get(k) is not None}
        prepared = {"pixels": pixels}

        def record(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                   streamer=None, raincheck_captures=None, **model_kwargs):
            prepared.update(input_ids=input_ids, processors=logits_processor, criteria=stopping_criteria,
                            generation_config=generation_config, model_kwargs=model_kwargs)
            return input_ids

        generate = vars(model).get(_ORIGINAL, model.generate)  # HF's own generate, under the raincheck wrapper
        captures = None
        if _needs_vision_attention(job.config):
            captures = stack.enter_context(VisionAttentionCapture(model, grids))
        generate(**call, custom_generate=record, raincheck_captures=captures)
        return grids, prepared, captures

    def prepare_ahead(self, job: BatchTurn) -> None:
        """Prepare a turn (`_prepare`: HF's preparation, its processors and stopping criteria) on the calling thread,
        before it is handed to the loop, so that the loop's thread goes on stepping the running answers meanwhile
        instead of doing it when the turn joins. A conversation's first turn gets its sequence made here too
        (`batched.new_sequence`: the vision tower's encoding of its media, embeddings, selection, plan; the loop
        only gives it a slot: `BatchEngine.add_made`). With `follow_ups_ahead` so does a follow-up
        (`_follow_up_ahead`), from its held cache as it is now, when nothing is restoring it (its lock free at once,
        not restoring in an engine of the loop, ``early_follow_up``); the loop uses that sequence only if the held
        cache is still the one it was made from (same object, same pending rows), else makes it again when the turn
        joins (the loop may have restored some of the leftovers meanwhile). Not for a turn whose selector needs a
        vision attention capture; called from the loop's own thread it does nothing. A preparation that raises is
        kept and raised when the turn joins, so the turn fails as it would have."""
        if self.on_loop_thread() or job.ahead is not None or _needs_vision_attention(job.config):
            return
        began = time.perf_counter()
        device = self.adapter.device
        side = self.prepare_stream and device.type == "cuda"
        try:
            inputs = self._staged(job.inputs)  # (before its place in line: beside the other preparations)
        except Exception:  # (memory the host cannot give): the preparation copies them as they are
            self._logger.debug("a turn's pixels could not be staged; prepared as they are", exc_info=True)
            inputs = job.inputs
        with self._preparing:  # (its place among the preparations, in the order the turns asked)
            try:  # (the first in line waits for device memory, the others behind it)
                self._wait_for_memory(job, inputs)
            except Exception:  # (a look at the device's memory that failed: the preparation goes ahead)
                self._logger.debug("a turn's wait for device memory failed; prepared at once", exc_info=True)
            entered, cpu = time.perf_counter(), time.thread_time()
            # (device work beside the loop's, its synchronisation and hand-over included: a capture on any thread
            # waits for it to end, `fast.scoping.device_work`)
            with device_work(), (self._preparation_stream() if side else contextlib.nullcontext()) as stream:
                try:
                    on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                    with torch.no_grad(), on_stream:
                        grids, prepared, _ = self._prepare(job, None, inputs)
                        state = None
                        if job.conversation.cache is None:
                            # its sequence too (the turn's embeddings, the selection, the plan: pure functions of the
                            # turn)
                            media = _media(prepared, self.adapter)
                            state = new_sequence(self.model, self.adapter, job.config, -1,
                                                 prepared["input_ids"].reshape(-1), **media, **grids)
                            prepared["pixels"] = {}  # (encoded: their device memory free before the turn joins)
                        elif self.follow_ups_ahead:
                            state = self._follow_up_ahead(job, prepared, grids, stream)
                        if stream is not None or device.type != "cuda":  # (on its own stream: no wait for the loop)
                            try:
                                prepared["host_reads"] = _host_reads(prepared)
                                prepared["host_ids"] = prepared["input_ids"].cpu()
                            except Exception:  # (the loop's thread then reads them itself)
                                self._logger.debug("a turn's host reads failed", exc_info=True)
                        job.ahead = (prepared, state, grids)
                except Exception as error:  # the turn's media, settings or processors: raised when it joins
                    job.ahead = error
                finally:
                    if stream is not None:
                        stream.synchronize()  # (its work done before the loop reads any of it)
                if stream is not None and not isinstance(job.ahead, BaseException):
                    used_on(job.ahead, torch.cuda.default_stream(device))  # the loop's stream uses it from now on
            job.ahead_cpu_s = time.thread_time() - cpu
        job.ahead_s, job.ahead_wait_s = time.perf_counter() - began, entered - began

    def _follow_up_ahead(self, job: BatchTurn, prepared: dict, grids: dict, stream) -> SequenceState | None:
        """In `prepare_ahead`, a follow-up's sequence made from its held cache as it is now (`batched.new_sequence`:
        the cache's leftover rows ahead of the turn, the turn's embeddings, selection and plan), or None where the loop
        makes it when the turn joins: a conversation that completes its leftovers before a follow-up
        (``early_follow_up=False``: that runs the model when it joins), restores in one of the loop's engines, or
        whose lock is taken (a chunk of its leftovers being restored in idle time, in place). ``prepared["made_from"]``
        records the cache and its pending rows (`_made_from`). On a stream of its own the sequence's device work first
        waits for the loop's stream (the held cache was written there). An error here is left to the join, which makes
        the sequence again and fails the turn if that fails too."""
        conv = job.conversation
        if not conv.early_follow_up or not conv._lock.acquire(blocking=False):
            return None
        try:
            cache = conv.cache
            if cache is None or conv in self._restoring:
                return None
            if stream is not None:
                stream.wait_stream(torch.cuda.default_stream(self.adapter.device))
            state = new_sequence(self.model, self.adapter, job.config, -1, prepared["input_ids"].reshape(-1),
                                 cache=cache, **_media(prepared, self.adapter), **grids)
            if stream is not None:
                stream.synchronize()  # (its reads of the held cache done while the lock keeps the cache as it is)
            prepared["made_from"] = (weakref.ref(cache), cache.num_pending)
            self.follow_ups_made_ahead += 1
            return state
        except Exception:  # (the join makes it again, and reports what fails then)
            self._logger.debug("a follow-up's sequence could not be made ahead; made when it joins", exc_info=True)
            return None
        finally:
            conv._lock.release()

    def _device_memory(self) -> int | None:
        """Device bytes a preparation can have now (`fast.graphs.usable_device_memory`: free, and held unused by
        PyTorch's allocator outside the CUDA graphs' pools, whose free part is read from the allocator's snapshot at
        most every `POOL_REFRESH_S`); None off CUDA."""
        device = self.adapter.device
        if device.type != "cuda":
            return None
        now = time.monotonic()
        if self._pools_free is None or now - self._pools_free[1] > self.POOL_REFRESH_S:
            self._pools_free = (private_pools_free_bytes(device), now)
        return usable_device_memory(device, self._pools_free[0])

    def _headroom(self) -> int:
        """`memory_headroom` in bytes on the CUDA device (``"auto"`` resolved against its memory)."""
        if self.memory_headroom != "auto":
            return int(self.memory_headroom)
        total = torch.cuda.get_device_properties(self.adapter.device).total_memory
        return min(self.MEMORY_HEADROOM, int(total * self.MEMORY_HEADROOM_FRACTION))

    def _turn_bytes(self, job: BatchTurn, inputs: dict) -> int:
        """`turn_device_bytes` of ``job``: a first turn's whole prompt and every turn's new pixels (``inputs``)."""
        ids = inputs.get("input_ids")
        rows = int(ids.shape[-1]) if job.conversation.cache is None and isinstance(ids, torch.Tensor) else 0
        pixels = sum(v.numel() * v.element_size() for v in (inputs.get(k) for k in PIXELS)
                     if isinstance(v, torch.Tensor))
        return turn_device_bytes(self.adapter, rows, pixels)

    def _wait_for_memory(self, job: BatchTurn, inputs: dict) -> None:
        """Before ``job``'s preparation puts its media on the device (`prepare_ahead`): until the device has its
        bytes (`_turn_bytes`) and `memory_headroom` more, evict held conversations where the loop may
        (`_relieve_memory`) and wait for answers to end. It goes ahead when the memory is there, when no answer runs
        or waits to join (nothing would free any: the preparation then fails alone if the device has too little),
        or when the loop closes. The wait is ``job.memory_wait_s``."""
        if self.memory_headroom is None:
            return
        available = self._device_memory()
        if available is None:
            return
        need = self._turn_bytes(job, inputs) + self._headroom()
        if available >= need:
            return
        began = time.perf_counter()
        with self._freed:
            self.memory_waits += 1
        while available < need and not self._closed:
            relieved = self._relieve_memory(need - available)
            before, available = available, self._device_memory()
            if relieved and available > before:  # (evicted, and their memory came back: enough now?)
                continue
            if available >= need or not (self._jobs or self._incoming or self._arriving):
                break
            with self._freed:
                self._freed.wait(self.MEMORY_POLL_S)
            available = self._device_memory()
        job.memory_wait_s = time.perf_counter() - began

    MAX_PREPARATION_STREAMS = 4  # streams per priority at most; more preparations at once share them

    @contextlib.contextmanager
    def _preparation_stream(self):
        """The CUDA stream one preparation runs on with `prepare_stream` (at `prepare_priority`), held for the block:
        one no other preparation holds, made on first need, so that preparations at once
        (``max_preparing`` above 1) wait for their own work only; at most `MAX_PREPARATION_STREAMS` per priority (each
        keeps a pool of the caching allocator's), beyond that the preparations share them in turn. Free for the next
        preparation once none holds it."""
        priority = self.prepare_priority
        with self._side_lock:
            made = self._side_streams.setdefault(priority, [])
            free = self._free_streams.setdefault(priority, [])
            if free:
                stream = free.pop()
            elif len(made) < self.MAX_PREPARATION_STREAMS:
                # (torch maps a priority beyond the device's range to the nearest it has: -100 is its highest)
                stream = torch.cuda.Stream(device=self.adapter.device, priority=-100 if priority == "high" else 0)
                made.append(stream)
            else:
                self._stream_turn += 1
                stream = made[self._stream_turn % len(made)]  # (all held: shared in turn)
            self._stream_holders[id(stream)] = self._stream_holders.get(id(stream), 0) + 1
        try:
            yield stream
        finally:
            with self._side_lock:
                self._stream_holders[id(stream)] -= 1
                if not self._stream_holders[id(stream)]:
                    del self._stream_holders[id(stream)]
                    free.append(stream)

    def _join(self, job: BatchTurn) -> None:
        """Prepare ``job`` as `generate(raincheck=...)` does and add it to its config's engine; an error ends it."""
        began = time.perf_counter()
        job.started = job.started or began
        if job.cancel.is_set():
            gone = self._gone(job)
            if gone is not None:
                self._end(job, error=gone)
                return
        conv = job.conversation
        if conv in self._restoring:  # its cache back (the rows restored so far stored) before the turn reads it
            self._stop_restoring(conv, keep=True)
        if not conv.early_follow_up:  # the completion barrier, on this thread (it runs the model)
            try:
                conv._complete_here()
            except BaseException as error:  # part of the leftovers may be stored: the cache cannot be trusted
                conv._failed = error
                self._end(job, error=error)
                return
        try:
            with contextlib.ExitStack() as stack:
                ahead, job.ahead = job.ahead, None
                if isinstance(ahead, BaseException):  # (its preparation on the caller's thread failed)
                    raise ahead
                state = None
                if ahead is None:
                    grids, prepared, captures = self._prepare(job, stack)
                else:
                    (prepared, state, grids), captures = ahead, None
                engine = self._engine_for(job.config)
                self._make_room(engine)
                job.previous_pending = conv.pending
                follow_up = conv.cache is not None
                if state is not None and follow_up:
                    if _made_from(prepared, conv.cache):
                        self.step_log.follow_up_joined(made_ahead=True)
                    else:  # the held cache changed since its sequence was made (restored rows): made again
                        state = None
                        self.follow_ups_made_again += 1
                        self.step_log.follow_up_joined(made_ahead=False)
                if state is not None:
                    seq = engine.add_made(state, cache=conv.cache)
                else:
                    seq = engine.add(prepared["input_ids"], cache=conv.cache, captures=captures,
                                     **_media(prepared, self.adapter), **grids)
        except BaseException as error:  # this turn's media, settings or processors: it alone fails
            self._end(job, error=error)
            return
        job.engine, job.seq = engine, seq
        reads = prepared.get("host_reads")
        job.ids, job.host_ids = prepared["input_ids"], prepared.get("host_ids")
        job.prompt_length = int(job.ids.shape[1])
        job.processors, job.criteria = prepared["processors"], prepared["criteria"]
        # criteria that can check the answer's tokens as host ints run after the step's one read (`_host_stop`):
        # called on the device's input_ids before it, a decode would wait for the device every step
        job.host_stops = tuple(c for c in job.criteria if callable(getattr(c, "raincheck_host_stop", None)))
        if job.host_stops:
            job.criteria = StoppingCriteriaList([c for c in job.criteria if all(c is not h for h in job.host_stops)])
        job.generation_config = prepared["generation_config"]
        job.scores, job.raw_logits, job.finished_pad = sampling_setup(job.ids, job.criteria, job.generation_config)
        job.unfinished = torch.ones(1, dtype=torch.long, device=job.ids.device)
        try:
            job.shared = _shared_plan(job, reads)
        except BaseException as error:  # (a processor's key): it alone fails
            engine.discard(seq)
            self._end(job, error=error)
            return
        self._jobs[seq] = job
        self.step_log.turn_joined(id(job), job.started, began, time.perf_counter(), follow_up, len(seq.prefill),
                                  ahead_s=job.ahead_s, ahead_wait_s=job.ahead_wait_s, ahead_cpu_s=job.ahead_cpu_s)
        if job.streamer is not None:
            try:
                # the prompt first, as generate gives it to a streamer (its host copy when the preparation made one)
                job.streamer.put(job.host_ids if job.host_ids is not None else job.ids.cpu())
            except BaseException as error:  # the turn's streamer: it alone fails
                self._fail(seq, error)

    # ---- stepping -----------------------------------------------------------------------------
    def _step(self, engine: BatchEngine) -> None:
        logits = self._launch(engine)
        if logits is not None:
            self._complete(engine, logits)

    def _launch(self, engine: BatchEngine) -> dict | None:
        """Launch ``engine``'s step (the one prepared at the end of the last, unless a join or leave dropped it): its
        next-token logits per sequence (on the device, still being computed), or None: it raised (its sequences
        failed)."""
        restoring = [conv for conv, (e, _) in self._restoring.items() if e is engine]
        log = self.step_log
        launched, cpu = time.perf_counter(), time.thread_time()
        try:
            logits = engine.step()
        except BaseException as error:  # every sequence that had rows in the step fails; the loop goes on
            log.launched(None, launched)
            self._logger.error("a batched step failed; its sequences are answered with an error", exc_info=error)
            for seq in engine.carried:
                if seq in self._jobs:
                    self._fail(seq, error)
            for conv in restoring:  # their slots may be half-written: their conversations keep their own caches
                self._stop_restoring(conv, keep=False)
            return None
        after = time.thread_time()
        log.launched(engine.last_step, launched, time.perf_counter(), after - cpu, after)
        self.steps += 1
        restored = 0
        for conv in restoring:
            seq = self._restoring[conv][1]
            restored += engine.carried.get(seq, 0)  # (its piece of this step: taken when the step was decided)
            if seq.num_pending == 0:
                self._stop_restoring(conv, keep=True)
        if restored:
            self.restored_busy += restored
            if self.on_restore is not None:
                self.on_restore(restored, True)
        self.batch_size = sum(1 for s in engine.carried if not s.restores_only)
        self.max_batch_size = max(self.max_batch_size, self.batch_size)
        if self.on_step is not None:
            self.on_step(self.batch_size, engine.last_step.kind)
        return logits

    def _complete(self, engine: BatchEngine, logits: dict) -> None:
        """The launched step's tokens: chosen, fed, the next step prepared, read, streamed; turns that ended leave.
        When none ends and nothing waits to join, leave or run on the loop, the next step is launched right after the
        read, before the streaming (`_launch_ahead`), so the device runs it while the loop streams and hands over."""
        log = self.step_log
        self.steps_completed += 1
        # each sequence's token and stopping check on the device first; every one fed its token as chosen and the
        # next step prepared (its host work overlaps this step on the device: `BatchEngine.prepare`); then one read of
        # them all (the step's one wait for the device; a read per sequence would wait once per sequence), then each
        # one streams, and leaves when it ended (which drops the prepared step: the next one is decided again)
        chosen, tokens, flags, stops = self._choose_all(logits)
        if not chosen:
            return
        try:
            read = torch.stack([torch.cat(tokens), torch.cat(flags)])
            fed = engine.feed_all([seq for seq, _ in chosen], read[0])
        except BaseException as error:  # (a device error surfacing here): the step's sequences fail, the loop goes on
            for seq, _ in chosen:
                self._fail(seq, error)
            return
        self._join_in_flight(engine)  # (turns waiting to join: while the step runs, into the next one)
        step = log.open
        if step is not None:
            step.preparing, step.preparing_cpu = time.perf_counter(), time.thread_time()
        try:
            engine.prepare()
        except BaseException as error:  # (it put everything back: the next step decides again, and fails there)
            self._logger.debug("preparing the next batched step ahead failed", exc_info=error)
        if step is not None:
            step.reading, step.reading_cpu = time.perf_counter(), time.thread_time()
        try:
            read = read.t().tolist()
        except BaseException as error:  # (a device error surfacing here): the step's sequences fail, the loop goes on
            for seq, _ in chosen:
                self._fail(seq, error)
            return
        finally:
            if step is not None:
                step.read = time.perf_counter()
        got = {seq: (job, device_token, value, going and not stop)
               for (seq, job), device_token, (value, going), stop in zip(chosen, fed, read, stops)}
        # first every token's record and stopping checks (what decides whether a turn ends), then the streaming
        ended, order = False, []
        for seq in logits:  # (in the step's order, as the sequences came)
            if seq not in got:
                continue
            job, device_token, value, going = got[seq]
            device_token.value = value
            if job.shared is not None:
                job.tail.append(value)
            job.answer.append(value)
            if len(job.answer) == 1:
                log.turn_first_token(id(job), time.perf_counter() if step is None else step.read)
            try:
                going = bool(going and not self._host_stop(job))
            except BaseException as error:  # its stopping criterion: it alone fails
                self._fail(seq, error)
                ended = True
                continue
            ended = ended or not going
            order.append((seq, job, value, going))
        # turns that ended leave first, and the next step is decided without them, so that it can be launched ahead
        # of the streaming too (it was prepared with their tokens fed)
        removed = self._remove_ended(engine, order) if ended and self.launch_ahead else {}
        if not ended or removed:
            self._launch_ahead(engine, gone=removed)
        for seq, job, value, going in order:
            if seq not in self._jobs:  # (the step launched ahead failed, and with it this turn)
                continue
            try:
                finished = self._next_token(job, value, torch.long, going)
            except BaseException as error:  # its streamer: it alone fails
                if seq in removed:  # (out of the engine already: its cache is dropped, its conversation unchanged)
                    del removed[seq]
                    self._end(self._jobs.pop(seq), error=error)
                else:
                    self._fail(seq, error)
                continue
            if finished:
                self._settle(job, removed.pop(seq) if seq in removed else self._take_out(engine, [seq])[seq])

    def _remove_ended(self, engine: BatchEngine, order: list) -> dict:
        """The step's turns that ended (``order``'s entries whose ``going`` is False) out of ``engine`` now, before
        their last tokens are streamed: ``{seq: its cache}`` (`_take_out`, for `_settle`), and the next step prepared
        again without them (their removal dropped the one prepared with their tokens fed), unless no answer is left
        in it."""
        removed = self._take_out(engine, [seq for seq, _, _, going in order if not going])
        if engine.idle:  # (no answer left to step: nothing to launch ahead)
            return removed
        try:
            engine.prepare()
        except BaseException as error:  # (it put everything back: the next step decides again, and fails there)
            self._logger.debug("preparing the next batched step ahead failed", exc_info=error)
        return removed

    def _take_out(self, engine: BatchEngine, seqs: list) -> dict:
        """``{seq: its cache}`` for answers that ended, out of ``engine`` (`BatchEngine.remove_many`: their caches are
        copied out of the pool before anything of the engine changes). Without device memory for the copies, room is
        made (`_relieve_memory`: the server evicts held conversations) and they are copied once more; still without,
        they leave without their caches, each mapped to the error (`_NoRoom`): those turns fail, their conversations as
        they were before them, or get their answers without a cache (`_answer_without_cache`), while the engine's
        other answers go on."""
        try:
            return dict(zip(seqs, engine.remove_many(seqs)))
        except torch.OutOfMemoryError as error:
            failure = error
        rows = sum(engine.pool.lengths[seq.slot] for seq in seqs if seq.slot is not None)
        if self._relieve_memory(rows * kv_bytes_per_token(self.model)):
            self._logger.warning("no device memory for the caches of %d answers that ended; held conversations were "
                                 "evicted to make room", len(seqs))
            try:
                return dict(zip(seqs, engine.remove_many(seqs)))
            except torch.OutOfMemoryError as error:
                failure = error
        self._logger.error("no device memory for the caches of %d answers that ended, and none could be made: they "
                           "leave without them; the other answers go on", len(seqs), exc_info=failure)
        for seq in seqs:
            engine.discard(seq)
        return {seq: _NoRoom(failure) for seq in seqs}

    def _settle(self, job: BatchTurn, cache) -> None:
        """The answer ended and left its engine with ``cache`` (`_take_out`'s): finished, or, where there was no
        device memory for its cache, answered without it (`_answer_without_cache`) or failed with the error."""
        if not isinstance(cache, _NoRoom):
            self._finish(job, cache)
        elif self._answer_without_cache(job):
            self._finish(job, None)
        else:
            self._jobs.pop(job.seq, None)
            self._end(job, error=cache.error)

    def _answer_without_cache(self, job: BatchTurn) -> bool:
        """Whether a turn whose cache could not be copied out of the pool (`_take_out`: no device memory) still gets
        its answer, recorded without a cache (``None``): then nothing can continue its conversation from one. A
        library conversation cannot lose its state, so here the turn fails and its conversation stays as it was before
        it; the server answers and lets the conversation go (`serve.scheduler.BatchScheduler`)."""
        return False

    def _relieve_memory(self, nbytes: int) -> bool:
        """Make ``nbytes`` of device memory (for the caches of answers that ended, copied out of the pool:
        `_take_out`; for a turn's preparation: `_wait_for_memory`; for an engine's pool growing in a step:
        `kv_pool.SlotKVPool.on_short`), from any thread: whether any was made. The loop
        holds nothing it may drop (its conversations' caches are theirs); the server's scheduler evicts held
        conversations (`serve.scheduler.BatchScheduler._relieve_memory`)."""
        return False

    def _launch_ahead(self, engine: BatchEngine, gone=()) -> None:
        """Launch ``engine``'s next step now, before this step's tokens are streamed (the turns that ended in it out of
        the engine already: `_remove_ended`), when nothing the loop does between steps is due: no turn waiting to
        join (but those that may join while a step runs, `_join_in_flight`), no task, no cancellation, no other
        engine with rows to run (its turn comes first), and no held conversation waiting to restore beside the
        answers. The loop completes it first thing next iteration (`_loop`); what it streams and hands over meanwhile
        overlaps the device's step. Nothing leaves or restores beside it while it runs, and a turn joining meanwhile
        enters the step after it: a turn's tokens after it are as they would be without it. ``gone``: sequences that
        left already (a cancelled one among them keeps nothing from being launched)."""
        waiting = False  # (a turn that cannot join while a step runs joins between steps: none is launched ahead)
        if self._incoming:
            with self._wake:
                waiting = any(not (self.join_in_flight and self._joins_in_flight(job, engine))
                              for job in self._incoming)
        if (not self.launch_ahead or self._closed or waiting or self._tasks or engine.idle
                or any(e is not engine and not e.idle for e in self._engines)
                or any(job.cancel.is_set() for seq, job in self._jobs.items() if seq not in gone)
                or self._restores_beside(engine)):
            return
        logits = self._launch(engine)
        if logits is not None:
            self._ahead = (engine, logits)
            self.steps_ahead += 1
            self.step_log.ahead()

    @staticmethod
    def _host_stop(job: BatchTurn) -> bool:
        """Whether one of the turn's host criteria (a stopping criterion with ``raincheck_host_stop(answer)``, which
        takes the answer's token ids as host ints, the one just chosen included: the server's stop strings) ends the
        answer with this token. Every one is asked, as stock ``generate`` calls every criterion."""
        return any([criterion.raincheck_host_stop(job.answer) for criterion in job.host_stops])

    def _choose_all(self, logits: dict) -> tuple[list, list, list, list]:
        """Every sequence's next token and whether it goes on, on the device (nothing read back). A turn that can
        (`_shared_plan`) is chosen together with the others of its group: one float copy of their rows, one call of
        each of their (equal) processors, one argmax, one EOS check, their lengths and cancellations checked on the
        host; the others each with their own processors and criteria (`_choose`), in the step's order (a sampled
        turn draws from the global generator as it would alone). Returns ``(chosen, tokens, flags, stops)``:
        ``[(seq, job)]``, the token tensors and the device "goes on" flags in that order (to concatenate), and per
        sequence the host's "stops" (length, cancellation). A turn whose processors or criteria raise fails alone;
        a group's processors that raise are run again turn by turn, so only the turn at fault fails."""
        chosen, tokens, flags, stops = [], [], [], []
        groups: dict = {}
        for seq, row in logits.items():
            job = self._jobs[seq]
            if job.shared is not None:
                groups.setdefault(job.shared, []).append((seq, job, row))
                continue
            self._choose_alone(seq, job, row, chosen, tokens, flags, stops)
        for members in groups.values():
            try:
                scores = torch.stack([row for _, _, row in members]).to(dtype=torch.float32, copy=True)
                for k, processor in enumerate(members[0][1].processors or ()):  # (equal keys: any member's act as
                    if type(processor) in _EOS_FLOORS:  # each one's, but for its length)
                        scores = _no_eos_yet(members, k, scores)
                    else:
                        scores = processor(None, scores)
                picked = torch.argmax(scores, dim=-1)
                eos = members[0][1].eos
                going = (torch.ones_like(picked) if eos is None else (~torch.isin(picked, eos)).long())
            except BaseException as error:  # one turn's processors may be at fault: each one on its own, as alone
                self._logger.debug("a group's processors raised; its turns choose alone", exc_info=error)
                for seq, job, row in members:
                    _sequence(job)
                    job.shared = None
                    self._choose_alone(seq, job, row, chosen, tokens, flags, stops)
                continue
            tokens.append(picked)
            flags.append(going)
            for seq, job, _ in members:
                chosen.append((seq, job))
                job.length += 1
                stop = job.max_length is not None and job.length >= job.max_length
                for request in job.cancels:
                    cancelled = request.event.is_set()
                    request.stopped = request.stopped or cancelled
                    stop = stop or cancelled
                stops.append(stop)
        return chosen, tokens, flags, stops

    def _choose_alone(self, seq, job: BatchTurn, row: torch.Tensor, chosen, tokens, flags, stops) -> None:
        try:
            token = self._choose(job, row)
        except BaseException as error:  # its processors or criteria: it alone fails
            self._fail(seq, error)
            return
        chosen.append((seq, job))
        tokens.append(token.long().reshape(-1))
        flags.append(job.unfinished.max().long().reshape(-1))
        stops.append(False)

    def _choose(self, job: BatchTurn, logits: torch.Tensor) -> torch.Tensor:
        """Choose the sequence's next token (``[1]``, on the device: nothing read back) and run its stopping
        criteria (``job.unfinished``)."""
        token, job.scores, job.raw_logits = choose_next_tokens(
            logits[None], job.ids, job.processors, job.generation_config, job.scores, job.raw_logits, job.unfinished,
            job.finished_pad)
        job.ids = torch.cat([job.ids, token[:, None]], dim=-1)
        job.unfinished = job.unfinished & ~job.criteria(job.ids, job.scores)
        return token

    def _next_token(self, job: BatchTurn, token: int, dtype: torch.dtype, going: bool) -> bool:
        """Record and stream the sequence's chosen ``token`` (read back; ``dtype``: the chosen tensor's, what the
        streamer gets; the engine was fed it on the device already); True when its answer ends (``going`` False)."""
        job.times.append(time.perf_counter())
        if job.streamer is not None:
            job.streamer.put(torch.tensor([token], dtype=dtype))
        return not going

    def _leave_cancelled(self) -> None:
        """Cancelled sequences leave before the next step: a decoding one with what it answered; one still
        prefilling as `_gone` says (its conversation stays as it was when it leaves)."""
        for seq, job in list(self._jobs.items()):
            if not job.cancel.is_set():
                continue
            if seq.prefilled:
                job.request.stopped = True
                self._settle(job, self._take_out(job.engine, [seq])[seq])
                continue
            gone = self._gone(job)
            if gone is not None:
                self._drop(seq)
                self._end(job, error=gone)

    def _restore_idle(self) -> bool:
        """One chunk of a held conversation's leftover deferred rows, while no engine has rows to run."""
        conv = self._next_to_restore(skip=self._restoring)
        if conv is None:
            return False
        began = time.perf_counter()
        try:
            restored = conv._restore_one_chunk()
        except BaseException as error:  # its cache cannot be trusted any more
            self._restore_failed(conv, error)
            return True
        finally:
            self._spent("idle", time.perf_counter() - began)
        if restored:
            self.restored_idle += restored
            if self.on_restore is not None:
                self.on_restore(restored, False)
        return restored > 0

    # ---- restoring held conversations beside the answers ---------------------------------------------
    def _restore_beside(self, engine: BatchEngine) -> None:
        """Before ``engine``'s step: restoring conversations no longer held leave; held ones with pending rows join
        it as restoring sequences, up to `MAX_RESTORING` in it and `max_sequences` sequences in all, while its answers
        leave rows of the budget (an estimate; the step itself gives them only the rows its budget has left)."""
        for conv in [c for c in self._restoring if not self._held(c)]:
            self._stop_restoring(conv, keep=False)
        while self._room_beside(engine):
            conv = self._next_to_restore(skip=self._restoring)
            if conv is None:
                return
            try:
                seq = engine.restore(conv.cache, max_rows=conv.config.idle_chunk_size)
            except BaseException as error:  # e.g. no memory for its slot: it restores in idle time instead
                self._logger.error("%s could not join the batch to restore its deferred tokens", self._name(conv),
                             exc_info=error)
                return
            self._restoring[conv] = (engine, seq)

    def _room_beside(self, engine: BatchEngine) -> bool:
        """Whether another held conversation may restore beside ``engine``'s answers now: fewer than `MAX_RESTORING`
        restore in it, it carries fewer than `max_sequences` sequences, and its answers' decode rows do not fill the
        steps' budget alone."""
        if self.max_sequences is not None and len(engine.sequences) >= self.max_sequences:
            return False
        scheduler = engine.scheduler
        answering = sum(1 for s in engine.sequences if not isinstance(s, RestoringState))
        if scheduler.token_budget is not None and answering >= scheduler.token_budget:
            return False
        return sum(1 for e, _ in self._restoring.values() if e is engine) < self.MAX_RESTORING

    def _make_room(self, engine: BatchEngine) -> None:
        """Before a turn joins ``engine``: while it carries `max_sequences` sequences or more, a held conversation
        restoring in it leaves (with the rows restored so far: `_stop_restoring`), so the answers keep the places
        restoration borrowed."""
        if self.max_sequences is None:
            return
        while len(engine.sequences) >= self.max_sequences:
            conv = next((c for c, (e, _) in self._restoring.items() if e is engine), None)
            if conv is None:
                return
            self._stop_restoring(conv, keep=True)

    def _restores_beside(self, engine: BatchEngine) -> bool:
        """Whether `_restore_beside` would change ``engine``'s restoring conversations now (one no longer held leaves,
        or a held one with pending rows joins)."""
        if any(not self._held(conv) for conv in self._restoring):
            return True
        return self._room_beside(engine) and self._next_to_restore(skip=self._restoring) is not None

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
            self._logger.error("taking %s's restored rows back failed; it keeps its cache", self._name(conv),
                         exc_info=error)
            if seq in engine.sequences:
                engine.discard(seq)
            return
        conv.restored_beside(cache)

    # ---- leaving ------------------------------------------------------------------------------
    def _drop(self, seq) -> None:
        job = self._jobs.pop(seq)
        job.engine.discard(seq)

    def _fail(self, seq, error: BaseException) -> None:
        job = self._jobs[seq]
        self._drop(seq)
        self._end(job, error=error)

    def _finish(self, job: BatchTurn, cache) -> None:
        """The answer ended (``cache``: the sequence's, from `BatchEngine.remove`): the conversation continues from
        it, with the turn in its history, as `Conversation`'s own turn leaves it."""
        self._jobs.pop(job.seq, None)
        conv = job.conversation
        sequence = _host_sequence(job)  # (the device's would wait for a step launched ahead meanwhile)
        try:
            if job.streamer is not None:
                job.streamer.end()
        except BaseException as error:
            self._end(job, error=error)
            return
        output = None
        if job.generation_config.return_dict_in_generate:  # what the per-turn path's generate call returns
            output = RaincheckGenerateOutput(sequences=_sequence(job), scores=job.scores, logits=job.raw_logits,
                                             cache=cache, raincheck=job.seq.trace)
        with conv._lock:
            result = conv._record_turn(cache, sequence, job.seq.trace, job.prompt_length, job.times, job.started,
                                       job.previous_pending, job.request.stopped, output=output)
        self._recorded(job, result)
        self._end(job, result=result)

    def _end(self, job: BatchTurn, result=None, error=None) -> None:
        job.result, job.error = result, error
        self.step_log.turn_ended(id(job))
        with self._freed:  # (a preparation waiting for device memory looks again)
            self._freed.notify_all()
        try:
            job.done(job)
        except BaseException as failure:  # the caller's bookkeeping; the loop itself goes on
            self._logger.error("ending a batched turn failed", exc_info=failure)
