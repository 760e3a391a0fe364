"""`generate(raincheck=...)` with a batch of left-padded prompts (`raincheck_hf.batched`), on the eager engine.

The reference for each row is the same call on that row alone, unpadded (itself checked against the masked
reference forward in test_generation.py / test_families.py), under the same chunk schedule: where the batch shares
a chunk budget (``RaincheckConfig.batch_chunk_rows``, which may cut a row's chunks), the row alone replays the
chunk sizes its batched trace recorded (`alone_schedule`); without sharing it decides them itself and the traces
must agree. Identical tokens, logits within 1e-4 (fp32, CPU), the same trace and the same cache.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from raincheck_hf import RaincheckConfig
from raincheck_hf.cache_utils import DeferredDynamicCache
from raincheck_hf.tiny import draw_test_image, draw_test_video

from conftest import make_inputs, no_placeholder_ids, video_metadata
from families import family_model, family_processor, family_params

TOL = 1e-4
ATTENTION_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")
GDN_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # Gated DeltaNet + gated attention: per-sequence recurrent states
ALL_FAMILIES = ATTENTION_FAMILIES + GDN_FAMILIES
MODES = ("raincheck", "serial", "hard", "post_answer", "full")
SELECTORS = ("mmtok", "divprune", "cdpruner", "fastv", "visionzip", "uniform", "random")


def batched_inputs(processor, rows):
    """Processor inputs for several prompts, left-padded as HF users batch them: ``rows`` are `make_inputs`
    keyword dicts (images / videos / text), each row its own media."""
    texts, images, videos, metadata = [], [], [], []
    for row in rows:
        content = ([{"type": "image"} for _ in row.get("images", ())]
                   + [{"type": "video"} for _ in row.get("videos", ())])
        content.append({"type": "text", "text": row.get("text", "What is in this image?")})
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False))
        images += list(row.get("images", ()))
        videos += list(row.get("videos", ()))
        metadata += [video_metadata(v.shape[0]) for v in row.get("videos", ())]
    kwargs = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
        kwargs["videos_kwargs"] = {"video_metadata": metadata}
    return processor(text=texts, return_tensors="pt", padding=True, padding_side="left", **kwargs)


def run(model, inputs, cfg, n, **kw):
    return model.generate(**inputs, max_new_tokens=n, do_sample=False, raincheck=cfg, return_dict_in_generate=True,
                          output_logits=True, **kw)


def alone_schedule(cfg: RaincheckConfig, trace) -> list[int] | None:
    """The chunk schedule a batched sequence's own batch-1 call replays (``generate(raincheck_chunk_schedule=...)``):
    its trace's chunk sizes when the batch shares a chunk budget (they may be cut), else None: the call decides them
    itself, and with sharing off they must be the batched ones (the caller compares the traces)."""
    return None if cfg.batch_chunk_rows is None else list(trace.chunk_size_per_forward)


def assert_trace_equal(got, want):
    assert got.mode == want.mode
    for name in ("selected", "deferred", "pending", "dropped"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert len(got.restored_per_forward) == len(want.restored_per_forward)
    for a, b in zip(got.restored_per_forward, want.restored_per_forward):
        assert torch.equal(a, b)
    assert got.chunk_size_per_forward == want.chunk_size_per_forward
    assert [(m, g, s.tolist()) for m, g, s in got.segments] == [(m, g, s.tolist()) for m, g, s in want.segments]


def _close(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.shape == b.shape, what
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert diff <= TOL, f"{what}: max abs diff {diff:.2e}"


def assert_gdn_layer_equal(got, want, what: str, pending: bool):
    """A Gated DeltaNet cache layer: the live state and conv window (HF's last ``Kc - 1`` columns: column 0 is
    never read), and, while deferred rows wait to be joined, the boundary record a join reads."""
    from raincheck_hf.gdn.eager import DeferredLinearAttentionLayer

    assert isinstance(got, DeferredLinearAttentionLayer) and isinstance(want, DeferredLinearAttentionLayer), what
    width = got.suffix_map.params.kernel_size - 1
    _close(got.conv_states[0][..., -width:], want.conv_states[0][..., -width:], f"{what} conv")
    _close(got.recurrent_states[0], want.recurrent_states[0], f"{what} state")
    if not pending:  # nothing can be joined before the next turn's input moves the boundary
        return
    g, w = got.suffix_map, want.suffix_map
    assert g.suffix_length == w.suffix_length, what
    for name in ("boundary_state", "boundary_conv_history", "leading_state", "rest_map", "live_conv_history"):
        _close(getattr(g, name), getattr(w, name), f"{what} {name}")
    for name in ("mixed_qkv", "a", "b"):
        _close(getattr(g.leading, name), getattr(w.leading, name), f"{what} leading {name}")


def assert_cache_equal(got: DeferredDynamicCache, want: DeferredDynamicCache):
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    assert repr(got) == repr(want)
    assert torch.equal(got.row_keys.cpu(), want.row_keys.cpu())
    assert torch.equal(got.row_sources, want.row_sources)
    assert torch.equal(got.row_kinds, want.row_kinds)
    assert torch.equal(got.source_ids, want.source_ids)
    assert got.next_position == want.next_position
    assert torch.equal(got.pending_sources, want.pending_sources)
    assert len(got.layers) == len(want.layers)
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        if isinstance(b, LinearAttentionCacheLayerMixin):
            assert_gdn_layer_equal(a, b, f"layer {i}", pending=want.num_pending > 0)
            continue
        _close(a.keys, b.keys, f"layer {i} keys")
        _close(a.values, b.values, f"layer {i} values")


def assert_rows_match_alone(model, processor, rows, cfg, n=8, **kw):
    """The batched call against each row's own call under the row's chunk schedule (`alone_schedule`): tokens,
    logits, trace, cache. Returns the batched output."""
    inputs = batched_inputs(processor, rows)
    length = inputs["input_ids"].shape[1]
    out = run(model, inputs, cfg, n, **kw)
    pad = model.generation_config.pad_token_id
    assert isinstance(out.raincheck, list) and len(out.raincheck) == len(rows)
    assert isinstance(out.cache, list) and len(out.cache) == len(rows)
    for i, row in enumerate(rows):
        alone_inputs = make_inputs(processor, **row)
        padding = int((inputs["attention_mask"][i] == 0).sum())
        assert torch.equal(inputs["input_ids"][i, padding:], alone_inputs["input_ids"][0])
        alone = run(model, alone_inputs, cfg, n, raincheck_chunk_schedule=alone_schedule(cfg, out.raincheck[i]), **kw)
        tokens = alone.sequences[0, alone_inputs["input_ids"].shape[1]:]
        got = out.sequences[i, length:]
        assert torch.equal(got[:tokens.numel()], tokens), f"row {i}"
        assert bool((got[tokens.numel():] == pad).all()), f"row {i}: tokens after its end are not the pad token"
        assert len(alone.logits) <= len(out.logits)
        for step, want in enumerate(alone.logits):
            diff = (out.logits[step][i] - want[0]).abs().max().item()
            assert diff <= TOL, f"row {i} step {step}: max abs logit diff {diff:.2e}"
        assert_trace_equal(out.raincheck[i], alone.raincheck)
        assert_cache_equal(out.cache[i], alone.cache)
    return out


IMAGE = dict(images=(draw_test_image(128, 96, seed=1),))
TEXT = dict(text="Say something about glyphs.")
TWO_IMAGES = dict(images=(draw_test_image(64, 64, seed=2), draw_test_image(96, 128, seed=3)), text="Which is red?")
VIDEO = dict(videos=(draw_test_video(4, 64, 96, seed=4),), text="What happens in the video?")
BIG_IMAGE = dict(images=(draw_test_image(192, 160, seed=5),), text="Describe it.")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", family_params(ALL_FAMILIES))
def test_rows_match_alone(name, mode):
    """Rows with different images (different visual and deferred counts), a text-only row, every mode."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(mode=mode, retention=0.3, chunk_size=3, decode_guard=1, fast_path=False)
    out = assert_rows_match_alone(model, processor, [IMAGE, TEXT, TWO_IMAGES, BIG_IMAGE], cfg)
    deferred = [t.deferred.numel() for t in out.raincheck]
    if mode != "full":
        assert len(set(deferred)) > 2 and deferred[1] == 0
    if mode in ("raincheck", "serial"):
        assert out.raincheck[0].restored_during_decode > 0


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_rows_with_spaced_chunks_match_alone(name):
    """``chunk_every=2`` in a batch: each row carries its chunks every other forward, as alone, and equals its call
    alone (the captured steps against this engine: tests/test_batched_graphs.py)."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1, chunk_every=2, fast_path=False)
    out = assert_rows_match_alone(model, processor, [IMAGE, TEXT, TWO_IMAGES], cfg)
    for trace in out.raincheck:
        carried = [i for i, r in enumerate(trace.restored_per_forward[1:], start=1) if r.numel()]
        assert all((i - 1) % 2 == 0 for i in carried)
    assert out.raincheck[0].restored_during_decode > 0


@pytest.mark.parametrize("mode", ["raincheck", "serial"])
@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_shared_chunk_budget(name, mode):
    """Four image prompts, ``chunk_size=31``, ``batch_chunk_rows=32``: each step's chunks are cut to the share that
    `generation.shared_chunk_cap` gives the sequences carrying one (7 rows each for three or four of them, 15 for
    two, a lone one its full 31), so a step's chunk rows stay within the budget, and each row equals itself alone
    under its schedule. With sharing off (None) every row carries its full chunk and equals its own call without
    any replay (its schedule is its own), and the shared schedules differ from those."""
    from raincheck_hf.generation import shared_chunk_cap

    model, processor = family_model(name), family_processor(name)
    rows = [BIG_IMAGE, TWO_IMAGES, IMAGE, BIG_IMAGE]
    shared = RaincheckConfig(mode=mode, retention=0.1, chunk_size=31, decode_guard=1, batch_chunk_rows=32,
                             fast_path=False)
    out = assert_rows_match_alone(model, processor, rows, shared, n=8)
    traces = out.raincheck
    cut = set()
    for f in range(1, max(len(t.chunk_size_per_forward) for t in traces)):
        sizes = [t.chunk_size_per_forward[f] for t in traces if len(t.chunk_size_per_forward) > f]
        carrying = sum(1 for c in sizes if c)
        share = shared_chunk_cap(carrying, 32, 31) or 31
        assert all(c in (0, share) for c in sizes), (f, sizes)
        if carrying > 1:
            assert carrying * share <= 32, (f, sizes)
            cut.add(share)
        restored = sum(t.restored_per_forward[f].numel() for t in traces if len(t.restored_per_forward) > f)
        assert restored <= max(32, share)
    assert cut == {7, 15}  # four, then two sequences carrying chunks at once
    off = assert_rows_match_alone(model, processor, rows, dataclasses.replace(shared, batch_chunk_rows=None), n=8)
    assert all(c in (0, 31) for t in off.raincheck for c in t.chunk_size_per_forward)
    assert any(a.chunk_size_per_forward != b.chunk_size_per_forward for a, b in zip(traces, off.raincheck))


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_rows_carrying_chunks_at_once_equal_their_own_calls_by_default(name):
    """The default settings (``batch_chunk_rows=None``): four image prompts with 31-row chunks, three or four of them
    carrying a chunk in the same steps, each carrying its full chunk; each row equals its own call without any replay
    of a schedule (tokens, logits within 1e-4, trace, cache), so an answer does not depend on what runs beside it."""
    assert RaincheckConfig().batch_chunk_rows is None
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.1, fast_path=False)
    out = assert_rows_match_alone(model, processor, [BIG_IMAGE, TWO_IMAGES, IMAGE, BIG_IMAGE], cfg, n=8)
    traces = out.raincheck
    widest = max(sum(1 for t in traces if len(t.chunk_size_per_forward) > f and t.chunk_size_per_forward[f] == 31)
                 for f in range(1, max(len(t.chunk_size_per_forward) for t in traces)))
    assert widest >= 3  # (a step where a cap of 64 would have cut every chunk to 7 rows)
    assert all(c in (0, 31) or c == t.restored_per_forward[f].numel()
               for t in traces for f, c in enumerate(t.chunk_size_per_forward) if f)


@pytest.mark.parametrize("order", ["relevance", "attention"])
@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_rows_restore_in_their_own_order(name, order):
    """``restore_order`` in a batch: each row restores its deferred rows in the order its own call does (traces
    equal, so the chunks are the same rows in the same forwards), tokens and logits as alone."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, decode_guard=1, restore_order=order, fast_path=False)
    out = assert_rows_match_alone(model, processor, [IMAGE, TWO_IMAGES, TEXT], cfg, n=6)
    restored = torch.cat(out.raincheck[1].restored_per_forward[1:])
    assert restored.numel() and not torch.equal(restored, restored.sort().values)  # not source order here


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_eager_attention_backend(name):
    """The additive float mask of ``attn_implementation="eager"`` (padding rows see only themselves there too)."""
    model, processor = family_model(name, "eager"), family_processor(name)
    cfg = RaincheckConfig(chunk_size=2, decode_guard=0, retention=0.2)
    out = assert_rows_match_alone(model, processor, [TWO_IMAGES, TEXT, IMAGE], cfg, n=6, output_scores=True)
    assert len(out.scores) == len(out.logits) and out.scores[0].shape == out.logits[0].shape


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen2_5_vl", "qwen3_5")))
def test_video_rows(name):
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(retention=0.2, chunk_size=4, decode_guard=0)
    assert_rows_match_alone(model, processor, [VIDEO, IMAGE, dict(images=IMAGE["images"], videos=VIDEO["videos"])],
                            cfg)


