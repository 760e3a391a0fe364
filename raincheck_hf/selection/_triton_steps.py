"""Triton step kernels of the greedy selectors (see `raincheck_hf.selection.kernels`, which imports this
module on first use, so that importing the package needs no Triton)."""

import triton
import triton.language as tl


@triton.jit
def _pack(score, cols):
    # float32 -> int32 whose order is the float order (negatives: flip the magnitude bits), then
    # (key << 32) + (0xFFFFFFFF - col): the int64 maximum is the best score, lowest column on ties
    score = score + 0.0  # -0.0 -> +0.0, so that they tie as torch.argmax sees them
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) * 4294967296 + (4294967295 - cols.to(tl.int64))


@triton.jit
def _winner(slots, s, b, B):
    # the previous step's pick, -1 at step 0
    prev = tl.load(slots + tl.maximum(s - 1, 0) * B + b)
    j = (4294967295 - (prev & 4294967295)).to(tl.int32)
    return tl.where(s > 0, j, -1)


@triton.jit
def _taken_after(taken, b, n, cols, cmask, j):
    # the block's taken flags with the previous pick added (written back by the thread that read it)
    t = tl.load(taken + b * n + cols, mask=cmask, other=1)
    t = tl.where(cols == j, 1, t).to(tl.int8)
    tl.store(taken + b * n + cols, t, mask=cmask)
    return t


@triton.jit
def _vote(slots, s, b, B, score, cols, valid, neg):
    packed = tl.where(valid, _pack(score, cols), neg)
    tl.atomic_max(slots + s * B + b, tl.max(packed, axis=0))


