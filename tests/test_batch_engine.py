"""`batch_engine.BatchEngine` (continuous batching on the slot pool `kv_pool.SlotKVPool`), eager engine, CPU.

The reference for every sequence is the same sequence run alone through batch-1 ``generate`` (greedy) under the
same chunk schedule (`test_batched.alone_schedule`: where the engine shares a chunk budget, the reference replays the
chunk sizes the sequence's trace recorded; without sharing it decides them itself and the traces must agree):
identical tokens, logits within 1e-4 (fp32), and the cache `BatchEngine.remove` returns equal to the call's own
cache.
Sequences join at random steps (fresh prompts with images or videos, or the next turn of a held conversation),
prompts are prefilled in pieces under random token budgets, and slots are reused.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from raincheck_hf import RaincheckConfig
from raincheck_hf.batch_engine import BatchEngine
from raincheck_hf.configuration import CHUNK_LADDER
from raincheck_hf.fast import batched_graphs
from raincheck_hf.kv_pool import MAX_KEY, SlotKVPool
from raincheck_hf.models import get_adapter
from raincheck_hf.tiny import draw_test_image

from conftest import make_inputs, no_placeholder_ids
from families import family_model, family_processor, family_params
from test_batched import (ALL_FAMILIES, IMAGE, TEXT, TWO_IMAGES, VIDEO, alone_schedule, assert_cache_equal,
                          assert_trace_equal, random_row)

TOL = 1e-4
MEDIA = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
FOLLOW = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"


def _alone(model, inputs, cfg, n, cache=None, schedule=None):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False, raincheck=cfg, return_dict_in_generate=True,
                          output_logits=True, suppress_tokens=no_placeholder_ids(model), cache=cache,
                          raincheck_chunk_schedule=schedule)


class Request:
    """One sequence of a schedule: what it adds to the engine, and its reference (its batch-1 call, `reference`,
    made once the sequence ran: it replays the sequence's chunk schedule)."""

    def __init__(self, model, processor, cfg, row: dict, n: int, arrive: int, follow_up: bool = False):
        self.model, self.cfg, self.n = model, cfg, n
        self.arrive, self.held = arrive, None
        eos = model.generation_config.eos_token_id
        self.eos = set() if eos is None else {int(e) for e in torch.as_tensor(eos).reshape(-1)}
        inputs = make_inputs(processor, **row)
        if follow_up:  # a held conversation: its first turn ran alone, the engine runs the next one
            first = _alone(model, inputs, cfg, 2)
            self.held = first.cache
            self.held_was = (repr(first.cache), first.cache.row_keys.clone(), first.cache.pending_sources.clone())
            follow = processor(text=[FOLLOW], return_tensors="pt")["input_ids"].to(first.sequences.device)
            inputs = {"input_ids": torch.cat([first.sequences, follow], dim=1)}
        self.ids = inputs["input_ids"][0]
        self.inputs = inputs
        self.media = {k: v for k, v in inputs.items() if k in MEDIA}
        self.want = self.want_tokens = None
        self.tokens, self.logits, self.cache, self.seq = [], [], None, None

    def take(self, logits: torch.Tensor, suppressed: torch.Tensor) -> bool:
        """Record a step's logits and take its greedy token (``suppressed`` ids excluded, as in the reference);
        True once it has its ``n`` tokens or took an EOS (where its reference's stopping criteria end it too)."""
        self.logits.append(logits)
        masked = logits.clone()
        masked[suppressed] = -float("inf")
        self.tokens.append(masked.argmax())
        return len(self.tokens) == self.n or int(self.tokens[-1]) in self.eos

    def reference(self):
        """Its own batch-1 call, once the engine ran it (made once): under its chunk schedule
        (`test_batched.alone_schedule` of its trace), from a copy of the held conversation it continues."""
        if self.want is None:
            self.want = _alone(self.model, self.inputs, self.cfg, self.n, cache=copy.deepcopy(self.held),
                               schedule=alone_schedule(self.cfg, self.seq.trace))
            self.want_tokens = self.want.sequences[0, self.ids.shape[0]:]
        return self.want

    def check(self, what: str):
        self.reference()
        got = torch.stack(self.tokens)
        assert torch.equal(got, self.want_tokens), f"{what}: tokens {got.tolist()} != {self.want_tokens.tolist()}"
        for step, (a, b) in enumerate(zip(self.logits, self.want.logits)):
            diff = (a - b[0]).abs().max().item()
            assert diff <= TOL, f"{what} step {step}: max abs logit diff {diff:.2e}"
        assert_cache_equal(self.cache, self.want.cache)
        if self.held is not None:  # the engine copied the held conversation and left it as it was
            was = self.held_was
            assert repr(self.held) == was[0] and torch.equal(self.held.row_keys, was[1])
            assert torch.equal(self.held.pending_sources, was[2])
        assert_trace_equal(self.seq.trace, self.want.raincheck)


def settle(engine: BatchEngine, active: dict, step_logits: dict, suppressed, ahead: bool = False) -> None:
    """After a step: each request that got logits takes its token, then leaves with its cache once done, or is fed
    its token for the next step. ``ahead``: as the drivers do it (`batch_engine._drive`, the serving loop): every
    request that got logits is fed its token as chosen (`BatchEngine.feed_all`, a tensor not read back) and the next
    step is prepared (`BatchEngine.prepare`) before anyone leaves; a request that finished then leaves, which
    abandons that step."""
    if not ahead:
        for seq, logits in step_logits.items():
            r = active[seq]
            if r.take(logits, suppressed):
                r.cache = engine.remove(seq)
                del active[seq]
            else:
                engine.feed(seq, r.tokens[-1])
        return
    done = {seq: active[seq].take(logits, suppressed) for seq, logits in step_logits.items()}
    if done:
        fed = engine.feed_all(list(done), torch.stack([active[seq].tokens[-1] for seq in done]))
        for i, (seq, token) in enumerate(zip(done, fed)):
            if i % 2:  # the driver's host value (the others' are read when a cache needs them)
                token.value = int(active[seq].tokens[-1])
    engine.prepare()
    for seq, finished in done.items():
        if finished:
            active[seq].cache = engine.remove(seq)
            del active[seq]


def drive(model, engine: BatchEngine, requests: list[Request], ahead: bool = False) -> int:
    """Run the schedule: each request joins at its step, takes greedy tokens (placeholders suppressed, as in its
    reference) until it has as many as its reference, then leaves with its cache. Returns the steps taken.
    ``ahead``: each next step prepared before the requests that finished leave and the new ones join (`settle`)."""
    suppressed = torch.tensor(no_placeholder_ids(model))
    waiting = sorted(requests, key=lambda r: r.arrive)
    active = {}
    step = 0
    while waiting or active:
        while waiting and waiting[0].arrive <= step:
            r = waiting.pop(0)
            r.seq = engine.add(r.ids, cache=r.held, **r.media)
            active[r.seq] = r
        settle(engine, active, engine.step(), suppressed, ahead)
        step += 1
        assert step < 500, "the schedule does not finish"
    return step


def draw_case(rng: random.Random, model, processor, longest: int = 6,
              most: int = 5) -> tuple[RaincheckConfig, list[Request], int | None]:
    """One random case of the batch engine's fuzzes (here, tests/test_batched_graphs.py and on CUDA in
    tests/test_gpu.py): the config (mode, retention, chunk size, guard, selector, shared chunk budget or none), two
    to ``most`` requests (prompt, answer length 2 to ``longest``, arrival step, held or not) and the engine's token
    budget."""
    cfg = RaincheckConfig(mode=rng.choice(("raincheck", "raincheck", "serial", "hard", "full", "post_answer")),
                          retention=rng.choice([0.0, 0.2, 0.3, 0.5]), chunk_size=rng.choice([1, 2, 3, 5, "auto"]),
                          decode_guard=rng.randint(0, 2), selector=rng.choice(("mmtok", "uniform", "divprune")),
                          fast_path=False)
    requests = [Request(model, processor, cfg, random_row(rng, sizes=(32, 64, 96, 128), video_frames=(2,)),
                        n=rng.randint(2, longest), arrive=rng.randint(0, 5), follow_up=rng.random() < 0.3)
                for _ in range(rng.randint(2, most))]
    budget = rng.choice([None, 5, 9, 16, 33])
    # drawn last, so that the rest of a seed's case stays what it was before this setting (the requests share cfg)
    cfg.batch_chunk_rows = rng.choice([None, 64, 8])
    return cfg, requests, budget


def draw_shared_case(rng: random.Random, model, processor, longest: int = 6,
                     most: int = 5) -> tuple[RaincheckConfig, list[Request], int | None]:
    """One random case of the shared chunk budget's fuzzes (here, tests/test_batched_graphs.py and on CUDA in
    tests/test_gpu.py): chunks of 15 to 63 rows under a ``batch_chunk_rows`` of 8 to 24, so that two sequences
    carrying chunks at once are always cut; two image prompts join at step 0 (they decode, and carry chunks,
    together), then up to ``most - 2`` random ones (held or not) at random steps; no token budget (both prompts run
    in the first step)."""
    cfg = RaincheckConfig(mode=rng.choice(("raincheck", "raincheck", "serial")), retention=rng.choice([0.0, 0.1, 0.2]),
                          chunk_size=rng.choice([15, 20, 31, 63]), decode_guard=rng.randint(0, 1),
                          selector=rng.choice(("mmtok", "uniform", "divprune")),
                          batch_chunk_rows=rng.choice([8, 12, 16, 24]), fast_path=False)

    def image():
        side = lambda: rng.choice([96, 128, 160])  # noqa: E731
        return dict(images=(draw_test_image(side(), side(), seed=rng.randrange(100)),), text="What is in this image?")

    requests = [Request(model, processor, cfg, image(), n=rng.randint(3, longest), arrive=0) for _ in range(2)]
    requests += [Request(model, processor, cfg, random_row(rng, sizes=(32, 64, 96, 128), video_frames=(2,)),
                         n=rng.randint(2, longest), arrive=rng.randint(0, 3), follow_up=rng.random() < 0.3)
                 for _ in range(rng.randint(0, most - 2))]
    return cfg, requests, None


def assert_some_chunks_cut(cfg: RaincheckConfig, requests: list[Request], what: str) -> None:
    """Some driven request's chunk sizes differ from those of its own call deciding them itself (no replay)."""
    differ = []
    for r in requests:
        free = _alone(r.model, r.inputs, cfg, r.n, cache=copy.deepcopy(r.held))
        differ.append(r.seq.trace.chunk_size_per_forward != free.raincheck.chunk_size_per_forward)
    assert any(differ), f"{what}: the shared budget cut no chunk"


def _run_fuzz_case(base: int, seed: int, draw, ahead: bool = False, graphs: bool | None = None, **engine_kwargs):
    """Seed ``base + seed``'s case drawn by ``draw`` on the family the seed picks, driven through a fresh engine with
    few slots (``ahead``: each next step prepared before the host reads the tokens, as the drivers do; ``graphs``:
    the engine's setting; ``engine_kwargs``: more of its settings), each sequence checked against its own call;
    ``(family, config, requests, engine)``."""
    rng = random.Random(base + seed)
    name = ALL_FAMILIES[seed % len(ALL_FAMILIES)]
    model, processor = family_model(name), family_processor(name)
    cfg, requests, budget = draw(rng, model, processor)
    engine_cfg = cfg
    if graphs:  # (the requests' own calls stay on the eager engine: ``cfg`` says fast_path=False)
        graphs = batched_graphs.batched_graph_blocker(get_adapter(model)) is None or None  # else: the eager engine
        engine_cfg = dataclasses.replace(cfg, fast_path=None)
    engine = BatchEngine(model, engine_cfg, token_budget=budget, num_slots=1, capacity=16, graphs=graphs,
                         **engine_kwargs)
    drive(model, engine, requests, ahead)
    for i, r in enumerate(requests):
        r.check(f"{name} seed {seed} sequence {i}")
    return name, cfg, requests, engine


@pytest.mark.parametrize("seed", range(30))
def test_fuzz_sequences_match_alone(seed):
    """Random join schedules, prompts (text, images, videos), modes, retentions, chunk sizes, guards, token
    budgets (most of them split prompts over several steps) and held conversations that continue, on every
    family; few initial slots, so slots are reused and the pool grows: each sequence equals its own call."""
    name, _, _, engine = _run_fuzz_case(2000, seed, draw_case)
    assert engine.sequences == [] and engine.pool.num_slots - len(engine.pool._free) == 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-buffers"])
@pytest.mark.parametrize("seed", range(8))
def test_fuzz_prepared_steps_match_alone(seed, graphs):
    """The same random schedules with each next step prepared before the host has the tokens and before anyone
    leaves or joins (`BatchEngine.feed_all` + `prepare`, as `generate` and the serving loop drive it): a step is
    launched as prepared, or abandoned by a join or a leave and decided again. Each sequence still equals its own
    call (tokens, logits, cache, trace), on the eager engine and on the captured steps' static buffers."""
    name, _, _, engine = _run_fuzz_case(2000, seed, draw_case, ahead=True, graphs=graphs)
    assert engine.sequences == [] and engine._ahead is None


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-buffers"])
@pytest.mark.parametrize("seed", range(8))
def test_fuzz_steps_split_by_width_match_alone(seed, graphs, monkeypatch):
    """The same random schedules with every decode forward that mixes one-row entries and wider ones split by width
    (``split_rows=1``: `width_split` says yes wherever it can), steps prepared ahead: each sequence still equals its
    own call (tokens, logits 1e-4, cache, trace), on the eager engine and on the captured steps' static buffers (the
    wide half gathering its slots at the largest chunk's width); every mixed forward was split, no other."""
    from raincheck_hf import batch_engine

    splits = []  # per decode forward: (its entries' widths mixed one-row and wider ones, forwards made of it)
    by_width = batch_engine.RowScheduler.by_width

    def noted(self, entries):
        out = by_width(self, entries)
        splits.append((len({len(g) > 1 for _, g in entries}) == 2, len(out)))
        return out

    monkeypatch.setattr(batch_engine.RowScheduler, "by_width", noted)
    _run_fuzz_case(2400, seed, draw_case, ahead=True, graphs=graphs, split_rows=1)
    assert all(n == (2 if mixed else 1) for mixed, n in splits)


def test_width_split_is_a_roofline_rule():
    """`width_split`: split a forward's one-row entries from its wider ones when, at ``split_rows`` rows to a pass
    over the weights, the padded forward costs more passes than the two; never without both kinds, or with None;
    `split_batches`: the wide halves' batch buckets such steps can take."""
    from raincheck_hf.batch_engine import split_batches, width_split

    assert width_split([1] * 24 + [32] * 8, 256)  # 1,024 rows (4 passes) against 24 + 256 (1 + 1)
    assert not width_split([1] * 6 + [32] * 2, 256)  # 256 rows: one pass either way
    assert width_split([1] * 16 + [32] * 16, 256)  # 1,024 rows (4) against 16 + 512 (1 + 2)
    assert width_split([1] * 8 + [32] * 24, 128) and not width_split([1] * 8 + [32] * 24, 256)
    assert not width_split([32] * 8, 1) and not width_split([1] * 8, 1) and not width_split([1, 32], None)
    assert width_split([1, 2], 1)
    assert split_batches(16, 32) == [] and split_batches(32, 32) == [1, 2, 4, 8, 16, 32]
    assert split_batches(4, 8, split_rows=1) == [1, 2, 4]  # (steps of 2 to 4 sequences: 1 to 3 wide ones)
    with pytest.raises(ValueError, match=r"BatchEngine\(split_rows=...\) must be None"):
        BatchEngine(family_model("qwen3_vl"), RaincheckConfig(), split_rows=0)


def test_prepared_step_abandoned_leaves_every_sequence_as_it_was():
    """`BatchEngine.prepare` takes chunks, prompt pieces and tokens from the sequences; `abandon` gives them all back
    (attributes, lists, traces, schedulers) and the step decided again is the same step: a prompt prefilling in
    pieces under a budget beside a decoding sequence with deferred chunks, prepared and abandoned at every step."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, fast_path=False)
    requests = [Request(model, processor, cfg, dict(images=(draw_test_image(96, 128, seed=1),), text="What?"),
                        n=5, arrive=0),
                Request(model, processor, cfg, dict(images=(draw_test_image(128, 96, seed=2),), text="Describe."),
                        n=4, arrive=1)]
    engine = BatchEngine(model, cfg, token_budget=12, num_slots=1, capacity=16)
    suppressed = torch.tensor(no_placeholder_ids(model))
    waiting, active, step = list(requests), {}, 0

    def state(seq):
        return (seq.token, seq.generated, seq.num_pending, None if seq.prefill is None else len(seq.prefill),
                list(seq.fed), list(seq.trace.chunk_size_per_forward), len(seq.trace.restored_per_forward))

    while waiting or active:
        while waiting and waiting[0].arrive <= step:
            r = waiting.pop(0)
            r.seq = engine.add(r.ids, **r.media)
            active[r.seq] = r
        before = {seq: state(seq) for seq in engine.sequences}
        engine.prepare()
        assert engine._ahead is not None and not engine.idle
        engine.abandon()
        assert {seq: state(seq) for seq in engine.sequences} == before
        engine.prepare()
        settle(engine, active, engine.step(), suppressed)
        step += 1
        assert step < 100
    for i, r in enumerate(requests):
        r.check(f"request {i}")


@pytest.mark.parametrize("seed", range(10))
def test_fuzz_shared_chunk_budget_sequences_match_alone_under_their_schedule(seed):
    """Random cases where the shared chunk budget cuts chunks (`draw_shared_case`), on every family: some sequence's
    chunk sizes differ from its own call's, and each sequence equals its own call replaying its schedule (tokens,
    logits 1e-4, cache, trace)."""
    name, cfg, requests, _ = _run_fuzz_case(3000, seed, draw_shared_case)
    assert_some_chunks_cut(cfg, requests, f"{name} seed {seed}")


# (sequences carrying a chunk, budget, chunk size) -> the cap (None: none); CHUNK_LADDER = (7, 15, 31, 63)
CAP_CASES = [
    (0, 64, 31, None), (1, 64, 31, None), (1, 1, 63, None),  # a lone sequence: what it gets alone
    (8, None, 31, None), (32, None, 63, None),  # no sharing
    (2, 64, 31, None), (3, 93, 31, None),  # its full chunks fit
    (3, 64, 31, 15), (4, 64, 31, 15), (5, 64, 31, 7), (8, 64, 31, 7), (9, 64, 31, 7), (32, 64, 31, 7),  # 7 at least
    (2, 64, 63, 31), (4, 64, 63, 15), (8, 64, 63, 7), (2, 125, 63, 31), (2, 126, 63, None),
    (4, 64, 20, 15), (3, 64, 20, None), (7, 64, 20, 7), (2, 1, 31, 7),  # a size off the ladder is cut onto it
    (8, 64, 5, None), (8, 8, 7, None), (2, 8, 8, 7),  # at or below the ladder's smallest: never cut
]


@pytest.mark.parametrize("carrying,budget,chunk,cap", CAP_CASES)
def test_shared_chunk_cap(carrying, budget, chunk, cap):
    from raincheck_hf.generation import shared_chunk_cap

    assert shared_chunk_cap(carrying, budget, chunk) == cap
    if cap is not None:
        assert cap < chunk and cap in CHUNK_LADDER
        assert carrying * cap <= budget or cap == min(CHUNK_LADDER)


def test_chunk_scheduler_applies_a_cap_and_replays_a_schedule(monkeypatch):
    """`ChunkScheduler.chunk_size` with a cap: a fixed size cut to it (not below the guard, not with nothing pending),
    ``"auto"`` choosing among the ladder sizes up to it (here from injected costs under which it takes 63 uncapped),
    ``serial`` the same; no cap: unchanged. With ``schedule`` it replays the given sizes (a forward past its end or
    with nothing pending: none), whatever the cap, and `may_carry_chunk` follows the replay."""
    from raincheck_hf.generation import ChunkScheduler, StepCosts

    class Pending:
        def __init__(self, n):
            self.num_pending = n

    for mode in ("raincheck", "serial"):
        fixed = ChunkScheduler(RaincheckConfig(chunk_size=31, decode_guard=2, mode=mode))
        assert [fixed.chunk_size(None, Pending(40), i) for i in (1, 2, 3)] == [0, 31, 31]
        assert [fixed.chunk_size(None, Pending(40), i, cap=7) for i in (1, 2, 3)] == [0, 7, 7]
        assert fixed.chunk_size(None, Pending(40), 2, cap=63) == 31
        assert fixed.chunk_size(None, Pending(0), 2, cap=7) == 0
        assert not fixed.may_carry_chunk(Pending(40), 1) and fixed.may_carry_chunk(Pending(40), 2)
    assert ChunkScheduler(RaincheckConfig(chunk_size=31, mode="post_answer")).chunk_size(None, Pending(40), 3, 7) == 0
    ms = 1e-3  # a step costs little more with a larger chunk: the slack pays for 63 at once
    costs = StepCosts(10 * ms, {7: 10.1 * ms, 15: 10.1 * ms, 31: 10.1 * ms, 63: 10.1 * ms})
    monkeypatch.setattr(ChunkScheduler, "step_costs", lambda self, adapter, cache: costs)
    auto = RaincheckConfig(chunk_size="auto", decode_guard=1, tpot_slack=0.5)
    assert ChunkScheduler(auto).chunk_size(None, Pending(500), 1) == 63
    for cap in (7, 15, 31):
        assert ChunkScheduler(auto).chunk_size(None, Pending(500), 1, cap=cap) == cap
    replay = ChunkScheduler(RaincheckConfig(chunk_size=31), schedule=[0, 7, 0, 15])
    assert [replay.chunk_size(None, Pending(40), i, cap=7) for i in (1, 2, 3, 4, 5)] == [7, 0, 15, 0, 0]
    assert replay.chunk_size(None, Pending(0), 3) == 0
    assert [replay.may_carry_chunk(Pending(40), i) for i in (1, 2, 3, 4)] == [True, False, True, False]


@pytest.mark.parametrize("name", family_params(ALL_FAMILIES))
def test_chunked_prefill_while_others_decode(name):
    """A long image prompt joins while another sequence decodes; under a small budget its prefill takes several
    steps, during which the other keeps getting a token every step; both equal their own calls."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    short = Request(model, processor, cfg, TEXT, n=8, arrive=0)
    long = Request(model, processor, cfg, TWO_IMAGES, n=3, arrive=2)
    engine = BatchEngine(model, cfg, token_budget=12, num_slots=2)
    rows_per_step = []
    handle = engine.adapter.text_model.register_forward_pre_hook(
        lambda m, a, kw: rows_per_step.append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True)
    try:
        drive(model, engine, [short, long])
    finally:
        handle.remove()
    for r, what in ((short, "decoding"), (long, "prefilled in pieces")):
        r.check(f"{name} {what}")
    prefill = len(long.seq.plan.input_rows)
    assert prefill > 2 * 12  # its prompt needs at least three steps at this budget
    # the short one decodes every step; the long one's prefill rides beside it, at most the budget's rows a step
    assert sum(1 for b, w in rows_per_step if b == 2) >= 3
    assert all(w <= 12 for _, w in rows_per_step[1:])


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_held_conversation_continues_with_its_leftover_rows(name):
    """A held conversation whose deferred rows are all still pending joins while another sequence decodes: its
    first forward's rows (the leftover deferred rows, then the follow-up's input) are split by the budget, the
    deferred rows' pieces joining at its old boundary (on Qwen3.5: its recorded suffix); it equals its batch-1
    follow-up."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.2, chunk_size=2, decode_guard=3, fast_path=False)
    other = Request(model, processor, cfg, IMAGE, n=8, arrive=0)
    held = Request(model, processor, cfg, TWO_IMAGES, n=4, arrive=1, follow_up=True)
    leftover = held.held.num_pending
    assert leftover > 4  # nothing was restored in its 2-token first turn
    engine = BatchEngine(model, cfg, token_budget=4)
    drive(model, engine, [other, held])
    other.check(f"{name} decoding")
    held.check(f"{name} continued")
    assert torch.equal(held.seq.trace.restored_per_forward[0], held.held.pending_sources)


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_reused_slot_shows_nothing_of_its_last_owner(name):
    """A sequence leaves; garbage is written over everything its slot holds (KV rows beyond any length, on
    Qwen3.5 its recurrent states too); the next sequence that takes the slot equals its own call. The freed slot's
    keys are all empty."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1, fast_path=False)
    first = Request(model, processor, cfg, TWO_IMAGES, n=4, arrive=0)
    engine = BatchEngine(model, cfg, num_slots=1)
    drive(model, engine, [first])
    pool = engine.pool
    assert pool.num_slots == 1 and bool((pool.slot_keys == MAX_KEY).all()) and pool.lengths == [0]
    gen = torch.Generator().manual_seed(0)
    for layer in pool.layers:
        if layer.is_initialized:
            layer.keys.copy_(1e3 * torch.randn(layer.keys.shape, generator=gen))
            layer.values.copy_(1e3 * torch.randn(layer.values.shape, generator=gen))
    if engine.recurrent is not None:
        assert engine.recurrent.layers
        for state in engine.recurrent.layers.values():
            for t in (state.state, state.conv, state.boundary_state, state.rest_map):
                t.copy_(1e3 * torch.randn(t.shape, generator=gen))
    second = Request(model, processor, cfg, IMAGE, n=4, arrive=0)
    third = Request(model, processor, cfg, TEXT, n=3, arrive=1)
    drive(model, engine, [second, third])
    first.check("first owner")
    second.check("next owner")
    third.check("a grown pool's new slot")
    assert pool.num_slots == 2