@pytest.mark.parametrize("name", family_params(ALL_FAMILIES))
def test_visionzip_rows(name):
    """VisionZip reads the vision tower's last block: each row gets its cut of the batch's one tower call."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(selector="visionzip", retention=0.3, chunk_size=3, decode_guard=1)
    rows = [TWO_IMAGES, TEXT, BIG_IMAGE] + ([VIDEO] if name != "qwen3_vl_moe" else [])
    assert_rows_match_alone(model, processor, rows, cfg, n=6)


def _text_model_batches(model):
    """The batch size of every text-model forward (a pre-hook on the text model), and its handle."""
    from raincheck_hf.models import get_adapter

    sizes = []
    handle = get_adapter(model).text_model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["inputs_embeds"].shape[0]), with_kwargs=True)
    return sizes, handle


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_rows_finishing_early_leave_the_forward(name):
    """A row that stops at its EOS matches its own call, its later tokens are pads, and it leaves the forward
    (its KV rows, and on Qwen3.5 its Gated DeltaNet states: the others' states are unchanged by its leaving)."""
    model, processor = family_model(name), family_processor(name)
    rows = [IMAGE, TWO_IMAGES, TEXT]
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=1)
    probe = run(model, make_inputs(processor, **TWO_IMAGES), cfg, 12)
    eos = int(probe.sequences[0, -9])  # row 1's 4th token (or earlier, where it first appears)
    out = assert_rows_match_alone(model, processor, rows, cfg, n=12, eos_token_id=eos)
    sizes, handle = _text_model_batches(model)
    try:
        again = run(model, batched_inputs(processor, rows), cfg, 12, eos_token_id=eos)
    finally:
        handle.remove()
    assert torch.equal(again.sequences, out.sequences)
    lengths = [len(t.restored_per_forward) for t in out.raincheck]  # forwards each row took part in
    assert min(lengths) < max(lengths), "no row finished early"
    assert sizes == [sum(k >= f for k in lengths) for f in range(1, max(lengths) + 1)]
    assert out.raincheck[1].pending.numel() > 0  # its chunks stopped with it: the rest stays pending in its cache
    assert torch.equal(out.cache[1].pending_sources, out.raincheck[1].pending)


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


