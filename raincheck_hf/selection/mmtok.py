"""`mmtok`: multimodal coverage maximisation, query-aware.

After MMTok (Dong et al. 2025, "MMTok: Multimodal Coverage Maximization for Efficient Inference of
VLMs"): the kept visual tokens should *cover* both the question's text tokens and the segment's full
set of visual tokens. With ``V`` the ``[n, D]`` visual tokens and ``T`` the ``[m, D]`` text tokens,

- ``P_tv[j, i] = softmax_i(cos(t_j, v_i) / tau_t)``  (``[m, n]``, each text row sums to 1 over visual tokens),
- ``P_vv[j, i] = softmax_i(cos(v_j, v_i) / tau_v)``  (``[n, n]``, each visual row sums to 1),
- ``coverage_text(S)   = mean_j max_{i in S} P_tv[j, i]``,
- ``coverage_vision(S) = mean_j max_{i in S} P_vv[j, i]``,
- ``f(S) = alpha * coverage_text(S) + (1 - alpha) * coverage_vision(S)``.

``f`` is a non-negative mixture of facility-location functions, hence monotone submodular, and the
greedy ``k``-step maximisation (``1 - 1/e`` guarantee) is what :class:`MMTokSelector` runs; each step
scores every candidate's marginal gain at once:
``gain(i) = alpha * mean_j relu(P_tv[j, i] - cov_t[j]) + (1 - alpha) * mean_j relu(P_vv[j, i] - cov_v[j])``,
with ``cov_t`` / ``cov_v`` the current per-row maxima over the kept set.

Without text (``context.text_embeds`` None or with zero rows) the objective is the vision term alone,
``f(S) = coverage_vision(S)``, whatever ``alpha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import GreedySelector, Segment, SelectionContext


def _as_text(features: torch.Tensor, text_embeds: torch.Tensor | None) -> torch.Tensor | None:
    """Text rows as float32 ``[m, D]`` on the features' device, or None when there is no text."""
    if text_embeds is None:
        return None
    text = torch.as_tensor(text_embeds).detach()
    if text.dim() == 1:
        text = text.unsqueeze(0)
    if text.dim() != 2 or (text.shape[0] > 0 and text.shape[1] != features.shape[-1]):
        raise ValueError(
            f"SelectionContext.text_embeds has shape {tuple(text.shape)}; mmtok needs [m, {features.shape[-1]}] "
            f"(the same embedding space as the segment's features)"
        )
    if text.shape[0] == 0:
        return None
    return text.to(device=features.device, dtype=torch.float32)


