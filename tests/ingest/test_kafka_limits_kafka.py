"""Issue #36's acceptance case at intake, on Apache Kafka: a topic limited to 10,000 bytes
(max.message.bytes) and 60 s ahead (message.timestamp.after.max.ms). Once the forwarder
learnt those limits, what the topic can never take is refused before it is acknowledged
(HTTP 413 naming the limit; a datagram counted), what it takes is accepted and delivered,
counted at a real consumer. And the rule's exact batch size against the broker itself."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer

from agent.record_batch import batch_of_one
from ferry_client import FerryClient, FerryHttp, PublishRejected
from tests.agent_harness import AgentProcess, write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.apache_delivery import tally, values
from tests.reliability.harness import metric_total
from tests.waiting import wait_until

LIMITS = {"max.message.bytes": "10000", "message.timestamp.after.max.ms": "60000"}
HOURS_2 = 7_200_000


def _counter(agent: AgentProcess, name: str, **labels: str) -> float:
    return metric_total(agent.get_json("/status/counters"), name, **labels)


def _compressible(size: int) -> bytes:
    return (b"the same few words again and again " * (size // 30 + 1))[:size]


def test_what_a_limited_topic_can_never_take_is_refused_at_intake(
    tmp_path: Path, apache_kafka: KafkaCluster
) -> None:
    topic = f"limited-{uuid.uuid4().hex[:8]}"
    apache_kafka.create_topic(topic, 2, config=LIMITS)
    config = write_config(tmp_path / "agent", apache_kafka.bootstrap,
                          topics={topic: {"acks": "all"}})
    acknowledged: list[bytes] = []
    with AgentProcess(config) as agent, FerryHttp(agent.http_url, timeout=30.0,
                                                  attempts=1) as http:
        # Before the forwarder learnt the topic's limits (its first message), all is taken.
        first = b"first-" + os.urandom(100)
        http.publish(topic, first)
        acknowledged.append(first)
        wait_until(lambda: _counter(agent, "kafka_topic_limits_known") >= 1, timeout=30,
                   message="the intake knows the topic's limits")

        with pytest.raises(PublishRejected) as refused:
            http.publish(topic, os.urandom(20_000))  # incompressible
        assert refused.value.status == 413 and refused.value.error == "too_large_for_topic"
        assert "max.message.bytes=10000" in refused.value.message, refused.value.message
        for value in (_compressible(20_000), os.urandom(9_000)):  # lz4 fits the first
            http.publish(topic, value)
            acknowledged.append(value)

        now = int(time.time() * 1000)
        neighbours = [f"datagram-{i:04d}".encode() for i in range(200)]
        with FerryClient(agent.socket_path, timeout=30) as client:
            for i, value in enumerate(neighbours):
                client.send(topic, value, partition_key=i % 2)
                if i == 50:
                    client.send(topic, os.urandom(20_000))
                if i == 100:
                    client.send(topic, b"from the future", timestamp_ms=now + HOURS_2)
        wait_until(lambda: _counter(agent, "messages_received", source="socket") == 202,
                   timeout=30, message="every datagram received")
        rejected = {reason: _counter(agent, "messages_rejected", source="socket",
                                     reason=reason)
                    for reason in ("too_large_for_topic", "timestamp_out_of_range")}
        assert rejected == {"too_large_for_topic": 1, "timestamp_out_of_range": 1}
        # The HTTP front door's counters reach the registry in batches (LocalCounters).
        wait_until(lambda: _counter(agent, "messages_rejected", source="http",
                                    reason="too_large_for_topic") == 1,
                   timeout=10, message="the 413 counted")
        acknowledged += neighbours
        wait_until(lambda: agent.buffered() == {}, timeout=60, interval=0.5,
                   message="the buffer drained")
        assert _counter(agent, "messages_discarded") == 0
    counted = tally(acknowledged, values(apache_kafka.bootstrap, topic))
    print(counted)
    assert counted.lost == [] and counted.duplicated == {} \
        and counted.read == len(acknowledged), counted


def test_the_batch_of_one_is_the_size_the_broker_compares(apache_kafka: KafkaCluster
                                                          ) -> None:
    """Uncompressed, a message whose batch of one is exactly max.message.bytes is taken,
    one byte more is refused (MSG_SIZE_TOO_LARGE): the rule counts what Kafka counts."""
    topic = f"exact-{uuid.uuid4().hex[:8]}"
    apache_kafka.create_topic(topic, 1, config={"max.message.bytes": "10000"})
    fits = 9_928
    assert batch_of_one(None, fits) == 10_000
    producer = Producer({"bootstrap.servers": apache_kafka.bootstrap,
                         "compression.type": "none", "linger.ms": 0, "acks": "all",
                         "enable.idempotence": True})
    errors: dict[int, KafkaError | None] = {}
    for size in (fits, fits + 1):
        producer.produce(topic, os.urandom(size),
                         on_delivery=lambda err, _msg, size=size: errors.__setitem__(size,
                                                                                     err))
        producer.flush(30)  # each alone in its batch
    assert errors[fits] is None, errors
    err = errors[fits + 1]
    assert err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE, errors
