"""The Gated DeltaNet kernels (`fast.gdn_kernels`) against their references, on CPU.

The Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton compiles a kernel,
so in one subprocess for all cases); the real sizes on a GPU are in `test_gpu.py`. Sizes are odd on purpose
(K, V not powers of two and K != V, so a state read as ``[V, K]`` fails), with HV = HK, 2 HK and 4 HK (1, 2
and 3 key heads), B = 1 and 2, T = 1, 2, 3 (one token and several take different tiles). A second subprocess
compiles the kernels for a Hopper GPU with the ptxas that Triton ships.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from raincheck_hf.gdn import kernels as gk
from raincheck_hf.gdn.algebra import (
    causal_conv_with_history,
    join_state,
    l2norm,
    naive_recurrent_gated_delta,
    roll_conv_history,
    update_suffix_map,
)

# the last of each list: the tiny Qwen3.5 of raincheck_hf.tiny (HK 2, HV 4, K 8, V 16, C 96), which the GPU
# tests of the engine run through these kernels.
# (B, T, HK, HV, K) for the map; (B, T, HK, HV, K, V) for the step; (B, HV, K, V) for the join;
# (B, T, C, Kc, bias, dtype) for the conv
MAP_SIZES = [(1, 1, 2, 2, 24), (2, 2, 2, 4, 40), (1, 3, 1, 4, 24), (2, 1, 3, 6, 17), (1, 1, 2, 4, 8)]
STEP_SIZES = [(1, 1, 2, 2, 24, 40), (2, 2, 2, 4, 40, 24), (1, 3, 1, 4, 24, 40), (2, 1, 3, 6, 17, 20),
              (1, 1, 2, 4, 8, 16)]
# (B, T, HK, HV, K, V, correlated keys) for the chunked form (16, 32 and 64-token tiles; K and V of 16 or more)
CHUNKED_SIZES = [(1, 7, 2, 4, 24, 40, False), (2, 16, 1, 2, 16, 20, False), (1, 31, 2, 4, 32, 24, False),
                 (1, 32, 1, 1, 16, 16, True), (1, 63, 1, 2, 16, 16, False), (1, 64, 1, 1, 16, 16, True),
                 (1, 3, 2, 4, 8, 16, False)]
JOIN_SIZES = [(1, 2, 24, 40), (2, 3, 40, 24), (1, 1, 17, 33), (1, 2, 80, 72), (1, 4, 8, 16)]
CONV_SIZES = [(1, 1, 40, 4, False, "float32"), (2, 2, 50, 4, True, "float32"), (1, 3, 200, 4, False, "float32"),
              (2, 5, 24, 4, True, "float32"), (1, 1, 30, 2, False, "float32"), (2, 2, 40, 4, False, "bfloat16"),
              (1, 1, 96, 4, False, "float32")]

SCRIPT = r"""
import json, sys, torch
from raincheck_hf.gdn import kernels as gk
from raincheck_hf.gdn.algebra import l2norm

def err(a, b):
    return (a.double() - b.double()).abs().max().item()

cases = json.loads(sys.argv[1])
out = {}
for B, T, HK, HV, K in cases["map"]:
    g = torch.Generator().manual_seed(42)
    M = torch.randn(B, HV, K, K, generator=g)
    k = l2norm(torch.randn(B, T, HK, K, generator=g))
    gate, beta = -torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g)
    got = gk.suffix_map_update_(M.clone(), k, gate, beta, reference=False)
    want = gk.suffix_map_update_(M.clone(), k, gate, beta, reference=True)
    # padding: a token with beta = 0 and g = 0 between two real ones changes nothing
    kp = torch.cat([k[:, :1], k[:, :1], k[:, 1:]], dim=1)
    gp = torch.cat([gate[:, :1], torch.zeros_like(gate[:, :1]), gate[:, 1:]], dim=1)
    bp = torch.cat([beta[:, :1], torch.zeros_like(beta[:, :1]), beta[:, 1:]], dim=1)
    padded = gk.suffix_map_update_(M.clone(), kp, gp, bp, reference=False)
    only_pad = gk.suffix_map_update_(M.clone(), k, torch.zeros_like(gate), torch.zeros_like(beta), reference=False)
    out[f"map {B, T, HK, HV, K}"] = {"err": err(got, want), "scale": want.abs().max().item(),
                                    "padded_equal": torch.equal(padded, got), "pad_identity": torch.equal(only_pad, M)}

