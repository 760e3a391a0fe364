"""The conversations a server holds, matched to incoming requests by token-id prefix.

A request is the whole dialogue so far (OpenAI's convention). Its prompt's token ids are compared
with each held conversation's ids (everything prefilled or generated so far, the last answer's
last token included); the longest held sequence that is a proper prefix of the prompt, whose
images and videos are the first ones of the request (by content hash) and whose Raincheck
settings are the request's, is continued: the follow-up prefills only what comes after it. No
match: a new conversation prefills the whole dialogue. A conversation is checked out while it
answers (a second request with the same prefix starts its own), and checked back in after, when
the least recently used idle conversations are evicted until the held caches fit the budget.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from ..configuration import RaincheckConfig
from ..conversation import Conversation, TurnResult, _CancelRequest


class ServedConversation(Conversation):
    """A `Conversation` whose turns arrive as whole tokenized dialogues (the server's requests).

    ``digests`` are the content hashes of the images and videos its cache holds, in order.
    """

    def __init__(self, model, processor, config: RaincheckConfig, conversation_id: str, background: bool = True):
        super().__init__(model, processor, config, background=background, early_follow_up=True)
        self.id = conversation_id
        self.digests: tuple[str, ...] = ()

    def answer(self, inputs: dict, digests: tuple[str, ...], streamer, generate_kwargs: dict,
               cancel: threading.Event) -> TurnResult:
        """One turn: ``inputs`` holds the whole dialogue's ``input_ids`` and this turn's new pixels only.

        ``cancel`` is the turn's cancellation event (`Conversation.cancel` sets the same one): set,
        even before the turn starts, it stops the answer at its next step.
        """
        with self._ask_lock:
            if self._failed is not None:
                raise RuntimeError(f"an earlier turn of this conversation failed: {self._failed}")
            request = _CancelRequest()
            request.event = cancel
            self._request = request
            result = self._run(inputs, streamer, generate_kwargs, request)
        self.digests = digests
        return result

    @property
    def length(self) -> int:
        return 0 if self.sequences is None else int(self.sequences.shape[1])

    def nbytes(self) -> int:
        return 0 if self.cache is None else cache_nbytes(self.cache)


def cache_nbytes(cache) -> int:
    """Bytes of the tensors a cache holds (its layers, bookkeeping and pending rows), each storage once, and on the
    CUDA fast path the device memory of the steps captured on its slot storage (their pool and static buffers:
    `fast.graphs.StepGraphs.nbytes`), which live as long as the storage does."""
    seen, total = set(), 0
    graphs = getattr(getattr(cache, "storage", None), "graphs", None)  # (a `StepGraphs`, on the fast path)
    if graphs is not None:
        total += graphs.nbytes()

    def add(value, depth):
        nonlocal total
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (storage.data_ptr(), value.device)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v, depth)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
            for v in vars(value).values():
                add(v, depth - 1)

    add(cache, 3)
    return total


@dataclass
class _Entry:
    conversation: ServedConversation
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = True
    nbytes: int = 0


@dataclass
class Checkout:
    """A conversation lent to one request; ``cached`` prompt tokens are already in its cache."""

    conversation: ServedConversation
    cached: int
    reused: bool


class ConversationStore:
    """Held conversations of one model, least recently used evicted first above ``max_bytes``.

    ``background``: the conversations' leftovers are restored by the model's restorer thread (`restorer.IdleRestorer`;
    False: the server's batching loop does it, `next_to_restore`)."""

    def __init__(self, model, processor, max_bytes: int | None, reuse: bool = True, background: bool = True):
        self.model, self.processor, self.max_bytes, self.reuse = model, processor, max_bytes, reuse
        self.background = background
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.evictions = 0
        self.restored_after_gone = 0  # idle-time restoration of conversations no longer held

    # ---- lending ------------------------------------------------------------------------------
    def checkout(self, input_ids: torch.Tensor, digests: tuple[str, ...], config: RaincheckConfig) -> Checkout:
        """The held conversation to continue for a prompt (``[n]`` ids), or a new one."""
        with self._lock:
            best = None
            for entry in self._entries.values() if self.reuse else ():
                conv = entry.conversation
                n = conv.length
                if (entry.busy or n == 0 or n >= input_ids.shape[0] or conv.config != config
                        or digests[:len(conv.digests)] != conv.digests):
                    continue
                if torch.equal(conv.sequences[0], input_ids[:n]) and (best is None or n > best.conversation.length):
                    best = entry
            if best is not None:
                best.busy = True
                best.last_used = time.monotonic()
                return Checkout(best.conversation, best.conversation.cache.source_length, True)
            conv = ServedConversation(self.model, self.processor, config, f"conv-{next(self._ids)}",
                                      background=self.background)
            self._entries[conv.id] = _Entry(conv)
        self.evict()  # a new conversation is about to need memory
        return Checkout(conv, 0, False)

    def checkin(self, conv: ServedConversation) -> None:
        """After a turn (also a cancelled one: the cache stays consistent), the conversation is matchable again."""
        if not self.reuse:  # nothing is continued: nothing is kept
            self.discard(conv)
            return
        nbytes = conv.nbytes()
        with self._lock:
            entry = self._entries.get(conv.id)
            if entry is None:
                return
            entry.busy, entry.last_used, entry.nbytes = False, time.monotonic(), nbytes
        self.evict()

    def next_to_restore(self, skip=()) -> ServedConversation | None:
        """An idle held conversation with leftover deferred rows (the most recently used first: the likeliest to
        get a follow-up soon), or None; conversations in ``skip`` (those restoring already) are passed over."""
        with self._lock:
            idle = [e for e in self._entries.values()
                    if not e.busy and e.conversation.pending > 0 and e.conversation not in skip]
            return max(idle, key=lambda e: e.last_used).conversation if idle else None

    def discard(self, conv: ServedConversation) -> None:
        """A turn failed part way: its cache cannot be trusted, so the conversation is dropped."""
        with self._lock:
            self._entries.pop(conv.id, None)
        self._close(conv)

    def forget(self, conv: ServedConversation) -> None:
        """``conv`` is no longer held, without closing it: its last turn was answered without a cache (the batching
        loop had no device memory for it). Called on the loop's thread while the turn's request thread waits for it,
        which `Conversation.close` would wait for in turn. It counts among the evictions."""
        with self._lock:
            if self._entries.pop(conv.id, None) is None:
                return
            self.evictions += 1
        self._gone(conv)

    def evict(self) -> int:
        """Close least recently used idle conversations until the held caches fit ``max_bytes``."""
        if self.max_bytes is None:
            return 0
        return len(self._evict_until(lambda total, freed: total <= self.max_bytes))

    def evict_bytes(self, need: int) -> int:
        """Close least recently used idle conversations until their caches held at least ``need`` bytes (or none is
        left): the device had no memory for an answer's cache (the batching loop, `BatchLoop._relieve_memory`).
        Returns the bytes their caches held."""
        return sum(nbytes for _, nbytes in self._evict_until(lambda total, freed: freed >= need))

    def _evict_until(self, enough) -> list:
        """Close least recently used idle conversations until ``enough(held bytes, bytes evicted)``: ``[(conversation,
        its bytes)]`` of those closed."""
        evicted = []
        with self._lock:
            for entry in self._entries.values():
                if not entry.busy:
                    entry.nbytes = entry.conversation.nbytes()  # idle-time restoration moves rows into the KV
            total, freed = sum(e.nbytes for e in self._entries.values()), 0
            for entry in sorted((e for e in self._entries.values() if not e.busy), key=lambda e: e.last_used):
                if enough(total, freed):
                    break
                total, freed = total - entry.nbytes, freed + entry.nbytes
                del self._entries[entry.conversation.id]
                evicted.append((entry.conversation, entry.nbytes))
            self.evictions += len(evicted)
        for conv, _ in evicted:
            self._close(conv)
        return evicted

    def _close(self, conv: ServedConversation) -> None:
        conv.close()
        self._gone(conv)

    def _gone(self, conv: ServedConversation) -> None:
        """``conv`` is no longer held: what it restored after its answers stays counted (the figures'
        ``restored_after_answer``)."""
        with self._lock:
            self.restored_after_gone += sum(t.restored_after_answer for t in conv.turns)

    def close(self) -> None:
        with self._lock:
            held = [e.conversation for e in self._entries.values()]
            self._entries.clear()
        for conv in held:
            conv.close()

    # ---- figures ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            entries = list(self._entries.values())
            gone = self.restored_after_gone
        return {
            "conversations": len(entries),
            "busy": sum(e.busy for e in entries),
            "cache_bytes": sum(e.nbytes for e in entries),
            "pending": sum(e.conversation.pending for e in entries),
            "restored_after_answer": gone + sum(t.restored_after_answer for e in entries for t in e.conversation.turns),
            "evictions": self.evictions,
            "max_bytes": self.max_bytes,
        }

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def get(self, conversation_id: str) -> ServedConversation | None:
        with self._lock:
            entry = self._entries.get(conversation_id)
            return None if entry is None else entry.conversation
