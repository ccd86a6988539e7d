"""The layering ARCHITECTURE.md describes holds: no import cycles, no module under a bare name."""

from __future__ import annotations

import subprocess
import sys

import grimp
import pytest

ROOTS = ("specgate.engine", "specgate.policies", "specgate.gateway", "specgate.bench", "specgate.migrations")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
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


def test_no_import_cycles() -> None:
    assert _cycles(grimp.build_graph(*ROOTS)) == []


@pytest.mark.slow
def test_the_old_top_level_names_are_gone() -> None:
    """Everything loads as specgate.*; nothing is importable (or loaded twice) as `engine`, `bench`..."""
    code = (
        "import sys, specgate.gateway.cli.main, specgate.gateway.http.app, specgate.bench.soak;"
        "bare = {'engine', 'gateway', 'policies', 'bench', 'migrations'};"
        "bare = sorted({m.split('.')[0] for m in sys.modules} & bare);"
        "print(bare)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
    for bare in ("engine", "gateway", "policies", "bench", "migrations"):
        probe = subprocess.run([sys.executable, "-c", f"import {bare}"], capture_output=True, cwd="/")
        assert probe.returncode != 0, bare
