"""End-to-end behaviour of `generate(raincheck=...)` on a tiny Qwen3-VL (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import raincheck_hf
from raincheck_hf import RaincheckConfig, restore_pending
from raincheck_hf.tiny import draw_test_image

from conftest import INPUT_CASES, make_inputs
from reference import TurnRecord, reference_logits

TOL = 1e-4


def greedy(model, inputs, n=12, **kw):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False, **kw)


def record(inputs, out):
    return TurnRecord(inputs["input_ids"], out, inputs.get("pixel_values"), inputs.get("image_grid_thw"),
                      inputs.get("pixel_values_videos"), inputs.get("video_grid_thw"))


def assert_matches_reference(model, records):
    refs = reference_logits(model, records)
    for k, (rec, ref) in enumerate(zip(records, refs)):
        assert len(rec.output.logits) == len(ref)
        for i, (got, want) in enumerate(zip(rec.output.logits, ref)):
            diff = (got[0] - want).abs().max().item()
            assert diff <= TOL, f"turn {k} forward {i}: max abs logit diff {diff:.2e}"


# ---- identical to stock -------------------------------------------------------------------------

def test_retention_one_is_stock(model, case_inputs):
    assert torch.equal(greedy(model, case_inputs, raincheck=RaincheckConfig(retention=1.0)), greedy(model, case_inputs))


def test_full_mode_is_stock(model, case_inputs):
    assert torch.equal(greedy(model, case_inputs, raincheck=RaincheckConfig(mode="full")), greedy(model, case_inputs))


def test_text_only_prompt_is_stock(model, processor):
    msgs = [{"role": "user", "content": "Say something about glyphs."}]
    inputs = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    for mode in ("raincheck", "hard", "post_answer", "serial"):
        assert torch.equal(greedy(model, inputs, raincheck=RaincheckConfig(mode=mode, retention=0.2)),
                           greedy(model, inputs))


def test_without_keyword_generate_is_untouched(processor):
    from raincheck_hf.tiny import build_tiny_qwen3_vl

    plain = build_tiny_qwen3_vl(seed=0)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    before = greedy(plain, inputs)
    raincheck_hf.enable(plain)
    raincheck_hf.enable(plain)  # idempotent
    assert torch.equal(greedy(plain, inputs), before)
    assert torch.equal(greedy(plain, inputs, raincheck=False), before)
    raincheck_hf.disable(plain)
    assert "generate" not in vars(plain)
    with pytest.raises(ValueError, match="raincheck"):
        greedy(plain, inputs, raincheck=True)  # HF rejects the unknown kwarg once disabled


# ---- the reference semantics of docs/method.md §3 --------------------------------------------------

SETTINGS = [
    pytest.param(0.3, 5, 2, id="r0.3-c5-g2"),
    pytest.param(0.3, 4, 0, id="r0.3-c4-g0"),  # chunk size not dividing the deferred count, guard 0
    pytest.param(0.0, 7, 1, id="r0-c7-g1"),
    pytest.param(0.5, 3, 3, id="r0.5-c3-g3"),
]


@pytest.mark.parametrize("retention,chunk,guard", SETTINGS)
def test_raincheck_matches_reference(model, case_inputs, retention, chunk, guard):
    cfg = RaincheckConfig(retention=retention, chunk_size=chunk, decode_guard=guard)
    out = greedy(model, case_inputs, n=14, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    trace = out.raincheck
    assert trace.restored_during_decode > 0 or trace.deferred.numel() == 0
    for i, restored in enumerate(trace.restored_per_forward[1:], start=1):
        if i < max(guard, 1):
            assert restored.numel() == 0, "a chunk ran before the decode guard"
        assert restored.numel() <= chunk
    assert_matches_reference(model, [record(case_inputs, out)])


@pytest.mark.parametrize("every,guard", [(3, 1), (2, 2)])
def test_spaced_chunks_match_reference(model, case_inputs, every, guard):
    """``chunk_every=k``: forwards g, g + k, ... carry a chunk (g = max(guard, 1)), the others decode alone; every
    forward's logits still equal the reference's over what it sees."""
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=guard, chunk_every=every)
    out = greedy(model, case_inputs, n=14, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    trace = out.raincheck
    first = max(guard, 1)
    carried = [i for i, r in enumerate(trace.restored_per_forward[1:], start=1) if r.numel()]
    # forwards first, first + k, ... carried one each, with no slot skipped until the rows ran out
    assert carried and carried == list(range(first, first + every * len(carried), every))
    assert trace.chunk_size_per_forward[1:] == [3 if i in carried else 0 for i in range(1, len(trace.chunk_size_per_forward))]
    assert_matches_reference(model, [record(case_inputs, out)])


def _restoration_sequence(trace) -> list[int]:
    """The deferred source positions in the order they were restored (during the answer, then pending)."""
    return torch.cat([r.reshape(-1) for r in trace.restored_per_forward[1:]] + [trace.pending]).tolist()


def _expected_order(model, inputs, trace, order) -> list[int]:
    """The order ``restore_order`` asks for, computed here from its definition (stable sort, source order on ties)."""
    from raincheck_hf.models import get_adapter
    from raincheck_hf.selection.fastv import turn_last_row_attention

    adapter = get_adapter(model)
    ids = inputs["input_ids"][0]
    with torch.no_grad():
        turn = adapter.encode_turn(ids, 0, image_grid_thw=inputs.get("image_grid_thw"),
                                   video_grid_thw=inputs.get("video_grid_thw"), pixel_values=inputs.get("pixel_values"),
                                   pixel_values_videos=inputs.get("pixel_values_videos"))
        deferred = trace.deferred
        if order == "attention":
            scores = turn_last_row_attention(model, turn, None)[0][deferred]
        else:
            feats = torch.nn.functional.normalize(turn.embeds[deferred].float(), dim=-1)
            text = torch.nn.functional.normalize(turn.embeds[turn.text_rows].float(), dim=-1)
            scores = (feats @ text.T).mean(dim=-1)  # min-max normalising keeps the order
    return deferred[torch.sort(scores, descending=True, stable=True).indices].tolist()


@pytest.mark.parametrize("order", ["relevance", "attention"])
@pytest.mark.parametrize("retention,chunk,guard", SETTINGS[:3])
def test_restore_order_matches_reference(model, case_inputs, retention, chunk, guard, order):
    """Deferred rows restored out of source order: each decode forward's logits equal one masked forward of the
    stock model over ``[T∪S] [deferred, in restoration order] [generated]``, and the order is the one asked for."""
    cfg = RaincheckConfig(retention=retention, chunk_size=chunk, decode_guard=guard, restore_order=order)
    out = greedy(model, case_inputs, n=14, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    trace = out.raincheck
    sequence = _restoration_sequence(trace)
    assert sorted(sequence) == trace.deferred.tolist()  # every deferred token once
    assert sequence == _expected_order(model, case_inputs, trace, order)
    if trace.deferred.numel() > 2:
        assert sequence != trace.deferred.tolist(), "the case should restore out of source order"
    assert_matches_reference(model, [record(case_inputs, out)])


def test_restore_order_source_is_source_order(model, case_inputs):
    out = greedy(model, case_inputs, n=10, raincheck=RaincheckConfig(chunk_size=3, decode_guard=1),
                 return_dict_in_generate=True)
    assert _restoration_sequence(out.raincheck) == out.raincheck.deferred.tolist()


def test_eager_attention_matches_reference(eager_model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    out = greedy(eager_model, inputs, raincheck=RaincheckConfig(chunk_size=3, decode_guard=1),
                 return_dict_in_generate=True, output_logits=True)
    assert_matches_reference(eager_model, [record(inputs, out)])


def assert_trace_accounts_for_every_multimodal_token(model, inputs, run=greedy):
    """Each image / video token selected or deferred, each deferred one restored (or pending) exactly once, in
    source order; ``run`` is the file's greedy call (here and in test_qwen3_5)."""
    t = run(model, inputs, n=6, raincheck=RaincheckConfig(chunk_size=3, decode_guard=2),
            return_dict_in_generate=True).raincheck
    ids = inputs["input_ids"][0]
    visual = ((ids == model.config.image_token_id) | (ids == model.config.video_token_id)).nonzero().flatten()
    assert torch.equal(torch.sort(torch.cat([t.selected, t.deferred])).values, visual)
    restored = torch.cat(t.restored_per_forward + [t.pending])
    assert torch.equal(torch.sort(restored).values, t.deferred)  # each deferred token exactly once
    assert torch.equal(t.deferred, torch.sort(t.deferred).values)


