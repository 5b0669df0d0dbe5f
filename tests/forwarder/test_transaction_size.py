"""The exactly-once loop's transaction sizing (agent/forwarder/transaction_size.py), alone: a
budget from the rate the last transaction achieved, never the same batch again after one was
given up, back to no budget once the cluster is fast. The same rule under a real producer
quota is in test_kafka_quota.py."""

from __future__ import annotations

from agent.forwarder.transaction_size import TARGET_SHARE, TransactionSize, fitting

LIMIT = 30.0
TARGET = LIMIT * TARGET_SHARE
MB = 1_000_000
NOW = 1000.0  # a time.monotonic()


def test_no_budget_until_a_transaction_is_slow() -> None:
    size = TransactionSize(LIMIT)
    assert size.budget is None and size.room(10 * MB) is None
    size.committed(20 * MB, 0.5, NOW)  # fast: nothing to learn
    assert size.budget is None


def test_a_transaction_given_up_sizes_the_next_from_what_was_acknowledged() -> None:
    """Issue #36's case: 3 MB sent, 2.8 MB of it acknowledged in the 30 s (a quota): the
    next transaction holds what that rate carries in the target share of the limit."""
    size = TransactionSize(LIMIT)
    size.timed_out(3 * MB, 2_800_000, LIMIT, NOW)
    assert size.budget == int(2_800_000 * TARGET / LIMIT)
    assert size.budget is not None and size.budget < 3 * MB // 2


def test_never_the_same_batch_again_even_when_nothing_was_acknowledged() -> None:
    size = TransactionSize(LIMIT)
    size.timed_out(3 * MB, 0, LIMIT, NOW)
    assert size.budget == 1, "no rate measured: the smallest transaction, one message"
    size = TransactionSize(LIMIT)
    # Given up early (librdkafka's message timeout before the flush's): at most half.
    size.timed_out(3 * MB, 3 * MB, 1.0, NOW)
    assert size.budget == 3 * MB // 2


def test_a_slow_commit_shrinks_to_the_target_and_one_far_from_its_budget_is_no_measure(
) -> None:
    size = TransactionSize(LIMIT)
    size.committed(1 * MB, 2 * TARGET, NOW)  # committed, but in twice the target
    assert size.budget == MB // 2
    # Slow with 100 bytes in it: a slow coordinator, not bytes; the budget stays.
    size.committed(100, 2 * TARGET, NOW + 20)
    assert size.budget == MB // 2
    size.committed(MB // 2, 4 * TARGET, NOW + 40)  # its whole budget, four times the target
    assert size.budget == MB // 8


def test_a_fast_commit_doubles_at_most_and_only_as_far_as_the_recent_rate_carries() -> None:
    """Kafka answers a throttled client at once and delays its *next* requests, and lets a
    quiet client burst first: a transaction that went fast may have cost the next ones.
    Growth is bounded by the bytes the cluster took over the last HORIZON seconds."""
    size = TransactionSize(LIMIT)
    size.timed_out(4 * MB, 4 * MB, LIMIT, NOW)  # 4 MB in 30 s: 1 MB in the target
    assert size.budget == MB
    size.committed(MB, 1.0, NOW + 1)  # fast, but the horizon's rate carries ~1 MB
    assert size.budget is not None and MB <= size.budget < 2 * MB
    size.committed(MB // 4, 0.1, NOW + 2)  # fast with a quarter of its budget: no growth
    assert size.budget is not None and size.budget < 2 * MB


def test_fast_commits_grow_back_to_no_budget() -> None:
    size = TransactionSize(LIMIT)
    size.committed(1 * MB, 2 * TARGET, NOW)
    now = NOW
    for _ in range(60):  # bounded: doubling from 0.5 MB passes the ceiling in ~15 commits
        if size.budget is None:
            break
        now += 0.2
        size.committed(size.budget, 0.1, now)
    assert size.budget is None, "a cluster fast again gets full transactions back"


def test_the_budget_is_taken_as_it_is_used() -> None:
    size = TransactionSize(LIMIT)
    size.timed_out(4000, 4000, LIMIT, NOW)  # a budget of 1,000 bytes
    assert size.room(0) == 1000 and size.room(600) == 400 and size.room(1500) == 0


def test_what_fits_is_at_least_one_message() -> None:
    assert fitting([400, 400, 400], 1000) == 2
    assert fitting([400, 400, 400], 1200) == 3
    assert fitting([5000, 10], 1000) == 1, "a message larger than the budget still goes"
    assert fitting([10, 10], None) == 2