for B, HV, K, V in cases["join"]:
    g = torch.Generator().manual_seed(42)
    S, M = torch.randn(B, HV, K, V, generator=g), torch.randn(B, HV, K, K, generator=g)
    S_new, S_old = torch.randn(B, HV, K, V, generator=g), torch.randn(B, HV, K, V, generator=g)
    got = gk.join_(S.clone(), M, S_new, S_old, reference=False)
    want = gk.join_(S.clone(), M, S_new, S_old, reference=True)
    out[f"join {B, HV, K, V}"] = {"err": err(got, want), "scale": want.abs().max().item()}

for B, T, HK, HV, K, V in cases["step"]:
    for dtype, l2, scale in (("float32", True, None), ("float32", False, 0.3), ("bfloat16", True, None)):
        g = torch.Generator().manual_seed(42)
        dt = getattr(torch, dtype)
        S = torch.randn(B, HV, K, V, generator=g)
        q, k = torch.randn(B, T, HK, K, generator=g).to(dt), torch.randn(B, T, HK, K, generator=g).to(dt)
        if not l2:
            q, k = l2norm(q.float()).to(dt), l2norm(k.float()).to(dt)
        v = torch.randn(B, T, HV, V, generator=g).to(dt)
        gate, beta = -torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g).to(dt)
        S1, S2 = S.clone(), S.clone()
        o1 = gk.recurrent_step_(S1, q, k, v, gate, beta, scale, l2, reference=False)
        o2 = gk.recurrent_step_(S2, q, k, v, gate, beta, scale, l2, reference=True)
        # padding tokens leave the state unchanged
        S3 = S.clone()
        gk.recurrent_step_(S3, q, k, v, torch.zeros_like(gate), torch.zeros_like(beta), scale, l2, reference=False)
        out[f"step {B, T, HK, HV, K, V} {dtype} l2norm={l2} scale={scale}"] = {
            "err": err(S1, S2), "scale": S2.abs().max().item(), "o_err": err(o1, o2), "o_scale": o2.abs().max().item(),
            "o_dtype": str(o1.dtype), "pad_identity": torch.equal(S3, S)}

for B, T, C, Kc, bias, dtype in cases["conv"]:
    g = torch.Generator().manual_seed(42)
    dt = getattr(torch, dtype)
    h = torch.randn(B, Kc - 1, C, generator=g).to(dt)
    x = torch.randn(B, T, C, generator=g).to(dt)
    w = torch.randn(C, 1, Kc, generator=g).to(dt)
    b = torch.randn(C, generator=g).to(dt) if bias else None
    h1, h2 = h.clone(), h.clone()
    y1 = gk.conv_update_(h1, x, w, b, reference=False)
    y2 = gk.conv_update_(h2, x, w, b, reference=True)
    h3 = h.clone()
    y3 = gk.conv_update_(h3, x, w[:, 0], b, activation=None, reference=False)
    y4 = gk.conv_update_(h.clone(), x, w[:, 0], b, activation=None, reference=True)
    out[f"conv {B, T, C, Kc, bias, dtype}"] = {
        "err": max(err(y1, y2), err(y3, y4)), "scale": y2.abs().max().item(), "history_equal": torch.equal(h1, h2),
        "dtype": str(y1.dtype)}
# the step's masked forms: real-token / real-row counts as device scalars, separate output buffers, in-kernel norm
for B, T, HK, HV, K, V in cases["step"]:
    g = torch.Generator().manual_seed(7)
    S = torch.randn(B, HV, K, V, generator=g)
    q, k = torch.randn(B, T, HK, K, generator=g), torch.randn(B, T, HK, K, generator=g)
    v = torch.randn(B, T, HV, V, generator=g).to(torch.bfloat16)
    gate, beta = -torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g).to(torch.bfloat16)
    for n in range(T + 2):  # n > T: every token real
        valid = torch.tensor([n])
        S1, out1 = torch.empty_like(S), torch.empty(B, T, HV, V, dtype=torch.bfloat16)
        o1 = gk.recurrent_step_(S, q, k, v, gate, beta, valid=valid, state_out=S1, out=out1, reference=False)
        real = (torch.arange(T) < n)[None, :, None]
        S2 = S.clone()
        o2 = gk.recurrent_step_(S2, q, k, v, torch.where(real, gate, 0.0),
                                torch.where(real, beta, torch.zeros_like(beta)), reference=True)
        S3 = torch.empty_like(S)
        o3 = gk.recurrent_step_(S, q, k, v, gate, beta, valid=valid, state_out=S3, reference=True)
        out[f"masked step {B, T, HK, HV, K, V} n={n}"] = {
            "err": max(err(S1, S2), err(S3, S2)), "scale": S2.abs().max().item(),
            "o_err": max(err(o1, o2), err(o3, o2)), "o_scale": o2.abs().max().item(), "out_is_o": o1 is out1}
