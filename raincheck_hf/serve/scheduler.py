"""The server's continuous-batching loop (``--batching``): `batch_loop.BatchLoop` with the server's conversations.

The loop itself (joining turns to `batch_engine.BatchEngine`, stepping, choosing tokens with each request's own
processors, leaving with the cache, one engine per config, restoring held conversations beside the answers and in
idle time) is the library's `BatchLoop`, which `Conversation(..., loop=)` uses too. What this layer adds:

- the held conversations are the `ConversationStore`'s: idle-time restoration takes them in the order
  `ConversationStore.next_to_restore` gives them, a conversation evicted meanwhile (``max_cache_bytes``: eviction
  does not wait for the loop) counts as no longer held, and one whose idle-time restoration fails is dropped;
- a turn whose client went away before its first token leaves at once with `client_gone` (a 499, answered to
  nobody) and its held conversation stays as it was; one already answering leaves with what it answered, as
  `Conversation.cancel` leaves it;
- a turn's media digests become its conversation's when it ends (the store matches follow-ups by them);
- only the server's default config keeps its engine while empty; the errors speak of the server shutting down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..batch_loop import BatchLoop, BatchTurn
from .errors import APIError

logger = logging.getLogger("raincheck_hf.serve")


def client_gone() -> APIError:
    """What a turn whose client went away before its first token gets (nobody reads it: logged as 499)."""
    return APIError(499, "The client closed the connection before the answer's first token.", code="client_gone")


@dataclass(eq=False)
class BatchJob(BatchTurn):
    """One request's turn (`BatchTurn`) with ``digests``: the content hashes of the media its dialogue holds.

    ``streamer``: the turn's `_Pieces`; ``generate_kwargs``: the per-turn path's (``max_new_tokens``,
    ``logits_processor``, ``stopping_criteria``, greedy settings)."""

    digests: tuple = ()
    unheld: bool = False  # answered without its cache (no device memory for it): its conversation is let go


class BatchScheduler(BatchLoop):
    """The loop's thread, its engines and its figures (``steps``, ``batch_size``: sequences in the last step).

    Args:
        model: the served model (enabled).
        store: the server's `ConversationStore` (idle-time restoration reads its held conversations).
        token_budget: rows per step (`BatchEngine`'s ``token_budget``).
        default_config: the server's default `RaincheckConfig` (its engine is kept while empty).
        on_step: called with the step's sequence count and kind (`batch_engine.StepRecord.kind`) after every step
            (the metrics).
        on_restore: called with ``(rows, busy)`` when held conversations' deferred rows were restored: in a step
            beside answers (``busy``) or in idle time (the metrics).
        on_handoff: called after each of the loop's iterations (the server's `_Handoff.flush`: the step's pieces
            to the event loop at once).
        on_join: called with the seconds a new turn's joining took on the loop's thread (its vision encoding and
            preparation: `BatchLoop._join`; the metrics).
        max_prompt_forwards: the most prompt-piece forwards in one step (`BatchLoop.max_prompt_forwards`).
        max_preparing: the most turns prepared at once on the request threads (`BatchLoop.max_preparing`).
        prepare_priority: the priority of the stream turns are prepared on (`BatchLoop.prepare_priority`).
        max_sequences: the most sequences in one step that held conversations restoring beside the answers may bring
            it to (`BatchLoop.max_sequences`: the places the server's engine was warmed for).
        memory_headroom: the device memory in bytes a turn's preparation leaves free for the loop's own work,
            ``"auto"`` or None (no wait for memory; `BatchLoop.memory_headroom`).
    """

    _logger = logger

    def __init__(self, model, store, token_budget: int | None, default_config, on_step=None, on_restore=None,
                 on_handoff=None, on_join=None, max_prompt_forwards: int | None = None,
                 max_preparing: int | None = 1, prepare_priority: str = "normal", max_sequences: int | None = None,
                 memory_headroom: int | str | None = "auto"):
        super().__init__(model, token_budget, config=default_config, on_step=on_step, on_restore=on_restore,
                         on_handoff=on_handoff, on_join=on_join, max_prompt_forwards=max_prompt_forwards,
                         max_preparing=max_preparing, prepare_priority=prepare_priority, max_sequences=max_sequences,
                         memory_headroom=memory_headroom)
        self.store = store

    def _closed_error(self, running: bool) -> BaseException:
        return RuntimeError("the server shut down while this turn was running" if running
                            else "the server is shutting down")

    def _gone(self, job) -> BaseException:
        return client_gone()

    def _next_to_restore(self, skip=()):
        return self.store.next_to_restore(skip=skip)

    def _held(self, conv) -> bool:
        """The store still holds ``conv`` (it was not evicted or dropped)."""
        return self.store.get(conv.id) is conv

    def _relieve_memory(self, nbytes: int) -> bool:
        """The least recently used idle held conversations are evicted (`ConversationStore.evict_bytes`) until
        their caches held at least ``nbytes``: whether any was."""
        return self.store.evict_bytes(max(1, int(nbytes))) > 0

    def _restore_failed(self, conv, error: BaseException) -> None:
        logger.error("idle-time restoration of %s failed; the conversation is dropped", conv.id, exc_info=error)
        self.store.discard(conv)

    def _recorded(self, job: BatchJob, result) -> None:
        job.conversation.digests = job.digests
        if job.unheld:
            self.store.forget(job.conversation)

    def _answer_without_cache(self, job: BatchJob) -> bool:
        """The answer goes back to its client although its cache could not be kept (no device memory, none to be
        made by eviction): its conversation is no longer held, as if evicted, and a follow-up prefills the dialogue
        again."""
        job.unheld = True
        return True
