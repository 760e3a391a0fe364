"""Invalid settings: a ValueError naming the setting and the value, before any compute."""

from __future__ import annotations

import pytest
import torch

import raincheck_hf
from raincheck_hf import RaincheckConfig

from conftest import INPUT_CASES, make_inputs


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(retention=1.5), "retention=1.5"),
        (dict(retention=-0.1), "retention=-0.1"),
        (dict(retention=float("nan")), "retention=nan"),
        (dict(retention="0.3"), "retention='0.3'"),
        (dict(chunk_size=0), "chunk_size=0"),
        (dict(chunk_size=2.5), "chunk_size=2.5"),
        (dict(decode_guard=-1), "decode_guard=-1"),
        (dict(chunk_size="big"), "chunk_size='big'"),
        (dict(tpot_slack=float("nan")), "tpot_slack=nan"),
        (dict(tpot_slack=-0.01), "tpot_slack=-0.01"),
        (dict(tpot_slack=True), "tpot_slack=True"),
        (dict(compile_steps=1), "compile_steps=1"),
        (dict(compile_steps="yes"), "compile_steps='yes'"),
        (dict(mode="fast"), "mode='fast'"),
        (dict(restore_order="score"), "restore_order='score'"),
        (dict(restore_order=None), "restore_order=None"),
        (dict(selector="no-such-method"), "selector='no-such-method'"),
        (dict(selector=torch.ones(3)), "selector as a tensor"),
        (dict(selector=3), "selector=3"),
        (dict(selector="uniform", selector_kwargs={"x": 1}), "uniform"),
        (dict(batch_chunk_rows=0), "batch_chunk_rows=0"),
        (dict(batch_chunk_rows=-8), "batch_chunk_rows=-8"),
        (dict(batch_chunk_rows=2.5), "batch_chunk_rows=2.5"),
        (dict(batch_chunk_rows=True), "batch_chunk_rows=True"),
        (dict(batch_chunk_rows="64"), "batch_chunk_rows='64'"),
        (dict(chunk_every=0), "chunk_every=0"),
        (dict(chunk_every=True), "chunk_every=True"),
        (dict(chunk_every=1.5), "chunk_every=1.5"),
        (dict(chunk_size="auto", chunk_every=4), "chunk_every=4"),
    ],
)
def test_invalid_config_names_the_setting(kwargs, name):
    with pytest.raises(ValueError) as info:
        RaincheckConfig(**kwargs)
    assert name in str(info.value)


def test_defaults_follow_the_method():
    cfg = RaincheckConfig()
    assert (cfg.retention, cfg.chunk_size, cfg.decode_guard, cfg.mode, cfg.restore_order) == (
        0.3, 31, 1, "raincheck", "source")


def test_batch_chunk_rows_is_none_by_default_and_takes_none_or_a_positive_int():
    """The batched steps' shared chunk cap: None by default (every sequence carries its full chunk: each row of a
    batch equals its own call), or an integer >= 1 (numpy integers normalised); anything else is refused by name, on
    assignment too (the old value stays)."""
    import numpy as np

    assert RaincheckConfig().batch_chunk_rows is None
    assert RaincheckConfig(batch_chunk_rows=None).batch_chunk_rows is None
    cfg = RaincheckConfig(batch_chunk_rows=np.int64(1))
    assert cfg.batch_chunk_rows == 1 and type(cfg.batch_chunk_rows) is int
    for bad in (0, 1.0, "all"):
        with pytest.raises(ValueError, match=r"RaincheckConfig\.batch_chunk_rows=.* must be None \(no sharing"):
            cfg.batch_chunk_rows = bad
    assert cfg.batch_chunk_rows == 1
    assert RaincheckConfig.coerce({"batch_chunk_rows": None}).batch_chunk_rows is None


@pytest.mark.parametrize("value", [None, True, False])
def test_compile_steps_is_auto_by_default_and_takes_a_bool(value):
    """None (the default: compiled where the steps are captured, `fast.compiled.resolve_compile_steps`), True or
    False; anything else is refused by name, at construction and on assignment (the old value stays)."""
    assert RaincheckConfig().compile_steps is None
    cfg = RaincheckConfig(compile_steps=value)
    assert cfg.compile_steps is value
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match=r"RaincheckConfig\.compile_steps=.* must be None \(auto"):
            cfg.compile_steps = bad
        assert cfg.compile_steps is value


class _CountVisionCalls:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.model.visual.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


