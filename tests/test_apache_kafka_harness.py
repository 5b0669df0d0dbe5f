"""tests/apache_kafka.py: the Apache Kafka cluster the Kafka-facing suites run on."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import Producer

from tests.apache_kafka import (
    KafkaCluster,
    build_class_archive,
    java_string_hash,
    kafka_version,
    new_cluster_id,
    transaction_state_partition,
)
from tests.kafka import read_topic
from tests.waiting import wait_until


def test_java_string_hash_matches_java() -> None:
    # Values Java's String.hashCode() gives (checked with java).
    assert java_string_hash("") == 0
    assert java_string_hash("a") == 97
    assert java_string_hash("ferry-agent") == 1341889682
    assert java_string_hash("polygenelubricants") == -(1 << 31)
    assert transaction_state_partition("polygenelubricants", 10) == 0  # abs(MIN_VALUE) is 0


def test_cluster_ids_are_kafka_uuids_that_no_argument_parser_takes_for_an_option() -> None:
    # 1 in 64 random ids starts with "-"; 2,000 draws see one with near certainty.
    ids = [new_cluster_id() for _ in range(2000)]
    assert all(len(i) == 22 and "=" not in i and not i.startswith("-") for i in ids)


def test_the_cluster_is_apache_kafka_with_three_in_sync_replicas(
    apache_kafka: KafkaCluster, unique_topic: str
) -> None:
    assert kafka_version().startswith("4.")
    assert apache_kafka.live_brokers() == {1, 2, 3}
    apache_kafka.create_topic(unique_topic, 2)
    assert sorted(apache_kafka.isr(unique_topic, 0)) == [1, 2, 3]


def test_a_killed_leader_is_replaced_and_rejoins_when_started(
    apache_kafka: KafkaCluster, unique_topic: str
) -> None:
    apache_kafka.create_topic(unique_topic)
    leader = apache_kafka.leader(unique_topic)
    apache_kafka.kill(leader)
    wait_until(lambda: apache_kafka.leader(unique_topic) not in (leader, -1), timeout=30,
               message="a new leader elected")
    producer = Producer({"bootstrap.servers": apache_kafka.bootstrap, "acks": "all"})
    producer.produce(unique_topic, b"while one node is down")
    assert producer.flush(30) == 0
    apache_kafka.start_node(leader)
    apache_kafka.wait_healthy()
    assert sorted(apache_kafka.isr(unique_topic)) == [1, 2, 3]
    assert [m.value for m in read_topic(apache_kafka.bootstrap, unique_topic)] == [
        b"while one node is down"
    ]


def test_a_proxied_cluster_routes_client_traffic_through_its_proxies(tmp_path: Path) -> None:
    with KafkaCluster(tmp_path, nodes=1, proxied=True) as cluster:
        cluster.create_topic("through-the-proxy")
        producer = Producer({"bootstrap.servers": cluster.proxied_bootstrap})
        producer.produce("through-the-proxy", b"proxied")
        assert producer.flush(30) == 0
        assert cluster.proxy(1).bytes_forwarded > 0
        assert [m.value for m in read_topic(cluster.proxied_bootstrap, "through-the-proxy")] == [
            b"proxied"
        ]


def test_a_node_starts_from_the_class_archive(tmp_path: Path) -> None:
    # dev/test builds it before the suite (then this is a no-op); a node maps it into memory
    # when its JVM accepted it, and ignores it silently when not.
    archive = build_class_archive()
    with KafkaCluster(tmp_path, nodes=1) as cluster:
        pid = cluster.node(1).pid
        assert pid is not None
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert str(archive) in maps, f"node 1's JVM did not map {archive}"
        cluster.create_topic("from-the-archive")
        producer = Producer({"bootstrap.servers": cluster.bootstrap})
        producer.produce("from-the-archive", b"loaded")
        assert producer.flush(30) == 0
        assert [m.value for m in read_topic(cluster.bootstrap, "from-the-archive")] == [b"loaded"]
