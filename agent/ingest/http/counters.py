"""Counters of the publish path, added up locally and handed to the registry in bulk.

At tens of thousands of requests a second, a registry call per request (a lock, label checks)
costs more than the rest of the bookkeeping; the event loop adds to a plain dict instead and
a timer flushes it to the registry ``interval`` seconds after the first count since the last
flush (and ``flush()`` whenever asked). Only the event loop thread adds.
"""

from __future__ import annotations

import asyncio

from agent.metrics import Registry

Labels = tuple[tuple[str, str], ...]


class LocalCounters:
    def __init__(self, registry: Registry, interval: float = 0.2) -> None:
        self.registry = registry
        self.interval = interval
        self._counts: dict[tuple[str, Labels], float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, name: str, labels: Labels, amount: float = 1) -> None:
        self.add_key((name, labels), amount)

    def add_key(self, key: tuple[str, Labels], amount: float = 1) -> None:
        """``add()`` with the (name, labels) pair built once by the caller."""
        counts = self._counts
        counts[key] = counts.get(key, 0) + amount
        if self._timer is None:
            # Traffic may stop right here: make sure what was counted gets out anyway.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.interval, self._timed_flush)

    def detach(self) -> None:
        """Counting moves to another event loop: forget the old loop's timer."""
        self.flush()
        self._timer = None

    def _timed_flush(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        counts, self._counts = self._counts, {}
        for (name, labels), amount in counts.items():
            self.registry.inc(name, amount, **dict(labels))
