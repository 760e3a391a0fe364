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
        (dict(mode="fast"), "mode='fast'"),
        (dict(selector="no-such-method"), "selector='no-such-method'"),
        (dict(selector=torch.ones(3)), "selector as a tensor"),
        (dict(selector=3), "selector=3"),
        (dict(selector="uniform", selector_kwargs={"x": 1}), "uniform"),
    ],
)
def test_invalid_config_names_the_setting(kwargs, name):
    with pytest.raises(ValueError) as info:
        RaincheckConfig(**kwargs)
    assert name in str(info.value)


def test_defaults_follow_the_method():
    cfg = RaincheckConfig()
    assert (cfg.retention, cfg.chunk_size, cfg.decode_guard, cfg.mode) == (0.3, 31, 16, "raincheck")


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
