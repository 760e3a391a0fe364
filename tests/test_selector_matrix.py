"""Model-dependent selectors (VisionZip, FastV) against the models' own eager attention, and every
registered selector through `generate(raincheck=...)` on tiny Qwen3-VL (and Qwen3.5 when present).

CPU, fp32, deterministic.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import raincheck_hf
import raincheck_hf.tiny as tiny
from raincheck_hf import RaincheckConfig
from raincheck_hf.integration import VisionAttentionCapture
from raincheck_hf.models import get_adapter
from raincheck_hf.selection import SelectionContext, Segment, get_selector, keep_count
from raincheck_hf.selection.fastv import FastVSelector, turn_last_row_attention
from raincheck_hf.selection.visionzip import VisionZipSelector, merged_received_attention

from conftest import INPUT_CASES, make_inputs, no_placeholder_ids
from families import BY_NAME, family_model, family_params, family_processor
from reference import TurnRecord, reference_logits

TOL = 1e-4
ATT_TOL = 1e-6






def greedy(model, inputs, n=6, **kw):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False, suppress_tokens=no_placeholder_ids(model), **kw)


def selected_per_segment(trace):
    """Per segment of the trace: the kept indices within the segment (sorted)."""
    out = []
    selected = set(trace.selected.tolist())
    for _modality, _grid, positions in trace.segments:
        out.append([i for i, p in enumerate(positions.tolist()) if p in selected])
    return out


# ---- eager ground truth for the last vision block -----------------------------------------------

class _RecordLastBlockAttention:
    """Wraps the modeling module's eager attention: keeps the weights the last vision block computes."""

    def __init__(self, monkeypatch, model):
        self.block_attn = model.model.visual.blocks[-1].attn
        self.weights: list[torch.Tensor] = []  # one [1, H, w, w] per window, in call order
        module = __import__(type(self.block_attn).__module__, fromlist=["_"])
        original = module.eager_attention_forward

        def wrapper(mod, *args, **kwargs):
            out, weights = original(mod, *args, **kwargs)
            if mod is self.block_attn:
                self.weights.append(weights.detach().float())
            return out, weights

        monkeypatch.setattr(module, "eager_attention_forward", wrapper)

    def merged_scores(self, start: int, stop: int, unit: int = 4) -> torch.Tensor:
        """Merged-token received attention of windows ``start:stop``, from the model's own weights."""
        patch = torch.cat([w[0].mean(dim=(0, 1)) for w in self.weights[start:stop]])
        return patch.view(-1, unit).sum(1)


