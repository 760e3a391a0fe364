"""The greedy selectors' Triton step kernels (`selection.kernels`) against the reference loops, on CPU.

The kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton compiles a kernel, so
in a subprocess); the CUDA graphs that replay them are tested in `test_gpu.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from raincheck_hf.selection import SelectionContext, Segment, Selector, get_selector
from raincheck_hf.selection.kernels import triton_available

# (segments B, tokens n, feature dim D, kept k, text rows m): n = 1, k = n, a batch of video slices,
# no text, odd sizes across the 32-column blocks and 64-row tiles
SIZES = [(1, 1, 8, 1, 3), (1, 40, 16, 40, 5), (2, 37, 16, 11, 5), (4, 48, 12, 14, 0), (1, 70, 24, 21, 40)]

SCRIPT = r"""
import json, sys, torch
from raincheck_hf.selection import kernels
from raincheck_hf.selection.cdpruner import cdpruner_inputs, conditional_kernel, dpp_greedy_map
from raincheck_hf.selection.divprune import divprune_greedy, divprune_inputs
from raincheck_hf.selection.mmtok import mmtok_greedy_group, mmtok_inputs

results = []
for B, n, D, k, m in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(42)
    f = torch.randn(B, n, D, generator=g)
    if n > 3:
        f[:, 3] = f[:, 1]  # a duplicate token: tied scores, broken towards the lower index
    text = torch.randn(m, D, generator=g) if m else None
    refs = {
        "mmtok": mmtok_greedy_group(f, text, k),  # (a group's coverage matrices in one call, as the kernels read)
        "divprune": torch.stack([divprune_greedy(x, k) for x in f]),
        "cdpruner": torch.stack([dpp_greedy_map(L, k, fallback_score=q)
                                 for L, q in (conditional_kernel(x, text, 0.5) for x in f)]),
    }
    inputs = {"mmtok": mmtok_inputs(f, text, 0.5, 0.02, 0.2), "divprune": divprune_inputs(f),
              "cdpruner": cdpruner_inputs(f, text, 0.5)}
    for method, want in refs.items():
        # mmtok: one launch (the winner's column read transposed or strided), or two launches a pick
        forms = [(True, True), (True, False), (False, True)]
        for one_launch, transposed in forms if method == "mmtok" else [(None, True)]:
            with kernels.mmtok_one_launch(one_launch), kernels.mmtok_transposed_column(transposed):
                got = kernels.greedy_select(method, inputs[method], k, use_graphs=False)
            results.append({"method": method, "one_launch": one_launch, "transposed": transposed,
                            "size": [B, n, D, k, m], "got": got.tolist(), "want": want.tolist()})
