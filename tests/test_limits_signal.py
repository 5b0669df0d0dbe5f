"""The topic limits the forwarder publishes for the intake (agent/signals/limits.py): a
round trip through the file, written only when changed, replaced whole, read at most once
per interval, and nothing refused on the strength of a file that is gone or unreadable."""

from __future__ import annotations

from pathlib import Path

from agent.signals.limits import (
    EMPTY,
    Limit,
    LimitsPublisher,
    LimitsView,
    Snapshot,
    decode,
    encode,
    file_path,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_snapshot_round_trips() -> None:
    snap = Snapshot("lz4", {"a": Limit(10_000, None, 60_000), "b": Limit(1_048_588)})
    assert decode(encode(snap)) == snap


def test_what_is_not_a_snapshot_reads_as_none() -> None:
    for raw in (b"", b"{", b"[]", b'{"version": 2, "compression": "lz4", "topics": {}}',
                b'{"version": 1, "compression": "lz4", "topics": {"a": [0, null, null]}}',
                b'{"version": 1, "compression": "lz4", "topics": {"a": ["x", null, null]}}'):
        assert decode(raw) is None, raw


def test_the_intake_sees_what_the_forwarder_published_within_an_interval(
    tmp_path: Path,
) -> None:
    path = file_path(tmp_path)
    clock = Clock()
    view = LimitsView(path, clock=clock)
    assert view.get("a") is None and view.current() is EMPTY  # nothing learnt yet
    publisher = LimitsPublisher(path, "lz4")
    assert publisher.publish({"a": Limit(10_000)})
    assert view.get("a") is None  # looked a moment ago: not again within the interval
    clock.now += 1.0
    assert view.get("a") == Limit(10_000)
    assert view.current().compression == "lz4"
    # Unchanged: not written again (the file keeps its identity).
    before = path.stat().st_mtime_ns, path.stat().st_ino
    assert not publisher.publish({"a": Limit(10_000)})
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    # Changed: replaced whole, seen at the next look; no temporary file left behind.
    assert publisher.publish({"a": Limit(20_000), "b": Limit(500, 1, 2)})
    clock.now += 1.0
    assert view.get("a") == Limit(20_000) and view.get("b") == Limit(500, 1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_cleared_or_broken_file_refuses_nothing(tmp_path: Path) -> None:
    path = file_path(tmp_path)
    clock = Clock()
    publisher = LimitsPublisher(path, "none")
    publisher.publish({"a": Limit(10_000)})
    view = LimitsView(path, clock=clock)
    assert view.get("a") == Limit(10_000)
    publisher.clear()  # the forwarder starting again: limits are learnt anew
    clock.now += 1.0
    assert view.get("a") is None
    path.write_bytes(b"not json")
    clock.now += 1.0
    assert view.get("a") is None
    # Cleared, the same limits are written again (not taken for unchanged).
    assert publisher.publish({"a": Limit(10_000)})
    clock.now += 1.0
    assert view.get("a") == Limit(10_000)
