"""The probe (agent/forwarder/probe.py) against a real tansu broker and a closed port: one
metadata request decides up, or down with the connect error as the cause."""

from __future__ import annotations

from agent.config import KafkaClusterConfig
from agent.forwarder.health import ClusterHealth
from agent.forwarder.probe import Probe
from tests.kafka import Broker, free_port


def test_a_broker_that_answers_is_up(broker: Broker) -> None:
    health = ClusterHealth("local", 10.0)
    probe = Probe("local", KafkaClusterConfig(bootstrap_servers=broker.bootstrap), health)
    assert probe.controller_accepts()  # nothing known yet: admin requests are not held back
    probe.probe_once()
    assert health.state == "up"
    assert health.reason == "answered a metadata request (1 brokers)"
    # The answer named the broker itself as the controller, and it takes connections: the
    # occasional admin requests (a topic's limits) go ahead.
    assert probe.controller_accepts()


def test_a_closed_port_is_down_with_the_connect_error() -> None:
    port = free_port()
    health = ClusterHealth("local", 10.0)
    config = KafkaClusterConfig(bootstrap_servers=f"127.0.0.1:{port}",
                                probe_interval_seconds=1.0)
    probe = Probe("local", config, health)
    probe.probe_once()
    assert health.state == "down"
    assert "Connection refused" in health.reason and f"127.0.0.1:{port}" in health.reason
    snap = health.snapshot()
    assert snap.last_probe_ok is False and snap.errors >= 1