def test_engine_runs_attention_rows_of_each_slot_only():
    """`SlotKVPool` directly: rows land at each slot's own offsets (padding rows after them stay invisible), and
    the visibility of a step is each slot's keys against its own queries; capacity doubles on overflow."""
    pool = SlotKVPool(num_layers=1, num_slots=2, capacity=16)
    a, b = pool.allocate(), pool.allocate()
    visible = pool.begin_step([a, b], [torch.tensor([0, 1, 2]), torch.tensor([5])], 3)
    layer = pool.layers[0]
    k = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 1, 3, 1)
    keys, _ = layer.update(k, k)
    pool.end_step()
    assert pool.lengths == [3, 1]
    assert keys.shape == (2, 1, 16, 1)
    assert keys[0, 0, :3, 0].tolist() == [0, 1, 2] and keys[1, 0, :3, 0].tolist() == [3, 4, 5]  # padding at 1, 2
    assert visible[0, :, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert visible[1, 0, :3].tolist() == [True, False, False]
    assert visible[1, 1].nonzero().flatten().tolist() == [1]  # a padding query sees only its own row
    assert visible[1, 2].nonzero().flatten().tolist() == [2]
    assert pool.slot_keys[b, 1:].eq(MAX_KEY).all()
    pool.begin_step([b], [torch.arange(6, 6 + 40)], 40)  # overflows 16 rows: capacity doubles to 64
    layer.update(torch.ones(1, 1, 40, 1), torch.ones(1, 1, 40, 1))
    pool.end_step()
    assert pool.capacity == 64 and pool.lengths == [3, 41]
    assert layer.keys[a, 0, :3, 0].tolist() == [0, 1, 2]  # kept over the reallocation
    pool.begin_step([a, b], [torch.tensor([50, 51]), torch.tensor([60])], 2)  # a forward that raises: taken back
    pool.end_step(completed=False)
    assert pool.lengths == [3, 41]
    assert pool.slot_keys[a, 3:].eq(MAX_KEY).all() and pool.slot_keys[b, 41:].eq(MAX_KEY).all()
    pool.release(a)
    assert pool.slot_keys[a].eq(MAX_KEY).all() and pool.allocate() == a
    with pytest.raises(ValueError, match="not in use"):
        pool.release(5)


def test_a_pool_growth_that_runs_out_of_memory_leaves_the_pool_usable_and_its_graphs_stale(monkeypatch):
    """`SlotKVPool._resize` one layer at a time: an allocation that fails part of the way (out of device memory, as
    in a 64-client run) leaves the pool at its old sizes with every layer holding at least those and its contents,
    and bumps ``version`` all the same (captured steps held the replaced layers' tensors, freed now; replaying them
    read freed memory and ended in an illegal memory access). A retry resizes the rest and keeps every row."""
    pool = SlotKVPool(num_layers=3, num_slots=2, capacity=64)
    a = pool.allocate()
    pool.begin_step([a], [torch.arange(3)], 3)
    for i, layer in enumerate(pool.layers):
        layer.update(torch.full((1, 1, 3, 2), float(i + 1)), torch.full((1, 1, 3, 2), float(-i - 1)))
    pool.end_step()
    version, real = pool.version, torch.Tensor.new_zeros
    calls = []

    def failing(t, *size, **kwargs):
        calls.append(size)
        if len(calls) == 3:  # the second layer's keys
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return real(t, *size, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", failing)
    with pytest.raises(torch.OutOfMemoryError):
        pool.reserve(100)
    monkeypatch.setattr(torch.Tensor, "new_zeros", real)
    assert pool.version > version and pool.capacity == 64 and pool.slot_keys.shape == (2, 64)
    assert [tuple(layer.keys.shape)[2] for layer in pool.layers] == [128, 64, 64]
    for i, layer in enumerate(pool.layers):
        assert layer.keys[a, 0, :3].eq(i + 1).all() and layer.values[a, 0, :3].eq(-i - 1).all()
    visible = pool.begin_step([a], [torch.tensor([3])], 1)  # the old sizes still serve a step
    for layer in pool.layers:
        layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    pool.end_step()
    assert visible[0, 0, :4].tolist() == [True] * 4
    version = pool.version
    pool.reserve(100)  # the retry: the first layer kept, the others resized
    assert pool.version > version and pool.capacity == 128
    assert all(tuple(layer.keys.shape) == tuple(layer.values.shape) == (2, 1, 128, 2) for layer in pool.layers)
    for i, layer in enumerate(pool.layers):
        assert layer.keys[a, 0, :3].eq(i + 1).all() and layer.keys[a, 0, 3].eq(0).all()


def test_a_pool_growth_short_of_memory_asks_for_room_and_tries_again(monkeypatch):
    """`SlotKVPool.on_short` (the batching loop's `_relieve_memory`: the server evicts held conversations): a layer's
    allocation that runs out of memory asks it for the bytes the growth still needs (that layer and the ones after
    it, the tensors they replace let go on the way), then tries once more; every row is kept. Without room made, or
    with nobody to ask (no hook, or its owner gone), the error is raised as before."""
    import weakref

    class Room:
        def __init__(self, made):
            self.made, self.asked = made, []

        def relieve(self, nbytes):
            self.asked.append(nbytes)
            return self.made

    real = torch.Tensor.new_zeros

    def pool_with_a_failure():
        pool = SlotKVPool(num_layers=3, num_slots=2, capacity=64)
        a = pool.allocate()
        pool.begin_step([a], [torch.arange(3)], 3)
        for i, layer in enumerate(pool.layers):
            layer.update(torch.full((1, 1, 3, 2), float(i + 1)), torch.full((1, 1, 3, 2), 0.5))
        pool.end_step()
        calls = []

        def failing(t, *size, **kwargs):
            calls.append(size)
            if len(calls) == 3:  # the second layer's keys, once
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
            return real(t, *size, **kwargs)

        monkeypatch.setattr(torch.Tensor, "new_zeros", failing)
        return pool, a

    room = Room(True)
    pool, a = pool_with_a_failure()
    pool.on_short = weakref.WeakMethod(room.relieve)
    pool.reserve(100)
    monkeypatch.setattr(torch.Tensor, "new_zeros", real)
    # the second and third layers' growth: each key / value tensor, [2, 1, 64, 2] float32 (1,024 bytes), made again at
    # [2, 1, 128, 2] (2,048) while it is held, then let go: the most held beyond now is the second layer's net 2,048
    # and then the third's keys grown (1,024 more) beside its new values (2,048); not every new tensor's bytes (8,192)
    assert room.asked == [2048 + 1024 + 2048]
    assert pool.capacity == 128 and all(layer.keys.shape[2] == 128 for layer in pool.layers)
    assert all(layer.keys[a, 0, :3].eq(i + 1).all() for i, layer in enumerate(pool.layers))
    for room in (Room(False), None, "gone"):
        pool, _ = pool_with_a_failure()
        if room == "gone":
            gone = Room(True)
            pool.on_short = weakref.WeakMethod(gone.relieve)
            del gone
        elif room is not None:
            pool.on_short = weakref.WeakMethod(room.relieve)
        with pytest.raises(torch.OutOfMemoryError):
            pool.reserve(100)
        monkeypatch.setattr(torch.Tensor, "new_zeros", real)
        assert pool.capacity == 64
        if isinstance(room, Room):
            assert len(room.asked) == 1


def test_a_growth_that_replaced_nothing_leaves_the_captured_steps_theirs(monkeypatch):
    """A growth whose first allocation fails (asked not to ask for room: ``reserve(relieve=False)``) raises
    `PoolOutOfMemory` (a ``torch.OutOfMemoryError``), asks nobody, and leaves the pool as it was with its ``version``
    unchanged: no tensor was replaced, so its captured steps may still replay."""
    import weakref

    from conftest import Room, failing_slot_resize
    from raincheck_hf.kv_pool import PoolOutOfMemory

    pool = SlotKVPool(num_layers=2, num_slots=2, capacity=64)
    a = pool.allocate()
    pool.begin_step([a], [torch.arange(3)], 3)
    for layer in pool.layers:
        layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    pool.end_step()
    room, version = Room(), pool.version
    pool.on_short = weakref.WeakMethod(room.relieve)
    failed = failing_slot_resize(monkeypatch, lambda layer, slots, size: True)
    with pytest.raises(PoolOutOfMemory):
        pool.reserve(100, relieve=False)
    assert failed == [0] and room.asked == [] and pool.version == version and pool.capacity == 64
    assert isinstance(PoolOutOfMemory("x"), torch.OutOfMemoryError)


def test_growth_need_is_the_most_held_beyond_now_on_the_way():
    """`kv_pool.growth_need`: steps of ``(net, peak)`` one after the other need the most, over the steps, of the earlier
    steps' net growth and the step's own peak."""
    from raincheck_hf.kv_pool import growth_need

    assert growth_need([]) == 0
    assert growth_need([(2, 3), (2, 3)]) == 5  # (the second step's peak on top of the first's net)
    assert growth_need(iter([(0, 7), (1, 1)])) == 7  # (a step that peaks high and lets it all go)
    assert growth_need([(-4, 0), (2, 3)]) == 0  # (a step that frees more than the next one needs)


def test_bad_input():
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    for budget in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="token_budget"):
            BatchEngine(model, RaincheckConfig(), token_budget=budget)
    engine = BatchEngine(model, RaincheckConfig())
    with pytest.raises(ValueError, match="one sequence's input_ids"):
        engine.add(torch.ones(2, 5, dtype=torch.long))
    ids = make_inputs(processor, **TEXT)["input_ids"]
    held = _alone(model, make_inputs(processor, **TEXT), RaincheckConfig(), 2).cache
    with pytest.raises(ValueError, match="held cache's"):
        engine.add(ids, cache=held)  # not the conversation the cache holds
    seq = engine.add(ids)
    with pytest.raises(ValueError, match="still prefilling"):
        engine.feed(seq, 1)
    assert engine.remove(seq) is None  # left before its prompt ran: nothing to continue
    assert engine.sequences == []


# ---- restoring sequences: held conversations restored in the spare budget of busy steps -------------------

def _held(model, processor, cfg, row):
    """A conversation's first turn run alone, too short for any chunk: ``(its cache, the follow-up's inputs)``."""
    inputs = make_inputs(processor, **row)
    first = _alone(model, inputs, cfg, 2)
    follow = processor(text=[FOLLOW], return_tensors="pt")["input_ids"].to(first.sequences.device)
    return first.cache, {"input_ids": torch.cat([first.sequences, follow], dim=1)}


def _idle_restored(model, cache, cfg, rows: int | None = None):
    """``cache`` (a copy) after `Conversation`'s idle-time restoration: its idle chunks, one forward each (``rows``:
    only the first that many pending rows, in one forward, as a restoration cut short leaves them)."""
    from raincheck_hf.generation import restore_pending

    cache = copy.deepcopy(cache)
    if rows is not None:
        restore_pending(model, cache, max_tokens=rows)
        return cache
    while cache.num_pending:
        restore_pending(model, cache, max_tokens=cfg.idle_chunk_size)
    return cache


def _assert_same_follow_up(model, inputs, cfg, got_cache, want_cache, what: str):
    """The follow-up from each cache: the same tokens, logits within TOL."""
    got = _alone(model, inputs, cfg, 4, cache=got_cache)
    want = _alone(model, inputs, cfg, 4, cache=want_cache)
    assert torch.equal(got.sequences, want.sequences), f"{what}: follow-up tokens differ"
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"{what} follow-up step {step}: max abs logit diff {diff:.2e}"


def _drive_with_restoring(engine, decoding: list[Request], restoring: list, suppressed, on_step=None):
    """Step while the ``decoding`` requests answer (each joins at its ``arrive`` step, a held one with its cache):
    every step, each fed sequence's token must run (its logits come back), and a restoring sequence whose rows are
    all restored leaves with its cache. ``on_step(step)`` after each step. Returns ``{restoring state: its cache}``
    and the rows each step restored."""
    waiting = sorted(decoding, key=lambda r: r.arrive)
    active = {}
    left, per_step, step = {}, [], 0
    while waiting or active:
        while waiting and waiting[0].arrive <= step:
            r = waiting.pop(0)
            r.seq = engine.add(r.ids, cache=r.held, **r.media)
            active[r.seq] = r
        fed = [s for s in active if s.token is not None]
        before = {s: s.num_pending for s in restoring if s in engine.sequences}
        logits = engine.step()
        assert all(s in logits for s in fed), "a decode row was left out of a step"
        per_step.append(sum(n - s.num_pending for s, n in before.items()))
        settle(engine, active, logits, suppressed)
        for s in restoring:
            if s in engine.sequences and s.num_pending == 0:
                left[s] = engine.remove(s)
        step += 1
        if on_step is not None:
            on_step(step)
        assert step < 500, "the schedule does not finish"
    return left, per_step


@pytest.mark.parametrize("budget", [None, 6])
@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_restoring_sequence_equals_idle_restoration(name, budget):
    """Two held conversations restore while two sequences answer: each step's restoring pieces come only from what
    the budget leaves after the decode rows and chunks (budget None: at most an idle chunk each), no decode row is
    ever left out, and the answers equal their own calls. Each restored cache equals `Conversation`'s idle-time
    restoration of the same held cache, and the follow-up from it answers identically."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.2, chunk_size=3, decode_guard=2, fast_path=False)
    held = [_held(model, processor, cfg, row) for row in (TWO_IMAGES, IMAGE)]
    assert all(cache.num_pending > 2 * cfg.chunk_size for cache, _ in held)
    answers = [Request(model, processor, cfg, IMAGE, n=12, arrive=0), Request(model, processor, cfg, TEXT, n=10,
                                                                              arrive=0)]
    engine = BatchEngine(model, cfg, token_budget=budget, num_slots=2)
    states = [engine.restore(cache) for cache, _ in held]
    assert all(s.max_rows == cfg.idle_chunk_size for s in states)
    rows, entries = [], []
    schedule = engine.scheduler.schedule

    def watched(adapter, sequences):  # each forward's rows per kind of sequence
        forwards = schedule(adapter, sequences)
        entries.append(forwards)
        rows.append(sum(len(g) for f in forwards for _, g in f))
        return forwards

    engine.scheduler.schedule = watched
    got, _ = _drive_with_restoring(engine, answers, states, torch.tensor(no_placeholder_ids(model)))
    for r, what in zip(answers, ("image answer", "text answer")):
        r.check(f"{name} {what} beside restoring sequences")
    for forwards in entries:
        pieces = [len(g) for f in forwards for s, g in f if s in states]
        assert all(p <= cfg.idle_chunk_size for p in pieces)
        if budget is not None:  # restoring rows only in what decode rows and chunks left
            others = sum(len(g) for f in forwards for s, g in f if s not in states)
            assert not pieces or others + sum(pieces) <= budget
    assert sum(1 for f in entries if any(s in states for fw in f for s, _ in fw)) >= 2
    assert set(got) == set(states) and engine.sequences == []
    for k, (state, (cache, follow)) in enumerate(zip(states, held)):
        assert cache.num_pending > 0  # the held cache itself is left as it was
        want = _idle_restored(model, cache, cfg)
        assert want.num_pending == 0
        assert torch.equal(torch.cat(state.restored), cache.pending_sources)
        assert_cache_equal(got[state], want)
        _assert_same_follow_up(model, follow, cfg, got[state], want, f"{name} held conversation {k}")


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_restoring_sequence_taken_back_for_a_follow_up(name):
    """A follow-up arrives while its conversation restores: the restoring sequence leaves part way (its cache: the
    held one with the rows restored so far), and the follow-up joins the same engine with that cache and its
    leftover rows ahead of it; it answers as the batch-1 follow-up from the same rows restored alone does."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.2, chunk_size=2, decode_guard=1, fast_path=False)
    cache, follow = _held(model, processor, cfg, TWO_IMAGES)
    other = Request(model, processor, cfg, IMAGE, n=10, arrive=0)
    engine = BatchEngine(model, cfg, token_budget=5)
    state = engine.restore(cache, max_rows=3)
    taken = {}

    def follow_up(step):  # once it has restored a piece or two (its prompt's prefill first fills the budget)
        if state in engine.sequences and len(state.restored) == 2:
            assert 0 < state.num_pending < cache.num_pending  # part way
            taken["cache"] = engine.remove(state)

    _drive_with_restoring(engine, [other], [state], torch.tensor(no_placeholder_ids(model)), on_step=follow_up)
    other.check(f"{name} answer beside a restoring sequence")
    partial = taken["cache"]
    restored = cache.num_pending - partial.num_pending
    want = _idle_restored(model, cache, cfg, rows=restored)
    assert_cache_equal(partial, want)
    # the follow-up in the engine, from the taken-back cache, against the batch-1 follow-up from the reference
    held = Request.__new__(Request)
    held.model, held.cfg, held.n, held.inputs = model, cfg, 4, follow
    eos = model.generation_config.eos_token_id
    held.eos = set() if eos is None else {int(e) for e in torch.as_tensor(eos).reshape(-1)}
    held.arrive, held.held = 0, partial
    held.held_was = (repr(partial), partial.row_keys.clone(), partial.pending_sources.clone())
    held.ids, held.media = follow["input_ids"][0], {}
    held.want = _alone(model, follow, cfg, 4, cache=copy.deepcopy(want))
    held.want_tokens = held.want.sequences[0, held.ids.shape[0]:]
    held.tokens, held.logits, held.cache, held.seq = [], [], None, None
    drive(model, engine, [held])
    held.check(f"{name} follow-up after a restoration cut short")


def test_restore_bad_input():
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.2, chunk_size=3, fast_path=False)
    engine = BatchEngine(model, cfg)
    cache, _ = _held(model, processor, cfg, IMAGE)
    with pytest.raises(ValueError, match="DeferredDynamicCache"):
        engine.restore(object())
    for rows in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
            engine.restore(cache, max_rows=rows)
    done = _idle_restored(model, cache, cfg)
    with pytest.raises(ValueError, match="no pending deferred rows"):
        engine.restore(done)
    state = engine.restore(cache)
    with pytest.raises(ValueError, match="restoring only"):
        engine.feed(state, 1)
    assert engine.idle  # a restoring sequence alone is no work of an answer
    engine.discard(state)
    assert engine.sequences == []


