"""The layout of `raincheck_hf.gdn`: no import circle through it, no import of a higher layer from it, and one
`GDNState` protocol that the eager and the static layer states both satisfy. CPU, static checks and one tiny
object each."""

from __future__ import annotations

import torch

from raincheck_hf.gdn import GDNState
from raincheck_hf.gdn.eager import EagerGDNState
from raincheck_hf.gdn.static import RecurrentLayout, StaticGDNState

from test_architecture import cycles, graph

# what the GDN package sits on; everything else of raincheck_hf (models, fast, generation, batched, serve, ...)
# sits on it
ALLOWED_BELOW = {"raincheck_hf.cache_utils", "raincheck_hf.patching", "raincheck_hf._triton"}


def test_the_graph_sees_function_level_imports(tmp_path):
    # the circle gated_delta <-> fast.gdn_kernels that this package removed went through an import inside a
    # function: the check must see those
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (package / "sub" / "b.py").write_text("from ..a import f\n")
    edges = graph(package)
    assert "pkg.sub.b" in edges["pkg.a"] and "pkg.a" in edges["pkg.sub.b"]
    assert cycles(edges) == [["pkg.a", "pkg.sub.b"]]
    assert "raincheck_hf.gdn.dispatch" in graph()["raincheck_hf.models.qwen3_5"]


def test_no_import_circle_through_gdn():
    through = [c for c in cycles(graph()) if any(m.startswith("raincheck_hf.gdn") for m in c)]
    assert through == []


def test_gdn_imports_nothing_above_it():
    edges = graph()
    upward = {name: sorted(t for t in targets if not t.startswith("raincheck_hf.gdn") and t not in ALLOWED_BELOW
                           and t != "raincheck_hf")
              for name, targets in edges.items() if name.startswith("raincheck_hf.gdn")}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_eager_and_static_states_satisfy_the_protocol():
    assert issubclass(EagerGDNState, GDNState) and issubclass(StaticGDNState, GDNState)
    layout = RecurrentLayout((0,), 1, 2, 4, 4, 4, torch.float32)
    assert isinstance(StaticGDNState(layout, "cpu"), GDNState)
