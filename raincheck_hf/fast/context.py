"""The fast-path step the calling thread is running, if any (`active_scope`).

The few-query attention (`fast.attention`), the compiled forms (`fast.compiled`) and the DeepStack hooks
(`fast.scoping`) act only inside a step of the calling thread; `fast.scoping.step_scope` sets the scope.
This module is below all of them, so none of them imports another to ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..patching import ThreadScoped


@dataclass(frozen=True)
class StepScope:
    """One fast-path step as the dispatchers see it: attention modules that run the few-query
    attention (by id) and the addend of each DeepStack decoder layer (by id)."""

    attention: frozenset
    addends: dict
    compiled: bool = False  # run the compiled forms of `fast.compiled` (RaincheckConfig.compile_steps)
    # the few-query attention's core compiled too (else its Triton kernel where usable): the single-sequence steps'
    # choice; the batched steps keep the kernel, which at a batch beats the compiled matmul form
    compiled_attention: bool = False
    # a batched step's per-sequence key extents (``[B]`` on the device: no row of batch row ``b`` sees a slot at or
    # past ``key_extent[b]``), so the few-query kernel reads each sequence's keys only up to its own rows; None: the
    # whole span
    key_extent: object = field(default=None, compare=False)
    # its per-sequence real query rows (``[B]``: positions from ``query_rows[b]`` on are padding, whose attention
    # output nobody reads), so the kernel skips blocks of padding rows; None: every row
    query_rows: object = field(default=None, compare=False)


STEP = ThreadScoped("raincheck_fast_step")


def active_scope() -> StepScope | None:
    """The step scope of the calling thread, or None."""
    return STEP.get()
