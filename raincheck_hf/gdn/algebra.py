"""Gated DeltaNet state algebra for deferred prefill (docs/method.md section 4), pure PyTorch.

Qwen3.5's linear-attention layers (``Qwen3_5GatedDeltaNet``) carry, per value head, a state
``S`` of shape ``[dk, dv]``. Raincheck inserts deferred tokens *before* a suffix ``y1 .. yt``
that has already been processed (generated tokens). This module holds the algebra that
corrects the live state after such an insertion without replaying the suffix.

Conventions (read from transformers 5.24 ``modeling_qwen3_5.py``; every function here follows them)
-----------------------------------------------------------------------------------------------------
- State layout ``[B, HV, K, V]`` (keys before values), fp32. ``o_t = scale * q_t^T S_t`` is a
  contraction over the K axis. The HF cache stores this state in fp32 too (it is created with
  ``zeros_like`` of the kernel's fp32 output).
- One token, as ``torch_recurrent_gated_delta_rule`` writes it::

      S <- exp(g_t) * S
      S <- S + k_t (beta_t (v_t - k_t^T S))^T

  which is exactly the affine map ``S <- A_t S + B_t`` with ``A_t = alpha_t (I - beta_t k_t k_t^T)``,
  ``B_t = beta_t k_t v_t^T`` and ``alpha_t = exp(g_t)`` (note: ``B_t`` carries no ``alpha_t``).
- The output of token t reads the state *after* its own update: ``o_t = scale * q_t^T S_t``.
- ``q`` and ``k`` are L2-normalised per head inside the kernel (``use_qk_l2norm_in_kernel=True``,
  ``x * rsqrt(sum(x^2) + 1e-6)``, in fp32), and then ``q`` is scaled by ``dk ** -0.5``. The
  functions here that take ``k`` expect it *already normalised* (see :func:`gdn_factors`).
- Grouped heads: 16 key heads serve 32 value heads via ``repeat_interleave`` on the head axis,
  so key head ``h`` serves value heads ``h*r .. h*r + r - 1`` (``r = HV // HK``), not a tiling.
- Gates: ``beta = sigmoid(b)`` (in the model dtype) and ``g = -exp(A_log.float()) *
  softplus(a.float() + dt_bias)`` (fp32), with ``a = in_proj_a(x)``, ``b = in_proj_b(x)``.
- Short convolution: depthwise causal ``conv1d`` with kernel ``Kc = 4`` over the concatenated
  pre-conv projection ``mixed_qkv = in_proj_qkv(x)`` (channels ordered ``[q | k | v]``, sizes
  ``[HK*dk, HK*dk, HV*dv]``), SiLU after, run in the conv weight's dtype. Qwen3.5's conv has no
  bias. Zero padding stands for "no token" at the start of a sequence.
- The HF conv cache (``cache.get_conv_state``) holds *pre-conv* inputs, channels-first, ``Kc``
  wide: ``[B, C, Kc]``. Only its last ``Kc - 1`` columns are ever read (both the single-token
  ``causal_conv1d_update`` and the multi-token path drop column 0's contribution). This module's
  conv history is sequence-first ``[B, Kc - 1, C]``; :func:`hf_conv_state_to_history` and
  :func:`history_to_hf_conv_state` convert.

The join, precisely
-------------------
Physical order ``[prefix] | boundary | [y1 .. yt]``. ``S_b`` is the state at the boundary,
``h_b`` the last ``Kc - 1`` pre-conv inputs before it. The suffix was processed from
``(S_b, h_b)``, leaving the live state ``S_live``. Deferred tokens are now inserted at the
boundary; running them from ``(S_b, h_b)`` gives the new boundary state ``S_b'`` and history
``h_b'``.

Split the suffix into the *leading segment* ``L = y1 .. y_l`` with ``l = min(Kc - 1, t)`` and the
rest ``R = y_{l+1} .. y_t``. The conv output of ``y_j`` reads the pre-conv inputs of
``y_{j-Kc+1} .. y_j``; for ``j <= Kc - 1`` that window reaches into ``h_b``, so inserting
tokens changes L's ``q, k, v`` (not its ``alpha, beta``: those come from ``a, b`` alone), while
R's factors only read suffix inputs and are unchanged. With ``A``/``B`` the per-token factors:

    S_L   = (L's factors from h_b)  applied tokenwise to S_b     (stored at append time)
    M_R   = A_t ... A_{l+1}                                      (identity when R is empty)
    S_live = M_R S_L + sum_{j in R} (A_t ... A_{j+1}) B_j

so, keeping R's recorded factors,

    S_L'   = (L's factors recomputed from h_b') applied tokenwise to S_b'    (<= Kc-1 = 3 tokens)
    S_live' = M_R S_L' + (the same R terms) = S_live + M_R (S_L' - S_L).

This is exact for the recorded R factors (an approximation of a full re-run only because a
re-run would also change the suffix's inputs through lower layers). After the join the boundary
has moved past the inserted tokens: ``S_b <- S_b'``, ``h_b <- h_b'``, ``S_L <- S_L'``; ``M_R``
and L's record stay. The live conv window also changes when ``t < Kc - 1`` (it still reaches
into ``h_b``): `SuffixStateMap.live_conv_history` (`gdn.suffix_map`) reads it back.

Everything here is a pure function of its arguments (no state, no kernels). The stateful per-layer record
is `raincheck_hf.gdn.suffix_map.SuffixStateMap`; on CUDA it updates ``M_R`` and joins through the Triton
kernels of `raincheck_hf.gdn.kernels` (one launch per layer each), whose references are the functions here
(and the CPU path).

Costs per layer: ``M_R`` is ``[B, HV, dk, dk]`` fp32 (Qwen3.5-9B: 32 x 128 x 128 x 4 B = 2 MiB),
updated per decode token as ``M <- alpha (M - beta k (k^T M))`` in O(dk^2) per head; the join is
one batched ``[dk, dk] @ [dk, dv]`` matmul plus at most three rank-1 token updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "GDNFactors",
    "GDNLayerParams",
    "LeadingRepair",
    "LeadingSegment",
    "advance_state",
    "causal_conv_with_history",
    "gdn_factors",
    "gdn_gates",
    "hf_conv_state_to_history",
    "history_to_hf_conv_state",
    "identity_map",
    "join_state",
    "l2norm",
    "naive_recurrent_gated_delta",
    "repair_leading_segment",
    "roll_conv_history",
    "suffix_factors",
    "update_suffix_map",
]


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """HF/fla's L2 normalisation: ``x * rsqrt(sum(x^2) + eps)`` (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _work_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    # State algebra runs in fp32 (as HF's kernels do); fp64 is kept so tests can run references in
    # double precision.
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _check_state(state: torch.Tensor, batch: int, heads: int, dk: int, dv: int, name: str) -> None:
    expected = (batch, heads, dk, dv)
    if tuple(state.shape) == expected:
        return
    hint = ""
    if tuple(state.shape) == (batch, heads, dv, dk):
        hint = (
            " It looks transposed ([B, HV, V, K], as fla's state_v_first=True layout): this module and"
            " transformers' Qwen3.5 use [B, HV, K, V]; pass state.transpose(-1, -2)."
        )
    raise ValueError(
        f"{name} must have shape [B, HV, K, V] = {list(expected)}, got {list(state.shape)}.{hint}"
    )


