"""What a fast-path step changes on a shared model, visible only to the thread running the step.

Several chats may share one model, each in its own thread (the demo serves its sessions that way),
and a stock ``generate`` may run on the same model meanwhile. A fast-path step needs two things the
stock modules do not do: the few-query attention (`fast.attention`) in an ``sdpa`` model's attention
layers, and DeepStack addends added to the first decoder layers' outputs as a plain, graph-safe add.
Neither may go through state that other threads read: not the text config's ``_attn_implementation``
(one object, read by every attention layer and by a stock ``generate`` elsewhere), not hooks that
act for every caller. So, as Qwen3.5's Gated DeltaNet dispatch does (`gdn.dispatch`):

- per module *instance*, a dispatcher is installed while at least one step uses it (reference-counted,
  removed by the last user, on error too): each attention module reads its config through a view
  (`_AttentionConfigView`), each DeepStack decoder layer carries one forward hook (`_deepstack_hook`);
- both act only for the `StepScope` that the calling thread set (a context variable, checked against
  the thread that set it, since a new thread may inherit the context); for anyone else the view reads
  the model's own config and the hook returns the output untouched.

A CUDA graph records what the step ran while it was captured, so replays need neither; captures of
step graphs and of vision-tower graphs are serialised by `CAPTURE_LOCK` (two threads capturing at once
would record each other's kernels into their graphs). `graph_capture` is the one way they capture: it also
pauses Python's automatic garbage collector for the capture, since a collection that frees a dead CUDA graph
(one left in a reference cycle by a closed engine or a released pool) calls a CUDA function a capture forbids,
and that invalidates the capture being recorded.

`CAPTURE_LOCK` is the exclusive side of a gate (`DeviceGate`) whose shared side, `device_work`, is held by the
threads that do device work beside each other: a batching loop's thread between its waits, and the threads that
prepare turns for it. A capture waits until none of them is inside, and they wait while one runs: a capture on one
thread with another thread's device calls in flight was seen to fail ("operation not permitted when stream is
capturing") even with thread-local capture errors (a first use of a kernel loads its module, for one, which a
capture does not allow anywhere in the process).

A capture's warm-up (lazy initialisation, library handles and workspaces, kernel tuning: outside the capture) runs
on the caller's current stream, as the forward it stands for would, never on a side stream. What a warm-up allocates
and keeps (a storage's KV tensors, lazily made by the first forward on it; a step's logits buffer) then belongs, in
the caching allocator, to the stream that uses it afterwards, so once freed it is reused only after that use. Made
on a side stream it went back to the side stream's free blocks when freed, with the caller's work on it still
queued: a conversation that grew into a bigger storage copied its KV out of the old one, the old one was freed, and
another thread's warm-up, already running on the side stream, took those blocks and wrote them before the copy read
them (answers that differed from the same dialogue alone, with several threads on one model).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from ..patching import CountedPatches, patched, patched_for_thread
from .context import STEP, StepScope, active_scope  # noqa: F401 (active_scope: asked here by callers)

class DeviceGate:
    """Device work of several threads at once (`shared`), or one thread capturing CUDA graphs alone (the gate used as
    a context manager: exclusive, reentrant for its holder). A thread inside `shared` that asks for the exclusive
    side leaves its shared hold while it holds it (so two such threads never wait for each other) and takes it back
    after; threads waiting for the exclusive side go before new shared holders (a loop that steps without pause
    does not keep a capture waiting). Never wait inside `shared` for another thread that may be waiting here."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # threads inside `shared`
        self._owner = None  # the exclusive holder's thread id
        self._depth = 0  # its nesting
        self._waiting = 0  # threads waiting for the exclusive side
        self._local = threading.local()  # this thread's `shared` nesting, and what it left for the exclusive side

    @contextlib.contextmanager
    def shared(self):
        me = threading.get_ident()
        depth = getattr(self._local, "depth", 0)
        if self._owner == me or depth:  # (inside already, or the exclusive holder: nothing to wait for)
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._cond:
            while self._owner is not None or self._waiting:
                self._cond.wait()
            self._shared += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    def __enter__(self):
        me = threading.get_ident()
        held = getattr(self._local, "depth", 0)  # (a `shared` holder asking: its hold is given up meanwhile)
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            if held:
                self._shared -= 1
                self._cond.notify_all()
            self._waiting += 1
            try:
                while self._owner is not None or self._shared:
                    self._cond.wait()
            except BaseException:  # (interrupted while it waited: its shared hold back, as its caller expects)
                self._shared += held
                raise
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            self._owner, self._depth = me, 1
        self._local.left = held
        self._local.depth = 0
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth:
                return
            self._owner = None
            held = getattr(self._local, "left", 0)
            if held:  # (its shared hold back at once: it was inside before it asked)
                self._shared += 1
            self._cond.notify_all()
        self._local.depth, self._local.left = held, 0

    @property
    def holders(self) -> tuple[int, int | None]:
        """``(threads inside shared, the exclusive holder's thread id or None)`` (what a test reads)."""
        with self._cond:
            return self._shared, self._owner


