"""`RaincheckConfig`: the settings of one Raincheck generation, validated before any compute."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import torch

from .selection import Selector, get_selector

MODES = ("full", "hard", "post_answer", "raincheck", "serial")
#: ``restore_order`` values (`plan.restoration_order`)
RESTORE_ORDERS = ("source", "relevance", "attention")
AUTO = "auto"
# chunk sizes `chunk_size="auto"` chooses from (padded rows; with the decode token a fused step has 8 .. 64 rows)
CHUNK_LADDER = (7, 15, 31, 63)


PREPARE_PRIORITIES = ("normal", "high")  # `BatchLoop.prepare_priority`'s values (and the server's --prepare-priority)


def is_limit(value) -> bool:
    """Whether ``value`` is a limit setting's: None (no limit, or the setting's default) or an int >= 1 (a bool is not
    taken for an int). Each caller raises its own error, naming its setting."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def parse_chunk_size(value) -> int | str:
    """A ``chunk_size`` from a command line or a list: ``"auto"``, else an integer (`RaincheckConfig` checks
    its range); a text that is neither raises ValueError (argparse reports it with the option's name)."""
    if isinstance(value, str):
        value = value.strip()
        return AUTO if value == AUTO else int(value)
    return int(value)


@dataclass
class RaincheckConfig:
    """How a prompt's multimodal tokens are split and when the deferred ones are prefilled.

    Every setting is checked at construction, on every later assignment and again by each
    ``generate(raincheck=...)`` call that uses the config (which works on its own copy): an invalid
    value is a ValueError naming ``RaincheckConfig.<setting>`` and the value, before any compute.

    Args:
        retention: fraction r of each image's / video slice's visual tokens prefilled first, in [0, 1]:
            ``round(r * n)`` of a slice's n tokens, at least one when r > 0; r = 0 selects none (every
            multimodal token is deferred, which docs/method.md §8 allows), r = 1 defers none.
        chunk_size: c, deferred tokens prefilled per decode step (and per idle-time step), >= 1; or
            ``"auto"``: each decode step takes the chunk size (from `CHUNK_LADDER`, or none) that keeps the
            answer's mean time per token within ``tpot_slack`` of plain decode steps, by the step costs
            measured on the running device, and finishes restoration earliest under that budget
            (`generation.auto_chunk_size`); on the fast path it prefers sizes whose step is already captured
            as a CUDA graph at its slot bucket and counts a capture's measured pause against the budget
            (captures during the answer are in the trace's ``captures``); idle-time restoration then uses
            the largest ladder size.
            Without measured costs (the eager engine, or a CPU) it takes the smallest ladder size
            every step. With ``"auto"`` the restoration schedule depends on timings, so which chunks a
            token saw (and, under greedy decoding, possibly the tokens while restoration runs) may
            differ between runs; a fixed size gives reproducible runs.
        chunk_every: k, with a fixed ``chunk_size``: a chunk rides on every k-th decode forward from the guard on
            (forwards g, g + k, g + 2k, ... with g = max(``decode_guard``, 1)), the others decode alone, an integer
            >= 1. Default 1: every one. Spacing the chunks spreads the restoration's cost over more of the answer
            (each chunk step costs about what it costs at k = 1; they are k times rarer), so a short answer pays
            less of it and leaves more rows for after it, which follow-ups see all the same; a long answer sees them
            later. Deterministic (with ``"auto"`` the measured step costs decide instead: it must stay 1).
        decode_guard: g, no deferred chunk runs before g tokens have been generated, >= 0. Default 1: the
            first token comes from the prefill alone (as fast as with pruning) and every decode step from
            then on carries a chunk until nothing is pending (0 is the same: the prefill never carries one).
            The guard moves the chunk steps, it does not change their size, so an answer long enough to hold
            them all has the same mean time per token whatever the guard; a larger guard keeps more of the
            answer's first tokens at plain-step speed but lets them see only the selected tokens (on the
            project's glyph benchmark, long first answers recover 70-78% of what pruning loses with 16,
            about 95% or more with 1: README, Quality).
        restore_order: which deferred tokens go first (`plan.restoration_order`): ``"source"`` (default:
            source order, docs/method.md's chunks of consecutive deferred tokens), ``"relevance"`` (most
            similar to the question's text embeddings first; no extra model pass) or ``"attention"`` (the
            rows the question's last prompt token attends to most at the first full-attention layer after
            DeepStack first; an extra scoring pass of those few layers before the prefill unless the selector
            is ``fastv``). Any order is exact: a restored row is stored with its true position and is seen
            by every later forward. Single prompts only (a batch restores in source order).
        tpot_slack: with ``chunk_size="auto"``, how much the answer's mean time per token may exceed
            that of plain decode steps (0.02: 2%), the pauses of chunk-step graph captures made during the
            answer included, a number >= 0; unused with a fixed chunk size.
        compile_steps: run the fast path's steps with their element-wise work fused by ``torch.compile``
            inside the captured graphs (`raincheck_hf.fast.compiled`): Qwen3-VL's decoder layers whole but
            for the cache write and the attention (norms, rotary embedding, activation, residual adds), other
            families' RMSNorms and dense MLPs, and the few-query attention's softmax; the first steps of a
            model pay the compile (warm-up). None (default) = on when the fast path captures its steps as
            CUDA graphs (a model on CUDA), off otherwise (CPU, the eager engine, a fast path whose graphs
            are off, e.g. after a failed capture); True / False = always / never on the fast path's steps
            (True on CPU with ``fast_path=True`` too, compiled for the CPU). The batched engine's captured
            decode steps (`generate` with a batch, the server's ``--batching``) follow the same rule, with the
            attention's Triton kernel kept. The eager engine ignores it.
        selector: a registered name (see `raincheck_hf.selection.available_selectors()`; default
            ``"mmtok"``, the query-aware coverage selector of docs/method.md §8), a `Selector` instance,
            or a boolean tensor over the prompt's multimodal tokens in source order
            (True = keep), which pins the selection exactly.
        mode: ``full`` (prefill everything), ``hard`` (drop the deferred tokens for good),
            ``post_answer`` (restore them only after the answer), ``raincheck`` (one chunk fused into
            each decode step after the guard, the rest after the answer) or ``serial`` (raincheck
            with the chunk in its own forward before the decode token: only to measure fusion).
        selector_kwargs: keyword arguments for a selector given by name.
        fast_path: execute on preallocated KV slots with CUDA-graph replay of the prefill (in 64-row
            buckets), decode, fused and idle-time steps (`raincheck_hf.fast`), and of the vision tower per
            image / video grid (captured the second time a grid is seen). None (default) = on when the model is on CUDA
            and the family supports it (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL; the Qwen3.5 families' text and models
            split by accelerate run the eager engine, the Qwen3.5 families' vision tower is captured too); False = always the eager reference engine; True = the fast path (on CPU
            it runs the fast path's code without graphs, which the tests compare). Graph replay was
            checked against the eager engine on the H200 (`tests/test_gpu.py`).
        batch_chunk_rows: with a batch of sequences (``generate`` with B > 1, `batch_engine.BatchEngine`, the
            server's ``--batching``), a cap on the deferred chunk rows one step may carry in all, shared by the
            sequences of the step that carry a chunk (`generation.shared_chunk_cap`): while n of them times
            ``chunk_size`` fits, each carries its full chunk; otherwise each carries the largest size of
            `CHUNK_LADDER` below ``chunk_size`` with n times it within the cap, at least the ladder's smallest
            (7; a ``chunk_size`` below that is never cut). A single sequence always carries what it carries
            alone. None (default): no cap, every sequence carries its full chunk, so each row of a batch equals
            its own call exactly, whatever else runs beside it. An integer >= 1 trades that for narrower steps:
            a cut chunk leaves fewer deferred tokens restored while the answer is written (the rest after it),
            so a row then equals itself alone only *under the same chunk schedule* (its trace's
            ``chunk_size_per_forward``), and an answer can depend on how many others were running.
    """

    retention: float = 0.3
    chunk_size: int | str = 31
    decode_guard: int = 1
    selector: str | Selector | torch.Tensor = "mmtok"
    mode: str = "raincheck"
    selector_kwargs: dict = field(default_factory=dict)
    fast_path: bool | None = None
    tpot_slack: float = 0.02
    compile_steps: bool | None = None
    restore_order: str = "source"
    batch_chunk_rows: int | None = None
    chunk_every: int = 1

    def __post_init__(self):
        self.validate()
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name, value):
        """A setting changed after construction is checked at once (the old value stays on error)."""
        if not self.__dict__.get("_checked", False) or name not in _FIELDS:  # __init__: __post_init__ checks
            object.__setattr__(self, name, value)
            return
        old = self.__dict__[name]
        object.__setattr__(self, name, value)
        try:
            self.validate()
        except ValueError:
            object.__setattr__(self, name, old)
            raise

    def validate(self) -> "RaincheckConfig":
        """Check every setting (a ValueError naming it and its value); numbers are normalised in place.

        Runs at construction, on every assignment and again at every use (`coerce`, i.e. every
        ``generate(raincheck=...)`` call), which also catches a ``selector_kwargs`` dict or a keep-mask
        changed in place. Returns the config.
        """
        if not (self.compile_steps is None or isinstance(self.compile_steps, bool)):
            raise ValueError(f"RaincheckConfig.compile_steps={self.compile_steps!r} must be None (auto: on when the "
                             "fast path captures CUDA graphs), True or False.")
        if not (self.fast_path is None or isinstance(self.fast_path, bool)):
            raise ValueError(f"RaincheckConfig.fast_path={self.fast_path!r} must be None (auto: on CUDA), True or False.")
        retention = self.retention
        if isinstance(retention, bool) or not isinstance(retention, numbers.Real) or not (
            math.isfinite(retention) and 0.0 <= retention <= 1.0
        ):
            raise ValueError(f"RaincheckConfig.retention={retention!r} must be a number in [0, 1] "
                             "(0: every multimodal token deferred, 1: none).")
        object.__setattr__(self, "retention", float(retention))
        for name, low in (("chunk_size", 1), ("decode_guard", 0), ("chunk_every", 1)):
            value = getattr(self, name)
            if name == "chunk_size" and isinstance(value, str) and value == AUTO:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                extra = ' or "auto"' if name == "chunk_size" else ""
                raise ValueError(f"RaincheckConfig.{name}={value!r} must be an integer >= {low}{extra}.")
            object.__setattr__(self, name, int(value))
        if self.chunk_size == AUTO and self.chunk_every != 1:
            raise ValueError(f"RaincheckConfig.chunk_every={self.chunk_every!r} needs a fixed chunk_size: with "
                             "chunk_size=\"auto\" the measured step costs decide which steps carry a chunk (leave "
                             "chunk_every at 1).")
        rows = self.batch_chunk_rows
        if rows is not None:
            if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
                raise ValueError(f"RaincheckConfig.batch_chunk_rows={rows!r} must be None (no sharing: every sequence "
                                 "of a batched step carries its full chunk) or an integer >= 1 (the chunk rows one "
                                 "batched step may carry in all).")
            object.__setattr__(self, "batch_chunk_rows", int(rows))
        slack = self.tpot_slack
        if isinstance(slack, bool) or not isinstance(slack, numbers.Real) or not (
            math.isfinite(slack) and slack >= 0.0
        ):
            raise ValueError(f"RaincheckConfig.tpot_slack={slack!r} must be a finite number >= 0 (0.02: the "
                             "answer's mean time per token within 2% of plain decode steps).")
        object.__setattr__(self, "tpot_slack", float(slack))
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ValueError(f"RaincheckConfig.mode={self.mode!r} is not one of {list(MODES)}.")
        if not isinstance(self.restore_order, str) or self.restore_order not in RESTORE_ORDERS:
            raise ValueError(f"RaincheckConfig.restore_order={self.restore_order!r} is not one of "
                             f"{list(RESTORE_ORDERS)}.")
        if not isinstance(self.selector_kwargs, dict):
            raise ValueError(f"RaincheckConfig.selector_kwargs={self.selector_kwargs!r} must be a dict of keyword "
                             "arguments for the selector named by RaincheckConfig.selector.")
        if isinstance(self.selector, str):
            get_selector(self.selector, **self.selector_kwargs)  # raises a ValueError naming the selector
        elif isinstance(self.selector, torch.Tensor):
            if self.selector.dtype != torch.bool or self.selector.ndim != 1:
                raise ValueError(
                    "RaincheckConfig.selector as a tensor must be a 1-D boolean keep-mask over the prompt's "
                    f"multimodal tokens in source order; got dtype={self.selector.dtype}, "
                    f"shape={tuple(self.selector.shape)}."
                )
            if self.selector_kwargs:
                raise ValueError(
                    f"RaincheckConfig.selector_kwargs={self.selector_kwargs!r} only applies to a selector given by name."
                )
        elif isinstance(self.selector, Selector):
            if self.selector_kwargs:
                raise ValueError(
                    f"RaincheckConfig.selector_kwargs={self.selector_kwargs!r} only applies to a selector given by name."
                )
        else:
            raise ValueError(
                f"RaincheckConfig.selector={self.selector!r} must be a registered name, a Selector instance "
                "or a boolean keep-mask tensor."
            )
        return self

    @classmethod
    def coerce(cls, value) -> "RaincheckConfig | None":
        """What `generate(raincheck=...)` accepts: True, a config, a dict of fields, or False/None (off).

        A config is checked again here and the call gets its own copy, so a setting changed after
        construction (or while the call runs) is never used unchecked.
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            value.validate()
            return dataclasses.replace(value, selector_kwargs=dict(value.selector_kwargs))
        if isinstance(value, dict):
            unknown = [key for key in value if key not in _FIELDS]
            if unknown:
                raise ValueError(
                    f"generate(raincheck={{...}}) got unknown RaincheckConfig setting(s) {unknown}; "
                    f"valid settings are {list(_FIELDS)}."
                )
            return cls(**value)
        raise ValueError(
            f"generate(raincheck={value!r}) must be True, False, a RaincheckConfig or a dict of its fields."
        )

    def build_selector(self) -> Selector | torch.Tensor:
        if isinstance(self.selector, str):
            return get_selector(self.selector, **self.selector_kwargs)
        return self.selector

    @property
    def defers(self) -> bool:
        """Whether this mode keeps unselected tokens for later (``hard`` drops them, ``full`` has none)."""
        return self.mode in ("post_answer", "raincheck", "serial")

    @property
    def restores_during_decode(self) -> bool:
        return self.mode in ("raincheck", "serial")

    @property
    def auto_chunk(self) -> bool:
        """``chunk_size="auto"``: the decode loop picks each step's chunk size (`generation.auto_chunk_size`)."""
        return self.chunk_size == AUTO

    @property
    def max_chunk_size(self) -> int:
        """The largest chunk a decode step may carry: the fixed size, or the ladder's largest with ``"auto"``
        (what the fast path's scratch slots are sized for)."""
        return max(CHUNK_LADDER) if self.auto_chunk else self.chunk_size

    @property
    def idle_chunk_size(self) -> int:
        """Rows per idle-time restoration forward: the fixed size, or the ladder's largest with ``"auto"``
        (idle time has no time per token to protect)."""
        return self.max_chunk_size


_FIELDS = tuple(f.name for f in dataclasses.fields(RaincheckConfig))
