"""`fast.batched_graphs` on the Gated DeltaNet families (Qwen3.5, Qwen3.5-MoE), on CPU: decode steps (tokens, chunks,
restoring pieces) on static buffers, each sequence's recurrent states read and written at its slot's row of the
per-slot states through the step's device indices (`batched_gdn.PackedGDNState.static_step`).

Without CUDA a "captured" step is the same callable run eagerly on its static buffers; the fixture `replay_log`
(tests/test_batched_graphs.py) records every replay and overwrites every input buffer with garbage after each one
(the GDN ones too: `RecurrentStepBuffers`), so a step that read anything its fill did not rewrite would differ.
References: the eager engine (``graphs=False``) and each sequence run alone through batch-1 ``generate``; tokens
identical, logits within 1e-4 (fp32).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from raincheck_hf import RaincheckConfig
from raincheck_hf.batch_engine import BatchEngine
from raincheck_hf.batched_gdn import PackedGDNState
from raincheck_hf.fast import batched_graphs

from conftest import assert_same_output
from families import family_model, family_params, family_processor
from test_batch_engine import Request, draw_case, drive
from test_batched import (IMAGE, TEXT, TWO_IMAGES, VIDEO, assert_cache_equal, assert_rows_match_alone,
                          assert_trace_equal, batched_inputs, run)
from test_batched_graphs import _decode_forwards, replay_log, run_restoring_fuzz  # noqa: F401 (the fixture)

TOL = 1e-4
GDN_FAMILIES = ("qwen3_5", "qwen3_5_moe")


def _with(cfg: RaincheckConfig, fast_path) -> RaincheckConfig:
    return dataclasses.replace(cfg, fast_path=fast_path)


# (family, mode, chunk size): both families, `full` and raincheck-family modes, chunk sizes across 1 .. 15
CASES = [("qwen3_5", "full", 1), ("qwen3_5", "raincheck", 1), ("qwen3_5", "raincheck", 15),
         ("qwen3_5", "post_answer", 2), ("qwen3_5_moe", "full", 15), ("qwen3_5_moe", "raincheck", 4),
         ("qwen3_5_moe", "post_answer", 7)]


@pytest.mark.parametrize("name,mode,chunk", [pytest.param(*c, id="-".join(map(str, c))) for c in CASES])
def test_generate_batch_replays_decode_steps_and_equals_eager_and_alone(name, mode, chunk, replay_log):
    """``generate`` with B = 3 (two images, text; batch bucket 4: one padding sequence), ``fast_path=True``: the
    decode steps (tokens, and ``[chunk, token]`` in raincheck) replay the static-buffer step; the answer equals the
    eager engine's (tokens identical, logits within 1e-4, traces, caches with their GDN states exported from the
    per-slot rows), which equals each row's own batch-1 call."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(mode=mode, retention=0.8, chunk_size=chunk, decode_guard=1)
    rows = [TWO_IMAGES, IMAGE, TEXT]
    want = assert_rows_match_alone(model, processor, rows, _with(cfg, False), n=12)  # the eager engine = each alone
    got = run(model, batched_inputs(processor, rows), _with(cfg, True), 12)
    assert_same_output(got, want, TOL, "step")
    for i in range(len(rows)):
        assert_trace_equal(got.raincheck[i], want.raincheck[i])
        assert_cache_equal(got.cache[i], want.cache[i])
    assert replay_log and any(key.batch == 4 for key in replay_log)
    if mode == "raincheck":  # chunks ride with the tokens in replayed steps
        assert any(key.chunks and key.width > 1 for key in replay_log)
    if mode == "post_answer":  # the answer's tokens are recorded (lead, then M_R) while every deferred row waits
        assert any(key.records for key in replay_log)
    if mode == "full":
        assert not any(key.records for key in replay_log)