# the chunked form against the token-by-token reference: chunk lengths up to 64, masked tails, correlated keys
# with no decay and beta = 1 (the hard case for its triangular solve), strided inputs
for B, T, HK, HV, K, V, hard in cases["chunked"]:
    g = torch.Generator().manual_seed(11)
    S = torch.randn(B, HV, K, V, generator=g)
    q = torch.randn(B, T, HK, K, generator=g).to(torch.bfloat16)
    if hard:
        k = (torch.randn(B, 1, HK, K, generator=g) + 0.05 * torch.randn(B, T, HK, K, generator=g)).to(torch.bfloat16)
        gate, beta = torch.zeros(B, T, HV), torch.ones(B, T, HV, dtype=torch.bfloat16)
    else:
        k = torch.randn(B, T, HK, K, generator=g).to(torch.bfloat16)
        gate, beta = -2 * torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g).to(torch.bfloat16)
    mixed = torch.randn(B, T, HV * V + 3, generator=g).to(torch.bfloat16)
    v = mixed[..., 3:].reshape(B, T, HV, V)  # strided, as the split of the conv output
    for n in sorted({T, max(T - 3, 0), 1}):
        valid = torch.tensor([n])
        S1, o1 = torch.empty_like(S), torch.empty(B, T, HV, V, dtype=torch.bfloat16)
        gk.chunked_step_(S, q, k, v, gate, beta, valid=valid, state_out=S1, out=o1, reference=False)
        S2 = S.clone()
        o2 = gk.recurrent_step_(S2, q, k, v.contiguous(), gate, beta, valid=valid, reference=True)
        S3 = torch.empty_like(S)
        o3 = gk.chunked_step_(S, q, k, v, gate, beta, valid=valid, state_out=S3, reference=True)
        out[f"chunked {B, T, HK, HV, K, V} hard={hard} n={n}"] = {
            "err": max(err(S1, S2), err(S3, S2)), "scale": S2.abs().max().item(),
            "o_err": max(err(o1, o2), err(o3, o2)), "o_scale": o2.abs().max().item()}
for B, T, HK, HV, K in cases["map"]:
    g = torch.Generator().manual_seed(8)
    M = torch.randn(B, HV, K, K, generator=g)
    k = torch.randn(B, T, HK, K, generator=g).to(torch.bfloat16)
    gate, beta = -torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g)
    got = gk.suffix_map_update_(M.clone(), k, gate, beta, l2norm=True, reference=False)
    want = gk.suffix_map_update_(M.clone(), l2norm(k.float()), gate, beta, reference=True)
    ref = gk.suffix_map_update_(M.clone(), k, gate, beta, l2norm=True, reference=True)
    out[f"normed map {B, T, HK, HV, K}"] = {"err": max(err(got, want), err(ref, want)), "scale": want.abs().max().item()}
for B, T, C, Kc, bias, dtype in cases["conv"]:
    g = torch.Generator().manual_seed(9)
    dt = getattr(torch, dtype)
    h = torch.randn(B, Kc - 1, C, generator=g).to(dt)
    x = torch.randn(B, T, C, generator=g).to(dt)
    w = torch.randn(C, Kc, generator=g).to(dt)
    y_full = gk.conv_update_(h.clone(), x, w, reference=True)
    for n in range(T + 2):
        rows_in = torch.tensor([n])
        # in place, the first min(n, T) rows enter: the history of the real rows alone
        h1 = h.clone()
        y1 = gk.conv_update_(h1, x, w, rows_in=rows_in, reference=False)
        h_want = h.clone()
        if n:
            gk.conv_update_(h_want, x[:, :min(n, T)], w, reference=True)
        h2 = h.clone()
        gk.conv_update_(h2, x, w, rows_in=rows_in, reference=True)
        # into another buffer, only while n < Kc - 1 (else it keeps its own)
        own = torch.randn(B, Kc - 1, C, generator=g).to(dt)
        o1, o2 = own.clone(), own.clone()
        y3 = gk.conv_update_(h, x, w, rows_in=rows_in, history_out=o1, only_within_window=True, reference=False)
        gk.conv_update_(h, x, w, rows_in=rows_in, history_out=o2, only_within_window=True, reference=True)
        o_want = h_want if n < Kc - 1 else own
        out[f"masked conv {B, T, C, Kc, bias, dtype} n={n}"] = {
            "err": max(err(y1, y_full), err(y3, y_full)), "scale": y_full.abs().max().item(),
            "history_equal": torch.equal(h1, h_want) and torch.equal(h2, h_want),
            "window_equal": torch.equal(o1, o_want) and torch.equal(o2, o_want)}