@pytest.mark.parametrize(
    "raincheck,extra,match",
    [
        (dict(retention=2.0), {}, "retention=2.0"),
        ("yes", {}, "raincheck='yes'"),
        (dict(mode="nope"), {}, "mode='nope'"),
        (RaincheckConfig(selector=torch.ones(5, dtype=torch.bool)), {}, "keep-mask of 5 entries"),
        (True, {"num_beams": 2}, "num_beams"),
        (True, {"output_attentions": True}, "output_attentions"),
        (True, {"custom_generate": lambda *a, **k: None}, "custom_generate"),
    ],
)
def test_generate_rejects_bad_requests_before_compute(model, processor, raincheck, extra, match):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    counter = _CountVisionCalls(model)
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(**inputs, max_new_tokens=3, raincheck=raincheck, **extra)
        assert counter.calls == 0, "the vision tower ran before the request was rejected"
    finally:
        counter.handle.remove()


def test_batch_and_padding_are_rejected(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    ids = inputs["input_ids"]
    with pytest.raises(ValueError, match="batch size 2"):
        model.generate(input_ids=ids.repeat(2, 1), max_new_tokens=2, raincheck=True)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, raincheck=True)


def test_continuation_must_extend_the_cached_conversation(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    out = model.generate(**inputs, max_new_tokens=3, raincheck=True, return_dict_in_generate=True)
    wrong = out.sequences.clone()
    wrong[0, 0] += 1
    with pytest.raises(ValueError, match="whole conversation"):
        model.generate(input_ids=torch.cat([wrong, wrong[:, -2:]], 1), cache=out.cache, max_new_tokens=2,
                       raincheck=True)
    with pytest.raises(ValueError, match="whole conversation"):
        model.generate(input_ids=out.sequences[:, :5], cache=out.cache, max_new_tokens=2, raincheck=True)


def test_attention_backend_without_masks_names_sdpa(processor):
    from raincheck_hf.tiny import build_tiny_qwen3_vl

    m = raincheck_hf.enable(build_tiny_qwen3_vl())
    m.config.text_config._attn_implementation = "flash_attention_2"  # cannot be installed here; simulate it
    with pytest.raises(ValueError, match="sdpa"):
        m.generate(**make_inputs(processor, **INPUT_CASES["one_image"]), max_new_tokens=2, raincheck=True)


def test_unsupported_model_is_named():
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        raincheck_hf.enable(tiny)


# ---- settings changed after construction -----------------------------------------------------------

CHANGED = [
    ("chunk_size", 0, "chunk_size=0"),
    ("chunk_size", -3, "chunk_size=-3"),
    ("chunk_size", 2.5, "chunk_size=2.5"),
    ("decode_guard", -1, "decode_guard=-1"),
    ("chunk_every", 0, "chunk_every=0"),
    ("retention", float("nan"), "retention=nan"),
    ("retention", "0.3", "retention='0.3'"),
    ("retention", 1.5, "retention=1.5"),
    ("mode", "fast", "mode='fast'"),
    ("restore_order", "backwards", "restore_order='backwards'"),
    ("selector", torch.ones(4, dtype=torch.int64), "dtype=torch.int64"),
    ("selector", torch.ones(4), "dtype=torch.float32"),
    ("selector", "no-such-method", "selector='no-such-method'"),
    ("selector_kwargs", {"x": 1}, "selector_kwargs={'x': 1}"),
    ("selector_kwargs", "x", "selector_kwargs='x'"),
    ("fast_path", "yes", "fast_path='yes'"),
]


@pytest.mark.parametrize("name,value,match", CHANGED, ids=[f"{n}={v!r}" for n, v, _ in CHANGED])
def test_a_setting_changed_after_construction_is_checked(name, value, match):
    cfg = RaincheckConfig(selector="uniform")
    before = getattr(cfg, name)
    with pytest.raises(ValueError, match=f"RaincheckConfig.{name}") as info:
        setattr(cfg, name, value)
    assert match in str(info.value)
    assert getattr(cfg, name) is before  # the config keeps its valid value
    cfg.chunk_size, cfg.mode, cfg.retention = 7, "hard", 0  # valid changes are taken (numbers normalised)
    assert (cfg.chunk_size, cfg.mode, cfg.retention) == (7, "hard", 0.0) and isinstance(cfg.retention, float)


def test_a_setting_changed_in_place_is_checked_when_used(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = RaincheckConfig(selector="uniform")
    cfg.selector_kwargs["no_such_option"] = 3  # a dict changed in place: no assignment to see it
    counter = _CountVisionCalls(model)
    try:
        with pytest.raises(ValueError, match="RaincheckConfig.selector_kwargs"):
            model.generate(**inputs, max_new_tokens=3, raincheck=cfg)
        with pytest.raises(ValueError, match="RaincheckConfig.selector_kwargs"):
            with raincheck_hf.Conversation(model, processor, RaincheckConfig(selector="uniform"),
                                           background=False) as conv:
                conv.config.selector_kwargs["no_such_option"] = 3
                conv.ask("What is in this image?", images=[INPUT_CASES["one_image"]["images"][0]])
        assert counter.calls == 0, "the vision tower ran before the request was rejected"
    finally:
        counter.handle.remove()


def test_a_conversation_checks_its_config_before_every_turn(model, processor):
    with raincheck_hf.Conversation(model, processor, RaincheckConfig(selector="uniform"), background=False,
                                   max_new_tokens=3) as conv:
        conv.config.selector = torch.ones(4, dtype=torch.bool)  # a valid config, but not for a conversation
        with pytest.raises(ValueError, match="boolean selector mask"):
            conv.ask("hi")
        conv.config = {"mode": "hard"}
        with pytest.raises(ValueError, match="Conversation.config"):
            conv.ask("hi")
        assert conv.turns == [] and conv.cache is None


def test_each_call_uses_its_own_copy_of_the_config(model, processor):
    """A config changed while a call runs (another thread) does not change that call."""
    from transformers import LogitsProcessorList

    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    cfg = RaincheckConfig(selector="uniform", chunk_size=2, decode_guard=1)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    want = model.generate(**inputs, raincheck=RaincheckConfig(selector="uniform", chunk_size=2, decode_guard=1), **kw)

    def change(input_ids, scores):
        cfg.chunk_size, cfg.mode = 5, "post_answer"
        return scores

    got = model.generate(**inputs, raincheck=cfg, logits_processor=LogitsProcessorList([change]), **kw)
    assert [r.tolist() for r in got.raincheck.restored_per_forward] == [
        r.tolist() for r in want.raincheck.restored_per_forward]
    assert cfg.chunk_size == 5  # the caller's object did change


def test_an_unknown_key_in_a_dict_config_is_named(model, processor):
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    counter = _CountVisionCalls(model)
    try:
        with pytest.raises(ValueError) as info:
            model.generate(**inputs, max_new_tokens=3, raincheck={"retention": 0.5, "foo": 1})
        assert counter.calls == 0
    finally:
        counter.handle.remove()
    message = str(info.value)
    assert "'foo'" in message and "retention" not in message.split("valid")[0]
    assert all(name in message.split("valid")[1] for name in ("retention", "chunk_size", "decode_guard", "selector",
                                                               "mode", "selector_kwargs", "fast_path"))


# ---- retention 0: every multimodal token deferred (docs/method.md allows r = 0) -------------------------------

@pytest.mark.parametrize("selector", ["uniform", "mmtok", "fastv", "visionzip"])
@pytest.mark.parametrize("fast_path", [False, True])
def test_retention_zero_defers_every_multimodal_token(model, processor, selector, fast_path):
    from reference import TurnRecord, reference_logits

    inputs = make_inputs(processor, **INPUT_CASES["two_images"])
    n_visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    out = model.generate(**inputs, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, raincheck=RaincheckConfig(retention=0.0, selector=selector,
                                                                        chunk_size=4, decode_guard=2,
                                                                        fast_path=fast_path))
    trace = out.raincheck
    assert trace.selected.numel() == 0 and trace.deferred.numel() == n_visual
    restored = torch.cat(trace.restored_per_forward).numel()
    assert restored + trace.pending.numel() == n_visual and restored > 0
    rec = TurnRecord(inputs["input_ids"], out, inputs["pixel_values"], inputs["image_grid_thw"])
    with torch.no_grad():
        for got, want in zip(out.logits, reference_logits(model, [rec])[0]):
            assert (got[0] - want).abs().max() <= 1e-4


def test_readme_and_docstrings_say_what_retention_zero_does():
    from pathlib import Path

    from raincheck_hf.selection.base import keep_count

    assert keep_count(0.0, 50) == 0 and keep_count(0.01, 50) == 1 and keep_count(1.0, 50) == 50
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`retention=0` selects none" in readme  # not "at least one" without the exception
    assert "r = 0 selects none" in RaincheckConfig.__doc__


def test_enable_names_an_unsupported_transformers_version_before_any_compute(monkeypatch):
    """The engine is built on one transformers minor version (pyproject.toml's pin): another one gets a clear error
    from `enable` (and so from `Conversation`, `load`, the server), not an obscure failure mid-generate."""
    import pathlib
    import re

    import transformers

    from raincheck_hf import integration

    pin = re.search(r'"transformers>=([\d.]+),<([\d.]+)"',
                    (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pin and pin.groups() == integration.TRANSFORMERS_RANGE  # the check and the pin say the same
    integration.check_transformers()  # the installed one
    integration.check_transformers("5.24.3.dev0")
    for bad in ("5.17.0", "5.25.0", "6.0.0"):
        with pytest.raises(RuntimeError, match=rf"needs transformers >=5.24,<5.25; this environment has transformers "
                                               rf"{re.escape(bad)}"):
            integration.check_transformers(bad)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match="transformers 5.17.0"):
        integration.enable(object())
