"""Every supported family through the same conversation-level tests (CPU, fp32, tiny models).

One shared list (`families.FAMILIES`): stock parity at retention 1 and ``full``, every mode against the
family's slow reference over three turns (images, a video, a text follow-up, with leftovers riding on
the next prefill), a `Conversation` with its background worker, and the fast path's code on CPU against
the eager engine. Family-specific checks (the GDN join, DeepStack, windowed vision attention) live in
the family's own test file.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raincheck_hf import Conversation, RaincheckConfig
from raincheck_hf.models import get_adapter
from raincheck_hf.plan import build_plan, input_rows_on_device
from raincheck_hf.tiny import draw_test_image, draw_test_video

from conftest import INPUT_CASES, assert_same_output, make_inputs, no_placeholder_ids, video_metadata
from families import family_model, family_params, family_processor
from reference import TurnRecord

TOL = 1e-4


def greedy(model, inputs, n, **kw):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False, suppress_tokens=no_placeholder_ids(model),
                          **kw)


def record(inputs, out):
    return TurnRecord(inputs["input_ids"], out, inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                      inputs.get("pixel_values_videos"), inputs.get("video_grid_thw"),
                      inputs.get("second_per_grid_ts"))


def follow_up(model, processor, sequences, **turn):
    """The whole conversation for the next turn: earlier ``sequences``, the adapter's turn glue, the new turn."""
    new = dict(make_inputs(processor, **turn))
    glue = get_adapter(model).turn_glue(processor.tokenizer, int(sequences[0, -1]))
    ids = torch.cat([sequences, torch.tensor([glue]), new["input_ids"]], dim=1)
    new.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    new.pop("mm_token_type_ids", None)
    return new


def assert_matches(family, model, records):
    refs = family.reference()(model, records)
    for k, (rec, ref) in enumerate(zip(records, refs)):
        assert len(rec.output.logits) == len(ref)
        for i, (got, want) in enumerate(zip(rec.output.logits, ref)):
            diff = (got[0] - want).abs().max().item()
            assert diff <= TOL, f"{family.name}: turn {k} forward {i}: max abs logit diff {diff:.2e}"


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("case", ["two_images", "video", "image_and_video"])
def test_retention_one_and_full_are_stock(family, case):
    _, model, processor = family
    inputs = make_inputs(processor, **INPUT_CASES[case])
    stock = greedy(model, inputs, n=8)
    assert torch.equal(greedy(model, inputs, n=8, raincheck=RaincheckConfig(retention=1.0)), stock)
    assert torch.equal(greedy(model, inputs, n=8, raincheck=RaincheckConfig(mode="full")), stock)


# Seconds per temporal patch of the tiny processors' videos (2 frames per patch) at these frame rates: 4, 2.5, 1, 0.5.
# Qwen2.5-VL spaces a video's temporal positions by tokens_per_second (2 in the tiny config) x those seconds, so
# at 0.5 and 0.8 fps they run past the text that follows the video; 2 and 4 fps are the ordinary case around it.
VIDEO_FPS = [0.5, 0.8, 2.0, 4.0]


def _low_fps_video_inputs(model, processor, fps: float):
    """One twelve-frame video at ``fps`` and a short question. At 0.5-1 fps (Qwen2.5-VL spaces its temporal
    positions by ``tokens_per_second / fps`` per temporal patch) the video's positions run past the text that
    follows it, so the prompt's largest position is not its last token's."""
    inputs = make_inputs(processor, videos=(draw_test_video(12, 64, 96, seed=5),), text="What happens?", video_fps=fps)
    if "second_per_grid_ts" in inputs:  # Qwen2.5-VL's processor: temporal patch size / fps
        assert inputs["second_per_grid_ts"].tolist() == [pytest.approx(2 / fps)]
    return inputs


