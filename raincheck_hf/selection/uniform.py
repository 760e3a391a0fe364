"""`uniform`: evenly strided rows, question-agnostic (the simplest baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Segment, SelectionContext, Selector


@dataclass
class UniformSelector(Selector):
    """Keep ``k`` rows spread evenly over the segment: row ``floor((i + 0.5) * n / k)`` for ``i < k``."""

    name: str = "uniform"

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        n = segment.num_tokens
        return ((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).floor().long().clamp_(max=n - 1)
