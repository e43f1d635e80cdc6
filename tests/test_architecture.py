"""The package's layout is its architecture (docs/architecture.md): these tests hold it.

Every ``import`` in ``src/qkv`` is read from the source (imports inside functions
included), so a lazy import cannot hide an upward dependency or a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "qkv"

# Layer of each top-level module or subpackage, lowest first. A module may import from
# its own layer or below, never above. The same table is drawn in docs/architecture.md.
LAYERS = {
    "utils": 0, "checks": 0, "kernels": 0, "options": 0,
    "functional": 1, "kv_cache": 1, "multihead": 1, "positional": 1, "scoring": 1,
    "latent_attention": 1, "attention_variants": 1, "linear_attention": 1,
    "book": 2,
    "models": 3,
    "data": 4,
    "training": 5,
    "tasks": 6, "heads": 6,
    "cli": 7, "bench": 7, "d2l": 7, "viz": 7,
    "__main__": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of_node(
    path: Path, node: ast.ImportFrom, alias: ast.alias
) -> list[tuple[int, str, str]]:
    """``[(line, module, name)]`` for one name of a ``from M import name`` of qkv code,
    the relative module resolved from ``path``; ``[]`` for other packages."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    if node.level:
        parts = package.split(".")
        base = parts[: len(parts) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target == "qkv" or target.startswith("qkv."):
        return [(node.lineno, target, alias.name)]
    return []


def imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` for every ``from M import name`` and ``import M`` of qkv code
    in ``path``, relative imports resolved; ``name`` is ``""`` for ``import M``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names if a.name.startswith("qkv")]
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found += imports_of_node(path, node, alias)
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


FILES = sorted(SRC.rglob("*.py"))
MODULES = {module_name(p): p for p in FILES}


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in MODULES if "." in m} - set(LAYERS))
    assert not unplaced, f"add {unplaced} to LAYERS here and to docs/architecture.md"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_only_downward(path):
    here = layer(module_name(path))
    if here is None:  # the package face, qkv/__init__.py, hands names on
        return
    upward = []
    for line, target, name in imports(path):
        # `from qkv import d2l` names a module; `from qkv.x import y` names x's layer.
        full = f"{target}.{name}" if target == "qkv" and name else target
        there = layer(full)
        if there is not None and there > here:
            upward.append(f"line {line}: {full} (layer {there})")
    assert not upward, f"{module_name(path)} (layer {here}) imports upward: {upward}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_name_crosses_a_module(path):
    crossing = [
        f"line {line}: {target}.{name}"
        for line, target, name in imports(path)
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    ]
    # Names bound to qkv modules (`from . import bahdanau_kernels as fused`): their
    # private attributes (`fused._x`) are as private as an imported `_x`.
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                for _, target, name in imports_of_node(path, node, alias):
                    if f"{target}.{name}" in MODULES:
                        modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            crossing.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not crossing, f"{module_name(path)} uses private names of other modules: {crossing}"


def test_no_import_cycles():
    # A package's __init__ only hands names on; its own imports are not edges.
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        edges = set()
        for _, target, name in imports(path):
            for candidate in (f"{target}.{name}", target):
                if candidate in MODULES and MODULES[candidate].name != "__init__.py":
                    edges.add(candidate)
                    break
        graph[mod] = edges - {mod}
    cycles, state = [], {}

    def visit(u: str, stack: list[str]) -> None:
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == "open":
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not cycles, cycles


def test_models_know_nothing_of_data_training_or_tasks():
    for mod, path in MODULES.items():
        if not mod.startswith("qkv.models"):
            continue
        for line, target, _ in imports(path):
            assert layer(target) is None or layer(target) <= LAYERS["models"], (mod, line, target)


def test_the_rules_catch_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    # The checks above must be able to fail: plant a models -> tasks import, a cycle and
    # a private name used from another module.
    fake = tmp_path / "qkv"
    (fake / "models").mkdir(parents=True)
    (fake / "tasks").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "models" / "__init__.py").write_text("")
    (fake / "tasks" / "__init__.py").write_text("")
    (fake / "models" / "a.py").write_text("def f():\n    from ..tasks.b import g\n")
    (fake / "tasks" / "b.py").write_text("from ..models.a import f\n")
    (fake / "tasks" / "c.py").write_text("from ..models import a\na._hidden()\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    path = fake / "models" / "a.py"
    monkeypatch.setattr(sys.modules[__name__], "MODULES",
                        {module_name(p): p for p in sorted(fake.rglob("*.py"))})
    with pytest.raises(AssertionError, match="imports upward"):
        test_imports_go_only_downward(path)
    with pytest.raises(AssertionError, match="qkv.models.a -> qkv.tasks.b -> qkv.models.a"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match=r"a\._hidden"):
        test_no_private_name_crosses_a_module(fake / "tasks" / "c.py")