def test_trace_accounts_for_every_multimodal_token(model, case_inputs):
    assert_trace_accounts_for_every_multimodal_token(model, case_inputs)  # source order


# ---- hard, post_answer, serial --------------------------------------------------------------------

def assert_modes_share_one_selection(model, inputs, run=greedy):
    traces = {m: run(model, inputs, n=3, raincheck=RaincheckConfig(mode=m, retention=0.3),
                     return_dict_in_generate=True).raincheck for m in ("hard", "post_answer", "raincheck", "serial")}
    for t in traces.values():
        assert torch.equal(t.selected, traces["raincheck"].selected)
    assert torch.equal(traces["hard"].dropped, traces["hard"].deferred)
    assert torch.equal(traces["post_answer"].pending, traces["post_answer"].deferred)


def test_modes_share_one_selection(model, case_inputs):
    assert_modes_share_one_selection(model, case_inputs)


def test_hard_equals_stock_on_pruned_sequence(model, processor):
    """`hard` = the stock text model run greedily on the pruned sequence at original positions."""
    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    out = greedy(model, inputs, n=10, raincheck=RaincheckConfig(mode="hard", retention=0.3),
                 return_dict_in_generate=True)
    ids = inputs["input_ids"][0]
    keep = torch.ones(ids.shape[0], dtype=torch.bool)
    keep[out.raincheck.deferred] = False
    # stock embeddings and positions of the full prompt, then pruned
    cfg = model.config
    emb = model.model.language_model.embed_tokens(ids).clone()
    vis = ids == cfg.image_token_id
    feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    emb[vis] = torch.cat(list(feats.pooler_output))
    ds = [torch.cat(list(f)) for f in feats.deepstack_features]
    pos, delta = model.model.get_rope_index(ids[None], vis.long()[None], image_grid_thw=inputs["image_grid_thw"])
    kept_vis = keep[vis]
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg.text_config)
    tm = model.model.language_model
    h = tm(inputs_embeds=emb[keep][None], position_ids=pos[:, :, keep], cache=cache, use_cache=True,
           visual_pos_masks=vis[keep][None], deepstack_visual_embeds=[d[kept_vis] for d in ds]).last_hidden_state
    tokens = []
    next_pos = int(pos.max()) + 1
    for step in range(10):
        tok = model.lm_head(h[:, -1]).argmax(-1)
        tokens.append(int(tok))
        p = torch.full((3, 1, 1), next_pos + step)
        h = tm(inputs_embeds=tm.embed_tokens(tok[None]), position_ids=p, cache=cache, use_cache=True).last_hidden_state
    assert out.sequences[0, ids.shape[0]:].tolist() == tokens[: out.sequences.shape[1] - ids.shape[0]]


