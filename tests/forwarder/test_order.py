"""Per-key order across a failure, as pure forwarder logic: a fake producer stands in for
librdkafka so the test decides exactly when each send fails or is acknowledged. (The same
rule against a real broker and a real outage: tests/reliability/test_outage.py.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError

from agent.buffer.store import Store
from agent.config import BufferConfig, FerryConfig, ForwarderConfig, KafkaClusterConfig
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.health import ClusterHealth
from agent.forwarder.partitioner import TopicLayout
from agent.metrics import Registry
from agent.records import Record

Callback = Callable[[KafkaError | None, Any], None]


class _Message:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class FakeProducer:
    """Records produce() calls; the test answers them with ack() or fail()."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Callback]] = []  # in produce order, never removed
        # (value, timestamp, headers) of each produce(), in order, never removed
        self.stamps: list[tuple[bytes, int, Any]] = []
        self.pending: list[tuple[bytes, Callback]] = []
        self._answers: list[tuple[Callback, KafkaError | None, _Message]] = []
        self._offset = 0

    def produce(self, topic: str, value: bytes, key: bytes | None = None, partition: int = -1,
                callback: Callback | None = None, on_delivery: Callback | None = None,
                timestamp: int = 0, headers: Any = None) -> None:
        # confluent-kafka's argument order: the forwarder passes some of them positionally.
        cb = callback or on_delivery
        assert cb is not None
        self.sent.append((value, cb))
        self.stamps.append((value, timestamp, headers))
        self.pending.append((value, cb))

    def _answer(self, value: bytes, err: KafkaError | None) -> None:
        i = next(i for i, (v, _) in enumerate(self.pending) if v == value)
        _, cb = self.pending.pop(i)
        self._answers.append((cb, err, _Message(0, self._offset)))
        self._offset += 1

    def ack(self, value: bytes) -> None:
        self._answer(value, None)

    def fail(self, value: bytes) -> None:
        self._answer(value, KafkaError(KafkaError._MSG_TIMED_OUT))

    def poll(self, timeout: float = 0) -> int:
        answers, self._answers = self._answers, []
        for cb, err, msg in answers:
            cb(err, msg)
        return len(answers)

    def purge(self, **_: Any) -> None:
        pass  # nothing here is queued-but-unsent: every send is "on the wire"

    def __len__(self) -> int:
        return len(self.pending)


class FakeCluster:
    def __init__(self, outage_after_seconds: float = 3600) -> None:
        self.config = KafkaClusterConfig(outage_after_seconds=outage_after_seconds)
        self.health = ClusterHealth("fake", outage_after_seconds)
        self.health.probe_answered(1)  # no probe thread here: the test plays the cluster
        self.brokers = 1
        self.p = FakeProducer()
        self.batches: list[int] = []  # the batch size of each producer() call, in order

    @property
    def up(self) -> bool:
        return self.health.up

    @property
    def down(self) -> bool:
        return self.health.down

    def start_probing(self) -> None:
        pass

    def layout(self, topic: str) -> TopicLayout:
        return TopicLayout((0,), (0,))

    def known_missing(self, topic: str) -> bool:
        return False

    def has_missing(self) -> bool:
        return False

    # Every broker reachable (agent/forwarder/brokers.py has its own tests).
    def stranded(self) -> int:
        return 0

    def unreachable_text(self) -> str:
        return ""

    def partial(self) -> bool:
        return False

    def unreachable_brokers(self) -> list[dict[str, object]]:
        return []

    def watch_brokers(self, conf: dict[str, object], source: str) -> None:
        pass

    def producer(self, acks: str, batch: int = 0) -> FakeProducer:
        self.batches.append(batch)
        return self.p

    def batch(self, topic: str) -> int:
        return 0  # the topic's limits are not learnt here: librdkafka's default batches

    def limits(self, topic: str) -> None:
        return None

    def poll(self) -> int:
        return self.p.poll(0)

    def outstanding(self) -> int:
        return len(self.p)

    def producers(self) -> list[FakeProducer]:
        return [self.p]

    def forget(self, topic: str) -> None:
        pass

    def purge_queued(self, acks: str) -> None:
        self.p.purge()

    def replace_producer(self, acks: str) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Forwarder, Store, FakeProducer]]:
    config = FerryConfig(buffer=BufferConfig(path=tmp_path / "buffer"),
                         forwarder=ForwarderConfig(retry_backoff_ms=1, retry_backoff_max_ms=1))
    store = Store(config.buffer.path, 64 * 1024 * 1024)
    cluster = FakeCluster()
    forwarder = Forwarder(config, store, registry=Registry(),
                          discard_log=DiscardLog(tmp_path / "discards.jsonl"),
                          clusters={"local": cluster})  # type: ignore[dict-item]
    try:
        yield forwarder, store, cluster.p
    finally:
        store.close()


def steps_until(forwarder: Forwarder, done: Callable[[], bool], limit: int = 20_000) -> bool:
    """Run the loop until ``done()`` or ``limit`` passes (bounded by count, not by time)."""
    for _ in range(limit):
        forwarder.step()
        if done():
            return True
    return False


def test_a_newer_message_waits_until_the_resent_older_one_is_acknowledged(
    setup: tuple[Forwarder, Store, FakeProducer],
) -> None:
    forwarder, store, producer = setup
    store.append([[Record("t", b"old", partition_key=1)]])
    assert steps_until(forwarder, lambda: len(producer.sent) == 1)
    producer.fail(b"old")  # timed out: it goes to the retry queue
    assert steps_until(forwarder, lambda: len(producer.sent) == 2)  # re-sent
    assert [v for v, _ in producer.sent] == [b"old", b"old"]

    # A newer message of the same key arrives while the re-sent one is still unanswered.
    # If it were sent now and the re-sent one timed out again (librdkafka reports timeouts
    # up to a second late, after the network may be back), it would reach Kafka first.
    store.append([[Record("t", b"new", partition_key=1)]])
    assert not steps_until(forwarder, lambda: len(producer.sent) > 2, limit=3000)

    producer.fail(b"old")  # the network came back just as it timed out again
    assert steps_until(forwarder, lambda: len(producer.sent) == 3)
    assert [v for v, _ in producer.sent] == [b"old", b"old", b"old"]  # still not "new"
    producer.ack(b"old")
    assert steps_until(forwarder, lambda: len(producer.sent) == 4)
    assert producer.sent[-1][0] == b"new"
    producer.ack(b"new")
    assert steps_until(forwarder, lambda: not store.topic_stats())
    view = forwarder.registry.view()
    assert view.total("messages_delivered", topic="t") == 2


def test_without_failures_new_messages_flow_while_others_are_in_flight(
    setup: tuple[Forwarder, Store, FakeProducer],
) -> None:
    forwarder, store, producer = setup
    store.append([[Record("t", b"a")]])
    assert steps_until(forwarder, lambda: len(producer.sent) == 1)
    store.append([[Record("t", b"b")]])
    assert steps_until(forwarder, lambda: len(producer.sent) == 2)  # no wait for "a"'s ack
    producer.ack(b"a")
    producer.ack(b"b")
    assert steps_until(forwarder, lambda: not store.topic_stats())
