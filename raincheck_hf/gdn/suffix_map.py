"""`SuffixStateMap`: one GDN layer's record for the join of docs/method.md §4, eager engine (batch of equal suffixes).

The algebra it applies is `raincheck_hf.gdn.algebra` (read its module docstring for the join, precisely); the
two hot updates go through `raincheck_hf.gdn.kernels` (`suffix_map_update_`, `join_`: Triton on CUDA, the
algebra's references wherever the kernels cannot run).
"""

from __future__ import annotations

import torch

from .algebra import (
    GDNFactors,
    GDNLayerParams,
    LeadingSegment,
    _check_seq,
    _check_state,
    _work_dtype,
    advance_state,
    gdn_factors,
    identity_map,
    repair_leading_segment,
    roll_conv_history,
)
from .kernels import join_, suffix_map_update_

__all__ = ["SuffixStateMap"]


def _check_suffix(what: str, params: GDNLayerParams, leading: LeadingSegment, tail: torch.Tensor,
                  suffix_length: int) -> None:
    """A recorded suffix of ``suffix_length`` tokens keeps ``min(t, Kc - 1)`` leading and tail rows."""
    keep = min(suffix_length, params.kernel_size - 1)
    if leading.length != keep or tail.shape[1] != keep:
        raise ValueError(f"{what}: a suffix of {suffix_length} tokens keeps {keep} leading and tail rows, got "
                         f"{leading.length} and {tail.shape[1]}.")


