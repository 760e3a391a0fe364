"""Triton kernel of the vision tower's rotary embedding (see `raincheck_hf.fast.vision_attention`, which imports this
module on first launch, so that importing the package needs no Triton).

One program owns ``BLOCK_S`` rows of one head. It reads that head's query and key halves from the ``qkv`` projection's
output, rotates them in float32 as transformers' ``apply_rotary_pos_emb_vision`` does (``x * cos + rotate_half(x) *
sin``, each product and the sum rounded on their own: the launch turns floating-point contraction off, so no fused
multiply-add rounds them otherwise) and writes them, cast back to the input's dtype (rounded to nearest, ties to even,
as torch casts), into ``OUT [2, S, H, D]``.
"""

import triton
import triton.language as tl


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """``x`` (float32) as ``dtype``, rounded to the nearest (ties to even) as torch rounds. To bfloat16 the rounding
    is done on the bits first, so that the cast itself is exact: Triton's interpreter truncates that cast."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000  # (finite inputs: no NaN to keep)
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def vision_rotary(QKV, COS, SIN, OUT, S, s_qkv, s_cos, s_sin, s_out,
                  H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    # Grid (cdiv(S, BLOCK_S), H). QKV [S, 3 * H * D] (its rows ``s_qkv`` apart, the last axis contiguous): query,
    # key and value, each head's D values in turn. COS / SIN [S, D] (rows ``s_cos`` / ``s_sin`` apart, the last axis
    # contiguous). OUT [2, S, H, D] contiguous (``s_out`` = S * H * D apart: passed, not computed here, since Triton
    # makes an integer argument of 1 a constant, which has no ``.to``), the dtype of QKV.
    h = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < S)[:, None] & (cols < HALF)[None, :]
    at_cos = COS + rows[:, None] * s_cos + cols[None, :]
    at_sin = SIN + rows[:, None] * s_sin + cols[None, :]
    cos_lo = tl.load(at_cos, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(at_cos + HALF, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(at_sin, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(at_sin + HALF, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(2):  # the query, then the key
        at = QKV + rows[:, None] * s_qkv + (part * H + h) * D + cols[None, :]
        lo = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
        # rotate_half(x) = cat(-x[HALF:], x[:HALF])
        out_lo = lo * cos_lo + (-hi) * sin_lo
        out_hi = hi * cos_hi + lo * sin_hi
        to = OUT + part * s_out + rows[:, None] * (H * D) + h * D + cols[None, :]
        tl.store(to, _cast(out_lo, OUT.dtype.element_ty), mask=mask)
        tl.store(to + HALF, _cast(out_hi, OUT.dtype.element_ty), mask=mask)
