"""``chunk_size="auto"``: the policy as a pure function of injected costs, and end to end on the tiny model."""

from __future__ import annotations

import gc
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
    extras = chunk_extras(partial)  # sizes absent from `chunk` are no candidates
    assert set(extras) == {15, 63} and extras[15] == pytest.approx(1.6 * MS)
    assert extras[63] == pytest.approx(1.6 * MS * 63 / 15)
    bounded = chunk_extras(StepCosts(COSTS.decode, {7: None, 15: COSTS.chunk[15], 31: None}))
    assert bounded[7] == pytest.approx(1.6 * MS) and bounded[31] == pytest.approx(1.6 * MS * 31 / 15)
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


# ---- graph captures: captured sizes first, a capture's pause counted ----------------------------

def test_bounds_of_unmeasured_sizes_never_undercut_the_measured_figures():
    """`chunk_extras` of a size not measured is an upper bound of its figure when a step's extra cost grows
    with its rows, less than in proportion (the 8B-shaped COSTS): checked for every subset measured."""
    import itertools

    true = chunk_extras(COSTS)
    for k in range(1, len(CHUNK_LADDER)):
        for sizes in itertools.combinations(CHUNK_LADDER, k):
            got = chunk_extras(StepCosts(COSTS.decode, {c: COSTS.chunk[c] if c in sizes else None
                                                         for c in CHUNK_LADDER}))
            assert set(got) == set(CHUNK_LADDER)
            for c in CHUNK_LADDER:
                assert got[c] >= true[c] - 1e-12, (sizes, c)
                if c in sizes:
                    assert got[c] == pytest.approx(true[c])


def _with(captured=None, capture=None, costs=COSTS):
    return StepCosts(costs.decode, dict(costs.chunk), None if captured is None else frozenset(captured), capture or {})


def test_a_captured_size_is_preferred_whenever_one_is_affordable():
    # 200 steps at 2% of 10 ms: 40 ms of allowance, every size affordable; without captures the rule takes 63
    assert auto_chunk_size(COSTS, 0.02, 941, 200, 0.0) == 63
    known = dict.fromkeys(CHUNK_LADDER, 0.15)  # every shape was captured once elsewhere, 150 ms each
    assert auto_chunk_size(_with({31}, known), 0.02, 941, 200, 0.0) == 31
    assert auto_chunk_size(_with({7, 15}, known), 0.02, 941, 200, 0.0) == 15
    # captured but not affordable yet (63 costs 5.5 ms extra): it waits for it, paying no capture meanwhile
    assert auto_chunk_size(_with({63}, known), 0.02, 941, 10, 0.0) == 0
    # a captured size is preferred even when an uncaptured one's capture was never measured
    assert auto_chunk_size(_with({7}, {}), 0.02, 941, 200, 0.0) == 7


def test_a_capture_counts_its_measured_cost():
    known = dict.fromkeys(CHUNK_LADDER, 0.15)
    # nothing captured at this bucket, every capture known to cost 150 ms: 40 ms of allowance pays none
    assert auto_chunk_size(_with(set(), known), 0.02, 941, 200, 0.0) == 0
    # 2000 steps: 400 ms of allowance pay one capture (and the step's extra)
    assert auto_chunk_size(_with(set(), known), 0.02, 941, 2000, 0.0) == 63
    # ... unless the answer already spent it (earlier chunks, earlier captures)
    assert auto_chunk_size(_with(set(), known), 0.02, 941, 2000, 300 * MS) == 0
    # a cheap capture makes its size win when no captured size is affordable now (15 rows left: 63 would
    # wait 8 steps for its 5.5 ms, 15 costs 1.6 + 1 ms now)
    cheap = {**known, 15: 0.001}
    assert auto_chunk_size(_with({63}, cheap), 0.02, 15, 20, 0.0) == 15
    assert auto_chunk_size(_with({63}, known), 0.02, 15, 20, 0.0) == 0
    # with a captured size affordable, no capture is paid, however cheap
    assert auto_chunk_size(_with({7}, cheap), 0.02, 15, 20, 0.0) == 7