class _Ban(LogitsProcessor):
    def __init__(self, token):
        self.token, self.shapes = token, []

    def __call__(self, input_ids, scores):
        self.shapes.append(tuple(scores.shape))
        scores = scores.clone()  # the raw logits (output_logits) stay as the model gave them
        scores[:, self.token] = -float("inf")
        return scores


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_streamer_and_logits_processor_as_stock(name):
    """The streamer gets the prompt batch, then one ``[B]`` token per step, then end (stock batched generate's
    calls); logits processors get ``[B, V]`` scores; the result matches each row alone with the same processor."""
    model, processor = family_model(name), family_processor(name)
    rows = [IMAGE, TEXT]
    inputs = batched_inputs(processor, rows)
    cfg = RaincheckConfig(chunk_size=3, decode_guard=1)
    banned = int(run(model, inputs, cfg, 1).sequences[0, -1])
    recorder, ban = _Recorder(), _Ban(banned)
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, raincheck=cfg, streamer=recorder,
                         logits_processor=LogitsProcessorList([ban]))
    stock = _Recorder()
    model.generate(**inputs, max_new_tokens=6, do_sample=False, streamer=stock)
    assert [tuple(p.shape) for p in recorder.puts] == [tuple(p.shape) for p in stock.puts]
    assert recorder.ended and stock.ended
    assert torch.equal(torch.cat([recorder.puts[0]] + [p[:, None] for p in recorder.puts[1:]], dim=1), out)
    assert banned not in out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ban.shapes and all(s == (2, model.config.get_text_config().vocab_size) for s in ban.shapes)
    assert_rows_match_alone(model, processor, rows, cfg, n=6, logits_processor=LogitsProcessorList([_Ban(banned)]))


