"""Selector contract and method-specific behaviour (CPU, deterministic, seed 42)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from raincheck_hf.selection import Segment, SelectionContext, get_selector
from raincheck_hf.selection.mmtok import mmtok_objective

SEED = 42
DIM = 16
ALL_SELECTORS = ["uniform", "random", "divprune", "mmtok", "cdpruner"]
RETENTIONS = [0.0, 0.1, 0.3, 0.5, 1.0]
SIZES = [1, 7, 64]


def make_segment(features: torch.Tensor, index: int = 0, modality: str = "image") -> Segment:
    n = int(features.shape[0])
    return Segment(index=index, modality=modality, features=features, grid=(1, 1, n),
                   source_positions=torch.arange(n))


def random_segment(n: int, dim: int = DIM, index: int = 0, seed: int = SEED) -> Segment:
    g = torch.Generator().manual_seed(seed + 1000 * index + n)
    return make_segment(torch.randn(n, dim, generator=g), index=index)


def text_context(m: int = 5, dim: int = DIM, seed: int = SEED) -> SelectionContext:
    g = torch.Generator().manual_seed(seed + 7)
    return SelectionContext(text_embeds=torch.randn(m, dim, generator=g))


def expected_count(retention: float, n: int) -> int:
    if n == 0 or retention <= 0:
        return 0
    return min(n, max(1, int(round(retention * n))))


def clustered_features(seed: int, sizes=(36, 4, 4, 4, 4, 4, 4, 4), dim: int = 32, spread: float = 0.15):
    """Tight clusters around random unit centres; one big cluster so a random pick is mostly redundant."""
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(len(sizes), dim, generator=g), dim=-1)
    rows = [centres[c] + spread * torch.randn(size, dim, generator=g) / dim**0.5 for c, size in enumerate(sizes)]
    features = torch.cat(rows)
    perm = torch.randperm(features.shape[0], generator=g)
    return features[perm]


def min_pairwise_cosine_distance(features: torch.Tensor, keep: torch.Tensor) -> float:
    x = F.normalize(features[keep].float(), dim=-1)
    dist = 1.0 - x @ x.T
    dist.fill_diagonal_(float("inf"))
    return float(dist.min())


# ------------------------------------------------------------------------------------------ contract


@pytest.mark.parametrize("name", ALL_SELECTORS)
@pytest.mark.parametrize("with_text", [False, True])
def test_keep_count_and_masks(name, with_text):
    selector = get_selector(name)
    context = text_context() if with_text else SelectionContext()
    for retention, n in itertools.product(RETENTIONS, SIZES):
        masks = selector.select([random_segment(n)], retention, context)
        assert len(masks) == 1
        mask = masks[0]
        assert mask.dtype == torch.bool and mask.shape == (n,)
        assert int(mask.sum()) == expected_count(retention, n), (name, retention, n)


@pytest.mark.parametrize("name", ALL_SELECTORS)
def test_deterministic(name):
    context = text_context()
    segments = [random_segment(64, index=0), random_segment(7, index=1)]
    first = get_selector(name).select(segments, 0.3, context)
    again = get_selector(name).select(segments, 0.3, context)  # a fresh instance too
    same_instance = get_selector(name)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(same_instance.select(segments, 0.3, context),
                                                 same_instance.select(segments, 0.3, context)))


@pytest.mark.parametrize("name", ALL_SELECTORS)
def test_several_segments_one_mask_each(name):
    sizes = [64, 7, 1, 20]
    segments = [random_segment(n, index=i) for i, n in enumerate(sizes)]
    masks = get_selector(name).select(segments, 0.5, text_context())
    assert len(masks) == len(segments)
    for mask, n in zip(masks, sizes):
        assert mask.shape == (n,)
        assert int(mask.sum()) == expected_count(0.5, n)


@pytest.mark.parametrize("name", ALL_SELECTORS)
def test_degenerate_features(name):
    """Duplicated rows, zero rows and more kept rows than feature dimensions still give k distinct rows."""
    features = torch.cat([torch.ones(20, 4), torch.zeros(10, 4), torch.randn(34, 4, generator=torch.Generator().manual_seed(SEED))])
    segment = make_segment(features)
    context = SelectionContext(text_embeds=torch.randn(3, 4, generator=torch.Generator().manual_seed(SEED)))
    for retention in (0.1, 0.5, 0.9):
        (mask,) = get_selector(name).select([segment], retention, context)
        assert int(mask.sum()) == expected_count(retention, 64)


def test_selectors_accept_low_precision_features():
    segment = make_segment(torch.randn(64, DIM, generator=torch.Generator().manual_seed(SEED)).to(torch.bfloat16))
    context = SelectionContext(text_embeds=torch.randn(4, DIM).to(torch.bfloat16))
    for name in ALL_SELECTORS:
        (mask,) = get_selector(name).select([segment], 0.25, context)
        assert int(mask.sum()) == 16


# ------------------------------------------------------------------------------------------ random


def test_random_seed_and_segment_index():
    features = torch.randn(64, DIM, generator=torch.Generator().manual_seed(SEED))
    a, b = make_segment(features, index=0), make_segment(features, index=1)
    sel = get_selector("random", seed=3)
    m0, m1 = sel.select([a, b], 0.25, SelectionContext())
    assert not torch.equal(m0, m1)  # different images differ
    assert torch.equal(m0, get_selector("random", seed=3).select([a], 0.25, SelectionContext())[0])
    assert not torch.equal(m0, get_selector("random", seed=4).select([a], 0.25, SelectionContext())[0])


# ------------------------------------------------------------------------------------------ divprune


def test_divprune_more_diverse_than_random():
    divprune = get_selector("divprune")
    div_scores, rand_scores = [], []
    for seed in range(5):
        features = clustered_features(seed)
        segment = make_segment(features)
        k_retention = 8 / features.shape[0]
        (keep_d,) = divprune.select([segment], k_retention, SelectionContext())
        div_scores.append(min_pairwise_cosine_distance(features, keep_d))
        for rseed in range(4):
            (keep_r,) = get_selector("random", seed=rseed).select([segment], k_retention, SelectionContext())
            rand_scores.append(min_pairwise_cosine_distance(features, keep_r))
    div_mean = sum(div_scores) / len(div_scores)
    rand_mean = sum(rand_scores) / len(rand_scores)
    assert div_mean > rand_mean + 0.2, (div_mean, rand_mean)
    # with 8 clusters and 8 picks, DivPrune takes one token per cluster: far apart every time
    assert min(div_scores) > 0.3


def test_divprune_question_agnostic():
    segment = random_segment(64)
    sel = get_selector("divprune")
    (a,) = sel.select([segment], 0.3, SelectionContext())
    (b,) = sel.select([segment], 0.3, text_context())
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ mmtok


def test_mmtok_objective_beats_random():
    mmtok = get_selector("mmtok")
    wins, greedy_total, random_total = 0, 0.0, 0.0
    for seed in range(5):
        features = clustered_features(seed, dim=DIM)
        segment = make_segment(features)
        text = features[:3] + 0.05 * torch.randn(3, DIM, generator=torch.Generator().manual_seed(seed))
        context = SelectionContext(text_embeds=text)
        (keep,) = mmtok.select([segment], 0.1, context)
        f_greedy = mmtok_objective(features, text, keep.nonzero().flatten(), 0.5, 0.02, 0.2)
        f_random = []
        for rseed in range(4):
            (keep_r,) = get_selector("random", seed=rseed).select([segment], 0.1, context)
            f_random.append(mmtok_objective(features, text, keep_r.nonzero().flatten(), 0.5, 0.02, 0.2))
        greedy_total += f_greedy
        random_total += sum(f_random) / len(f_random)
        wins += f_greedy > max(f_random)
    assert wins == 5
    assert greedy_total > random_total


@pytest.mark.parametrize("with_text", [True, False])
def test_mmtok_objective_monotone_in_retention(with_text):
    segment = random_segment(64)
    context = text_context() if with_text else SelectionContext()
    sel = get_selector("mmtok")
    values = []
    for retention in [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]:
        (keep,) = sel.select([segment], retention, context)
        values.append(sel.objective(segment, keep.nonzero().flatten(), context))
    assert values[0] == 0.0
    assert all(b >= a - 1e-6 for a, b in zip(values, values[1:])), values
    assert values[-1] > values[1]


def test_mmtok_greedy_is_nested_and_text_matters():
    segment = random_segment(64)
    sel = get_selector("mmtok")
    context = text_context()
    (small,) = sel.select([segment], 0.1, context)
    (large,) = sel.select([segment], 0.3, context)
    assert bool((small & ~large).sum() == 0)  # greedy prefixes: the smaller set is inside the larger
    # a text token equal to one visual row makes that row the first pick for a text-only objective
    target = 23
    text_only = get_selector("mmtok", alpha=1.0)
    (keep,) = text_only.select([segment], 1 / 64, SelectionContext(text_embeds=segment.features[target:target + 1]))
    assert keep.nonzero().flatten().tolist() == [target]


def test_mmtok_objective_function():
    features = torch.randn(10, DIM, generator=torch.Generator().manual_seed(SEED))
    text = torch.randn(2, DIM, generator=torch.Generator().manual_seed(SEED + 1))
    assert mmtok_objective(features, text, [], 0.5, 0.02, 0.2) == 0.0
    full = mmtok_objective(features, text, list(range(10)), 0.5, 0.02, 0.2)
    part = mmtok_objective(features, text, [0, 3], 0.5, 0.02, 0.2)
    assert 0.0 < part <= full <= 1.0
    # no text: the vision term alone, whatever alpha
    assert mmtok_objective(features, None, [0, 3], 0.9, 0.02, 0.2) == pytest.approx(
        mmtok_objective(features, torch.empty(0, DIM), [0, 3], 0.1, 0.02, 0.2))


# ------------------------------------------------------------------------------------------ cdpruner


def test_cdpruner_prefers_relevant_tokens():
    g = torch.Generator().manual_seed(SEED)
    n, dim = 64, 256
    features = torch.randn(n, dim, generator=g)  # near-orthogonal: similarity ~ identity
    relevant = [3, 17, 42, 55]
    text = F.normalize(features[relevant], dim=-1).sum(dim=0, keepdim=True)
    text = torch.cat([text, text + 0.01 * torch.randn(1, dim, generator=g)])
    segment = make_segment(features)
    context = SelectionContext(text_embeds=text)
    sel = get_selector("cdpruner")
    (keep4,) = sel.select([segment], 4 / n, context)
    assert sorted(keep4.nonzero().flatten().tolist()) == relevant
    (keep10,) = sel.select([segment], 0.15, context)
    assert set(relevant) <= set(keep10.nonzero().flatten().tolist())
    # without the question the same call is a plain DPP and need not pick them
    (keep_plain,) = get_selector("cdpruner", theta=0.0).select([segment], 4 / n, context)
    assert sorted(keep_plain.nonzero().flatten().tolist()) != relevant


def test_cdpruner_diversity_without_text():
    """Without text CDPruner is a DPP on cosine similarity: it spreads picks across clusters."""
    features = clustered_features(SEED)
    segment = make_segment(features)
    (keep,) = get_selector("cdpruner").select([segment], 8 / features.shape[0], SelectionContext())
    assert min_pairwise_cosine_distance(features, keep) > 0.3


# ------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "name, kwargs, setting",
    [
        ("random", {"seed": -1}, "RandomSelector.seed"),
        ("random", {"seed": 1.5}, "RandomSelector.seed"),
        ("random", {"seed": "x"}, "RandomSelector.seed"),
        ("mmtok", {"alpha": -1}, "MMTokSelector.alpha=-1"),
        ("mmtok", {"alpha": 1.5}, "MMTokSelector.alpha"),
        ("mmtok", {"alpha": float("nan")}, "MMTokSelector.alpha"),
        ("mmtok", {"text_temperature": 0.0}, "MMTokSelector.text_temperature"),
        ("mmtok", {"vision_temperature": -0.2}, "MMTokSelector.vision_temperature"),
        ("mmtok", {"vision_temperature": float("inf")}, "MMTokSelector.vision_temperature"),
        ("cdpruner", {"theta": -0.1}, "CDPrunerSelector.theta"),
        ("cdpruner", {"theta": 1.01}, "CDPrunerSelector.theta"),
        ("cdpruner", {"theta": "0.5"}, "CDPrunerSelector.theta"),
    ],
)
def test_invalid_settings(name, kwargs, setting):
    with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
        get_selector(name, **kwargs)


def test_mismatched_text_dimension():
    segment = random_segment(16)
    bad = SelectionContext(text_embeds=torch.randn(3, DIM + 1))
    for name in ("mmtok", "cdpruner"):
        with pytest.raises(ValueError, match="text_embeds"):
            get_selector(name).select([segment], 0.5, bad)


def test_unknown_selector_name():
    with pytest.raises(ValueError, match="selector"):
        get_selector("no-such-selector")


# ---- selectors that hook the model act only for their own call's thread -------------------------------

@pytest.mark.parametrize("selector,where", [("fastv", "text"), ("visionzip", "tower")])
def test_a_selector_s_hooks_are_invisible_to_another_thread(model, processor, selector, where):
    """Thread A is paused inside the forward its selector hooks (FastV's scoring pass, VisionZip's tower
    call); thread B meanwhile runs a stock generate on the same model and image: both get what they get alone."""
    import threading

    from raincheck_hf import RaincheckConfig

    from conftest import INPUT_CASES, make_inputs

    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    cfg = RaincheckConfig(selector=selector, chunk_size=3, decode_guard=2, fast_path=False)
    want_a, want_b = model.generate(**inputs, raincheck=cfg, **kw), model.generate(**inputs, **kw)
    module = model.model.language_model.layers[0] if where == "text" else model.model.visual.blocks[0]
    owner, inside, release = {}, threading.Event(), threading.Event()

    def pause(_module, _args):  # A's first pass through the module: its selector's hooks are in place
        if threading.get_ident() == owner.get("a") and not inside.is_set():
            inside.set()
            assert release.wait(timeout=60)

    handle = module.register_forward_pre_hook(pause)
    got, errors = {}, []

    def run_a():
        owner["a"] = threading.get_ident()
        try:
            got["a"] = model.generate(**inputs, raincheck=cfg, **kw)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    a = threading.Thread(target=run_a)
    try:
        a.start()
        assert inside.wait(timeout=60)
        got["b"] = model.generate(**inputs, **kw)
    finally:
        release.set()
        a.join()
        handle.remove()
    assert not errors, errors
    assert torch.equal(got["a"].raincheck.selected, want_a.raincheck.selected)
    for key, want in (("a", want_a), ("b", want_b)):
        assert torch.equal(got[key].sequences, want.sequences), key
        for x, y in zip(got[key].logits, want.logits):
            assert (x - y).abs().max() <= 1e-5, key


class _Picker(get_selector("uniform").__class__):
    """A selector whose picks are given (``picks``: one index list a segment), checked later when ``later``."""

    def __init__(self, picks, later):
        self.picks, self.later = picks, later

    def select_segment(self, segment, k, context):
        return torch.tensor(self.picks[segment.index])

    def picks_checked_later(self, segments, context):
        return self.later


def test_a_started_selection_gives_the_masks_select_gives_on_the_host_and_on_a_device():
    """`Selector.start` (what a turn's first forward runs on): its host masks are `select`'s, its device keep-mask
    (`keep_on`, made where the picks are) their concatenation, ``count`` the kept rows; segments kept whole or not
    at all, and groups of equal segments, included."""
    segments = [random_segment(12, index=0, seed=1), random_segment(12, index=1, seed=2),
                random_segment(7, index=2, seed=3), random_segment(1, index=3, seed=4)]
    for name in ("uniform", "mmtok", "divprune", "random"):
        for retention in (0.0, 0.3, 1.0):
            context = text_context()
            want = get_selector(name).select(segments, retention, context)
            started = get_selector(name).start(segments, retention, context)
            assert all(torch.equal(a, b) for a, b in zip(started.masks(), want))
            assert torch.equal(started.keep(), torch.cat(want)) and started.count == int(torch.cat(want).sum())
            assert torch.equal(started.keep_on("cpu"), torch.cat(want))


def test_picks_checked_later_break_the_contract_when_read_not_when_placed():
    """Picks the selector may have checked later (the library's kernels on a device) are placed on the device
    unchecked, out-of-range ones clamped (no device-side error), and the contract's error comes when they are
    read (`StartedSelection.keep`, before the turn's plan); other selectors' picks are checked at once."""
    segments = [random_segment(10, index=0), random_segment(10, index=1)]
    bad = [[0, 3, 3], [1, 2, 99]]  # a repeat, an index out of range
    with pytest.raises(RuntimeError, match="must return 3 distinct indices"):
        _Picker(bad, later=False).start(segments, 0.3, SelectionContext())
    started = _Picker(bad, later=True).start(segments, 0.3, SelectionContext())
    assert started.count == 6 and started.keep_on("cpu").shape == (20,)
    with pytest.raises(RuntimeError, match=r"returned \[0, 3, 3\] for a segment of 10 tokens"):
        started.keep()
    good = _Picker([[0, 3, 4], [1, 2, 9]], later=True).start(segments, 0.3, SelectionContext())
    assert torch.cat(good.masks()).nonzero().flatten().tolist() == [0, 3, 4, 11, 12, 19]
