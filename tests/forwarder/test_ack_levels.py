"""Ack levels and delivery attempts, against a real broker.

librdkafka refuses inconsistent settings when a producer is built (idempotence needs
acks=all), so building real producers from producer_config() and delivering through them
checks the effective configuration, not just the dictionary.
"""

from __future__ import annotations

import json
from pathlib import Path

from confluent_kafka import Producer

from agent.config import ForwarderConfig, KafkaClusterConfig
from agent.forwarder.clusters import producer_config
from ferry_client import FerryClient
from tests.agent_harness import running_agent
from tests.kafka import Broker, TcpProxy, consume_all
from tests.waiting import wait_until


def test_each_ack_level_builds_a_working_producer_with_its_guarantees(
    session_broker: Broker, unique_topic: str
) -> None:
    cluster = KafkaClusterConfig(bootstrap_servers=session_broker.bootstrap,
                                 properties={"linger.ms": 1})
    all_conf = producer_config("local", "all", cluster, ForwarderConfig())
    leader_conf = producer_config("local", "leader", cluster, ForwarderConfig())
    assert (all_conf["acks"], all_conf["enable.idempotence"]) == ("all", True)
    assert (leader_conf["acks"], leader_conf["enable.idempotence"]) == (1, False)
    # Ordering survives retries without idempotence only with one request in flight.
    assert leader_conf["max.in.flight.requests.per.connection"] == 1
    assert all_conf["linger.ms"] == 1  # [kafka.local.properties] are applied last
    for name, conf in (("all", all_conf), ("leader", leader_conf)):
        producer = Producer(conf)  # raises if librdkafka finds the settings inconsistent
        errors: list[object] = []
        producer.produce(unique_topic, name.encode(),
                         on_delivery=lambda err, _msg, into=errors: into.append(err))
        assert producer.flush(20) == 0
        assert errors == [None]
    got = consume_all(session_broker.bootstrap, unique_topic, 2, timeout=20)
    assert sorted(m.value for m in got) == [b"all", b"leader"]


def test_max_attempts_discards_into_the_log_after_that_many_failures(
    tmp_path: Path, proxied_broker: tuple[Broker, TcpProxy], unique_topic: str
) -> None:
    broker, proxy = proxied_broker
    topics = {unique_topic: {"max_attempts": 2, "acks": "leader"}}
    forwarder = {"message_timeout_ms": 1000, "retry_backoff_ms": 50}
    with running_agent(tmp_path, broker.bootstrap, topics=topics,
                       forwarder=forwarder) as agent:
        assert agent.config.socket.path is not None
        with FerryClient(agent.config.socket.path) as client:
            client.send(unique_topic, b"warm-up")  # partitions known, connection up
            assert len(consume_all(broker.direct_bootstrap, unique_topic, 1, timeout=20)) == 1
            proxy.blackhole()  # from now on every attempt times out
            client.send(unique_topic, b"doomed")
        wait_until(lambda: agent.registry.view().total(
            "messages_discarded", reason="attempts") == 1, timeout=30,
            message="discarded after 2 attempts")
        view = agent.registry.view()
        assert view.total("delivery_failures", topic=unique_topic) == 2
        assert not agent.store.topic_stats()
        lines = [json.loads(x) for x in agent.config.discard_log_path.read_text().splitlines()]
        assert [(d["reason"], d["attempts"], d["topic"]) for d in lines] == [
            ("attempts", 2, unique_topic)]


def test_a_produce_request_times_out_before_its_messages() -> None:
    """request.timeout.ms stays within message.timeout.ms minus linger.ms (the Java producer's
    rule): a request the broker still holds when its messages time out must be drained by an
    idempotent producer, its broker thread busy (clusters.request_timeout_ms). librdkafka's
    30 s default where the message timeout allows it; a cluster's own properties override it."""
    cluster = KafkaClusterConfig(bootstrap_servers="127.0.0.1:1")

    def timeout(**fwd: float) -> int:
        return int(producer_config("local", "all", cluster, ForwarderConfig(**fwd))
                   ["request.timeout.ms"])

    assert timeout() == 30_000
    assert timeout(message_timeout_ms=3000, linger_ms=1) == 2999
    assert timeout(message_timeout_ms=3000, linger_ms=2.5) == 2997
    assert timeout(message_timeout_ms=1000, linger_ms=5000) == 1
    own = KafkaClusterConfig(bootstrap_servers="127.0.0.1:1",
                             properties={"request.timeout.ms": 7000})
    conf = producer_config("local", "leader", own, ForwarderConfig(message_timeout_ms=3000))
    assert conf["request.timeout.ms"] == 7000