@pytest.mark.parametrize("views", [True, False], ids=["views", "gather"])
@pytest.mark.parametrize("seed", range(6))
def test_fuzz_gdn_captured_steps_match_alone(seed, views, replay_log, monkeypatch):
    """Random join schedules, prompts, modes, chunk sizes, budgets and held conversations on the GDN families,
    through an engine with the static-buffer steps (dense views of the lowest slots, or gathered slots with the
    bucket's padding in the scratch slot): each sequence equals its own eager batch-1 call (tokens, logits 1e-4,
    cache with its GDN states, trace); every step the captured steps accept was a replay (decode steps, and prompt
    pieces of input rows alone in prefill steps: `PackedGDNState.static_prefill`), the others ran eagerly; the pool
    ends empty."""
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    rng = random.Random(7700 + seed)
    name = GDN_FAMILIES[seed % 2]
    model, processor = family_model(name), family_processor(name)
    cfg, requests, budget = draw_case(rng, model, processor, longest=8, most=5)
    engine = BatchEngine(model, _with(cfg, None), token_budget=budget, num_slots=1, capacity=16, graphs=True)
    counts = _decode_forwards(engine)
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"{name} seed {seed} sequence {i}")
    assert counts["decode"] > 0 and len(replay_log) == counts["taken"] == engine.graphs.replays
    assert counts["taken"] - counts["decode"] == sum(key.prefill for key in replay_log) > 0  # (no prompt rides)
    # (with views, a decode forward beside a prompt piece whose sequence holds a lower slot gathers its slots)
    assert any(key.dense for key in replay_log) == views and (views or not any(key.dense for key in replay_log))
    assert engine.sequences == [] and len(engine.pool._free) == engine.pool.num_slots
    for state in engine.recurrent.layers.values():  # every row fresh again (the scratch slot's too: padding
        for name in PackedGDNState._NAMES:           # sequences leave their rows unchanged)
            t = getattr(state, name)
            want = torch.eye(t.shape[-1]).expand_as(t) if name == "rest_map" else torch.zeros_like(t)
            assert torch.equal(t, want.to(t.dtype)), name
        assert state.suffix_length == [0] * state.batch


def test_records_replay_with_every_suffix_length(replay_log):
    """``post_answer`` (every generated token recorded while the deferred rows wait): three sequences of different
    prompt lengths and answer lengths decode together, their tokens recorded as leading tokens (suffix 0 .. Kc - 2)
    then into M_R, in the same captured steps (some sequences leading while others map: the per-row masks); after the
    answer each one's restored follow-up (its exported boundary record) equals its own call's."""
    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    cfg = RaincheckConfig(mode="post_answer", retention=0.2, chunk_size=3, decode_guard=0, fast_path=False)
    late = Request(model, processor, cfg, VIDEO, n=7, arrive=2)  # joins two steps later: suffix lengths differ
    requests = [Request(model, processor, cfg, IMAGE, n=9, arrive=0),
                Request(model, processor, cfg, TWO_IMAGES, n=4, arrive=0), late]
    engine = BatchEngine(model, _with(cfg, None), num_slots=2, graphs=True)
    seen = []
    fill = engine.graphs._fill_recurrent

    def watched(buffers, entries, recorded, rows, layout=None):
        fill(buffers, entries, recorded, rows, layout)
        seen.append((buffers.lead.tolist(), buffers.record_map.tolist()))

    engine.graphs._fill_recurrent = watched
    drive(model, engine, requests)
    for i, r in enumerate(requests):
        r.check(f"sequence {i}")
    assert any(key.records for key in replay_log)
    assert any(any(lead) and any(into) for lead, into in seen)  # one step: a leading record and an M_R update


