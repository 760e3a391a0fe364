"""Triton kernels of the hot Gated DeltaNet work (see `raincheck_hf.gdn.kernels`, which imports this
module on first launch, so that importing the package needs no Triton).

Buffers written in place are contiguous; inputs may be strided views (a split of a projection) whose last
axis is contiguous, their other strides passed in (``s<tensor>_<axis>``, in elements). A state / map is
``[B, HV, K, V]`` / ``[B, HV, K, K]`` fp32, row-major over its last two axes (keys first). Key head ``hk``
serves value heads ``hk * R .. hk * R + R - 1`` (``R = HV // HK``, transformers' ``repeat_interleave``).
Arithmetic is fp32 whatever the inputs' dtype.
"""

import triton
import triton.language as tl


@triton.jit
def suffix_map_update(M, k, g, beta, T, HV, HK, K, sk_b, sk_t, sk_h, sg_b, sg_t, sb_b, sb_t, L2NORM: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr):
    # M <- alpha_t (M - beta_t k_t (k_t^T M)) for t = 0 .. T - 1. Column j of the product depends on column
    # j of M only, so a program owns a [K, BLOCK_J] column slab of one head's map: one read, T updates in
    # registers, one write. Grid (B * HV, cdiv(K, BLOCK_J)). L2NORM: k is raw, normalised here (fp32).
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h // (HV // HK)
    rows = tl.arange(0, BLOCK_K)
    rmask = rows < K
    cols = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    mask = rmask[:, None] & (cols < K)[None, :]
    ptrs = M + bh.to(tl.int64) * K * K + rows[:, None] * K + cols[None, :]
    m = tl.load(ptrs, mask=mask, other=0.0)
    for t in range(T):
        kv = tl.load(k + b.to(tl.int64) * sk_b + t * sk_t + hk * sk_h + rows, mask=rmask, other=0.0).to(tl.float32)
        if L2NORM:
            kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
        alpha = tl.exp(tl.load(g + b.to(tl.int64) * sg_b + t * sg_t + h).to(tl.float32))
        bt = tl.load(beta + b.to(tl.int64) * sb_b + t * sb_t + h).to(tl.float32)
        kTm = tl.sum(kv[:, None] * m, axis=0)  # [BLOCK_J]: k^T M[:, j]
        m = alpha * (m - (bt * kv)[:, None] * kTm[None, :])
    tl.store(ptrs, m, mask=mask)


@triton.jit
def join(S, M, S_new, S_old, K, V, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr):
    # S[i, j] += sum_r M[i, r] (S_new[r, j] - S_old[r, j]) for one [BLOCK_I, BLOCK_J] tile of one head's state,
    # the difference taken first (as join_state), fp32 products (no TF32). Grid (B * HV, cdiv(K, BLOCK_I),
    # cdiv(V, BLOCK_J)); a program reads and writes only its own tile of S.
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    cols = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    rmask = rows < K
    cmask = cols < V
    m_base = M + bh * K * K
    s_off = bh * K * V
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for r0 in range(0, K, BLOCK_R):
        red = r0 + tl.arange(0, BLOCK_R)
        redmask = red < K
        m = tl.load(m_base + rows[:, None] * K + red[None, :], mask=rmask[:, None] & redmask[None, :], other=0.0)
        dmask = redmask[:, None] & cmask[None, :]
        d_off = s_off + red[:, None] * V + cols[None, :]
        d = tl.load(S_new + d_off, mask=dmask, other=0.0) - tl.load(S_old + d_off, mask=dmask, other=0.0)
        acc = tl.dot(m, d, acc, input_precision="ieee")
    ptrs = S + s_off + rows[:, None] * V + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + acc, mask=mask)


