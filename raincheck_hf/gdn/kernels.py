"""Kernels for the hot Gated DeltaNet work of a Qwen3.5 step, each beside its reference.

Four in-place operations on static buffers, one launch each for all heads (or channels) of a layer, so that
a captured CUDA graph can hold them:

- `suffix_map_update_`: the suffix map ``M <- A_T ... A_1 M`` with ``A_t = exp(g_t) (I - beta_t k_t k_t^T)``
  (docs/method.md §4), in the form ``M <- alpha (M - beta k (k^T M))``. Column ``j`` of the product
  depends on column ``j`` of ``M`` only, so each program owns a ``[K, BLOCK_J]`` column slab of one head's
  map and the whole map is read once and written once (2 MiB per Qwen3.5-9B layer).
- `join_`: the state-difference identity ``S_live += M (S_new - S_old)``, the difference taken first (as
  `algebra.join_state`), fp32 products.
- `recurrent_step_`: the gated delta rule for one or a few tokens (transformers'
  ``torch_recurrent_gated_delta_rule``: q/k L2-normalised inside, q scaled, output read after the update).
- `conv_update_`: the depthwise causal short convolution continuing after a sequence-first history
  (``[B, Kc - 1, C]``, as `algebra`), SiLU after, the history rolled in place.

Conventions are `raincheck_hf.gdn.algebra`'s: state ``[B, HV, K, V]`` fp32 (keys first), key head ``h``
serves value heads ``h*r .. h*r + r - 1`` (``r = HV // HK``, transformers' ``repeat_interleave``).

Dispatch: every function takes ``reference``. ``None`` (default) launches the Triton kernel when the
tensors are on CUDA, Triton is importable and the buffer written in place is contiguous fp32, and runs the
reference otherwise (on CPU the fast path's code then computes exactly what the references compute);
``True`` always runs the reference; ``False`` always launches the kernel (on CPU that needs Triton's
interpreter, ``TRITON_INTERPRET=1``, which is how the CPU tests run them). Inputs that are only read may be
strided views (e.g. the q / k / v split of the conv output) as long as their last axis is contiguous. The references are
`algebra.update_suffix_map`, `algebra.join_state`, `recurrent_step_reference` (transformers'
recurrent rule, op for op) and `algebra.causal_conv_with_history` + `algebra.roll_conv_history`; each
wrapper's docstring names its reference, and its Triton kernel (the name without the underscore) is in `gdn._triton`.

Counts on the device: ``valid`` (`recurrent_step_`, `chunked_step_`: how many leading tokens are real) and
``rows_in`` (`conv_update_`: how many leading rows enter the history) are a device scalar for the whole batch (the
batch-1 fast path's padded chunk) or ``[B]`` integers, one per batch row (the batched captured step,
`batched_gdn.PackedGDNState.static_step`: each sequence's own chunk length; 0 leaves its state / history as it was).

Nothing here synchronises with the host or allocates more than the returned output, so the kernel paths
can be captured in a CUDA graph. Triton is imported on the first launch only.
"""

from __future__ import annotations

import functools
import os

import torch

from .._triton import cdiv, pow2, triton_available
from .algebra import causal_conv_with_history, join_state, roll_conv_history, update_suffix_map
from .algebra import l2norm as l2norm_keys

__all__ = [
    "chunked_step_",
    "conv_update_",
    "gate_off",
    "join_",
    "recurrent_step_",
    "recurrent_step_reference",
    "suffix_map_update_",
    "triton_available",
]

