"""Sequences leaving a batched engine together (`BatchEngine.remove_many`): the Gated DeltaNet states of all of them
exported from one gathered copy per tensor (`PackedGDNState.export_rows`) equal the per-sequence `export` (the
reference) exactly; the rows reset together (`PackedGDNStates.reset_rows`) equal `reset` one by one; and the engine's
caches, slots and remaining sequences after `remove_many` equal those after `remove` one by one."""

from __future__ import annotations

import pytest
import torch

from raincheck_hf.batched_gdn import PackedGDNState, PackedGDNStates
from raincheck_hf.cache_utils import DeferredDynamicCache
from raincheck_hf.gdn.algebra import GDNLayerParams
from raincheck_hf.gdn.eager import deferred_linear_layer
from raincheck_hf.tiny import tiny_qwen3_5_config

HK, HV, K, V, KC = 2, 4, 8, 16, 4
C = 2 * HK * K + HV * V
SLOTS = 6


def _params(gen):
    return GDNLayerParams(conv_weight=0.5 * torch.randn(C, 1, KC, generator=gen), A_log=torch.randn(HV, generator=gen),
                          dt_bias=torch.randn(HV, generator=gen), num_k_heads=HK, num_v_heads=HV, head_k_dim=K,
                          head_v_dim=V)


def _random_state(params, gen, dtype=torch.bfloat16):
    state = PackedGDNState(SLOTS, params, dtype, "cpu")
    for name in PackedGDNState._NAMES:
        t = getattr(state, name)
        noise = torch.randn(t.shape, generator=gen)
        t.copy_(torch.eye(K) + 0.1 * noise if name == "rest_map" else noise)
    # suffixes shorter than, equal to and longer than the conv window (Kc - 1 = 3), and none
    state.suffix_length = [0, 1, 2, 3, 7, 5]
    return state


def _layer(layer_idx: int):
    """An empty GDN cache layer of a tiny Qwen3.5 cache (layer 0 is a linear-attention layer there)."""
    cache = DeferredDynamicCache(config=tiny_qwen3_5_config().text_config)
    return deferred_linear_layer(cache, layer_idx)


def _gdn_record(layer) -> dict:
    smap = layer.suffix_map
    return {"conv": layer.conv_states[0], "state": layer.recurrent_states[0], "boundary_state": smap.boundary_state,
            "boundary_conv": smap.boundary_conv_history, "leading_state": smap.leading_state, "rest_map": smap.rest_map,
            "tail": smap._tail, "lead_qkv": smap.leading.mixed_qkv, "lead_a": smap.leading.a, "lead_b": smap.leading.b,
            "suffix": torch.tensor(smap.suffix_length)}


def test_export_rows_equals_export_of_each_row():
    gen = torch.Generator().manual_seed(31)
    params = _params(gen)
    state = _random_state(params, gen)
    rows = [4, 0, 2, 3, 1]  # (out of order; slot 5 stays)
    want = []
    for r in rows:
        layer = _layer(0)
        state.export(r, layer, params)
        want.append(_gdn_record(layer))
    layers = [_layer(0) for _ in rows]
    state.export_rows(rows, layers, params)
    for r, layer, w in zip(rows, layers, want):
        got = _gdn_record(layer)
        assert got.keys() == w.keys()
        for name in w:
            assert got[name].dtype == w[name].dtype and torch.equal(got[name], w[name]), (r, name)
    # each cache owns its row: an in-place update of one (as `suffix_map_update_` writes M_R) changes no other, and
    # nothing of the packed state
    before = [layer.suffix_map.rest_map.clone() for layer in layers]
    packed = state.rest_map.clone()
    layers[1].suffix_map.rest_map.mul_(2.0)
    layers[1].recurrent_states[0].zero_()
    assert all(torch.equal(layer.suffix_map.rest_map, b) for i, (layer, b) in enumerate(zip(layers, before)) if i != 1)
    assert torch.equal(state.rest_map, packed)
    assert torch.equal(layers[0].recurrent_states[0], want[0]["state"])


def test_reset_rows_equals_reset_of_each_row():
    gen = torch.Generator().manual_seed(7)
    params = _params(gen)
    one, many = PackedGDNStates(SLOTS), PackedGDNStates(SLOTS)
    for states in (one, many):
        g = torch.Generator().manual_seed(11)
        states.layers = {0: _random_state(params, g), 2: _random_state(params, g, torch.float32)}
    for r in (4, 1, 2):
        one.reset(r)
    many.reset_rows([4, 1, 2])
    for i in one.layers:
        a, b = one.layers[i], many.layers[i]
        assert a.suffix_length == b.suffix_length == [0, 0, 0, 3, 0, 5]
        for name in PackedGDNState._NAMES:
            assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)


