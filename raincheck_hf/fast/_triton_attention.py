"""Triton kernel of the few-query attention (see `raincheck_hf.fast.attention`, which imports this module on
first launch, so that importing the package needs no Triton).

One program owns one key/value head of one sequence, a block of its query rows (the query heads of the head's group
stacked as rows, position-major: row ``m = l * GROUP + g`` is query head ``hk * GROUP + g`` at query position ``l``) and
one split of the key slots. It walks its split in ``BLOCK_N`` tiles with an online softmax in float32 (scores of
half-precision inputs accumulated in float32; probabilities cast to the value dtype for the second product, as flash
attention does) and writes its unnormalised output with its running maximum and sum; `combine` merges the splits. A
score the boolean visibility hides is ``-inf``; the running maximum starts at a large finite negative, so a tile (or a
split) in which a row sees nothing adds exactly nothing. With ``HAS_EXTENT`` each sequence's walk stops at its own
extent (``EXTENT[b]``: no row of sequence ``b`` sees a slot at or past it), so a batch whose sequences hold fewer rows
than the step's span reads only their own keys; the tiles it skips are ones in which no row sees anything, so the result
is the same in exact arithmetic (bit for bit in Triton's interpreter; on a GPU the bounded specialization's code may
round the last bits of its sums otherwise). With ``HAS_ROWS`` a sequence's query positions at or past
``ROWS_REAL[b]`` are padding (a batched step pads every sequence to its widest): a program whose block holds only
such rows reads nothing and leaves them an empty sum (``L = 0``; the merge makes their output 0), so a one-token
sequence beside 32-row chunks costs one block of rows, not all of them.
"""

import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources  # noqa: F401  (a launch that asks for too much shared memory)

NEG = tl.constexpr(-1.0e30)  # the running maximum's start: finite, so exp(-inf - NEG) = 0 and exp(NEG - NEG) = 1


@triton.jit
def few_query_split(Q, K, V, MASK, EXTENT, ROWS_REAL, O, M, L, S, HKV, GROUP, ROWS, SPLIT_LEN, scale,
                    sq_b, sq_h, sq_l, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_l, sm_s,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                    HAS_EXTENT: tl.constexpr, HAS_ROWS: tl.constexpr):
    # Grid (B * HKV, cdiv(GROUP * ROWS, BLOCK_M), splits). O [splits, B * HKV, GROUP * ROWS, D] fp32,
    # M / L [splits, B * HKV, GROUP * ROWS] fp32, all contiguous. Inputs: last axis contiguous. EXTENT / ROWS_REAL
    # [B] int64 (read only with HAS_EXTENT / HAS_ROWS).
    bh = tl.program_id(0)
    split = tl.program_id(2)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    rows_total = GROUP * ROWS
    m_idx = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = m_idx < rows_total
    g = m_idx % GROUP
    pos = m_idx // GROUP
    head = hk * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + head[:, None].to(tl.int64) * sq_h + pos[:, None] * sq_l + d[None, :],
                mask=rmask[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    k_base = K + b * sk_b + hk.to(tl.int64) * sk_h
    v_base = V + b * sv_b + hk.to(tl.int64) * sv_h
    m_base = MASK + b * sm_b
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, S)
    if HAS_EXTENT:
        end = tl.minimum(end, tl.load(EXTENT + b).to(tl.int32))
    if HAS_ROWS:  # a block of padding rows only: nothing to read
        first = (tl.program_id(1) * BLOCK_M) // GROUP
        end = tl.where(first < tl.load(ROWS_REAL + b).to(tl.int32), end, start)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        k = tl.load(k_base + n[:, None].to(tl.int64) * sk_s + d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = tl.load(m_base + pos[:, None] * sm_l + n[None, :] * sm_s, mask=rmask[:, None] & nmask[None, :],
                          other=0)
        s = tl.where(visible != 0, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None].to(tl.int64) * sv_s + d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    row = (split * tl.num_programs(0) + bh).to(tl.int64) * rows_total + m_idx
    tl.store(O + row[:, None] * D + d[None, :], acc, mask=rmask[:, None])
    tl.store(M + row, m_i, mask=rmask)
    tl.store(L + row, l_i, mask=rmask)