def test_replays_after_sequences_leave_and_join_read_no_stale_state(replay_log):
    """Three sequences decode; the one in slot 0 leaves first (the sequence in the highest slot moves into its hole,
    its GDN states with it), garbage is written over the GDN rows of every slot no sequence holds (free slots, the
    scratch slot: where the bucket's padding sequences read), and a new sequence joins into a freed slot; the same
    captured keys replay across the change: each sequence equals its own call."""
    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    cfg = RaincheckConfig(mode="full", fast_path=False)
    first = [Request(model, processor, cfg, row, n=n, arrive=0) for row, n in ((TEXT, 3), (IMAGE, 10),
                                                                                (TWO_IMAGES, 10))]
    late = Request(model, processor, cfg, VIDEO, n=6, arrive=5)
    engine = BatchEngine(model, _with(cfg, None), num_slots=4, graphs=True)
    remove = engine.remove
    gen = torch.Generator().manual_seed(3)
    soiled = []

    def remove_and_soil(seq):
        cache = remove(seq)
        held = {s.slot for s in engine.sequences}
        for state in engine.recurrent.layers.values():
            for row in range(state.batch):
                if row not in held:
                    for name in PackedGDNState._NAMES:
                        t = getattr(state, name)
                        t[row] = 1e3 * torch.randn(t[row].shape, generator=gen)
                    soiled.append(row)
        return cache

    engine.remove = remove_and_soil
    drive(model, engine, first + [late])
    for i, r in enumerate(first + [late]):
        r.check(f"sequence {i}")
    assert soiled
    fours = [i for i, key in enumerate(replay_log) if key.batch == 4]
    twos = [i for i, key in enumerate(replay_log) if key.batch == 2]
    assert fours and twos and fours[0] < twos[0] < fours[-1]  # 3 sequences, then 2, then 3 again with the late one


def test_every_decode_step_replays_chunks_included(replay_log):
    """On the GDN families every step without a prompt piece replays, those carrying a deferred chunk too (chunks of
    different lengths in one step: the rows after each sequence's own chunk gated off, its token gathered from its
    own row): the eager runner runs prompt pieces only, and the answer equals the eager engine's."""
    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    cfg = RaincheckConfig(retention=0.3, chunk_size=5, decode_guard=0, batch_chunk_rows=None)
    inputs = batched_inputs(processor, [TWO_IMAGES, IMAGE, VIDEO])
    want = run(model, inputs, _with(cfg, False), 10)
    engines = []
    init = BatchEngine.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)
        self.kept_graphs = self.graphs  # (`close` drops it)
        self.eager_decode = 0
        runner_run = self.runner.run

        def counted(entries):  # the decode-only forwards the eager runner ran: none
            self.eager_decode += batched_graphs.decode_only(entries)
            return runner_run(entries)

        self.runner.run = counted

    BatchEngine.__init__ = kept
    try:
        got = run(model, inputs, _with(cfg, True), 10)
    finally:
        BatchEngine.__init__ = init
    assert_same_output(got, want, TOL, "step")
    (engine,) = engines
    assert engine.eager_decode == 0 and engine.kept_graphs.replays == len(replay_log) > 0
    assert any(key.chunks and key.width == 6 for key in replay_log)
    assert any(t.restored_during_decode for t in got.raincheck)


@pytest.mark.parametrize("views", [True, False], ids=["views", "gather"])
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_restoring_sequences_ride_in_replayed_gdn_steps(seed, views, replay_log, monkeypatch):
    """Held conversations restore from step 0 beside random answers (`draw_restoring_case`) on the GDN families:
    restoring pieces (deferred rows only, no token: their boundary moves, their live state joins) ride in replayed
    steps; every forward without a prompt piece was a replay; each answer equals its own eager batch-1 call, and each
    restored cache (its GDN states exported from the per-slot rows) equals idle-time restoration of its held cache."""
    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "views", views)
    run_restoring_fuzz(GDN_FAMILIES[seed % 2], 7800 + seed, seed, replay_log)


@pytest.mark.parametrize("name", family_params(GDN_FAMILIES))
def test_settings(name, replay_log):
    """The GDN families take the static-buffer steps with ``graphs=True`` (on CPU: eagerly on the buffers), keep the
    eager engine with ``graphs=None`` on CPU, and the engine's recurrent states are the captured steps' own."""
    model = family_model(name)
    assert BatchEngine(model, RaincheckConfig()).graphs is None
    engine = BatchEngine(model, RaincheckConfig(), graphs=True)
    assert engine.graphs is not None and engine.recurrent is engine.graphs.recurrent
    assert batched_graphs.batched_graph_blocker(engine.adapter) is None


