"""A delete that keeps failing (a full disk under a buffer without its reserve, a disk error)
is logged when it starts failing and when it works again, with counts: not at every attempt
(issue 23 saw 23 lines a second)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from agent.buffer.store import BufferUnavailable
from agent.config import TopicConfig
from agent.forwarder import leaving
from agent.records import Record
from tests.forwarder.fakes import Acking, Setup, run_until


def test_a_failing_delete_is_two_log_lines_however_long_it_fails(
    setup: Setup, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(leaving, "DELETE_RETRY_SECONDS", 0.001)
    fwd = setup.forwarder({"local": Acking()}, lambda t: TopicConfig())
    setup.store.append([[Record("t", b"m%d" % i) for i in range(3000)]])
    remove_many = setup.store.remove_many
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise BufferUnavailable("disk_full", "disk full under /x: mdb_txn_commit: "
                                             "No space left on device")

    monkeypatch.setattr(setup.store, "remove_many", failing)
    deadline = time.monotonic() + 10
    while len(calls) < 50 and time.monotonic() < deadline:
        fwd.step()
    assert len(calls) >= 50
    monkeypatch.setattr(setup.store, "remove_many", remove_many)  # space again
    run_until(fwd, lambda: not setup.store.topic_stats(), "the buffer drained")
    lines = [r.getMessage() for r in caplog.records
             if "removing messages from the buffer" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "failed: disk full" in lines[0] and "messages wait in the buffer" in lines[0]
    assert f"works again after {len(calls)} failed attempts" in lines[1]
    assert fwd.registry.view().total("messages_delivered", topic="t") == 3000
