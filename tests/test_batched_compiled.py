"""``RaincheckConfig.compile_steps`` on the batched engine's captured decode steps (`fast.batched_graphs`), on CPU.

With ``compile_steps`` (on by default where the steps are captured, i.e. on CUDA) a batched decode step runs the
family's compiled forms (`ModelAdapter.compile_targets`: Qwen3-VL's decoder layers as two compiled regions around
the cache write and the attention, the other families' RMSNorms and dense MLPs) inside the static-buffer step, as the
single-sequence fast path's steps do; the few-query attention keeps its Triton kernel there (at a batch the kernel
beats the compiled matmul form). Here Inductor compiles for the CPU and the "captured" step runs eagerly on its
buffers (`test_batched_graphs.replay_log`); the reference is the eager engine: tokens identical, logits within 1e-4.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from raincheck_hf import RaincheckConfig
from raincheck_hf.fast import attention as attention_module
from raincheck_hf.fast import batched_graphs
from raincheck_hf.models import get_adapter

from conftest import assert_same_output, count_compiled_calls
from families import family_model, family_params, family_processor
from test_batched import IMAGE, TEXT, TWO_IMAGES, assert_cache_equal, assert_trace_equal, batched_inputs, run
from test_batched_graphs import replay_log  # noqa: F401 (the fixture)

TOL = 1e-4

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile's CPU backend needs a C++ compiler")


# (family, mode): Qwen3-VL's fused layers in raincheck (chunks ride with the tokens) and full; the default targets
# (norms, MLPs) on Qwen3.5 beside its static-buffer Gated DeltaNet step
CASES = [("qwen3_vl", "raincheck"), ("qwen3_vl", "full"), ("qwen3_5", "raincheck")]


@pytest.mark.parametrize("name,mode", [pytest.param(*c, id="-".join(c)) for c in CASES])
def test_compiled_batched_steps_equal_the_eager_engine(name, mode, replay_log, monkeypatch):
    """``generate`` with B = 3 and ``compile_steps=True``: every replayed decode step ran the compiled forms (both of
    Qwen3-VL's regions in every layer, or the norms and MLPs), the attention kept its own form (its core was never
    compiled), the replays' keys say so, and the answer equals the eager engine's (tokens, logits 1e-4, traces,
    caches)."""
    model, processor = family_model(name), family_processor(name)
    cfg = RaincheckConfig(mode=mode, retention=0.8, chunk_size=3, decode_guard=1)
    rows = [TWO_IMAGES, IMAGE, TEXT]
    want = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=False), 8)
    calls = count_compiled_calls(monkeypatch)
    got = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=True, compile_steps=True), 8)
    assert_same_output(got, want, TOL, "step")
    for i in range(len(rows)):
        assert_trace_equal(got.raincheck[i], want.raincheck[i])
        assert_cache_equal(got.cache[i], want.cache[i])
    assert replay_log and all(key.compiled for key in replay_log)
    if mode == "raincheck":
        assert any(key.width > 1 for key in replay_log)
    layers = len(get_adapter(model).text_model.layers)
    assert attention_module._few_query not in calls  # the kernel / matmul form, not the compiled core
    if name == "qwen3_vl":
        from raincheck_hf.models.qwen3_vl import _attention_inputs, _layer_output

        assert set(calls) == {_attention_inputs, _layer_output}
        runs = len(replay_log) + len(set(replay_log))  # every replay, and each key's first run when it is captured
        assert calls.count(_attention_inputs) == calls.count(_layer_output) == layers * runs
    else:
        assert len(calls) >= len(replay_log) * layers  # a norm or an MLP of every layer, every replay
    assert all("forward" not in vars(m) for m, _ in get_adapter(model).compile_targets())  # dispatchers gone


def test_compile_steps_default_follows_whether_the_steps_are_captured(replay_log, monkeypatch):
    """``compile_steps=None`` (the default) compiles a batched step exactly when it is captured as a CUDA graph (on
    CUDA); on CPU the static-buffer step runs uncompiled, and ``compile_steps=False`` never compiles."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    calls = count_compiled_calls(monkeypatch)
    for setting in (None, False):
        cfg = RaincheckConfig(retention=0.8, chunk_size=3, decode_guard=1, fast_path=True, compile_steps=setting)
        run(model, batched_inputs(processor, [IMAGE, TEXT]), cfg, 4)
    assert replay_log and not any(key.compiled for key in replay_log) and calls == []