def _window_order(model, grid):
    """Qwen2.5-VL's tower holds merged tokens window by window: the permutation back to source order
    (computed here with transformers' own helper), None for the other towers."""
    tower = model.model.visual
    if not hasattr(tower, "window_size"):
        return None
    from transformers.vision_utils import get_vision_window_index

    index, _ = get_vision_window_index(grid, tower.spatial_merge_size, tower.window_size, tower.patch_size)
    return torch.argsort(index)


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("case", ["two_images", "video"])
def test_visionzip_recomputation_matches_eager_block(monkeypatch, family, case):
    model, processor = family_model(family, "eager"), family_processor(family)
    assert model.config.vision_config._attn_implementation == "eager"
    inputs = make_inputs(processor, **INPUT_CASES[case])
    modality = "image" if case == "two_images" else "video"
    values, grid = (inputs["pixel_values"], inputs["image_grid_thw"]) if modality == "image" else (
        inputs["pixel_values_videos"], inputs["video_grid_thw"])
    recorder = _RecordLastBlockAttention(monkeypatch, model)
    with torch.no_grad(), VisionAttentionCapture(model, {f"{modality}_grid_thw": grid}) as capture:
        model.model.get_image_features(values, grid, return_dict=True)
    assert len(recorder.weights) == int(grid[:, 0].sum()) == 2  # one window per image / temporal slice
    got = merged_received_attention(capture[modality])
    want = recorder.merged_scores(0, len(recorder.weights))
    order = _window_order(model, grid)
    if order is not None:
        if case == "two_images":  # these images span several windows: the window order is not source order
            assert not torch.equal(order, torch.arange(order.numel()))
        want = want[order]
    assert got.shape == want.shape == (int(grid.prod(-1).sum()) // 4,)
    assert torch.allclose(got, want, atol=ATT_TOL, rtol=0)
    # hooks are gone after the call
    assert not model.model.visual.blocks[-1]._forward_pre_hooks and not model.model.visual._forward_pre_hooks


@pytest.mark.parametrize("case", ["two_images", "image_and_video"])
def test_visionzip_in_generate_keeps_the_most_attended_rows(monkeypatch, eager_model, processor, case):
    """All-dominant VisionZip through generate = per-segment top-k of the eager last-block attention.

    image_and_video has equal image and video grids: the capture must still tell the calls apart."""
    inputs = make_inputs(processor, **INPUT_CASES[case])
    recorder = _RecordLastBlockAttention(monkeypatch, eager_model)
    r = 0.5
    out = greedy(eager_model, inputs, n=2, return_dict_in_generate=True,
                 raincheck=RaincheckConfig(selector="visionzip", selector_kwargs={"dominant_fraction": 1.0},
                                           retention=r, mode="hard"))
    trace = out.raincheck
    n_image = int(inputs["image_grid_thw"][:, 0].sum())
    scores = {"image": recorder.merged_scores(0, n_image)}  # HF encodes images first, then videos
    if "video_grid_thw" in inputs:
        scores["video"] = recorder.merged_scores(n_image, len(recorder.weights))
    offsets = {"image": 0, "video": 0}
    for (modality, _grid, positions), kept in zip(trace.segments, selected_per_segment(trace)):
        n = positions.numel()
        seg = scores[modality][offsets[modality]:offsets[modality] + n]
        offsets[modality] += n
        k = keep_count(r, n)
        assert kept == sorted(torch.topk(seg, k).indices.tolist())
    assert not eager_model.model.visual.blocks[-1]._forward_pre_hooks


def _crafted_block(model):
    """The tiny model's last vision block with identity norm1, q = k = v = x, so attention is x x^T / sqrt(d)."""
    block_cls = type(model.model.visual.blocks[-1])
    block = block_cls(model.config.vision_config).eval()
    block.norm1 = nn.Identity()
    dim = model.config.vision_config.hidden_size
    with torch.no_grad():
        block.attn.qkv.weight.copy_(torch.cat([torch.eye(dim)] * 3))
        block.attn.qkv.bias.zero_()
    return block


def test_visionzip_crafted_dominant_and_contextual(model):
    """A known merged token receives most attention: it is the dominant pick; the rest are strided."""
    block = _crafted_block(model)
    dim, head_dim = model.config.vision_config.hidden_size, block.attn.head_dim
    sizes = [12, 8]  # two windows (segments) of merged tokens
    hot = [5, 2]  # the merged token of each window that all queries attend to
    x = torch.zeros(4 * sum(sizes), dim)
    x[:, 0] = 1.0
    base = 0
    for n, h in zip(sizes, hot):
        x[4 * (base + h): 4 * (base + h) + 4, 0] = 8.0
        x[4 * base: 4 * (base + n), 1] = 0.01 * torch.arange(4 * n)  # break exact ties between the others
        base += n
    cu = torch.tensor([0, 4 * sizes[0], 4 * sum(sizes)], dtype=torch.int32)
    record = {"block": block, "hidden_states": x, "cu_seqlens": cu, "merge_unit": 4,
              "query_key": get_adapter(model).vision_block_query_key,
              "position_embeddings": (torch.ones(x.shape[0], head_dim), torch.zeros(x.shape[0], head_dim))}
    scores = merged_received_attention(record)
    assert [int(scores[:sizes[0]].argmax()), int(scores[sizes[0]:].argmax())] == hot
    for window in (scores[:sizes[0]], scores[sizes[0]:]):  # each window's attention mass is 1
        assert torch.allclose(window.sum(), torch.tensor(1.0))

    segments = [Segment(i, "image", torch.randn(n, 8), (1, 1, n), torch.arange(n)) for i, n in enumerate(sizes)]
    context = SelectionContext(extras={"vision_captures": {"image": record},
                                       "turn": SimpleNamespace(segments=segments)})
    only_dominant = VisionZipSelector(dominant_fraction=1.0)
    assert [m.nonzero().flatten().tolist() for m in only_dominant.select(segments, 0.09, context)] == [[5], [2]]
    # k = 3 of 12: 1 dominant (row 5) + 2 strided of the 11 others: floor((i + .5) * 11 / 2) -> others[2], others[8]
    mixed = VisionZipSelector(dominant_fraction=1 / 3)
    assert mixed.split(3) == (1, 2)
    keep = mixed.select([segments[0]], 0.25, context)[0]
    assert keep.nonzero().flatten().tolist() == [2, 5, 9]


def test_visionzip_settings_and_errors():
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="dominant_fraction"):
            VisionZipSelector(dominant_fraction=bad)
    with pytest.raises(ValueError, match="query_chunk"):
        VisionZipSelector(query_chunk=0)
    assert VisionZipSelector().split(64) == (54, 10)
    seg = Segment(0, "image", torch.randn(8, 4), (1, 2, 4), torch.arange(8))
    with pytest.raises(ValueError, match="visionzip"):
        VisionZipSelector().select([seg], 0.5, SelectionContext())


