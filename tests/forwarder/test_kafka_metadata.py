"""A topic's metadata changing under the forwarder, on real Apache Kafka.

- **Partitions added** while PartitionKey messages flow (the shared 3-node cluster). Bruce's
  rule (agent/forwarder/partitioner.py) puts a key at ``sorted_partitions[key mod n]``, so
  once the forwarder learns the new count (its metadata refresh, every
  ``clusters.METADATA_INTERVAL`` seconds) a key whose ``key mod n`` changed moves to another
  partition, once: all its earlier messages in the old partition, all later ones in the new.
  Nothing is lost or duplicated.
- **Topic deleted and re-created** mid-stream (shared cluster). Kafka discards what the
  deleted topic held: messages Kafka acknowledged before the deletion are gone with it, and
  that is Kafka's doing. What is checked is Ferry's part: every acknowledged message is read
  by a consumer (from the old topic, by a reader that followed it until the deletion, or
  from the new one), or Kafka acknowledged it to Ferry before the deletion
  (``GET /messages/{id}`` says where). None is discarded.
- **Auto-create off and the topic missing** (a 1-node cluster of its own): the topic's row,
  health (CRITICAL), ``ferry status`` and a log line name the missing topic; every message
  is kept; once the topic is created, all arrive once.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from agent.forwarder.clusters import METADATA_INTERVAL
from tests.agent_harness import AgentProcess, wait_drained, write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.apache_delivery import (
    Stream,
    cluster_row,
    ferry_status,
    health_messages,
    log_lines,
    publish,
    status,
    tally,
    topic_row,
)
from tests.kafka import read_topic
from tests.waiting import wait_until

KEYS = 8  # Bruce partition keys 0..7: with 2 then 4 partitions, keys 2, 3, 6, 7 move


def test_partitions_added_while_partition_key_messages_flow(
    tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str
) -> None:
    topic = unique_topic
    apache_kafka.create_topic(topic, 2)
    config = write_config(tmp_path / "agent", apache_kafka.bootstrap,
                          topics={topic: {"acks": "all"}})
    with AgentProcess(config) as agent, Stream(agent, topic, "m",
                                               partition_keys=KEYS) as stream:
        stream.wait_for(200)
        added_at = time.monotonic()
        apache_kafka.add_partitions(topic, 4)

        def in_new_partitions() -> bool:
            return any(m.partition >= 2 for m in read_topic(apache_kafka.bootstrap, topic))

        wait_until(in_new_partitions, timeout=METADATA_INTERVAL + 60, interval=0.5,
                   message="messages in the added partitions")
        moved_after = time.monotonic() - added_at
        stream.wait_for(200)
        acknowledged = stream.stop()
        wait_drained(agent, timeout=60)
        assert status(agent)["totals"]["discarded"] == 0

    records = read_topic(apache_kafka.bootstrap, topic, timeout=60)
    counted = tally(acknowledged, [r.value for r in records])
    print(f"{counted}; first message in an added partition {moved_after:.1f} s after they "
          f"were added (metadata refresh every {METADATA_INTERVAL:g} s)")
    assert counted.lost == [] and counted.duplicated == {}, counted
    # Each key: partition key mod 2 first, then key mod 4, switching once, in sending order.
    by_key: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for r in records:
        assert r.value is not None
        seq = int(r.value.split(b"-")[1])
        by_key[seq % KEYS].append((seq, r.partition))
    moved = 0
    for key, seen in sorted(by_key.items()):
        seen.sort()
        old, new = key % 2, key % 4
        assert {p for _, p in seen} <= {old, new}, (key, sorted({p for _, p in seen}))
        partitions = [p for _, p in seen]
        if old != new:
            switch = partitions.index(new)  # ValueError: the key never moved
            assert set(partitions[:switch]) == {old} and set(partitions[switch:]) == {new}, (
                key, partitions)
            moved += 1
        else:
            assert set(partitions) == {old}
    assert moved == 4
    print(f"keys moved once each: {moved} of {KEYS}; the others kept their partition")


class TopicFollower:
    """A real consumer reading ``topic`` from the start, from a thread, until stopped: what
    the topic held up to its deletion (read_topic after the deletion would see nothing)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"follower-{topic}",
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 20, "log_level": 0,
            # Not resubscribing to the re-created topic: it is read separately, afterwards.
            "topic.metadata.refresh.interval.ms": 600000})
        self._consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._consumer.poll(0.05)
            if message is None or message.error() is not None:
                continue
            value = message.value()
            if value is not None:
                self.seen.append(value)

    def stop(self) -> list[bytes]:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()
        return self.seen


