"""The architecture, as imports: data flows ingest → buffer → forwarder, and the code's
imports say so. Read with ``ast`` (every import, at module level or inside a function), so a
new arrow that runs the wrong way fails here rather than in a reader's head.

- only ``agent.buffer`` touches LMDB; only ``agent.forwarder`` touches Kafka;
- no stage imports another stage's package (they meet in the buffer, the records, the
  metrics registry and the signals), nor the daemon, the CLI or the status page;
- ``status`` reads the agent (its registry, runtime, buffer keys) and is imported only by the
  composition roots, ``agent.daemon`` and ``agent.cli``;
- ``spool``, ``spark_writer`` and ``ferry_client`` stand without the agent;
- the spool intake's two strategies import neither the lifecycle that runs them nor each
  other, and only the blocks strategy writes to the store without the committer;
- and in the tests, no test module imports from another: what several test files share is in
  a helper module (no ``test_`` prefix) or a conftest.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "status", "spool", "spark_writer", "ferry_client")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module)
                    names.update(f"{node.module}.{a.name}" for a in node.names)
            found[_module(path)] = names
    return found


IMPORTS = _imports()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _importers(target: str) -> set[str]:
    return {m for m, names in IMPORTS.items() if any(_within(n, target) for n in names)}


def test_the_scan_sees_the_code() -> None:
    assert "agent.buffer.store" in IMPORTS and "status.routes" in IMPORTS
    assert len(IMPORTS) > 60


def test_only_the_buffer_touches_lmdb() -> None:
    assert {m for m in _importers("lmdb") if not _within(m, "agent.buffer")} == set()


def test_only_the_forwarder_touches_kafka() -> None:
    assert {m for m in _importers("confluent_kafka")
            if not _within(m, "agent.forwarder")} == set()


STAGES = ("agent.ingest", "agent.buffer", "agent.forwarder")
ROOTS = ("agent.daemon", "agent.cli")


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_no_other_stage_nor_what_composes_it(stage: str) -> None:
    # The buffer sits between the two others: both may import it; it imports neither.
    forbidden = [s for s in STAGES if s != stage and s != "agent.buffer"]
    forbidden += [*ROOTS, "status"]
    wrong = {(m, n) for m, names in IMPORTS.items() if _within(m, stage)
             for n in names if any(_within(n, f) for f in forbidden)}
    assert wrong == set()


def test_status_is_imported_only_by_the_composition_roots() -> None:
    importers = {m for m in _importers("status") if not _within(m, "status")}
    assert {m for m in importers if not any(_within(m, r) for r in ROOTS)} == set()
    assert importers  # the daemon serves the status routes


def test_status_does_not_import_what_composes_it() -> None:
    wrong = {(m, n) for m, names in IMPORTS.items() if _within(m, "status")
             for n in names if any(_within(n, r) for r in ROOTS)}
    assert wrong == set()


@pytest.mark.parametrize("package", ["spool", "spark_writer", "ferry_client"])
def test_the_writers_and_the_client_stand_without_the_agent(package: str) -> None:
    wrong = {(m, n) for m, names in IMPORTS.items() if _within(m, package)
             for n in names if _within(n, "agent") or _within(n, "status")}
    assert wrong == set()


def test_the_client_needs_nothing_but_itself() -> None:
    ours = {n.split(".")[0] for m, names in IMPORTS.items() if _within(m, "ferry_client")
            for n in names} & set(PACKAGES)
    assert ours == {"ferry_client"}


# The spool intake: the one lifecycle every file goes through, and the two ways of storing a
# file's records it hands a file to (agent/ingest/spool_intake.py says which takes which).
SPOOL_LIFECYCLE = "agent.ingest.spool_intake"
SPOOL_STRATEGIES = ("agent.ingest.spool_records", "agent.ingest.spool_blocks")


@pytest.mark.parametrize("strategy", SPOOL_STRATEGIES)
def test_a_spool_strategy_imports_neither_the_lifecycle_nor_the_other(strategy: str) -> None:
    # What both need (the batch's pause, the progress, the screen) is in modules of its own.
    others = {SPOOL_LIFECYCLE, *SPOOL_STRATEGIES} - {strategy}
    assert {n for n in IMPORTS[strategy] if any(_within(n, o) for o in others)} == set()


def test_only_the_blocks_strategy_stores_spool_batches_without_the_committer() -> None:
    # Binary files are the one exception to "one writer" (docs/design.md); the rest of the
    # intake stores through the committer. A call of ``append_encoded`` is the exception.
    calls = {_module(path) for path in (ROOT / "agent" / "ingest").rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "append_encoded"}
    assert calls == {"agent.ingest.spool_blocks"}


def test_no_test_module_imports_from_another_test_module() -> None:
    # What several test files share lives in a helper module or a conftest.py (DEVELOPERS.md,
    # "Tests"), where a reader looks for it, not among another file's tests. Imports inside
    # functions count too.
    found = _imports(("tests",))
    test_modules = {m for m in found if m.rsplit(".", 1)[-1].startswith("test_")}
    assert "tests.forwarder.test_order" in test_modules and len(test_modules) > 100
    wrong = {(m, n) for m, names in found.items() for n in names
             if any(".".join(n.split(".")[:i]) in test_modules - {m}
                    for i in range(1, n.count(".") + 2))}
    assert wrong == set()


def _top_level_imports() -> dict[str, set[str]]:
    """What each module imports when it is loaded (not inside functions, nor for typing)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names: set[str] = set()
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.update(f"{node.module}.{a.name}" for a in node.names)
                    names.add(node.module)
            found[_module(path)] = {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def test_no_import_cycle_between_modules() -> None:
    edges = _top_level_imports()
    graph = {m: {n for n in names if n in edges and n != m} for m, names in edges.items()}
    # Importing a package runs its __init__: a module importing agent.buffer.store also
    # depends on agent/buffer/__init__.py, which is what it imports that way.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


# The forwarder's rooms that are objects of their own (agent/forwarder/loop_state.py lists
# every room): module, and the attribute the Forwarder holds it as.
ROOM_OBJECTS = {"agent.forwarder.leaving": "leaving",
                "agent.forwarder.stuck_topics": "stuck_topics",
                "agent.forwarder.cluster_watch": "cluster_watch",
                "agent.forwarder.routing": "routing",
                "agent.forwarder.retries": "retries",
                "agent.forwarder.reports": "reports"}
# The rooms still made of LoopState, and the loop itself.
ROOM_MIXINS = ("agent.forwarder.loop_state", "agent.forwarder.forwarder",
               "agent.forwarder.reading", "agent.forwarder.send")
# The room objects a room object is handed when it is made, and calls: every such
# dependency, named here (no cycle: test_no_import_cycle_between_modules).
HANDED_ROOMS = {"agent.forwarder.retries": {"agent.forwarder.leaving",
                                            "agent.forwarder.stuck_topics"},
                "agent.forwarder.reports": {"agent.forwarder.leaving",
                                            "agent.forwarder.stuck_topics",
                                            "agent.forwarder.retries"}}


def test_the_rooms_are_where_the_rules_below_look() -> None:
    assert set(ROOM_OBJECTS) | set(ROOM_MIXINS) <= set(IMPORTS)


@pytest.mark.parametrize("room", sorted(ROOM_OBJECTS))
def test_a_room_object_imports_no_other_room_but_those_it_is_handed(room: str) -> None:
    """What a room object shares with the loop is handed to it (``Shared``, shared.py): it
    imports neither the loop's state nor a room made of it, and of the room objects only
    those it is handed (``HANDED_ROOMS``)."""
    rooms = (set(ROOM_OBJECTS) | set(ROOM_MIXINS)) - {room}
    imported = {r for r in rooms if any(_within(n, r) for n in IMPORTS[room])}
    assert imported == HANDED_ROOMS.get(room, set())


def private_reaches(tree: ast.AST) -> list[int]:
    """Lines that reach a room object's private field: ``<anything>.leaving._batch``."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ROOM_OBJECTS.values()]


def test_no_room_reaches_into_a_room_object_s_fields() -> None:
    assert sorted(private_reaches(ast.parse("self.leaving._batch.runs\nfwd.cluster_watch._parked\n"
                                            "self.leaving.flush()\nself._leaving\n"))) == [1, 2]
    found = [(str(path.relative_to(ROOT)), line)
             for package in PACKAGES for path in (ROOT / package).rglob("*.py")
             for line in private_reaches(ast.parse(path.read_text()))]
    assert found == []
