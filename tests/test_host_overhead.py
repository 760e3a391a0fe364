"""The batched engine's per-step host work made for all sequences at once: each piece equals the per-sequence form it
replaces (the end-to-end equality with rows run alone is in test_batched*.py / test_batch_engine.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from raincheck_hf.batched import SequenceState, token_rows
from raincheck_hf.cache_utils import DEFERRED, GENERATED, INPUT, order_key, order_key_int
from raincheck_hf.fast import batched_graphs
from raincheck_hf.models import get_adapter

from families import family_model


def test_placement_matches_per_sequence_rows():
    rng = random.Random(0)
    for _ in range(500):
        width = rng.randint(1, 9)
        counts = [rng.choice([0, 1, 1, width, rng.randint(0, width)]) for _ in range(rng.randint(1, 10))]
        want = torch.cat([b * width + torch.arange(c, dtype=torch.long) for b, c in enumerate(counts)])
        assert torch.equal(batched_graphs._placement(counts, width), want), (counts, width)


def _decode_only_per_entry(entries) -> bool:
    """The rule `decode_only` applies, one entry at a time (its former form)."""
    for seq, group in entries:
        kinds = torch.as_tensor(group.kinds)
        if seq.restores_only:
            if group.want_logits or bool((kinds != DEFERRED).any()):
                return False
        elif not group.want_logits or int(kinds[-1]) != GENERATED or bool((kinds[:-1] != DEFERRED).any()):
            return False
    return True


def test_decode_only_matches_per_entry_rule():
    rng = random.Random(1)
    seen = {True: 0, False: 0}
    for _ in range(2000):
        entries = []
        for _ in range(rng.randint(1, 6)):
            restoring = rng.random() < 0.3
            n = rng.randint(1, 5)
            if restoring:
                kinds = [DEFERRED] * n
            else:
                kinds = [DEFERRED] * (n - 1) + [GENERATED]
            if rng.random() < 0.15:  # break it somewhere
                kinds[rng.randrange(n)] = rng.choice([INPUT, DEFERRED, GENERATED])
            want_logits = (not restoring) if rng.random() < 0.9 else restoring
            entries.append((SimpleNamespace(restores_only=restoring), _Group(kinds, want_logits)))
        expected = _decode_only_per_entry(entries)
        seen[expected] += 1
        assert batched_graphs.decode_only(entries) == expected
    assert seen[True] > 100 and seen[False] > 100


class _Group:
    def __init__(self, kinds, want_logits):
        self.kinds = torch.tensor(kinds, dtype=torch.int8)
        self.want_logits = want_logits

    def __len__(self):
        return int(self.kinds.shape[0])


def test_token_rows_match_decode_step_rows():
    """Each sequence's token row made together equals the one `ChunkScheduler.decode_step` makes alone."""
    model = family_model("qwen3_vl")
    adapter = get_adapter(model)
    seqs = [SimpleNamespace(token=tok, generated=gen, first_generated_position=pos, plan=SimpleNamespace(turn=turn),
                            ids=torch.zeros(length, dtype=torch.long))
            for tok, gen, pos, turn, length in [(5, 1, 40, 0, 37), (17, 9, 12, 2, 80), (0, 3, 7, 1, 5)]]
    with torch.no_grad():
        rows = token_rows(adapter, seqs)
        for s, (batch, key, source, kind) in zip(seqs, rows):
            alone = adapter.text_row(torch.tensor([s.token]), s.first_generated_position + s.generated - 1)
            assert torch.equal(batch.embeds, alone.embeds)
            assert torch.equal(batch.positions, alone.positions)
            assert torch.equal(batch.visual, alone.visual) and batch.deepstack is None
            assert torch.equal(key, order_key(s.plan.turn, GENERATED, s.generated - 1).reshape(1))
            assert torch.equal(source, torch.tensor([s.ids.shape[0] + s.generated - 1]))
            assert torch.equal(kind, torch.tensor([GENERATED], dtype=torch.int8))
    assert token_rows(adapter, []) == []


def test_stored_rows_are_joined_when_read():
    """`SequenceState.stored` appends; ``row_sources`` / ``row_kinds`` give the rows of every stored group in order,
    also after a read in between and after being set (a held cache's record)."""
    state = SequenceState(0, 0, torch.zeros(3, dtype=torch.long), None, None, None, None, 0)
    assert state.row_sources.numel() == 0 and state.row_sources.dtype == torch.long
    assert state.row_kinds.numel() == 0 and state.row_kinds.dtype == torch.int8
    state.row_sources, state.row_kinds = torch.tensor([7, 8]), torch.tensor([INPUT, INPUT], dtype=torch.int8)
    groups = [SimpleNamespace(sources=torch.tensor([1, 2]), kinds=torch.tensor([DEFERRED, GENERATED],
                                                                              dtype=torch.int8)),
              SimpleNamespace(sources=torch.tensor([3]), kinds=torch.tensor([GENERATED], dtype=torch.int8))]
    state.stored(groups[0])
    assert state.row_sources.tolist() == [7, 8, 1, 2]
    state.stored(groups[1])
    assert state.row_sources.tolist() == [7, 8, 1, 2, 3]
    assert state.row_kinds.tolist() == [INPUT, INPUT, DEFERRED, GENERATED, GENERATED]
    state.row_sources = torch.tensor([4])
    assert state.row_sources.tolist() == [4]


def test_order_key_int_matches_order_key():
    rng = random.Random(2)
    for _ in range(200):
        turn, segment, index = rng.randrange(1 << 21), rng.choice([INPUT, DEFERRED, GENERATED]), rng.randrange(1 << 40)
        assert order_key_int(turn, segment, index) == int(order_key(turn, segment, index))