# ---- FastV against the model's own eager attention ------------------------------------------------

def _stock_layer_attention(model, inputs, layer):
    """``[H, L, L]`` eager attention weights of text layer ``layer`` in a stock forward of the full prompt."""
    attn = model.model.language_model.layers[layer].self_attn
    seen = {}
    def keep(_module, _inputs, out):
        seen["w"] = out[1]

    handle = attn.register_forward_hook(keep)
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        handle.remove()
    return seen["w"][0], out


def _turn(model, inputs):
    adapter = get_adapter(model)
    return adapter.encode_turn(inputs["input_ids"][0], 0, image_grid_thw=inputs.get("image_grid_thw"),
                               video_grid_thw=inputs.get("video_grid_thw"), pixel_values=inputs.get("pixel_values"),
                               pixel_values_videos=inputs.get("pixel_values_videos"),
                               second_per_grid_ts=inputs.get("second_per_grid_ts"))


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("case", ["one_image", "image_and_video"])
def test_fastv_recomputation_matches_eager_weights(family, case):
    model, processor = family_model(family, "eager"), family_processor(family)
    inputs = make_inputs(processor, **INPUT_CASES[case])
    turn = _turn(model, inputs)
    got, layer = turn_last_row_attention(model, turn, None)
    # tiny Qwen3-VL(-MoE): DeepStack feeds layers 0-1, so K = 2; tiny Qwen3.5(-MoE): its one full-attention
    # layer, 2; tiny Qwen2.5-VL: no DeepStack, every layer attention, so K = 0
    assert layer == (0 if family == "qwen2_5_vl" else 2)
    weights, out = _stock_layer_attention(model, inputs, layer)
    if not BY_NAME[family].linear_attention:  # output_attentions agrees with the hook (all layers are attention)
        assert torch.equal(out.attentions[layer][0], weights)
    want = weights[:, -1].float().mean(0)
    assert got.shape == want.shape == (inputs["input_ids"].shape[1],)
    assert torch.allclose(got, want, atol=ATT_TOL, rtol=0)
    if family in ("qwen3_vl", "qwen2_5_vl"):
        got3, _ = turn_last_row_attention(model, turn, 3)
        want3 = _stock_layer_attention(model, inputs, 3)[0][:, -1].float().mean(0)
        assert torch.allclose(got3, want3, atol=ATT_TOL, rtol=0)


def test_fastv_selects_top_k_per_segment(eager_model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["image_and_video"])
    weights, _ = _stock_layer_attention(eager_model, inputs, 2)
    last = weights[:, -1].float().mean(0)
    r = 0.5
    out = greedy(eager_model, inputs, n=2, return_dict_in_generate=True,
                 raincheck=RaincheckConfig(selector="fastv", retention=r, mode="hard"))
    trace = out.raincheck
    for (_m, _g, positions), kept in zip(trace.segments, selected_per_segment(trace)):
        k = keep_count(r, positions.numel())
        assert kept == sorted(torch.topk(last[positions], k).indices.tolist())


