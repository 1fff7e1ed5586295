"""The package's import structure: no cycles, every module imports, models stay plain.

The graph is read from the source (module-level and function-level imports alike), so a
cycle hidden inside a function body is found too. An edge from a module to one of its
own ancestor packages is ignored: a parent package is always initialised first.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import disagmoe

PACKAGE_DIR = Path(disagmoe.__file__).parent
MODEL_FORBIDDEN = (
    "disagmoe.bench",
    "disagmoe.runtime",
    "disagmoe.simulator",
    "disagmoe.distributed",
    "torch.distributed",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES: dict[str, Path] = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return SOURCES[module].name == "__init__.py"


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imported_names(module: str) -> set[str]:
    """Every absolute name `module` imports anywhere in its body.

    `from A import x` gives `A.x`, which is a submodule or an attribute of `A`
    (`_first_party` tells which); relative imports are resolved against `module`'s package.
    """
    tree = ast.parse(SOURCES[module].read_text(), filename=str(SOURCES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.update(base if a.name == "*" else f"{base}.{a.name}" for a in node.names)
    return names


def _first_party(name: str) -> str | None:
    """The first-party module that importing `name` runs: itself, or for an attribute
    `A.x`, its nearest ancestor module; None for third-party names."""
    while name and name not in SOURCES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in SOURCES:
        targets = {_first_party(name) for name in imported_names(module)}
        graph[module] = {
            t for t in targets if t is not None and t != module and not _is_within(module, t)
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path `[a, b, ..., a]`, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        path = [root]
        state[root] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                state[node] = 2
                continue
            nxt = todo.pop()
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_find_cycle_reports_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def all_modules() -> list[str]:
    """Every module of the package: pkgutil's walk, plus the modules of namespace
    packages (folders without `__init__.py`), which pkgutil does not descend into."""
    walked = {info.name for info in pkgutil.walk_packages(disagmoe.__path__, prefix="disagmoe.")}
    return sorted(walked | (set(SOURCES) - {"disagmoe"}))


@pytest.mark.parametrize("module", all_modules())
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_models_import_no_distributed_code() -> None:
    bad = {
        f"{module} imports {name}"
        for module in SOURCES
        if _is_within(module, "disagmoe.models")
        for name in imported_names(module)
        if any(_is_within(name, forbidden) for forbidden in MODEL_FORBIDDEN)
    }
    assert not bad, "models must stay plain nn.Modules: " + "; ".join(sorted(bad))
