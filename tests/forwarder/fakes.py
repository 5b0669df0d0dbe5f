"""Fakes for the forwarder's pure-logic tests: a fake producer and cluster stand in for
librdkafka so a test decides exactly when each send fails or is acknowledged.

``FakeProducer`` records produce() calls, which the test answers with ack() or fail();
``FakeCluster`` plays one cluster around it (``Acking``: one that acknowledges every message
as it is produced). ``Setup`` is a config, a buffer and a discard log to build a Forwarder
over such clusters (the ``setup`` fixture in tests/conftest.py); ``steps_until`` and
``run_until`` step the forwarder's loop until a condition holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from confluent_kafka import KafkaError

from agent.buffer import codec, keys
from agent.buffer.store import Store
from agent.buffer.stored import StoredMessage
from agent.config import BufferConfig, FerryConfig, ForwarderConfig, KafkaClusterConfig, TopicConfig
from agent.forwarder.clusters import Cluster
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.flight import Flight
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.health import ClusterHealth
from agent.forwarder.leaving import Leaving
from agent.forwarder.partitioner import TopicLayout
from agent.forwarder.reports import Reports
from agent.forwarder.retries import Retries
from agent.forwarder.shared import Shared
from agent.forwarder.stuck_topics import StuckTopics
from agent.forwarder.topic_state import TopicState
from agent.metrics import Registry
from agent.records import Record
from agent.signals.ack import AckSender
from tests.waiting import wait_until

Callback = Callable[[KafkaError | None, Any], None]


class FakeMessage:
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
        self._answers: list[tuple[Callback, KafkaError | None, FakeMessage]] = []
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
        self._answers.append((cb, err, FakeMessage(0, self._offset)))
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


def steps_until(forwarder: Forwarder, done: Callable[[], bool], limit: int = 20_000) -> bool:
    """Run the loop until ``done()`` or ``limit`` passes (bounded by count, not by time)."""
    for _ in range(limit):
        forwarder.step()
        if done():
            return True
    return False


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.config = FerryConfig(
            buffer=BufferConfig(path=tmp_path / "buffer"),
            forwarder=ForwarderConfig(retry_backoff_ms=1, retry_backoff_max_ms=1))
        self.store = Store(self.config.buffer.path, 64 * 1024 * 1024)
        self.discards = tmp_path / "discards.jsonl"

    def forwarder(self, clusters: dict[str, FakeCluster],
                  settings: Callable[[str], TopicConfig] | None = None) -> Forwarder:
        return Forwarder(self.config, self.store, registry=Registry(),
                         discard_log=DiscardLog(self.discards),
                         clusters=clusters,  # type: ignore[arg-type]
                         topic_settings=settings)

    def discard_ids(self) -> list[str]:
        if not self.discards.exists():
            return []
        return [json.loads(line)["id"] for line in self.discards.read_text().splitlines()]

    def discard_reasons(self) -> list[str]:
        if not self.discards.exists():
            return []
        return [json.loads(line)["reason"] for line in self.discards.read_text().splitlines()]


def run_until(fwd: Forwarder, done: Callable[[], bool], what: str) -> None:
    """Step the loop until ``done()``, for up to 10 s: some waits here are timed (a refused
    send is retried after 50 ms), so a count of steps is no bound."""
    wait_until(lambda: fwd.step() is not None and done(), timeout=10, interval=0.001,
               message=what)


class Acking(FakeCluster):
    """A cluster that acknowledges every message as it is produced."""

    def __init__(self) -> None:
        super().__init__()
        produce = self.p.produce

        def and_ack(topic: str, value: bytes, *args: Any, **kwargs: Any) -> None:
            produce(topic, value, *args, **kwargs)
            self.p.ack(value)

        self.p.produce = and_ack  # type: ignore[method-assign]


BACKOFF = 0.5  # Rooms' retry_backoff_ms / 1000: the first retry's delay


class RecordingAck(AckSender):
    """The signal to the HTTP stage, recorded: what was said acknowledged, and discarded."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.delivered: list[bytes] = []
        self.discarded: list[bytes] = []

    def send(self, delivered: Iterable[bytes], discarded: Iterable[bytes] = ()) -> int:
        self.delivered += delivered
        self.discarded += discarded
        return 0


class Rooms:
    """The forwarder's room objects for a failed send and a report (Retries, Reports), made
    with what the Forwarder hands them: fake clusters, the real Leaving and StuckTopics, and
    the loop's two send acts recorded (``sent``, ``produced``)."""

    def __init__(self, tmp_path: Path, *clusters: str, produce: bool | None = True) -> None:
        self.shared = Shared()
        self.clusters = {name: FakeCluster() for name in clusters}
        self.registry = Registry()
        self.store = Store(tmp_path / "buffer", 16 * 1024 * 1024)
        self.ack = RecordingAck(tmp_path / "ack.sock")
        self.leaving = Leaving(self.shared, self.store, self.registry,
                               DiscardLog(tmp_path / "discards.jsonl"), self.ack)
        as_clusters = cast(dict[str, Cluster], self.clusters)
        self.stuck = StuckTopics(self.shared, as_clusters)
        self.sent: list[Flight] = []
        self.produced: list[tuple[Flight, str]] = []
        self._produce_result = produce
        self.retries = Retries(self.shared, as_clusters, self.registry, self.leaving,
                               self.stuck, backoff_initial=BACKOFF, backoff_max=4 * BACKOFF,
                               send=self._send, produce=self._produce)
        self.reports = Reports(self.shared, as_clusters, self.registry, self.leaving,
                               self.stuck, self.retries, lambda topic: TopicConfig(), self.ack)

    def _send(self, f: Flight, now: float) -> None:
        self.sent.append(f)
        f.pending = 1

    def _produce(self, f: Flight, cluster: str) -> bool | None:
        self.produced.append((f, cluster))
        return self._produce_result

    def stored(self, seq: int, topic: str = "t") -> tuple[bytes, bytes]:
        """A message's id and stored value, as the buffer holds them."""
        mid = keys.make_id(int(time.time() * 1000), seq)
        record = Record(topic, b"v%d" % seq, None, None, 0, (), False)
        return mid, codec.encode(record, 0)

    def in_flight(self, settings: TopicConfig, seq: int, topic: str = "t") -> Flight:
        """A message read and sent once: counted in flight, as the loop counts it."""
        mid = keys.make_id(int(time.time() * 1000), seq)
        record = Record(topic, b"v%d" % seq, None, None, 0, (), False)
        f = Flight(StoredMessage(keys.message_key(topic, mid), mid, record, 0, 20), settings)
        st = self.shared.topics.setdefault(topic, TopicState())
        st.in_flight += 1
        self.shared.in_flight += 1
        return f

    def close(self) -> None:
        self.store.close()
