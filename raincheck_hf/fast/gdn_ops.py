"""The per-step Gated DeltaNet operations of the fast path, in place on static fp32 buffers.

On CUDA each one launches the Triton kernel of `fast.gdn_kernels` with the same signature (one launch per
layer, in place; `gdn_kernels` itself falls back to the `gated_delta` references where a kernel cannot run).
On CPU they are the torch implementations here, built from `raincheck_hf.gated_delta` (the reference of
docs/method.md §4) and written back into the given buffers with ``copy_``, so that a captured CUDA graph
keeps reading and writing the same addresses. The tests compare both against `gated_delta`.

Shapes follow the layout of transformers' Qwen3.5 and of `gated_delta` (sequence first, state key first):
``q, k [B, T, HK, K]`` (key heads; repeated to value heads here, ``repeat_interleave``), ``v [B, T, HV, V]``,
``g, beta [B, T, HV]``, states ``[B, HV, K, V]``, suffix maps ``[B, HV, K, K]``, conv histories
``[B, Kc - 1, C]`` (pre-conv inputs, oldest first).
"""

from __future__ import annotations

import torch

from . import gdn_kernels
from ..gated_delta import (
    advance_state,
    causal_conv_with_history,
    join_state,
    l2norm,
    roll_conv_history,
    update_suffix_map,
)

__all__ = ["conv_update_", "join_", "recurrent_step_", "suffix_map_update_"]


def _to_value_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """``[B, T, HK, K]`` -> ``[B, T, HV, K]``: key head ``h`` serves value heads ``h*r .. h*r + r - 1``."""
    rep = num_v_heads // x.shape[2]
    return x.repeat_interleave(rep, dim=2) if rep > 1 else x


def suffix_map_update_(M: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    """``M <- A_T ... A_1 M`` in place, ``A_t = exp(g_t) (I - beta_t k_t k_t^T)``.

    Args:
        M: ``[B, HV, K, K]`` fp32 suffix map.
        k: ``[B, T, HK, K]`` L2-normalised keys (key heads).
        g, beta: ``[B, T, HV]``.
    """
    if M.is_cuda:
        gdn_kernels.suffix_map_update_(M, k, g, beta)
        return
    M.copy_(update_suffix_map(M, _to_value_heads(k, M.shape[1]), g, beta))


def join_(S_live: torch.Tensor, M: torch.Tensor, S_new: torch.Tensor, S_old: torch.Tensor) -> None:
    """``S_live += M @ (S_new - S_old)`` in place (the state-difference identity).

    Args:
        S_live, S_new, S_old: ``[B, HV, K, V]`` fp32; M: ``[B, HV, K, K]`` fp32.
    """
    if S_live.is_cuda:
        gdn_kernels.join_(S_live, M, S_new, S_old)
        return
    S_live.copy_(join_state(S_live, M, S_old, S_new))


def recurrent_step_(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, scale: float | None = None, l2norm: bool = True) -> torch.Tensor:
    """Run ``T`` tokens of the gated delta rule from ``S``, updating ``S`` in place; the outputs.

    Token t: ``S <- exp(g_t) S``, ``S <- S + k_t (beta_t (v_t - k_t^T S))^T``, ``o_t = scale q_t^T S``
    (the state after the token), as transformers' recurrent rule.

    Args:
        S: ``[B, HV, K, V]`` fp32 state.
        q, k: ``[B, T, HK, K]`` raw (``l2norm=True``: normalised here, in fp32) or already normalised.
        v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]`` (``g = 0, beta = 0``: the token changes nothing).
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``o [B, T, HV, V]`` in ``v``'s dtype.
    """
    if S.is_cuda:
        return gdn_kernels.recurrent_step_(S, q, k, v, g, beta, scale, l2norm)
    heads, dk = S.shape[1], S.shape[2]
    q, k = _to_value_heads(q, heads).float(), _to_value_heads(k, heads).float()
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    scale = dk ** -0.5 if scale is None else scale
    state = S.float()
    out = []
    for t in range(k.shape[1]):
        state = advance_state(state, k[:, t:t + 1], v[:, t:t + 1].float(), g[:, t:t + 1], beta[:, t:t + 1])
        out.append(scale * (q[:, t, :, None, :] @ state).squeeze(-2))  # [B, HV, V]
    S.copy_(state)
    return torch.stack(out, dim=1).to(v.dtype)


_l2norm = l2norm  # the argument named ``l2norm`` shadows the function inside recurrent_step_


def conv_update_(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv of ``x`` after ``history``; ``history`` rolls past ``x`` in place.

    Args:
        history: ``[B, Kc - 1, C]`` the last pre-conv inputs before ``x``.
        x: ``[B, T, C]`` pre-conv inputs; weight: ``[C, Kc]`` (or ``[C, 1, Kc]``); bias: ``[C]`` or None.

    Returns:
        ``[B, T, C]`` post-activation conv outputs in ``x``'s dtype.
    """
    if history.is_cuda:
        return gdn_kernels.conv_update_(history, x, weight, bias, activation)
    y = causal_conv_with_history(x, history, weight, bias, activation)
    history.copy_(roll_conv_history(history, x))
    return y
