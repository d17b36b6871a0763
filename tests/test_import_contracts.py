"""The floors of the house hold: imports run down (flows -> stage packages -> tasks.common and kernels)
and no modules import each other in a circle.

The layers contract and its list of known exceptions live in ``pyproject.toml`` (``[tool.importlinter]``);
``.venv/bin/lint-imports`` prints the same verdict with the offending lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

importlinter_cli = pytest.importorskip("importlinter.cli", reason="import-linter is a dev extra: pip install -e '.[dev]'")
grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter: pip install -e '.[dev]'")

# Circles of modules (each a sorted tuple) that today's code still has; empty since issue 33's
# ground-floor moves. A new circle fails; a listed one that is gone fails too, so the list shrinks.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


def import_circles(graph) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (or a module importing itself) of
    ``graph`` (a grimp ``ImportGraph``), each as a sorted tuple: Tarjan's algorithm, iteratively."""
    adjacency = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: set[tuple[str, ...]] = set()
    for root in adjacency:
        if root in index:
            continue
        work = [(root, iter(adjacency[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adjacency[child])))
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
                if len(component) > 1 or node in adjacency[node]:
                    circles.add(tuple(sorted(component)))
    return circles


def test_import_circles_finds_a_circle():
    class Graph:  # the two methods of grimp's ImportGraph that import_circles reads
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, m: str) -> set[str]:
            return self.edges.get(m, set())

    assert import_circles(Graph()) == {("a", "b", "c")}


def test_imports_run_down_the_floors(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert importlinter_cli.lint_imports(no_cache=True, no_logo=True) == 0, (
        "an import runs up or sideways between floors (see the report above; the contract is "
        "[tool.importlinter] in pyproject.toml)")


def test_no_new_import_circles():
    graph = grimp.build_graph("flows", "tasks", "kernels", include_external_packages=False, cache_dir=None)
    circles = import_circles(graph)
    assert circles - KNOWN_CIRCLES == set(), f"new import circles: {sorted(circles - KNOWN_CIRCLES)}"
    assert KNOWN_CIRCLES - circles == set(), f"gone, remove from KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - circles)}"
