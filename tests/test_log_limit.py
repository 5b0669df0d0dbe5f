"""Rate-limited warnings (agent/process/log_limit.py): a line a minute per key, and the next line
says how many were left out, so a long outage is a few lines, with nothing hidden."""

from __future__ import annotations

import logging

import pytest

from agent.process.log_limit import LogLimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeats_are_counted_and_reported_with_the_next_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    limit = LogLimit(logging.getLogger("test.limit"), every=60, clock=clock)
    caplog.set_level(logging.WARNING, "test.limit")
    for i in range(10_000):  # a refusal per datagram group for 100 s
        clock.now = i * 0.01
        limit.warning("disk_error", "datagrams refused: %s", f"group {i}")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "datagrams refused: group 0"
    assert lines[1].startswith("datagrams refused: group 6000 (5999 similar lines left out")
    assert limit.suppressed("disk_error") == 3999


def test_keys_are_limited_separately(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limit = LogLimit(logging.getLogger("test.limit"), every=60, clock=clock)
    caplog.set_level(logging.WARNING, "test.limit")
    assert limit.warning("down:local", "cluster %s is down", "local")
    assert limit.warning("down:remote", "cluster %s is down", "remote")
    assert not limit.warning("down:local", "cluster %s is down", "local")
    assert [r.getMessage() for r in caplog.records] == ["cluster local is down",
                                                        "cluster remote is down"]