def count_paths(engine) -> list[tuple[str, bool, bool]]:
    """Per forward of ``engine``, in order: ``(path, restoring, decoding)``: ``path`` "replay" (the captured step,
    `fast.batched_graphs.BatchedStepGraphs.launch`) or "eager" (`ForwardRunner`), whether it carried a restoring piece,
    and whether it carried a fed token."""
    from raincheck_hf.batched import RestoringState
    from raincheck_hf.cache_utils import GENERATED

    log = []

    def wrap(run, path, entries_of=lambda entries: entries):
        def logged(entries, *args):
            listed = entries_of(entries)
            log.append((path, any(isinstance(s, RestoringState) for s, _ in listed),
                        any(int(torch.as_tensor(g.kinds)[-1]) == GENERATED for _, g in listed)))
            return run(entries, *args)
        return logged

    engine.runner.run = wrap(engine.runner.run, "eager")
    if engine.graphs is not None:  # (every captured step goes through `launch`: `run` is prepare + launch)
        engine.graphs.launch = wrap(engine.graphs.launch, "replay", lambda step: step.entries)
    return log


def draw_restoring_case(rng: random.Random, model, processor, longest: int = 6, most: int = 4):
    """One random case of restoring beside answers (tests/test_batched_graphs.py and on CUDA tests/test_gpu.py): a
    config that defers (mode, retention, chunk size, guard, selector, shared chunk budget or none), one to three
    held conversations with pending rows (`_held`: image or video first turns) that restore from step 0 in pieces
    of at most ``max_rows`` (1 or 2, so that the tiny prompts' ten-odd pending rows last beyond the answers'
    prefill), beside one to ``most`` answers (random prompts, held or not, arriving at random steps), and the engine's
    token budget. Returns ``(cfg, answers, held caches, max_rows, budget)``."""
    cfg = RaincheckConfig(mode=rng.choice(("raincheck", "raincheck", "serial", "post_answer")),
                          retention=rng.choice([0.0, 0.2, 0.3]), chunk_size=rng.choice([1, 2, 3, 5, "auto"]),
                          decode_guard=rng.randint(0, 2), selector=rng.choice(("mmtok", "uniform", "divprune")),
                          batch_chunk_rows=rng.choice([None, 64, 8]), fast_path=False)
    first = dataclasses.replace(cfg, decode_guard=2)  # (their 2-token first turns carry no chunk: all rows wait)
    held = [_held(model, processor, first, rng.choice((IMAGE, TWO_IMAGES, VIDEO)))[0] for _ in range(rng.randint(1, 3))]
    assert all(cache.num_pending for cache in held)
    answers = [Request(model, processor, cfg, random_row(rng, sizes=(32, 64, 96, 128), video_frames=(2,)),
                       n=rng.randint(2, longest), arrive=rng.randint(0, 3), follow_up=rng.random() < 0.3)
               for _ in range(rng.randint(1, most))]
    return cfg, answers, held, rng.choice([1, 2]), rng.choice([None, 6, 9, 16, 33])


