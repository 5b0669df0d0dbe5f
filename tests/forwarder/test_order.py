"""Per-key order across a failure, as pure forwarder logic: a fake producer stands in for
librdkafka so the test decides exactly when each send fails or is acknowledged. (The same
rule against a real broker and a real outage: tests/reliability/test_outage.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer.store import Store
from agent.config import BufferConfig, FerryConfig, ForwarderConfig
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.forwarder import Forwarder
from agent.metrics import Registry
from agent.records import Record
from tests.forwarder.fakes import FakeCluster, FakeProducer, steps_until


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
