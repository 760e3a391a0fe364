"""`batched_gdn.PackedGDNState.static_step` (the captured batched decode step of one Gated DeltaNet layer) on its
`gdn.kernels` operations, on CPU.

The kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` is read when Triton compiles a kernel, and the
interpreter is not thread-safe: one subprocess runs every case, as tests/test_gdn_kernels.py does). Each case runs
the step on the same random states and inputs three ways: the kernel path (``reference=False``), the reference path
(``reference=True``, what ``reference=None`` runs on CPU) and the eager packed step (`PackedGDNState.step`, the
reference of the captured step) on the same sequences. B = 3 sequences at slots of a 5-slot state, among them a
padding sequence (``real = False``), chunks of different lengths (one past `gdn.dispatch.RECURRENT_CHUNK_MAX`),
sequences carrying nothing, restoring pieces (a chunk, no token), tokens recorded as leading tokens and into M_R;
fp32, the tiny Qwen3.5's head split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raincheck_hf.gdn import kernels as gk

SCRIPT = r"""
import json
from types import SimpleNamespace

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                           torch_recurrent_gated_delta_rule)

from raincheck_hf.batched_gdn import PackedGDNState, PackedRowLayout
from raincheck_hf.cache_utils import GENERATED
from raincheck_hf.gdn.algebra import GDNLayerParams

HK, HV, K, V, KC = 2, 4, 8, 16, 4
C = 2 * HK * K + HV * V
SLOTS = 5
gen = torch.Generator().manual_seed(2029)
params = GDNLayerParams(conv_weight=0.5 * torch.randn(C, 1, KC, generator=gen), A_log=torch.randn(HV, generator=gen),
                        dt_bias=torch.randn(HV, generator=gen), num_k_heads=HK, num_v_heads=HV, head_k_dim=K,
                        head_v_dim=V)


def random_state():
    state = PackedGDNState(SLOTS, params, torch.float32, "cpu")
    for name in PackedGDNState._NAMES:
        t = getattr(state, name)
        noise = torch.randn(t.shape, generator=gen)
        t.copy_(torch.eye(K) + 0.1 * noise if name == "rest_map" else noise)
    return state


def copy(state):
    return state.take(list(range(SLOTS)))


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


# (width W, chunks, record, per sequence: (slot, real, deferred, token, suffix, records)), records: None / "lead" /
# "map" (lead needs suffix < Kc - 1, map suffix >= Kc - 1)
CASES = {
    "chunks+records": (5, True, True, [(3, True, 4, True, 1, "lead"), (0, True, 2, True, 6, "map"),
                                       (4, False, 0, False, 0, None)]),
    "chunks, one carries nothing, a restoring piece": (4, True, False, [(1, True, 0, True, 2, None),
                                                                        (2, True, 3, False, 0, None),
                                                                        (4, False, 0, False, 0, None)]),
    "chunks, short suffixes, a token not recorded": (6, True, True, [(0, True, 5, True, 0, "lead"),
                                                                    (3, True, 1, True, 2, None),
                                                                    (2, False, 0, False, 0, None)]),
    # past RECURRENT_CHUNK_MAX rows the chunks take transformers' chunked rule, the rest stays on the kernels
    "a long chunk": (67, True, True, [(1, True, 66, True, 1, "lead"), (3, True, 10, True, 4, "map"),
                                     (0, False, 0, False, 0, None)]),
    "tokens recorded": (1, False, True, [(2, True, 0, True, 2, "lead"), (4, True, 0, True, 3, "map"),
                                         (0, False, 0, False, 0, None)]),
    "tokens": (1, False, False, [(1, True, 0, True, 0, None), (3, True, 0, True, 9, None),
                                 (0, False, 0, False, 0, None)]),
}

