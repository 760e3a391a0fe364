"""The one list of model families the conversation-level tests run on (each test file parametrises over it).

A family is its tiny model builder (`raincheck_hf.tiny`), its processor and its slow reference:
`reference.reference_logits` (one masked forward of the stock text model) for attention-only text
models, `reference_gdn.gdn_reference_logits` (the layers written out, GDN join applied tokenwise)
for Qwen3.5's hybrid layers. Models are built once per session.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

from raincheck_hf import tiny


@dataclass(frozen=True)
class Family:
    name: str
    builder: str  # a builder of raincheck_hf.tiny
    processor: str  # a processor builder of raincheck_hf.tiny
    linear_attention: bool = False  # Gated DeltaNet layers: the GDN reference

    def build(self, **kwargs):
        return getattr(tiny, self.builder)(**kwargs)

    def reference(self):
        if self.linear_attention:
            from reference_gdn import gdn_reference_logits

            return gdn_reference_logits
        from reference import reference_logits

        return reference_logits


FAMILIES = [
    Family("qwen3_vl", "build_tiny_qwen3_vl", "build_tiny_processor"),
    Family("qwen3_vl_moe", "build_tiny_qwen3_vl_moe", "build_tiny_processor"),
    Family("qwen3_5", "build_tiny_qwen3_5", "build_tiny_processor", linear_attention=True),
    Family("qwen3_5_moe", "build_tiny_qwen3_5_moe", "build_tiny_processor", linear_attention=True),
    Family("qwen2_5_vl", "build_tiny_qwen2_5_vl", "build_tiny_qwen2_5_vl_processor"),
]
BY_NAME = {f.name: f for f in FAMILIES}


def family_params(names=None):
    """``pytest.param`` per family (all, or the given names), id = the family's name."""
    return [pytest.param(f.name, id=f.name) for f in FAMILIES if names is None or f.name in names]


@functools.lru_cache(maxsize=None)
def family_model(name: str, attn_implementation: str = "sdpa"):
    """The family's tiny model (seed 0), enabled; one instance per session and attention backend."""
    import raincheck_hf

    return raincheck_hf.enable(BY_NAME[name].build(seed=0, attn_implementation=attn_implementation))


@functools.lru_cache(maxsize=None)
def family_processor(name: str):
    return getattr(tiny, BY_NAME[name].processor)()