# Tile sizes (columns per program; see each kernel) and warps per program, chosen for K = V = 128 (Qwen3.5) by
# what ptxas reports for sm_90 (no register spills) and one wave of programs: 4 column blocks per head, so 128
# programs per layer for the map and the one-token step (32 value heads), 128 for the join (64 x 64 tiles), 64
# for the conv (8,192 channels). `python -m raincheck_hf.bench gdn --sweep` times the alternatives.
SUFFIX_BLOCK_J, SUFFIX_WARPS = 32, 8
JOIN_BLOCK, JOIN_BLOCK_R, JOIN_WARPS = 64, 16, 8  # 64 x 64 x 32 with 4 warps spills registers
STEP_BLOCK_V, STEP_WARPS = 32, 8
# Several tokens (a deferred chunk from the boundary state) are a serial chain of reductions over K: one warp per
# 8-column slab keeps those reductions inside the warp (shuffles, no barrier per token), 512 programs per layer.
STEP_CHUNK_BLOCK_V, STEP_CHUNK_WARPS = 8, 1
CONV_BLOCK_C, CONV_WARPS = 128, 4
# A chunk in the chunked form: one program per head and 32-column value slab (128 per Qwen3.5-9B layer), the
# chunk's tokens padded to a power of two (16 at least, for tl.dot), products over K in 16-row slices (the
# whole K at once spills registers); 64 tokens take twice the warps.
CHUNKED_BLOCK_V, CHUNKED_BLOCK_R, CHUNKED_WARPS, CHUNKED_MAX_TOKENS = 32, 16, 4, 64


def launch_tiles(op: str, dk: int, dv: int, tokens: int = 1) -> tuple[dict, int]:
    """The tile constexprs and warps each kernel is launched with for head sizes ``dk``, ``dv`` and ``tokens``
    tokens per call (the wrappers below use it; so does the test that compiles them for Hopper)."""
    if op == "suffix_map_update":
        return {"BLOCK_K": pow2(dk), "BLOCK_J": min(SUFFIX_BLOCK_J, pow2(dk))}, SUFFIX_WARPS
    if op == "join":  # tl.dot needs 16 or more along each axis
        return {"BLOCK_I": min(JOIN_BLOCK, pow2(dk, 16)), "BLOCK_J": min(JOIN_BLOCK, pow2(dv, 16)),
                "BLOCK_R": min(JOIN_BLOCK_R, pow2(dk, 16))}, JOIN_WARPS
    if op == "recurrent_step":
        block_v, warps = (STEP_BLOCK_V, STEP_WARPS) if tokens == 1 else (STEP_CHUNK_BLOCK_V, STEP_CHUNK_WARPS)
        return {"BLOCK_K": pow2(dk), "BLOCK_V": min(block_v, pow2(dv))}, warps
    if op == "chunked_step":
        block_t = pow2(tokens, 16)  # tl.dot needs 16 or more along each axis
        return {"BLOCK_T": block_t, "BLOCK_R": CHUNKED_BLOCK_R,
                "BLOCK_V": min(CHUNKED_BLOCK_V, pow2(dv, 16))}, CHUNKED_WARPS if block_t <= 32 else 2 * CHUNKED_WARPS
    if op == "conv_update":
        return {"BLOCK_C": CONV_BLOCK_C}, CONV_WARPS
    raise ValueError(f"no GDN kernel {op!r}")


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import _triton

    return _triton


def _use_kernel(reference: bool | None, buffers: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
                name: str, fp32: bool = True) -> bool:
    """Whether to launch the kernel: see the module docstring. ``buffers`` are written in place (must be
    contiguous, and fp32 when ``fp32``, for the kernel), ``inputs`` only read (through their strides)."""
    if reference not in (None, True, False):
        raise ValueError(f"{name}: reference must be None (auto), True or False, got {reference!r}.")
    if reference:
        return False
    fits = all((b.dtype == torch.float32 or not fp32) and b.is_contiguous() for b in buffers)
    device = buffers[0].device
    same_device = all(t.device == device for t in buffers + inputs)
    if reference is None:
        return device.type == "cuda" and same_device and fits and triton_available()
    if not same_device:
        raise ValueError(f"{name}: all tensors must be on one device, got "
                         f"{sorted({str(t.device) for t in buffers + inputs})}.")
    if not fits:
        raise ValueError(f"{name}: the kernel updates contiguous{' float32' if fp32 else ''} buffers in place; got "
                         f"{[(str(b.dtype), b.is_contiguous()) for b in buffers]} (dtype, contiguous). "
                         "Pass reference=None or True for other dtypes and layouts.")
    if not triton_available():
        raise ValueError(f"{name}: reference=False needs Triton, which cannot be imported here.")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name}: reference=False on {device.type} tensors needs Triton's interpreter "
                         "(TRITON_INTERPRET=1 in the environment before the first launch); use CUDA tensors or "
                         "reference=None.")
    return True


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {list(expected)}, got {list(x.shape)}.")