# per-row counts ([B] integers, one per batch row: the batched captured step's sequences), against each row run
# alone with its own scalar count; a row with count 0 keeps its state / history exactly
for _, T, HK, HV, K, V in cases["step"]:
    g = torch.Generator().manual_seed(12)
    B = 3
    counts = torch.tensor([0, min(1, T), T + 1])
    S = torch.randn(B, HV, K, V, generator=g)
    q, k = torch.randn(B, T, HK, K, generator=g), torch.randn(B, T, HK, K, generator=g)
    v = torch.randn(B, T, HV, V, generator=g)
    gate, beta = -torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g)
    row = {"err": 0.0, "o_err": 0.0, "scale": S.abs().max().item(), "o_scale": 1.0, "zero_kept": True}
    for fn in (gk.recurrent_step_, gk.chunked_step_):
        got = {}
        for reference in (False, True):
            S1 = S.clone()
            o1 = fn(S1, q, k, v, gate, beta, valid=counts, reference=reference)
            got[reference] = (S1, o1)
            row["zero_kept"] &= torch.equal(S1[0], S[0])
        for b in range(B):
            Sb = S[b:b + 1].clone()
            ob = gk.recurrent_step_(Sb, q[b:b + 1], k[b:b + 1], v[b:b + 1], gate[b:b + 1], beta[b:b + 1],
                                    valid=counts[b:b + 1], reference=True)
            for S1, o1 in got.values():
                row["err"] = max(row["err"], err(S1[b:b + 1], Sb))
                row["o_err"] = max(row["o_err"], err(o1[b:b + 1], ob))
            row["o_scale"] = max(row["o_scale"], ob.abs().max().item())
    out[f"per-row step {B, T, HK, HV, K, V}"] = row
for _, T, C, Kc, bias, dtype in cases["conv"]:
    g = torch.Generator().manual_seed(13)
    dt = getattr(torch, dtype)
    B = 3
    counts = torch.tensor([0, min(1, T), T + 1])
    h = torch.randn(B, Kc - 1, C, generator=g).to(dt)
    x = torch.randn(B, T, C, generator=g).to(dt)
    w = torch.randn(C, Kc, generator=g).to(dt)
    own = torch.randn(B, Kc - 1, C, generator=g).to(dt)
    y_full = gk.conv_update_(h.clone(), x, w, reference=True)
    row = {"err": 0.0, "scale": y_full.abs().max().item(), "history_equal": True, "window_equal": True}
    for reference in (False, True):
        h1 = h.clone()
        y1 = gk.conv_update_(h1, x, w, rows_in=counts, reference=reference)
        o1 = own.clone()
        y2 = gk.conv_update_(h, x, w, rows_in=counts, history_out=o1, only_within_window=True, reference=reference)
        row["err"] = max(row["err"], err(y1, y_full), err(y2, y_full))
        for b in range(B):
            hb, ob = h[b:b + 1].clone(), own[b:b + 1].clone()
            gk.conv_update_(hb, x[b:b + 1], w, rows_in=counts[b:b + 1], reference=True)
            gk.conv_update_(h[b:b + 1], x[b:b + 1], w, rows_in=counts[b:b + 1], history_out=ob,
                            only_within_window=True, reference=True)
            row["history_equal"] &= torch.equal(h1[b:b + 1], hb)
            row["window_equal"] &= torch.equal(o1[b:b + 1], ob)
        row["history_equal"] &= torch.equal(h1[0], h[0])  # count 0: the history as it was
    out[f"per-row conv {B, T, C, Kc, bias, dtype}"] = row
K, V = 3, 5
q = torch.tensor([1.0, 0.0, 0.0]).view(1, 1, 1, K)
k = torch.tensor([0.6, 0.8, 0.0]).view(1, 1, 1, K)
v = torch.arange(1.0, V + 1).view(1, 1, 1, V)
S = torch.zeros(1, 1, K, V)
o = gk.recurrent_step_(S, q, k, v, torch.zeros(1, 1, 1), torch.full((1, 1, 1), 0.5), scale=1.0, l2norm=False,
                       reference=False)
g = torch.Generator().manual_seed(0)
M, D = torch.randn(1, 2, 24, 24, generator=g), torch.randn(1, 2, 24, 40, generator=g)
joined = gk.join_(torch.zeros(1, 2, 24, 40), M, D, torch.zeros_like(D), reference=False)
out["layout"] = {"S_err": err(S[0, 0], 0.5 * k.view(K, 1) * v.view(1, V)), "o_err": err(o.view(V), 0.3 * v.view(V)),
                 "join_err": err(joined, torch.einsum("bhij,bhjv->bhiv", M, D)),
                 "join_wrong": err(joined[..., :24], torch.einsum("bhji,bhjv->bhiv", M, D[..., :24]))}
