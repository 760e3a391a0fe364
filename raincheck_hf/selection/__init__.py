"""Selectors (pruning methods) decide *which* multimodal tokens are prefilled first.

Use a registered name (``"uniform"``, ...), a :class:`Selector` instance, or, in
:class:`~raincheck_hf.RaincheckConfig`, a boolean tensor over the prompt's multimodal tokens.
"""

from __future__ import annotations

import importlib

from .base import Segment, SelectionContext, Selector, StartedSelection, keep_count

# name -> "module:Class" (imported on first use, so importing the package stays cheap)
_BUILTIN = {
    "uniform": "uniform:UniformSelector",
    "random": "random:RandomSelector",
    "divprune": "divprune:DivPruneSelector",
    "mmtok": "mmtok:MMTokSelector",
    "cdpruner": "cdpruner:CDPrunerSelector",
    "visionzip": "visionzip:VisionZipSelector",
    "fastv": "fastv:FastVSelector",
}
_REGISTERED: dict[str, type] = {}


def register_selector(name: str, cls: type) -> type:
    """Make ``cls`` (a :class:`Selector` subclass) available by ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, Selector)):
        raise TypeError(f"register_selector({name!r}, ...) needs a Selector subclass, got {cls!r}")
    _REGISTERED[name] = cls
    return cls


def available_selectors() -> list[str]:
    """Names usable as ``RaincheckConfig(selector=...)``, the ones whose module is present."""
    names = set(_REGISTERED)
    for name, target in _BUILTIN.items():
        if importlib.util.find_spec(f"{__name__}.{target.split(':')[0]}") is not None:
            names.add(name)
    return sorted(names)


def get_selector(name: str, **kwargs) -> Selector:
    """Instantiate the selector registered as ``name``."""
    cls = _REGISTERED.get(name)
    if cls is None and name in _BUILTIN:  # (its own module only: a search for every selector's costs each request)
        module_name, cls_name = _BUILTIN[name].split(":")
        full = f"{__name__}.{module_name}"
        try:
            cls = getattr(importlib.import_module(full), cls_name)
        except ModuleNotFoundError as error:
            if error.name != full:  # a module it needs is missing: that is the user's to see
                raise
    if cls is not None:
        try:
            return cls(**kwargs)
        except TypeError as error:  # an unknown or missing field
            raise ValueError(f"RaincheckConfig.selector_kwargs={kwargs!r} do not fit selector {name!r}: {error}") from None
    raise ValueError(
        f"RaincheckConfig.selector={name!r} is not a registered selector; choose one of "
        f"{available_selectors()}, pass a Selector instance, or a boolean keep-mask tensor."
    )


__all__ = ["Segment", "SelectionContext", "Selector", "StartedSelection", "keep_count", "register_selector",
           "get_selector", "available_selectors"]
