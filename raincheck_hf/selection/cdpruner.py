"""`cdpruner`: conditional-DPP MAP selection, query-aware.

After CDPruner (Zhang et al. 2025, "Beyond Attention or Similarity: Maximizing Conditional Diversity
for Token Pruning in MLLMs"): the kept visual tokens should be diverse *conditioned on the question*.

- ``S[i, j] = cos(v_i, v_j)``: the Gram matrix of the L2-normalised visual tokens, hence PSD as it is
  (no shift needed; rank ``<= D``).
- relevance ``r_i = mean_j cos(v_i, t_j)`` over the question's text tokens, min-max normalised to
  ``[0, 1]`` over the segment; without text (or when all ``r_i`` are equal) ``r = 1`` (uniform).
- the relevance/diversity trade-off ``theta`` (the reparametrisation of Chen et al. 2018 that CDPruner
  uses): quality ``q_i = exp(a * r_i)`` with ``a = theta / (2 (1 - theta))``, so that
  ``log det L_Y = (theta / (1 - theta)) * sum_{i in Y} r_i + log det S_Y``, i.e. proportional to
  ``theta * relevance + (1 - theta) * log-diversity``. ``theta = 0`` ignores the question;
  ``theta = 1`` uses ``q = r`` directly (the paper's plain conditional kernel ``diag(r) S diag(r)``).
- kernel ``L = diag(q) S diag(q)`` (PSD), and the kept set is the greedy MAP of the DPP with kernel
  ``L``, computed with the fast incremental Cholesky update of Chen, Zhang & Zhou (NeurIPS 2018,
  "Fast Greedy MAP Inference for Determinantal Point Process to Improve Recommendation Diversity"):
  every step updates all candidates' residual gains ``d_i^2`` at once in ``O(n * step)``.

When ``k`` exceeds the kernel's numerical rank (more kept tokens than feature dimensions, duplicate or
zero rows), every remaining gain is ~0 and ``log det`` is ``-inf`` for any further addition; the
remaining slots are then filled by decreasing quality ``q`` (lowest index on ties) so that exactly ``k``
distinct rows come back. This fallback is ours: the paper stops there (it never asks for more tokens
than the rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import GreedySelector, Segment, SelectionContext

#: a residual gain ``d_i^2`` at or below ``_RANK_TOL * max_i L_ii`` counts as zero (float32 round-off)
_RANK_TOL = 1e-5


def relevance_scores(features: torch.Tensor, text_embeds: torch.Tensor | None) -> torch.Tensor:
    """``[..., n]`` float32 min-max-normalised mean cosine similarity of each visual row of ``features
    [..., n, D]`` (leading dimensions: a batch of segments) to the text rows, per segment.

    All ones when there is no text (None or zero rows) or when every row is equally relevant.
    """
    dim = int(features.shape[-1])
    device = features.device
    ones = torch.ones(features.shape[:-1], dtype=torch.float32, device=device)
    if text_embeds is None:
        return ones
    text = torch.as_tensor(text_embeds).detach()
    if text.dim() == 1:
        text = text.unsqueeze(0)
    if text.dim() != 2 or (text.shape[0] > 0 and text.shape[1] != dim):
        raise ValueError(
            f"SelectionContext.text_embeds has shape {tuple(text.shape)}; cdpruner needs [m, {dim}] "
            f"(the same embedding space as the segment's features)"
        )
    if text.shape[0] == 0:
        return ones
    v = F.normalize(features.detach().float(), dim=-1, eps=1e-12)
    t = F.normalize(text.to(device=device, dtype=torch.float32), dim=-1, eps=1e-12)
    rel = (v @ t.T).mean(dim=-1)
    lo, hi = rel.amin(dim=-1, keepdim=True), rel.amax(dim=-1, keepdim=True)
    span = hi - lo
    # all rows equally relevant (or a single row): uniform relevance, no division by ~0
    return torch.where(span > 1e-6, (rel - lo) / span.clamp(min=1e-6), ones)


def conditional_kernel(features: torch.Tensor, text_embeds: torch.Tensor | None, theta: float):
    """``(L [..., n, n], q [..., n])``: the conditional DPP kernel ``diag(q) S diag(q)`` and the qualities ``q``
    of ``features [..., n, D]`` (leading dimensions: a batch of segments)."""
    v = F.normalize(features.detach().float(), dim=-1, eps=1e-12)
    similarity = v @ v.mT
    rel = relevance_scores(features, text_embeds)
    if theta >= 1.0:
        quality = rel
    else:
        quality = torch.exp((theta / (2.0 * (1.0 - theta))) * rel)
    return quality[..., :, None] * similarity * quality[..., None, :], quality


def fallback_scores(score: torch.Tensor) -> torch.Tensor:
    """``score [..., n]`` mapped into ``[-2, -1]`` per segment: below every live gain (``> tol > 0``), above -inf
    (taken)."""
    lo, hi = score.amin(dim=-1, keepdim=True), score.amax(dim=-1, keepdim=True)
    return -2.0 + (score - lo) / (hi - lo).clamp(min=1e-30)


def dpp_greedy_map(kernel: torch.Tensor, k: int, fallback_score: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy MAP of a DPP with PSD ``kernel`` ``[n, n]`` by incremental Cholesky (Chen et al. 2018).

    Returns ``[k]`` indices in selection order on the kernel's device. Step ``t`` picks
    ``argmax_i d_i^2`` (the gain of ``log det``), then, with ``j`` the pick and ``c_i`` the Cholesky rows
    so far, ``e_i = (L[j, i] - <c_j, c_i>) / d_j`` and ``d_i^2 -= e_i^2`` for all ``i`` at once.
    Once every remaining ``d_i^2`` is numerically zero, picks go by decreasing ``fallback_score``
    (default: the diagonal of ``kernel``), lowest index on ties.
    """
    n = int(kernel.shape[0])
    if not 0 <= k <= n:
        raise ValueError(f"dpp_greedy_map: k={k} must be in [0, {n}]")
    device = kernel.device
    kernel = kernel.float()
    selected = torch.empty(k, dtype=torch.long, device=device)
    if k == 0:
        return selected
    d2 = torch.diagonal(kernel).clone()
    tol = _RANK_TOL * d2.max().clamp(min=1e-30)
    if fallback_score is None:
        fallback_score = d2.clone()
    fallback = fallback_scores(fallback_score.to(device=device, dtype=torch.float32))
    cholesky = torch.zeros(k, n, dtype=torch.float32, device=device)  # row t: e of step t
    taken = torch.zeros(n, dtype=torch.bool, device=device)
    neg_inf = torch.tensor(float("-inf"), device=device)
    for step in range(k):
        live = d2 > tol
        score = torch.where(taken, neg_inf, torch.where(live, d2, fallback))
        # ``j`` stays a 1-element device tensor: a 0-d index would be read back to the host every step
        j = torch.argmax(score).reshape(1)  # first maximum: lowest index on ties
        selected[step:step + 1] = j
        taken.index_fill_(0, j, True)
        d2_j = d2.index_select(0, j)
        # dead pick (rank exhausted): e = 0 keeps the factorisation and the other gains as they are
        e = (kernel.index_select(0, j)[0] - cholesky[:step].T @ cholesky[:step].index_select(1, j)[:, 0]) \
            / d2_j.clamp(min=1e-30).sqrt()
        e = torch.where(d2_j > tol, e, torch.zeros_like(e))
        cholesky[step] = e
        d2 = (d2 - e * e).clamp_(min=0)
    return selected