def test_compiled_and_plain_steps_of_one_model_keep_their_own_graphs(replay_log, monkeypatch):
    """Engines of one model with and without ``compile_steps`` share its kept pool: each step key says whether it is
    compiled, so a later plain call replays plain steps (nothing compiled runs) and equals the eager engine."""
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    rows = [IMAGE, TEXT]
    cfg = RaincheckConfig(retention=0.8, chunk_size=3, decode_guard=1)
    want = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=False), 6)
    run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=True, compile_steps=True), 6)
    assert replay_log and all(key.compiled for key in replay_log)
    replay_log.clear()
    calls = count_compiled_calls(monkeypatch)
    got = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=True, compile_steps=False), 6)
    assert replay_log and not any(key.compiled for key in replay_log) and calls == []
    assert_same_output(got, want, TOL, "step")


@pytest.mark.parametrize("family", family_params(["qwen3_vl_moe", "qwen2_5_vl"]))
def test_compiled_batched_steps_of_other_families(family, replay_log):
    """The default targets on the other attention families' batched steps (Qwen2.5-VL's norms and MLPs; Qwen3-VL-MoE's
    norms, its experts left as they are)."""
    from conftest import no_placeholder_ids

    model, processor = family_model(family), family_processor(family)
    cfg = RaincheckConfig(retention=0.8, chunk_size=3, decode_guard=1)
    kw = dict(suppress_tokens=no_placeholder_ids(model))
    rows = [IMAGE, TEXT]
    want = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=False), 6, **kw)
    got = run(model, batched_inputs(processor, rows), dataclasses.replace(cfg, fast_path=True, compile_steps=True), 6,
              **kw)
    assert replay_log and all(key.compiled for key in replay_log)
    assert_same_output(got, want, TOL, "step")


def test_the_single_sequence_steps_still_compile_the_attention_core(monkeypatch):
    """The batched steps keep the attention kernel, the single-sequence fast path's compiled steps still run the
    compiled few-query core (its measured choice at one sequence): the scope flag is per step."""
    from raincheck_hf.fast.context import active_scope
    from raincheck_hf.fast.scoping import step_scope

    model = family_model("qwen3_vl")
    text_model = get_adapter(model).text_model
    targets = get_adapter(model).compile_targets()
    with step_scope(text_model, [], compile_targets=targets):
        assert active_scope().compiled and active_scope().compiled_attention
    with step_scope(text_model, [], compile_targets=targets, compile_attention=False):
        assert active_scope().compiled and not active_scope().compiled_attention
    with step_scope(text_model, []):
        assert not active_scope().compiled and not active_scope().compiled_attention
    assert active_scope() is None


def test_row_wise_forms_take_few_graphs_whatever_the_shapes():
    """Qwen3.5's norms and MLPs run as `fast.compiled.RowWise` forms: over single-sequence and batched steps (one and
    several rows, one and several sequences, the layer norms' ``[B, W, D]`` and the query / key norms'
    ``[B, W, H, d]``) each compiled function holds a few Dynamo graphs, far from the recompile limit past which its
    further shapes would run uncompiled (the class's own ``forward`` compiled as called took a graph per rank and per
    leading dimension of size 1: past the limit of 8 in a batched benchmark on the GPU)."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from conftest import no_placeholder_ids
    from raincheck_hf.fast.compiled import RowWise

    model, processor = family_model("qwen3_5"), family_processor("qwen3_5")
    cfg = RaincheckConfig(retention=0.5, chunk_size=3, decode_guard=1, fast_path=True, compile_steps=True)
    kw = dict(suppress_tokens=no_placeholder_ids(model))
    for rows in ([IMAGE], [TWO_IMAGES, IMAGE, TEXT], [IMAGE, TEXT]):
        run(model, batched_inputs(processor, rows), cfg, 5, **kw)
    forms = {impl for _, impl in get_adapter(model).compile_targets()}
    assert forms and all(isinstance(f, RowWise) for f in forms)
    graphs = {(f.fn.__qualname__, key): len(_debug_get_cache_entry_list(copy.__code__))
              for f in forms for key, copy in f.copies.items()}
    norms = {key for name, key in graphs if name == "Qwen3_5RMSNorm.forward"}
    assert len(norms) == 3, graphs  # the layer norms, the query norm (the strided half of a projection), the key norm
    # one row, or several from a base of one row per sequence (tokens), of one sequence (a prompt piece alone in its
    # prefill step) or of several of several rows (Dynamo guards a view's base), the first several-row shape once
    # static before Dynamo makes the row count dynamic
    assert all(1 <= n <= 5 for n in graphs.values()), graphs
    assert max(graphs.values()) < torch._dynamo.config.recompile_limit