@pytest.mark.parametrize("mode", ["raincheck", "post_answer"])
def test_after_a_failed_capture_steps_run_eagerly_with_their_chunks_and_records(mode, monkeypatch):
    """A capture that fails on CUDA (here: made to fail, the buffers on the CPU) turns the engine's decode steps
    eager on the same buffers for the rest of its life; those steps still carry their deferred chunks
    (``raincheck``) and record their generated rows (``post_answer``): the answer equals the eager engine's."""
    def failing(self, key, buffers):
        self.use_cuda = True  # (as on CUDA: a failed capture warns and falls back instead of raising)
        raise RuntimeError("capture failed")

    monkeypatch.setattr(batched_graphs.BatchedStepGraphs, "_capture", failing)
    batched_graphs.release_all()
    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    cfg = RaincheckConfig(mode=mode, retention=0.8, chunk_size=3, decode_guard=1)
    rows = [TWO_IMAGES, IMAGE]
    want = run(model, batched_inputs(processor, rows), _with(cfg, False), 10)
    with pytest.warns(RuntimeWarning) as caught:  # (the prompts' step fails first, then a decode step's)
        got = run(model, batched_inputs(processor, rows), _with(cfg, True), 10)
    said = [str(w.message) for w in caught]
    assert any("capture of the prompt step" in m for m in said) and any("capture of the decode step" in m for m in said)
    batched_graphs.release_all()
    assert_same_output(got, want, TOL, "step")
    for i in range(len(rows)):
        assert_trace_equal(got.raincheck[i], want.raincheck[i])
        assert_cache_equal(got.cache[i], want.cache[i])


