"""The package's import graph: no cycles, and the stages import in one direction only.

Every `import watchdog...` and `from watchdog... import ...` in watchdog/, at module level or
inside a function (a lazy import is still a dependency), read with ast: nothing is imported to
build the graph. The directions are docs/architecture.md's: the pure decision core imports no
I/O stage, observing does not act, evidence does not run the daemon.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "watchdog"

# (a package, the packages it must never import)
FORBIDDEN: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "watchdog.decide",
        (
            "watchdog.observe",
            "watchdog.act",
            "watchdog.evidence",
            "watchdog.run",
            "watchdog.commands",
        ),
    ),
    (
        "watchdog.observe",
        ("watchdog.act", "watchdog.evidence", "watchdog.run", "watchdog.commands"),
    ),
    ("watchdog.evidence", ("watchdog.run", "watchdog.commands")),
    ("watchdog.act", ("watchdog.run", "watchdog.commands")),
)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module a dotted name lives in (`watchdog.act.plan.build_plan` → its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name) if name.startswith("watchdog") else None
            if owner is not None:
                yield owner


GRAPH: dict[str, frozenset[str]] = {
    module: frozenset(_imported(path)) - {module} for module, path in MODULES.items()
}


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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


def test_the_graph_is_read() -> None:
    """The reader sees what the package imports (a reader that finds nothing proves nothing)."""
    assert "watchdog.act.contracts" in GRAPH["watchdog.act.hosts"]
    assert "watchdog.decide.fold" in GRAPH["watchdog.decide"]


def test_no_import_cycles_in_the_package() -> None:
    """The package has no import cycles, so every module can be imported on its own."""
    assert _cycles(GRAPH) == []


def test_a_cycle_is_found() -> None:
    """The cycle finder itself, on a graph with one cycle of three and a self-free tail."""
    graph = {
        "a": frozenset({"b"}),
        "b": frozenset({"c"}),
        "c": frozenset({"a", "d"}),
        "d": frozenset(),
    }
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize(("package", "forbidden"), FORBIDDEN, ids=[p for p, _ in FORBIDDEN])
def test_stages_import_in_one_direction(package: str, forbidden: tuple[str, ...]) -> None:
    """Stage `package` imports none of `forbidden` (docs/architecture.md)."""
    wrong = sorted(
        f"{module} -> {dep}"
        for module, deps in GRAPH.items()
        if module == package or module.startswith(package + ".")
        for dep in deps
        if any(dep == f or dep.startswith(f + ".") for f in forbidden)
    )
    assert wrong == []
