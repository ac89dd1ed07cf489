"""No import cycle among the experiment package's modules, counting deferred and TYPE_CHECKING imports.

A cycle that only works because one side imports late (inside a function, or for type
checkers alone) breaks as soon as someone moves that import; each module imports downward.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cl_streamkl.experiment

PACKAGE = Path(cl_streamkl.experiment.__file__).parent


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["cl_streamkl", *path.relative_to(PACKAGE.parent).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (a package for a name it defines)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # "from .x import y": the package, one level up per further dot
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported):], imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_experiment_package_has_no_import_cycle():
    modules = _module_names()
    assert "cl_streamkl.experiment.config" in modules and "cl_streamkl.experiment.data.names" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "cl_streamkl.experiment.config_checks" in graph["cl_streamkl.experiment.config"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