@pytest.mark.parametrize("name", family_params(("qwen3_vl_moe", "qwen3_5_moe")))
def test_sampling(name):
    """Seeded batched sampling is reproducible; top_k=1 sampling is the greedy answer of every row."""
    model, processor = family_model(name), family_processor(name)
    inputs = batched_inputs(processor, [IMAGE, TWO_IMAGES, TEXT])
    cfg = RaincheckConfig(chunk_size=3, decode_guard=1)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=20, temperature=1.3,
                                   raincheck=cfg))
    assert torch.equal(runs[0], runs[1])
    greedy = model.generate(**inputs, max_new_tokens=8, do_sample=False, raincheck=cfg)
    top1 = model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=1, raincheck=cfg)
    assert torch.equal(greedy, top1)


@pytest.mark.parametrize("name", family_params(("qwen3_vl", "qwen3_5")))
def test_row_cache_continues_at_batch_one(name):
    """``out.cache[i]`` continues row i's conversation: its follow-up equals the follow-up of the row's own call
    (rows still pending: on Qwen3.5 the next turn joins them at the boundary the batched call recorded)."""
    model, processor = family_model(name), family_processor(name)
    rows = [IMAGE, TWO_IMAGES]
    cfg = RaincheckConfig(retention=0.3, chunk_size=2, decode_guard=2)
    kw = dict(suppress_tokens=no_placeholder_ids(model))
    out = run(model, batched_inputs(processor, rows), cfg, 5, **kw)
    assert all(c.num_pending > 0 for c in out.cache)
    for c in out.cache:  # (each row's keys and values in one block of memory: `cache_utils.hold_rows`)
        held = [t for layer in c.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()
                for t in (layer.keys, layer.values)]
        assert held and len({t.untyped_storage().data_ptr() for t in held}) == 1
    for i, row in enumerate(rows):
        first = make_inputs(processor, **row)
        alone = run(model, first, cfg, 5, **kw)
        follow = processor(text=["<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"],
                           return_tensors="pt")["input_ids"]
        ids = torch.cat([alone.sequences, follow], dim=1)
        want = run(model, {"input_ids": ids}, cfg, 5, cache=alone.cache, **kw)
        got = run(model, {"input_ids": ids}, cfg, 5, cache=out.cache[i], **kw)
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits):
            assert (a - b).abs().max().item() <= TOL


