"""The package's layering (docs/architecture.md): no import circle, no import from a lower layer to a higher one.

The import graph is read from the source with `ast`, imports inside functions included (a lazy import is still a
dependency). Every module of the package must be placed in a layer below, so a new module is placed on purpose.
"""

from __future__ import annotations

import ast
import pathlib

import raincheck_hf

ROOT = pathlib.Path(raincheck_hf.__file__).parent

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS = [
    ("foundation", ["raincheck_hf", "raincheck_hf._triton", "raincheck_hf.patching", "raincheck_hf.masking",
                    "raincheck_hf.cache_utils", "raincheck_hf.kv_pool", "raincheck_hf.tiny", "raincheck_hf.persist",
                    "raincheck_hf.quality", "raincheck_hf.gdn", "raincheck_hf.batched_gdn",
                    "raincheck_hf.fast.context", "raincheck_hf.fast.compiled", "raincheck_hf.fast.attention",
                    "raincheck_hf.fast._triton_attention", "raincheck_hf.fast.autotune_ahead",
                    "raincheck_hf.fast.scoping", "raincheck_hf.fast.timing"]),
    ("selection and models", ["raincheck_hf.configuration", "raincheck_hf.selection", "raincheck_hf.models",
                              "raincheck_hf.plan"]),
    ("execution", ["raincheck_hf.fast", "raincheck_hf.runner"]),
    ("scheduling and drivers", ["raincheck_hf.generation", "raincheck_hf.batched", "raincheck_hf.batch_engine"]),
    ("public API", ["raincheck_hf.integration", "raincheck_hf.warmup", "raincheck_hf.loading",
                    "raincheck_hf.startup"]),
    ("sessions", ["raincheck_hf.batch_loop", "raincheck_hf.step_log", "raincheck_hf.conversation",
                  "raincheck_hf.serve.scheduler", "raincheck_hf.serve.store",
                  "raincheck_hf.serve.errors", "raincheck_hf.serve.schema", "raincheck_hf.serve.media",
                  "raincheck_hf.serve.protocol", "raincheck_hf.serve.admission", "raincheck_hf.serve.metrics",
                  "raincheck_hf.eval.harness"]),
    ("entry points", ["raincheck_hf.__main__", "raincheck_hf.serve", "raincheck_hf.eval", "raincheck_hf.bench"]),
]


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """``dotted module name -> file`` for every module of the package at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: pathlib.Path, known) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (``from x import y`` counts as ``x.y`` when that
    is a module, else ``x``)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


def graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """``module -> modules of the package at root it imports``."""
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def test_no_import_circle():
    assert cycles(graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
              for module, deps in graph().items() for dep in sorted(deps) if layer_of(dep) > layer_of(module)]
    assert upward == []