def assert_serial_agrees_with_fused(model, inputs, run=greedy):
    kw = dict(n=12, return_dict_in_generate=True, output_logits=True)
    fused = run(model, inputs, raincheck=RaincheckConfig(chunk_size=4, decode_guard=1), **kw)
    serial = run(model, inputs, raincheck=RaincheckConfig(chunk_size=4, decode_guard=1, mode="serial"), **kw)
    assert torch.equal(fused.sequences, serial.sequences)
    for a, b in zip(fused.logits, serial.logits):
        assert (a - b).abs().max() <= TOL
    assert [r.tolist() for r in fused.raincheck.restored_per_forward] == [
        r.tolist() for r in serial.raincheck.restored_per_forward]


def test_serial_agrees_with_fused(model, case_inputs):
    assert_serial_agrees_with_fused(model, case_inputs)


def assert_post_answer_restores_nothing_during_decode(model, inputs, run=greedy, **kw):
    out = run(model, inputs, raincheck=RaincheckConfig(mode="post_answer", decode_guard=0),
              return_dict_in_generate=True, **kw)
    assert out.raincheck.restored_during_decode == 0
    hard = run(model, inputs, raincheck=RaincheckConfig(mode="hard"), return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, hard.sequences)  # same visible context during the answer


def test_post_answer_restores_nothing_during_decode(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    assert_post_answer_restores_nothing_during_decode(model, inputs, output_logits=True)


# ---- multi-turn ------------------------------------------------------------------------------------

def second_turn(processor, sequences, images=(), text="And what colour is the corner?"):
    turn = make_inputs(processor, images=images, text=text)
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    glue = [eos] if sequences[0, -1] != eos else []
    glue += processor.tokenizer("\n", add_special_tokens=False)["input_ids"]
    ids = torch.cat([sequences, torch.tensor([glue]), turn["input_ids"]], dim=1)
    turn = dict(turn)
    turn["input_ids"] = ids
    turn["attention_mask"] = torch.ones_like(ids)
    turn.pop("mm_token_type_ids", None)
    return turn


@pytest.mark.parametrize("between", ["nothing", "complete", "one_chunk"])
def test_second_turn_matches_reference(model, processor, between):
    from raincheck_hf.tiny import draw_test_image

    cfg = RaincheckConfig(retention=0.25, chunk_size=3, decode_guard=7)
    first = make_inputs(processor, **INPUT_CASES["one_image"])
    out1 = greedy(model, first, n=8, raincheck=cfg, return_dict_in_generate=True, output_logits=True)
    assert out1.raincheck.pending.numel() > 0
    if between == "complete":
        restore_pending(model, out1.cache)
        assert out1.cache.num_pending == 0
    elif between == "one_chunk":
        restore_pending(model, out1.cache, max_tokens=cfg.chunk_size)
    second = second_turn(processor, out1.sequences, images=(draw_test_image(64, 96, seed=9),))
    out2 = greedy(model, second, n=8, raincheck=cfg, cache=out1.cache, return_dict_in_generate=True,
                  output_logits=True)
    if between != "complete":
        assert out2.raincheck.restored_per_forward[0].numel() > 0  # leftovers ride with the prefill
    assert_matches_reference(model, [record(first, out1), record(second, out2)])


def test_completed_cache_holds_every_prompt_token_once(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["image_and_video"])
    out = greedy(model, inputs, n=5, raincheck=RaincheckConfig(decode_guard=2, chunk_size=2),
                 return_dict_in_generate=True)
    assert_completed_cache_holds_every_prompt_token_once(model, inputs, out)


def assert_completed_cache_holds_every_prompt_token_once(model, inputs, out):
    """Once ``out``'s pending rows are restored, its cache holds each prompt position exactly once."""
    cache = out.cache
    restore_pending(model, cache)
    prompt_len = inputs["input_ids"].shape[1]
    sources = cache.row_sources
    prompt_rows = sources[sources < prompt_len]
    assert torch.equal(torch.sort(prompt_rows).values, torch.arange(prompt_len))
    assert cache.get_seq_length() == cache.num_rows == out.sequences.shape[1] - 1


def restored_both_ways(model, inputs, n, run=greedy):
    """The caches of two equal calls (most tokens deferred, none restored during the answer), the pending rows of
    one restored all at once, of the other three at a time."""
    cfg = RaincheckConfig(retention=0.2, decode_guard=100)
    a = run(model, inputs, n=n, raincheck=cfg, return_dict_in_generate=True).cache
    b = run(model, inputs, n=n, raincheck=cfg, return_dict_in_generate=True).cache
    restore_pending(model, a)
    while b.num_pending:
        restore_pending(model, b, max_tokens=3)
    return a, b


def test_completion_barrier_same_cache_either_way(model, processor):
    """Restoring chunk by chunk and all at once leave the same keys and values."""
    a, b = restored_both_ways(model, make_inputs(processor, **INPUT_CASES["one_image"]), 4)
    assert torch.equal(a.row_keys, b.row_keys)
    for la, lb in zip(a.layers, b.layers):
        assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)