def _like(name: str, out: torch.Tensor, of: str, x: torch.Tensor, what: str) -> None:
    """An output buffer ``out`` must have ``x``'s shape and dtype."""
    _shape(name, out, tuple(x.shape), what)
    if out.dtype != x.dtype:
        raise ValueError(f"{name} must have {of}'s dtype {x.dtype}, got {out.dtype}.")


def _suffix_map_dims(M: torch.Tensor) -> tuple[int, int, int]:
    """``(B, HV, K)`` of a suffix map ``M`` ``[B, HV, K, K]``, checked."""
    if M.dim() != 4 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"M must be [B, HV, K, K], got {list(M.shape)}.")
    bsz, heads, dk, _ = M.shape
    return bsz, heads, dk


def _heads(name: str, k: torch.Tensor, heads_v: int) -> int:
    """Key heads of ``k`` ``[B, T, HK, K]`` checked against ``HV`` value heads; returns ``r = HV // HK``."""
    heads_k = int(k.shape[2])
    if heads_k == 0 or heads_v % heads_k:
        raise ValueError(f"{name} has {heads_k} key heads, which must divide the {heads_v} value heads "
                         "(key head h serves value heads h*r .. h*r + r - 1).")
    return heads_v // heads_k


def _check_count(name: str, n: torch.Tensor | None, device: torch.device, batch: int) -> bool:
    """A count (``valid`` / ``rows_in``) on the buffers' device: one integer element (a device scalar, for every
    batch row) or ``[B]`` integers (one per batch row). Returns whether it is per row."""
    if n is None:
        return False
    per_row = n.dim() == 1 and n.shape[0] == batch and batch != 1
    if (n.numel() != 1 and not per_row) or n.dtype.is_floating_point or n.dtype == torch.bool or n.device != device:
        raise ValueError(f"{name} must be a one-element integer tensor (a device scalar) or [B] = [{batch}] integers "
                         f"(one per batch row) on {device}, got {n.dtype} {list(n.shape)} on {n.device}.")
    return per_row


def _count_mask(n: torch.Tensor, seq: int) -> torch.Tensor:
    """``[1 or B, T, 1]``: token ``t`` of batch row ``b`` is real (``t < n[b]``, or ``t < n[0]`` for a scalar)."""
    return (torch.arange(seq, device=n.device)[None] < n.reshape(-1, 1))[..., None]


