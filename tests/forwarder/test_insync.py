"""The in-sync replica diagnosis (agent/forwarder/insync.py) from metadata-shaped input, and
how a cluster's state carries it (agent/forwarder/health.py), with a test clock. The real
cluster case is in tests/forwarder/test_kafka_ack_levels.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.forwarder import insync
from agent.forwarder.health import ClusterHealth
from agent.forwarder.insync import Shortfall


@dataclass
class Partition:
    replicas: list[int]
    isrs: list[int]


@dataclass
class Topic:
    partitions: dict[int, Partition]
    error: object = None


@dataclass
class Metadata:
    topics: dict[str, Topic] = field(default_factory=dict)


def test_only_partitions_below_their_topics_minimum_are_short() -> None:
    topics = {
        "a": Topic({0: Partition([1, 2, 3], [1]), 1: Partition([1, 2, 3], [1, 2]),
                    2: Partition([1, 2, 3], [1, 2, 3])}),
        "b": Topic({0: Partition([1, 2, 3], [2])}),
        "healthy": Topic({0: Partition([1, 2], [1, 2])}),
        "__consumer_offsets": Topic({0: Partition([1, 2, 3], [1])}),
        "broken": Topic({}, error="UNKNOWN_TOPIC_OR_PART"),
    }
    in_sync = insync.under_replicated(topics)
    # Under-replicated (fewer in sync than replicas); internal topics are not Ferry's.
    assert in_sync == {"a": {0: 1, 1: 2}, "b": {0: 1}}
    # a needs 2: only partition 0 is short. b's setting is unknown: nothing claimed.
    assert insync.shortfalls(in_sync, {"a": 2}) == [Shortfall("a", (0,), 1, 2)]
    # With min.insync.replicas 3 both of a's under-replicated partitions are short.
    assert insync.shortfalls(in_sync, {"a": 3, "b": 1}) == [Shortfall("a", (0, 1), 1, 3)]


def test_the_cause_names_the_error_the_partitions_and_the_setting() -> None:
    assert insync.describe([]) == ""
    one = insync.describe([Shortfall("orders", (0, 2), 1, 2)])
    assert one == ("NOT_ENOUGH_REPLICAS: orders partitions 0, 2: 1 in-sync replica, "
                   "min.insync.replicas 2 (the cluster refuses acks=all writes there)")
    many = insync.describe([Shortfall(f"t{i}", (0,), 0, 2) for i in range(5)])
    assert many.count("partition 0: 0 in-sync replicas") == insync.SHOWN_TOPICS
    assert "and 2 more topics" in many


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stalled_cluster_names_the_shortfall_until_it_acknowledges_again() -> None:
    clock = Clock()
    h = ClusterHealth("local", 2.0, clock=clock, wall=clock)
    h.probe_answered(1)
    h.client_error("127.0.0.1:1/2: Connect to ipv4#127.0.0.1:1 failed: Connection refused")
    h.sends(10)
    assert not h.stalled()
    clock.now += 2.5
    h.check()
    assert h.stalled() and h.state == "down"
    assert "Connection refused" in h.reason  # the client's last error, until diagnosed
    cause = insync.describe([Shortfall("orders", (0,), 1, 2)])
    h.diagnosed(cause)
    assert h.state == "down" and h.reason.endswith(cause)
    assert "Connection refused" not in h.reason  # a dead node's connect error is not why
    assert h.snapshot().to_json()["in_sync_shortfall"] == cause
    h.acknowledged()
    h.sends(0)
    assert h.state == "up" and h.snapshot().in_sync_shortfall == ""


def test_the_shortfall_is_the_cause_when_probes_fail_too() -> None:
    """Two of three KRaft nodes stopped: the survivor serves metadata, but DescribeCluster
    can wait for a controller that is gone, so the probe fails as well."""
    clock = Clock()
    h = ClusterHealth("local", 2.0, clock=clock, wall=clock)
    h.probe_answered(1)
    h.client_error("127.0.0.1:1/2: Connect to ipv4#127.0.0.1:1 failed: Connection refused")
    h.sends(10)
    h.probe_failed("Timed out waiting for controller")
    clock.now += 2.5
    assert h.stalled()
    cause = insync.describe([Shortfall("orders", (0, 1), 1, 2)])
    h.diagnosed(cause)
    assert h.state == "down" and h.reason.endswith(cause), h.reason