# strided inputs, as the engine passes them: q / k / v split from one conv output, a token slice of a batch
g = torch.Generator().manual_seed(1)
B, T, HK, HV, K, V = 2, 3, 2, 4, 24, 40
mixed = torch.randn(B, T + 1, 2 * HK * K + HV * V, generator=g)[:, 1:]  # token stride != row width
q, k, v = torch.split(mixed, [HK * K, HK * K, HV * V], dim=-1)
q, k, v = q.reshape(B, T, HK, K), k.reshape(B, T, HK, K), v.reshape(B, T, HV, V)
gate, beta = (-torch.rand(B, T + 1, HV, generator=g))[:, 1:], torch.rand(B, T + 1, HV, generator=g)[:, 1:]
assert not (q.is_contiguous() or v.is_contiguous() or gate.is_contiguous())
S = torch.randn(B, HV, K, V, generator=g)
S1, S2 = S.clone(), S.clone()
o1 = gk.recurrent_step_(S1, q, k, v, gate, beta, reference=False)
o2 = gk.recurrent_step_(S2, q.contiguous(), k.contiguous(), v.contiguous(), gate.contiguous(), beta.contiguous(),
                        reference=True)
M = torch.randn(B, HV, K, K, generator=g)
kn = l2norm(k)[:, 1:]  # a token slice of a batch of 2: not contiguous
M1 = gk.suffix_map_update_(M.clone(), kn, gate[:, 1:], beta[:, 1:], reference=False)
M2 = gk.suffix_map_update_(M.clone(), kn.contiguous(), gate[:, 1:].contiguous(), beta[:, 1:].contiguous(),
                           reference=True)
x, w = mixed[..., :50], torch.randn(50, 4, generator=g)
h = torch.randn(B, 3, 50, generator=g)
h1, h2 = h.clone(), h.clone()
y1 = gk.conv_update_(h1, x, w, reference=False)
y2 = gk.conv_update_(h2, x.contiguous(), w, reference=True)
out["strided"] = {"S_err": err(S1, S2), "o_err": err(o1, o2), "M_err": err(M1, M2), "y_err": err(y1, y2),
                  "history_equal": torch.equal(h1, h2)}

# the GDN benchmark's kernel calls (python -m raincheck_hf.bench gdn) against its reference calls
from raincheck_hf.bench.gdn import OPS, _max_diff
for op in OPS:
    shape = {"batch": 1, "heads_k": 1, "heads_v": 2, "dk": 16, "dv": 24, "kernel_size": 4}
    out[f"bench {op}"] = _max_diff(shape, torch.device("cpu"), torch.float32, op, "kernel")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    if not gk.triton_available():
        pytest.skip("needs Triton (its interpreter runs the kernels on CPU)")
    cases = {"map": MAP_SIZES, "join": JOIN_SIZES, "step": STEP_SIZES, "conv": CONV_SIZES, "chunked": CHUNKED_SIZES}
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rows(results, prefix):
    rows = {name: r for name, r in results.items() if name.startswith(prefix)}
    assert rows, prefix
    return rows


def test_suffix_map_kernel_matches_reference(interpreted):
    rows = _rows(interpreted, "map ")
    assert len(rows) == len(MAP_SIZES)
    for name, r in rows.items():
        assert r["err"] <= 1e-5 * max(1.0, r["scale"]), (name, r)
        assert r["padded_equal"] and r["pad_identity"], (name, r)  # padding tokens are exact identities


def _assert_within(rows, rel: float, err: str = "err", scale: str = "scale") -> None:
    """Every row's ``err`` within ``rel`` of its ``scale`` (at least 1)."""
    for name, r in rows.items():
        assert r[err] <= rel * max(1.0, r[scale]), (name, r)


def test_join_kernel_matches_reference(interpreted):
    rows = _rows(interpreted, "join ")
    assert len(rows) == len(JOIN_SIZES)
    _assert_within(rows, 1e-5)


def test_recurrent_step_kernel_matches_reference(interpreted):
    rows = _rows(interpreted, "step ")
    assert len(rows) == 3 * len(STEP_SIZES)
    for name, r in rows.items():
        assert r["err"] <= 1e-5 * max(1.0, r["scale"]), (name, r)
        o_tol = 1e-5 if "float32" in name else 1e-2  # bf16 output: one rounding of a value within 1e-5
        assert r["o_err"] <= o_tol * max(1.0, r["o_scale"]), (name, r)
        assert r["o_dtype"] == ("torch.bfloat16" if "bfloat16" in name else "torch.float32"), (name, r)
        assert r["pad_identity"], (name, r)


