"""The import graph: no module imports itself back, and packages import only downwards.

Read statically (every `import` anywhere in a module, function bodies included), so a deferred
import cannot hide a cycle. Layers, lowest first: the engine (`jaxpp_integration`: `jax_compat`,
then `frontend` and `schedules`, `compiler`, `tools`, `runtime`, `api`), then the trainer
(`MaxText`: errors, `config`, `cluster`, model/data/sharding/optimizer/metrics, `checkpoint`,
`train_step`, `planning`, then the entry points), then `benchmarks`.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Package (or top-level module) -> layer. A package may import its own layer or lower ones.
LAYERS = {
    "jaxpp_integration.jax_compat": 0,
    "jaxpp_integration.frontend": 1,
    "jaxpp_integration.schedules": 1,
    "jaxpp_integration.compiler": 2,
    "jaxpp_integration.tools": 3,
    "jaxpp_integration.runtime": 4,
    "jaxpp_integration.api": 5,
    "jaxpp_integration": 5,
    "MaxText": 6,
    "MaxText.errors": 6,
    "MaxText.exit_codes": 6,
    "MaxText.venv": 6,
    "MaxText.config": 7,
    "MaxText.cluster": 8,
    "MaxText.model": 9,
    "MaxText.data": 9,
    "MaxText.sharding": 9,
    "MaxText.optimizer": 9,
    "MaxText.metrics": 9,
    "MaxText.profiling": 9,
    "MaxText.memory": 9,
    "MaxText.step_clock": 9,
    "MaxText.checkpoint": 10,
    "MaxText.dpo_step": 11,
    "MaxText.train_step": 11,
    "MaxText.convert": 11,
    "MaxText.planning": 12,
    "MaxText.train": 13,
    "MaxText.plan": 13,
    "MaxText.generate": 13,
    "MaxText.launch": 13,
    "MaxText.to_maxtext": 13,
    "MaxText.to_huggingface": 13,
    "benchmarks": 14,
}
# Upward imports that are known and scheduled to go (each entry is checked to still exist, so a
# fixed one must be removed from this list).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {
    _module_name(p): p
    for top in ("MaxText", "jaxpp_integration", "benchmarks")
    for p in (REPO / top).rglob("*.py")
}


def _imports(path: Path) -> set[str]:
    """Project modules `path` imports (`from pkg import submodule` counts the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name in MODULES}


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def _layer_of(module: str) -> str:
    """The longest LAYERS key that is `module` or a package containing it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return key
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def _package_edges() -> set[tuple[str, str]]:
    return {
        (_layer_of(a), _layer_of(b))
        for a, targets in GRAPH.items()
        for b in targets
        if _layer_of(a) != _layer_of(b)
    }


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer_of(module)


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle of `graph`, once each, written from its least module."""
    cycles = []

    def visit(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                cycles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:
                visit(nxt, [*path, nxt])

    for module in sorted(graph):
        visit(module, [module])
    return cycles


def upward(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in edges if LAYERS[a] < LAYERS[b]}


def test_no_import_cycle_between_modules():
    # A package's __init__ re-exporting its own modules is not a cycle: drop those edges.
    graph = {
        a: {b for b in targets if not (a.startswith(b + ".") and MODULES[b].name == "__init__.py")}
        for a, targets in GRAPH.items()
    }
    assert find_cycles(graph) == []


def test_packages_import_only_downwards():
    found = upward(_package_edges())
    assert found - KNOWN_UPWARD == set(), sorted(found - KNOWN_UPWARD)
    assert KNOWN_UPWARD <= found, f"fixed, remove from KNOWN_UPWARD: {KNOWN_UPWARD - found}"


def test_the_engine_never_imports_the_trainer():
    engine = [m for m in GRAPH if m.startswith("jaxpp_integration")]
    assert [(m, t) for m in engine for t in GRAPH[m] if not t.startswith("jaxpp_integration")] == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == ["a -> b -> c -> a"]
    assert upward(
        {("MaxText.config", "MaxText.planning"), ("MaxText.train", "MaxText.config")}
    ) == {("MaxText.config", "MaxText.planning")}
    assert _layer_of("MaxText.planning.cost_model") == "MaxText.planning"


def private_imports(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, name) for every `from <project module> import _name` of another module's
    private name (packages talk through public names)."""
    found = []
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in MODULES:
                found += [
                    (m, f"{node.module}.{a.name}")
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports(MODULES) == []


def test_the_private_name_check_catches_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from jaxpp_integration.compiler.compile import _Remote\n")
    assert private_imports({"probe": probe}) == [
        ("probe", "jaxpp_integration.compiler.compile._Remote")
    ]