print(json.dumps(results))
"""


@pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs the kernels on CPU)")
def test_step_kernels_match_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(SIZES)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 5 * len(SIZES)
    for r in results:
        assert r["got"] == r["want"], (r["method"], r["one_launch"], r["transposed"], r["size"])


def test_cdpruner_fallback_is_the_reference_mapping():
    from raincheck_hf.selection.cdpruner import fallback_scores

    s = torch.tensor([3.0, 1.0, 2.0, 1.0])
    assert torch.allclose(fallback_scores(s), torch.tensor([-1.0, -2.0, -1.5, -2.0]))
    assert torch.equal(fallback_scores(torch.ones(3)), torch.full((3,), -2.0))  # no spread: all equal, lowest first


class _Counting(Selector):
    name = "counting"

    def __init__(self):
        self.groups = []

    def select_segment(self, segment, k, context):
        return torch.arange(k)

    def select_group(self, segments, k, context):
        self.groups.append([s.index for s in segments])
        return super().select_group(segments, k, context)


def _segment(i, n, d=4):
    return Segment(i, "video", torch.randn(n, d), (1, 1, n), torch.arange(n) + 100 * i)


def test_select_batches_runs_of_equal_segments_and_keeps_the_contract():
    selector = _Counting()
    segments = [_segment(0, 10), _segment(1, 10), _segment(2, 10), _segment(3, 7), _segment(4, 10), _segment(5, 1)]
    masks = selector.select(segments, 0.3, SelectionContext())
    assert selector.groups == [[0, 1, 2], [3], [4]]  # n = 1 keeps its one token without asking
    assert [int(m.sum()) for m in masks] == [3, 3, 3, 2, 3, 1]
    assert all(bool(m[:int(m.sum())].all()) for m in masks)


def test_greedy_selectors_on_cpu_use_the_reference():
    g = torch.Generator().manual_seed(1)
    segments = [Segment(i, "video", torch.randn(30, 8, generator=g), (1, 5, 6), torch.arange(30) + 30 * i)
                for i in range(3)]
    text = torch.randn(4, 8, generator=g)
    from raincheck_hf.selection.mmtok import group_coverage, mmtok_greedy, mmtok_greedy_group

    # a group of equal segments (a video's slices) is selected on its coverage matrices made in one batched call
    masks = get_selector("mmtok").select(segments, 0.3, SelectionContext(text_embeds=text))
    picks = mmtok_greedy_group(torch.stack([segment.features for segment in segments]), text, 9)
    for mask, pick in zip(masks, picks):
        want = torch.zeros(30, dtype=torch.bool)
        want[pick] = True
        assert torch.equal(mask, want)
    # ... whose values are each segment's own (to rounding); a group of one is the segment's own call exactly
    p_tv, p_vv = group_coverage(torch.stack([segment.features for segment in segments]), text, 0.02, 0.2)
    for b, segment in enumerate(segments):
        alone_tv, alone_vv = group_coverage(segment.features[None], text, 0.02, 0.2)
        torch.testing.assert_close(p_vv[b], alone_vv[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p_tv[b], alone_tv[0], rtol=1e-5, atol=1e-7)
        own = mmtok_greedy(segment.features, text, 9)
        assert torch.equal(mmtok_greedy_group(segment.features[None], text, 9)[0], own)


def test_one_launch_runs_go_one_after_the_other_on_a_cuda_device(monkeypatch):
    """mmtok's one-launch run has its programs wait for each other: two at once on a device could each hold what the
    other needs. They go one at a time (a lock, and a device-side wait on the last one's end); other runs do not."""
    import threading
    import time

    from raincheck_hf.selection import kernels

    events = []

    class Order:  # stands in for the device-side wait (`fast.scoping.StreamOrder`), which needs CUDA
        def wait(self, device=None):
            events.append("wait")

        def done(self, device=None):
            events.append("done")

    monkeypatch.setattr(kernels, "StreamOrder", Order)
    monkeypatch.setattr(kernels, "_WHOLE", {})
    inside, release, order = threading.Event(), threading.Event(), []

    def first():
        with kernels._one_at_a_time("cuda:0", True):
            order.append("first in")
            inside.set()
            release.wait(10)
            order.append("first out")

    def second():
        inside.wait(10)
        with kernels._one_at_a_time("cuda:0", True):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside.wait(10)
    time.sleep(0.2)
    with kernels._one_at_a_time("cuda:0", False), kernels._one_at_a_time("cpu", True):  # two-launch / CPU: no wait
        order.append("other")
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["first in", "other", "first out", "second in"]
    assert events == ["wait", "done", "wait", "done"]


def test_mmtok_transposed_column_names_a_bad_setting_and_is_scoped_to_its_block():
    import threading

    from raincheck_hf.selection import kernels

    with pytest.raises(ValueError, match="enabled=1 must be True or False"):
        with kernels.mmtok_transposed_column(1):
            pass
    seen = []
    with kernels.mmtok_transposed_column(False):
        seen.append(kernels._TRANSPOSED.get())
        thread = threading.Thread(target=lambda: seen.append(kernels._TRANSPOSED.get()))
        thread.start()
        thread.join()
    seen.append(kernels._TRANSPOSED.get())
    assert seen == [False, True, True]
    inputs = {"P": torch.zeros(1, 8, 4), "W": torch.zeros(8, dtype=torch.float64)}
    assert kernels._key("mmtok", inputs, 2) == kernels._key("mmtok", inputs, 2, None, True)
    assert kernels._key("mmtok", inputs, 2, None, False) != kernels._key("mmtok", inputs, 2)  # its own graph


def test_one_launch_grid_fits_the_multiprocessors_it_can_count_on(monkeypatch):
    """The one-launch run's programs must all be resident at once: at most one per multiprocessor of the device, or
    of the share CUDA MPS gives this process; a shape that would need more (or more registers) keeps two launches."""
    import types

    from raincheck_hf.selection import kernels

    monkeypatch.setattr(kernels.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    cuda = torch.device("cuda", 0)
    assert kernels.resident_programs(cuda) == 132
    assert kernels.whole_run_shape(1, 1344, 1408, cuda) == (84, 2048, 16, 16)  # the 1,344-token image, 58 text rows
    assert kernels.whole_run_shape(32, 192, 224, cuda) == (3, 256, 64, 8)  # 32 video slices, few text rows: 96
    assert kernels.whole_run_shape(32, 192, 608, cuda) is None  # ... with 397 text rows: 1,024 x 64 values a program
    assert kernels.whole_run_shape(200, 64, 96, cuda) is None  # more segments than multiprocessors
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")
    assert kernels.resident_programs(cuda) == 33
    assert kernels.whole_run_shape(1, 1344, 1408, cuda) is None  # 41 columns a program: too many values
    assert kernels.whole_run_shape(1, 500, 532, cuda) == (32, 1024, 16, 8)
    for shape in ((1, 500, 532), (4, 100, 132), (1, 1, 33)):
        programs = kernels.whole_run_shape(*shape, cuda)[0]
        assert shape[0] * programs <= 33
