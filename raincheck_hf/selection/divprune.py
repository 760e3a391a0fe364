"""`divprune`: max-min diversity of the kept rows, question-agnostic.

After DivPrune (Alvar et al., CVPR 2025, "DivPrune: Diversity-based Visual Token Pruning for Large
Multimodal Models"): pruning is cast as a Max-Min Diversity Problem over the segment's visual tokens
with the cosine distance ``d(i, j) = 1 - cos(x_i, x_j)``, and solved greedily:

1. the first kept token is the most isolated one, the token whose distance to its nearest other token
   is the largest: ``argmax_i min_{j != i} d(i, j)``;
2. each following step adds the token whose minimum distance to the tokens kept so far is the largest:
   ``argmax_{i not in S} min_{s in S} d(i, s)``.

Each step is one vectorised update of a running ``[n]`` vector of minimum distances to the set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import GreedySelector, Segment, SelectionContext


def cosine_distance_matrix(features: torch.Tensor) -> torch.Tensor:
    """``[..., n, n]`` float32 matrix ``1 - cos(x_i, x_j)`` of ``features [..., n, D]`` on their device (zero
    rows have cos 0); leading dimensions are a batch of segments."""
    x = F.normalize(features.detach().float(), dim=-1, eps=1e-12)
    return 1.0 - x @ x.mT


def divprune_greedy(features: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (``[k]``, in selection order, on the features' device) of the greedy max-min selection."""
    n = int(features.shape[0])
    if not 0 <= k <= n:
        raise ValueError(f"divprune_greedy: k={k} must be in [0, {n}]")
    device = features.device
    selected = torch.empty(k, dtype=torch.long, device=device)
    if k == 0:
        return selected
    dist = cosine_distance_matrix(features)
    neg_inf = torch.tensor(float("-inf"), device=device)
    if n == 1:
        selected[0] = 0
        return selected
    # step 1: the token farthest from its nearest neighbour (ignore the zero self-distance)
    nearest = dist.masked_fill(torch.eye(n, dtype=torch.bool, device=device), float("inf")).amin(dim=1)
    first = torch.argmax(nearest)
    selected[0] = first
    min_dist = dist[:, first].clone()  # min distance of every token to the set so far
    taken = torch.zeros(n, dtype=torch.bool, device=device)
    taken[first] = True
    # ``j`` stays a 1-element device tensor: a 0-d index would be read back to the host every step
    for step in range(1, k):
        j = torch.argmax(torch.where(taken, neg_inf, min_dist)).reshape(1)
        selected[step:step + 1] = j
        taken.index_fill_(0, j, True)
        min_dist = torch.minimum(min_dist, dist.index_select(1, j).squeeze(1))
    return selected


@dataclass
class DivPruneSelector(GreedySelector):
    """Greedy max-min cosine diversity of the segment's visual tokens (DivPrune); ignores the question.

    Ties go to the lowest row index, so the selection is deterministic. No settings.
    """

    name: str = "divprune"
    kernel: ClassVar[str] = "divprune"

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        return divprune_greedy(segment.features, k).cpu()

    def kernel_inputs(self, features: torch.Tensor, context: SelectionContext) -> dict:
        return divprune_inputs(features)


def divprune_inputs(features: torch.Tensor) -> dict:
    """``{"D": [B, n, n], "first": [B, n]}``: the cosine distances of `divprune.cosine_distance_matrix` for
    ``features [B, n, D]`` and each token's distance to its nearest other token (the reference's first pick)."""
    D = cosine_distance_matrix(features)
    eye = torch.eye(D.shape[-1], dtype=torch.bool, device=D.device)
    return {"D": D, "first": D.masked_fill(eye, float("inf")).amin(dim=2)}
