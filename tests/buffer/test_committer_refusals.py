"""Refusals for lack of space: counted per message, logged once per change of state (issue 23:
a full disk logged a line per attempt, 23 a second)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer import committer as committer_module
from agent.buffer.committer import Committer
from agent.buffer.store import BufferFull, DiskFull, Outcome, Store, StoredMessage
from agent.metrics import Registry
from agent.records import Record

MB = 1024 * 1024


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "b", MB) as s:
        yield s


def fill_and_refuse(committer: Committer, n: int) -> int:
    """Commit 10 KiB groups until the buffer is full, then ``n`` more refusals; returns how
    many groups were stored."""
    stored = 0
    while isinstance(committer.commit([Record("t", b"x" * 10_000)], "http", timeout=10), list):
        stored += 1
    for _ in range(n):
        assert isinstance(committer.commit([Record("t", b"x" * 10_000)], "http", timeout=10),
                          BufferFull)
    return stored


def drain(store: Store) -> None:
    store.remove([Outcome(m.key, m.stored_bytes, "t", "delivered", "local", 0, 0)
                  for m in store.read("t", None, 100_000) if isinstance(m, StoredMessage)])


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agent.buffer.committer"]


def test_a_refusal_episode_is_two_log_lines_with_counts(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING)
    registry = Registry()
    committer = Committer(store, registry=registry)
    committer.start()
    try:
        fill_and_refuse(committer, 50)
        [start] = refusal_lines(caplog)
        assert "refuses new messages (buffer_full)" in start
        assert registry.view().total("messages_rejected", reason="buffer_full") == 51
        drain(store)
        # Stored again, but too soon after the last refusal to call the episode over: near
        # the limit, commits alternate between stored and refused.
        assert isinstance(committer.commit([Record("t", b"y")], "http", timeout=10), list)
        assert len(refusal_lines(caplog)) == 1
        monkeypatch.setattr(committer_module, "REFUSING_QUIET_SECONDS", 0.0)
        assert isinstance(committer.commit([Record("t", b"z")], "http", timeout=10), list)
        start, end = refusal_lines(caplog)
        assert "accepts new messages again: 51 buffer_full refused" in end
        assert "(2 stored meanwhile)" in end
        # Nothing more to say while all is well.
        assert isinstance(committer.commit([Record("t", b"w")], "http", timeout=10), list)
        assert len(refusal_lines(caplog)) == 2
    finally:
        committer.close()


def test_a_disk_full_refusal_is_counted_and_logged_as_such(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING)
    registry = Registry()

    def no_room(txn: object, need: int, room: int | None) -> tuple[int, BufferFull | None]:
        return 0, DiskFull("disk full under somewhere: 1 bytes do not fit in the 0 left")

    monkeypatch.setattr(store.capacity, "fit_on_disk", no_room)
    committer = Committer(store, registry=registry)
    committer.start()
    try:
        for _ in range(20):
            result = committer.commit([Record("t", b"x")], "socket", timeout=10)
            assert isinstance(result, DiskFull) and result.reason == "disk_full"
        assert registry.view().total("messages_rejected", source="socket",
                                     reason="disk_full") == 20
        [line] = refusal_lines(caplog)
        assert "refuses new messages (disk_full)" in line
        # Readiness: "full", but not by the buffer's size: re-checked after a while.
        assert committer.full and not committer._full_by_size
    finally:
        committer.close()