@triton.jit(do_not_specialize=["s"])
def mmtok_gain(P, W, cov, part, slots, s, B, R, n, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # one [BLOCK_R, BLOCK_N] tile per program: the partial gains of a block of candidates over a block of rows.
    # P [B, R, n]: coverage rows (vision rows then text rows, zero padding); W [R] float64: each row's weight;
    # cov [2, B, R]: coverage maxima, read from buffer s % 2, the previous pick applied, written to the other
    # buffer (by the programs of the first column block: each row block has one writer); part [RB, B, n]
    # float64: the partial sums
    b = tl.program_id(0)
    cb = tl.program_id(1)
    rb = tl.program_id(2)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    j = _winner(slots, s, b, B)
    p_base = P + b.to(tl.int64) * R * n
    c = tl.load(cov + (s % 2) * B * R + b * R + rows, mask=rmask, other=0.0)
    c = tl.maximum(c, tl.load(p_base + rows * n + j, mask=rmask & (j >= 0), other=0.0))
    tl.store(cov + ((s + 1) % 2) * B * R + b * R + rows, c, mask=rmask & (cb == 0))
    p = tl.load(p_base + rows[:, None] * n + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    w = tl.load(W + rows, mask=rmask, other=0.0)
    gain = tl.sum(w[:, None] * tl.maximum(p - c[:, None], 0.0).to(tl.float64), axis=0)
    tl.store(part + (rb * B + b).to(tl.int64) * n + cols, gain, mask=cmask)


@triton.jit(do_not_specialize=["s"])
def mmtok_vote(part, taken, slots, s, B, n, RB, neg, BLOCK_RB: tl.constexpr, BLOCK_N: tl.constexpr):
    # the gains of a block of candidates, summed over the row blocks in a fixed order (deterministic),
    # rounded to float32 as the reference rounds them, then voted
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    j = _winner(slots, s, b, B)
    rbs = tl.arange(0, BLOCK_RB)  # every row block's partials in one load (a loop would wait on each in turn)
    acc = tl.sum(tl.load(part + (rbs[:, None] * B + b).to(tl.int64) * n + cols[None, :],
                         mask=(rbs[:, None] < RB) & cmask[None, :], other=0.0), axis=0)
    t = _taken_after(taken, b, n, cols, cmask, j)
    _vote(slots, s, b, B, acc.to(tl.float32), cols, cmask & (t == 0), neg)


@triton.jit(do_not_specialize=["k", "programs"])
def mmtok_run(P, PT, W, slots, arrived, B, R, n, k, programs, neg,
              R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    # every pick of mmtok's greedy in one launch: ``programs`` programs per segment, each holding its block of
    # candidate columns' coverage values (all R rows) in registers, the coverage maxima kept by each program. A pick:
    # the block's gains (as mmtok_gain + mmtok_vote sum them: float64, rounded to float32 once), a vote into
    # slots[s, b], then a barrier among the segment's programs (arrived[b] counts the votes cast) and the winner's
    # column of P applied to the maxima: with TRANSPOSED, one contiguous row of PT [B, n, R] (P's transposed copy),
    # else P's strided column (a memory sector per row). The launcher keeps the grid within what the device holds at
    # once, one launch at a time.
    pid = tl.program_id(0)
    b = pid // programs
    cols = (pid % programs) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    rows = tl.arange(0, R_PAD)
    rmask = rows < R
    p_base = P + b.to(tl.int64) * R * n
    pt_base = PT + b.to(tl.int64) * n * R
    p = tl.load(p_base + rows[:, None] * n + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    w = tl.load(W + rows, mask=rmask, other=0.0)
    cov = tl.zeros([R_PAD], dtype=tl.float32)
    out = cmask == 0  # columns past n, then the ones taken
    for s in range(k):
        gain = tl.sum(w[:, None] * tl.maximum(p - cov[:, None], 0.0).to(tl.float64), axis=0)
        packed = tl.where(out, neg, _pack(gain.to(tl.float32), cols))
        tl.atomic_max(slots + s * B + b, tl.max(packed, axis=0), sem="relaxed")
        tl.debug_barrier()
        seen = tl.atomic_add(arrived + b, 1, sem="acq_rel") + 1
        while seen < (s + 1) * programs:
            seen = tl.atomic_add(arrived + b, 0, sem="acquire")
        won = tl.atomic_max(slots + s * B + b, neg, sem="acquire")  # (a read of the vote's final value)
        j = (4294967295 - (won & 4294967295)).to(tl.int32)
        out = out | (cols == j)
        if TRANSPOSED:
            cov = tl.maximum(cov, tl.load(pt_base + j * R + rows, mask=rmask, other=0.0))
        else:
            cov = tl.maximum(cov, tl.load(p_base + rows * n + j, mask=rmask, other=0.0))


@triton.jit(do_not_specialize=["s"])
def divprune_step(D, first, mind, taken, slots, s, B, n, neg, BLOCK_N: tl.constexpr):
    # D [B, n, n] cosine distances; first [B, n]: step 0's scores (distance to the nearest other token);
    # mind [B, n]: minimum distance to the kept set (starts at +inf)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    j = _winner(slots, s, b, B)
    d = tl.load(D + b.to(tl.int64) * n * n + cols * n + j, mask=cmask & (j >= 0), other=float("inf"))
    m = tl.minimum(tl.load(mind + b * n + cols, mask=cmask, other=float("inf")), d)
    tl.store(mind + b * n + cols, m, mask=cmask)
    score = tl.where(s == 0, tl.load(first + b * n + cols, mask=cmask, other=0.0), m)
    t = _taken_after(taken, b, n, cols, cmask, j)
    _vote(slots, s, b, B, score, cols, cmask & (t == 0), neg)


@triton.jit(do_not_specialize=["s"])
def cdpruner_step(L, C, d2, fallback, tol, taken, slots, s, B, n, k, neg,
                  BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # L [B, n, n] the DPP kernel; C [B, k, n] Cholesky rows (row t: e of step t); d2 [2, B, n] residual
    # gains, read from buffer s % 2 and written to the other; fallback [B, n]; tol [B]
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n
    j = _winner(slots, s, b, B)
    has_j = j >= 0
    c_base = C + b.to(tl.int64) * k * n
    d2_in = d2 + (s % 2) * B * n + b * n
    d2_out = d2 + ((s + 1) % 2) * B * n + b * n
    tol_b = tl.load(tol + b)
    d2_j = tl.load(d2_in + tl.maximum(j, 0))
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t0 in range(0, s - 1, BLOCK_T):  # <c_j, c_i> over the rows of the steps before j's
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < s - 1
        cj = tl.load(c_base + ts * n + j, mask=tmask, other=0.0)
        ct = tl.load(c_base + ts[:, None] * n + cols[None, :], mask=tmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(cj[:, None] * ct, axis=0)
    l_row = tl.load(L + b.to(tl.int64) * n * n + tl.maximum(j, 0) * n + cols, mask=cmask & has_j, other=0.0)
    e = (l_row - acc) / tl.sqrt(tl.maximum(d2_j, 1e-30))
    e = tl.where(has_j & (d2_j > tol_b), e, 0.0)  # a dead pick (rank exhausted) leaves the gains as they are
    tl.store(c_base + (s - 1) * n + cols, e, mask=cmask & has_j)
    g = tl.maximum(tl.load(d2_in + cols, mask=cmask, other=0.0) - e * e, 0.0)
    tl.store(d2_out + cols, g, mask=cmask)
    score = tl.where(g > tol_b, g, tl.load(fallback + b * n + cols, mask=cmask, other=0.0))
    t = _taken_after(taken, b, n, cols, cmask, j)
    _vote(slots, s, b, B, score, cols, cmask & (t == 0), neg)

KERNELS = {"mmtok": (mmtok_gain, mmtok_vote), "mmtok_run": mmtok_run, "divprune": divprune_step,
           "cdpruner": cdpruner_step}