def test_hold_rows_keeps_a_cache_in_one_block():
    """`cache_utils.hold_rows`: each layer holds what it was given, as a copy (changing the given tensors afterwards
    leaves it as it was), every layer's keys and values in one storage; layers of unlike shapes are copied each on its
    own (`DynamicCache.update`), as are layers of an unlike dtype."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from raincheck_hf.cache_utils import hold_rows

    def empty(layers: int) -> DynamicCache:
        cache = DynamicCache()
        cache.layers.extend(DynamicLayer() for _ in range(layers))
        return cache

    g = torch.Generator().manual_seed(3)
    given = {i: (torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)) for i in (0, 2, 3)}
    want = {i: (k.clone(), v.clone()) for i, (k, v) in given.items()}
    cache = empty(4)
    hold_rows(cache, given)
    for k, v in given.values():
        k.add_(1.0), v.add_(1.0)
    for i, (k, v) in want.items():
        assert torch.equal(cache.layers[i].keys, k) and torch.equal(cache.layers[i].values, v)
    held = [t for i in want for t in (cache.layers[i].keys, cache.layers[i].values)]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    assert not cache.layers[1].is_initialized and cache.get_seq_length(2) == 5
    longer = (torch.ones(1, 2, 6, 4),) * 2
    wider = (torch.ones(1, 2, 5, 4, dtype=torch.float64),) * 2
    for unlike in ({0: (torch.zeros(1, 2, 5, 4),) * 2, 1: longer}, {0: (torch.zeros(1, 2, 5, 4),) * 2, 1: wider}):
        other = empty(2)
        hold_rows(other, unlike)
        for i, (k, v) in unlike.items():
            assert torch.equal(other.layers[i].keys, k) and other.layers[i].keys.dtype == k.dtype
        assert other.layers[0].keys.untyped_storage().data_ptr() != other.layers[1].keys.untyped_storage().data_ptr()


def test_auto_engine_takes_the_eager_engine_for_a_batch(monkeypatch):
    """Where ``fast_path=None`` would take the fast path and the captured vision tower (a model on CUDA, simulated
    here), a batch still runs on the eager engine with HF's vision encoding: the same result as on the CPU."""
    from raincheck_hf.models.qwen3_vl import Qwen3VLAdapter

    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    inputs = batched_inputs(processor, [IMAGE, TWO_IMAGES])
    cfg = RaincheckConfig(chunk_size=3, decode_guard=1)
    want = run(model, inputs, cfg, 6)
    monkeypatch.setattr(Qwen3VLAdapter, "execution_path", lambda self, config: "fast")
    monkeypatch.setattr(Qwen3VLAdapter, "use_vision_graphs", lambda self, config: True)
    import raincheck_hf.fast.graphs as graphs

    def no_graphs(*args, **kwargs):  # the fast path's step runner (real or, in test_fast_path, stand-in graphs)
        raise AssertionError("a batch reached the fast path's step graphs")

    monkeypatch.setattr(graphs.StepGraphs, "__init__", no_graphs)
    got = run(model, inputs, cfg, 6)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert all(type(c) is DeferredDynamicCache for c in got.cache)


