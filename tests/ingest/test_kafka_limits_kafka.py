"""Issue #36's acceptance case at intake, on Apache Kafka: a topic limited to 10,000 bytes
(max.message.bytes) and 60 s ahead (message.timestamp.after.max.ms). Once the forwarder
learnt those limits, what the topic can never take is refused before it is acknowledged
(HTTP 413 naming the limit; a datagram counted), what it takes is accepted and delivered,
counted at a real consumer. The same for spool files of both strategies (a binary file's
blocks, a hand-made file's records): the record the topic never takes is left out and counted,
the rest of its file delivered. And the rule's exact batch size against the broker itself."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer

from agent.record_batch import batch_of_one
from ferry_client import FerryClient, FerryHttp, PublishRejected
from spool.format import SpoolRecord
from spool.writer import write_spool_file
from tests.agent_harness import AgentProcess, write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.apache_delivery import tally, values
from tests.reliability.harness import metric_total
from tests.waiting import wait_until

LIMITS = {"max.message.bytes": "10000", "message.timestamp.after.max.ms": "60000"}
HOURS_2 = 7_200_000


def _counter(agent: AgentProcess, name: str, **labels: str) -> float:
    return metric_total(agent.get_json("/status/counters"), name, **labels)


def _drop_aged(path: Path, data: bytes) -> None:
    """A hand-made file finished a minute ago (fresh ones are left to settle), renamed into
    place so the agent never sees it young."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    past = time.time() - 60
    os.utime(tmp, (past, past))
    os.rename(tmp, path)


def _compressible(size: int) -> bytes:
    return (b"the same few words again and again " * (size // 30 + 1))[:size]


def test_what_a_limited_topic_can_never_take_is_refused_at_intake(
    tmp_path: Path, apache_kafka: KafkaCluster
) -> None:
    topic = f"limited-{uuid.uuid4().hex[:8]}"
    apache_kafka.create_topic(topic, 2, config=LIMITS)
    config = write_config(tmp_path / "agent", apache_kafka.bootstrap, spool=True,
                          topics={topic: {"acks": "all"}})
    spool = tmp_path / "agent" / "spool"
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

        # Spool files: a binary one (its blocks stored as they are) and a hand-made one (its
        # lines as records), each with a record too large and one from the future.
        binary = [SpoolRecord(topic, f"spooled-{i:03d}".encode(), partition_key=i % 2)
                  for i in range(100)]
        binary.insert(30, SpoolRecord(topic, os.urandom(20_000)))
        binary.insert(60, SpoolRecord(topic, b"spooled from the future",
                                      timestamp_ms=now + HOURS_2))
        write_spool_file(spool, "limited.ferry", binary)
        lines = [f"line-{i:03d}" for i in range(50)]
        rows: list[dict[str, object]] = [{"value": line} for line in lines]
        rows.insert(10, {"value": os.urandom(10_000).hex()})
        rows.insert(20, {"value": "line from the future", "timestamp": now + HOURS_2})
        (spool / topic).mkdir()
        _drop_aged(spool / topic / "people.jsonl",
                   b"".join(json.dumps(row).encode() + b"\n" for row in rows))

        def spooled() -> tuple[float, dict[str, float]]:
            return (_counter(agent, "messages_accepted", source="spool"),
                    {reason: _counter(agent, "messages_rejected", source="spool",
                                      reason=reason)
                     for reason in ("too_large_for_topic", "timestamp_out_of_range")})

        wait_until(lambda: spooled()[0] >= 150 and sum(spooled()[1].values()) >= 4,
                   timeout=30, message="both spool files taken")
        assert spooled() == (150, {"too_large_for_topic": 2, "timestamp_out_of_range": 2})
        acknowledged += [r.value for r in binary if r.value.startswith(b"spooled-")]
        acknowledged += [line.encode() for line in lines]
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
