"""Bad cluster input, on real Apache Kafka: a bootstrap list naming no Kafka, and a node that
accepts TCP connections but never answers.

Each: the cluster is reported down with a reason a person can act on (``/status/all``,
``ferry status``, the log line ``cluster local is down: ...``), the topic says why it waits,
every acknowledged message stays in the buffer, and once the cluster is reachable (the
configuration fixed and the agent restarted; the silent node answering again) every message
arrives once. A missing topic with auto-create off is in test_kafka_metadata.py, refused
credentials and certificates in test_kafka_security.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.agent_harness import AgentProcess, wait_drained, write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.apache_delivery import (
    cluster_row,
    ferry_status,
    health_messages,
    log_lines,
    publish,
    status,
    tally,
    topic_row,
    values,
)
from tests.kafka import TcpProxy, free_port
from tests.waiting import wait_until

MESSAGES = 50


def reported_down(agent: AgentProcess, topic: str, cause: str) -> dict[str, object]:
    """Wait until the local cluster is down because of ``cause`` and the topic says so;
    check health, ``ferry status`` and the log name it too. Returns the cluster's row."""
    t0 = time.monotonic()
    row = wait_until(
        lambda: (r := cluster_row(status(agent), "local"))["state"] == "down"
        and cause in str(r["reason"]) and r,
        timeout=60, interval=0.2, message=f"local cluster down because of {cause!r}")
    print(f"down after {time.monotonic() - t0:.1f} s: {row['reason']}")
    stuck = wait_until(lambda: (topic_row(status(agent), topic) or {}).get("stuck"),
                       timeout=60, interval=0.5, message=f"{topic} reported waiting")
    assert stuck["error"] == "NO_PARTITIONS" and cause in stuck["detail"], stuck
    doc = status(agent)
    assert doc["health"]["status"] == "critical"
    assert any("cluster local is down" in m and cause in m for m in health_messages(doc))
    code, output = ferry_status(agent)
    assert code == 2 and "local DOWN" in output and cause in output, output
    assert any(cause in line for line in log_lines(agent, "cluster local is down")), (
        agent.log_tail())
    assert doc["totals"]["discarded"] == 0
    return row


def test_wrong_bootstrap_servers_are_reported_and_messages_kept_until_fixed(
    tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str
) -> None:
    topic = unique_topic
    apache_kafka.create_topic(topic, 2)
    nothing_there = f"127.0.0.1:{free_port()}"  # nothing listens: connections are refused
    wrong = write_config(tmp_path / "agent", nothing_there, topics={topic: {"acks": "all"}})
    with AgentProcess(wrong) as agent:
        acknowledged = publish(agent, topic, "wrong", MESSAGES)
        reported_down(agent, topic, f"Connect to ipv4#{nothing_there} failed: "
                                    "Connection refused")
        assert agent.buffered() == {topic: MESSAGES}

    fixed = write_config(tmp_path / "agent", apache_kafka.bootstrap,
                         topics={topic: {"acks": "all"}})
    with AgentProcess(fixed) as agent:
        acknowledged += publish(agent, topic, "fixed", MESSAGES)
        wait_drained(agent, timeout=60)
    counted = tally(acknowledged, values(apache_kafka.bootstrap, topic))
    print(counted)
    assert counted.lost == [] and counted.duplicated == {}, counted


def test_a_node_that_accepts_connections_but_never_answers(
    tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str
) -> None:
    topic = unique_topic
    apache_kafka.create_topic(topic, 2)
    # The agent bootstraps through a proxy that accepts connections and drops every byte:
    # TCP is fine, Kafka never answers (a hung broker, a firewall eating packets).
    with TcpProxy(apache_kafka.node(1).port) as silent:
        silent.blackhole()
        config = write_config(tmp_path / "agent", f"127.0.0.1:{silent.port}",
                              topics={topic: {"acks": "all"}})
        with AgentProcess(config) as agent:
            acknowledged = publish(agent, topic, "silent", MESSAGES)
            reported_down(agent, topic, "no answer to a metadata request")
            assert silent.connections_accepted > 0, "the agent never connected"
            assert agent.buffered() == {topic: MESSAGES}

            # The node answers again: the agent recovers by itself, no restart.
            silent.restore()
            recovered_at = time.monotonic()
            wait_drained(agent, timeout=120)
            print(f"drained {time.monotonic() - recovered_at:.1f} s after the node answered")
            acknowledged += publish(agent, topic, "answering", MESSAGES)
            wait_drained(agent, timeout=60)
            assert cluster_row(status(agent), "local")["state"] == "up"
    counted = tally(acknowledged, values(apache_kafka.bootstrap, topic))
    print(counted)
    assert counted.lost == [] and counted.duplicated == {}, counted