# ---- HF's generation features keep working ---------------------------------------------------------

def test_sampling_is_reproducible_with_a_seed(model, case_inputs):
    cfg = RaincheckConfig(chunk_size=3, decode_guard=1)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(**case_inputs, max_new_tokens=10, do_sample=True, top_k=20, temperature=1.3,
                                   raincheck=cfg))
    assert torch.equal(runs[0], runs[1])


class _Ban(LogitsProcessor):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


class _StopAt(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_logits_processor_stopping_criteria_and_streamer(model, processor):
    from transformers import TextIteratorStreamer

    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    base = greedy(model, inputs, raincheck=True)
    banned = int(base[0, inputs["input_ids"].shape[1]])
    prompt_len = inputs["input_ids"].shape[1]
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False, raincheck=RaincheckConfig(decode_guard=1),
                         logits_processor=LogitsProcessorList([_Ban(banned)]),
                         stopping_criteria=StoppingCriteriaList([_StopAt(prompt_len + 7)]), streamer=streamer)
    assert out.shape[1] == prompt_len + 7
    assert banned not in out[0, prompt_len:].tolist()
    streamed = "".join(streamer)
    assert streamed == processor.tokenizer.decode(out[0, prompt_len:])


def test_placeholder_id_as_last_generated_token_is_text(model, processor):
    """A model may emit a placeholder id; fed back in the next turn, it is text, not a missing image."""
    first = make_inputs(processor, **INPUT_CASES["one_image"])
    out1 = greedy(model, first, n=4, raincheck=True, return_dict_in_generate=True)
    seqs = out1.sequences.clone()
    seqs[0, -1] = model.config.image_token_id  # as if the answer had ended on <|image_pad|>
    second = second_turn(processor, seqs, text="Go on.")
    out2 = greedy(model, second, n=3, raincheck=True, cache=out1.cache, return_dict_in_generate=True)
    assert out2.raincheck.selected.numel() == out2.raincheck.deferred.numel() == 0


