"""A topic's limits and the batch size that follows (agent/forwarder/topic_limits.py), and
the exactly-once topics held back one by one (agent/forwarder/held_topics.py). Describing a
real topic's configuration is tried on Apache Kafka in test_kafka_refusals.py."""

from __future__ import annotations

import time

import pytest

from agent.forwarder.held_topics import FIRST_HOLD, LONGEST_HOLD, HeldTopics
from agent.forwarder.topic_limits import ALONE, MARGIN, TopicLimits, batch_bytes


@pytest.mark.parametrize(("limit", "batch"), [
    (1_048_588, 0),        # Kafka's default: librdkafka's default batch size fits
    (1_000_000, 524_288),  # just under the default batch size
    (10_000, 8_192),
    (1_024 + MARGIN, 1_024),
    (1_000, ALONE),        # too small to batch in
])
def test_the_batch_fits_under_the_topic_s_limit(limit: int, batch: int) -> None:
    got = batch_bytes(TopicLimits(max_message_bytes=limit))
    assert got == batch
    if batch not in (0, ALONE):
        assert got + MARGIN <= limit


def test_unknown_limits_keep_librdkafka_s_batches() -> None:
    assert batch_bytes(None) == 0


def test_a_held_topic_waits_doubling_and_is_released_by_a_commit() -> None:
    held = HeldTopics()
    now = time.monotonic()
    first = held.hold("t", "TOPIC_AUTHORIZATION_FAILED", "denied", True, "local")
    assert first == FIRST_HOLD and held.waiting("t", now)
    assert not held.waiting("other", now)
    waits = [held.hold("t", "TOPIC_AUTHORIZATION_FAILED", "denied", True, "local")
             for _ in range(8)]
    assert waits[0] == 2 * FIRST_HOLD and waits[-1] == LONGEST_HOLD
    assert held.view["t"]["error"] == "TOPIC_AUTHORIZATION_FAILED"
    assert held.view["t"]["failures"] == 9 and held.view["t"]["operator"] is True
    held.delivered(["t"])
    assert held.view == {} and not held.waiting("t", time.monotonic())


def test_a_topic_waiting_for_a_broker_is_named_without_a_back_off_until_it_commits() -> None:
    held = HeldTopics()
    for _ in range(3):  # each transaction that meets it again: one row, not counted again
        held.waits("t", "BROKER_OUT_OF_REACH", "partition 1 waits", "local")
    assert not held.waiting("t", time.monotonic())  # read again at the next transaction
    assert held.view["t"]["error"] == "BROKER_OUT_OF_REACH"
    assert held.view["t"]["operator"] is False and held.view["t"]["failures"] == 1
    held.waits("t", "BROKER_OUT_OF_REACH", "partition 3 waits", "local")
    assert held.view["t"]["detail"] == "partition 3 waits"
    held.delivered(["t"])
    assert held.view == {}