CAPTURE_LOCK = DeviceGate()  # held for a whole capture (warm-up, capture, bookkeeping) of any graph
device_work = CAPTURE_LOCK.shared  # held by threads doing device work beside others (a batching loop, its preparations)
_PAUSES = [0]  # nested `paused_collector` scopes (under CAPTURE_LOCK)


@contextlib.contextmanager
def paused_collector():
    """Python's automatic garbage collector off for the scope (as it was before once the outermost scope ends, on
    error too), under `CAPTURE_LOCK`. Objects whose last reference goes are still freed at once; only cycles wait
    for the next collection after the scope. Torch's graph context no longer collects before a capture: a cycle
    holding a dead ``torch.cuda.CUDAGraph`` collected during a capture destroys that graph there (a call the
    capture forbids: "operation not permitted when stream is capturing") and the capture fails."""
    with CAPTURE_LOCK:
        was_enabled = gc.isenabled() if _PAUSES[0] == 0 else None
        _PAUSES[0] += 1
        gc.disable()
        try:
            yield
        finally:
            _PAUSES[0] -= 1
            if _PAUSES[0] == 0 and was_enabled:
                gc.enable()


_CAPTURE_STREAMS: dict = {}  # CUDA device index -> the process's one stream that captures run on there
_STREAMS_LOCK = threading.Lock()  # (making the kept streams)


def _process_stream(streams: dict, device) -> "torch.cuda.Stream":
    """``streams``' stream of ``device`` (None: the current CUDA device), made on first need and kept."""
    index = torch.device("cuda" if device is None else device).index
    if index is None:
        index = torch.cuda.current_device()
    with _STREAMS_LOCK:
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(device=index)
        return stream


def capture_stream(device=None) -> "torch.cuda.Stream":
    """The stream every graph capture on ``device`` (default: the current one) runs on, one per device for the process
    (as `torch.cuda.graph`'s default capture stream is one per process), made on first need. Only captures use it,
    under `CAPTURE_LOCK`: no other work can land in a graph being captured on it."""
    return _process_stream(_CAPTURE_STREAMS, device)


@contextlib.contextmanager
def graph_capture(graph, pool=None):
    """Capture the block's device work into ``graph`` (a ``torch.cuda.CUDAGraph``; ``pool``: a memory pool token to
    share, e.g. another graph's ``pool()``), with ``capture_error_mode="thread_local"`` (only the calling thread's
    unsafe calls break it), under `CAPTURE_LOCK`, with the collector paused (`paused_collector`), on `capture_stream`.

    What ``torch.cuda.graph`` does, through the graph's own ``capture_begin`` / ``capture_end``, without emptying the
    allocators' caches before each capture (``torch.cuda.empty_cache`` and the pinned host memory's): a warm-up that
    captures hundreds of steps in a row would give their device blocks and pinned buffers back before each capture
    and allocate them again in the next step (``cudaMalloc`` / ``cudaHostAlloc`` each time), and the engine's
    pinned non-blocking copies would lose their cached buffers at every capture in the middle of serving. vLLM's
    capture loop skips the same emptying (it patches it out for every graph after the first)."""
    with paused_collector():
        torch.cuda.synchronize()  # (as torch's context: the capture starts after all earlier work)
        stream = capture_stream()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()  # (also after an error in the block: it ends the capture, and raises its own)


def _on_cuda(device) -> bool:
    """Whether ``device`` (a device, its name, or None: the current CUDA device) is a CUDA device."""
    return device is None or torch.device(device).type == "cuda"


def tensors_in(obj):
    """Every tensor reachable from ``obj`` through dicts, sequences and objects' attributes (``__dict__`` and
    ``__slots__``); not through modules, tokenizers and processors (weights and vocabularies, nothing a turn made)."""
    seen = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
            continue
        if item is None or isinstance(item, (str, bytes, int, float, torch.nn.Module, torch.dtype, torch.device,
                                             type, PreTrainedTokenizerBase, ProcessorMixin)) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(item)
        else:
            stack.extend(getattr(item, "__dict__", {}).values())
            for klass in type(item).__mro__:
                for name in getattr(klass, "__slots__", ()):
                    if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                        stack.append(getattr(item, name, None))


def used_on(obj, stream=None, device=None) -> None:
    """`torch.Tensor.record_stream` ``stream`` (None: the calling thread's current stream of ``device``, asked at the
    first CUDA tensor: a CPU-only process never asks) on every CUDA tensor of ``obj`` (`tensors_in`).

    For tensors made on one stream and used on another from now on: freed, their blocks go to no allocation of the
    stream they were made on before the work queued here is done. A turn prepared on a stream of its own and handed to
    the batching loop's (`batch_loop.BatchLoop.prepare_stream`); what a captured graph reads and writes by address
    outside its memory pool (its static inputs and buffers), made on the capturing thread's stream and replayed on
    others: unmarked, a graph evicted from a full table with a replay still queued gave them to a preparation on the
    capturing stream, which could write them before the replay read them. Tensors made on ``stream`` cost a lookup
    (the allocator ignores uses on a block's own stream)."""
    for tensor in tensors_in(obj):
        if tensor.is_cuda:
            stream = torch.cuda.current_stream(device) if stream is None else stream
            tensor.record_stream(stream)