def test_stop_strings_with_a_tokenizer_stop_as_in_stock(model, processor):
    """``stop_strings=`` with ``tokenizer=`` (HF drops the tokenizer when a custom loop runs, so raincheck builds the
    `StopStringCriteria` itself): the answer stops after the token that completes the string, as the same answer cut
    there; stop strings in the generation config work the same (the caller's config untouched); without a tokenizer
    a ValueError naming the setting, before any compute. Also on the batching loop's path (`Conversation(loop=)`)."""
    import copy

    from raincheck_hf import Conversation
    from raincheck_hf.batch_loop import BatchLoop

    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    start = inputs["input_ids"].shape[1]
    base = greedy(model, inputs, n=8, raincheck=True)[0, start:].tolist()
    at = next(i for i in range(2, len(base)) if base[i] not in base[:i])  # a token first generated at position i
    stop = processor.tokenizer.decode([base[at]])
    assert stop.strip(), "the stop string must be visible text"
    want = base[:at + 1]
    out = greedy(model, inputs, n=8, raincheck=True, stop_strings=[stop], tokenizer=processor.tokenizer)
    assert out[0, start:].tolist() == want
    config = copy.deepcopy(model.generation_config)
    config.stop_strings = [stop]
    out = greedy(model, inputs, n=8, raincheck=True, generation_config=config, tokenizer=processor.tokenizer)
    assert out[0, start:].tolist() == want and config.stop_strings == [stop]
    with pytest.raises(ValueError, match="stop_strings.*tokenizer"):
        greedy(model, inputs, n=8, raincheck=True, stop_strings=[stop])
    image = INPUT_CASES["one_image"]["images"]
    with BatchLoop(model) as loop, Conversation(model, processor, RaincheckConfig(), loop=loop) as conv:
        result = conv.ask("What is in this image?", images=list(image), max_new_tokens=8, do_sample=False,
                          stop_strings=[stop], tokenizer=processor.tokenizer)
        assert processor.tokenizer.decode(result.token_ids).endswith(stop)


def test_hf_does_not_build_a_cache_the_call_never_reads(model, processor, monkeypatch):
    """A raincheck call runs its own cache: HF's preparation builds no `DynamicCache` for it unless the call names
    ``use_cache`` or a setting reads HF's cache (a ``cache_implementation``, which then gives no warning); the answer
    is the same either way."""
    import warnings

    from transformers import cache_utils

    made = []
    init = cache_utils.DynamicCache.__init__

    def recorded(self, *args, **kwargs):
        made.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", recorded)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    kw = dict(max_new_tokens=4, do_sample=False, raincheck=RaincheckConfig(retention=0.3, fast_path=False))
    runs = {}
    for name, extra in (("default", {}), ("use_cache", {"use_cache": True}),
                        ("implementation", {"cache_implementation": "dynamic"})):
        made.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[name] = model.generate(**inputs, **kw, **extra)
        assert not [w for w in caught if "use_cache" in str(w.message)], name
        assert ("DynamicCache" in made) == (name != "default"), (name, made)
        assert "DeferredDynamicCache" in made  # the engine's own
    assert all(torch.equal(runs["default"], out) for out in runs.values())