@triton.jit
def recurrent_step(S, S_out, n_valid, q, k, v, g, beta, o, T, HV, HK, K, V, scale, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
                   sv_b, sv_t, sv_h, sg_b, sg_t, sb_b, sb_t, L2NORM: tl.constexpr, HAS_VALID: tl.constexpr,
                   VALID_PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # The gated delta rule, token by token, in transformers' order: S <- exp(g) S; delta = beta (v - k^T S);
    # S <- S + k delta^T; o = (scale q)^T S. Value column j of S only ever meets column j of v and o, so a
    # program owns a [K, BLOCK_V] column slab of one head's state. Grid (B * HV, cdiv(V, BLOCK_V)).
    # S is read, S_out written (the same buffer for an update in place). HAS_VALID: tokens t >= n_valid[0] (a
    # device scalar; with VALID_PER_ROW n_valid[b], one count per batch row) are padding, run with g = 0 and
    # beta = 0 (the state passes them unchanged).
    # A token's inputs are loaded one token ahead, so their latency overlaps the previous token's chain.
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h // (HV // HK)
    b64 = b.to(tl.int64)
    rows = tl.arange(0, BLOCK_K)
    rmask = rows < K
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    mask = rmask[:, None] & cmask[None, :]
    offs = bh.to(tl.int64) * K * V + rows[:, None] * V + cols[None, :]
    s = tl.load(S + offs, mask=mask, other=0.0)
    valid = T
    if HAS_VALID:
        if VALID_PER_ROW:
            valid = tl.load(n_valid + b).to(tl.int32)
        else:
            valid = tl.load(n_valid).to(tl.int32)
    q_ptr = q + b64 * sq_b + hk * sq_h + rows
    k_ptr = k + b64 * sk_b + hk * sk_h + rows
    v_ptr = v + b64 * sv_b + h * sv_h + cols
    g_ptr = g + b64 * sg_b + h
    b_ptr = beta + b64 * sb_b + h
    qn = tl.load(q_ptr, mask=rmask, other=0.0)
    kn = tl.load(k_ptr, mask=rmask, other=0.0)
    vn = tl.load(v_ptr, mask=cmask, other=0.0)
    gn = tl.load(g_ptr)
    bn = tl.load(b_ptr)
    for t in range(T):
        qv, kv, vv = qn.to(tl.float32), kn.to(tl.float32), vn.to(tl.float32)
        gv, bt = gn.to(tl.float32), bn.to(tl.float32)
        nt = t + 1
        ahead = nt < T
        qn = tl.load(q_ptr + nt * sq_t, mask=rmask & ahead, other=0.0)
        kn = tl.load(k_ptr + nt * sk_t, mask=rmask & ahead, other=0.0)
        vn = tl.load(v_ptr + nt * sv_t, mask=cmask & ahead, other=0.0)
        gn = tl.load(g_ptr + nt * sg_t, mask=ahead, other=0.0)
        bn = tl.load(b_ptr + nt * sb_t, mask=ahead, other=0.0)
        real = t < valid
        gv = tl.where(real, gv, 0.0)
        bt = tl.where(real, bt, 0.0)
        if L2NORM:  # x * rsqrt(sum(x^2) + 1e-6), as transformers / fla
            qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + 1e-6)
            kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
        qv = qv * scale
        s = s * tl.exp(gv)
        delta = (vv - tl.sum(kv[:, None] * s, axis=0)) * bt
        s = s + kv[:, None] * delta[None, :]
        out = tl.sum(qv[:, None] * s, axis=0)
        tl.store(o + ((b * T + t) * HV + h).to(tl.int64) * V + cols, out.to(o.dtype.element_ty), mask=cmask)
    tl.store(S_out + offs, s, mask=mask)