@dataclass
class CDPrunerSelector(GreedySelector):
    """Conditional-DPP greedy MAP over the segment's visual tokens (CDPruner); query-aware.

    Relevance to the question comes from ``context.text_embeds`` (``[m, D]``, the features' space);
    without text it is uniform and the method is a plain DPP on cosine similarity.

    Attributes:
        theta: relevance/diversity trade-off in ``[0, 1]``: ``q = exp(theta / (2 (1 - theta)) * r)``
            (``0``: diversity only; ``1``: the plain kernel ``diag(r) S diag(r)``). Default 0.5.
    """

    name: str = "cdpruner"
    kernel: ClassVar[str] = "cdpruner"
    theta: float = 0.5

    def __post_init__(self) -> None:
        value = self.theta
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value))
                or not 0.0 <= float(value) <= 1.0):
            raise ValueError(f"CDPrunerSelector.theta={value!r} must be in [0, 1]")

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        kernel, quality = conditional_kernel(segment.features, context.text_embeds, float(self.theta))
        return dpp_greedy_map(kernel, k, fallback_score=quality).cpu()

    def kernel_inputs(self, features: torch.Tensor, context: SelectionContext) -> dict:
        return cdpruner_inputs(features, context.text_embeds, float(self.theta))


def cdpruner_inputs(features: torch.Tensor, text_embeds: torch.Tensor | None, theta: float) -> dict:
    """``{"L", "diag", "fallback", "tol"}`` of `cdpruner.dpp_greedy_map` for ``features [B, n, D]``: the kernels
    of `cdpruner.conditional_kernel`, their diagonals, the qualities as fallback scores, the rank tolerances."""
    L, quality = conditional_kernel(features, text_embeds, theta)
    diag = torch.diagonal(L, dim1=1, dim2=2).clone()
    return {"L": L, "diag": diag, "fallback": fallback_scores(quality),
            "tol": _RANK_TOL * diag.amax(dim=1).clamp(min=1e-30)}