def _positions_run_past_the_text(model, inputs) -> bool:
    from reference import rope_index

    ids = inputs["input_ids"][0]
    cfg = model.config
    mm_types = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    positions = rope_index(model, ids, mm_types, [record(inputs, None)])
    return int(positions.max()) > int(positions[:, -1].max())


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("fps", VIDEO_FPS)
def test_low_fps_video_retention_one_and_full_are_stock(family, fps):
    """Issue 28: stock `generate` puts generated token t at the last prompt token's position + t (it advances
    the position ids column by column), which is not the prompt's largest position + t when a video's temporal
    positions run past the text after it (Qwen2.5-VL at low fps). The eager engine and the fast path's code."""
    fam, model, processor = family
    inputs = _low_fps_video_inputs(model, processor, fps)
    if fam.name == "qwen2_5_vl":
        assert _positions_run_past_the_text(model, inputs) == (fps < 1)  # the case this test is about
    kw = dict(return_dict_in_generate=True, output_logits=True)
    stock = greedy(model, inputs, n=8, **kw)
    for cfg in (RaincheckConfig(retention=1.0, fast_path=False), RaincheckConfig(mode="full", fast_path=False),
                RaincheckConfig(retention=1.0, fast_path=True)):
        assert_same_output(greedy(model, inputs, n=8, raincheck=cfg, **kw), stock, TOL)


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("fps", VIDEO_FPS)
def test_low_fps_video_matches_reference_over_two_turns(family, fps):
    """Retention 0.3 on a low-fps video, then a text follow-up (leftovers on its prefill): every forward against
    the family's slow reference, whose positions are the model's own rope index over the whole dialogue; the
    eager engine and the fast path's code."""
    fam, model, processor = family
    for fast_path in (False, True):
        cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=2, fast_path=fast_path)
        kw = dict(raincheck=cfg, return_dict_in_generate=True, output_logits=True)
        inputs = [_low_fps_video_inputs(model, processor, fps)]
        outs = [greedy(model, inputs[0], n=6, **kw)]
        assert outs[0].raincheck.pending.numel() > 0  # leftovers ride on the follow-up's prefill
        inputs.append(follow_up(model, processor, outs[0].sequences, text="And then?"))
        outs.append(greedy(model, inputs[1], n=5, cache=outs[0].cache, **kw))
        assert_matches(fam, model, [record(i, o) for i, o in zip(inputs, outs)])


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("fps", [0.5, 0.8])
def test_low_fps_video_follow_up_in_conversation_is_stock_on_the_whole_dialogue(family, fps):
    """A `Conversation` at retention 1: a low-fps video turn, then a text follow-up. The follow-up's answer equals
    stock `generate` run on the whole dialogue (the first turn's video, its answer, the follow-up), so the next turn
    continues where the rope index over the whole dialogue puts it: after the answer's last token, not after the
    video's largest temporal position."""
    fam, model, processor = family
    video = draw_test_video(12, 64, 96, seed=5)
    kw = dict(output_logits=True, suppress_tokens=no_placeholder_ids(model))
    with Conversation(model, processor, RaincheckConfig(retention=1.0), max_new_tokens=6, background=False) as conv:
        conv.ask("What happens?", videos=[video], video_fps=fps, **kw)
        second = conv.ask("And then?", **kw)
    sequences = second.output.sequences
    dialogue = sequences[:, : sequences.shape[1] - second.token_ids.numel()]
    inputs = dict(_low_fps_video_inputs(model, processor, fps))  # the first turn's video (and its seconds per patch)
    cfg = model.config
    inputs.update(input_ids=dialogue, attention_mask=torch.ones_like(dialogue),
                  mm_token_type_ids=(dialogue == cfg.image_token_id).long() + 2 * (dialogue == cfg.video_token_id).long())
    stock = greedy(model, inputs, n=6, return_dict_in_generate=True, output_logits=True)
    assert_same_output(second.output, stock, TOL)


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen2_5_vl")))
def test_low_fps_videos_in_a_batch_are_stock(name):
    """A batch of two left-padded prompts with videos at 0.5 and 0.8 fps (the batched eager engine): each generated
    token sits after its own row's last prompt token, as stock `generate` on the same batch puts it."""
    model, processor = family_model(name), family_processor(name)
    videos = [draw_test_video(12, 64, 96, seed=5), draw_test_video(8, 64, 64, seed=6)]
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": q}]}],
                                           add_generation_prompt=True, tokenize=False)
             for q in ("What happens?", "And here, what is it?")]
    inputs = processor(text=texts, videos=videos, return_tensors="pt", padding=True, padding_side="left",
                       videos_kwargs={"video_metadata": [video_metadata(12, 0.5), video_metadata(8, 0.8)]})
    assert int((inputs["attention_mask"] == 0).sum()) > 0
    kw = dict(return_dict_in_generate=True, output_logits=True)
    stock = greedy(model, inputs, n=8, **kw)
    for cfg in (RaincheckConfig(retention=1.0), RaincheckConfig(mode="full")):
        assert_same_output(greedy(model, inputs, n=8, raincheck=cfg, **kw), stock, TOL)


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("mode", ["raincheck", "serial", "hard", "post_answer"])
def test_every_mode_matches_reference_over_three_turns(family, mode):
    """Turn 1: an image and a video; turn 2: a four-frame video at 4 fps (two temporal slices) with turn 1's leftovers
    in its prefill; turn 3: text only. Every forward's logits against the family's slow reference."""
    _three_turns_match_reference(family, RaincheckConfig(mode=mode, retention=0.3, chunk_size=2, decode_guard=3))


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("order", ["relevance", "attention"])
@pytest.mark.parametrize("mode", ["raincheck", "serial"])
def test_restore_orders_match_reference_over_three_turns(family, order, mode):
    """The same conversation with the deferred rows restored out of source order (Qwen3.5: the GDN join takes
    the chunks in restoration order); the reference puts them in that order (`reference.restoration_place`)."""
    outs = _three_turns_match_reference(family, RaincheckConfig(mode=mode, retention=0.3, chunk_size=2,
                                                                decode_guard=3, restore_order=order))
    for out in outs[:2]:
        trace = out.raincheck
        restored = torch.cat([r for r in trace.restored_per_forward[1:]] + [trace.pending]).tolist()
        assert sorted(restored) == trace.deferred.tolist() and restored != trace.deferred.tolist()