@triton.jit
def conv_update(history, x, w, bias, y, history_out, n_rows, T, C, sx_b, sx_t, KC: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ROWS_IN: tl.constexpr, ONLY_WITHIN: tl.constexpr,
                ROWS_PER_ROW: tl.constexpr, BLOCK_C: tl.constexpr):
    # Depthwise causal conv of x [B, T, C] after history [B, KC - 1, C] (the window of output t is rows
    # t .. t + KC - 1 of cat(history, x)), then history_out <- the last KC - 1 rows of cat(history, x[:, :n]),
    # n = T, or with ROWS_IN n = min(n_rows[0], T) (a device scalar: the real rows of a padded chunk);
    # ONLY_WITHIN writes it only while n_rows[0] < KC - 1; with ROWS_PER_ROW the count is n_rows[b], one per batch
    # row. history_out may be history (an update in place).
    # Dtypes as transformers' torch path: inputs cast to x's then to the weight's dtype, fp32 accumulation, the
    # sum and the activation rounded to the weight's dtype, the output in x's. Grid (B, cdiv(C, BLOCK_C)).
    W: tl.constexpr = KC - 1
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    h_base = history + b * W * C
    o_base = history_out + b * W * C
    x_base = x + b * sx_b
    y_base = y + b * T * C
    if HAS_BIAS:
        bias_v = tl.load(bias + c, mask=cm, other=0.0).to(w.dtype.element_ty).to(tl.float32)
    for t in range(T):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for i in tl.static_range(KC):
            p = t + i  # row of cat(history, x)
            hv = tl.load(h_base + p * C + c, mask=cm & (p < W), other=0.0).to(x.dtype.element_ty)
            xv = tl.load(x_base + (p - W) * sx_t + c, mask=cm & (p >= W), other=0.0)
            val = tl.where(p < W, hv, xv).to(w.dtype.element_ty).to(tl.float32)
            acc += tl.load(w + c * KC + i, mask=cm, other=0.0).to(tl.float32) * val
        if HAS_BIAS:
            acc += bias_v
        acc = acc.to(w.dtype.element_ty).to(tl.float32)
        if SILU:
            acc = (acc * tl.sigmoid(acc)).to(w.dtype.element_ty).to(tl.float32)
        tl.store(y_base + t * C + c, acc.to(y.dtype.element_ty), mask=cm)
    tl.debug_barrier()  # every read of history above happens before the roll below writes it
    n = T
    write = cm
    if ROWS_IN:
        if ROWS_PER_ROW:
            given = tl.load(n_rows + b).to(tl.int32)
        else:
            given = tl.load(n_rows).to(tl.int32)
        n = tl.minimum(given, T)
        if ONLY_WITHIN:
            write = cm & (given < W)
    # Row i of the new history is row n + i of cat(history, x): in increasing i, a store to row i never
    # overwrites a history row that a later i still reads (those are rows n + i' > i).
    for i in tl.static_range(W):
        p = n + i
        hv = tl.load(h_base + p * C + c, mask=cm & (p < W), other=0.0)
        xv = tl.load(x_base + (p - W) * sx_t + c, mask=cm & (p >= W), other=0.0).to(history.dtype.element_ty)
        tl.store(o_base + i * C + c, tl.where(p < W, hv, xv).to(history_out.dtype.element_ty), mask=write)


