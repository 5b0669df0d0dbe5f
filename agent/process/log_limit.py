"""Rate-limited log lines: a warning that can repeat (a cluster flapping, datagrams refused,
a topic stuck) is written at most once per ``every`` seconds per key; the next line that gets
through says how many were left out meanwhile. In a long outage that is a few lines an hour,
not millions, and nothing is hidden: the count is there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_EVERY = 60.0
MAX_KEYS = 1000  # keys are topics or reasons: bounded so a flood of names cannot grow memory


class LogLimit:
    def __init__(self, logger: logging.Logger, every: float = DEFAULT_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``every`` seconds ago;
        True when it was written."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            if len(self._last) >= MAX_KEYS and key not in self._last:
                self._last.clear()
                self._suppressed.clear()
            self._last[key] = now
            left_out = self._suppressed.pop(key, 0)
        if left_out:
            self.logger.log(level, msg + " (%d similar lines left out in the last %.0f s)",
                            *args, left_out, now - (last if last is not None else now))
        else:
            self.logger.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def suppressed(self, key: str) -> int:
        with self._lock:
            return self._suppressed.get(key, 0)
