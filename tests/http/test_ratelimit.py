"""Token buckets per topic (pure logic, controlled clock)."""

from __future__ import annotations

from agent.ingest.http.ratelimit import RateLimiter, retry_after_header


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_second_of_burst_then_the_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    assert [limiter.acquire("t", 3) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.acquire("t", 3)
    assert abs(wait - 1 / 3) < 1e-9
    clock.now += wait
    assert limiter.acquire("t", 3) == 0.0
    assert limiter.acquire("t", 3) > 0


def test_topics_have_their_own_buckets_and_zero_is_unlimited() -> None:
    limiter = RateLimiter(Clock())
    assert limiter.acquire("a", 1) == 0.0
    assert limiter.acquire("a", 1) > 0
    assert limiter.acquire("b", 1) == 0.0
    assert all(limiter.acquire("c", 0) == 0.0 for _ in range(1000))


def test_a_batch_bigger_than_the_bucket_passes_when_full_and_leaves_debt() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    assert limiter.acquire("t", 10, n=50) == 0.0
    wait = limiter.acquire("t", 10, n=1)
    assert abs(wait - 4.1) < 1e-9  # 40 tokens of debt + 1 at 10/s
    clock.now += 4.1
    assert limiter.acquire("t", 10, n=1) == 0.0


def test_retry_after_is_whole_seconds_and_never_zero() -> None:
    assert retry_after_header(0.01) == b"1"
    assert retry_after_header(1.2) == b"2"
