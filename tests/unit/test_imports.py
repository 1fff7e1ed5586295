"""The package's import structure: no cycles, every module imports, models stay plain, and
packages depend one way, as `src/disagmoe/layers.toml` says.

The graph is read from the source with `ast` (module-level and function-level imports
alike; nothing is imported to read it), so a cycle hidden inside a function body is
found too. An edge from a module to one of its own ancestor packages is ignored: a parent
package is always initialised first.

Packages: a folder of src/disagmoe or a module at its top. docs/architecture.md shows the
layer table between its `<!-- layers -->` markers, rendered by `render_layers`;
`python tests/unit/test_imports.py --write` rewrites that block after a change to the table.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

import disagmoe

PACKAGE_DIR = Path(disagmoe.__file__).parent
LAYERS_TOML = PACKAGE_DIR / "layers.toml"
ARCHITECTURE_DOC = PACKAGE_DIR.parents[1] / "docs" / "architecture.md"
BEGIN, END = "<!-- layers -->", "<!-- /layers -->"
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


# ------------------------------------------------------------------ package layers


@dataclass(frozen=True)
class Layer:
    name: str
    packages: tuple[str, ...]
    ordered: bool  # a package may import those listed before it in its own layer
    about: str


def read_layers(path: Path = LAYERS_TOML) -> list[Layer]:
    raw = tomllib.loads(path.read_text())
    return [
        Layer(l["name"], tuple(l["packages"]), bool(l.get("ordered", False)), l.get("about", ""))
        for l in raw["layer"]
    ]


def package_of(module: str) -> str:
    """`runtime` for disagmoe.runtime.disagg, `config` for disagmoe.config."""
    return module.split(".")[1]


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package -> the importing modules, for every cross-package import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph().items():
        if module == "disagmoe":
            continue
        for target in targets:
            if target != "disagmoe" and package_of(target) != package_of(module):
                edges.setdefault((package_of(module), package_of(target)), []).append(module)
    return edges


def packages_on_disk() -> set[str]:
    return {package_of(module) for module in SOURCES if module != "disagmoe"}


def layer_allows(layers: list[Layer], src: str, dst: str) -> bool:
    """May package `src` import package `dst`?"""
    position = {p: (i, j) for i, l in enumerate(layers) for j, p in enumerate(l.packages)}
    (ls, ps), (ld, pd) = position[src], position[dst]
    if ld != ls:
        return ld < ls
    return layers[ls].ordered and pd < ps


def layer_violations(layers: list[Layer], edges: dict[tuple[str, str], list[str]]) -> list[str]:
    known = {p for l in layers for p in l.packages}
    out = []
    for (src, dst), where in sorted(edges.items()):
        if src not in known or dst not in known:
            out.append(f"{src} -> {dst}: {src if src not in known else dst} is not in layers.toml")
        elif not layer_allows(layers, src, dst):
            out.append(f"{src} -> {dst} goes up or sideways ({', '.join(sorted(where)[:3])})")
    return out


def render_layers(layers: list[Layer]) -> str:
    """The table as docs/architecture.md shows it, top layer first."""
    lines = [
        "| layer | packages: each imports only lower layers (and, across `→`, those before it) |"
        " what it holds |",
        "|---|---|---|",
    ]
    for layer in reversed(layers):
        names = (" → " if layer.ordered else " · ").join(f"`{p}`" for p in layer.packages)
        lines.append(f"| {layer.name} | {names} | {layer.about} |")
    return "\n".join(lines)


def doc_layers_block(text: str) -> str:
    assert BEGIN in text and END in text, f"docs/architecture.md lacks the {BEGIN} block"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_every_package_is_in_the_layer_table_once() -> None:
    listed = [p for l in read_layers() for p in l.packages]
    assert len(listed) == len(set(listed)), "a package is listed twice in layers.toml"
    assert set(listed) == packages_on_disk(), (
        f"not in layers.toml: {sorted(packages_on_disk() - set(listed))}; "
        f"in layers.toml but not in src/disagmoe: {sorted(set(listed) - packages_on_disk())}"
    )


def test_packages_import_only_down_the_layer_table() -> None:
    problems = layer_violations(read_layers(), package_edges())
    assert not problems, "\n".join(problems)


def test_executors_import_none_of_each_other_nor_what_sits_above_them() -> None:
    executors = {"runtime", "baselines", "simulator"}
    layers = read_layers()
    above = {p for l in layers[[l.name for l in layers].index("planner") :] for p in l.packages}
    bad = [f"{s} -> {d}" for (s, d) in package_edges() if s in executors and d in executors | above]
    assert not bad, bad


def test_an_upward_or_sideways_edge_is_reported() -> None:
    layers = read_layers()
    assert layer_violations(layers, {("models", "training"): ["m"]}) == [
        "models -> training goes up or sideways (m)"
    ]
    assert layer_violations(layers, {("runtime", "simulator"): ["m"]})  # peers, unordered
    assert layer_violations(layers, {("config", "device"): ["m"]})  # ordered: later one
    assert not layer_violations(layers, {("device", "config"): ["m"]})
    assert not layer_violations(layers, {("training", "models"): ["m"]})
    assert layer_violations(layers, {("newpkg", "models"): ["m"]})


def test_package_edges_see_relative_and_function_level_imports() -> None:
    edges = package_edges()
    assert "disagmoe.runtime.disagg" in edges[("runtime", "training")]  # `from ..training`
    assert "disagmoe.train" in edges[("train", "simulator")]  # inside run_rank


def test_docs_show_the_layer_table() -> None:
    assert doc_layers_block(ARCHITECTURE_DOC.read_text()) == render_layers(read_layers()), (
        "docs/architecture.md's layer table differs from src/disagmoe/layers.toml: run "
        "`python tests/unit/test_imports.py --write`"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_imports.py --write")
    text = ARCHITECTURE_DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    ARCHITECTURE_DOC.write_text(f"{head}{BEGIN}\n{render_layers(read_layers())}\n{END}{tail}")
    print("wrote the layer table into docs/architecture.md")