def run_restoring_case(model, engine: BatchEngine, cfg: RaincheckConfig, answers: list[Request], held: list,
                       max_rows: int | None, budget: int | None) -> tuple[list, list]:
    """Drive a `draw_restoring_case` on ``engine`` (made with ``budget``): the held conversations join as restoring
    sequences (pieces of at most ``max_rows``), the answers at their steps; once the answers are done, the engine
    restores what is left alone. Checks the scheduling rules on every step (no fed token left out, restoring pieces
    within the budget's spare rows and ``max_rows``). Returns each held conversation's restored cache, and
    `count_paths`' log."""
    states = [engine.restore(cache, max_rows=max_rows) for cache in held]
    paths = count_paths(engine)
    entries = []
    schedule = engine.scheduler.schedule

    def watched(adapter, sequences):
        forwards = schedule(adapter, sequences)
        entries.append(forwards)
        return forwards

    engine.scheduler.schedule = watched
    got, _ = _drive_with_restoring(engine, answers, states, torch.tensor(no_placeholder_ids(model)))
    for state in states:
        while state in engine.sequences and state.num_pending:  # the answers are done: restoring pieces alone
            assert engine.step() == {}
        if state in engine.sequences:
            got[state] = engine.remove(state)
    for forwards in entries:
        pieces = [len(g) for f in forwards for s, g in f if s in states]
        assert all(p <= max_rows for p in pieces)
        if budget is not None:  # restoring rows only in what the others left
            others = sum(len(g) for f in forwards for s, g in f if s not in states)
            assert not pieces or others + sum(pieces) <= budget
    assert engine.sequences == []
    return [got[state] for state in states], paths