def _three_turns_match_reference(family, cfg):
    fam, model, processor = family
    mode = cfg.mode
    kw = dict(raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    inputs = [make_inputs(processor, **INPUT_CASES["image_and_video"])]
    outs = [greedy(model, inputs[0], n=5, **kw)]
    assert outs[0].raincheck.deferred.numel() > 0
    if mode == "raincheck":
        assert outs[0].raincheck.restored_during_decode > 0
    # 4 fps: half a second per temporal patch, so Qwen2.5-VL's rope index must be given second_per_grid_ts
    inputs.append(follow_up(model, processor, outs[0].sequences, videos=(draw_test_video(4, 64, 96, seed=8),),
                            text="What happens now?", video_fps=4.0))
    outs.append(greedy(model, inputs[1], n=6, cache=outs[0].cache, **kw))
    if mode != "hard":
        assert outs[1].raincheck.restored_per_forward[0].numel() > 0  # turn 1's leftovers ride on the prefill
    assert len(outs[1].raincheck.segments) == 2  # one segment per temporal slice
    inputs.append(follow_up(model, processor, outs[1].sequences, text="And the colours?"))
    outs.append(greedy(model, inputs[2], n=5, cache=outs[1].cache, **kw))
    assert_matches(fam, model, [record(i, o) for i, o in zip(inputs, outs)])
    return outs


@pytest.mark.parametrize("family", family_params(), indirect=True)
def test_conversation_with_background_worker_matches_reference(family):
    fam, model, processor = family
    images = [draw_test_image(128, 96, seed=1), draw_test_image(64, 96, seed=9)]
    with Conversation(model, processor, RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=4),
                      max_new_tokens=6) as conv:
        first = conv.ask("What is in this image?", images=images[:1], output_logits=True,
                         suppress_tokens=no_placeholder_ids(model))
        assert first.trace.deferred.numel() > 0
        conv.ask("And this one?", images=images[1:], output_logits=True, suppress_tokens=no_placeholder_ids(model))
    records = []
    for turn, image in zip(conv.turns, images):
        pixels = processor.image_processor(images=[image], return_tensors="pt")
        ids = turn.output.sequences[:, : turn.output.sequences.shape[1] - turn.token_ids.numel()]
        records.append(TurnRecord(ids, turn.output, pixels["pixel_values"], pixels["image_grid_thw"]))
    assert_matches(fam, model, records)


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("mode", ["raincheck", "full"])
def test_fast_path_code_matches_eager_engine(family, mode):
    """``fast_path=True`` on CPU: static KV slots for families with ``supports_fast_path`` (no graphs on CPU),
    the precomputed vision-tower call for every family; same tokens and logits as ``fast_path=False``."""
    from raincheck_hf.fast import StaticDeferredCache

    _, model, processor = family
    inputs = make_inputs(processor, **INPUT_CASES["image_and_video"])
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True,
              suppress_tokens=no_placeholder_ids(model))
    cfg = dict(mode=mode, chunk_size=4, decode_guard=2)
    slow = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, **cfg), **kw)
    fast = model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, **cfg), **kw)
    assert isinstance(fast.cache, StaticDeferredCache) == get_adapter(model).supports_fast_path
    assert torch.equal(slow.sequences, fast.sequences)
    for a, b in zip(slow.logits, fast.logits):
        assert (a - b).abs().max() <= 1e-5
    assert [r.tolist() for r in slow.raincheck.restored_per_forward] == [
        r.tolist() for r in fast.raincheck.restored_per_forward]


