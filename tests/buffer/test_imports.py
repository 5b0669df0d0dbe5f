"""agent/buffer's modules import one another one way: no module reaches back, not even from
inside a function (compact.py and store.py used to import each other)."""

from __future__ import annotations

import ast
from pathlib import Path

BUFFER = Path(__file__).resolve().parents[2] / "agent" / "buffer"
PACKAGE = "agent.buffer"


def buffer_imports() -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports, anywhere in it."""
    graph: dict[str, set[str]] = {}
    for path in sorted(BUFFER.glob("*.py")):
        name = path.stem
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PACKAGE:  # from agent.buffer import codec, keys
                    found.update(a.name for a in node.names)
                elif node.module.startswith(PACKAGE + "."):
                    found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names
                             if a.name.startswith(PACKAGE + "."))
        graph[name] = found - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports if there is one (depth-first search), else None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if (found := visit(nxt)) is not None:
                return found
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if (found := visit(start)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_of_the_buffer_imports_one_that_imports_it_back() -> None:
    graph = buffer_imports()
    assert {"store", "compact"} <= graph.keys()
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_compaction_and_the_store_share_the_layout_without_each_other() -> None:
    graph = buffer_imports()
    assert "store" not in graph["compact"]
    assert "compact" not in graph["store"]
    assert "layout" in graph["compact"]
