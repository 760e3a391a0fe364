"""The fast path's Gated DeltaNet layer state: docs/method.md §4 in fixed buffers, changed only in place.

`StaticGDNState` is the `gdn.state.GDNState` of a `fast.static_cache.StaticDeferredCache`: the slot storage
allocates one per GDN layer (`RecurrentLayout` says how large), carries them over on growth and deep copies,
and a captured CUDA graph holds their addresses. The steps run `gdn.kernels` (Triton on CUDA, the references of
`gdn.algebra` elsewhere) and, for long row runs, transformers' chunked rule; `gdn.dispatch` drives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels as gdn_kernels
from .algebra import GDNLayerParams

__all__ = ["RecurrentLayout", "StaticGDNState"]


@dataclass(frozen=True)
class RecurrentLayout:
    """The Gated DeltaNet layers of a text model, as the static cache reserves them.

    Attributes:
        layers: indices of the GDN (``linear_attention``) layers.
        num_k_heads, num_v_heads, head_k_dim, head_v_dim: the head split (Qwen3.5-9B: 16, 32, 128, 128).
        kernel_size: the short convolution's width ``Kc`` (4).
        dtype: the pre-conv inputs' dtype (the model's).
    """

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    kernel_size: int
    dtype: torch.dtype

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


class StaticGDNState:
    """One GDN layer's state of docs/method.md §4 in fixed buffers (batch 1), changed only in place.

    Buffers (fp32 states, pre-conv inputs in the model's dtype):
        state ``[1, HV, K, V]`` and conv ``[1, Kc - 1, C]``: the live recurrent state and conv history;
        boundary_state / boundary_conv: S_b and h_b, where deferred rows are inserted;
        leading_state ``[1, HV, K, V]``: S_L, the first ``l <= Kc - 1`` suffix tokens applied to S_b;
        leading_qkv ``[1, Kc - 1, C]``: those tokens' pre-conv inputs (slot ``j`` holds suffix token ``j``), and
            leading_g ``[1, Kc - 1, HV]`` (fp32) / leading_beta: their gates, which an insertion does not change
            (they depend on the token's own projections only; q, k and v go through the conv and do);
        rest_map ``[1, HV, K, K]``: M, the product of the later suffix tokens' transitions.

    The suffix length ``t`` (and how many rows of a padded chunk are real) come with each step as device
    scalars, so one captured step serves every value; padding rows get ``g = 0, beta = 0`` (no change to
    any state) and never enter a conv history.
    """

    _NAMES = ("state", "conv", "boundary_state", "boundary_conv", "leading_state", "leading_qkv", "leading_g",
              "leading_beta", "rest_map")

    def __init__(self, layout: RecurrentLayout, device):
        hv, dk, dv, width = layout.num_v_heads, layout.head_k_dim, layout.head_v_dim, layout.kernel_size - 1
        f32 = dict(dtype=torch.float32, device=device)
        own = dict(dtype=layout.dtype, device=device)
        self.state = torch.zeros(1, hv, dk, dv, **f32)
        self.conv = torch.zeros(1, width, layout.conv_dim, **own)
        self.boundary_state = torch.zeros(1, hv, dk, dv, **f32)
        self.boundary_conv = torch.zeros(1, width, layout.conv_dim, **own)
        self.leading_state = torch.zeros(1, hv, dk, dv, **f32)
        self.leading_qkv = torch.zeros(1, width, layout.conv_dim, **own)
        self.leading_g = torch.zeros(1, width, hv, **f32)
        self.leading_beta = torch.zeros(1, width, hv, **own)
        self.rest_map = torch.zeros(1, hv, dk, dk, **f32)
        self.repaired = torch.zeros(1, hv, dk, dv, **f32)  # scratch of `join` (S_L'), not part of the state
        self.width = width
        self._eye = torch.eye(dk, **f32)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._NAMES]

    def copy_from(self, other: "StaticGDNState") -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)

    def zero_(self) -> None:
        for t in self.tensors():
            t.zero_()

    # ---- the steps (params: the layer's `GDNLayerParams`) -------------------------------------
    def run_chunk(self, qkv, g, beta, n_real: torch.Tensor, params: GDNLayerParams, chunk_rule=None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Deferred rows from the boundary: ``S_b <- S_b'``, ``h_b <- h_b'``; their core outputs ``[1, R, HV, V]``
        (into ``out`` when given).

        ``qkv [1, R, C]``, ``g, beta [1, R, HV]``: the first ``n_real`` (a device scalar ``[1]``) rows are
        real, the rest padding (gated to no-ops; they follow the real rows, so no real row's conv reads them,
        and only the real rows enter h_b). Two launches, each masking by ``n_real`` itself: the conv, then the
        rule token by token; or, for longer chunks (the caller's choice), ``chunk_rule``
        (transformers' chunked rule, exact for gated-off rows too).
        """
        y = gdn_kernels.conv_update_(self.boundary_conv, qkv, params.conv_weight, params.conv_bias, params.activation,
                                     rows_in=n_real)
        q, k, v = _split_heads(y, params)
        if chunk_rule is None:
            # the token-by-token kernel: `gdn.kernels.chunked_step_` computes the same in the chunked form, but a
            # fused Qwen3.5-9B step with it in this place measured no faster (9.81 against 9.58 ms on an H200)
            return gdn_kernels.recurrent_step_(self.boundary_state, q, k, v, g, beta, valid=n_real, out=out)
        g, beta = gdn_kernels.gate_off(g, beta, (torch.arange(qkv.shape[1], device=qkv.device) < n_real)[None, :, None])
        o, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=self.boundary_state,
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        self.boundary_state.copy_(final)
        return o if out is None else out.copy_(o)

    def join(self, suffix_length: torch.Tensor, params: GDNLayerParams) -> None:
        """After `run_chunk`: ``S_live += M (S_L' - S_L)``, S_L' the leading segment (``min(t, Kc - 1)``
        recorded tokens, ``t = suffix_length``, a device scalar ``[1]``) recomputed from the new h_b and
        applied to the new S_b; the live conv history follows h_b while ``t < Kc - 1``: it is the last
        ``Kc - 1`` of ``[h_b', the t recorded tokens]``, which the conv writes (otherwise it holds suffix tokens
        only and does not change). Four launches: the conv, the rule into the scratch S_L', the join, S_L <- S_L'.
        """
        t = suffix_length
        y = gdn_kernels.conv_update_(self.boundary_conv, self.leading_qkv, params.conv_weight, params.conv_bias,
                                     params.activation, rows_in=t, history_out=self.conv, only_within_window=True)
        q, k, v = _split_heads(y, params)
        gdn_kernels.recurrent_step_(self.boundary_state, q, k, v, self.leading_g, self.leading_beta, valid=t,
                                    state_out=self.repaired)
        gdn_kernels.join_(self.state, self.rest_map, self.repaired, self.leading_state)
        self.leading_state.copy_(self.repaired)

    def run_rest(self, qkv, g, beta, params: GDNLayerParams, chunk_rule=None, out: torch.Tensor | None = None):
        """Rows after the boundary (a generated token, or a turn's input) from the live state.

        One row runs the recurrent rule; several (a prefill after leftover deferred rows) ``chunk_rule`` (transformers'
        chunked gated delta rule of the layer's modeling file), as the stock module does. Returns the core
        outputs ``[1, T, HV, V]`` (into ``out`` when given) and the rows' keys ``[1, T, HK, K]`` and values (raw)
        for `record`.
        """
        y = gdn_kernels.conv_update_(self.conv, qkv, params.conv_weight, params.conv_bias, params.activation)
        q, k, v = _split_heads(y, params)
        if qkv.shape[1] == 1 or chunk_rule is None:
            return gdn_kernels.recurrent_step_(self.state, q, k, v, g, beta, out=out), k, v
        o, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=self.state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        self.state.copy_(final)
        return (o if out is None else out.copy_(o)), k, v

    def run_input(self, qkv, g, beta, n_padding: torch.Tensor, params: GDNLayerParams, chunk_rule=None):
        """A turn's input rows from the live state, after ``n_padding`` (a device scalar ``[1]``) leading padding
        rows: the layout of a bucketed prefill, ``[padding, input rows]``, whose captured graph serves every
        input length of its bucket. `run_rest`'s result for the real rows, and the same states after.

        Padding rows get ``g = 0, beta = 0`` (the state passes them unchanged), and the conv history is moved
        next to the first real row: of ``[h, padding, real rows]`` (``P`` padding rows) the shifted sequence
        is ``[anything (P rows), h, real rows]``, so every real row's conv window holds ``[h, real rows]`` only
        and the new history is the last ``Kc - 1`` of that, whatever ``P``. Padding rows' outputs are garbage.
        """
        rows = qkv.shape[1]
        device = qkv.device
        joined = torch.cat([self.conv, qkv.to(self.conv.dtype)], dim=1)  # [1, Kc - 1 + R, C]
        position = torch.arange(self.width + rows, device=device)
        index = torch.where(position < n_padding + self.width, (position - n_padding).clamp(min=0), position)
        shifted = joined.index_select(1, index)
        history = shifted[:, :self.width].clone()
        y = gdn_kernels.conv_update_(history, shifted[:, self.width:], params.conv_weight, params.conv_bias,
                                     params.activation)
        self.conv.copy_(history)  # the last Kc - 1 of [h, real rows]
        q, k, v = _split_heads(y, params)
        g, beta = gdn_kernels.gate_off(g, beta, (torch.arange(rows, device=device) >= n_padding)[None, :, None])
        if rows == 1 or chunk_rule is None:
            return gdn_kernels.recurrent_step_(self.state, q, k, v, g, beta), k, v
        out, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=self.state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        self.state.copy_(final)
        return out, k, v

    def record(self, qkv, k, v, g, beta, suffix_length: torch.Tensor, leading: bool) -> None:
        """Extend the suffix by the generated token that just ran: its pre-conv input ``qkv [1, 1, C]`` and its
        factors from `run_rest` (``k`` raw, ``v``, ``g``, ``beta [1, 1, HV]``). With ``leading`` (``t < Kc -
        1``, known on the host) it fills leading-record slot ``t`` and S_L advances by it; otherwise ``M <- A_t
        M`` (``k`` normalised inside the update)."""
        if leading:
            self.leading_qkv.index_copy_(1, suffix_length, qkv.to(self.leading_qkv.dtype))
            self.leading_g.index_copy_(1, suffix_length, g.to(self.leading_g.dtype))
            self.leading_beta.index_copy_(1, suffix_length, beta.to(self.leading_beta.dtype))
            gdn_kernels.recurrent_step_(self.leading_state, k, k, v, g, beta)  # the output is not needed
            return
        gdn_kernels.suffix_map_update_(self.rest_map, k, g, beta, l2norm=True)

    def reset_boundary(self) -> None:
        """The boundary moves to the live state (after a turn's input rows): ``S_b = S_L = S_live``,
        ``h_b`` = the live conv history, ``M = I``; the leading record is emptied by the suffix length 0."""
        self.boundary_state.copy_(self.state)
        self.leading_state.copy_(self.state)
        self.boundary_conv.copy_(self.conv)
        self.rest_map.copy_(self._eye.expand_as(self.rest_map))


def _split_heads(y: torch.Tensor, params: GDNLayerParams):
    """Conv outputs ``[1, T, C]`` -> ``q, k [1, T, HK, K]`` and ``v [1, T, HV, V]`` (channels ``[q | k | v]``)."""
    bsz, seq, _ = y.shape
    q, k, v = torch.split(y, [params.key_dim, params.key_dim, params.value_dim], dim=-1)
    return (q.reshape(bsz, seq, params.num_k_heads, params.head_k_dim),
            k.reshape(bsz, seq, params.num_k_heads, params.head_k_dim),
            v.reshape(bsz, seq, params.num_v_heads, params.head_v_dim))