def test_a_growth_that_runs_out_of_memory_leaves_the_states_whole_and_their_graphs_stale(monkeypatch):
    """`PackedGDNStates.grow` one layer at a time, each layer all or nothing: an allocation that fails in the second
    layer leaves the first grown, the second as it was (every tensor at its old rows, its records too), the batch at
    its old size and ``version`` bumped (captured steps held the first layer's old tensors). A retry grows the rest;
    every old row is kept and the new rows are fresh."""
    gen = torch.Generator().manual_seed(5)
    params = _params(gen)
    states = PackedGDNStates(SLOTS)
    states.layers = {0: _random_state(params, gen), 2: _random_state(params, gen, torch.float32)}
    before = {i: {name: getattr(s, name).clone() for name in PackedGDNState._NAMES} for i, s in states.layers.items()}
    before_lengths = {i: list(s.suffix_length) for i, s in states.layers.items()}
    version, real, calls = states.version, torch.cat, []

    def failing(tensors, *args, **kwargs):
        calls.append(1)
        if len(calls) == len(PackedGDNState._NAMES) + 2:  # in the second layer
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", failing)
    with pytest.raises(torch.OutOfMemoryError):
        states.grow(SLOTS + 3)
    monkeypatch.setattr(torch, "cat", real)
    assert states.version > version and states.batch == SLOTS
    assert states.layers[0].batch == SLOTS + 3 and states.layers[2].batch == SLOTS
    assert all(getattr(states.layers[2], name).shape[0] == SLOTS for name in PackedGDNState._NAMES)
    version = states.version
    states.grow(SLOTS + 3)
    assert states.version > version and states.batch == SLOTS + 3
    fresh = PackedGDNStates(3)
    fresh.layers = {0: _random_state(params, gen), 2: _random_state(params, gen, torch.float32)}
    for i, s in states.layers.items():
        assert s.batch == SLOTS + 3
        for r in range(SLOTS, SLOTS + 3):
            fresh.layers[i].reset(r - SLOTS)
        for name in PackedGDNState._NAMES:
            assert torch.equal(getattr(s, name)[:SLOTS], before[i][name]), (i, name)
            assert torch.equal(getattr(s, name)[SLOTS:], getattr(fresh.layers[i], name)[:3]), (i, name)
        assert s.suffix_length == before_lengths[i] + [0, 0, 0]