def test_masked_recurrent_step_matches_gated_off_padding(interpreted):
    # valid = n: tokens from n on run as padding (g = 0, beta = 0), exactly what masking g and beta does
    rows = _rows(interpreted, "masked step ")
    assert len(rows) == sum(T + 2 for _, T, *_ in STEP_SIZES)
    _assert_within(rows, 1e-5)
    _assert_within(rows, 1e-2, "o_err", "o_scale")  # bf16 outputs
    assert all(r["out_is_o"] for r in rows.values()), rows


def test_chunked_step_matches_the_token_by_token_rule(interpreted):
    rows = _rows(interpreted, "chunked ")
    assert len(rows) == sum(len({T, max(T - 3, 0), 1}) for _, T, *_ in CHUNKED_SIZES)
    _assert_within(rows, 2e-5)  # fp32, sums in another order
    _assert_within(rows, 1e-2, "o_err", "o_scale")  # bf16 outputs


def test_suffix_map_normalises_keys_inside(interpreted):
    rows = _rows(interpreted, "normed map ")
    assert len(rows) == len(MAP_SIZES)
    _assert_within(rows, 1e-5)


def test_conv_rolls_only_the_real_rows_in(interpreted):
    rows = _rows(interpreted, "masked conv ")
    assert len(rows) == sum(T + 2 for _, T, *_ in CONV_SIZES)
    for name, r in rows.items():
        tol = 2e-2 if "bfloat16" in name else 1e-5
        assert r["err"] <= tol * max(1.0, r["scale"]), (name, r)  # outputs: every row, as without the count
        assert r["history_equal"] and r["window_equal"], (name, r)  # copies: exact


def test_per_row_counts_equal_each_row_alone(interpreted):
    # valid / rows_in as [B] (one count per batch row, the batched captured step's form): each row equals its own
    # call with a scalar count; a row whose count is 0 keeps its state / history exactly
    steps = _rows(interpreted, "per-row step ")
    assert len(steps) == len(STEP_SIZES)
    _assert_within(steps, 2e-5)  # the chunked form: sums in another order
    _assert_within(steps, 2e-5, "o_err", "o_scale")
    assert all(r["zero_kept"] for r in steps.values()), steps
    convs = _rows(interpreted, "per-row conv ")
    assert len(convs) == len(CONV_SIZES)
    for name, r in convs.items():
        tol = 2e-2 if "bfloat16" in name else 1e-5
        assert r["err"] <= tol * max(1.0, r["scale"]), (name, r)
        assert r["history_equal"] and r["window_equal"], (name, r)


def test_conv_update_kernel_matches_reference(interpreted):
    rows = _rows(interpreted, "conv ")
    assert len(rows) == len(CONV_SIZES)
    for name, r in rows.items():
        tol = 2e-2 if "bfloat16" in name else 1e-5  # bf16 (eps 2^-7): the sum and the SiLU each rounded once
        assert r["err"] <= tol * max(1.0, r["scale"]), (name, r)
        assert r["history_equal"], (name, r)  # the roll is a copy: exact
        assert r["dtype"] == ("torch.bfloat16" if "bfloat16" in name else "torch.float32"), (name, r)


# ---- compiled for a Hopper GPU (no GPU needed: Triton's compiler and the ptxas it ships) -----------------

