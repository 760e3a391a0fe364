"""Model-family adapters: everything that knows a family's quirks lives in `models/<family>.py`
(the interface the engine calls: `base.ModelAdapter`; shared pieces: `mixins.py`)."""

from __future__ import annotations

from .base import ModelAdapter
from .qwen2_5_vl import Qwen2_5_VLAdapter
from .qwen3_5 import Qwen3_5Adapter
from .qwen3_5_moe import Qwen3_5MoeAdapter
from .qwen3_vl import Qwen3VLAdapter
from .qwen3_vl_moe import Qwen3VLMoeAdapter

ADAPTERS = (Qwen3VLAdapter, Qwen3VLMoeAdapter, Qwen3_5Adapter, Qwen3_5MoeAdapter, Qwen2_5_VLAdapter)


def supported_model_classes() -> list[str]:
    return [name for adapter in ADAPTERS for name in adapter.model_classes]


def get_adapter(model) -> ModelAdapter:
    """The adapter for ``model``; a clear ValueError naming the supported classes otherwise."""
    for adapter in ADAPTERS:
        if type(model).__name__ in adapter.model_classes:
            return adapter(model)
    raise ValueError(
        f"Raincheck does not support {type(model).__name__} (model_type="
        f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}); supported model classes: "
        f"{supported_model_classes()}."
    )
