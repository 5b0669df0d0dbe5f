"""agent/daemon/supervision.py: back-off, its decay after a healthy run, and the give-up rule.

Pure logic: ``run`` is a scripted list of how each run ended, and sleeping only records the
wait. The daemon with a real forwarder that is SIGKILLed is tests/test_daemon.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

from agent.daemon.supervision import Exit, GaveUp, RestartPolicy, supervise

POLICY = RestartPolicy(backoff=0.5, backoff_max=4.0, healthy_after=60.0, max_crashes=5)


def script(*ends: Exit | None) -> tuple[Callable[[], Exit | None], list[int]]:
    """A ``run`` that returns ``ends`` one by one; and a list of how many calls were made."""
    it: Iterator[Exit | None] = iter(ends)
    calls: list[int] = []

    def run() -> Exit | None:
        calls.append(1)
        return next(it)

    return run, calls


def short(code: int = -9) -> Exit:
    return Exit(code, 1.0)


def healthy(code: int = -9) -> Exit:
    return Exit(code, 61.0)


def test_crashes_back_off_exponentially_up_to_the_cap() -> None:
    run, calls = script(short(), short(), short(), short(), None)
    sleeps: list[float] = []
    supervise("forwarder", run, POLICY, sleeps.append)
    assert sleeps == [0.5, 1.0, 2.0, 4.0]
    assert len(calls) == 5


def test_the_cap_holds() -> None:
    policy = RestartPolicy(backoff=1.0, backoff_max=3.0, healthy_after=60.0, max_crashes=0)
    run, _ = script(*[short()] * 6, None)
    sleeps: list[float] = []
    supervise("forwarder", run, policy, sleeps.append)
    assert sleeps == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]


def test_gives_up_after_max_crashes_in_a_row(caplog: pytest.LogCaptureFixture) -> None:
    run, calls = script(*[short(3)] * 5, None)
    sleeps: list[float] = []
    with caplog.at_level(logging.ERROR), pytest.raises(GaveUp, match="crashed 5 times") as info:
        supervise("forwarder", run, POLICY, sleeps.append)
    assert len(calls) == 5 and len(sleeps) == 4  # no wait after the last crash
    assert info.value.last == short(3)
    assert "exit code 3" in str(info.value) and "within 60 s of starting" in str(info.value)
    assert "restarting it in 0.5 s (1 in a row of at most 5)" in caplog.text


def test_a_healthy_run_resets_the_back_off_and_the_count() -> None:
    # Four quick crashes, a healthy run, four more: never five in a row, so no give-up; and
    # after the healthy run the back-off starts from the beginning (and its crash restarts
    # at once).
    run, calls = script(short(), short(), short(), short(), healthy(),
                        short(), short(), short(), short(), None)
    sleeps: list[float] = []
    supervise("forwarder", run, POLICY, sleeps.append)
    assert sleeps == [0.5, 1.0, 2.0, 4.0,  # first crashes; then the healthy one's end: no wait
                      0.5, 1.0, 2.0, 4.0]
    assert len(calls) == 10


def test_a_run_just_under_healthy_after_counts_as_a_crash() -> None:
    run, _ = script(*[Exit(1, 59.9)] * 5)
    with pytest.raises(GaveUp):
        supervise("forwarder", run, POLICY, lambda seconds: None)


def test_zero_max_crashes_never_gives_up() -> None:
    policy = RestartPolicy(backoff=0.01, backoff_max=0.01, healthy_after=60.0, max_crashes=0)
    run, calls = script(*[short()] * 200, None)
    supervise("forwarder", run, policy, lambda seconds: None)
    assert len(calls) == 201


def test_a_stop_ends_supervision_at_once() -> None:
    run, calls = script(None)
    sleeps: list[float] = []
    supervise("forwarder", run, POLICY, sleeps.append)
    assert calls == [1] and sleeps == []