AOT_SCRIPT = r"""
import json, os, re, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from raincheck_hf.gdn import _triton as K, kernels as gk

ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = {}

def build(name, fn, types, const, warps):
    sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(const)))
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    path = os.path.join(sys.argv[1], name.replace(" ", "_") + ".ptx")
    with open(path, "w") as f:
        f.write(compiled.asm["ptx"])
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info.stderr)]
    out[name] = {"rc": info.returncode, "spill_stores": sum(spills), "ptxas": info.stderr[-400:]}

# the launches of gdn_kernels at the Qwen3.5-9B sizes (K = V = 128) and the tiny model's (K 8, V 16), bf16
# activations, fp32 state
f32, bf, i32, i64 = "*fp32", "*bf16", "i32", "*i64"
for dk, dv in ((128, 128), (8, 16)):
    tiles = {op: gk.launch_tiles(op, dk, dv) for op in ("suffix_map_update", "join", "conv_update")}
    tiles_map, warps_map = tiles["suffix_map_update"]
    build(f"suffix_map_update {dk}x{dv}", K.suffix_map_update, [f32, bf, f32, bf] + [i32] * 11,
          {"L2NORM": True, **tiles_map}, warps_map)
    build(f"join {dk}x{dv}", K.join, [f32] * 4 + [i32] * 2, *tiles["join"])
    for tokens in (1, 32):  # the masked form (a chunk's real-token count) is the larger one
        step, warps = gk.launch_tiles("recurrent_step", dk, dv, tokens)
        for per_row in (False, True):  # one count for the batch (the batch-1 fast path) / one per row (batched)
            build(f"recurrent_step {dk}x{dv} T={tokens} per_row={per_row}", K.recurrent_step,
                  [f32, f32, i64, bf, bf, bf, f32, bf, bf] + [i32] * 5 + ["fp32"] + [i32] * 13,
                  {"L2NORM": True, "HAS_VALID": tokens > 1 or per_row, "VALID_PER_ROW": per_row, **step}, warps)
    for tokens in (32, 64):  # a fused step's chunk (c = 31 padded to 32), the largest chunk it runs
        tiles_c, warps_c = gk.launch_tiles("chunked_step", dk, dv, tokens)
        for per_row in (False, True):  # the batch-1 fast path / the batched step's per-sequence counts
            build(f"chunked_step {dk}x{dv} T={tokens} per_row={per_row}", K.chunked_step,
                  [f32, f32, i64, bf, bf, bf, f32, bf, bf] + [i32] * 5 + ["fp32"] + [i32] * 13,
                  {"HAS_VALID": True, "VALID_PER_ROW": per_row, **tiles_c}, warps_c)
for within in (False, True):
    for per_row in (False, True):
        build(f"conv_update within={within} per_row={per_row}", K.conv_update, [bf] * 6 + [i64] + [i32] * 4,
              {"KC": 4, "HAS_BIAS": False, "SILU": True, "ROWS_IN": True, "ONLY_WITHIN": within,
               "ROWS_PER_ROW": per_row, **tiles["conv_update"][0]}, tiles["conv_update"][1])
print(json.dumps(out))
"""


def test_kernels_compile_for_hopper_without_register_spills(tmp_path):
    # the interpreter checks the arithmetic; this checks that the kernels, with the tiles gdn_kernels launches
    # them with, compile for sm_90 (as on an H100 / H200) and keep their tiles in registers
    if not gk.triton_available():
        pytest.skip("needs Triton")
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton ships no ptxas")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", AOT_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 24
    for name, r in results.items():
        assert r["rc"] == 0 and r["spill_stores"] == 0, (name, r)


# ---- the references (the CPU path) -----------------------------------------------------------------------

def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hk, hv", [(2, 2), (2, 4), (1, 4)])
def test_cpu_path_is_the_gated_delta_reference(hk, hv):
    B, T, K, V = 2, 3, 12, 20
    M, k = _rand(B, hv, K, K), l2norm(_rand(B, T, hk, K, seed=1))
    g, beta = -_rand(B, T, hv, seed=2).abs(), _rand(B, T, hv, seed=3).sigmoid()
    r = hv // hk
    got = gk.suffix_map_update_(M.clone(), k, g, beta)
    assert torch.equal(got, update_suffix_map(M, k.repeat_interleave(r, 2), g, beta))

    S, S_new, S_old = _rand(B, hv, K, V, seed=4), _rand(B, hv, K, V, seed=5), _rand(B, hv, K, V, seed=6)
    assert torch.equal(gk.join_(S.clone(), M, S_new, S_old), join_state(S, M, S_old, S_new))

    q, kr, v = _rand(B, T, hk, K, seed=7), _rand(B, T, hk, K, seed=8), _rand(B, T, hv, V, seed=9)
    S1 = S.clone()
    o = gk.recurrent_step_(S1, q, kr, v, g, beta)
    want_o, want_S = naive_recurrent_gated_delta(l2norm(q).repeat_interleave(r, 2), l2norm(kr).repeat_interleave(r, 2),
                                                 v, g, beta, S)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S1, want_S, rtol=1e-5, atol=1e-5)

    C, Kc = 30, 4
    h, x, w = _rand(B, Kc - 1, C, seed=10), _rand(B, T, C, seed=11), _rand(C, 1, Kc, seed=12)
    h1 = h.clone()
    y = gk.conv_update_(h1, x, w)
    assert torch.equal(y, causal_conv_with_history(x, h, w))
    assert torch.equal(h1, roll_conv_history(h, x))


def test_recurrent_reference_is_transformers_rule():
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    B, T, HK, HV, K, V = 1, 3, 2, 4, 16, 24
    q, k, v = _rand(B, T, HK, K), _rand(B, T, HK, K, seed=1), _rand(B, T, HV, V, seed=2)
    g, beta = -_rand(B, T, HV, seed=3).abs(), _rand(B, T, HV, seed=4).sigmoid()
    S = _rand(B, HV, K, V, seed=5)
    S1 = S.clone()
    o = gk.recurrent_step_reference(S1, q, k, v, g, beta)
    want_o, want_S = mod.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, want_o) and torch.equal(S1, want_S)