@pytest.mark.parametrize("chunks", [False, True], ids=["inputs", "leftovers"])
@pytest.mark.parametrize("seed", range(3))
def test_static_prefill_equals_the_eager_packed_step(seed, chunks):
    """`PackedGDNState.static_prefill` (a prompt piece in a captured step, its counts on the device) against the eager
    packed step (`PackedGDNState.step` with the same layout, the reference) on random states, records and inputs:
    sequences at slots of a 5-slot state in one step of width 96 and a padding sequence. ``inputs``: pieces of 96,
    70 and 1 input rows (the chunked rule, padding gated off after the real rows). ``leftovers`` (the key's
    ``chunks``): a continued conversation's leftover deferred rows in front: 30 deferred + 50 input rows, 3 + 1, 20
    deferred rows only (suffix lengths below and past the leading segment), and 60 input rows without any. Each
    sequence's core outputs on its own rows, its live state and conv window, its boundary (moved after the input rows,
    or after the deferred rows of a piece without input rows), S_L and M_R within 1e-5 (fp32); the padding sequence's
    slot (and an untouched one) exactly as before."""
    from types import SimpleNamespace

    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                               torch_recurrent_gated_delta_rule)

    from raincheck_hf.batched_gdn import PackedRowLayout
    from raincheck_hf.cache_utils import INPUT
    from raincheck_hf.gdn.algebra import GDNLayerParams

    hk, hv, k, v, kc, slots, width = 2, 4, 8, 16, 4, 5, 96
    c = 2 * hk * k + hv * v
    gen = torch.Generator().manual_seed(4100 + seed)
    params = GDNLayerParams(conv_weight=0.5 * torch.randn(c, 1, kc, generator=gen),
                            A_log=torch.randn(hv, generator=gen), dt_bias=torch.randn(hv, generator=gen),
                            num_k_heads=hk, num_v_heads=hv, head_k_dim=k, head_v_dim=v)
    base = PackedGDNState(slots, params, torch.float32, "cpu")
    for name in PackedGDNState._NAMES:
        t = getattr(base, name)
        noise = torch.randn(t.shape, generator=gen)
        t.copy_(torch.eye(k) + 0.1 * noise if name == "rest_map" else noise)
    base.suffix_length = [1, 0, 5, 2, 7]
    pieces = ([(3, 30, 50), (0, 3, 1), (4, 20, 0), (2, 0, 60)] if chunks  # (slot, deferred rows, input rows)
              else [(3, 0, 96), (0, 0, 70), (4, 0, 1)])
    seqs = random.Random(seed).sample(pieces, len(pieces)) + [(1, 0, 0)]  # no rows: a padding sequence
    qkv = torch.randn(len(seqs), width, c, generator=gen)
    a, b = torch.randn(len(seqs), width, hv, generator=gen), torch.randn(len(seqs), width, hv, generator=gen)
    column = lambda i: torch.tensor([s[i] for s in seqs])  # noqa: E731
    step = SimpleNamespace(slots=column(0), real=column(1) + column(2) > 0, deferred=column(1), inputs=column(2),
                           suffix=torch.tensor([base.suffix_length[s[0]] for s in seqs]))
    state = base.take(list(range(slots)))
    core = state.static_prefill(qkv, a, b, step, params, torch_chunk_gated_delta_rule,
                                torch_recurrent_gated_delta_rule, chunks)
    assert core.shape == (len(seqs), width, hv, v)
    for i, (slot, d, n) in enumerate(seqs):
        if d + n == 0:
            continue
        eager = base.take([slot])
        layout = PackedRowLayout(d, n, INPUT if n else None)
        want = eager.step(qkv[i:i + 1, :d + n], a[i:i + 1, :d + n], b[i:i + 1, :d + n], [layout], params,
                          torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)
        assert (core[i, :d + n] - want[0]).abs().max() <= 1e-5, (slot, d, n)
        for name in PackedGDNState._NAMES:
            got, expected = getattr(state, name)[slot], getattr(eager, name)[0]
            assert (got - expected).abs().max() <= 1e-5, (slot, d, n, name)
        # (the host's suffix length: 0 after input rows, as `PackedGDNStates.reset_suffix` makes it after the step)
        assert eager.suffix_length == [0 if n else base.suffix_length[slot]]
    untouched = [slot for slot in range(slots) if slot not in {p[0] for p in pieces}]  # (padding, or not in it)
    assert 1 in untouched
    for slot in untouched:
        for name in PackedGDNState._NAMES:
            assert torch.equal(getattr(state, name)[slot], getattr(base, name)[slot]), (slot, name)


def test_a_follow_up_with_leftover_deferred_rows_runs_in_a_prefill_step(replay_log):
    """A held Qwen3.5 conversation (its first answer 2 tokens long: most of its image's deferred rows still pending)
    asks a follow-up while another answer decodes: the follow-up's prompt, ``[leftover deferred rows, its text]``,
    replays a prefill step that carries those rows (``chunks``: they run from the boundary and join, then the text
    from the joined live state, `PackedGDNState.static_prefill`), nothing runs on the eager forward, and both answers
    equal their own eager batch-1 calls (the follow-up from its held cache)."""
    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1, fast_path=False)
    answer = Request(model, processor, cfg, IMAGE, n=8, arrive=0)
    follow = Request(model, processor, cfg, TWO_IMAGES, n=4, arrive=2, follow_up=True)
    assert int(follow.held.pending_sources.numel()) > 0  # (leftover deferred rows: the case this test is about)
    engine = BatchEngine(model, _with(cfg, None), num_slots=2, graphs=True)
    engine.runner.run = lambda entries: pytest.fail("a forward ran eagerly")  # noqa: ARG005
    drive(model, engine, [answer, follow])
    answer.check("answer")
    follow.check("follow-up with leftover deferred rows")
    assert any(key.prefill and key.chunks for key in replay_log)
    engine.close()
