"""Per-instance patches shared by concurrent users: applied by the first, undone by the last.

The engine changes how a few modules of a shared model behave while one of its calls runs (Qwen3.5's
split Gated DeltaNet forward, the fast path's few-query attention and DeepStack adds); several calls
may run at once, in several threads, so a patch is reference-counted per module instance and the
patched code itself decides, per thread, whether to act (context variables).
"""

from __future__ import annotations

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