def gate_off(g: torch.Tensor, beta: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g, beta [B, T, HV]`` with the tokens outside ``real`` (a bool mask broadcasting to them) set to
    ``g = 0, beta = 0``: padding, which leaves a state unchanged."""
    return torch.where(real, g, 0.0), torch.where(real, beta, torch.zeros_like(beta))


def _inner(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last axis (the kernels take the other strides): a view of a projection's split
    needs no copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _repeat_heads(x: torch.Tensor, r: int) -> torch.Tensor:
    return x.repeat_interleave(r, dim=2) if r > 1 else x


# ---- the suffix map ----------------------------------------------------------------------------------------

def suffix_map_update_(M: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                       l2norm: bool = False, reference: bool | None = None) -> torch.Tensor:
    """``M <- A_T ... A_1 M`` in place for ``T`` tokens (oldest first), ``A_t = exp(g_t) (I - beta_t k_t k_t^T)``.

    Args:
        M: ``[B, HV, K, K]`` the suffix map (fp32 for the kernel).
        k: ``[B, T, HK, K]`` normalised keys (raw ones with ``l2norm``), any float dtype; ``HK`` divides ``HV``.
        g: ``[B, T, HV]`` log decay; beta: ``[B, T, HV]``. A token with ``beta = 0`` and ``g = 0`` leaves
            ``M`` unchanged (padding).
        l2norm: normalise ``k`` first, in fp32 (`algebra.l2norm` of ``k.float()``).
        reference: None (auto), True (`algebra.update_suffix_map`), False (the kernel).

    Returns:
        ``M``, updated.
    """
    bsz, heads, dk = _suffix_map_dims(M)
    if k.dim() != 4 or k.shape[0] != bsz or k.shape[-1] != dk or k.shape[1] < 1:
        raise ValueError(f"k must be [B, T, HK, K] = [{bsz}, T >= 1, HK, {dk}], got {list(k.shape)}.")
    seq = int(k.shape[1])
    r = _heads("k", k, heads)
    _shape("g", g, (bsz, seq, heads), "[B, T, HV]")
    _shape("beta", beta, (bsz, seq, heads), "[B, T, HV]")
    if not _use_kernel(reference, (M,), (k, g, beta), "suffix_map_update_"):
        k = l2norm_keys(k.float()) if l2norm else k
        return M.copy_(update_suffix_map(M, _repeat_heads(k, r), g, beta))
    k, g, beta = _inner(k), _inner(g), _inner(beta)
    tiles, warps = launch_tiles("suffix_map_update", dk, dk)
    grid = (bsz * heads, cdiv(dk, tiles["BLOCK_J"]))
    _kernels().suffix_map_update[grid](M, k, g, beta, seq, heads, heads // r, dk, *k.stride()[:3], *g.stride()[:2],
                                       *beta.stride()[:2], L2NORM=bool(l2norm), **tiles, num_warps=warps)
    return M


# ---- the join -----------------------------------------------------------------------------------------------

def join_(S_live: torch.Tensor, M: torch.Tensor, S_new: torch.Tensor, S_old: torch.Tensor, *,
          reference: bool | None = None) -> torch.Tensor:
    """``S_live += M @ (S_new - S_old)`` in place (the difference first, as `algebra.join_state`).

    Args:
        S_live: ``[B, HV, K, V]`` the live state, corrected in place (fp32 for the kernel).
        M: ``[B, HV, K, K]`` the suffix map.
        S_new, S_old: ``[B, HV, K, V]`` the boundary-side state after / before the insertion (note the order:
            ``join_state`` takes them as ``S_b_old, S_b_new``).
        reference: None (auto), True (`algebra.join_state`), False (the kernel).

    Returns:
        ``S_live``, updated.
    """
    bsz, heads, dk = _suffix_map_dims(M)
    if S_live.dim() != 4:
        raise ValueError(f"S_live must be [B, HV, K, V], got {list(S_live.shape)}.")
    dv = int(S_live.shape[-1])
    for name, s in (("S_live", S_live), ("S_new", S_new), ("S_old", S_old)):
        if tuple(s.shape) != (bsz, heads, dk, dv):
            transposed = tuple(s.shape) == (bsz, heads, dv, dk)
            raise ValueError(f"{name} must have shape [B, HV, K, V] = {[bsz, heads, dk, dv]}, got {list(s.shape)}"
                             + (" (transposed: [B, HV, V, K]; states here are keys first)." if transposed else "."))
    if not _use_kernel(reference, (S_live, M), (S_new, S_old), "join_"):
        return S_live.copy_(join_state(S_live, M, S_old, S_new))
    S_new, S_old = S_new.contiguous(), S_old.contiguous()
    tiles, warps = launch_tiles("join", dk, dv)
    grid = (bsz * heads, cdiv(dk, tiles["BLOCK_I"]), cdiv(dv, tiles["BLOCK_J"]))
    _kernels().join[grid](S_live, M, S_new, S_old, dk, dv, **tiles, num_warps=warps)
    return S_live


# ---- the recurrent step -------------------------------------------------------------------------------------

def recurrent_step_reference(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, scale: float | None = None, l2norm: bool = True) -> torch.Tensor:
    """`recurrent_step_` in PyTorch, transformers' ``torch_recurrent_gated_delta_rule`` op for op (so the CPU
    path computes what the eager engine computes); ``S`` updated in place, ``o`` returned in fp32
    (`recurrent_step_` casts it to ``v``'s dtype). Agrees with `algebra.naive_recurrent_gated_delta`
    (tests check both)."""
    dk = q.shape[-1]
    r = v.shape[2] // q.shape[2]
    q, k = _repeat_heads(q, r), _repeat_heads(k, r)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    q = q / dk**0.5 if scale is None else q * scale
    state = S.to(torch.float32)
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    S.copy_(state)
    return out.transpose(1, 2).contiguous()


def recurrent_step_(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, scale: float | None = None, l2norm: bool = True, *,
                    reference: bool | None = None, out: torch.Tensor | None = None,
                    valid: torch.Tensor | None = None, state_out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule for ``T`` (small) tokens, in place on ``S`` (or from ``S`` into ``state_out``).

    Args:
        S: ``[B, HV, K, V]`` the recurrent state (fp32 for the kernel).
        q, k: ``[B, T, HK, K]`` raw queries and keys (L2-normalised inside when ``l2norm``, eps 1e-6), any
            float dtype; ``HK`` divides ``HV``.
        v: ``[B, T, HV, V]``; g: ``[B, T, HV]`` log decay; beta: ``[B, T, HV]``.
        scale: query scale after normalisation, default ``K ** -0.5``.
        reference: None (auto), True (`recurrent_step_reference`), False (the kernel).
        out: optional ``[B, T, HV, V]`` buffer in ``v``'s dtype for the output (kernel path: written in place,
            nothing allocated).
        valid: optional device scalar ``[1]`` (integer): tokens ``t >= valid`` are padding and run with
            ``g = 0, beta = 0`` (the state passes them unchanged; their outputs read it), so one captured
            call serves every count of real tokens; or ``[B]`` integers, one count per batch row (a row with
            ``valid[b] = 0`` keeps its state exactly: the batched captured step's sequences without a chunk).
        state_out: optional ``[B, HV, K, V]`` buffer that receives the final state, ``S`` then only read.

    Returns:
        ``o`` ``[B, T, HV, V]`` in ``v``'s dtype: ``o_t = scale q_t^T S_t``, the state after token t's update.
    """
    _check_step(S, q, k, v, g, beta, out, valid, state_out)
    return _launch_step(S, q, k, v, g, beta, scale, l2norm, reference, out, valid, state_out, chunked=False)


def _check_step(S, q, k, v, g, beta, out, valid, state_out) -> None:
    """The shape / dtype / device checks of `recurrent_step_` and `chunked_step_`."""
    if S.dim() != 4:
        raise ValueError(f"S must be [B, HV, K, V], got {list(S.shape)}.")
    bsz, heads, dk, dv = S.shape
    if q.dim() != 4 or q.shape[0] != bsz or q.shape[1] < 1 or q.shape[-1] != dk:
        raise ValueError(f"q must be [B, T, HK, K] = [{bsz}, T >= 1, HK, {dk}], got {list(q.shape)}"
                         + (" (is S transposed? states here are [B, HV, K, V])." if q.dim() == 4 and
                            q.shape[-1] == dv else "."))
    seq = int(q.shape[1])
    _heads("q", q, heads)
    _shape("k", k, tuple(q.shape), "[B, T, HK, K]")
    _shape("v", v, (bsz, seq, heads, dv), "[B, T, HV, V]")
    _shape("g", g, (bsz, seq, heads), "[B, T, HV]")
    _shape("beta", beta, (bsz, seq, heads), "[B, T, HV]")
    if out is not None:
        _like("out", out, "v", v, "[B, T, HV, V]")
    if state_out is not None:
        _shape("state_out", state_out, tuple(S.shape), "[B, HV, K, V]")
    _check_count("valid", valid, S.device, bsz)


def chunked_step_(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float | None = None, *, reference: bool | None = None,
                  out: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                  state_out: torch.Tensor | None = None) -> torch.Tensor:
    """`recurrent_step_` (``l2norm=True``) for a chunk of ``T <= CHUNKED_MAX_TOKENS`` tokens at once.

    Same arguments, results and reference (`recurrent_step_reference`, token by token); the kernel computes
    the chunk in the chunked form of the rule (a ``T x T`` unit triangular system for the tokens' deltas, solved
    by forward substitution; matrix products in fp32), one program per head and value slab, where
    `recurrent_step_`'s kernel runs a serial chain of ``T`` token updates. The results agree up to fp32
    rounding (the order of the sums differs). The fast path does not use it yet: in its place a fused
    Qwen3.5-9B step measured no faster (`python -m raincheck_hf.bench gdn --ops chunked_step` times it alone).
    """
    _check_step(S, q, k, v, g, beta, out, valid, state_out)
    if q.shape[1] > CHUNKED_MAX_TOKENS:
        raise ValueError(f"chunked_step_ takes at most {CHUNKED_MAX_TOKENS} tokens, got {q.shape[1]}.")
    return _launch_step(S, q, k, v, g, beta, scale, True, reference, out, valid, state_out, chunked=True)


def _launch_step(S, q, k, v, g, beta, scale, l2norm, reference, out, valid, state_out, chunked: bool):
    name = "chunked_step_" if chunked else "recurrent_step_"
    bsz, heads, dk, dv = S.shape
    seq = int(q.shape[1])
    r = heads // int(q.shape[2])
    target = S if state_out is None else state_out
    if not _use_kernel(reference, (target, S), (q, k, v, g, beta), name):
        if valid is not None:
            g, beta = gate_off(g, beta, _count_mask(valid, seq))
        if state_out is not None:
            target.copy_(S)
        o = recurrent_step_reference(target, q, k, v, g, beta, scale, l2norm).to(v.dtype)
        return o if out is None else out.copy_(o)
    if out is not None and not out.is_contiguous():
        raise ValueError("out must be contiguous.")
    q, k, v, g, beta = (_inner(x) for x in (q, k, v, g, beta))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    op = "chunked_step" if chunked else "recurrent_step"
    tiles, warps = launch_tiles(op, dk, dv, seq)
    grid = (bsz * heads, cdiv(dv, tiles["BLOCK_V"]))
    flags = {} if chunked else {"L2NORM": bool(l2norm)}
    getattr(_kernels(), op)[grid](S, target, S if valid is None else valid, q, k, v, g, beta, o, seq, heads,
                                  heads // r, dk, dv, float(dk**-0.5 if scale is None else scale),
                                  *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:2],
                                  *beta.stride()[:2], HAS_VALID=valid is not None,
                                  VALID_PER_ROW=valid is not None and valid.numel() != 1, **flags, **tiles,
                                  num_warps=warps)
    return o


