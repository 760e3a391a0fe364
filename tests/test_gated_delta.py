"""Parity tests for raincheck_hf.gated_delta (docs/method.md section 4), CPU, deterministic.

Two paths, same answer: the naive affine-map reference against transformers' own torch
fallbacks, the online suffix map against the explicit product, the join against direct
tokenwise application of the same factors, and the whole engine protocol against a real
``Qwen3_5GatedDeltaNet`` layer with its HF cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from raincheck_hf.gdn.algebra import (
    GDNLayerParams,
    LeadingSegment,
    advance_state,
    causal_conv_with_history,
    gdn_factors,
    hf_conv_state_to_history,
    history_to_hf_conv_state,
    identity_map,
    join_state,
    l2norm,
    naive_recurrent_gated_delta,
    repair_leading_segment,
    roll_conv_history,
    suffix_factors,
    update_suffix_map,
)
from raincheck_hf.gdn.suffix_map import SuffixStateMap

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

SEED = 42
KERNEL = 4


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def random_qkv(bsz, seq, hk, hv, dk, dv, *, seed=SEED, dtype=torch.float32):
    """Raw (unnormalised) q, k with ``hk`` heads, v with ``hv`` heads, mild decay, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, seq, hk, dk, generator=gen, dtype=dtype)
    k = torch.randn(bsz, seq, hk, dk, generator=gen, dtype=dtype)
    v = torch.randn(bsz, seq, hv, dv, generator=gen, dtype=dtype)
    # Mild decay and write strength so that the state (and the suffix map) stay far from zero
    # over 100 tokens: the tests then measure something.
    g = -0.02 * F.softplus(torch.randn(bsz, seq, hv, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(bsz, seq, hv, generator=gen, dtype=dtype) - 2.0)
    return q, k, v, g, beta


def to_value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """What the kernel does to q/k: L2-normalise, then repeat_interleave key heads to value heads."""
    return l2norm(x).repeat_interleave(hv // x.shape[2], dim=2)


def random_state(bsz, hv, dk, dv, *, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bsz, hv, dk, dv, generator=gen, dtype=dtype)


def random_params(hk, hv, dk, dv, *, seed=SEED, bias=False):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    return GDNLayerParams(
        conv_weight=0.5 * torch.randn(conv_dim, 1, KERNEL, generator=gen),  # nn.Conv1d layout
        conv_bias=0.1 * torch.randn(conv_dim, generator=gen) if bias else None,
        # Small A (slow decay) so the suffix map keeps memory over 100 tokens.
        A_log=torch.log(torch.empty(hv).uniform_(0.005, 0.05, generator=gen)),
        dt_bias=torch.randn(hv, generator=gen),
        num_k_heads=hk,
        num_v_heads=hv,
        head_k_dim=dk,
        head_v_dim=dv,
    )


def random_preconv(bsz, seq, params: GDNLayerParams, *, seed):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(bsz, seq, params.conv_dim, generator=gen)
    a = torch.randn(bsz, seq, params.num_v_heads, generator=gen)
    b = torch.randn(bsz, seq, params.num_v_heads, generator=gen)
    return mixed, a, b


# Shapes shared by the tests below: odd head sizes and dk != dv so a transposed layout cannot pass.
SHAPES = [
    pytest.param(dict(bsz=2, hk=1, hv=3, dk=5, dv=7), id="hk1-hv3-dk5-dv7"),
    pytest.param(dict(bsz=1, hk=2, hv=4, dk=16, dv=8), id="hk2-hv4-dk16-dv8"),
]
SUFFIX_LENGTHS = [pytest.param(t, id=f"t{t}") for t in (1, 2, 3, 4, 17, 100)]


# ----------------------------------------------------------------------------------------------
# 1. the naive reference against transformers' own torch fallbacks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seq", [pytest.param(t, id=f"T{t}") for t in (1, 63, 100)])
@pytest.mark.parametrize("with_state", [pytest.param(False, id="zero-init"), pytest.param(True, id="init")])
def test_naive_matches_hf_recurrent(shape, seq, with_state):
    bsz, hk, hv, dk, dv = (shape[k] for k in ("bsz", "hk", "hv", "dk", "dv"))
    q, k, v, g, beta = random_qkv(bsz, seq, hk, hv, dk, dv)
    s0 = random_state(bsz, hv, dk, dv, seed=1) if with_state else None
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = naive_recurrent_gated_delta(to_value_heads(q, hv), to_value_heads(k, hv), v, g, beta, s0)
    assert s.shape == s_hf.shape == (bsz, hv, dk, dv) and s.dtype == torch.float32
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seq", [pytest.param(t, id=f"T{t}") for t in (63, 100, 200)])
def test_naive_matches_hf_chunk(shape, seq):
    bsz, hk, hv, dk, dv = (shape[k] for k in ("bsz", "hk", "hv", "dk", "dv"))
    q, k, v, g, beta = random_qkv(bsz, seq, hk, hv, dk, dv, seed=7)
    s0 = random_state(bsz, hv, dk, dv, seed=2)
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = naive_recurrent_gated_delta(to_value_heads(q, hv), to_value_heads(k, hv), v, g, beta, s0)
    # The chunked UT-transform sums in a different order: fp32 rounding only.
    assert rel_err(o, o_hf) <= 1e-5
    assert rel_err(s, s_hf) <= 1e-5


def test_output_reads_state_after_update():
    """o_t = scale * q_t^T S_t with S_t the state *after* token t (from zero: beta (q.k) v / sqrt(dk))."""
    bsz, hv, dk, dv = 1, 3, 5, 7
    q, k, v, g, beta = random_qkv(bsz, 1, hv, hv, dk, dv, seed=3)
    qn, kn = l2norm(q), l2norm(k)
    o, s = naive_recurrent_gated_delta(qn, kn, v, g, beta)
    expected = dk**-0.5 * beta[:, 0, :, None] * (qn[:, 0] * kn[:, 0]).sum(-1, keepdim=True) * v[:, 0]
    torch.testing.assert_close(o[:, 0], expected)
    o_hf, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf)
    # The readout contracts the K axis of a [B, HV, K, V] state.
    torch.testing.assert_close(o[:, 0], dk**-0.5 * torch.einsum("bhk,bhkv->bhv", qn[:, 0], s))


def test_state_layout_is_k_by_v():
    """dk != dv: a [B, HV, V, K] (transposed, fla state_v_first) state is rejected, and would be wrong."""
    bsz, hv, dk, dv, seq = 2, 3, 5, 7, 9
    q, k, v, g, beta = random_qkv(bsz, seq, hv, hv, dk, dv, seed=4)
    s0 = random_state(bsz, hv, dk, dv, seed=5)
    _, s_hf = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    _, s = naive_recurrent_gated_delta(l2norm(q), l2norm(k), v, g, beta, s0)
    assert s.shape == (bsz, hv, dk, dv)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)

    s_t = s0.transpose(-1, -2).contiguous()
    with pytest.raises(ValueError, match="transposed"):
        naive_recurrent_gated_delta(l2norm(q), l2norm(k), v, g, beta, s_t)
    M = identity_map(bsz, hv, dk)
    with pytest.raises(ValueError, match="transposed"):
        join_state(s_t, M, s_t, s_t)
    with pytest.raises(ValueError, match="transposed"):
        advance_state(s_t, l2norm(k), v, g, beta)