def test_restoring_rides_in_captured_decode_steps():
    """With captured decode steps (``fast_path=True``; on a CPU the same static-buffer step runs eagerly) a restoring
    piece rides in every step: in the prompt's step the restoring piece replays and then the prompt piece alone, in
    a forward of its own (a prefill step of batch 1), every decode step carries a piece and is still replayed (never
    run eagerly for it), and so is every step after the answer (restoring pieces only). Nothing runs eagerly. The
    answer equals its own call; the restored cache equals idle-time restoration's and the follow-up from it answers
    identically."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    eager = RaincheckConfig(retention=0.2, chunk_size=2, decode_guard=2, fast_path=False)
    cfg = dataclasses.replace(eager, fast_path=True)
    cache, follow = _held(model, processor, eager, TWO_IMAGES)  # (a held cache as the batching server holds them)
    other = Request(model, processor, eager, TEXT, n=5, arrive=0)  # its reference: the eager batch-1 call
    engine = BatchEngine(model, cfg, num_slots=2)
    assert engine.graphs is not None
    state = engine.restore(cache)
    assert cache.num_pending > other.n * cfg.idle_chunk_size  # more than the answer's steps restore
    paths = count_paths(engine)
    _, per_step = _drive_with_restoring(engine, [other], [state], torch.tensor(no_placeholder_ids(model)))
    other.check("answer on captured decode steps beside a restoring sequence")
    assert len(per_step) == other.n and all(n == cfg.idle_chunk_size for n in per_step)  # a piece in every step
    # the prompt's step: the first restoring piece replayed, then the prompt's piece alone
    assert paths[:2] == [("replay", True, False), ("replay", False, False)]
    assert paths[2:] == [("replay", True, True)] * (other.n - 1)  # each decode step: replayed, with a piece
    while state.num_pending:  # nothing else left: restoring pieces alone, replayed too
        assert engine.step() == {}
    assert {p for p in paths[other.n + 1:]} == {("replay", True, False)}
    assert engine.graphs.replays == len(paths)
    got = engine.remove(state)
    engine.close()
    want = _idle_restored(model, cache, eager)
    assert_cache_equal(got, want)
    _assert_same_follow_up(model, follow, eager, got, want, "restored beside captured decode steps")


def test_a_fast_path_cache_cannot_join_a_batch_and_says_why():
    """A batch-1 fast-path conversation's static cache has no rows a slot can copy: a clear error, before any compute."""
    from raincheck_hf.fast.static_cache import StaticDeferredCache

    model = family_model("qwen3_vl")
    engine = BatchEngine(model, RaincheckConfig(fast_path=False))
    static = StaticDeferredCache.__new__(StaticDeferredCache)
    with pytest.raises(ValueError, match="fast-path conversation's static cache"):
        engine.add(torch.tensor([1, 2, 3]), cache=static)
    with pytest.raises(ValueError, match="fast-path conversation's static cache"):
        engine.restore(static)
    assert engine.sequences == []