def test_a_growth_short_of_memory_asks_for_room_and_tries_again(monkeypatch):
    """`PackedGDNStates.on_short` (the batching loop's `_relieve_memory`, as `kv_pool.SlotKVPool.on_short`): a layer
    that finds no memory asks for the bytes the growth still needs (that layer's and the next's), then grows; every
    old row is kept. With no room made the error is raised, the batch as it was."""
    import weakref

    from raincheck_hf.kv_pool import growth_need

    gen = torch.Generator().manual_seed(6)
    params = _params(gen)
    asked, real = [], torch.cat

    class Room:
        made = True

        def relieve(self, nbytes):
            asked.append(nbytes)
            return self.made

    for made in (True, False):
        states = PackedGDNStates(SLOTS)
        states.layers = {0: _random_state(params, gen), 2: _random_state(params, gen, torch.float32)}
        before = {i: s.state.clone() for i, s in states.layers.items()}
        room, calls = Room(), []
        room.made = made
        states.on_short = weakref.WeakMethod(room.relieve)
        want = growth_need(s.grow_growth(SLOTS + 2) for s in states.layers.values())

        def failing(tensors, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:  # the first layer's first tensor, once
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
            return real(tensors, *args, **kwargs)

        asked.clear()
        monkeypatch.setattr(torch, "cat", failing)
        if made:
            states.grow(SLOTS + 2)
        else:
            with pytest.raises(torch.OutOfMemoryError):
                states.grow(SLOTS + 2)
        monkeypatch.setattr(torch, "cat", real)
        assert asked == [want] and want > 0
        assert states.batch == (SLOTS + 2 if made else SLOTS)
        for i, s in states.layers.items():
            assert s.batch == states.batch and torch.equal(s.state[:SLOTS], before[i])


def test_remove_many_equals_removing_one_by_one():
    """Two engines with the same three sequences stepped the same way (the batched engine's captured-step layout:
    `fast_path=True`, so sequences stay in the lowest slots): `remove_many` of the first two (not the last slot, so
    the one that stays moves down) gives the caches `remove` gives one by one, and leaves the engine as `remove`
    does (the remaining sequence's slot, the free slots and keys, every recurrent row); its next step is the same."""
    from raincheck_hf import RaincheckConfig
    from raincheck_hf.batch_engine import BatchEngine

    from conftest import make_inputs
    from families import family_model, family_processor
    from test_batched import BIG_IMAGE, TEXT, assert_cache_equal

    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    config = RaincheckConfig(chunk_size=3, decode_guard=1, fast_path=True)
    media = ("pixel_values", "image_grid_thw")
    rows = [BIG_IMAGE, TEXT, dict(BIG_IMAGE, text="What colour is it?")]
    engines = []
    for _ in range(2):
        engine = BatchEngine(model, config)
        seqs = []
        for row in rows:
            inputs = make_inputs(processor, **row)
            seqs.append(engine.add(inputs["input_ids"][0], **{k: v for k, v in inputs.items() if k in media}))
        for _ in range(4):
            logits = engine.step()
            for seq, value in logits.items():
                engine.feed(seq, int(value.argmax()))
        engines.append((engine, seqs))
    (one, seqs1), (many, seqs2) = engines
    assert [s.slot for s in seqs1] == [0, 1, 2] and all(s.prefilled for s in seqs1)
    want = [one.remove(seqs1[0]), one.remove(seqs1[1])]
    got = many.remove_many([seqs2[0], seqs2[1]])
    for g, w in zip(got, want):
        assert_cache_equal(g, w)
    assert seqs1[2].slot == seqs2[2].slot == 0
    assert one.pool._free == many.pool._free and torch.equal(one.pool.slot_keys, many.pool.slot_keys)
    assert one.pool.lengths == many.pool.lengths
    assert one.recurrent.layers.keys() == many.recurrent.layers.keys()
    for i in one.recurrent.layers:
        a, b = one.recurrent.layers[i], many.recurrent.layers[i]
        assert a.suffix_length == b.suffix_length
        for name in PackedGDNState._NAMES:
            assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)
    with pytest.raises(ValueError, match="not in this engine"):
        one.remove_many([seqs1[2], seqs1[0]])  # (one of them left already)
    with pytest.raises(ValueError, match="more than once"):
        many.remove_many([seqs2[2], seqs2[2]])
    assert seqs1[2].slot == seqs2[2].slot == 0  # (refused before anything was done)
    many.prepare()  # (its token was fed after the last step)
    prepared = many._ahead
    assert prepared is not None and many.remove_many([]) == [] and many._ahead is prepared  # nothing leaves: kept
    many.abandon()
    a, b = one.step(), many.step()
    assert torch.equal(a[seqs1[2]], b[seqs2[2]])


def test_restored_refuses_what_restore_suffix_refuses():
    """`SuffixStateMap.restored` checks what `reset_boundary` / `restore_suffix` check (shapes, the suffix's leading
    and tail rows) and takes fp32 states only (it does not convert them)."""
    from raincheck_hf.gdn.algebra import LeadingSegment
    from raincheck_hf.gdn.suffix_map import SuffixStateMap

    gen = torch.Generator().manual_seed(3)
    params = _params(gen)
    state = _random_state(params, gen)
    got = {name: getattr(state, name)[:1].clone() for name in PackedGDNState._NAMES}
    lead = LeadingSegment(got["leading_qkv"][:, :2], got["leading_a"][:, :2], got["leading_b"][:, :2])
    args = (got["boundary_state"], got["boundary_conv"], lead, got["leading_state"], got["rest_map"])
    smap = SuffixStateMap.restored(params, *args, 2, got["leading_qkv"][:, :2])
    assert smap.suffix_length == 2 and smap.rest_map is got["rest_map"]  # (taken, not copied)
    with pytest.raises(ValueError, match="keeps 2 leading and tail rows, got 2 and 1"):
        SuffixStateMap.restored(params, *args, 2, got["leading_qkv"][:, :1])
    with pytest.raises(ValueError, match="fp32 states, got rest_map in torch.float64"):
        SuffixStateMap.restored(params, *args[:4], got["rest_map"].double(), 2, got["leading_qkv"][:, :2])
    with pytest.raises(ValueError, match="boundary_conv"):
        SuffixStateMap.restored(params, args[0], got["boundary_conv"][:, :1], *args[2:], 2, got["leading_qkv"][:, :2])