def coverage_matrices(
    features: torch.Tensor, text_embeds: torch.Tensor | None, tau_t: float, tau_v: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(P_tv [m, n] or None, P_vv [n, n])`` in float32 on the features' device, for ``features [n, D]``; for a
    group of equal segments ``[B, n, D]`` the same in one batched call, ``(P_tv [B, m, n] or None, P_vv [B, n, n])``
    (a batched product may round differently from the segments' own: `group_coverage` says which a group gets)."""
    v = F.normalize(features.detach().float(), dim=-1, eps=1e-12)
    text = _as_text(features, text_embeds)
    p_vv = torch.softmax((v @ v.transpose(-1, -2)) / tau_v, dim=-1)
    p_tv = None
    if text is not None:
        t = F.normalize(text, dim=-1, eps=1e-12)
        p_tv = torch.softmax((t @ v.transpose(-1, -2)) / tau_t, dim=-1)
    return p_tv, p_vv


def group_coverage(
    features: torch.Tensor, text_embeds: torch.Tensor | None, tau_t: float, tau_v: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The coverage matrices of a group of ``B`` equal segments (``features [B, n, D]``; a video's temporal slices),
    as both the reference loop and the kernels read them: ``(P_tv [B, m, n] or None, P_vv [B, n, n])``. One segment
    gets `coverage_matrices` of its own ``[n, D]`` (what `mmtok_greedy` computes); several get one batched call,
    a few launches where a loop over the segments took a dozen each (a 32-slice video: ~13 ms of host time)."""
    if features.shape[0] == 1:
        p_tv, p_vv = coverage_matrices(features[0], text_embeds, tau_t, tau_v)
        return (None if p_tv is None else p_tv.unsqueeze(0)), p_vv.unsqueeze(0)
    return coverage_matrices(features, text_embeds, tau_t, tau_v)


def _objective_from(p_tv: torch.Tensor | None, p_vv: torch.Tensor, selected: torch.Tensor, alpha: float) -> torch.Tensor:
    if selected.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=p_vv.device)
    cov_v = p_vv.index_select(1, selected).amax(dim=1).mean()
    if p_tv is None:
        return cov_v
    cov_t = p_tv.index_select(1, selected).amax(dim=1).mean()
    return alpha * cov_t + (1.0 - alpha) * cov_v


def mmtok_objective(
    features: torch.Tensor,
    text_embeds: torch.Tensor | None,
    selected_indices,
    alpha: float = 0.5,
    tau_t: float = 0.02,
    tau_v: float = 0.2,
) -> float:
    """The MMTok coverage objective ``f(S)`` of the rows ``selected_indices`` of ``features`` (see the module doc).

    ``f(empty set) = 0``. With ``text_embeds`` None or empty it is the vision coverage alone.
    """
    selected = torch.as_tensor(selected_indices, dtype=torch.long).flatten().to(features.device).unique()
    p_tv, p_vv = coverage_matrices(features, text_embeds, tau_t, tau_v)
    return float(_objective_from(p_tv, p_vv, selected, alpha))


def gain_weights(has_text: bool, alpha: float) -> tuple[float, float]:
    """``(w_t, w_v)``: the weights of the text and vision coverage terms (the vision term alone without text)."""
    return (float(alpha), 1.0 - float(alpha)) if has_text else (0.0, 1.0)


def mmtok_greedy(
    features: torch.Tensor,
    text_embeds: torch.Tensor | None,
    k: int,
    alpha: float = 0.5,
    tau_t: float = 0.02,
    tau_v: float = 0.2,
) -> torch.Tensor:
    """Indices (``[k]``, in selection order, on the features' device) of the greedy maximiser of ``f``."""
    return mmtok_greedy_group(features[None], text_embeds, k, alpha, tau_t, tau_v)[0]


def mmtok_greedy_group(features: torch.Tensor, text_embeds: torch.Tensor | None, k: int, alpha: float = 0.5,
                       tau_t: float = 0.02, tau_v: float = 0.2) -> torch.Tensor:
    """``[B, k]`` indices of the greedy maximiser of ``f`` for each segment of a group ``features [B, n, D]``, on the
    group's coverage matrices (`group_coverage`): what `MMTokSelector` picks for a group, and the reference of the
    kernels' picks. A group of one: `mmtok_greedy`'s picks (its segment's own coverage matrices)."""
    n = int(features.shape[1])
    if not 0 <= k <= n:
        raise ValueError(f"mmtok_greedy_group: k={k} must be in [0, {n}]")
    p_tv, p_vv = group_coverage(features, text_embeds, tau_t, tau_v)
    return torch.stack([greedy_over(None if p_tv is None else p_tv[b], p_vv[b], k, alpha)
                        for b in range(p_vv.shape[0])])


def greedy_over(p_tv: torch.Tensor | None, p_vv: torch.Tensor, k: int, alpha: float) -> torch.Tensor:
    """The reference greedy loop on one segment's coverage matrices: ``[k]`` indices in selection order."""
    n = int(p_vv.shape[0])
    device = p_vv.device
    selected = torch.empty(k, dtype=torch.long, device=device)
    if k == 0:
        return selected
    w_t, w_v = gain_weights(p_tv is not None, alpha)
    cov_v = torch.zeros(n, dtype=torch.float32, device=device)  # max over S of P_vv[j, S]; 0 for S empty
    cov_t = None if p_tv is None else torch.zeros(p_tv.shape[0], dtype=torch.float32, device=device)
    taken = torch.zeros(n, dtype=torch.bool, device=device)
    neg_inf = torch.tensor(float("-inf"), device=device)
    # ``j`` stays a 1-element device tensor: indexing with a 0-d tensor (or int(j)) would read it back
    # to the host, one device sync per step (403 of them for a 1,344-token image at retention 0.3)
    for step in range(k):
        # summed in float64 and rounded to float32 once: the value does not depend on the order of the sum (to
        # ~1e-16), so the Triton kernels of `selection.kernels` make the same picks whatever order they sum in
        gain = torch.zeros(n, dtype=torch.float64, device=device)
        if w_v > 0:
            gain = gain + (p_vv - cov_v[:, None]).clamp_(min=0).double().sum(dim=0) * (w_v / n)
        if p_tv is not None and w_t > 0:
            gain = gain + (p_tv - cov_t[:, None]).clamp_(min=0).double().sum(dim=0) * (w_t / p_tv.shape[0])
        j = torch.argmax(torch.where(taken, neg_inf, gain.float())).reshape(1)  # first maximum: lowest index on ties
        selected[step:step + 1] = j
        taken.index_fill_(0, j, True)
        cov_v = torch.maximum(cov_v, p_vv.index_select(1, j).squeeze(1))
        if p_tv is not None:
            cov_t = torch.maximum(cov_t, p_tv.index_select(1, j).squeeze(1))
    return selected


def _check_unit(owner: str, setting: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) <= 1.0):
        raise ValueError(f"{owner}.{setting}={value!r} must be in [0, 1]")


def _check_positive(owner: str, setting: str, value) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value))
            or float(value) <= 0):
        raise ValueError(f"{owner}.{setting}={value!r} must be a finite number > 0")


@dataclass
class MMTokSelector(GreedySelector):
    """Greedy multimodal coverage maximisation (MMTok); query-aware.

    Covers the question's text tokens (``context.text_embeds``, ``[m, D]`` in the features' space) and
    the segment's own visual tokens. When ``context.text_embeds`` is None or has no rows, it falls back
    to the vision coverage term only (``alpha`` is then ignored).

    Attributes:
        alpha: weight of the text coverage term, in ``[0, 1]`` (``1 - alpha`` weighs the vision term).
        text_temperature: ``tau_t`` of the text-to-visual softmax, ``> 0``.
        vision_temperature: ``tau_v`` of the visual-to-visual softmax, ``> 0``.
    """

    name: str = "mmtok"
    kernel: ClassVar[str] = "mmtok"
    alpha: float = 0.5
    text_temperature: float = 0.02
    vision_temperature: float = 0.2

    def __post_init__(self) -> None:
        _check_unit("MMTokSelector", "alpha", self.alpha)
        _check_positive("MMTokSelector", "text_temperature", self.text_temperature)
        _check_positive("MMTokSelector", "vision_temperature", self.vision_temperature)

    def objective(self, segment: Segment, selected_indices, context: SelectionContext) -> float:
        """``f(S)`` with this selector's settings."""
        return mmtok_objective(segment.features, context.text_embeds, selected_indices, self.alpha,
                               self.text_temperature, self.vision_temperature)

    def select_segment(self, segment: Segment, k: int, context: SelectionContext) -> torch.Tensor:
        return mmtok_greedy(segment.features, context.text_embeds, k, self.alpha, self.text_temperature,
                            self.vision_temperature).cpu()

    def select_group(self, segments: list[Segment], k: int, context: SelectionContext) -> list[torch.Tensor]:
        if len(segments) == 1 or self.uses_kernels(segments, context):
            return super().select_group(segments, k, context)
        # the reference loop on the group's coverage matrices, as the kernels read them (`group_coverage`)
        features = torch.stack([segment.features for segment in segments])
        return list(mmtok_greedy_group(features, context.text_embeds, k, self.alpha, self.text_temperature,
                                       self.vision_temperature).cpu())

    def kernel_inputs(self, features: torch.Tensor, context: SelectionContext) -> dict:
        return mmtok_inputs(features, context.text_embeds, self.alpha, self.text_temperature, self.vision_temperature)


TEXT_BUCKET = 32  # text rows of the kernels' inputs are padded to a multiple of this, so a graph serves many question lengths


def mmtok_inputs(features: torch.Tensor, text_embeds: torch.Tensor | None, alpha: float, tau_t: float,
                 tau_v: float) -> dict:
    """``{"P": [B, R, n], "W": [R] float64}`` for ``features [B, n, D]``: the group's coverage matrices
    (`group_coverage`, the reference's own, so the values are the same to the bit), vision rows then
    text rows padded with zeros to a multiple of `TEXT_BUCKET`, and each row's weight in the gain (the term's
    weight over its row count; 0 for padding, which then adds exactly 0)."""
    p_tv, p_vv = group_coverage(features, text_embeds, tau_t, tau_v)
    n = p_vv.shape[-1]
    w_t, w_v = gain_weights(p_tv is not None, alpha)
    if p_tv is None:
        return {"P": p_vv, "W": torch.full((n,), w_v / n, dtype=torch.float64, device=p_vv.device)}
    m = p_tv.shape[1]
    R = n + -(-m // TEXT_BUCKET) * TEXT_BUCKET
    P = p_vv.new_zeros(p_vv.shape[0], R, n)
    P[:, :n] = p_vv
    P[:, n:n + m] = p_tv
    W = torch.zeros(R, dtype=torch.float64, device=p_vv.device)
    W[:n], W[n:n + m] = w_v / n, w_t / m
    return {"P": P, "W": W}
