"""The fast path's in-place GDN operations as its static GDN state calls them (`fast.gdn_kernels`: the Triton
kernels on CUDA, the references on CPU) and the static-buffer state map (`fast.static_cache.StaticGDNState`)
against the references of `raincheck_hf.gated_delta`.

Random inputs (seed 42), odd sizes, several head counts (key heads repeated to value heads), CPU.
"""

from __future__ import annotations

import pytest
import torch

from raincheck_hf.gdn import kernels as gdn_ops
from raincheck_hf.gdn.algebra import (
    advance_state,
    causal_conv_with_history,
    gdn_factors,
    gdn_gates,
    l2norm,
    naive_recurrent_gated_delta,
    roll_conv_history,
    suffix_factors,
)
from raincheck_hf.gdn.static import RecurrentLayout, StaticGDNState
from raincheck_hf.gdn.suffix_map import SuffixStateMap

from test_gated_delta import KERNEL, SHAPES, random_params, random_preconv, random_qkv, random_state, rel_err


def _heads(shape):
    return (shape[k] for k in ("bsz", "hk", "hv", "dk", "dv"))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seq", [pytest.param(t, id=f"T{t}") for t in (1, 5, 31)])
def test_recurrent_step_matches_naive(shape, seq):
    bsz, hk, hv, dk, dv = _heads(shape)
    q, k, v, g, beta = random_qkv(bsz, seq, hk, hv, dk, dv)
    state = random_state(bsz, hv, dk, dv, seed=3)
    want_o, want_s = naive_recurrent_gated_delta(l2norm(q).repeat_interleave(hv // hk, 2),
                                                 l2norm(k).repeat_interleave(hv // hk, 2), v, g, beta, state)
    address = state.data_ptr()
    o = gdn_ops.recurrent_step_(state, q, k, v, g, beta)
    assert state.data_ptr() == address and o.shape == (bsz, seq, hv, dv)
    assert rel_err(o, want_o) <= 1e-5 and rel_err(state, want_s) <= 1e-5


def test_recurrent_step_gated_off_rows_change_nothing():
    """``g = 0, beta = 0``: the padding of a chunk step leaves the state exactly as it was."""
    q, k, v, g, beta = random_qkv(1, 4, 2, 4, 8, 6)
    state = random_state(1, 4, 8, 6, seed=5)
    before = state.clone()
    gdn_ops.recurrent_step_(state, q, k, v, torch.zeros_like(g), torch.zeros_like(beta))
    assert torch.equal(state, before)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seq", [pytest.param(t, id=f"T{t}") for t in (1, 3, 17)])
def test_suffix_map_update_is_the_product_of_transitions(shape, seq):
    bsz, hk, hv, dk, _ = _heads(shape)
    _, k, _, g, beta = random_qkv(bsz, seq, hk, hv, dk, 1)
    M = random_state(bsz, hv, dk, dk, seed=4)
    want = M.clone().double()
    factors = suffix_factors(l2norm(k).repeat_interleave(hv // hk, 2).double(), g.double(), beta.double())
    for t in range(seq):
        want = factors[:, t] @ want
    address = M.data_ptr()
    gdn_ops.suffix_map_update_(M, l2norm(k), g, beta)
    assert M.data_ptr() == address
    assert rel_err(M, want) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_join_adds_the_mapped_boundary_change(shape):
    bsz, _, hv, dk, dv = _heads(shape)
    live, new, old = (random_state(bsz, hv, dk, dv, seed=s) for s in (6, 7, 8))
    M = random_state(bsz, hv, dk, dk, seed=9)
    want = live.double() + M.double() @ (new.double() - old.double())
    gdn_ops.join_(live, M, new, old)
    assert rel_err(live, want) <= 1e-6


@pytest.mark.parametrize("seq", [1, 2, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_update_rolls_the_history(seq, bias):
    params = random_params(2, 4, 8, 6, bias=bias)
    x, _, _ = random_preconv(1, seq, params, seed=10)
    history, _, _ = random_preconv(1, KERNEL - 1, params, seed=11)
    want_y = causal_conv_with_history(x, history, params.conv_weight, params.conv_bias)
    want_h = torch.cat([history, x], dim=1)[:, -(KERNEL - 1):]
    y = gdn_ops.conv_update_(history, x, params.conv_weight, params.conv_bias)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(history, want_h)


# ---- the static-buffer protocol of one layer against `SuffixStateMap` --------------------------------

def _layout(params):
    return RecurrentLayout((0,), params.num_k_heads, params.num_v_heads, params.head_k_dim, params.head_v_dim,
                           KERNEL, torch.float32)


@pytest.mark.parametrize("rule", ["recurrent", "chunked"])
@pytest.mark.parametrize("real,padding", [(1, 0), (1, 5), (2, 3), (7, 9), (20, 0)])
def test_padded_input_rows_match_unpadded_ones(real, padding, rule):
    """A bucketed prefill's layout ``[padding, input rows]`` (`StaticGDNState.run_input`) against the same rows
    unpadded (`run_rest`) from the same live state and conv history: outputs of the real rows, live state, conv
    history; fewer real rows than the history's width too."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    params = random_params(2, 4, 8, 6)
    rows = {}
    for name, pad in (("unpadded", 0), ("padded", padding)):
        buf = StaticGDNState(_layout(params), "cpu")
        buf.state.copy_(random_state(1, 4, 8, 6, seed=21))
        buf.conv.copy_(random_preconv(1, KERNEL - 1, params, seed=22)[0])
        qkv, a, b = random_preconv(1, real, params, seed=23)
        if pad:  # garbage in the padding rows: none of it may reach a real row or the states
            junk, ja, jb = random_preconv(1, pad, params, seed=24)
            qkv, a, b = (torch.cat([100 * x, y], dim=1) for x, y in ((junk, qkv), (ja, a), (jb, b)))
        g, beta = gdn_gates(a, b, params)
        chunk_rule = torch_chunk_gated_delta_rule if rule == "chunked" else None
        if name == "unpadded":
            out, _, _ = buf.run_rest(qkv, g, beta, params, chunk_rule=chunk_rule)
        else:
            out, _, _ = buf.run_input(qkv, g, beta, torch.tensor([pad]), params, chunk_rule=chunk_rule)
            out = out[:, pad:]
        rows[name] = (out, buf.state.clone(), buf.conv.clone())
    (o1, s1, c1), (o2, s2, c2) = rows["unpadded"], rows["padded"]
    assert rel_err(o2, o1) <= 1e-5 and rel_err(s2, s1) <= 1e-5
    assert torch.equal(c2, c1)


@pytest.mark.parametrize("suffix", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("real,padding", [(3, 2), (1, 4), (6, 0)])
def test_static_state_matches_suffix_state_map(suffix, real, padding):
    """Boundary at a random live state; ``suffix`` generated tokens (recorded: the first Kc - 1 as the leading
    segment, the rest into M); a chunk of ``real`` deferred rows padded with ``padding`` rows; the join; one
    more token. Live state, conv window and boundary against `SuffixStateMap` and tokenwise application."""
    params = random_params(2, 4, 8, 6)
    buf = StaticGDNState(_layout(params), "cpu")
    live = random_state(1, 4, 8, 6, seed=12)
    history, _, _ = random_preconv(1, KERNEL - 1, params, seed=13)
    buf.state.copy_(live)
    buf.conv.copy_(history)
    buf.reset_boundary()
    smap = SuffixStateMap(params)
    smap.reset_boundary(live, history)
    live_conv = history.clone()

    def token(seed, t, record=True):
        nonlocal live, live_conv
        qkv, a, b = random_preconv(1, 1, params, seed=seed)
        g, beta = gdn_gates(a, b, params)
        _, k, v = buf.run_rest(qkv, g, beta, params)
        if record:
            buf.record(qkv, k, v, g, beta, torch.tensor([t]), leading=t < KERNEL - 1)
            smap.append_suffix(qkv, a, b)
        f = gdn_factors(qkv, live_conv, a, b, params)
        live = advance_state(live, f.k, f.v, f.g, f.beta)
        live_conv = roll_conv_history(live_conv, qkv)

    for t in range(suffix):
        token(100 + t, t)
    qkv, a, b = random_preconv(1, real + padding, params, seed=14)
    g, beta = gdn_gates(a, b, params)
    buf.run_chunk(qkv, g, beta, torch.tensor([real]), params)
    buf.join(torch.tensor([suffix]), params)
    f = gdn_factors(qkv[:, :real], smap.boundary_conv_history, a[:, :real], b[:, :real], params)
    new_boundary = advance_state(smap.boundary_state, f.k, f.v, f.g, f.beta)
    live = smap.join(new_boundary, roll_conv_history(smap.boundary_conv_history, qkv[:, :real]), live)
    live_conv = smap.live_conv_history
    torch.testing.assert_close(buf.boundary_state, smap.boundary_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf.boundary_conv, smap.boundary_conv_history)
    torch.testing.assert_close(buf.leading_state, smap.leading_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf.state, live, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf.conv, live_conv)
    token(200, suffix, record=False)  # the next token reads the corrected state and window
    torch.testing.assert_close(buf.state, live, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf.conv, live_conv)