@pytest.mark.parametrize("name, rows", [
    ("qwen3_vl", [TWO_IMAGES, TEXT, IMAGE]),
    ("qwen2_5_vl", [VIDEO, IMAGE]),  # a video's second_per_grid_ts entries go with its copies
    ("qwen3_5", [IMAGE]),  # one prompt: its copies are a batch
], ids=["qwen3_vl", "qwen2_5_vl", "qwen3_5"])
def test_num_return_sequences_runs_each_copy_as_a_row(name, rows):
    """``num_return_sequences=n`` with sampling: each prompt's n copies are rows ``i * n ... i * n + n - 1``, as stock
    `generate` lays them out, each with its own row's media: the same call as the processor's batch of every prompt
    written n times (same seed), tokens, traces and all; from the generation config too."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(chunk_size=3, decode_guard=1)
    sample = dict(max_new_tokens=5, do_sample=True, top_k=20, temperature=1.3, raincheck=cfg,
                  return_dict_in_generate=True)
    torch.manual_seed(11)
    got = model.generate(**batched_inputs(processor, rows), num_return_sequences=2, **sample)
    torch.manual_seed(11)
    want = model.generate(**batched_inputs(processor, [row for row in rows for _ in range(2)]), **sample)
    assert got.sequences.shape[0] == 2 * len(rows)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.raincheck) == len(got.cache) == 2 * len(rows)
    for a, b in zip(got.raincheck, want.raincheck):
        assert_trace_equal(a, b)
    config = copy.deepcopy(model.generation_config)
    config.num_return_sequences, config.do_sample, config.top_k, config.temperature = 2, True, 20, 1.3
    torch.manual_seed(11)
    from_config = model.generate(**batched_inputs(processor, rows), generation_config=config, max_new_tokens=5,
                                 raincheck=cfg)
    assert torch.equal(from_config, want.sequences)


# ---- refusals (before any compute) -------------------------------------------------------------------

def _refused(model, inputs, match, **kw):
    sizes, handle = _text_model_batches(model)
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(**inputs, max_new_tokens=3, **kw)
    finally:
        handle.remove()
    assert sizes == [], "the text model ran before the refusal"


def test_refusals():
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    inputs = batched_inputs(processor, [IMAGE, TEXT])
    prompts = [processor.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in ("Hi.", "Say something about glyphs.")]
    right = processor(text=prompts, return_tensors="pt", padding=True, padding_side="right")
    _refused(model, right, r"padding_side = 'left'", raincheck=True)
    _refused(model, inputs, r"keep-mask tensor.*batch size 2",
             raincheck=RaincheckConfig(selector=torch.ones(3, dtype=torch.bool)))
    _refused(model, inputs, r"starts new conversations only", raincheck=True,
             cache=DeferredDynamicCache(config=model.config.get_text_config()))
    broken = dict(inputs)
    broken["image_grid_thw"] = torch.cat([inputs["image_grid_thw"], inputs["image_grid_thw"]])
    _refused(model, broken, r"image_grid_thw", raincheck=True)
    _refused(model, broken, r"image_grid_thw", raincheck=True, do_sample=True, num_return_sequences=2)
    # copies of an answer (num_return_sequences), one prompt or several
    one = make_inputs(processor, **IMAGE)
    for given in (inputs, one):
        _refused(model, given, r"num_return_sequences=2: greedy decoding", raincheck=True, num_return_sequences=2)
        _refused(model, given, r"num_return_sequences=0.* int >= 1", raincheck=True, do_sample=True,
                 num_return_sequences=0)
        _refused(model, given, r"num_return_sequences=3: precomputed mm_encoder_outputs", raincheck=True,
                 do_sample=True, num_return_sequences=3, mm_encoder_outputs={"image": None})
    _refused(model, one, r"num_return_sequences=2: a keep-mask tensor", do_sample=True, num_return_sequences=2,
             raincheck=RaincheckConfig(selector=torch.ones(3, dtype=torch.bool)))
    _refused(model, one, r"num_return_sequences=2: the copies start new conversations", raincheck=True,
             do_sample=True, num_return_sequences=2, cache=DeferredDynamicCache(config=model.config.get_text_config()))


def test_chunk_schedule_refusals():
    """``generate(raincheck_chunk_schedule=...)`` (the replay the batched tests use) is checked before any compute:
    one prompt only, a list of sizes from 0 to the config's largest chunk, 0 for the prefill, none where the mode
    restores nothing during decoding."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    one = make_inputs(processor, **IMAGE)
    cfg = RaincheckConfig(chunk_size=15)
    _refused(model, batched_inputs(processor, [IMAGE, TEXT]), r"replays one sequence's chunk sizes; got a batch of 2",
             raincheck=cfg, raincheck_chunk_schedule=[0, 7])
    for bad in ([0, -1], [0, 16], [7, 7], (0, 2.0), [0, True], "0,7", 7):
        _refused(model, one, r"raincheck_chunk_schedule=.* must be a list of per-forward chunk sizes", raincheck=cfg,
                 raincheck_chunk_schedule=bad)
    _refused(model, one, r"integers from 0 to 0 \(mode='full'", raincheck=RaincheckConfig(mode="full"),
             raincheck_chunk_schedule=[0, 7])
    _refused(model, one, r"integers from 0 to 63", raincheck=RaincheckConfig(chunk_size="auto"),
             raincheck_chunk_schedule=[0, 64])


# ---- fuzz ---------------------------------------------------------------------------------------------

def random_row(rng: random.Random, sizes=(32, 64, 96, 128, 160), video_frames=(2, 4)):
    """A random prompt row: text, one or two glyph images, or a video (``video_frames`` frames, drawn only when
    there is a choice), each image side one of ``sizes``."""
    kind = rng.choice(["text", "image", "image", "images", "video"])
    size = lambda: rng.choice(sizes)  # noqa: E731
    if kind == "text":
        return dict(text=rng.choice(["Say something about glyphs.", "List every red glyph you can see."]))
    if kind == "video":
        frames = rng.choice(video_frames) if len(video_frames) > 1 else video_frames[0]
        return dict(videos=(draw_test_video(frames, size(), size(), seed=rng.randrange(100)),),
                    text="What happens in the video?")
    count = 1 if kind == "image" else 2
    return dict(images=tuple(draw_test_image(size(), size(), seed=rng.randrange(100)) for _ in range(count)),
                text=rng.choice(["What is in this image?", "Which is red?"]))


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_num_return_sequences(seed):
    """Random rows (text, images, videos), families, modes, chunk sizes, answer lengths and copy counts: sampling with
    ``num_return_sequences=n`` equals the processor's batch of every prompt written n times under the same seed."""
    from families import FAMILIES

    rng = random.Random(500 + seed)
    name = rng.choice([f.name for f in FAMILIES])
    model, processor = family_model(name), family_processor(name)
    rows = [random_row(rng) for _ in range(rng.randint(1, 3))]
    n = rng.randint(2, 3)
    cfg = RaincheckConfig(chunk_size=rng.choice([2, 3, 7]), mode=rng.choice(["raincheck", "full", "hard"]))
    sample = dict(max_new_tokens=rng.randint(2, 6), do_sample=True, top_k=20, raincheck=cfg)
    torch.manual_seed(seed)
    got = model.generate(**batched_inputs(processor, rows), num_return_sequences=n, **sample)
    torch.manual_seed(seed)
    want = model.generate(**batched_inputs(processor, [row for row in rows for _ in range(n)]), **sample)
    assert got.shape[0] == n * len(rows) and torch.equal(got, want), f"{name} seed {seed}"