def _check_seq(name: str, x: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)}, got {list(x.shape)}.")


# ----------------------------------------------------------------------------------------------
# 1. the slow reference
# ----------------------------------------------------------------------------------------------


def naive_recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule written as the explicit affine map (slow, obviously correct).

    ``S_t = A_t S_{t-1} + B_t`` with ``A_t = exp(g_t) (I - beta_t k_t k_t^T)`` and
    ``B_t = beta_t k_t v_t^T``; ``o_t = scale * q_t^T S_t`` (the state *after* token t).

    Args:
        q: ``[B, T, HV, K]`` queries, already L2-normalised and repeated to value heads.
        k: ``[B, T, HV, K]`` keys, same (normalisation is the caller's: the map is what it is for
            any ``k``, but the model normalises, see :func:`gdn_factors`).
        v: ``[B, T, HV, V]``.
        g: ``[B, T, HV]`` log decay (``<= 0``).
        beta: ``[B, T, HV]`` write strength.
        initial_state: ``[B, HV, K, V]`` or None (zeros).
        scale: query scale, default ``K ** -0.5`` as in HF.

    Returns:
        ``o`` ``[B, T, HV, V]`` in ``q``'s dtype and the final state ``[B, HV, K, V]`` in fp32
        (fp64 when any input is fp64).
    """
    bsz, seq, heads, dk = k.shape
    dv = v.shape[-1]
    _check_seq("q", q, (bsz, seq, heads, dk))
    _check_seq("v", v, (bsz, seq, heads, dv))
    _check_seq("g", g, (bsz, seq, heads))
    _check_seq("beta", beta, (bsz, seq, heads))
    dt = _work_dtype(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = dk**-0.5

    if initial_state is None:
        state = torch.zeros(bsz, heads, dk, dv, dtype=dt, device=k.device)
    else:
        _check_state(initial_state, bsz, heads, dk, dv, "initial_state")
        state = initial_state.to(dt)

    eye = torch.eye(dk, dtype=dt, device=k.device)
    out = torch.empty(bsz, seq, heads, dv, dtype=dt, device=k.device)
    for t in range(seq):
        q_t, k_t, v_t = q[:, t].to(dt), k[:, t].to(dt), v[:, t].to(dt)
        alpha_t = g[:, t].to(dt).exp()[..., None, None]
        beta_t = beta[:, t].to(dt)[..., None, None]
        a_mat = alpha_t * (eye - beta_t * k_t[..., :, None] * k_t[..., None, :])  # [B, HV, K, K]
        b_mat = beta_t * k_t[..., :, None] * v_t[..., None, :]  # [B, HV, K, V]
        state = a_mat @ state + b_mat
        out[:, t] = scale * (q_t[..., None, :] @ state).squeeze(-2)
    return out.to(q.dtype), state


def advance_state(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Apply a few tokens' updates to a state, in the rank-1 form (O(dk*dv) per head per token).

    Same map as :func:`naive_recurrent_gated_delta` without forming ``A_t``; used on the hot path
    for the (at most ``Kc - 1``) leading-segment tokens.

    Args:
        state: ``[B, HV, K, V]``.
        k: ``[B, T, HV, K]`` normalised keys; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]``.

    Returns:
        ``[B, HV, K, V]`` fp32 (fp64 for fp64 inputs).
    """
    bsz, seq, heads, dk = k.shape
    dv = v.shape[-1]
    _check_state(state, bsz, heads, dk, dv, "state")
    _check_seq("v", v, (bsz, seq, heads, dv))
    _check_seq("g", g, (bsz, seq, heads))
    _check_seq("beta", beta, (bsz, seq, heads))
    dt = _work_dtype(state, k, v)
    state = state.to(dt)
    for t in range(seq):
        k_t = k[:, t].to(dt)[..., None, :]  # [B, HV, 1, K]
        state = state * g[:, t].to(dt).exp()[..., None, None]
        delta = beta[:, t].to(dt)[..., None, None] * (v[:, t].to(dt)[..., None, :] - k_t @ state)
        state = state + k_t.transpose(-1, -2) @ delta
    return state