def test_one_capture_where_nothing_is_captured_and_its_cost_is_unknown():
    # nothing captured at this bucket and no capture measured: the size the rule ranks best, at no capture cost
    assert auto_chunk_size(_with(set(), {}), 0.02, 941, 200, 0.0) == auto_chunk_size(COSTS, 0.02, 941, 200, 0.0) == 63
    # sizes whose capture is known compete with their cost, those never captured at none
    assert auto_chunk_size(_with(set(), {63: 0.15, 31: 0.15}), 0.02, 941, 200, 0.0) == 15
    # something captured at this bucket (not affordable now): a size never captured is not taken, it waits
    assert auto_chunk_size(_with({63}, {}), 0.02, 941, 10, 0.0) == 0
    # no measurement at all: the smallest size (or the smallest captured one)
    nothing = StepCosts(COSTS.decode, {}, frozenset(), {})
    assert auto_chunk_size(nothing, 0.02, 941, 200, 0.0) == min(CHUNK_LADDER)
    assert auto_chunk_size(StepCosts(COSTS.decode, {}, frozenset({31}), {}), 0.02, 941, 200, 0.0) == 31


def simulate_buckets(slack, pending, steps, capture_s, bucket_rows=64, start_rows=100, guard=1, captured=None):
    """A decode loop over a slot-bucket ladder (``bucket_rows`` per bucket) as the fast path sees it: a size's
    figure is measured once its step was captured at some bucket, a capture costs ``capture_s`` seconds of
    pause (counted once measured) and marks the (size, bucket) captured. Returns the chosen sizes, the rows
    restored, the captures ``(step, size, bucket, cost known before, nothing captured there before)``, the
    total time of each prefix, and ``captured`` (bucket -> sizes), updated."""
    captured = {} if captured is None else captured
    measured, capture_known = set(), {}
    for sizes in captured.values():
        measured |= sizes
        capture_known.update(dict.fromkeys(sizes, capture_s))
    rows, restored, spent, total = start_rows, 0, 0.0, 0.0
    chosen, captures, totals = [], [], []
    bucket_of = lambda c: (rows + c + 1 + bucket_rows - 1) // bucket_rows
    for i in range(1, steps + 1):
        c = 0
        if i >= guard and restored < pending:
            left = pending - restored
            here = frozenset(s for s in CHUNK_LADDER if s in captured.get(bucket_of(min(s, left)), ()))
            figures = {s: COSTS.chunk[s] if s in measured else None for s in CHUNK_LADDER}
            costs = StepCosts(COSTS.decode, figures, here, dict(capture_known))
            c = auto_chunk_size(costs, slack, left, i, spent)
        step = COSTS.decode
        if c:
            n = min(c, pending - restored)
            step = COSTS.chunk[c]
            spent += chunk_extras(costs).get(c, 0.0)  # what the scheduler counts (a bound until measured)
            b = bucket_of(n)
            if c not in captured.get(b, ()):
                captures.append((i, c, b, c in capture_known, not any(
                    s in captured.get(bucket_of(min(s, pending - restored)), ()) for s in CHUNK_LADDER)))
                captured.setdefault(b, set()).add(c)
                measured.add(c)
                capture_known[c] = capture_s
                spent += capture_s
                step += capture_s
            restored += n
            rows += n
        rows += 1
        total += step
        chosen.append(c)
        totals.append(total)
    return chosen, restored, captures, totals, captured


def test_simulated_answers_pay_only_affordable_or_first_captures_and_reuse_them():
    """Answers on one slot storage (captures persist): a capture whose cost is unknown happens only where nothing
    is captured at its bucket, once per size; every other one is paid from the slack; once each size was
    tried, answers capture nothing and every prefix of them stays within the slack."""
    slack, pending, steps, capture_s = 0.02, 941, 512, 0.15
    rate = slack * COSTS.decode
    world, first_tries = {}, 0
    for answer in range(6):
        chosen, restored, captures, totals, world = simulate_buckets(slack, pending, steps, capture_s, guard=16,
                                                                     captured=world)
        unknown = [cap for cap in captures if not cap[3]]
        assert all(cap[4] for cap in unknown), "a capture of unknown cost only where nothing was captured"
        assert len(unknown) <= 1
        first_tries += len(unknown)
        # apart from a size's first capture, the answer stays within its slack (captures included)
        for i, total in enumerate(totals, start=1):
            first = sum(capture_s for cap in unknown if cap[0] <= i)
            assert total - first <= (COSTS.decode + rate) * i + 1e-9
        assert restored > 0 and set(chosen) <= {0, *CHUNK_LADDER}
    assert first_tries <= len(CHUNK_LADDER)
    assert not captures and len({s for sizes in world.values() for s in sizes}) >= 2


class _ReplayedStep:
    """Stands in for a captured CUDA graph on a CPU: `replay` runs the step eagerly on its buffers (what the
    graph would replay) and advances the fake device clock by the step's stand-in cost."""

    def __init__(self, graphs, adapter, buffers, want_logits, bucket, variant, ms):
        self.args = (graphs, adapter, buffers, want_logits, bucket, variant)
        self.ms = ms

    def replay(self):
        graphs, adapter, buffers, want_logits, bucket, variant = self.args
        _FakeEvent.clock += self.ms
        _FakeEvent.done_until = _FakeEvent.clock  # the fake device is done at once: figures read a step later
        graphs._step(adapter, graphs.replaying, buffers, want_logits, bucket, variant)