def test_moe_experts_decide_whether_steps_can_be_captured(monkeypatch):
    """transformers' grouped_mm experts are one device kernel in bfloat16 only; in fp32, or with the eager
    experts, a step reads the device back to the host: auto picks the eager engine on CUDA then, and
    `fast_path=True` keeps the static slots without captures."""
    from families import BY_NAME

    import raincheck_hf

    model = raincheck_hf.enable(BY_NAME["qwen3_vl_moe"].build(seed=0))
    adapter = get_adapter(model)
    monkeypatch.setattr(type(adapter), "device", property(lambda self: torch.device("cuda")))
    assert "bfloat16" in adapter.step_graph_blocker()
    assert adapter.execution_path(RaincheckConfig()) == "eager"
    assert adapter.execution_path(RaincheckConfig(fast_path=True)) == "fast"
    model.to(torch.bfloat16)
    assert adapter.step_graph_blocker() is None
    assert adapter.execution_path(RaincheckConfig()) == "fast"
    model.set_experts_implementation("eager")
    assert "'eager'" in adapter.step_graph_blocker()
    assert adapter.execution_path(RaincheckConfig()) == "eager"
    dense = get_adapter(raincheck_hf.enable(BY_NAME["qwen3_vl"].build(seed=0)))
    assert dense.step_graph_blocker() is None


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("case", ["one_image", "video"])
def test_prompt_ending_with_a_placeholder_is_refused(family, case):
    """A prompt cut after its last ``<|image_pad|>`` / ``<|video_pad|>``: the answer would start from a placeholder
    row (which the selection may defer), and stock `generate` would continue each M-RoPE axis of it separately.
    A clear error instead of an answer that differs from stock."""
    _, model, processor = family
    inputs = dict(make_inputs(processor, **INPUT_CASES[case]))
    ids = inputs["input_ids"]
    placeholder = model.config.image_token_id if case == "one_image" else model.config.video_token_id
    last = int((ids[0] == placeholder).nonzero().max())
    inputs.update(input_ids=ids[:, : last + 1], attention_mask=inputs["attention_mask"][:, : last + 1])
    inputs.pop("mm_token_type_ids", None)
    kind = "image" if case == "one_image" else "video"
    with pytest.raises(ValueError, match=rf"ends with a <\|{kind}_pad\|> placeholder"):
        greedy(model, inputs, n=2, raincheck=RaincheckConfig(retention=1.0))