@pytest.mark.parametrize("seed", range(25))
def test_fuzz_rows_match_alone(seed):
    """Random rows (text, images of random sizes, videos), modes, retentions, chunk sizes, guards, selectors and
    answer lengths, some rows finishing early, on every family: each row equals its own call."""
    rng = random.Random(1000 + seed)
    name = ALL_FAMILIES[seed % len(ALL_FAMILIES)]
    model, processor = family_model(name), family_processor(name)
    rows = [random_row(rng) for _ in range(rng.randint(2, 4))]
    cfg = RaincheckConfig(mode=rng.choice(MODES + ("raincheck", "raincheck", "serial")),
                          retention=rng.choice([0.0, 0.2, 0.3, 0.5, 1.0]),
                          chunk_size=rng.choice([1, 2, 3, 5, 8, "auto"]), decode_guard=rng.randint(0, 3),
                          selector=rng.choice(SELECTORS), fast_path=False)
    if cfg.chunk_size != "auto":  # (a stream of its own: the rest of a seed's case stays what it was)
        cfg.chunk_every = random.Random(f"chunk_every-{seed}").choice([1, 1, 2, 3])
    n = rng.randint(4, 12)
    kw = {}
    if rng.random() < 0.5:  # some row stops early: its own token at a random step is the EOS
        probe_row = rng.randrange(len(rows))
        probe = run(model, make_inputs(processor, **rows[probe_row]), cfg, n)
        kw["eos_token_id"] = int(probe.sequences[0, -rng.randint(1, n)])
    assert_rows_match_alone(model, processor, rows, cfg, n=n, **kw)


def _small_gdn_layer(seed: int):
    """A small Gated DeltaNet layer's parameters (1 key / 2 value heads, dims 8 / 6) from ``seed``: the generator
    (to draw the inputs from next), the head sizes, the conv channels and the `GDNLayerParams`."""
    from raincheck_hf.gdn.algebra import GDNLayerParams

    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = 1, 2, 8, 6
    conv_dim = 2 * hk * dk + hv * dv
    params = GDNLayerParams(conv_weight=0.5 * torch.randn(conv_dim, 1, 4, generator=gen),
                            A_log=torch.log(torch.empty(hv).uniform_(0.01, 0.1, generator=gen)),
                            dt_bias=torch.randn(hv, generator=gen), num_k_heads=hk, num_v_heads=hv, head_k_dim=dk,
                            head_v_dim=dv)
    return gen, (hk, hv, dk, dv), conv_dim, params


# ---- the per-sequence Gated DeltaNet states of a packed forward, directly ------------------------------------

