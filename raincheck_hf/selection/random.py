"""`random`: a seeded uniformly random subset of rows, question-agnostic (the chance baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Segment, SelectionContext, Selector

# Large odd multiplier mixing the segment index into the seed (keeps seeds of nearby segments apart).
_SEGMENT_STRIDE = 1_000_003
_SEED_MODULUS = 2**63 - 1


@dataclass
class RandomSelector(Selector):
    """Keep ``k`` rows drawn uniformly without replacement.

    The CPU generator is seeded from ``seed`` and the segment's ``index``, so two images of one prompt
    get different draws while the same prompt always gets the same selection (on any device: the draw
    never depends on the features, only on ``n``, ``k``, ``seed`` and ``index``).

    Attributes:
        seed: non-negative integer base seed.
    """

    name: str = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"RandomSelector.seed={self.seed!r} must be a non-negative integer")

    def generator_seed(self, segment_index: int) -> int:
        """The seed of the generator used for segment number ``segment_index``."""
        return (self.seed * _SEGMENT_STRIDE + int(segment_index)) % _SEED_MODULUS

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(self.generator_seed(segment.index))
        return torch.randperm(segment.num_tokens, generator=generator)[:k]