@pytest.mark.parametrize("family", family_params(), indirect=True)
@pytest.mark.parametrize("case", ["two_images", "image_and_video"])
def test_a_turns_rows_worked_out_on_the_host_equal_the_reference(family, case):
    """`ModelAdapter.rows` with host row indexes (a plan's) works out which rows are visual and their DeepStack rows
    on the host (`TurnInputs.visual_rows`), so nothing waits for the device; against `rows_reference` (read from the
    device's ``visual_index``) on random subsets in random order, the empty one, every row, and text rows only:
    embeddings, positions, visual flags and DeepStack rows equal."""
    fam, model, processor = family
    adapter = get_adapter(model)
    inputs = make_inputs(processor, **INPUT_CASES[case])
    with torch.no_grad():
        turn = adapter.encode_turn(inputs["input_ids"][0], 0, image_grid_thw=inputs.get("image_grid_thw"),
                                   video_grid_thw=inputs.get("video_grid_thw"), pixel_values=inputs.get("pixel_values"),
                                   pixel_values_videos=inputs.get("pixel_values_videos"))
    assert turn.visual_rows is not None and turn.num_visual > 0
    n = turn.visual_index.shape[0]
    generator = torch.Generator().manual_seed(0)
    picks = [torch.randperm(n, generator=generator)[:k] for k in (1, 5, n // 3, n // 2)]
    picks += [torch.arange(0), torch.arange(n), turn.text_rows.cpu(), turn.visual_rows[::2].flip(0)]
    for rows in picks:
        got, want = adapter.rows(turn, rows), adapter.rows_reference(turn, rows)
        assert torch.equal(got.embeds, want.embeds) and torch.equal(got.positions, want.positions)
        assert torch.equal(got.visual, want.visual) and got.visual.dtype == torch.bool
        # the visual rows' indices, moved with the rows' index (the fast path's DeepStack fill reads nothing back)
        assert torch.equal(got.visual_rows, want.visual.nonzero().flatten()) and want.visual_rows is None
        assert (got.deepstack is None) == (want.deepstack is None) == (turn.deepstack is None), fam.name
        for a, b in zip(got.deepstack or [], want.deepstack or []):
            assert torch.equal(a, b)
        # the flags a batched sequence keeps on the host, from the host rows and from the device's index alike
        unknown = dataclasses.replace(turn, visual_rows=None, host_ids=None)
        assert torch.equal(turn.visual_flags_on_host(rows), want.visual.cpu())
        assert torch.equal(unknown.visual_flags_on_host(rows), want.visual.cpu())
    assert torch.equal(turn.ids_on_host(), inputs["input_ids"][0]) and turn.host_ids is not None
    # a turn's first forward on the fast path: its input rows chosen from a keep-mask where the selection made it
    # (`plan.input_rows_on_device`) and gathered there (`rows_from_device_index`, the visual count known), without
    # reading anything back: the plan's rows and `rows_reference`'s batch, on random keep-masks
    for kept in (0, 1, turn.num_visual // 3, turn.num_visual):
        keep = torch.zeros(turn.num_visual, dtype=torch.bool)
        keep[torch.randperm(turn.num_visual, generator=generator)[:kept]] = True
        plan = build_plan(turn, keep, 2, 7)
        rows = input_rows_on_device(turn, keep, kept)
        assert torch.equal(rows, plan.input_rows)
        got, want = adapter.rows_from_device_index(turn, rows, kept), adapter.rows_reference(turn, plan.input_rows)
        assert torch.equal(got.embeds, want.embeds) and torch.equal(got.positions, want.positions)
        assert torch.equal(got.visual, want.visual) and torch.equal(got.visual_rows, want.visual.nonzero().flatten())
        for a, b in zip(got.deepstack or [], want.deepstack or []):
            assert torch.equal(a, b)
    assert torch.equal(dataclasses.replace(turn, host_ids=None).ids_on_host(), inputs["input_ids"][0])
