"""The probe (agent/forwarder/probe.py) against a real tansu broker and a closed port: one
metadata request decides up, or down with the connect error as the cause."""

from __future__ import annotations

import time

from agent.config import KafkaClusterConfig
from agent.forwarder.clusters import (
    IDLE_METADATA_INTERVAL,
    METADATA_INTERVAL,
    idle_metadata_interval,
)
from agent.forwarder.health import ClusterHealth
from agent.forwarder.probe import REACH_TIMEOUT, Probe
from tests.kafka import Broker, TcpProxy, create_topic, free_port


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


def test_the_probe_names_a_topic_that_exists_one_of_ferrys_first(
    broker: Broker, unique_topic: str
) -> None:
    """The first probe knows no topic and asks for all; from then on it names one the
    answer listed (one of Ferry's when listed), never one that does not exist: librdkafka
    would look that one up again every second for as long as the client lives."""
    mine, other = f"{unique_topic}-mine", f"{unique_topic}-0-other"
    create_topic(broker.bootstrap, other)
    probe = Probe("local", KafkaClusterConfig(bootstrap_servers=broker.bootstrap),
                  ClusterHealth("local", 10.0), topics=lambda: [mine])
    assert probe.topic is None
    probe.probe_once()
    listed = probe.topic
    assert listed is not None and listed != mine  # not created yet: some other topic
    create_topic(broker.bootstrap, mine)
    probe.probe_once()  # names `listed`, which exists; that answer does not list `mine`
    assert probe.topic == listed
    named = Probe("local", KafkaClusterConfig(bootstrap_servers=broker.bootstrap),
                  ClusterHealth("local", 10.0), topics=lambda: [mine])
    named.probe_once()  # a full listing: Ferry's topic is in it and preferred
    assert named.topic == mine


def test_the_clusters_choice_comes_first() -> None:
    probe = Probe("local", KafkaClusterConfig(bootstrap_servers="127.0.0.1:1"),
                  ClusterHealth("local", 10.0), named=lambda: "sent-to")
    assert probe.topic == "sent-to"


def test_an_idle_full_refresh_stays_under_the_idle_connection_period() -> None:
    assert idle_metadata_interval(0) == IDLE_METADATA_INTERVAL  # connections never closed
    assert idle_metadata_interval(30) == IDLE_METADATA_INTERVAL
    assert idle_metadata_interval(24) == 18
    assert idle_metadata_interval(3) == METADATA_INTERVAL  # never more often than busy


def test_the_reach_check_reports_a_broker_out_of_reach_only_once_it_answers(
    proxied_broker: tuple[Broker, TcpProxy],
) -> None:
    """A broker out of reach is asked alone (a client whose only bootstrap it is): through
    a silent network (its proxy blackholed) it is reported unanswered, within the check's
    bound; once it answers again, answered."""
    broker, proxy = proxied_broker
    reached: list[tuple[int, bool]] = []
    probe = Probe("local", KafkaClusterConfig(bootstrap_servers=broker.bootstrap),
                  ClusterHealth("local", 10.0), out_of_reach=lambda: {7: broker.bootstrap},
                  reached=lambda node, answered: reached.append((node, answered)))
    proxy.blackhole()
    started = time.monotonic()
    probe.check_reach()
    assert reached == [(7, False)]
    assert time.monotonic() - started < REACH_TIMEOUT + 1.0
    proxy.restore()
    probe.check_reach()
    assert reached == [(7, False), (7, True)]


def test_no_reach_check_without_a_broker_out_of_reach(broker: Broker) -> None:
    reached: list[tuple[int, bool]] = []
    probe = Probe("local", KafkaClusterConfig(bootstrap_servers=broker.bootstrap),
                  ClusterHealth("local", 10.0), out_of_reach=dict,
                  reached=lambda node, answered: reached.append((node, answered)))
    probe.probe_once()
    assert reached == []
