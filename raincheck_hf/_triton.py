"""Whether Triton can be used here: the one question the project's Triton kernels (`gdn.kernels`,
`selection.kernels`) ask before their first launch. Importing this module imports no Triton."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton can be imported here (the kernels' only dependency beyond torch; asked once)."""
    try:
        import triton  # noqa: F401
    except Exception:  # no Triton, or one that cannot load here
        return False
    return True
