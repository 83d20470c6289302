"""The training package's modules use each other in one direction: no import cycle, counting the imports made
inside functions too (a deferred import hides a cycle from Python, not from a reader). The trainer, the elastic
loop and the warm spares once imported each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import PROJECT_ROOT

PACKAGE = "training"


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports anywhere in it (``from training import x`` counts as
    ``training.x`` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets, as the path that closes it."""
    found, state = [], dict.fromkeys(graph, "new")

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state[target] == "open":
                found.append([*path[path.index(target):], target])
            elif state[target] == "new":
                walk(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if state[node] == "new":
            walk(node, [node])
    return found


def test_cycles_are_found_in_a_graph_that_has_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_training_package_has_no_import_cycle() -> None:
    paths = {module_name(path): path for path in (PROJECT_ROOT / PACKAGE).rglob("*.py")}
    known = set(paths)
    graph = {name: imported(path, known) - {name, PACKAGE} for name, path in paths.items()}
    assert cycles(graph) == []
    # The one direction of the loops: the trainer uses the elastic loop, both use the run's parts, and the spares
    # start the trainer.
    assert {"training.elastic", "training.run_parts"} <= graph["training.train"]
    assert "training.run_parts" in graph["training.elastic"] and "training.train" in graph["training.warm"]
