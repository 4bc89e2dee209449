"""The package's shape, measured: no import cycle (imports inside functions included), each layer
imports only the layers below it, no module over 400 lines and no function over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "paritykit"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Layer of each top-level part, lowest first; a module may import its own layer and those below.
LAYERS = {
    "__main__": 7,
    "errors": 0, "harness": 1, "compare": 2, "convert": 2, "strategies": 2, "sync": 2,
    "dist": 3, "engine": 4, "checks": 5, "gate": 6, "plugin": 7, "__init__": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every paritykit module ``tree`` imports, at any depth (inside functions too)."""
    found = set()
    is_package = (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    trees = _modules()
    known = set(trees)
    return {name: _imports(name, tree, known) for name, tree in trees.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, stack.append(node)
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how packages re-export; not a cycle.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def test_there_is_no_import_cycle():
    assert _cycle(_graph()) is None


def test_each_layer_imports_only_the_layers_below_it():
    upward = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def _check_folder(module: str) -> str | None:
    """The check folder a module belongs to (``paritykit.checks.<folder>...``), or None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "checks" and (PACKAGE / "checks" / parts[2]).is_dir():
        return parts[2]
    return None


def test_no_check_imports_another_check():
    crossing = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _check_folder(module) and _check_folder(target) and _check_folder(module) != _check_folder(target)
    ]
    assert crossing == []


def test_the_engine_sits_below_every_check():
    assert {f"{m} -> {t}" for m, ts in _graph().items() if m.startswith("paritykit.engine") for t in ts
            if t.startswith("paritykit.checks")} == set()


def test_the_plugin_imports_only_dist_the_facade_and_the_profiles():
    allowed = ("paritykit", "paritykit.dist", "paritykit.gate.profiles")
    assert {t for t in _graph()["paritykit.plugin"] if not t.startswith(allowed)} == set()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_MODULE_LINES
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse("\n".join(lines)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
