"""The layout of `raincheck_hf.gdn`: no import circle through it, no import of a higher layer from it, and one
`GDNState` protocol that the eager and the static layer states both satisfy. CPU, static checks and one tiny
object each."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import raincheck_hf
from raincheck_hf.gdn import GDNState
from raincheck_hf.gdn.eager import EagerGDNState
from raincheck_hf.gdn.static import RecurrentLayout, StaticGDNState

PACKAGE = Path(raincheck_hf.__file__).parent
# what the GDN package sits on; everything else of raincheck_hf (models, fast, generation, batched, serve, ...)
# sits on it
ALLOWED_BELOW = {"raincheck_hf.cache_utils", "raincheck_hf.patching", "raincheck_hf._triton"}


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``module -> modules of the package at root it imports``, module-level and function-level imports alike."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    names = {name for name, _ in modules}
    graph = {}
    for (name, is_package), path in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in names and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_level_imports(tmp_path):
    # the circle gated_delta <-> fast.gdn_kernels that this package removed went through an import inside a
    # function: the check must see those
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (package / "sub" / "b.py").write_text("from ..a import f\n")
    graph = import_graph(package)
    assert "pkg.sub.b" in graph["pkg.a"] and "pkg.a" in graph["pkg.sub.b"]
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert "raincheck_hf.gdn.dispatch" in import_graph()["raincheck_hf.models.qwen3_5"]


def test_no_import_circle_through_gdn():
    through = [c for c in cycles(import_graph()) if any(m.startswith("raincheck_hf.gdn") for m in c)]
    assert through == []


def test_gdn_imports_nothing_above_it():
    graph = import_graph()
    upward = {name: sorted(t for t in targets if not t.startswith("raincheck_hf.gdn") and t not in ALLOWED_BELOW
                           and t != "raincheck_hf")
              for name, targets in graph.items() if name.startswith("raincheck_hf.gdn")}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_eager_and_static_states_satisfy_the_protocol():
    assert issubclass(EagerGDNState, GDNState) and issubclass(StaticGDNState, GDNState)
    layout = RecurrentLayout((0,), 1, 2, 4, 4, 4, torch.float32)
    assert isinstance(StaticGDNState(layout, "cpu"), GDNState)