def test_fastv_runs_one_scoring_pass_per_turn(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    calls = []
    handle = model.model.language_model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = greedy(model, inputs, n=1, return_dict_in_generate=True,
                     raincheck=RaincheckConfig(selector="fastv", retention=0.5))
    finally:
        handle.remove()
    assert len(out.raincheck.segments) == 2
    assert len(calls) == 2  # the scoring pass (both segments) + the prefill; n=1 has no decode forward


@pytest.mark.parametrize("name", ["visionzip", "fastv"])
def test_second_turn_matches_reference(model, processor, name):
    """A follow-up turn with a new image: the capture holds only that turn's image, FastV's scoring pass
    runs at the turn's absolute positions, and the logits still match docs/method.md §3's reference."""
    cfg = RaincheckConfig(selector=name, retention=0.3, chunk_size=3, decode_guard=2)
    first = make_inputs(processor, **INPUT_CASES["one_image"])
    out1 = greedy(model, first, n=4, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    turn = make_inputs(processor, images=(tiny.draw_test_image(64, 96, seed=9),), text="And the corner?")
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    glue = [eos] if out1.sequences[0, -1] != eos else []
    glue += processor.tokenizer("\n", add_special_tokens=False)["input_ids"]
    second = dict(turn)
    second["input_ids"] = torch.cat([out1.sequences, torch.tensor([glue]), turn["input_ids"]], dim=1)
    second["attention_mask"] = torch.ones_like(second["input_ids"])
    second.pop("mm_token_type_ids", None)
    out2 = greedy(model, second, n=4, raincheck=cfg, cache=out1.cache, return_dict_in_generate=True,
                  output_logits=True)
    records = [TurnRecord(first["input_ids"], out1, first["pixel_values"], first["image_grid_thw"]),
               TurnRecord(second["input_ids"], out2, second["pixel_values"], second["image_grid_thw"])]
    for rec, refs in zip(records, reference_logits(model, records)):
        for i, (got, want) in enumerate(zip(rec.output.logits, refs)):
            assert (got[0] - want).abs().max().item() <= TOL, (name, i)
    assert all(len(kept) == keep_count(0.3, p.numel()) for (_m, _g, p), kept in
               zip(out2.raincheck.segments, selected_per_segment(out2.raincheck)))


def test_fastv_settings_and_errors(model, processor):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="layer"):
            FastVSelector(layer=bad)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    for layer, message in ((1, "DeepStack"), (4, "has 4 layers")):
        with pytest.raises(ValueError, match=message):
            greedy(model, inputs, n=1, raincheck=RaincheckConfig(selector="fastv", selector_kwargs={"layer": layer}))


# ---- every registered selector through generate ----------------------------------------------------

MATRIX_CASES = ["one_image", "video"]


def test_new_selectors_are_registered():
    names = raincheck_hf.available_selectors()
    assert {"visionzip", "fastv", "mmtok", "uniform"} <= set(names)
    assert RaincheckConfig().selector == "mmtok"
    assert type(get_selector("visionzip")).__name__ == "VisionZipSelector"
    assert type(get_selector("fastv")).__name__ == "FastVSelector"


@pytest.mark.parametrize("family", family_params())
@pytest.mark.parametrize("case", MATRIX_CASES)
@pytest.mark.parametrize("name", raincheck_hf.available_selectors())
def test_every_selector_through_generate(family, case, name):
    model, processor = family_model(family), family_processor(family)
    linear = BY_NAME[family].linear_attention
    inputs = make_inputs(processor, **INPUT_CASES[case])
    r = 0.4
    traces, outs = {}, {}
    for mode in ("hard", "post_answer", "raincheck"):
        cfg = RaincheckConfig(selector=name, retention=r, mode=mode, chunk_size=3, decode_guard=1)
        # the selection happens before the prefill, so one token is enough to compare it; the raincheck
        # run also restores a chunk (guard 1) in each decode forward
        n = (2 if linear else 3) if mode == "raincheck" else 1
        outs[mode] = greedy(model, inputs, n=n, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
        traces[mode] = outs[mode].raincheck
    assert traces["raincheck"].restored_during_decode > 0
    trace = traces["raincheck"]
    assert trace.segments
    for (_m, _g, positions), kept in zip(trace.segments, selected_per_segment(trace)):
        assert len(kept) == max(1, round(r * positions.numel()))
    for mode in ("hard", "post_answer"):
        assert torch.equal(traces[mode].selected, trace.selected), mode
        assert torch.equal(traces[mode].deferred, trace.deferred), mode
    if not linear:  # docs/method.md §3's reference (attention-only text; Qwen3.5's GDN reference is in test_families)
        rec = TurnRecord(inputs["input_ids"], outs["raincheck"], inputs.get("pixel_values"),
                         inputs.get("image_grid_thw"), inputs.get("pixel_values_videos"), inputs.get("video_grid_thw"),
                         inputs.get("second_per_grid_ts"))
        refs = reference_logits(model, [rec])[0]
        assert len(refs) == len(rec.output.logits)
        for i, (got, want) in enumerate(zip(rec.output.logits, refs)):
            diff = (got[0] - want).abs().max().item()
            assert diff <= TOL, f"{name}: forward {i}: max abs logit diff {diff:.2e}"