out = {}
for name, (width, chunks, record, seqs) in CASES.items():
    base = random_state()
    bsz = len(seqs)
    qkv = torch.randn(bsz, width, C, generator=gen)
    a, b = torch.randn(bsz, width, HV, generator=gen), torch.randn(bsz, width, HV, generator=gen)
    long = lambda i: torch.tensor([s[i] for s in seqs], dtype=torch.long)  # noqa: E731
    flag = lambda i: torch.tensor([bool(s[i]) for s in seqs])  # noqa: E731
    step = SimpleNamespace(slots=long(0), real=flag(1), deferred=long(2), token=flag(3), suffix=long(4),
                           lead=torch.tensor([s[5] == "lead" for s in seqs]),
                           record_map=torch.tensor([s[5] == "map" for s in seqs]))
    results = {}
    for path, reference in (("kernel", False), ("reference", True)):
        state = copy(base)
        core = state.static_step(qkv, a, b, step, params, torch_chunk_gated_delta_rule,
                                 torch_recurrent_gated_delta_rule, chunks, record, reference=reference)
        results[path] = (state, core)
    # the eager packed step on the same sequences (padding sequences: no rows)
    eager = base.take([s[0] for s in seqs])
    eager.suffix_length = [s[4] for s in seqs]
    layouts = [PackedRowLayout(s[2], int(s[3]), GENERATED if s[3] else None, s[5] is not None) if s[1]
               else PackedRowLayout(0, 0, None) for s in seqs]
    eager_core = eager.step(qkv, a, b, layouts, params, torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)
    (ks, kc), (rs, rc) = results["kernel"], results["reference"]
    # the sequences' own rows (a padding sequence's outputs, and rows past a sequence's own, are never read)
    own = torch.tensor([[s[1] and t < s[2] + s[3] for t in range(width)] for s in seqs])[..., None, None]
    row = {"core_err": err(kc, rc), "core_scale": rc.abs().max().item(),
           "eager_core_err": err(torch.where(own, rc, 0.0), torch.where(own, eager_core, 0.0))}
    for n in PackedGDNState._NAMES:
        got, want = getattr(ks, n), getattr(rs, n)
        row[n] = err(got, want)
        row[n + " scale"] = want.abs().max().item()
        row[n + " eager"] = err(want[step.slots], getattr(eager, n))
        # exactness: every slot the step does not touch, padding sequences' slots, and what a sequence without a
        # chunk / a token / a record keeps, equal to the state before, on both paths
        kept = [r for r in range(SLOTS) if r not in step.slots.tolist()]
        kept += [s[0] for s in seqs if not s[1]]
        if n in ("boundary_state", "boundary_conv"):
            kept += [s[0] for s in seqs if s[1] and not s[2]]
        if n in ("leading_qkv", "leading_a", "leading_b"):
            kept += [s[0] for s in seqs if s[1] and s[5] != "lead"]
        if n == "leading_state":
            kept += [s[0] for s in seqs if s[1] and not s[2] and s[5] != "lead"]
        if n == "rest_map":
            kept += [s[0] for s in seqs if s[1] and s[5] != "map"]
        if n == "state":
            kept += [s[0] for s in seqs if s[1] and not s[2] and not s[3]]
        if n == "conv":
            kept += [s[0] for s in seqs if s[1] and not s[3] and (not s[2] or s[4] >= KC - 1)]
        before = getattr(base, n)
        row[n + " kept"] = all(torch.equal(getattr(st, n)[r], before[r]) for st in (ks, rs) for r in kept)
    # a dense step (batch row b is slot b): the same sequences moved to slots 0 .. B - 1, the step on views of those
    # rows updated in place, against the same step on copies written back: equal to the bit, on both paths
    order = [s[0] for s in seqs] + [r for r in range(SLOTS) if r not in [s[0] for s in seqs]]
    moved = base.take(order)
    dense_step = SimpleNamespace(**{**vars(step), "slots": torch.arange(bsz)})
    worst = 0.0
    for reference in (False, True):
        runs = []
        for dense in (False, True):
            state = copy(moved)
            core = state.static_step(qkv, a, b, dense_step, params, torch_chunk_gated_delta_rule,
                                     torch_recurrent_gated_delta_rule, chunks, record, dense=dense,
                                     reference=reference)
            runs.append((state, core))
        (gs, gc), (ds, dc) = runs
        worst = max([worst, err(gc, dc)] + [err(getattr(gs, n), getattr(ds, n)) for n in PackedGDNState._NAMES])
    row["dense_err"] = worst
    out[name] = row
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    if not gk.triton_available():
        pytest.skip("needs Triton (its interpreter runs the kernels on CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


NAMES = ("state", "conv", "boundary_state", "boundary_conv", "leading_state", "leading_qkv", "leading_a", "leading_b",
         "rest_map")


def test_kernel_path_equals_the_reference_path(interpreted):
    assert len(interpreted) == 6
    for case, row in interpreted.items():
        assert row["core_err"] <= 1e-5 * max(1.0, row["core_scale"]), (case, row)
        for n in NAMES:
            assert row[n] <= 1e-5 * max(1.0, row[n + " scale"]), (case, n, row)


def test_a_dense_step_on_views_equals_the_gathered_step_to_the_bit(interpreted):
    """``dense=True`` (batch row b is slot b: the states' rows updated in place through views, `take_rows` /
    `put_rows`) gives exactly the gathered step's states and outputs, on the kernel and the reference paths."""
    for case, row in interpreted.items():
        assert row["dense_err"] == 0.0, (case, row["dense_err"])


def test_rows_without_a_chunk_token_or_record_keep_their_states_exactly(interpreted):
    for case, row in interpreted.items():
        for n in NAMES:
            assert row[n + " kept"], (case, n)


def test_reference_path_equals_the_eager_packed_step(interpreted):
    # the eager step runs transformers' chunked rule on the chunks, the captured step the rule token by token
    for case, row in interpreted.items():
        assert row["eager_core_err"] <= 1e-4, (case, row)
        for n in NAMES:
            assert row[n + " eager"] <= 1e-4 * max(1.0, row[n + " scale"]), (case, n, row)
