"""Raincheck (deferred multimodal prefill) for HF transformers' Qwen vision-language models (Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, Qwen2.5-VL).

    import raincheck_hf
    raincheck_hf.enable(model)
    out = model.generate(**inputs, raincheck=True)       # or raincheck=raincheck_hf.RaincheckConfig(...)

Importing this package changes nothing; `enable(model)` acts on that one model instance.
"""

import importlib

__version__ = "0.1.0"

# Public names, imported on first use: importing the package (as `python -m raincheck_hf --help` does)
# loads neither torch nor transformers; `raincheck_hf.enable`, `from raincheck_hf import X` work as usual.
_EXPORTS = {
    "DeferredDynamicCache": "cache_utils", "MODES": "configuration", "RaincheckConfig": "configuration",
    "RaincheckGenerateOutput": "generation", "RaincheckTrace": "generation", "restore_pending": "generation",
    "disable": "integration", "enable": "integration", "is_enabled": "integration", "Selector": "selection",
    "available_selectors": "selection", "get_selector": "selection", "register_selector": "selection",
    "Conversation": "conversation", "BatchLoop": "batch_loop", "warm_up": "warmup", "WarmUpSummary": "warmup",
    "IdleWarmUp": "warmup",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    try:  # a submodule (`raincheck_hf.generation` after a bare `import raincheck_hf`)
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'raincheck_hf' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "BatchLoop", "Conversation", "DeferredDynamicCache", "MODES", "RaincheckConfig", "RaincheckGenerateOutput", "RaincheckTrace",
    "Selector", "available_selectors", "disable", "enable", "get_selector", "is_enabled", "register_selector",
    "restore_pending", "warm_up", "WarmUpSummary", "IdleWarmUp",
]