# ---- the short convolution ----------------------------------------------------------------------------------

def conv_update_(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = "silu", *, reference: bool | None = None,
                 out: torch.Tensor | None = None, rows_in: torch.Tensor | None = None,
                 history_out: torch.Tensor | None = None, only_within_window: bool = False) -> torch.Tensor:
    """Depthwise causal conv of ``x`` continuing after ``history``; ``history`` rolled in place (or the rolled
    history written to ``history_out``).

    Args:
        history: ``[B, Kc - 1, C]`` the last pre-conv inputs before ``x`` (sequence-first, as `algebra`);
            afterwards the last ``Kc - 1`` rows of ``cat(history, x)``.
        x: ``[B, T, C]`` pre-conv inputs, ``T >= 1``.
        weight: ``[C, Kc]`` or ``[C, 1, Kc]``; bias: ``[C]`` or None.
        activation: ``"silu"`` or None.
        reference: None (auto; the kernel needs a contiguous history of any float dtype), True
            (`algebra.causal_conv_with_history` + `algebra.roll_conv_history`), False (the kernel).
        out: optional ``[B, T, C]`` buffer in ``x``'s dtype for the output.
        rows_in: optional device scalar ``[1]`` (integer) ``n``: only the first ``min(n, T)`` rows of ``x``
            enter the history (the real rows of a padded chunk; every output is computed as usual, and a
            real row's never reads the padding after it); or ``[B]`` integers, one count per batch row (``0``:
            that row's history is written back unchanged).
        history_out: optional ``[B, Kc - 1, C]`` buffer (``history``'s dtype) for the rolled history;
            ``history`` is then only read.
        only_within_window: with ``rows_in``, write the rolled history only while ``n < Kc - 1`` (the live
            window of a suffix shorter than the window; a longer one keeps its own), per batch row for a ``[B]``
            count.

    Returns:
        ``y`` ``[B, T, C]`` in ``x``'s dtype, as `algebra.causal_conv_with_history`.
    """
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2:
        raise ValueError(f"weight must be [C, Kc] or [C, 1, Kc], got {list(weight.shape)}.")
    channels, kernel = weight.shape
    if x.dim() != 3 or x.shape[-1] != channels or x.shape[1] < 1:
        raise ValueError(f"x must be [B, T, C] = [B, T >= 1, {channels}], got {list(x.shape)}.")
    bsz, seq, _ = x.shape
    _shape("history", history, (bsz, kernel - 1, channels), "[B, Kc - 1, C]")
    if bias is not None:
        _shape("bias", bias, (channels,), "[C]")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be 'silu' (Qwen3.5's hidden_act) or None, got {activation!r}.")
    if out is not None:
        _like("out", out, "x", x, "[B, T, C]")
    if history_out is not None:
        _like("history_out", history_out, "history", history, "[B, Kc - 1, C]")
    per_row = _check_count("rows_in", rows_in, history.device, bsz)
    if only_within_window and rows_in is None:
        raise ValueError("only_within_window needs rows_in (the count it compares with the window).")
    target = history if history_out is None else history_out
    # the history keeps its own dtype (the kernel rolls it as it is): only its layout matters
    if not _use_kernel(reference, (target, history), (x, weight) + (() if bias is None else (bias,)),
                       "conv_update_", fp32=False):
        y = causal_conv_with_history(x, history, weight, bias, activation)
        if rows_in is None:
            target.copy_(roll_conv_history(history, x))
        else:  # rows n .. n + Kc - 2 of cat(history, x), n = min(rows_in, T) (per batch row for a [B] count)
            width = history.shape[1]
            joined = torch.cat([history, x.to(history.dtype)], dim=1)
            n = torch.clamp(rows_in, max=seq).reshape(-1, 1)
            index = (n + torch.arange(width, device=rows_in.device)).expand(bsz, width)
            rolled = joined.gather(1, index[..., None].expand(-1, -1, channels))
            if only_within_window:
                rolled = torch.where((rows_in < width).reshape(-1, 1, 1), rolled, target)
            target.copy_(rolled)
        return y if out is None else out.copy_(y)
    if out is not None and not out.is_contiguous():
        raise ValueError("out must be contiguous.")
    x, weight = _inner(x), weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    tiles, warps = launch_tiles("conv_update", 0, 0)
    grid = (bsz, cdiv(channels, tiles["BLOCK_C"]))
    _kernels().conv_update[grid](history, x, weight, weight if bias is None else bias.contiguous(), y, target,
                                 history if rows_in is None else rows_in, seq, channels, *x.stride()[:2], KC=kernel,
                                 HAS_BIAS=bias is not None, SILU=activation is not None, ROWS_IN=rows_in is not None,
                                 ONLY_WITHIN=bool(only_within_window), ROWS_PER_ROW=per_row, **tiles, num_warps=warps)
    return y