class StreamOrder:
    """The order of the device work of the users of one set of static buffers (a captured graph's inputs and
    outputs) across CUDA streams. Each user, holding the buffers' lock, calls `wait` before its first kernel on them
    and `done` after its last (its outputs copied out): a user on another stream (`batch_loop.BatchLoop` prepares
    turns on streams of their own) then starts only after the one before it, as users of one stream do by their
    queue's order. Costs an event record per use; off CUDA (a test's CPU replay) it does nothing."""

    __slots__ = ("_done",)

    def __init__(self):
        self._done = None

    def wait(self, device=None) -> None:
        if self._done is not None and _on_cuda(device):
            torch.cuda.current_stream(device).wait_event(self._done)

    def done(self, device=None) -> None:
        if not _on_cuda(device):
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._done = event


_PATCHES = CountedPatches()  # attention config views and DeepStack hooks (counted per instance)
_COMPILE_PATCHES = CountedPatches()  # compiled-forward dispatchers (`fast.compiled`), a module may also hold a hook


class _AttentionConfigView:
    """An attention module's ``config`` while steps may use it: the model's own config object for every
    read and write, except that ``_attn_implementation`` names the few-query attention inside a step of
    the calling thread that lists this module (and only where the model runs ``sdpa``)."""

    __slots__ = ("_raincheck_config", "_raincheck_module")

    def __init__(self, config, module_id: int):
        object.__setattr__(self, "_raincheck_config", config)
        object.__setattr__(self, "_raincheck_module", module_id)

    @property
    def _attn_implementation(self):
        from .attention import ENABLED, NAME

        implementation = self._raincheck_config._attn_implementation
        scope = active_scope()
        if ENABLED and implementation == "sdpa" and scope is not None and self._raincheck_module in scope.attention:
            return NAME
        return implementation

    def __getattr__(self, name):
        if name.startswith("_raincheck_"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self._raincheck_config, name)

    def __setattr__(self, name, value):
        setattr(self._raincheck_config, name, value)

    def __delattr__(self, name):
        delattr(self._raincheck_config, name)


def _view_config(module):
    original = module.config
    module.config = _AttentionConfigView(original, id(module))

    def undo():
        if isinstance(vars(module).get("config"), _AttentionConfigView):
            module.config = original

    return undo


def _deepstack_hook(module, args, output):
    scope = active_scope()
    addend = None if scope is None else scope.addends.get(id(module))
    return None if addend is None else output + addend


def _hook_deepstack(module):
    return module.register_forward_hook(_deepstack_hook).remove


@contextlib.contextmanager
def step_scope(text_model, addends: list[torch.Tensor], few_query: bool = True, layers=None, compile_targets=(),
               compile_attention: bool = True, key_extent: torch.Tensor | None = None,
               query_rows: torch.Tensor | None = None):
    """For the calling thread, inside the block: decoder layer ``layers[i]`` (default: the i-th; the adapter's
    ``deepstack_layers()``) adds ``addends[i]`` to its output (DeepStack), with ``few_query`` the attention
    layers of an ``sdpa`` model run `fast.attention.few_query_attention`, and the ``(module, forward)`` pairs
    ``compile_targets`` (`ModelAdapter.compile_targets`; with the few-query attention's core unless
    ``compile_attention`` is False, which keeps its Triton kernel) run compiled (`fast.compiled`). Other threads
    (and this one after the block) see the stock modules' behaviour. ``key_extent`` / ``query_rows``: a batched
    step's per-sequence key extents and real query rows for the few-query kernel (`fast.context.StepScope`)."""
    attention = [layer.self_attn for layer in text_model.layers if hasattr(layer, "self_attn")] if few_query else []
    layers = list(text_model.layers[:len(addends)] if layers is None else layers)[:len(addends)]
    if attention:
        from .attention import register

        register()
    scope = StepScope(frozenset(id(m) for m in attention), {id(layer): a for layer, a in zip(layers, addends)},
                      bool(compile_targets), bool(compile_targets) and compile_attention, key_extent, query_rows)
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(_PATCHES, layers, _hook_deepstack))
        if compile_targets:
            from .compiled import dispatcher

            for module, impl in compile_targets:
                stack.enter_context(patched(_COMPILE_PATCHES, [module], dispatcher(impl)))
        # the attention views, and the scope they (and the hooks, the dispatchers) act for: this thread's only
        stack.enter_context(patched_for_thread(_PATCHES, attention, _view_config, STEP, scope))
        yield
