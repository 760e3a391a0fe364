"""Triton kernels of the few-query attention (see `raincheck_hf.fast.attention`, which imports this module on
first launch, so that importing the package needs no Triton).

`few_query_split`: one program owns one key/value head of one sequence, a block of its query rows (the query
heads of the head's group stacked as rows, position-major: row ``m = l * GROUP + g`` is query head
``hk * GROUP + g`` at query position ``l``) and one split of the key slots. It walks its split in ``BLOCK_N``
tiles with an online softmax in float32 (scores of half-precision inputs accumulated in float32; probabilities
cast to the value dtype for the second product, as flash attention does) and writes its unnormalised output with
its running maximum and sum. A score the boolean visibility hides is ``-inf``; the running maximum starts at a
large finite negative, so a tile (or a split) in which a row sees nothing adds exactly nothing.

`few_query_combine` merges the splits of each row and writes the output ``[B, L, Hq, D]`` in its dtype.

Ragged steps (``RAGGED``): ``REAL [B]`` holds each sequence's real query positions (a prefix of its ``L`` rows; the
rest are padding of a batched step, `fast.batched_graphs`). Position-major rows make a sequence's real rows the
first ``REAL[b] * GROUP`` of its key/value head, so a program whose row block lies past them walks no tile and
stores nothing, and the combine writes zeros for padded rows without reading anything. The grid stays the
padded one (a captured CUDA graph keeps it fixed); only the work inside depends on ``REAL``.
"""

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # the running maximum's start: finite, so exp(-inf - NEG) = 0 and exp(NEG - NEG) = 1


@triton.jit
def few_query_split(Q, K, V, MASK, REAL, O, M, L, S, HKV, GROUP, ROWS, SPLIT_LEN, scale,
                    sq_b, sq_h, sq_l, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_l, sm_s,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                    RAGGED: tl.constexpr):
    # Grid (B * HKV, cdiv(GROUP * ROWS, BLOCK_M), splits). O [splits, B * HKV, GROUP * ROWS, D] fp32,
    # M / L [splits, B * HKV, GROUP * ROWS] fp32, all contiguous. Inputs: last axis contiguous.
    bh = tl.program_id(0)
    split = tl.program_id(2)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    rows_total = GROUP * ROWS
    block_start = tl.program_id(1) * BLOCK_M
    m_idx = block_start + tl.arange(0, BLOCK_M)
    if RAGGED:
        real_rows = tl.minimum(tl.load(REAL + b).to(tl.int32) * GROUP, rows_total)
    else:
        real_rows = rows_total
    rmask = m_idx < real_rows
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
    end = tl.where(block_start < real_rows, end, start)  # a block of padded rows only: no tile at all
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


@triton.jit
def few_query_combine(O, M, L, REAL, OUT, SPLITS, BHKV, HKV, GROUP, ROWS,
                      D: tl.constexpr, BLOCK_R: tl.constexpr, RAGGED: tl.constexpr):
    # Grid (B * HKV, cdiv(GROUP * ROWS, BLOCK_R)). O / M / L as `few_query_split` writes them; OUT [B, ROWS,
    # HKV * GROUP, D] contiguous, in the output dtype. A row past its sequence's real rows gets zeros.
    bh = tl.program_id(0)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    rows_total = GROUP * ROWS
    m_idx = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = m_idx < rows_total
    if RAGGED:
        real_rows = tl.minimum(tl.load(REAL + b).to(tl.int32) * GROUP, rows_total)
    else:
        real_rows = rows_total
    rmask = m_idx < real_rows
    d = tl.arange(0, D)
    peak = tl.full((BLOCK_R,), NEG, tl.float32)
    for split in range(0, SPLITS):
        row = (split * BHKV + bh).to(tl.int64) * rows_total + m_idx
        peak = tl.maximum(peak, tl.load(M + row, mask=rmask, other=NEG))
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    total = tl.zeros((BLOCK_R,), tl.float32)
    for split in range(0, SPLITS):
        row = (split * BHKV + bh).to(tl.int64) * rows_total + m_idx
        weight = tl.exp(tl.load(M + row, mask=rmask, other=NEG) - peak)
        total += tl.load(L + row, mask=rmask, other=0.0) * weight
        acc += tl.load(O + row[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0) * weight[:, None]
    merged = tl.where(rmask[:, None], acc / tl.where(rmask, total, 1.0)[:, None], 0.0)
    g = m_idx % GROUP
    pos = m_idx // GROUP
    dest = ((b * ROWS + pos) * (HKV * GROUP) + hk * GROUP + g).to(tl.int64)
    tl.store(OUT + dest[:, None] * D + d[None, :], merged.to(OUT.dtype.element_ty), mask=inside[:, None])