def test_topic_deleted_and_recreated_mid_stream(
    tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str
) -> None:
    topic = unique_topic
    apache_kafka.create_topic(topic, 2)
    config = write_config(tmp_path / "agent", apache_kafka.bootstrap,
                          topics={topic: {"acks": "all"}})
    with AgentProcess(config) as agent, Stream(agent, topic, "m") as stream:
        follower = TopicFollower(apache_kafka.bootstrap, topic, 2)
        stream.wait_for(200)
        apache_kafka.delete_topic(topic)
        deleted_at = len(stream.acknowledged)
        old_topic = follower.stop()
        # The shared cluster auto-creates topics, and librdkafka's producer asks it to: the
        # forwarder's own metadata request may re-create the topic (1 partition) first.
        try:
            apache_kafka.create_topic(topic, 2)
            recreated = "by the test, 2 partitions"
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            recreated = "by the forwarder's metadata request (auto-create)"
        stream.wait_for(200)
        acknowledged = stream.stop()
        wait_drained(agent, timeout=90)
        doc = status(agent)
        assert doc["totals"]["discarded"] == 0
        new_records = read_topic(apache_kafka.bootstrap, topic, timeout=60)
        new_topic = [r.value for r in new_records]
        # What neither consumer read: Kafka must have acknowledged it before the deletion.
        unread = tally(acknowledged, old_topic, new_topic).lost
        where = {v: agent.get_json(f"/messages/{stream.ids[v]}") for v in unread}
    in_new = {(r.partition, r.offset) for r in new_records}
    gone_with_topic = [v for v, w in where.items() if w.get("state") == "delivered"
                       and (w.get("partition"), w.get("offset")) not in in_new]
    lost = [v for v in unread if v not in gone_with_topic]
    counted = tally(acknowledged, old_topic, new_topic)
    print(f"{counted}; re-created {recreated}; {len(old_topic)} read from the deleted topic, "
          f"{len(new_topic)} from the new one, {len(gone_with_topic)} acknowledged by Kafka "
          f"into the deleted topic before the deletion and gone with it; lost by Ferry "
          f"{len(lost)}; {deleted_at} acknowledged by Ferry when the deletion returned")
    assert lost == [], [(v, where[v]) for v in lost]
    assert counted.duplicated == {}, counted
    assert new_topic, "nothing reached the re-created topic"


PROPAGATION_MS = 5000


@pytest.fixture
def no_auto_create(tmp_path: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(tmp_path / "kafka", nodes=1, auto_create_topics=False,
                      start_timeout=240) as cluster:
        yield cluster


def test_missing_topic_with_auto_create_off_is_reported_and_kept_until_created(
    tmp_path: Path, no_auto_create: KafkaCluster, unique_topic: str
) -> None:
    topic = unique_topic
    # librdkafka holds a send to a topic the cluster says does not exist for
    # topic.metadata.propagation.max.ms (30 s by default) before failing it, which is when
    # the topic is reported stuck. Here it holds them 5 s: still well past
    # outage_after_seconds (2 s), so sends held unanswered would make the cluster down, as
    # they once did, and each retry is held again while the test looks.
    config = write_config(tmp_path / "agent", no_auto_create.bootstrap,
                          topics={topic: {"acks": "all"}},
                          extra='[kafka.local.properties]\n'
                                f'"topic.metadata.propagation.max.ms" = {PROPAGATION_MS}\n')
    with AgentProcess(config) as agent:
        t0 = time.monotonic()
        acknowledged = publish(agent, topic, "waiting", 50)
        stuck = wait_until(lambda: (topic_row(status(agent), topic) or {}).get("stuck"),
                           timeout=90, interval=0.5, message=f"{topic} reported stuck")
        reported_after = time.monotonic() - t0
        print(f"reported after {reported_after:.1f} s: {stuck}")
        assert stuck["error"] in ("UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC"), stuck
        assert stuck["operator"] is True, stuck
        doc = status(agent)
        assert doc["health"]["status"] == "critical"
        assert any(f"topic {topic} cannot be delivered" in m for m in health_messages(doc))
        code, output = ferry_status(agent)
        assert code == 2 and "UNKNOWN_TOPIC" in output and f"topic {topic}" in output, output
        print(output.splitlines()[0])
        assert log_lines(agent, f"topic {topic} cannot be delivered"), agent.log_tail()
        assert agent.buffered() == {topic: 50}
        # The cluster itself is fine, and was all along: only the topic waits. (Its sends,
        # held by librdkafka for PROPAGATION_MS each time, once made the whole cluster
        # "down".)
        assert cluster_row(doc, "local")["state"] == "up"
        assert not log_lines(agent, "cluster local is down"), agent.log_tail()

        no_auto_create.create_topic(topic, 2)
        created_at = time.monotonic()
        acknowledged += publish(agent, topic, "created", 50)
        wait_drained(agent, timeout=90)
        print(f"drained {time.monotonic() - created_at:.1f} s after the topic was created")
        # The status page hears from the forwarder in snapshots, a moment after the buffer.
        wait_until(lambda: (topic_row(status(agent), topic) or {}).get("stuck") is None,
                   timeout=30, interval=0.25, message=f"{topic} no longer reported stuck")
        assert status(agent)["totals"]["discarded"] == 0
    counted = tally(acknowledged, [r.value for r in read_topic(no_auto_create.bootstrap, topic)])
    print(counted)
    assert counted.lost == [] and counted.duplicated == {}, counted
