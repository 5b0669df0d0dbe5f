"""Tests of the test harness itself: tests/waiting.py and tests/kafka.py against real tansu."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from tests.kafka import (
    Broker,
    TcpProxy,
    consume_all,
    create_topic,
    read_topic,
    topic_partitions,
)
from tests.waiting import wait_until

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@dataclass
class Deliveries:
    """Delivery reports of one producer, in arrival order."""

    reports: list[tuple[KafkaError | None, bytes | None, int | None]] = field(default_factory=list)

    def __call__(self, error: KafkaError | None, message: Message) -> None:
        self.reports.append((error, message.value(), message.offset()))

    def succeeded(self) -> list[bytes | None]:
        return [value for error, value, _ in self.reports if error is None]

    def failed(self) -> list[KafkaError]:
        return [error for error, _, _ in self.reports if error is not None]


def make_producer(bootstrap: str, **overrides: Any) -> Producer:
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "linger.ms": 5,
        # Reconnect quickly once the broker/proxy is back (librdkafka backs off to 10 s).
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 200,
    }
    config.update(overrides)
    return Producer(config)


def produce_one(producer: Producer, topic: str, value: bytes, deliveries: Deliveries) -> None:
    producer.produce(topic, value=value, on_delivery=deliveries)


# --------------------------------------------------------------------------------------------
# waiting.wait_until
# --------------------------------------------------------------------------------------------


def test_wait_until_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", 7, 8])
    assert wait_until(lambda: next(values), timeout=5, interval=0.001) == 7


def test_wait_until_timeout_names_the_condition_and_last_value() -> None:
    with pytest.raises(AssertionError, match=r"the moon.*last value: \[\]"):
        wait_until(lambda: [], timeout=0.05, interval=0.01, message="the moon")


def test_wait_until_ignores_listed_errors_and_reports_the_last() -> None:
    def refuse() -> bool:
        raise ConnectionRefusedError("nobody home")

    with pytest.raises(AssertionError, match="nobody home") as raised:
        wait_until(refuse, timeout=0.05, interval=0.01, ignore=(ConnectionError,))
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, timeout=5, ignore=(ConnectionError,))


# --------------------------------------------------------------------------------------------
# produce / consume round trip
# --------------------------------------------------------------------------------------------


def test_round_trip_keeps_partition_key_value_timestamp_and_headers(
    session_broker: Broker, unique_topic: str
) -> None:
    create_topic(session_broker.bootstrap, unique_topic, partitions=3)
    producer = make_producer(session_broker.bootstrap, **{"enable.idempotence": True})
    deliveries = Deliveries()
    sent = {
        (p, f"k{i}".encode(), f"v{i}".encode(), 1_700_000_000_000 + i)
        for i, p in enumerate([0, 1, 2, 2, 1, 0, 2])
    }
    for partition, key, value, timestamp in sent:
        producer.produce(
            unique_topic,
            key=key,
            value=value,
            partition=partition,
            timestamp=timestamp,
            headers=[("origin", key), ("empty", None)],
            on_delivery=deliveries,
        )
    assert producer.flush(10) == 0
    assert deliveries.failed() == []

    got = consume_all(session_broker.bootstrap, unique_topic, expected_count=len(sent))

    assert {(m.partition, m.key, m.value, m.timestamp_ms) for m in got} == sent
    assert all(m.timestamp_type == TIMESTAMP_CREATE_TIME for m in got)
    assert all(m.headers == (("origin", m.key), ("empty", None)) for m in got)
    assert got[0].header("origin") == got[0].key


def test_read_topic_returns_every_record_of_multi_record_batches(
    session_broker: Broker, unique_topic: str
) -> None:
    # Large linger: records leave in few, multi-record batches, the case where tansu's
    # ListOffsets is wrong and read_topic must rely on Fetch's high watermark.
    create_topic(session_broker.bootstrap, unique_topic, partitions=2)
    producer = make_producer(session_broker.bootstrap, **{"linger.ms": 200})
    for i in range(50):
        producer.produce(unique_topic, value=b"%d" % i, partition=i % 2)
    assert producer.flush(10) == 0

    records = read_topic(session_broker.bootstrap, unique_topic)

    assert sorted(int(r.value or b"") for r in records) == list(range(50))
    assert [(r.partition, r.offset) for r in records] == [(p, o) for p in (0, 1) for o in range(25)]


def test_consumers_are_bounded_when_the_topic_never_appears(
    session_broker: Broker, unique_topic: str
) -> None:
    started = time.monotonic()
    assert consume_all(session_broker.bootstrap, unique_topic, 1, timeout=1.0) == []
    assert read_topic(session_broker.bootstrap, unique_topic, timeout=1.0) == []
    assert time.monotonic() - started < 8
    # Looking must not create it: tansu auto-creates on AdminClient metadata requests.
    assert topic_partitions(session_broker.bootstrap, unique_topic) is None


def test_produce_auto_creates_a_topic_with_four_partitions(
    session_broker: Broker, unique_topic: str
) -> None:
    producer = make_producer(session_broker.bootstrap)
    producer.produce(unique_topic, value=b"x")
    assert producer.flush(10) == 0
    assert topic_partitions(session_broker.bootstrap, unique_topic) == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------------
# broker stop / start
# --------------------------------------------------------------------------------------------


def test_stopped_broker_fails_delivery_and_a_restart_on_the_same_port_recovers(
    broker: Broker, unique_topic: str
) -> None:
    bootstrap, pid = broker.bootstrap, broker.pid
    producer = make_producer(bootstrap, **{"message.timeout.ms": 1500})
    deliveries = Deliveries()
    produce_one(producer, unique_topic, b"before", deliveries)
    assert producer.flush(10) == 0

    broker.stop()
    assert not broker.running
    produce_one(producer, unique_topic, b"while down", deliveries)
    assert producer.flush(5) == 0  # returns once the message times out
    assert [e.code() for e in deliveries.failed()] == [KafkaError._MSG_TIMED_OUT]

    broker.start()
    assert (broker.bootstrap, broker.running) == (bootstrap, True)
    assert broker.pid != pid
    produce_one(producer, unique_topic, b"after", deliveries)
    assert producer.flush(10) == 0
    assert deliveries.succeeded() == [b"before", b"after"]
    # Memory storage: the restarted broker only holds what was produced after the restart.
    assert [r.value for r in read_topic(bootstrap, unique_topic)] == [b"after"]


def test_restart_strands_an_idempotent_producer_from_before_it(
    broker: Broker, unique_topic: str
) -> None:
    """Documents a tansu limit: producer ids are lost with memory storage (see kafka.py)."""
    config = {"enable.idempotence": True, "message.timeout.ms": 1500}
    old = make_producer(broker.bootstrap, **config)
    deliveries = Deliveries()
    produce_one(old, unique_topic, b"before", deliveries)
    assert old.flush(10) == 0

    broker.restart()
    produce_one(old, unique_topic, b"stranded", deliveries)
    assert old.flush(5) == 0
    assert deliveries.succeeded() == [b"before"]
    assert [e.code() for e in deliveries.failed()] == [KafkaError._MSG_TIMED_OUT]

    new = make_producer(broker.bootstrap, **config)
    produce_one(new, unique_topic, b"fresh", deliveries)
    assert new.flush(10) == 0
    assert deliveries.succeeded() == [b"before", b"fresh"]


# --------------------------------------------------------------------------------------------
# TCP proxy
# --------------------------------------------------------------------------------------------


def test_proxy_carries_all_client_traffic(proxied_broker: tuple[Broker, TcpProxy]) -> None:
    broker, proxy = proxied_broker
    assert broker.bootstrap == f"127.0.0.1:{proxy.port}"
    metadata = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=5)
    assert [f"{b.host}:{b.port}" for b in metadata.brokers.values()] == [broker.bootstrap]
    assert proxy.connections_accepted >= 1
    assert proxy.bytes_forwarded > 0


@pytest.mark.parametrize("stall", ["blackhole", "hold"])
def test_a_stalled_proxy_holds_delivery_back_until_restore(
    proxied_broker: tuple[Broker, TcpProxy], unique_topic: str, stall: str
) -> None:
    """blackhole drops bytes (the stream breaks, librdkafka resends after reconnecting);
    hold keeps them (the request sent during the hold is simply answered late)."""
    broker, proxy = proxied_broker
    create_topic(broker.bootstrap, unique_topic, partitions=1)
    producer = make_producer(
        broker.bootstrap, **{"enable.idempotence": True, "message.timeout.ms": 30000}
    )
    deliveries = Deliveries()
    produce_one(producer, unique_topic, b"before", deliveries)
    assert producer.flush(10) == 0

    getattr(proxy, stall)()
    produce_one(producer, unique_topic, b"during", deliveries)
    assert producer.flush(1.5) == 1, f"delivered through a proxy in {stall}"
    assert deliveries.succeeded() == [b"before"]
    assert deliveries.failed() == []
    if stall == "blackhole":
        assert proxy.bytes_dropped > 0
    else:
        assert proxy.bytes_dropped == 0
        assert proxy.active_connections >= 1  # kept open, unlike cut

    proxy.restore()
    assert producer.flush(15) == 0
    assert deliveries.succeeded() == [b"before", b"during"]
    assert deliveries.failed() == []
    if stall == "hold":
        assert proxy.bytes_dropped == 0
    records = consume_all(broker.bootstrap, unique_topic, expected_count=2)
    assert [r.value for r in records] == [b"before", b"during"]


def test_cut_resets_connections_until_restore(
    proxied_broker: tuple[Broker, TcpProxy], unique_topic: str
) -> None:
    broker, proxy = proxied_broker
    errors: list[KafkaError] = []
    producer = make_producer(
        broker.bootstrap, **{"message.timeout.ms": 30000, "error_cb": errors.append}
    )
    deliveries = Deliveries()
    produce_one(producer, unique_topic, b"before", deliveries)
    assert producer.flush(10) == 0
    assert proxy.active_connections >= 1

    proxy.cut()
    assert proxy.active_connections == 0
    produce_one(producer, unique_topic, b"during", deliveries)

    def all_brokers_down() -> bool:
        producer.poll(0.05)  # serves error_cb
        return any(e.code() == KafkaError._ALL_BROKERS_DOWN for e in errors)

    wait_until(all_brokers_down, timeout=5, message="the producer to see all brokers down")
    assert deliveries.succeeded() == [b"before"]

    proxy.restore()
    assert producer.flush(15) == 0
    assert deliveries.succeeded() == [b"before", b"during"]


# --------------------------------------------------------------------------------------------
# artifacts
# --------------------------------------------------------------------------------------------


def test_artifacts_dir_is_an_empty_per_test_directory_under_test_artifacts(
    artifacts_dir: Path,
) -> None:
    repo_root = Path(__file__).resolve().parent.parent
    assert artifacts_dir.is_dir()
    assert artifacts_dir.parent == repo_root / "test-artifacts"
    assert "test_artifacts_dir_is_an_empty" in artifacts_dir.name
    assert list(artifacts_dir.iterdir()) == []


def test_request_frames_count_each_request_by_api_key_however_the_stream_is_cut() -> None:
    """The counting proxy's parser: two Metadata requests (api_key 3) and a Produce (0) of
    two clients, one with no client id, handed over one byte at a time, then in one piece;
    each also logged one by one, in order."""
    import collections
    import struct

    from tests.kafka import _RequestFrames

    def request(api_key: int, client: bytes | None, body: bytes) -> bytes:
        name = struct.pack(">h", -1) if client is None else struct.pack(">h", len(client)) + client
        header = struct.pack(">hhi", api_key, 9, 7) + name + body
        return struct.pack(">i", len(header)) + header

    stream = (request(3, b"ferry-local-probe", b"m" * 40) + request(0, b"ferry-local-all",
              b"p" * 1000) + request(3, None, b"") + request(3, b"ferry-local-probe", b""))
    for pieces in ([stream[i:i + 1] for i in range(len(stream))], [stream]):
        counts: dict[tuple[int, str], int] = {}
        log: collections.deque[tuple[float, int, str]] = collections.deque()
        frames = _RequestFrames()
        for piece in pieces:
            frames.feed(piece, counts, log)
        assert counts == {(3, "ferry-local-probe"): 2, (0, "ferry-local-all"): 1, (3, ""): 1}
        assert [(api, client) for _, api, client in log] == [
            (3, "ferry-local-probe"), (0, "ferry-local-all"), (3, ""), (3, "ferry-local-probe")]
        assert frames.skip == 0 and not frames.head
