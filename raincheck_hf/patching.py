"""Per-instance patches shared by concurrent users: applied by the first, undone by the last.

The engine changes how a few modules of a shared model behave while one of its calls runs (Qwen3.5's
split Gated DeltaNet forward, the fast path's few-query attention and DeepStack adds); several calls
may run at once, in several threads, so a patch is reference-counted per module instance and the
patched code itself decides, per thread, whether to act (context variables): `patched_for_thread` does both
for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from typing import Callable


class CountedPatches:
    """Patches by module instance: ``acquire(module, apply)`` runs ``apply(module)`` (which returns the undo
    callable) for the first user only; ``release(module)`` undoes it after the last user."""

    def __init__(self):
        self._lock = threading.Lock()
        self._installed: dict[int, list] = {}  # id(module) -> [users, undo]

    def acquire(self, module, apply: Callable[[object], Callable[[], None]]) -> None:
        with self._lock:
            entry = self._installed.get(id(module))
            if entry is not None:
                entry[0] += 1
            else:
                self._installed[id(module)] = [1, apply(module)]

    def release(self, module) -> None:
        with self._lock:
            entry = self._installed.get(id(module))
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                entry[1]()
                del self._installed[id(module)]

    def __contains__(self, module) -> bool:
        return id(module) in self._installed


class ThreadScoped:
    """A value that only the thread which set it sees, for the extent of a ``with`` block.

    A context variable alone is not enough: a thread started inside the block (a streamer's, a worker's) may
    inherit the context, and must not act on a step it does not run. So the value is stored with the setting
    thread's id and `get` answers None to every other thread.
    """

    def __init__(self, name: str):
        self._var: contextvars.ContextVar = contextvars.ContextVar(name, default=None)

    def get(self):
        """The value the calling thread set (innermost block), or None."""
        entry = self._var.get()
        return entry[1] if entry is not None and entry[0] == threading.get_ident() else None

    @contextlib.contextmanager
    def using(self, value):
        """Make ``value`` the calling thread's for the block (nested blocks restore the outer value)."""
        token = self._var.set((threading.get_ident(), value))
        try:
            yield value
        finally:
            self._var.reset(token)


@contextlib.contextmanager
def patched(patches: CountedPatches, modules, apply: Callable[[object], Callable[[], None]]):
    """For the ``with`` block: ``apply`` on each of ``modules``, counted in ``patches`` (the first user applies, the
    last undoes). Undone on exit, on error too, also when applying fails part way."""
    installed = []
    try:
        for module in modules:
            patches.acquire(module, apply)
            installed.append(module)
        yield
    finally:
        for module in reversed(installed):
            patches.release(module)


@contextlib.contextmanager
def patched_for_thread(patches: CountedPatches, modules, apply: Callable[[object], Callable[[], None]],
                       scoped: ThreadScoped, value):
    """`patched` for the ``with`` block, with ``value`` as the calling thread's ``scoped`` value, which the patched
    code reads to decide whether to act (the one way the engine changes a shared model's modules: Qwen3.5's Gated
    DeltaNet dispatch, `gdn.dispatch`, and the fast path's step scope, `fast.scoping.step_scope`)."""
    with patched(patches, modules, apply), scoped.using(value):
        yield value


def install_forward(module, acts: Callable[[], bool], fast: Callable) -> Callable[[], None]:
    """Make ``module`` run ``fast(module, *args, **kwargs)`` on the calls for which ``acts()`` holds (asked at each
    call: the calling thread's scope) and its own ``forward`` on every other; returns the undo callable (for
    `CountedPatches.acquire`). A module whose ``forward`` is already an attribute of its own (patched by someone
    else) is left alone, and the undo does nothing."""
    if "forward" in vars(module):
        return lambda: None
    stock = module.forward

    def forward(*args, **kwargs):
        if acts():
            return fast(module, *args, **kwargs)
        return stock(*args, **kwargs)

    module.forward = forward

    def undo():
        if vars(module).get("forward") is forward:
            del module.forward

    return undo


def module_function(module, name: str):
    """The function ``name`` of the modeling file that defines ``module``'s class (its own rotary, kernels): what
    a patched forward calls to run the module's own code."""
    fn = getattr(sys.modules.get(type(module).__module__), name, None)
    if fn is None:
        raise ValueError(f"{type(module).__name__}'s modeling module has no {name}")
    return fn
