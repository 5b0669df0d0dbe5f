"""A small server-side ring of recent status points, so charts have a past on first load.

The page keeps its own rolling window while it is open; this ring is what it starts from, and
what lets ``health`` say "3 messages discarded in the last 10 min". One point every 5 s for
10 minutes is 120 small dicts.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 5.0
DEFAULT_KEEP = 120


class History:
    """Thread-safe ring of points (dicts with a ``time`` key), oldest first."""

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        self._lock = threading.Lock()
        self._points: deque[dict[str, Any]] = deque(maxlen=keep)

    def add(self, point: dict[str, Any]) -> None:
        with self._lock:
            self._points.append(point)

    def points(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._points)


class Sampler:
    """A daemon thread that adds ``take()`` to a History every ``interval`` seconds."""

    def __init__(
        self,
        history: History,
        take: Callable[[], dict[str, Any]],
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        self.history = history
        self.take = take
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-history", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def sample(self) -> None:
        try:
            self.history.add(self.take())
        except Exception:  # noqa: BLE001 - the status page must never take the agent down
            log.exception("taking a status history point failed")

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval):
            self.sample()
