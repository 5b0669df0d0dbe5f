"""Isolation (agent/forwarder/isolation.py) in the at-least-once loop: Kafka refuses a batch,
and only the message refused alone is discarded; its neighbours are sent again alone and
delivered, in order. A fault-injecting producer (fakes.py's) plays the cluster; the same
promises on Apache Kafka's real refusals are in test_kafka_refusals.py."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError

from agent.forwarder import isolation, timestamps
from agent.forwarder.topic_limits import ALONE
from agent.records import Record
from tests.forwarder.fakes import FakeCluster, Setup, run_until

HOUR_MS = 3_600_000


def test_a_refused_batch_sends_each_message_alone_and_discards_only_the_culprit(
    setup: Setup,
) -> None:
    local = FakeCluster()
    fwd = setup.forwarder({"local": local})
    values = [b"m%02d" % i for i in range(10)]
    setup.store.append([[Record("t", v, key=b"k") for v in values]])
    run_until(fwd, lambda: len(local.p.pending) == 10, "the batch sent")
    assert local.batches[-1] == 0, "the first send is batched as usual"
    # The broker refuses the batch for m04; librdkafka names it and fails the others as its
    # neighbours (KIP-467).
    for v in values:
        local.p._answer(v, KafkaError(KafkaError.INVALID_RECORD if v == b"m04"
                                      else KafkaError._INVALID_DIFFERENT_RECORD))
    run_until(fwd, lambda: len(local.p.pending) == 10, "all ten sent again")
    assert local.batches[-10:] == [ALONE] * 10, "each alone, through the one-message producer"
    resent = [v for v, _ in local.p.pending]
    assert resent == values, "sent again in their order"
    for v in resent:
        if v == b"m04":
            local.p._answer(v, KafkaError(KafkaError.INVALID_RECORD))
        else:
            local.p.ack(v)
    run_until(fwd, lambda: not setup.store.topic_stats(), "all to leave the buffer")
    assert setup.discard_reasons() == ["invalid"]
    view = fwd.registry.view()
    assert view.total("messages_delivered", topic="t") == 9
    assert view.total("messages_isolated", topic="t") == 10
    assert view.total("messages_refused", topic="t", error="INVALID_RECORD") == 1
    assert "INVALID_RECORD" in setup.discards.read_text()


def test_a_batch_too_large_loses_nothing(setup: Setup) -> None:
    """MSG_SIZE_TOO_LARGE on a batch says nothing of any one message: each alone fits."""
    local = FakeCluster()
    fwd = setup.forwarder({"local": local})
    values = [b"v%03d" % i for i in range(50)]
    setup.store.append([[Record("t", v) for v in values]])
    run_until(fwd, lambda: len(local.p.pending) == 50, "sent")
    for v in values:
        local.p._answer(v, KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    run_until(fwd, lambda: len(local.p.pending) == 50, "sent again, alone")
    for v in values:
        local.p.ack(v)
    run_until(fwd, lambda: not setup.store.topic_stats(), "delivered")
    assert setup.discard_reasons() == []
    assert fwd.registry.view().total("messages_delivered", topic="t") == 50


def test_a_message_that_waited_past_the_topic_s_limit_is_restamped_not_lost(
    setup: Setup,
) -> None:
    local = FakeCluster()
    fwd = setup.forwarder({"local": local})
    setup.store.append([[Record("t", b"old")]])
    run_until(fwd, lambda: len(local.p.pending) == 1, "sent")
    local.p._answer(b"old", KafkaError(KafkaError.INVALID_TIMESTAMP))  # in a batch
    run_until(fwd, lambda: len(local.p.pending) == 1, "sent alone")
    # Alone, and still too old by the broker's clock, though fresh when Ferry took it: the
    # wait in the buffer made it so (an outage longer than before.max.ms), seen 2 h later.
    original = local.p.stamps[-1][1]
    later = time.time() + 7200
    real_time = time.time
    time.time = lambda: later  # type: ignore[assignment]
    try:
        local.p._answer(b"old", KafkaError(KafkaError.INVALID_TIMESTAMP))
        run_until(fwd, lambda: len(local.p.pending) == 1, "sent again, restamped")
    finally:
        time.time = real_time  # type: ignore[assignment]
    value, ts, headers = local.p.stamps[-1]
    assert ts == 0, "librdkafka stamps it with the send time"
    assert (timestamps.ORIGINAL, str(original).encode()) in headers
    local.p.ack(b"old")
    run_until(fwd, lambda: not setup.store.topic_stats(), "delivered")
    assert setup.discard_reasons() == []
    assert fwd.registry.view().total("messages_restamped", topic="t") == 1


@pytest.mark.parametrize(("ts", "accepted", "now", "expected"), [
    # waited in the buffer past before.max.ms: sent with the send time
    (0, 0, 2 * HOUR_MS, "restamp"),
    # already 2 h old when a client handed it over, then refused at once: its own fault
    (0, 2 * HOUR_MS, 2 * HOUR_MS + 1000, "refuse"),
    # 2 h ahead of the broker, and of Ferry's clock when accepted: a client's bad clock
    (2 * HOUR_MS, 0, 1000, "refuse"),
    # ahead of the broker but stamped by this host's clock: the host clock is ahead
    (2 * HOUR_MS, 2 * HOUR_MS, 2 * HOUR_MS - 500, "clock_ahead"),
])
def test_the_timestamp_rule(ts: int, accepted: int, now: int, expected: str) -> None:
    assert timestamps.verdict(ts, accepted, now) == expected


def test_a_host_clock_ahead_keeps_the_message() -> None:
    # Ferry stamped it (accepted == ts); the broker, 2 h behind, finds it in the future.
    now = 10 * HOUR_MS
    assert timestamps.verdict(now, now, now - 1) == "clock_ahead"
    assert isolation.verdict(KafkaError.INVALID_TIMESTAMP, True, False, now + 1, now + 1,
                             now) == "clock_skew"
    # Restamped and still refused: the clocks are apart, kept as well.
    assert isolation.verdict(KafkaError.INVALID_TIMESTAMP, True, True, 0, 0, now) == \
        "clock_skew"


def test_only_a_message_alone_is_judged() -> None:
    for code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD,
                 KafkaError._INVALID_DIFFERENT_RECORD):
        assert isolation.verdict(code, False, False, 0, 0, 0) == "isolate"
    assert isolation.verdict(KafkaError._INVALID_DIFFERENT_RECORD, True, False, 0, 0, 0) == \
        "isolate", "an innocent neighbour is never discarded"
    assert isolation.verdict(KafkaError.MSG_SIZE_TOO_LARGE, True, False, 0, 0, 0) == "discard"
