"""The forwarder's failure paths, as pure logic: a fake producer stands in for librdkafka so a
test decides when a send is refused, fails or is acknowledged (the fakes of fakes.py).

Each test is a sequence that once lost order, sent what must not be sent, discarded what a
cluster delivered, counted a failure twice, or let memory or the discard log grow."""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from agent.config import TopicConfig
from agent.forwarder import leaving, reading
from agent.forwarder.partitioner import TopicLayout
from agent.records import Record
from tests.forwarder.fakes import FakeCluster, Setup, run_until, steps_until


def refuse_once(cluster: FakeCluster, value: bytes, exc: Exception) -> None:
    """The cluster's producer raises ``exc`` the first time it is handed ``value``."""
    produce = cluster.p.produce
    refused: list[bytes] = []

    def maybe_refuse(topic: str, *args: Any, **kw: Any) -> None:
        given = args[0] if args else kw["value"]
        if given == value and not refused:
            refused.append(given)
            raise exc
        produce(topic, *args, **kw)

    cluster.p.produce = maybe_refuse  # type: ignore[method-assign]


class Refusing(FakeCluster):
    """A cluster whose producer refuses every message at once with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__()

        def produce(*args: Any, **kwargs: Any) -> None:
            raise KafkaException(KafkaError(code))

        self.p.produce = produce  # type: ignore[method-assign]


def values(cluster: FakeCluster) -> list[bytes]:
    return [v for v, _ in cluster.p.sent]


# -- order -----------------------------------------------------------------------------------
@pytest.mark.parametrize("refusal", [
    BufferError("Local: Queue full"),
    KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION)),
], ids=["queue-full", "refused-for-now"])
def test_a_send_refused_for_now_holds_back_the_rest_of_its_batch(
    setup: Setup, refusal: Exception
) -> None:
    local = FakeCluster()
    refuse_once(local, b"older", refusal)
    fwd = setup.forwarder({"local": local})
    # One batch: the older message is refused, the newer one (same key) would still fit.
    setup.store.append([[Record("t", b"older", partition_key=7),
                         Record("t", b"newer", partition_key=7)]])
    run_until(fwd, lambda: len(local.p.sent) == 1, "the refused message's retry")
    assert values(local) == [b"older"]  # its retry, not the newer message
    local.p.ack(b"older")
    assert steps_until(fwd, lambda: len(local.p.sent) == 2)
    assert values(local) == [b"older", b"newer"]
    local.p.ack(b"newer")
    assert steps_until(fwd, lambda: not setup.store.topic_stats())


def test_retries_that_cannot_be_sent_keep_their_order(setup: Setup) -> None:
    local = FakeCluster()
    fwd = setup.forwarder({"local": local})
    setup.store.append([[Record("t", b"a", partition_key=1), Record("t", b"b", partition_key=1)]])
    assert steps_until(fwd, lambda: len(local.p.sent) == 2)
    local.p.fail(b"a")
    local.p.fail(b"b")
    refuse_once(local, b"a", BufferError("Local: Queue full"))  # a's re-send finds it full
    run_until(fwd, lambda: len(local.p.sent) >= 4, "the re-sends of a and b")
    # b waited for a, although the queue had room for it when a was refused.
    assert values(local)[2:] == [b"a", b"b"]


# -- what must not be sent, or not be discarded ----------------------------------------------
def test_a_retried_message_of_a_deleted_topic_is_discarded_not_sent(setup: Setup) -> None:
    local = FakeCluster()
    fwd = setup.forwarder({"local": local})
    setup.store.append([[Record("t", b"old")]])
    assert steps_until(fwd, lambda: len(local.p.sent) == 1)
    setup.store.bump_generation("t")  # the topic is deleted while "old" is in flight
    assert steps_until(fwd, lambda: fwd._generations.get("t") == 1)
    local.p.fail(b"old")  # ... and its send fails: it goes to the retry queue
    assert steps_until(fwd, lambda: not setup.store.topic_stats())
    assert values(local) == [b"old"]  # never sent again
    assert setup.discard_reasons() == ["generation"]
    view = fwd.registry.view()
    assert view.total("messages_discarded", topic="t", reason="generation") == 1
    assert fwd.stats()["in_flight"] == 0


def test_a_permanent_refusal_by_one_cluster_waits_for_the_other(setup: Setup) -> None:
    local, remote = FakeCluster(), FakeCluster()
    fwd = setup.forwarder({"local": local, "remote": remote},
                          lambda t: TopicConfig(fallback_to_remote=True,
                                                speculative_send_delay_ms=0))
    setup.store.append([[Record("t", b"m")]])
    assert steps_until(fwd, lambda: len(local.p.sent) == 1 and len(remote.p.sent) == 1)
    # The remote datacenter refuses the message for good (its brokers take smaller
    # messages: an error the failure policy discards on) ...
    remote.p._answer(b"m", KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    steps_until(fwd, lambda: False, limit=200)
    assert setup.store.topic_stats(), "discarded although the local send was still in flight"
    # ... and the local one delivers it.
    local.p.ack(b"m")
    assert steps_until(fwd, lambda: not setup.store.topic_stats())
    view = fwd.registry.view()
    assert view.total("messages_delivered", topic="t") == 1
    assert view.total("messages_discarded", topic="t") == 0
    assert setup.discard_reasons() == []


def test_a_fallback_the_remote_refuses_at_once_is_one_failure(setup: Setup) -> None:
    local, remote = FakeCluster(), Refusing(KafkaError._UNKNOWN_PARTITION)
    fwd = setup.forwarder({"local": local, "remote": remote},
                          lambda t: TopicConfig(fallback_to_remote=True, max_attempts=1,
                                                speculative_send_delay_ms=100_000))
    setup.store.append([[Record("t", b"m")]])
    assert steps_until(fwd, lambda: len(local.p.sent) == 1)
    local.p.fail(b"m")  # the local send fails; the fallback to remote is refused at once
    assert steps_until(fwd, lambda: not setup.store.topic_stats())
    assert setup.discard_reasons() == ["attempts"]
    assert fwd.registry.view().total("messages_discarded", topic="t") == 1
    stats = fwd.stats()
    # "t" holds nothing now: its entry may already be dropped (topic_state.py).
    assert (stats["in_flight"], stats["retries"], stats["topics"].get("t", 0)) == (0, 0, 0)


def test_a_producer_refusing_everything_as_fatal_is_replaced(setup: Setup) -> None:
    replaced: list[str] = []

    class Fatal(FakeCluster):
        def replace_producer(self, acks: str) -> None:
            replaced.append(acks)

    local = Fatal()
    refuse_once(local, b"m", KafkaException(KafkaError(KafkaError._FATAL, fatal=True)))
    fwd = setup.forwarder({"local": local})
    setup.store.append([[Record("t", b"m")]])
    run_until(fwd, lambda: len(local.p.sent) == 1, "the re-send after the refusal")
    assert replaced == ["leader"]


# -- bounded work ----------------------------------------------------------------------------
class Unreachable(FakeCluster):
    """Partitions never known: the forwarder can only expire what it holds."""

    def layout(self, topic: str) -> TopicLayout:
        return None  # type: ignore[return-value]


def test_an_expired_backlog_is_discarded_a_bounded_number_per_step(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 3 * reading.EXPIRE_PER_STEP + 100
    with monkeypatch.context() as m:
        an_hour_ago = time.time() - 3600
        m.setattr(time, "time", lambda: an_hour_ago)  # accepted an hour ago
        setup.store.append([[Record("t", b"x" * 50) for _ in range(n)]])
    fwd = setup.forwarder({"local": Unreachable()}, lambda t: TopicConfig(ttl_seconds=60))
    flushed: list[int] = []
    flush = fwd.leaving.flush

    def counting() -> int:
        flushed.append(fwd.leaving.waiting())
        return flush()

    monkeypatch.setattr(fwd.leaving, "flush", counting)
    # Timed, not counted: the last few expired messages leave with the next timed delete
    # batch (DELETE_BATCH_SECONDS), which a fast host reaches only after many idle steps.
    run_until(fwd, lambda: not setup.store.topic_stats(), "the expired backlog to leave")
    assert sum(flushed) == n
    assert max(flushed) <= reading.EXPIRE_PER_STEP
    assert setup.discard_reasons() == ["ttl"] * n


def test_a_failed_delete_writes_each_discard_line_once_and_backs_off(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    fwd = setup.forwarder({"local": FakeCluster()}, lambda t: TopicConfig(max_message_bytes=10))
    setup.store.append([[Record("t", b"x" * 100) for _ in range(2500)]])  # all too large
    remove_many = setup.store.remove_many
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(setup.store, "remove_many", failing)
    for _ in range(50):
        fwd.step()
    # At most one try per back-off period over the time the steps took, however slow the
    # host made them (retrying at once would be one try a step: 50).
    took = time.monotonic() - calls[0]
    assert len(calls) <= 1 + took / leaving.DELETE_RETRY_SECONDS, (
        f"{len(calls)} tries in {took:.2f} s: retried at once instead of after the back-off")
    logged = setup.discard_ids()
    assert logged and len(set(logged)) == len(logged)
    monkeypatch.setattr(setup.store, "remove_many", remove_many)  # the disk recovers
    run_until(fwd, lambda: not setup.store.topic_stats(), "the discards to leave the buffer")
    logged = setup.discard_ids()
    assert len(logged) == len(set(logged)) == 2500  # each line once
    assert setup.discard_reasons() == ["too_large"] * 2500
    assert fwd.registry.view().total("messages_discarded", topic="t") == 2500
