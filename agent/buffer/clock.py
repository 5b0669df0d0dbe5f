"""The wall clock the buffer reads: message ids carry their acceptance time, and tracking
entries the time their message left. One place, so that tests can set it."""

from __future__ import annotations

import time


def now_ms() -> int:
    return int(time.time() * 1000)
