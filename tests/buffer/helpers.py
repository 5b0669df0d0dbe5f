"""What the buffer's unit tests share: readers of a Store's contents, a fake clock for its ids
and ages (the ``clock`` fixture in conftest.py installs one), and a recorder of the
callbacks the Committer's writer thread makes, and a gate that holds that thread."""

from __future__ import annotations

import threading

from agent.buffer.committer import Result
from agent.buffer.store import Store, StoredMessage

WAIT = 30.0  # seconds a held writer thread waits to be released, at most


def read_all(store: Store, topic: str) -> list[StoredMessage]:
    out: list[StoredMessage] = []
    for m in store.read(topic, None, 1_000_000):
        assert isinstance(m, StoredMessage), m
        out.append(m)
    return out


def values(store: Store, topic: str) -> list[bytes]:
    return [m.record.value for m in read_all(store, topic)]


def stats(store: Store) -> dict[str, tuple[int, int]]:
    return {s.topic: (s.messages, s.bytes) for s in store.topic_stats()}


class FakeClock:
    """Stands in for the store's ``time`` module so ids and tracking ages are deterministic."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


class Calls:
    """Every call of a ``submit_groups()`` callback, from the writer thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[list[Result]] = []

    def __call__(self, results: list[Result]) -> None:
        with self.lock:
            self.calls.append(list(results))

    def count(self) -> int:
        with self.lock:
            return len(self.calls)


class Gate:
    """A commit callback that holds the writer thread until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, result: Result) -> None:
        self.entered.set()
        assert self.release.wait(WAIT), "gate never released"
