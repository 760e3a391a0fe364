"""Whether Triton can be used here: the one question the project's Triton kernels (`gdn.kernels`,
`selection.kernels`, `fast.attention`) ask before their first launch; and the block / grid arithmetic they share.
Importing this module imports no Triton."""

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


def pow2(n: int, floor: int = 1) -> int:
    """The least power of two >= ``n`` (and >= ``floor``): the kernels' block sizes."""
    return max(floor, 1 << (max(int(n), 1) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (program counts of a launch grid)."""
    return -(-a // b)