def test_state_layout_is_keys_first():
    # One token from a zero state: S = beta k v^T, so S[:, :, i, :] is proportional to v and S[:, :, :, j] to k,
    # and o = scale (q . k) beta v. Checked by hand, not against another implementation.
    K, V = 3, 5
    q = torch.tensor([1.0, 0.0, 0.0]).view(1, 1, 1, K)
    k = torch.tensor([0.6, 0.8, 0.0]).view(1, 1, 1, K)
    v = torch.arange(1.0, V + 1).view(1, 1, 1, V)
    S = torch.zeros(1, 1, K, V)
    o = gk.recurrent_step_(S, q, k, v, torch.zeros(1, 1, 1), torch.full((1, 1, 1), 0.5), scale=1.0, l2norm=False)
    torch.testing.assert_close(S[0, 0], 0.5 * k.view(K, 1) * v.view(1, V))
    torch.testing.assert_close(o.view(V), 0.5 * 0.6 * v.view(V))
    with pytest.raises(ValueError, match="transposed"):
        gk.join_(S, torch.eye(K).view(1, 1, K, K), S.transpose(-1, -2).contiguous(), S)


def test_state_layout_is_keys_first_in_kernels(interpreted):
    # the hand-made case of test_state_layout_is_keys_first through the kernels, and the join's M applied on the
    # left of a [K, V] difference (K != V, M not symmetric) written out as an einsum
    r = interpreted["layout"]
    assert r["S_err"] < 1e-6 and r["o_err"] < 1e-6, r
    assert r["join_err"] < 1e-5 and r["join_wrong"] > 1.0, r


def test_strided_inputs_read_in_place(interpreted):
    # the split of a projection and a token slice go in without a copy (last axis contiguous, strides passed)
    r = interpreted["strided"]
    assert r["S_err"] < 1e-5 and r["o_err"] < 1e-5 and r["M_err"] < 1e-5 and r["y_err"] < 1e-5, r
    assert r["history_equal"], r


def test_benchmark_kernel_calls_match_its_reference_calls(interpreted):
    rows = _rows(interpreted, "bench ")
    assert sorted(rows) == sorted(f"bench {op}" for op in ("suffix_map_update", "join", "recurrent_step",
                                                           "recurrent_step_chunk", "chunked_step", "conv_update"))
    assert all(err <= 1e-5 for err in rows.values()), rows


def test_kernels_catch_a_transposed_layout():
    # the tolerances above would catch a transposed reading: here is how far off one is
    B, HV, K, V = 1, 2, 24, 40
    S, M = _rand(B, HV, K, V), _rand(B, HV, K, K, seed=1)
    S_new, S_old = _rand(B, HV, K, V, seed=2), _rand(B, HV, K, V, seed=3)
    right = join_state(S, M, S_old, S_new)
    wrong = S + M.transpose(-1, -2) @ (S_new - S_old)  # M applied transposed
    assert (right - wrong).abs().max() > 1.0


def test_bad_inputs_are_value_errors():
    M, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="key heads"):
        gk.suffix_map_update_(M, k, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="beta"):
        gk.suffix_map_update_(M, torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 4), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="float32"):
        gk.suffix_map_update_(M.double(), torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                              reference=False)
    with pytest.raises(ValueError, match="reference"):
        gk.join_(torch.zeros(1, 4, 8, 8), M, M, M, reference="yes")
    with pytest.raises(ValueError, match="activation"):
        gk.conv_update_(torch.zeros(1, 3, 5), torch.zeros(1, 1, 5), torch.zeros(5, 4), activation="gelu")
    with pytest.raises(ValueError, match="history"):
        gk.conv_update_(torch.zeros(1, 2, 5), torch.zeros(1, 1, 5), torch.zeros(5, 4))
    with pytest.raises(ValueError, match="v must"):
        gk.recurrent_step_(torch.zeros(1, 2, 8, 6), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8),
                           torch.zeros(1, 1, 2, 5), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    if gk.triton_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            gk.join_(torch.zeros(1, 4, 8, 8), M, torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8), reference=False)


def test_fp64_stays_on_the_reference():
    # the state map of gated_delta runs in fp64 in some tests: auto dispatch keeps it on the reference
    M, k = torch.eye(6, dtype=torch.float64).expand(1, 2, 6, 6).clone(), l2norm(_rand(1, 2, 2, 6).double())
    g, beta = torch.full((1, 2, 2), -0.1, dtype=torch.float64), torch.full((1, 2, 2), 0.5, dtype=torch.float64)
    got = gk.suffix_map_update_(M.clone(), k, g, beta)
    assert got.dtype == torch.float64
    assert torch.equal(got, update_suffix_map(M, k, g, beta))