# ----------------------------------------------------------------------------------------------
# 2. the suffix map M = A_t ... A_1
# ----------------------------------------------------------------------------------------------


def suffix_factors(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Explicit per-token transition matrices ``A_t = exp(g_t) (I - beta_t k_t k_t^T)``.

    For tests and references only (``T * dk^2`` memory per head).

    Args:
        k: ``[B, T, HV, K]`` normalised keys; g, beta: ``[B, T, HV]``.

    Returns:
        ``[B, T, HV, K, K]`` fp32 (fp64 for fp64 inputs).
    """
    bsz, seq, heads, dk = k.shape
    _check_seq("g", g, (bsz, seq, heads))
    _check_seq("beta", beta, (bsz, seq, heads))
    dt = _work_dtype(k, g, beta)
    k = k.to(dt)
    eye = torch.eye(dk, dtype=dt, device=k.device)
    outer = k[..., :, None] * k[..., None, :]
    return g.to(dt).exp()[..., None, None] * (eye - beta.to(dt)[..., None, None] * outer)


def identity_map(
    batch: int, heads: int, dk: int, *, device=None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The suffix map at the boundary: ``I`` of shape ``[B, HV, K, K]``."""
    eye = torch.eye(dk, dtype=dtype, device=device)
    return eye.expand(batch, heads, dk, dk).clone(memory_format=torch.contiguous_format)


def update_suffix_map(
    M: torch.Tensor, k_t: torch.Tensor, g_t: torch.Tensor, beta_t: torch.Tensor
) -> torch.Tensor:
    """Online product ``M <- A_t M`` for one or several new tokens (oldest first).

    Written as ``M <- alpha (M - beta k (k^T M))``: two batched matmuls per token, O(dk^2) per
    head, never forming ``A_t``. Several tokens loop over the token axis only.

    Args:
        M: ``[B, HV, K, K]`` current map (identity at the boundary).
        k_t: ``[B, HV, K]`` (one token) or ``[B, n, HV, K]`` (n tokens), normalised keys.
        g_t, beta_t: ``[B, HV]`` or ``[B, n, HV]``.

    Returns:
        The new ``[B, HV, K, K]`` map, fp32 (fp64 if ``M`` or the inputs are fp64).
    """
    if k_t.dim() == 3:  # one token: give it a token axis
        k_t, g_t, beta_t = k_t[:, None], g_t[:, None], beta_t[:, None]
    bsz, n, heads, dk = k_t.shape
    _check_seq("M", M, (bsz, heads, dk, dk))
    _check_seq("g_t", g_t, (bsz, n, heads))
    _check_seq("beta_t", beta_t, (bsz, n, heads))
    dt = _work_dtype(M, k_t)
    M = M.to(dt)
    for t in range(n):
        k_col = k_t[:, t].to(dt)[..., :, None]  # [B, HV, K, 1]
        kT_M = k_col.transpose(-1, -2) @ M  # [B, HV, 1, K]
        beta_k = beta_t[:, t].to(dt)[..., None, None] * k_col
        M = g_t[:, t].to(dt).exp()[..., None, None] * (M - beta_k @ kT_M)
    return M


def join_state(
    S_live: torch.Tensor, M: torch.Tensor, S_b_old: torch.Tensor, S_b_new: torch.Tensor
) -> torch.Tensor:
    """State-difference identity: ``S_live + M @ (S_b_new - S_b_old)``.

    Args:
        S_live: ``[B, HV, K, V]`` the state after the suffix, computed from ``S_b_old``.
        M: ``[B, HV, K, K]`` product of the suffix's ``A`` matrices (newest on the left).
        S_b_old, S_b_new: ``[B, HV, K, V]`` boundary state before / after the insertion.

    Returns:
        ``[B, HV, K, V]`` fp32 (fp64 for fp64 inputs).
    """
    bsz, heads, dk, _ = M.shape
    _check_seq("M", M, (bsz, heads, dk, dk))
    # dv from the state's last axis, unless that axis is K: then the state is [.., V, K] and the
    # check below names the transposition instead of a confusing size mismatch.
    dv = S_live.shape[-2] if S_live.shape[-1] == dk and S_live.shape[-2] != dk else S_live.shape[-1]
    for name, s in (("S_live", S_live), ("S_b_old", S_b_old), ("S_b_new", S_b_new)):
        _check_state(s, bsz, heads, dk, dv, name)
    dt = _work_dtype(S_live, M, S_b_old, S_b_new)
    # Subtract first: the boundary change is small next to the states, and M @ S_b_new - M @ S_b_old
    # would lose it to cancellation.
    return S_live.to(dt) + M.to(dt) @ (S_b_new.to(dt) - S_b_old.to(dt))


# ----------------------------------------------------------------------------------------------
# 3. the short convolution
# ----------------------------------------------------------------------------------------------


def _conv_weight_2d(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() == 3:  # nn.Conv1d's depthwise layout [C, 1, Kc]
        if weight.shape[1] != 1:
            raise ValueError(f"depthwise conv weight must be [C, 1, Kc], got {list(weight.shape)}.")
        return weight[:, 0]
    if weight.dim() != 2:
        raise ValueError(f"conv weight must be [C, Kc] or [C, 1, Kc], got {list(weight.shape)}.")
    return weight


def _apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"activation must be 'silu' (Qwen3.5's hidden_act) or None, got {activation!r}.")


def causal_conv_with_history(
    x: torch.Tensor,
    history: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv of ``x`` continuing after ``history``, activation after.

    Mirrors HF's ``causal_conv1d_fn`` / ``causal_conv1d_update`` torch paths, dtype included
    (computed in the weight's dtype, returned in ``x``'s), so recomputed factors are the ones HF
    would compute.

    Args:
        x: ``[B, T, C]`` pre-conv inputs (``in_proj_qkv`` output).
        history: ``[B, Kc - 1, C]`` the last ``Kc - 1`` pre-conv inputs before ``x`` (zeros where
            the sequence had not started).
        weight: ``[C, Kc]`` or ``[C, 1, Kc]`` (as stored in ``nn.Conv1d``).
        bias: ``[C]`` or None (Qwen3.5 has none).
        activation: ``"silu"`` or None.

    Returns:
        ``[B, T, C]`` post-activation conv outputs.
    """
    w = _conv_weight_2d(weight)
    channels, kernel = w.shape
    bsz, seq, _ = x.shape
    _check_seq("x", x, (bsz, seq, channels))
    _check_seq("history", history, (bsz, kernel - 1, channels))
    if seq == 0:  # e.g. an empty leading segment: conv1d refuses inputs shorter than the kernel
        return x.clone()
    full = torch.cat([history.to(x.dtype), x], dim=1).transpose(1, 2)  # [B, C, Kc - 1 + T]
    # No padding: the history plays the role of HF's left zero padding / cached conv state.
    out = F.conv1d(full.to(w.dtype), w.unsqueeze(1), bias, groups=channels)  # [B, C, T]
    return _apply_activation(out, activation).transpose(1, 2).to(x.dtype)


def roll_conv_history(history: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The last ``Kc - 1`` pre-conv inputs after appending ``x``: ``cat(history, x)[-(Kc-1):]``.

    Args:
        history: ``[B, Kc - 1, C]``; x: ``[B, T, C]`` (T may be 0).

    Returns:
        ``[B, Kc - 1, C]`` in ``history``'s dtype.
    """
    width = history.shape[1]
    if width == 0:
        return history
    return torch.cat([history, x.to(history.dtype)], dim=1)[:, -width:]


def hf_conv_state_to_history(conv_state: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """HF's conv cache ``[B, C, Kc]`` (channels-first, pre-conv) to a history ``[B, Kc - 1, C]``.

    Returns a view of the cache tensor, which HF updates in place: clone it to keep it
    (:meth:`SuffixStateMap.reset_boundary` and :meth:`SuffixStateMap.join` do).
    """
    if conv_state.dim() != 3 or conv_state.shape[-1] < kernel_size - 1:
        raise ValueError(
            f"conv_state must be HF's [B, C, W] with W >= kernel_size - 1 = {kernel_size - 1},"
            f" got {list(conv_state.shape)}."
        )
    return conv_state[..., conv_state.shape[-1] - (kernel_size - 1) :].transpose(1, 2)


def history_to_hf_conv_state(history: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """A history ``[B, Kc - 1, C]`` to HF's conv cache layout ``[B, C, Kc]``.

    Column 0 (the ``Kc``-th latest input) is filled with zeros: HF never reads it, it only shifts
    out on the next update. Copy the result into ``cache.get_conv_state(layer)`` in place (HF keeps
    a static address for CUDA graphs).
    """
    _check_seq("history", history, (history.shape[0], kernel_size - 1, history.shape[-1]))
    pad = history.new_zeros(history.shape[0], 1, history.shape[-1])
    return torch.cat([pad, history], dim=1).transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------
# 4. factors from pre-conv inputs, the leading-segment repair
# ----------------------------------------------------------------------------------------------


@dataclass
class GDNLayerParams:
    """What is needed to turn one GDN layer's pre-conv inputs into delta-rule factors.

    Attributes:
        conv_weight: ``[C, Kc]`` (``[C, 1, Kc]`` accepted and viewed) with
            ``C = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim``.
        A_log, dt_bias: ``[HV]``.
        num_k_heads, num_v_heads, head_k_dim, head_v_dim: the head split (Qwen3.5: 16, 32, 128, 128).
        conv_bias: ``[C]`` or None.
        activation: the conv's activation, ``"silu"`` for Qwen3.5.
    """

    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_bias: torch.Tensor | None = None
    activation: str | None = "silu"

    def __post_init__(self) -> None:
        self.conv_weight = _conv_weight_2d(self.conv_weight)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads ({self.num_k_heads}):"
                " key heads are repeated (repeat_interleave) to value heads."
            )
        if self.conv_weight.shape[0] != self.conv_dim:
            raise ValueError(
                f"conv_weight has {self.conv_weight.shape[0]} channels, but the head split gives"
                f" 2 * {self.num_k_heads} * {self.head_k_dim} + {self.num_v_heads} * {self.head_v_dim}"
                f" = {self.conv_dim}; check num_*_heads / head_*_dim."
            )
        for name in ("A_log", "dt_bias"):
            t = getattr(self, name)
            if tuple(t.shape) != (self.num_v_heads,):
                raise ValueError(f"{name} must have shape [{self.num_v_heads}], got {list(t.shape)}.")
        if self.conv_bias is not None and tuple(self.conv_bias.shape) != (self.conv_dim,):
            raise ValueError(f"conv_bias must have shape [{self.conv_dim}], got {list(self.conv_bias.shape)}.")
        _apply_activation(self.conv_weight.new_zeros(1), self.activation)  # validates the name

    @classmethod
    def from_module(cls, module) -> GDNLayerParams:
        """Read a ``Qwen3_5GatedDeltaNet`` (or a module with the same attribute names).

        The tensors are detached views of the module's parameters, not copies.
        """
        bias = module.conv1d.bias
        return cls(
            conv_weight=module.conv1d.weight.detach(),
            conv_bias=None if bias is None else bias.detach(),
            A_log=module.A_log.detach(),
            dt_bias=module.dt_bias.detach(),
            num_k_heads=module.num_k_heads,
            num_v_heads=module.num_v_heads,
            head_k_dim=module.head_k_dim,
            head_v_dim=module.head_v_dim,
            activation=module.activation,
        )

    @property
    def kernel_size(self) -> int:
        return int(self.conv_weight.shape[-1])

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GDNFactors(NamedTuple):
    """Delta-rule inputs of some tokens, as the kernel sees them (fp32, value-head aligned).

    ``q, k``: ``[B, T, HV, K]`` L2-normalised and repeated to value heads (``q`` not yet scaled);
    ``v``: ``[B, T, HV, V]``; ``g, beta``: ``[B, T, HV]``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def gdn_factors(
    mixed_qkv: torch.Tensor,
    history: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: GDNLayerParams,
) -> GDNFactors:
    """Pre-conv projections to the delta-rule factors, exactly as ``Qwen3_5GatedDeltaNet`` does.

    Args:
        mixed_qkv: ``[B, T, C]`` ``in_proj_qkv`` outputs (pre-conv).
        history: ``[B, Kc - 1, C]`` pre-conv inputs before these tokens.
        a: ``[B, T, HV]`` ``in_proj_a`` outputs; b: ``[B, T, HV]`` ``in_proj_b`` outputs.
        params: the layer's conv / gate parameters and head split.

    Returns:
        :class:`GDNFactors` in fp32 (fp64 for fp64 inputs).
    """
    bsz, seq, _ = mixed_qkv.shape
    p = params
    _check_seq("a", a, (bsz, seq, p.num_v_heads))
    _check_seq("b", b, (bsz, seq, p.num_v_heads))
    conv = causal_conv_with_history(mixed_qkv, history, p.conv_weight, p.conv_bias, p.activation)
    q, k, v = torch.split(conv, [p.key_dim, p.key_dim, p.value_dim], dim=-1)
    dt = _work_dtype(mixed_qkv)
    # HF casts to fp32 and normalises inside the kernel; normalising before the head repeat is the
    # same thing (per-head op) and cheaper.
    q = l2norm(q.reshape(bsz, seq, p.num_k_heads, p.head_k_dim).to(dt))
    k = l2norm(k.reshape(bsz, seq, p.num_k_heads, p.head_k_dim).to(dt))
    v = v.reshape(bsz, seq, p.num_v_heads, p.head_v_dim).to(dt)
    rep = p.num_v_heads // p.num_k_heads
    if rep > 1:  # key head h serves value heads h*rep .. h*rep + rep - 1
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    g, beta = gdn_gates(a, b, p)
    return GDNFactors(q=q, k=k, v=v, g=g.to(dt), beta=beta.to(dt))


def gdn_gates(a: torch.Tensor, b: torch.Tensor, params: GDNLayerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` from the gate inputs ``a = in_proj_a(x)``, ``b = in_proj_b(x)`` (``[B, T, HV]``), with the
    module's expressions and dtype path: ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32, ``beta =
    sigmoid(b)`` in the model dtype."""
    return -params.A_log.float().exp() * F.softplus(a.float() + params.dt_bias), b.sigmoid()


@dataclass
class LeadingSegment:
    """What is kept of the first ``l <= Kc - 1`` suffix tokens to recompute their factors.

    Attributes:
        mixed_qkv: ``[B, l, C]`` pre-conv ``in_proj_qkv`` outputs.
        a, b: ``[B, l, HV]`` gate inputs (``in_proj_a`` / ``in_proj_b`` outputs).
    """

    mixed_qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    def __post_init__(self) -> None:
        bsz, length, _ = self.mixed_qkv.shape
        if self.a.shape[:2] != (bsz, length) or self.b.shape != self.a.shape:
            raise ValueError(
                f"LeadingSegment: mixed_qkv {list(self.mixed_qkv.shape)}, a {list(self.a.shape)} and"
                f" b {list(self.b.shape)} must agree on [B, l]."
            )

    @property
    def length(self) -> int:
        return int(self.mixed_qkv.shape[1])

    @classmethod
    def empty(cls, like_qkv: torch.Tensor, like_gate: torch.Tensor) -> LeadingSegment:
        """A zero-length record with the batch, channels, dtype and device of the examples given."""
        return cls(mixed_qkv=like_qkv[:, :0], a=like_gate[:, :0], b=like_gate[:, :0])

    def extended(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> LeadingSegment:
        return LeadingSegment(
            mixed_qkv=torch.cat([self.mixed_qkv, mixed_qkv.to(self.mixed_qkv.dtype)], dim=1),
            a=torch.cat([self.a, a.to(self.a.dtype)], dim=1),
            b=torch.cat([self.b, b.to(self.b.dtype)], dim=1),
        )


class LeadingRepair(NamedTuple):
    """``state``: ``[B, HV, K, V]`` S_L', the leading segment applied to the new boundary state;
    ``factors``: the leading tokens' recomputed :class:`GDNFactors`."""

    state: torch.Tensor
    factors: GDNFactors


def repair_leading_segment(
    leading: LeadingSegment,
    new_history: torch.Tensor,
    new_boundary_state: torch.Tensor,
    params: GDNLayerParams,
) -> LeadingRepair:
    """Recompute the leading segment's factors from the new conv history and apply them.

    Args:
        leading: the first ``l <= Kc - 1`` suffix tokens' pre-conv and gate inputs.
        new_history: ``[B, Kc - 1, C]`` pre-conv inputs just before the boundary after insertion.
        new_boundary_state: ``[B, HV, K, V]`` S_b'.
        params: the layer's parameters.

    Returns:
        :class:`LeadingRepair` with ``state = S_L'`` (fp32); for ``l = 0`` it is S_b' itself.
    """
    if leading.length > params.kernel_size - 1:
        raise ValueError(
            f"the leading segment holds {leading.length} tokens, more than kernel_size - 1 ="
            f" {params.kernel_size - 1}: later tokens do not read the boundary history; keep them in M_R."
        )
    factors = gdn_factors(leading.mixed_qkv, new_history, leading.a, leading.b, params)
    state = advance_state(new_boundary_state, factors.k, factors.v, factors.g, factors.beta)
    return LeadingRepair(state=state, factors=factors)
