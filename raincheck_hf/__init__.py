"""Raincheck (deferred multimodal prefill) for HF transformers' Qwen vision-language models (Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, Qwen2.5-VL).

    import raincheck_hf
    raincheck_hf.enable(model)
    out = model.generate(**inputs, raincheck=True)       # or raincheck=raincheck_hf.RaincheckConfig(...)

Importing this package changes nothing; `enable(model)` acts on that one model instance.
"""

from .cache_utils import DeferredDynamicCache
from .configuration import MODES, RaincheckConfig
from .generation import RaincheckGenerateOutput, RaincheckTrace, restore_pending
from .integration import disable, enable, is_enabled
from .selection import Selector, available_selectors, get_selector, register_selector

__version__ = "0.1.0"


def __getattr__(name):
    # Conversation pulls in threading and the processor machinery; import it on first use
    if name == "Conversation":
        from .conversation import Conversation

        return Conversation
    raise AttributeError(f"module 'raincheck_hf' has no attribute {name!r}")


__all__ = [
    "Conversation", "DeferredDynamicCache", "MODES", "RaincheckConfig", "RaincheckGenerateOutput", "RaincheckTrace",
    "Selector", "available_selectors", "disable", "enable", "get_selector", "is_enabled", "register_selector",
    "restore_pending",
]
