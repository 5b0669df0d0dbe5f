"""Per-topic rate limits for HTTP publishing: one token bucket per topic, in memory.

A topic's ``rate_limit`` is messages per second; the bucket holds at most one second's worth
(at least one message), so short bursts pass and a sustained excess is refused with 429. A
batch takes one token per message. A batch bigger than the bucket is let through when the
bucket is full and leaves it in debt, so it delays later requests instead of never passing.
Only the event loop thread calls it, so it needs no lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class _Bucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_topics: int = 10000
                 ) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._max_topics = max_topics

    def acquire(self, topic: str, rate: float, n: int = 1) -> float:
        """Take ``n`` tokens; 0.0 when allowed, else the seconds until it would be."""
        if rate <= 0:
            return 0.0
        now = self._clock()
        capacity = max(rate, 1.0)
        bucket = self._buckets.get(topic)
        if bucket is None:
            if len(self._buckets) >= self._max_topics:
                self._buckets.clear()  # bounded memory; forgetting only forgives debt
            bucket = self._buckets[topic] = _Bucket(capacity, now)
        else:
            bucket.tokens = min(capacity, bucket.tokens + (now - bucket.stamp) * rate)
            bucket.stamp = now
        need = min(float(n), capacity)
        if bucket.tokens + 1e-9 >= need:  # a client back exactly when told is not refused
            bucket.tokens -= n
            return 0.0
        return (need - bucket.tokens) / rate


def retry_after_header(seconds: float) -> bytes:
    """Retry-After takes whole seconds; never 0, or clients would retry at once."""
    return str(max(1, math.ceil(seconds))).encode()