def test_packed_gdn_state_rows_are_independent():
    """`PackedGDNState.step` on three sequences with different layouts, garbage in every padding row, equals
    each sequence stepped alone without padding (outputs and every state tensor), over a prefill, fused and
    chunk-only forwards with records into the leading segment and the suffix map; a sequence with no rows in a
    forward (padding only) keeps its states bit for bit; a sequence that leaves takes its rows with it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from raincheck_hf.batched_gdn import PackedGDNState, PackedRowLayout as L
    from raincheck_hf.cache_utils import GENERATED as G, INPUT as I

    gen, (hk, hv, dk, dv), conv_dim, params = _small_gdn_layer(42)
    rules = (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)
    steps = [  # per forward, per sequence: (deferred rows, rest rows, rest kind, record)
        [L(0, 5, I), L(0, 2, I), L(0, 7, I)],
        [L(0, 1, G, True), L(0, 1, G, True), L(0, 0, None)],
        [L(3, 1, G, True), L(0, 1, G, True), L(2, 1, G, True)],
        [L(0, 1, G, True), L(0, 1, G, True), L(0, 1, G, True)],
        [L(2, 0, None), L(0, 0, None), L(1, 0, None)],  # serial mode's chunk forward
        [L(0, 1, G, True), L(1, 1, G, False), L(0, 1, G, True)],
        [L(4, 1, G, False), L(0, 0, None), L(0, 1, G, True)],
    ]
    packed = PackedGDNState(3, params, torch.float32, "cpu")
    alone = [PackedGDNState(1, params, torch.float32, "cpu") for _ in range(3)]
    for layouts in steps:
        width = max(lay.n_deferred + lay.n_rest for lay in layouts)
        qkv = 1e3 * torch.randn(3, width, conv_dim, generator=gen)  # garbage wherever a row is padding
        a, b = 1e3 * torch.randn(3, width, hv, generator=gen), 1e3 * torch.randn(3, width, hv, generator=gen)
        real = [lay.n_deferred + lay.n_rest for lay in layouts]
        for i, n in enumerate(real):
            qkv[i, :n] = torch.randn(n, conv_dim, generator=gen)
            a[i, :n], b[i, :n] = torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen)
        before = [[getattr(packed, name)[i].clone() for name in PackedGDNState._NAMES] for i in range(3)]
        core = packed.step(qkv, a, b, layouts, params, *rules)
        for i, (lay, n) in enumerate(zip(layouts, real)):
            assert bool((core[i, n:] == 0).all())
            if not n:
                assert all(torch.equal(getattr(packed, name)[i], was)
                           for name, was in zip(PackedGDNState._NAMES, before[i]))
                continue
            want = alone[i].step(qkv[i:i + 1, :n], a[i:i + 1, :n], b[i:i + 1, :n], [lay], params, *rules)
            _close(core[i, :n], want[0], f"sequence {i} outputs")
            for name in PackedGDNState._NAMES:
                _close(getattr(packed, name)[i], getattr(alone[i], name)[0], f"sequence {i} {name}")
            assert packed.suffix_length[i] == alone[i].suffix_length[0]
    assert packed.suffix_length == [4, 3, 4]  # records into the suffix map past the three leading slots
    kept = packed.state[[0, 2]].clone()
    packed.select([0, 2])
    assert packed.batch == 2 and torch.equal(packed.state, kept)


def test_packed_gdn_step_work_does_not_grow_with_the_batch(monkeypatch):
    """A packed GDN step launches the same batched ops whatever the number of sequences: one call each of the
    factor, record and rule functions per layer step (the records were a Python loop per sequence, which cost an
    8-row Qwen3.5-9B step ~2,400 extra small ops per 3 GDN layers on the eager engine), no host <-> device sync
    (``.item()``-like reads of device tensors), and the step's index tensors built once per forward for all its
    layers (`_StepPlan`, shared through ``plans``). Each sequence still equals itself stepped alone."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    import raincheck_hf.batched_gdn as bg
    from raincheck_hf.batched_gdn import PackedGDNState, PackedRowLayout as L
    from raincheck_hf.cache_utils import GENERATED as G, INPUT as I

    gen, (hk, hv, dk, dv), conv_dim, params = _small_gdn_layer(7)
    rules = (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)
    calls = {}
    for name in ("gdn_factors", "advance_state", "update_suffix_map", "join_state", "_StepPlan"):
        def counted(*a, _name=name, _fn=getattr(bg, name), **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(bg, name, counted)

    class Syncs(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).split(".")[1] in ("_local_scalar_dense", "item", "nonzero", "is_nonzero"):
                Syncs.seen += 1
            return func(*args, **(kwargs or {}))

    def inputs(batch, width):
        return (torch.randn(batch, width, conv_dim, generator=gen), torch.randn(batch, width, hv, generator=gen),
                torch.randn(batch, width, hv, generator=gen))

    counts = {}
    for batch in (1, 6):
        packed = PackedGDNState(batch, params, torch.float32, "cpu")
        alone = [PackedGDNState(1, params, torch.float32, "cpu") for _ in range(batch)]
        prefill = [L(0, 5 + i, I) for i in range(batch)]
        decode = [L(0, 1, G, True)] * batch
        # sequences past the leading segment and in it, chunks of different lengths: every branch of a record step
        fused = [L(1 + i % 3, 1, G, True) for i in range(batch)]
        steps = [prefill] + [decode] * (3 if batch == 1 else 0) + [[L(0, 1, G, i % 2 == 0) for i in range(batch)]] * 3
        steps += [fused]
        for layouts in steps:
            width = max(lay.n_deferred + lay.n_rest for lay in layouts)
            qkv, a, b = inputs(batch, width)
            calls.clear()
            plans, Syncs.seen = {}, 0
            with Syncs():
                core = packed.step(qkv, a, b, layouts, params, *rules, plans=plans)
            assert Syncs.seen == 0
            counts[batch] = dict(calls)  # (of the last step when the loop ends: the fused one)
            for i, lay in enumerate(layouts):
                n = lay.n_deferred + lay.n_rest
                want = alone[i].step(qkv[i:i + 1, :n], a[i:i + 1, :n], b[i:i + 1, :n], [lay], params, *rules)
                _close(core[i, :n], want[0], f"sequence {i} outputs")
                for name in PackedGDNState._NAMES:
                    _close(getattr(packed, name)[i], getattr(alone[i], name)[0], f"sequence {i} {name}")
        # the fused step's two layers: one plan
        qkv, a, b = inputs(batch, max(lay.n_deferred + lay.n_rest for lay in fused))
        calls.clear()
        plans = {}
        twin = PackedGDNState(batch, params, torch.float32, "cpu")
        twin.suffix_length = list(packed.suffix_length)
        packed.step(qkv, a, b, fused, params, *rules, plans=plans)
        twin.step(qkv, a, b, fused, params, *rules, plans=plans)
        assert calls["_StepPlan"] == 1
    # the last (fused) step, six sequences (three recording into M_R, three into the leading segment): the join's
    # and the records' factors one call each, one map update, the join's and the leading records' advance
    assert counts[6] == {"_StepPlan": 1, "gdn_factors": 2, "advance_state": 2, "join_state": 1,
                         "update_suffix_map": 1}, counts
    assert counts[1] == {"_StepPlan": 1, "gdn_factors": 2, "advance_state": 1, "join_state": 1,
                         "update_suffix_map": 1}, counts