def test_a_sequence_made_ahead_joins_with_the_next_arrival_number_and_only_once():
    """`BatchEngine.add_made`: a fresh prompt's sequence made by `batched.new_sequence` elsewhere (as
    `BatchLoop.prepare_ahead` makes it on the asking thread) takes the engine's next arrival number and a slot, as
    `add` would; the same sequence a second time is refused with a clear error."""
    from raincheck_hf.batched import new_sequence

    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.5, chunk_size=2, fast_path=False)
    engine = BatchEngine(model, cfg, num_slots=2)
    first = engine.add(make_inputs(processor, **TEXT)["input_ids"])
    inputs = make_inputs(processor, **IMAGE, text="Describe it.")
    made = new_sequence(model, get_adapter(model), cfg, -1, inputs["input_ids"].reshape(-1),
                        pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    assert engine.add_made(made) is made and made.index == first.index + 1 and made.slot != first.slot
    with pytest.raises(ValueError, match="not added anywhere yet"):
        engine.add_made(made)
    engine.close()


@pytest.mark.parametrize("leftover", [False, True])
def test_prompt_pieces_are_cut_by_host_flags_as_the_device_flags_cut_them(leftover):
    """A prompt's prefill (`SequenceState.prefill_group`; a continued conversation's leftover deferred rows first)
    carries its rows' visual flags on the host, so a step that cuts a piece under the budget (`RowGroup.split`) takes
    its DeepStack rows without reading ``batch.visual`` back from the device (a read there waits for the steps queued
    before it): the pieces with the device flags made unreadable are the pieces cut from the device flags."""
    from raincheck_hf.batched import new_sequence
    from raincheck_hf.models.base import RowBatch

    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    cfg = RaincheckConfig(retention=0.5, chunk_size=2, fast_path=False)
    adapter = get_adapter(model)
    inputs = make_inputs(processor, **IMAGE, text="Describe it.")
    media = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    cache, ids = None, inputs["input_ids"].reshape(-1)
    if leftover:  # a held conversation with deferred rows left: its follow-up's prefill starts with them
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False, raincheck=cfg, return_dict_in_generate=True,
                             suppress_tokens=no_placeholder_ids(model))
        cache = out.cache
        assert cache.peek_pending() is not None and len(cache.peek_pending()) > 0
        ids = torch.cat([out.sequences, processor(text=[FOLLOW], return_tensors="pt")["input_ids"]], 1).reshape(-1)
        media = {}
    with torch.no_grad():
        group = new_sequence(model, adapter, cfg, 0, ids, cache=cache, **media).prefill
    assert group.visual is not None and torch.equal(group.visual, group.batch.visual.cpu())
    assert group.visual.dtype == torch.bool and group.visual.device.type == "cpu"
    b = group.batch
    blind = dataclasses.replace(group, batch=RowBatch(b.embeds, b.positions, b.visual.to("meta"), b.deepstack))
    reference = dataclasses.replace(group, visual=None)
    n = len(group)
    for cuts in ([n // 3, n // 3], [1, n - 2], [n - 1]):
        left, right = blind, reference
        for cut in cuts:
            (head, left), (want, right) = left.split(cut), right.split(cut)
            assert len(head) == len(want) == cut and torch.equal(head.visual, want.batch.visual)
            assert [d.shape for d in head.batch.deepstack] == [d.shape for d in want.batch.deepstack]
            for got, expected in zip(head.batch.deepstack, want.batch.deepstack):
                assert torch.equal(got, expected)
        assert torch.equal(left.visual, right.batch.visual)
        for got, expected in zip(left.batch.deepstack, right.batch.deepstack):
            assert torch.equal(got, expected)



def test_static_buffer_steps_run_whatever_the_callers_grad_mode():
    """The captured steps' static buffers serve every caller of the model: after a `BatchLoop`'s turn (its thread
    runs the steps under ``no_grad``, as ``generate`` does), a `BatchEngine` driven with grad mode on, on the same
    model, runs its steps on those buffers too, each sequence equal to its own call. A logits buffer made under
    ``no_grad`` was written in place with grad mode on, and torch refused it (found by a test order that ran the
    loop's tests first)."""
    from raincheck_hf import BatchLoop, Conversation
    from raincheck_hf.tiny import draw_test_image

    name = ALL_FAMILIES[0]
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=2, fast_path=True)  # (the static buffers)
    with BatchLoop(model) as loop, Conversation(model, processor, cfg, background=False, max_new_tokens=4,
                                                loop=loop) as conv:
        conv.ask("What is in this image?", images=[draw_test_image(128, 96, seed=1)])
    assert torch.is_grad_enabled()
    _run_fuzz_case(2000, 0, draw_case, ahead=True, graphs=True)