@triton.jit
def chunked_step(S, S_out, n_valid, q, k, v, g, beta, o, T, HV, HK, K, V, scale, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
                 sv_b, sv_t, sv_h, sg_b, sg_t, sb_b, sb_t, HAS_VALID: tl.constexpr, VALID_PER_ROW: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # `recurrent_step` (with L2NORM) for T <= BLOCK_T tokens at once, in the chunked (WY) form: with
    # G_t = g_0 + .. + g_t, the tokens' deltas U (u_t = beta_t (v_t - k_t^T S'_t), S'_t the decayed state
    # before token t) solve (I + A) U = B, A[t, j] = beta_t exp(G_t - G_j) k_t.k_j (j < t), B_t = beta_t (v_t -
    # exp(G_t) k_t^T S): unit lower triangular, solved by forward substitution (u_t = B_t - sum_{j<t} A[t, j]
    # u_j, row by row: stable, where a Neumann-series product would cancel huge terms for correlated keys).
    # Then o_t = exp(G_t) q_t^T S + sum_{j <= t} exp(G_t - G_j) (q_t.k_j) u_j and S_T = exp(G_T) S +
    # sum_j exp(G_T - G_j) k_j u_j^T. Products over K run in BLOCK_R-row slices (the raw q / k, their norms
    # applied to the products after), fp32 (no TF32). Grid (B * HV, cdiv(V, BLOCK_V)).
    bh = tl.program_id(0)
    b = bh // HV
    h = bh % HV
    hk = h // (HV // HK)
    b64 = b.to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    valid = T
    if HAS_VALID:
        if VALID_PER_ROW:  # one count per batch row
            valid = tl.minimum(tl.load(n_valid + b).to(tl.int32), T)
        else:
            valid = tl.minimum(tl.load(n_valid).to(tl.int32), T)
    tin = ts < T
    real = ts < valid
    q_base = q + b64 * sq_b + hk * sq_h
    k_base = k + b64 * sk_b + hk * sk_h
    s_base = S + bh.to(tl.int64) * K * V
    so_base = S_out + bh.to(tl.int64) * K * V
    kk = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    qk = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    ks = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    qs = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    nk = tl.zeros((BLOCK_T,), dtype=tl.float32)
    nq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for r0 in range(0, K, BLOCK_R):
        red = r0 + tl.arange(0, BLOCK_R)
        tr = tin[:, None] & (red < K)[None, :]
        kc = tl.load(k_base + ts[:, None] * sk_t + red[None, :], mask=tr, other=0.0).to(tl.float32)
        qc = tl.load(q_base + ts[:, None] * sq_t + red[None, :], mask=tr, other=0.0).to(tl.float32)
        s0c = tl.load(s_base + red[:, None] * V + cols[None, :], mask=(red < K)[:, None] & cmask[None, :], other=0.0)
        nk += tl.sum(kc * kc, axis=1)
        nq += tl.sum(qc * qc, axis=1)
        kk = tl.dot(kc, tl.trans(kc), kk, input_precision="ieee")
        qk = tl.dot(qc, tl.trans(kc), qk, input_precision="ieee")
        ks = tl.dot(kc, s0c, ks, input_precision="ieee")
        qs = tl.dot(qc, s0c, qs, input_precision="ieee")
    rk = tl.rsqrt(nk + 1e-6)  # x * rsqrt(sum(x^2) + 1e-6), as transformers / fla, applied to the products
    rq = tl.rsqrt(nq + 1e-6) * scale
    vm = tl.load(v + b64 * sv_b + h * sv_h + ts[:, None] * sv_t + cols[None, :], mask=tin[:, None] & cmask[None, :],
                 other=0.0).to(tl.float32)
    gv = tl.load(g + b64 * sg_b + h + ts * sg_t, mask=real, other=0.0).to(tl.float32)
    bt = tl.load(beta + b64 * sb_b + h + ts * sb_t, mask=real, other=0.0).to(tl.float32)
    G = tl.cumsum(gv, axis=0)
    G_last = tl.sum(gv, axis=0)
    causal = ts[:, None] >= ts[None, :]
    decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))  # [t, j], <= 1 where used
    a = tl.where(ts[:, None] > ts[None, :], bt[:, None] * decay * (rk[:, None] * kk * rk[None, :]), 0.0)
    u = bt[:, None] * (vm - (tl.exp(G) * rk)[:, None] * ks)  # B
    for t in range(1, valid):  # rows from valid on are padding: A's rows and B's are zero there
        at = tl.sum(tl.where(ts[:, None] == t, a, 0.0), axis=0)  # A[t, :]
        u = tl.where(ts[:, None] == t, u - tl.sum(at[:, None] * u, axis=0)[None, :], u)
    attn = tl.where(causal, (rq[:, None] * qk * rk[None, :]) * decay, 0.0)
    out = (tl.exp(G) * rq)[:, None] * qs + tl.dot(attn, u, input_precision="ieee")
    o_offs = ((b * T + ts) * HV + h).to(tl.int64)[:, None] * V + cols[None, :]
    tl.store(o + o_offs, out.to(o.dtype.element_ty), mask=tin[:, None] & cmask[None, :])
    w = (tl.exp(G_last - G) * rk)[:, None] * u  # [T, V], the keys' norms folded in
    decay_last = tl.exp(G_last)
    for r0 in range(0, K, BLOCK_R):
        red = r0 + tl.arange(0, BLOCK_R)
        smask = (red < K)[:, None] & cmask[None, :]
        kt = tl.load(k_base + ts[None, :] * sk_t + red[:, None], mask=(red < K)[:, None] & tin[None, :],
                     other=0.0).to(tl.float32)  # [R, T]: raw keys, transposed
        offs = red[:, None] * V + cols[None, :]
        s_new = decay_last * tl.load(s_base + offs, mask=smask, other=0.0) + tl.dot(kt, w, input_precision="ieee")
        tl.store(so_base + offs, s_new, mask=smask)