def _fake_graphs_class(capture_s: float, step_ms):
    """A `StepGraphs` whose "captures" (on a CPU) keep buffers and an eager replay of the step, timed on the fake
    event clock (``step_ms(rows)``), each taking ``capture_s`` seconds of a fake wall clock: the real
    `run` / `prepare` / `launch` / `step_figures` / `_try_capture` around them."""
    from raincheck_hf.fast.graphs import StepBuffers, StepGraphs, StepKey
    from raincheck_hf.fast.timing import StepTimings

    class FakeGraphs(StepGraphs):
        wall = 0.0

        def __init__(self, adapter, use_graphs):
            super().__init__(adapter, use_graphs)
            self.use_graphs = use_graphs
            self.pad_prefill = False  # prefills run eagerly, as the CPU fast path does
            self.timings = StepTimings(enabled=use_graphs, event=_FakeEvent)

        def clock(self):
            return FakeGraphs.wall

        def _capture(self, adapter, cache, rows, want_logits, start, bucket=None, variant=None, timed=True):
            bucket = cache.capacity if bucket is None else bucket
            if cache.total_slots - rows < start:
                return None
            key = StepKey(rows, want_logits, variant, bucket)
            buffers = StepBuffers.empty(rows, self.hidden, self.num_deepstack, adapter.dtype, adapter.device,
                                        step_info=adapter.has_linear_attention)
            graph = _ReplayedStep(self, adapter, buffers, want_logits, bucket, variant, step_ms(rows))
            FakeGraphs.wall += capture_s
            if timed and rows <= cache.scratch:
                self.timings.time_replays(key, _FakeGraph(step_ms(rows)))
            self._captured[key] = (graph, buffers)
            return graph, buffers

        def _replay(self, cache, key, graph):
            self.replaying = cache
            try:
                super()._replay(cache, key, graph)
            finally:
                self.replaying = None  # the storage (and these graphs) outlive the cache

    return FakeGraphs


@pytest.fixture
def fake_graphs(model, monkeypatch):
    """Install `_fake_graphs_class` for this test's static caches (its own slot storages, released after)."""
    import raincheck_hf.fast.graphs as graphs_module
    import raincheck_hf.fast.static_cache as static_cache
    from raincheck_hf.fast import release_storage

    monkeypatch.setattr(static_cache, "SLOT_BUCKET", 16)  # several slot buckets per answer on the tiny model
    _FakeEvent.clock = _FakeEvent.done_until = 0.0
    release_storage(model)

    def install(capture_s=0.15, step_ms=lambda rows: 10.0 + 0.05 * (rows - 1)):
        monkeypatch.setattr(graphs_module, "StepGraphs", _fake_graphs_class(capture_s, step_ms))

    yield install
    release_storage(model)


def _chunk_captures(out, mode="raincheck"):
    """The chunk steps captured during a call's answer, as ``(chunk size, forward)``."""
    fused = mode != "serial"  # a fused step has the decode token's row too
    return [(rows - fused, forward) for forward, rows, _ in out.raincheck.captures if rows > 1 and forward > 0]


def _chunk_keys(graphs, mode="raincheck"):
    """Chunk sizes of the chunk-step graphs a `StepGraphs` holds."""
    fused = mode != "serial"
    return [key[0] - fused for key in graphs._captured if key[0] > 1 and key[1] == fused]


