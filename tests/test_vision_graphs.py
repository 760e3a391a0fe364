"""The fast path's vision tower (`raincheck_hf.fast.vision_graphs`): the precomputed-bookkeeping call it
captures computes what stock ``get_image_features`` computes, the capture policy, and the routing of
pixels around HF's eager encoding. Graph replay itself is checked on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from raincheck_hf import RaincheckConfig
from raincheck_hf.fast import vision_graphs
from raincheck_hf.fast.vision_graphs import VisionGraphs
from raincheck_hf.models import get_adapter

from conftest import INPUT_CASES, make_inputs
from families import family_model, family_params, family_processor


PRECOMPUTED = {"interp_indices", "interp_weights", "position_ids", "cu_seqlens", "max_seqlen", "window_index",
               "cu_window_seqlens", "max_window_seqlen"}  # what transformers.vision_utils pops


def _stock(model, pixel_values, grid, modality):
    inner = model.model
    encode = inner.get_image_features if modality == "image" else inner.get_video_features
    return encode(pixel_values, grid, return_dict=True)


def _assert_same_features(stock, ours):
    assert [t.shape for t in ours.pooler_output] == [t.shape for t in stock.pooler_output]
    for a, b in zip(stock.pooler_output, ours.pooler_output):
        assert torch.equal(a, b)
    stock_deepstack = getattr(stock, "deepstack_features", None)
    if not stock_deepstack:
        assert ours.deepstack_features is None
        return
    assert len(ours.deepstack_features) == len(stock_deepstack)
    for layer_a, layer_b in zip(stock_deepstack, ours.deepstack_features):
        for a, b in zip(layer_a, layer_b):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_precomputed_tower_call_matches_stock_features(family, case):
    model, processor = family_model(family), family_processor(family)
    inputs = make_inputs(processor, **INPUT_CASES[case])
    adapter = get_adapter(model)
    grid = inputs.get("image_grid_thw", inputs.get("video_grid_thw"))
    # only names the towers pop from their kwargs (a misspelt one would be recomputed and go unnoticed)
    assert set(adapter.vision_grid_kwargs(adapter.vision_tower, grid)) <= PRECOMPUTED
    graphs = VisionGraphs(get_adapter(model), use_graphs=False)
    with torch.no_grad():
        for modality, values, grid in (("image", "pixel_values", "image_grid_thw"),
                                       ("video", "pixel_values_videos", "video_grid_thw")):
            if grid not in inputs:
                continue
            stock = _stock(model, inputs[values], inputs[grid], modality)
            _assert_same_features(stock, graphs.encode(inputs[values], inputs[grid]))


def test_grid_kwargs_match_what_the_tower_computes(model):
    from transformers.vision_utils import get_vision_position_ids

    tower = model.model.visual
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])
    kwargs = get_adapter(model).vision_grid_kwargs(tower, grid)
    assert torch.equal(kwargs["position_ids"], get_vision_position_ids(grid, tower.spatial_merge_size))
    # SDPA reads only the window lengths: they stay on the host (a device tensor would be read back in the graph)
    assert kwargs["cu_seqlens"].device.type == "cpu"
    assert kwargs["cu_seqlens"].tolist() == [0, 96, 112, 128]


class _FakeGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


def _fake_capture(log):
    def capture(self, tower, key, pixel_values, grid_thw, kwargs):
        log.append(("capture", key[0]))
        outputs = self._forward(tower, pixel_values.clone(), grid_thw, kwargs)
        return self._store(key, vision_graphs.CapturedTower(_FakeGraph(log), pixel_values.clone(), outputs))
    return capture


def test_a_grid_is_captured_on_its_second_sighting_and_the_oldest_is_evicted(model, processor, monkeypatch):
    log = []
    monkeypatch.setattr(VisionGraphs, "_capture", _fake_capture(log))
    monkeypatch.setattr(vision_graphs, "MAX_GRAPHS", 2)
    graphs = VisionGraphs(get_adapter(model), use_graphs=True)
    from raincheck_hf.tiny import draw_test_image

    sizes = [(64, 64), (96, 64), (128, 96)]
    inputs = [make_inputs(processor, images=(draw_test_image(w, h, seed=1),)) for w, h in sizes]
    with torch.no_grad():
        first = graphs.encode(inputs[0]["pixel_values"], inputs[0]["image_grid_thw"])
        assert log == []  # first sighting: eager, nothing captured
        again = graphs.encode(inputs[0]["pixel_values"], inputs[0]["image_grid_thw"])
        assert log == [("capture", ((1, 4, 4),)), "replay"]
        assert torch.equal(first.pooler_output[0], again.pooler_output[0])
        graphs.encode(inputs[0]["pixel_values"], inputs[0]["image_grid_thw"])
        assert log[-2:] == ["replay", "replay"] and len(log) == 3  # replayed, not captured again
        for _ in range(2):
            for x in inputs[1:]:
                graphs.encode(x["pixel_values"], x["image_grid_thw"])
    assert len(graphs._captured) == 2  # the least recently used grid was evicted
    assert ((1, 4, 4),) not in [key[0] for key in graphs._captured]


def test_replayed_outputs_are_copies(model, processor, monkeypatch):
    monkeypatch.setattr(VisionGraphs, "_capture", _fake_capture([]))
    graphs = VisionGraphs(get_adapter(model), use_graphs=True)
    x = make_inputs(processor, **INPUT_CASES["one_image"])
    with torch.no_grad():
        for _ in range(2):
            out = graphs.encode(x["pixel_values"], x["image_grid_thw"])
    (captured,) = graphs._captured.values()
    pooled, _deepstack = captured.outputs
    assert out.pooler_output[0].data_ptr() != pooled.data_ptr()


def test_fast_path_encodes_pixels_itself_and_eager_path_lets_hf_encode(model, processor, monkeypatch):
    calls = []
    original = model.model.get_image_features

    def counting(*args, **kwargs):
        calls.append("hf")
        return original(*args, **kwargs)

    monkeypatch.setattr(model.model, "get_image_features", counting)
    encode = VisionGraphs.encode

    def counting_encode(self, *args, **kwargs):
        calls.append("graphs")
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(VisionGraphs, "encode", counting_encode)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    kw = dict(max_new_tokens=3, do_sample=False)
    model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True), **kw)
    assert calls == ["graphs"]
    calls.clear()
    model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False), **kw)
    assert calls == ["hf"]
    calls.clear()
    # a selector that reads the tower's attention needs the eager tower (its hooks do not fire on a replay)
    model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, selector="visionzip"), **kw)
    assert calls == ["hf"]


def test_pixels_and_precomputed_features_together_are_refused(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    with pytest.raises(ValueError, match="both"):
        model.generate(**inputs, mm_encoder_outputs={"image": features}, max_new_tokens=2,
                       raincheck=RaincheckConfig(fast_path=True))


def test_freed_tower_is_reported(model):
    graphs = VisionGraphs(get_adapter(model), use_graphs=False)
    graphs.tower_ref = lambda: None
    with pytest.raises(RuntimeError, match="freed"):
        graphs.encode(torch.zeros(4, 4), torch.tensor([[1, 2, 2]]))


def test_vision_graphs_for_is_one_per_tower(model, qwen35):
    a = vision_graphs.vision_graphs_for(get_adapter(model))
    assert vision_graphs.vision_graphs_for(get_adapter(model)) is a
    assert vision_graphs.vision_graphs_for(get_adapter(qwen35)) is not a
    vision_graphs.release_vision_graphs(model.model.visual)
    assert vision_graphs.vision_graphs_for(get_adapter(model)) is not a


def test_concurrent_encodes_of_one_grid_each_get_their_own_features(model, processor, monkeypatch):
    """Copy-in, replay and copy-out are one unit: a replay that reads the static pixels while another
    thread copies its own in would return the other image's features."""
    import threading
    import time

    def capture(self, tower, key, pixel_values, grid_thw, kwargs):
        static_pixels = pixel_values.clone()
        outputs = self._forward(tower, static_pixels, grid_thw, kwargs)

        class SlowGraph:  # like a replay: recomputes the static outputs from the static pixels, after a while
            def replay(self_graph):
                time.sleep(0.05)  # the other thread runs meanwhile
                pooled, deepstack = self._forward(tower, static_pixels, grid_thw, kwargs)
                outputs[0].copy_(pooled)
                for out, new in zip(outputs[1], deepstack):
                    out.copy_(new)

        return self._store(key, vision_graphs.CapturedTower(SlowGraph(), static_pixels, outputs))

    monkeypatch.setattr(VisionGraphs, "_capture", capture)
    graphs = VisionGraphs(get_adapter(model), use_graphs=True)
    from raincheck_hf.tiny import draw_test_image

    images = [make_inputs(processor, images=(draw_test_image(96, 64, seed=s),)) for s in (11, 12)]
    with torch.no_grad():
        for _ in range(2):  # captured on the second sighting
            graphs.encode(images[0]["pixel_values"], images[0]["image_grid_thw"])
        want = [_stock(model, x["pixel_values"], x["image_grid_thw"], "image").pooler_output[0] for x in images]
        got = [None, None]

        def encode(i):
            with torch.no_grad():
                got[i] = graphs.encode(images[i]["pixel_values"], images[i]["image_grid_thw"]).pooler_output[0]

        threads = [threading.Thread(target=encode, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not torch.equal(want[0], want[1])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_a_failed_capture_turns_the_towers_graphs_off_and_the_warm_up_says_why(model, processor, monkeypatch):
    """A tower capture that raises (an op that cannot be captured, or no device memory for it) warns, answers eagerly
    with the same features, and turns this tower's graphs off (`VisionGraphs.failure` says why); `warm_up` reports
    it in its summary (``vision_failure``) instead of silently warming no grid."""
    import raincheck_hf
    from raincheck_hf.fast.vision_graphs import vision_graphs_for
    from raincheck_hf.tiny import draw_test_image

    def refused(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(VisionGraphs, "_capture", refused)
    graphs = vision_graphs_for(get_adapter(model))
    graphs.use_graphs, graphs.failure = True, None  # (as on CUDA)
    graphs._captured.clear()
    graphs.seen.clear()
    x = make_inputs(processor, images=(draw_test_image(128, 96, seed=3),))
    try:
        with torch.no_grad():
            want = graphs.encode(x["pixel_values"], x["image_grid_thw"])
            with pytest.warns(RuntimeWarning, match="capture of the vision tower failed"):
                got = graphs.encode(x["pixel_values"], x["image_grid_thw"])  # second sighting: the capture raises
        assert torch.equal(want.pooler_output[0], got.pooler_output[0])
        assert not graphs.use_graphs
        assert graphs.failure == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
        summary = raincheck_hf.warm_up(model, processor, RaincheckConfig(fast_path=True), max_tokens=512,
                                       image_sizes=[(96, 128)], cache_dir=False, progress=False)
        assert summary.vision == [] and summary.vision_failure == graphs.failure
    finally:
        graphs.use_graphs, graphs.failure = False, None  # (the model's tower as a CPU model has it)
