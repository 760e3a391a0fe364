"""``chunk_size="auto"``: the policy as a pure function of injected costs, and end to end on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from raincheck_hf import Conversation, RaincheckConfig, restore_pending
from raincheck_hf import generation
from raincheck_hf.cache_utils import GENERATED
from raincheck_hf.configuration import CHUNK_LADDER
from raincheck_hf.generation import StepCosts, auto_chunk_size, chunk_extras
from raincheck_hf.tiny import draw_test_image

from conftest import INPUT_CASES, make_inputs
from test_generation import assert_matches_reference, greedy, record

MS = 1e-3
# shaped like the fused steps measured on the 8B model: a larger chunk costs more, but less per row
COSTS = StepCosts(10 * MS, {7: 11.0 * MS, 15: 11.6 * MS, 31: 12.9 * MS, 63: 15.5 * MS})


def simulate(costs, slack, pending, steps, guard=0, policy=None):
    """Run a policy over ``steps`` decode steps; the chosen sizes (index 0 = forward 1) and rows restored."""
    policy = policy or (lambda p, i, spent: auto_chunk_size(costs, slack, p, i, spent))
    chosen, spent, restored = [], 0.0, 0
    for i in range(1, steps + 1):
        c = policy(pending - restored, i, spent) if i >= max(guard, 1) and restored < pending else 0
        if c:
            spent += costs.chunk[c] - costs.decode
            restored += min(c, pending - restored)
        chosen.append(c)
    return chosen, restored


def finish_step(chosen):
    return max((i + 1 for i, c in enumerate(chosen) if c), default=0)


def test_policy_keeps_every_prefix_within_the_slack_and_restores_everything():
    chosen, restored = simulate(COSTS, 0.02, 941, 512, guard=16)
    assert restored == 941
    assert set(chosen) <= {0, *CHUNK_LADDER}
    total = 0.0
    for i, c in enumerate(chosen, start=1):
        total += COSTS.chunk[c] if c else COSTS.decode
        assert total <= (1.02 * COSTS.decode) * i + 1e-12, f"mean TPOT over the first {i} steps exceeds the slack"
    assert not any(chosen[:15])  # the guard


@pytest.mark.parametrize("slack", [0.005, 0.02, 0.05, 0.2])
def test_policy_finishes_no_later_than_any_fixed_size_or_the_largest_affordable(slack):
    pending, steps = 941, 4000
    ours = finish_step(simulate(COSTS, slack, pending, steps)[0])

    def whenever_affordable(sizes):
        def policy(p, i, spent):
            for c in sorted(sizes, reverse=True):  # the largest affordable one
                if COSTS.chunk[c] - COSTS.decode <= slack * COSTS.decode * i - spent + 1e-12:
                    return c
            return 0
        return policy

    for sizes in [(c,) for c in CHUNK_LADDER] + [CHUNK_LADDER]:
        chosen, restored = simulate(COSTS, slack, pending, steps, policy=whenever_affordable(sizes))
        assert restored == pending
        assert ours <= finish_step(chosen), sizes


def test_policy_edges():
    assert auto_chunk_size(COSTS, 0.02, 0, 100, 0.0) == 0  # nothing pending
    assert auto_chunk_size(None, 0.02, 50, 1, 0.0) == min(CHUNK_LADDER)  # not measured: the fallback
    assert auto_chunk_size(StepCosts(COSTS.decode, {7: None}), 0.02, 50, 1, 0.0) == min(CHUNK_LADDER)
    # a lot of slack: the largest size every step, then the smallest that holds the rest
    chosen, restored = simulate(COSTS, 10.0, 200, 10)
    assert chosen[:4] == [63, 63, 63, 15] and restored == 200
    # no slack: only chunks that cost nothing extra run
    assert auto_chunk_size(COSTS, 0.0, 100, 50, 0.0) == 0
    free = StepCosts(COSTS.decode, {7: COSTS.decode, 63: COSTS.decode})
    assert auto_chunk_size(free, 0.0, 100, 1, 0.0) == 63
    # a size not measured takes an upper bound from the measured ones; spent slack is taken off
    partial = StepCosts(COSTS.decode, {15: COSTS.chunk[15], 63: None})
    extras = chunk_extras(partial)
    assert extras[15] == pytest.approx(1.6 * MS) and extras[7] == pytest.approx(1.6 * MS)  # a larger size's
    assert extras[63] == pytest.approx(1.6 * MS * 63 / 15) and extras[31] == pytest.approx(1.6 * MS * 31 / 15)
    assert auto_chunk_size(partial, 1.0, 100, 1, 0.0) == 63
    assert auto_chunk_size(partial, 1.0, 100, 1, 10 * MS) == 0
    # a short remainder is better served by a small size
    assert auto_chunk_size(COSTS, 0.02, 5, 500, 0.0) == 7


@pytest.mark.parametrize("fast_path", [False, True])
def test_auto_without_timings_is_the_smallest_ladder_size(model, processor, fast_path):
    """No measured costs (CPU): every step after the guard carries the smallest ladder size, so the answer is
    token for token that of the fixed size, and matches the reference."""
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    kw = dict(n=14, return_dict_in_generate=True, output_logits=True)
    auto = greedy(model, inputs, raincheck=RaincheckConfig(chunk_size="auto", decode_guard=2, fast_path=fast_path),
                  **kw)
    fixed = greedy(model, inputs, raincheck=RaincheckConfig(chunk_size=min(CHUNK_LADDER), decode_guard=2,
                                                            fast_path=fast_path), **kw)
    assert torch.equal(auto.sequences, fixed.sequences)
    for a, b in zip(auto.logits, fixed.logits):
        assert (a - b).abs().max() <= 1e-6
    assert [r.tolist() for r in auto.raincheck.restored_per_forward] == [
        r.tolist() for r in fixed.raincheck.restored_per_forward]
    sizes = auto.raincheck.chunk_size_per_forward
    assert sizes == fixed.raincheck.chunk_size_per_forward
    assert len(sizes) == len(auto.raincheck.restored_per_forward)
    assert sizes[0] == 0 and {s for s in sizes[1:2]} == {0} and min(CHUNK_LADDER) in sizes
    assert_matches_reference(model, [record(inputs, auto)])


def _kept_rows(cache):
    """Keys and KV of the input and deferred rows, in key order (generated rows depend on what they saw)."""
    keep = cache.row_kinds != GENERATED
    order = torch.argsort(cache.row_keys[keep.to(cache.row_keys.device)])
    rows = keep.nonzero().flatten()[order.cpu()]
    return cache.row_keys[rows.to(cache.row_keys.device)], [
        (layer.keys[:, :, rows], layer.values[:, :, rows]) for layer in cache.layers]


@pytest.mark.parametrize("mode", ["raincheck", "serial"])
def test_auto_with_injected_costs(model, processor, monkeypatch, mode):
    """Costs injected into the scheduler: the trace holds the sizes the policy picks, every step matches the
    reference, everything comes back, and the completed cache's input and deferred rows are those of a fixed size."""
    costs = StepCosts(10 * MS, {7: 10.4 * MS, 15: 10.5 * MS, 31: 12.0 * MS, 63: 14.0 * MS})
    monkeypatch.setattr(generation.ChunkScheduler, "step_costs", lambda self, adapter, cache: costs)
    inputs = make_inputs(processor, images=[draw_test_image(256, 256, seed=s) for s in (4, 5, 6)], text="Describe it.")
    cfg = RaincheckConfig(chunk_size="auto", decode_guard=2, tpot_slack=0.1, retention=0.2, mode=mode)
    out = greedy(model, inputs, n=20, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    trace = out.raincheck
    sizes = trace.chunk_size_per_forward
    deferred = trace.deferred.numel()
    assert deferred > 63
    want, _ = simulate(costs, 0.1, deferred, len(sizes) - 1, guard=2)
    assert sizes[1:] == want
    assert len(set(sizes) - {0}) >= 2  # the injected costs make it switch sizes
    for size, restored in zip(sizes, trace.restored_per_forward):
        assert restored.numel() <= size
    assert_matches_reference(model, [record(inputs, out)])
    restore_pending(model, out.cache, max_tokens=cfg.idle_chunk_size)
    restored = torch.cat(trace.restored_per_forward + [out.raincheck.pending])
    assert torch.equal(torch.sort(restored).values, trace.deferred)
    while out.cache.num_pending:
        restore_pending(model, out.cache, max_tokens=cfg.idle_chunk_size)
    fixed = greedy(model, inputs, n=20, raincheck=RaincheckConfig(chunk_size=31, decode_guard=2, retention=0.2),
                   return_dict_in_generate=True).cache
    restore_pending(model, fixed)
    keys_a, kv_a = _kept_rows(out.cache)
    keys_b, kv_b = _kept_rows(fixed)
    assert torch.equal(keys_a, keys_b)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


def test_idle_time_uses_the_largest_ladder_size(model, processor, monkeypatch):
    import raincheck_hf.conversation as conversation

    sizes = []

    def spy(model, cache, max_tokens=None):
        sizes.append(max_tokens)
        return restore_pending(model, cache, max_tokens=max_tokens)

    monkeypatch.setattr(conversation, "restore_pending", spy)
    cfg = RaincheckConfig(chunk_size="auto", decode_guard=50, retention=0.1)
    with Conversation(model, processor, cfg, background=False, max_new_tokens=4) as conv:
        conv.ask("What is in this image?", images=[draw_test_image(256, 256, seed=s) for s in (4, 5, 6)])
        pending = conv.pending
        assert pending > max(CHUNK_LADDER)
        assert conv.complete() == pending
    assert sizes and set(sizes) == {max(CHUNK_LADDER)} and len(sizes) == math.ceil(pending / max(CHUNK_LADDER))


def test_fixed_size_trace_records_its_chunk_size(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    out = greedy(model, inputs, n=10, raincheck=RaincheckConfig(chunk_size=4, decode_guard=2),
                 return_dict_in_generate=True)
    t = out.raincheck
    assert t.chunk_size_per_forward == [4 if r.numel() else 0 for r in t.restored_per_forward]


@pytest.mark.parametrize("value", [float("nan"), -0.1, "0.02", True, None, float("inf")])
def test_invalid_tpot_slack_is_named(value):
    with pytest.raises(ValueError, match="tpot_slack="):
        RaincheckConfig(tpot_slack=value)
    cfg = RaincheckConfig()
    with pytest.raises(ValueError, match="tpot_slack="):
        cfg.tpot_slack = value
    assert cfg.tpot_slack == 0.02


@pytest.mark.parametrize("value", ["Auto", "fast", "", 0])
def test_chunk_size_names_auto(value):
    with pytest.raises(ValueError, match=r"chunk_size=.*\"auto\""):
        RaincheckConfig(chunk_size=value)


class _FakeEvent:
    """Stands in for a CUDA timing event: `record` stamps the fake device clock, `query` says whether the fake
    device has passed it."""

    clock = 0.0  # device time (ms) of the last recorded event
    done_until = 0.0  # the device has finished everything recorded up to this time

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock

    def query(self):
        return self.t is not None and self.t <= _FakeEvent.done_until

    def synchronize(self):
        _FakeEvent.done_until = max(_FakeEvent.done_until, self.t)

    def elapsed_time(self, other):
        return other.t - self.t


class _FakeGraph:
    def __init__(self, ms):
        self.ms = ms

    def replay(self):
        _FakeEvent.clock += self.ms


def test_step_timings_are_read_lazily_and_never_waited_for():
    from raincheck_hf.fast import timing
    from raincheck_hf.fast.timing import StepTimings

    _FakeEvent.clock = _FakeEvent.done_until = 0.0
    t = StepTimings(event=_FakeEvent)
    decode, fused = (1, True, 2048), (32, True, 2048)
    t.time_replays(fused, _FakeGraph(13.0))  # capture time: synchronised, so measured at once
    assert t.cost(fused) == pytest.approx(0.013)
    for _ in range(3):
        t.replay(decode, _FakeGraph(10.0))
    assert t.cost(decode) is None  # the device has not passed the events yet: nothing read, nothing waited for
    _FakeEvent.done_until = _FakeEvent.clock - 10.0  # the first two replays are done, the third runs
    assert t.cost(decode) == pytest.approx(0.010) and len(t._samples[decode]) == 2
    # a shape measured at another slot bucket only: the nearest bucket's figure
    assert t.nearest_cost((1, True, 2304)) == pytest.approx(0.010) and t.nearest_cost((8, True, 2048)) is None
    # at most MAX_IN_FLIGHT unread pairs; the rest run unmeasured
    _FakeEvent.done_until = -1.0
    for _ in range(timing.MAX_IN_FLIGHT + 5):
        t.replay(decode, _FakeGraph(10.0))
    assert len(t._in_flight) == timing.MAX_IN_FLIGHT
    _FakeEvent.done_until = _FakeEvent.clock
    t.poll()
    assert not t._in_flight and len(t._samples[decode]) == timing.WINDOW
    disabled = StepTimings(enabled=False, event=_FakeEvent)
    disabled.replay(decode, _FakeGraph(10.0))
    disabled.time_replays(decode, _FakeGraph(10.0))
    assert disabled.cost(decode) is None