@pytest.mark.parametrize("mode", ["raincheck", "serial"])
def test_auto_captures_only_the_sizes_it_picks_and_counts_their_pauses(model, processor, fake_graphs, mode):
    """On the fast path's code with stand-in captures: `step_figures` captures nothing, so every chunk step
    captured is one the scheduler chose; a capture's pause is charged to the answer (a 10 s one: no chunk
    after it), the next answer carries a captured size where one is, and every step matches the reference."""
    fake_graphs(capture_s=10.0)
    inputs = make_inputs(processor, images=[draw_test_image(256, 256, seed=s) for s in (4, 5, 6)], text="Describe it.")
    cfg = RaincheckConfig(chunk_size="auto", decode_guard=2, tpot_slack=0.5, retention=0.2, fast_path=True,
                          compile_steps=False, mode=mode)
    first = greedy(model, inputs, n=20, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    graphs = first.cache.graphs
    sizes = first.raincheck.chunk_size_per_forward
    # nothing measured at the guard: the smallest size is captured (a 10 s pause), then nothing is affordable
    assert _chunk_captures(first, mode) == [(min(CHUNK_LADDER), 2)]
    assert [c for c in sizes if c] == [min(CHUNK_LADDER)]
    assert all(seconds == 10.0 for _, _, seconds in first.raincheck.captures)
    assert set(_chunk_keys(graphs, mode)) == {min(CHUNK_LADDER)}
    assert_matches_reference(model, [record(inputs, first)])
    storage = first.cache.storage
    del first, graphs
    gc.collect()  # the first cache gone, the next call takes over its slot storage and captured steps
    second = greedy(model, inputs, n=20, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    assert second.cache.storage is storage
    sizes = second.raincheck.chunk_size_per_forward
    # the size captured at this bucket by the first answer first, with no pause; then, where nothing is captured,
    # the one size never tried that the rule ranks best (its capture cost unknown), and after its 10 s nothing
    first_chunk = next(i for i, c in enumerate(sizes) if c)  # (serial: once the slack pays for its own forward)
    assert sizes[first_chunk] == min(CHUNK_LADDER)
    (size, forward), = _chunk_captures(second, mode)
    assert forward > first_chunk
    assert size != min(CHUNK_LADDER) and sizes[forward] == size and not any(sizes[forward + 1:])
    assert set(_chunk_keys(second.cache.graphs, mode)) <= {min(CHUNK_LADDER), size}, "a chunk no step carried"
    assert_matches_reference(model, [record(inputs, second)])


def test_fixed_chunk_size_is_unchanged_by_capture_costs(model, processor, fake_graphs):
    """A fixed size captures its own shape wherever it runs, whatever a capture costs, and chunks every step
    after the guard, as before; the captures show in the trace."""
    fake_graphs(capture_s=10.0)
    inputs = make_inputs(processor, images=[draw_test_image(256, 256, seed=s) for s in (4, 5, 6)], text="Describe it.")
    cfg = dict(chunk_size=4, decode_guard=2, retention=0.2, compile_steps=False)
    kw = dict(n=20, return_dict_in_generate=True, output_logits=True)
    fast = greedy(model, inputs, raincheck=RaincheckConfig(fast_path=True, **cfg), **kw)
    eager = greedy(model, inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    assert torch.equal(fast.sequences, eager.sequences)
    assert fast.raincheck.chunk_size_per_forward == eager.raincheck.chunk_size_per_forward
    assert [r.tolist() for r in fast.raincheck.restored_per_forward] == [
        r.tolist() for r in eager.raincheck.restored_per_forward]
    assert {rows for _, rows, _ in fast.raincheck.captures} == {1, 5} and not eager.raincheck.captures
    assert len(_chunk_captures(fast)) >= 2, fast.raincheck.captures  # the fused shape at several slot buckets
    assert_matches_reference(model, [record(inputs, fast)])


def test_warm_up_times_its_captures_only_for_auto(model, processor, fake_graphs, monkeypatch):
    """A capture's timed replays (first cost figures, a few steps of device time each) are what ``chunk_size="auto"``
    weighs: `warm_up` takes them for an ``auto`` config and leaves them out for a fixed chunk size, whose steps
    nothing weighs (its first figures then come from its first replays); a capture inside an answer times them."""
    import raincheck_hf
    from raincheck_hf.fast import release_storage
    from raincheck_hf.fast.timing import StepTimings

    fake_graphs()
    timed = []
    real = StepTimings.time_replays
    monkeypatch.setattr(StepTimings, "time_replays", lambda self, key, graph, *a: timed.append(key) or
                        real(self, key, graph, *a))
    bounds = dict(max_tokens=256, max_new_tokens=8, cache_dir=False, progress=False)
    fixed = raincheck_hf.warm_up(model, processor, RaincheckConfig(fast_path=True, chunk_size=4, compile_steps=False),
                                 **bounds)
    assert fixed.captured and timed == []
    release_storage(model)
    auto = raincheck_hf.warm_up(model, processor, RaincheckConfig(fast_path=True, chunk_size="auto",
                                                                  compile_steps=False), **bounds)
    steps = [entry for entry in auto.captured if entry[1] <= max(CHUNK_LADDER) + 1]
    assert steps and len(timed) == len(steps)
    release_storage(model)
    timed.clear()
    inputs = make_inputs(processor, images=[draw_test_image(64, 64, seed=1)], text="Describe it.")
    out = greedy(model, inputs, n=4, raincheck=RaincheckConfig(fast_path=True, chunk_size=4, compile_steps=False),
                 return_dict_in_generate=True)
    assert out.raincheck.captures and timed  # (captured in the answer: timed as before)