class SuffixStateMap:
    """Per-layer bookkeeping for the join of docs/method.md section 4 (see `gdn.algebra`'s module docstring).

    Holds the boundary state ``S_b`` (fp32), the boundary conv history ``h_b``, the leading
    segment's record and its state ``S_L`` (old factors), the rest's map ``M_R`` and the last
    ``Kc - 1`` suffix pre-conv inputs. The live state itself stays in the HF cache.

    Engine protocol, per GDN layer:

    1. after the initial prefill: ``reset_boundary(cache state, hf_conv_state_to_history(...))``;
    2. after every forward that appends suffix tokens (decode tokens): ``append_suffix`` with that
       layer's ``in_proj_qkv`` / ``in_proj_a`` / ``in_proj_b`` outputs for those tokens;
    3. for a deferred chunk: run it from ``(boundary_state, boundary_conv_history)`` to get S_b'
       and h_b', then ``live = join(S_b', h_b', live)``, write ``live`` and
       ``history_to_hf_conv_state(live_conv_history)`` back into the cache, then run the decode
       token from there (and ``append_suffix`` it).

    All tensors are batched over ``B`` and heads; every row shares the same suffix length.
    """

    def __init__(self, params: GDNLayerParams):
        self.params = params
        self._ready = False

    # -- state ------------------------------------------------------------------------------
    def reset_boundary(self, state: torch.Tensor, conv_history: torch.Tensor) -> None:
        """Start an empty suffix at a boundary.

        Args:
            state: ``[B, HV, K, V]`` the recurrent state at the boundary (copied, fp32).
            conv_history: ``[B, Kc - 1, C]`` the last pre-conv inputs before it (copied).
        """
        p = self.params
        bsz = state.shape[0]
        _check_state(state, bsz, p.num_v_heads, p.head_k_dim, p.head_v_dim, "state")
        _check_seq("conv_history", conv_history, (bsz, p.kernel_size - 1, p.conv_dim))
        dt = _work_dtype(state)
        # Own copies: HF updates its cache tensors in place.
        self.boundary_state = state.to(dt).clone()
        self.boundary_conv_history = conv_history.clone()
        self.leading_state = self.boundary_state.clone()  # S_L = S_b while L is empty
        self.rest_map = identity_map(bsz, p.num_v_heads, p.head_k_dim, device=state.device, dtype=dt)
        gate_like = conv_history.new_zeros(bsz, 0, p.num_v_heads)
        self.leading = LeadingSegment.empty(conv_history, gate_like)
        self._tail = conv_history[:, :0].clone()  # last <= Kc - 1 suffix pre-conv inputs
        self.suffix_length = 0
        self._ready = True

    def restore_suffix(self, leading: LeadingSegment, leading_state: torch.Tensor, rest_map: torch.Tensor,
                       suffix_length: int, tail: torch.Tensor) -> None:
        """After `reset_boundary`: a suffix recorded elsewhere (the batched engine's per-sequence record,
        `batched_gdn.PackedGDNState.export`). ``leading``: its first ``min(t, Kc - 1)`` tokens' inputs;
        ``leading_state`` S_L ``[B, HV, K, V]``; ``rest_map`` M_R ``[B, HV, K, K]``; ``tail [B, <= Kc - 1, C]``
        its last pre-conv inputs; ``suffix_length`` t. Copied."""
        self._require_ready()
        _check_suffix("restore_suffix", self.params, leading, tail, suffix_length)
        self.leading = leading
        self.leading_state = leading_state.to(self.leading_state.dtype).clone()
        self.rest_map = rest_map.to(self.rest_map.dtype).clone()
        self._tail = tail.to(self._tail.dtype).clone()
        self.suffix_length = int(suffix_length)

    @classmethod
    def restored(cls, params: GDNLayerParams, boundary_state: torch.Tensor, boundary_conv: torch.Tensor,
                 leading: LeadingSegment, leading_state: torch.Tensor, rest_map: torch.Tensor, suffix_length: int,
                 tail: torch.Tensor) -> "SuffixStateMap":
        """`reset_boundary` then `restore_suffix` with the same arguments, the tensors taken as they are instead of
        copied: the caller gives ones nothing else holds or writes (`batched_gdn.PackedGDNState.export_rows`' own
        gathered copies, one row of each per map; the updates here replace them or write their own rows in place).
        States fp32 (``_work_dtype`` of fp32 states), as `reset_boundary` makes them."""
        p = params
        bsz = boundary_state.shape[0]
        _check_state(boundary_state, bsz, p.num_v_heads, p.head_k_dim, p.head_v_dim, "boundary_state")
        _check_seq("boundary_conv", boundary_conv, (bsz, p.kernel_size - 1, p.conv_dim))
        for name, t in (("boundary_state", boundary_state), ("leading_state", leading_state), ("rest_map", rest_map)):
            if t.dtype != torch.float32:
                raise ValueError(f"SuffixStateMap.restored takes fp32 states, got {name} in {t.dtype}.")
        _check_suffix("restored", p, leading, tail, suffix_length)
        out = cls(params)
        out.boundary_state = boundary_state
        out.boundary_conv_history = boundary_conv
        out.leading = leading
        out.leading_state = leading_state
        out.rest_map = rest_map
        out._tail = tail if tail.dtype == boundary_conv.dtype else tail.to(boundary_conv.dtype)
        out.suffix_length = int(suffix_length)
        out._ready = True
        return out

    def _require_ready(self) -> None:
        if not self._ready:
            raise RuntimeError("SuffixStateMap: call reset_boundary(state, conv_history) first.")

    @property
    def live_conv_history(self) -> torch.Tensor:
        """``[B, Kc - 1, C]`` the conv window before the next suffix token (reaches into ``h_b``
        while the suffix is shorter than ``Kc - 1``)."""
        self._require_ready()
        return roll_conv_history(self.boundary_conv_history, self._tail)

    # -- hot path ---------------------------------------------------------------------------
    def append_suffix(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> GDNFactors:
        """Record ``n`` new suffix tokens: the first ``Kc - 1`` of the suffix join the leading
        segment (``S_L`` advances), the others extend ``M_R <- A_t M_R``.

        Args:
            mixed_qkv: ``[B, n, C]`` pre-conv inputs; a, b: ``[B, n, HV]`` gate inputs.

        Returns:
            the tokens' :class:`GDNFactors` (computed from the current live conv window).
        """
        self._require_ready()
        factors = gdn_factors(mixed_qkv, self.live_conv_history, a, b, self.params)
        n = mixed_qkv.shape[1]
        n_lead = max(0, min(n, self.params.kernel_size - 1 - self.leading.length))
        if n_lead:
            self.leading = self.leading.extended(mixed_qkv[:, :n_lead], a[:, :n_lead], b[:, :n_lead])
            self.leading_state = advance_state(
                self.leading_state,
                factors.k[:, :n_lead],
                factors.v[:, :n_lead],
                factors.g[:, :n_lead],
                factors.beta[:, :n_lead],
            )
        if n > n_lead:
            # in place (the map is private to this object): one Triton launch for all heads on CUDA,
            # update_suffix_map wherever the kernel cannot run (CPU, fp64)
            suffix_map_update_(self.rest_map, factors.k[:, n_lead:], factors.g[:, n_lead:], factors.beta[:, n_lead:])
        width = self.params.kernel_size - 1
        tail = torch.cat([self._tail, mixed_qkv.to(self._tail.dtype)], dim=1)
        self._tail = tail[:, max(0, tail.shape[1] - width) :]
        self.suffix_length += n
        return factors

    def join(
        self, new_boundary_state: torch.Tensor, new_conv_history: torch.Tensor, live_state: torch.Tensor
    ) -> torch.Tensor:
        """Correct the live state for tokens inserted at the boundary; move the boundary past them.

        Args:
            new_boundary_state: ``[B, HV, K, V]`` S_b' (the inserted tokens run from S_b).
            new_conv_history: ``[B, Kc - 1, C]`` h_b' (last pre-conv inputs of the inserted tokens,
                or of ``h_b`` and them when fewer than ``Kc - 1`` were inserted).
            live_state: ``[B, HV, K, V]`` the current live state (after the whole suffix).

        Returns:
            ``[B, HV, K, V]`` fp32 ``S_live + M_R (S_L' - S_L)``.
        """
        self._require_ready()
        p = self.params
        bsz = self.boundary_state.shape[0]
        _check_state(new_boundary_state, bsz, p.num_v_heads, p.head_k_dim, p.head_v_dim, "new_boundary_state")
        _check_seq("new_conv_history", new_conv_history, (bsz, p.kernel_size - 1, p.conv_dim))
        repair = repair_leading_segment(self.leading, new_conv_history, new_boundary_state, p)
        # join_state's identity on a copy of the live state: one Triton launch on CUDA, join_state itself
        # wherever the kernel cannot run
        dt = _work_dtype(live_state, self.rest_map, self.leading_state, repair.state)
        new_live = join_(live_state.to(dt, copy=True), self.rest_map, repair.state, self.leading_state)
        # The inserted tokens now sit before the boundary: the next insertion starts from here, and
        # L's recorded state is the one built from the new history. M_R and L's inputs are unchanged.
        self.boundary_state = new_boundary_state.to(self.boundary_state.dtype).clone()
        self.boundary_conv_history = new_conv_history.to(self.boundary_conv_history.dtype).clone()
        self.leading_state = repair.state
        return new_live