# ----------------------------------------------------------------------------------------------
# 2. the suffix map and the join
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [pytest.param(t, id=f"T{t}") for t in (1, 2, 5, 17)])
def test_update_suffix_map_equals_explicit_product(seq):
    bsz, hv, dk, dv = 2, 3, 5, 7
    _, k, _, g, beta = random_qkv(bsz, seq, hv, hv, dk, dv, seed=6, dtype=torch.float64)
    kn = l2norm(k)
    A = suffix_factors(kn, g, beta)  # [B, T, HV, K, K]
    assert A.shape == (bsz, seq, hv, dk, dk)
    product = identity_map(bsz, hv, dk, dtype=torch.float64)
    for t in range(seq):
        product = A[:, t] @ product  # newest on the left
    M_all = update_suffix_map(identity_map(bsz, hv, dk, dtype=torch.float64), kn, g, beta)
    M_one = identity_map(bsz, hv, dk, dtype=torch.float64)
    for t in range(seq):  # the decode-time form: one token, [B, HV, K]
        M_one = update_suffix_map(M_one, kn[:, t], g[:, t], beta[:, t])
    torch.testing.assert_close(M_all, product, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(M_one, product, rtol=1e-12, atol=1e-12)
    # fp32 state of the map, as on the hot path
    M32 = update_suffix_map(identity_map(bsz, hv, dk), kn.float(), g.float(), beta.float())
    assert M32.dtype == torch.float32 and rel_err(M32, product) <= 1e-5


def test_suffix_factors_define_the_affine_map():
    """S_T = (A_T..A_1) S_0 + (state from zero): the identity the join rests on, in fp64."""
    bsz, hv, dk, dv, seq = 1, 3, 5, 7, 6
    q, k, v, g, beta = random_qkv(bsz, seq, hv, hv, dk, dv, seed=8, dtype=torch.float64)
    kn, s0 = l2norm(k), random_state(bsz, hv, dk, dv, seed=9, dtype=torch.float64)
    _, s_from_s0 = naive_recurrent_gated_delta(l2norm(q), kn, v, g, beta, s0)
    _, s_from_zero = naive_recurrent_gated_delta(l2norm(q), kn, v, g, beta)
    M = update_suffix_map(identity_map(bsz, hv, dk, dtype=torch.float64), kn, g, beta)
    torch.testing.assert_close(s_from_s0, M @ s0 + s_from_zero, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(advance_state(s0, kn, v, g, beta), s_from_s0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seq", SUFFIX_LENGTHS)
def test_join_matches_direct_application(shape, seq):
    bsz, hk, hv, dk, dv = (shape[k] for k in ("bsz", "hk", "hv", "dk", "dv"))
    q, k, v, g, beta = random_qkv(bsz, seq, hk, hv, dk, dv, seed=10 + seq)
    qn, kn = to_value_heads(q, hv), to_value_heads(k, hv)
    s_b = random_state(bsz, hv, dk, dv, seed=11)
    s_b_new = s_b + random_state(bsz, hv, dk, dv, seed=12)  # what inserted tokens did to the boundary
    _, s_live = naive_recurrent_gated_delta(qn, kn, v, g, beta, s_b)
    M = update_suffix_map(identity_map(bsz, hv, dk), kn, g, beta)
    joined = join_state(s_live, M, s_b, s_b_new)
    _, direct = naive_recurrent_gated_delta(qn, kn, v, g, beta, s_b_new)
    assert joined.dtype == torch.float32
    assert rel_err(joined, direct) <= 1e-5
    # The correction itself is not negligible (the test would be vacuous if M had decayed to 0).
    assert (direct - s_live).norm() >= 1e-3 * direct.norm()


# ----------------------------------------------------------------------------------------------
# 3. the short convolution and the leading-segment repair
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [pytest.param(False, id="no-bias"), pytest.param(True, id="bias")])
def test_conv_with_history_matches_hf(bias):
    """Against HF's multi-token conv over the whole sequence and its single-token cached update."""
    gen = torch.Generator().manual_seed(SEED)
    bsz, channels, seq = 2, 11, 9
    weight = torch.randn(channels, 1, KERNEL, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    history = torch.randn(bsz, KERNEL - 1, channels, generator=gen)
    x = torch.randn(bsz, seq, channels, generator=gen)

    ours = causal_conv_with_history(x, history, weight, b)
    torch.testing.assert_close(causal_conv_with_history(x, history, weight[:, 0], b), ours)

    whole = torch.cat([history, x], dim=1).transpose(1, 2)
    ref = hf.causal_conv1d_fn(whole, weight[:, 0], b, activation="silu")[:, :, KERNEL - 1 :]
    torch.testing.assert_close(ours, ref.transpose(1, 2))

    conv_state = history_to_hf_conv_state(history, KERNEL)  # [B, C, Kc]; column 0 is never read
    assert conv_state.shape == (bsz, channels, KERNEL)
    steps = [
        hf.causal_conv1d_update(x[:, t : t + 1].transpose(1, 2), conv_state, weight[:, 0], b, "silu")
        for t in range(seq)
    ]
    torch.testing.assert_close(ours, torch.cat(steps, dim=2).transpose(1, 2))
    # HF's cache rolled in place holds pre-conv inputs: the same window as roll_conv_history.
    torch.testing.assert_close(hf_conv_state_to_history(conv_state, KERNEL), roll_conv_history(history, x))


@pytest.mark.parametrize("seq", [pytest.param(t, id=f"t{t}") for t in (1, 2, 3, 4, 10)])
@pytest.mark.parametrize("prefix_len", [pytest.param(1, id="short-prefix"), pytest.param(6, id="prefix6")])
def test_conv_repair_matches_full_recompute(seq, prefix_len):
    """Only the first Kc-1 suffix tokens change with the history, and the repair recomputes them
    exactly as a from-scratch conv over the new sequence (zero padding at its start) does."""
    params = random_params(1, 3, 5, 7, bias=True)
    bsz = 2
    old_prefix, _, _ = random_preconv(bsz, 6, params, seed=20)
    new_prefix, _, _ = random_preconv(bsz, prefix_len, params, seed=21)
    y, a, b = random_preconv(bsz, seq, params, seed=22)
    zeros = torch.zeros(bsz, KERNEL - 1, params.conv_dim)
    h_old = roll_conv_history(zeros, old_prefix)
    h_new = roll_conv_history(zeros, new_prefix)  # a prefix shorter than Kc-1 leaves zeros in front

    recorded = gdn_factors(y, h_old, a, b, params)
    lead = min(KERNEL - 1, seq)
    leading = LeadingSegment(y[:, :lead], a[:, :lead], b[:, :lead])
    repair = repair_leading_segment(leading, h_new, random_state(bsz, 3, 5, 7, seed=23), params)

    # From scratch: HF's conv over the whole new sequence, then the module's split / normalise / repeat.
    whole = torch.cat([new_prefix, y], dim=1).transpose(1, 2)
    conv = hf.causal_conv1d_fn(whole, params.conv_weight, params.conv_bias, activation="silu")
    conv = conv[:, :, prefix_len:].transpose(1, 2)
    _, k_s, v_s = torch.split(conv, [params.key_dim, params.key_dim, params.value_dim], dim=-1)
    k_s = to_value_heads(k_s.reshape(bsz, seq, 1, 5), 3)
    v_s = v_s.reshape(bsz, seq, 3, 7)

    torch.testing.assert_close(repair.factors.k, k_s[:, :lead])
    torch.testing.assert_close(repair.factors.v, v_s[:, :lead])
    # Gates do not read the conv: recomputed alpha and beta are the recorded ones (up to an ulp:
    # vectorised sigmoid on a slice may round differently from the whole tensor).
    torch.testing.assert_close(repair.factors.g, recorded.g[:, :lead], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(repair.factors.beta, recorded.beta[:, :lead], rtol=1e-6, atol=1e-7)
    # The rest of the suffix keeps its factors under the new history.
    torch.testing.assert_close(recorded.k[:, lead:], k_s[:, lead:])
    torch.testing.assert_close(recorded.v[:, lead:], v_s[:, lead:])
    # ... while the leading segment really did change (the repair is not a no-op).
    assert not torch.allclose(recorded.k[:, :lead], k_s[:, :lead])


def _direct_rerun(s_b_new, h_new, y, a, b, recorded, params):
    """Reference: the suffix tokenwise from S_b', leading factors from h_b', the rest as recorded."""
    lead = min(KERNEL - 1, y.shape[1])
    fresh = gdn_factors(y[:, :lead], h_new, a[:, :lead], b[:, :lead], params)
    k = torch.cat([fresh.k, recorded.k[:, lead:]], dim=1)
    v = torch.cat([fresh.v, recorded.v[:, lead:]], dim=1)
    g = torch.cat([fresh.g, recorded.g[:, lead:]], dim=1)
    beta = torch.cat([fresh.beta, recorded.beta[:, lead:]], dim=1)
    q = torch.zeros_like(k)
    return naive_recurrent_gated_delta(q, k, v, g, beta, s_b_new)[1]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seq", [pytest.param(0, id="t0"), *SUFFIX_LENGTHS])
def test_full_join_with_leading_repair(shape, seq):
    hk, hv, dk, dv = (shape[k] for k in ("hk", "hv", "dk", "dv"))
    bsz = 2
    params = random_params(hk, hv, dk, dv, seed=30)
    s_b = random_state(bsz, hv, dk, dv, seed=31)
    h_b = torch.randn(bsz, KERNEL - 1, params.conv_dim, generator=torch.Generator().manual_seed(32))
    y, a, b = random_preconv(bsz, seq, params, seed=33)

    smap = SuffixStateMap(params)
    smap.reset_boundary(s_b, h_b)
    # Append as an engine would: a first decode token alone, then uneven pieces.
    recorded = []
    for lo, hi in ((0, 1), (1, 3), (3, seq)):
        lo, hi = min(lo, seq), min(hi, seq)
        if hi > lo:
            recorded.append(smap.append_suffix(y[:, lo:hi], a[:, lo:hi], b[:, lo:hi]))
    assert smap.suffix_length == seq and smap.leading.length == min(KERNEL - 1, seq)
    rec = gdn_factors(y, h_b, a, b, params)  # the recorded factors, in one go
    if recorded:
        torch.testing.assert_close(torch.cat([f.k for f in recorded], dim=1), rec.k)
    s_live = naive_recurrent_gated_delta(rec.q, rec.k, rec.v, rec.g, rec.beta, s_b)[1]

    # First insertion.
    s_b1 = s_b + random_state(bsz, hv, dk, dv, seed=34)
    h_b1 = torch.randn(bsz, KERNEL - 1, params.conv_dim, generator=torch.Generator().manual_seed(35))
    live1 = smap.join(s_b1, h_b1, s_live)
    direct1 = _direct_rerun(s_b1, h_b1, y, a, b, rec, params)
    assert rel_err(live1, direct1) <= 1e-5
    if seq:
        assert (direct1 - s_live).norm() >= 1e-3 * direct1.norm()  # the correction matters
    torch.testing.assert_close(smap.live_conv_history, roll_conv_history(h_b1, y))

    # A second insertion at the (moved) boundary: chunks compose.
    s_b2 = s_b1 + random_state(bsz, hv, dk, dv, seed=36)
    h_b2 = torch.randn(bsz, KERNEL - 1, params.conv_dim, generator=torch.Generator().manual_seed(37))
    live2 = smap.join(s_b2, h_b2, live1)
    assert rel_err(live2, _direct_rerun(s_b2, h_b2, y, a, b, rec, params)) <= 1e-5

    # Decoding continues after a join: the next token reads the corrected conv window.
    y_next, a_next, b_next = random_preconv(bsz, 2, params, seed=38)
    smap.append_suffix(y_next, a_next, b_next)
    y_all, a_all, b_all = (torch.cat(p, dim=1) for p in ((y, y_next), (a, a_next), (b, b_next)))
    rec_all = gdn_factors(y_all, h_b2, a_all, b_all, params)  # the appended tokens saw h_b2's window
    live3 = advance_state(live2, rec_all.k[:, seq:], rec_all.v[:, seq:], rec_all.g[:, seq:], rec_all.beta[:, seq:])
    s_b3 = s_b2 + random_state(bsz, hv, dk, dv, seed=39)
    h_b3 = torch.randn(bsz, KERNEL - 1, params.conv_dim, generator=torch.Generator().manual_seed(40))
    live4 = smap.join(s_b3, h_b3, live3)
    assert rel_err(live4, _direct_rerun(s_b3, h_b3, y_all, a_all, b_all, rec_all, params)) <= 1e-5


# ----------------------------------------------------------------------------------------------
# 4. against a real Qwen3_5GatedDeltaNet layer and its HF cache
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_layer():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=KERNEL,
    )
    torch.manual_seed(SEED)
    layer = hf.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():  # slower decay than the init's A in [0.01, 16], so the join has work to do
        layer.A_log.copy_(torch.log(torch.linspace(0.01, 0.1, cfg.linear_num_value_heads)))
    return cfg, layer


def _preconv(layer, x):
    return layer.in_proj_qkv(x), layer.in_proj_a(x), layer.in_proj_b(x)


def test_factors_reproduce_the_module(tiny_layer):
    """gdn_factors + the naive reference + the module's norm / out_proj give the module's output:
    split order, head repeat, l2norm, scale and gate formulas are HF's."""
    cfg, layer = tiny_layer
    x = torch.randn(2, 37, cfg.hidden_size, generator=torch.Generator().manual_seed(50))
    params = GDNLayerParams.from_module(layer)
    with torch.no_grad():
        ref = layer(x)
        mixed, a, b = _preconv(layer, x)
        f = gdn_factors(mixed, torch.zeros(2, KERNEL - 1, params.conv_dim), a, b, params)
        o, _ = naive_recurrent_gated_delta(f.q, f.k, f.v, f.g, f.beta)
        z = layer.in_proj_z(x).reshape(-1, params.head_v_dim)
        out = layer.out_proj(layer.norm(o.reshape(-1, params.head_v_dim), z).reshape(2, 37, -1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("suffix_len", [pytest.param(2, id="t2-shorter-than-kernel"), pytest.param(9, id="t9")])
def test_engine_protocol_against_hf_layer(tiny_layer, suffix_len):
    """One layer, fixed inputs: the join equals a full re-run of [prefix, chunk, suffix] (the
    suffix's factors cannot change through lower layers here), conv cache included, and the
    next decode token from the joined cache matches the re-run's."""
    from transformers.cache_utils import DynamicCache

    cfg, layer = tiny_layer
    bsz, n_prefix, n_chunk = 2, 5, 7
    gen = torch.Generator().manual_seed(60)
    x_p, x_d, x_y, x_next = (
        torch.randn(bsz, n, cfg.hidden_size, generator=gen) for n in (n_prefix, n_chunk, suffix_len, 1)
    )
    params = GDNLayerParams.from_module(layer)
    smap = SuffixStateMap(params)
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        layer(x_p, cache=cache)
        smap.reset_boundary(cache.get_recurrent_state(0), hf_conv_state_to_history(cache.get_conv_state(0), KERNEL))
        chunk_cache = copy.deepcopy(cache)  # the chunk runs from the boundary
        for piece in (x_y[:, :1], x_y[:, 1:]):  # a single-token decode step, then the rest
            layer(piece, cache=cache)
            smap.append_suffix(*_preconv(layer, piece))

        layer(x_d, cache=chunk_cache)
        s_b_new = chunk_cache.get_recurrent_state(0)
        h_b_new = hf_conv_state_to_history(chunk_cache.get_conv_state(0), KERNEL)
        stale = cache.get_recurrent_state(0).clone()
        live = smap.join(s_b_new, h_b_new, stale)
        cache.update_recurrent_state(live, 0)
        cache.get_conv_state(0).copy_(history_to_hf_conv_state(smap.live_conv_history, KERNEL))

        rerun = DynamicCache(config=cfg)
        layer(torch.cat([x_p, x_d, x_y], dim=1), cache=rerun)
        assert rel_err(live, rerun.get_recurrent_state(0)) <= 1e-5
        assert rel_err(stale, rerun.get_recurrent_state(0)) >= 1e-2  # the join had real work to do
        torch.testing.assert_close(
            smap.live_conv_history, hf_conv_state_to_history(rerun.get_conv_state(0), KERNEL)
        )
        out = layer(x_next, cache=cache)
        out_ref = layer(x_next, cache=rerun)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


def test_params_validation_is_actionable(tiny_layer):
    _, layer = tiny_layer
    p = GDNLayerParams.from_module(layer)
    with pytest.raises(ValueError, match="channels"):
        GDNLayerParams(p.conv_weight, p.A_log, p.dt_bias, p.num_k_heads, p.num_v_heads, p.head_k_dim + 1, p.head_v_dim)
    with pytest.raises(ValueError, match="multiple"):
        GDNLayerParams(p.conv_weight, p.A_log, p.dt_bias, 3, p.num_v_heads, p.head_k_dim, p.head_v_dim)
    with pytest.raises(RuntimeError, match="reset_boundary"):
        SuffixStateMap(p).live_conv_history
