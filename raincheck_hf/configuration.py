"""`RaincheckConfig`: the settings of one Raincheck generation, validated before any compute."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .selection import Selector, get_selector

MODES = ("full", "hard", "post_answer", "raincheck", "serial")


@dataclass
class RaincheckConfig:
    """How a prompt's multimodal tokens are split and when the deferred ones are prefilled.

    Args:
        retention: fraction r of each image's / video slice's visual tokens prefilled first, in [0, 1].
        chunk_size: c, deferred tokens prefilled per decode step (and per idle-time step), >= 1.
        decode_guard: g, no deferred chunk runs before g tokens have been generated, >= 0.
        selector: a registered name (see `raincheck_hf.selection.available_selectors()`; default
            ``"mmtok"``, the query-aware coverage selector of method.md §8), a `Selector` instance,
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
    """

    retention: float = 0.3
    chunk_size: int = 31
    decode_guard: int = 16
    selector: str | Selector | torch.Tensor = "mmtok"
    mode: str = "raincheck"
    selector_kwargs: dict = field(default_factory=dict)
    fast_path: bool | None = None

    def __post_init__(self):
        if self.fast_path not in (None, True, False):
            raise ValueError(f"RaincheckConfig.fast_path={self.fast_path!r} must be None (auto: on CUDA), True or False.")
        if isinstance(self.retention, bool) or not isinstance(self.retention, (int, float)) or not (
            math.isfinite(self.retention) and 0.0 <= self.retention <= 1.0
        ):
            raise ValueError(f"RaincheckConfig.retention={self.retention!r} must be a number in [0, 1].")
        self.retention = float(self.retention)
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"RaincheckConfig.chunk_size={self.chunk_size!r} must be an integer >= 1.")
        if isinstance(self.decode_guard, bool) or not isinstance(self.decode_guard, int) or self.decode_guard < 0:
            raise ValueError(f"RaincheckConfig.decode_guard={self.decode_guard!r} must be an integer >= 0.")
        if self.mode not in MODES:
            raise ValueError(f"RaincheckConfig.mode={self.mode!r} is not one of {list(MODES)}.")
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

    @classmethod
    def coerce(cls, value) -> "RaincheckConfig | None":
        """What `generate(raincheck=...)` accepts: True, a config, a dict of fields, or False/None (off)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
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
