"""agent/forwarder/routing.py: which cluster a message goes to, and the speculative sends to
the remote one, over fake clusters whose health the test sets. (The same through the whole
loop on real brokers: tests/forwarder/test_fallback.py and test_kafka_fallback.py.)"""

from __future__ import annotations

from typing import cast

from agent.buffer.stored import StoredMessage
from agent.config import TopicConfig
from agent.forwarder.clusters import Cluster
from agent.forwarder.flight import LOCAL, REMOTE, Flight
from agent.forwarder.health import ClusterHealth
from agent.forwarder.routing import SPECULATIVE_AGAIN, Routing
from agent.records import Record
from tests.forwarder.fakes import FakeCluster

FALLBACK = TopicConfig(fallback_to_remote=True, speculative_send_delay_ms=250)
PLAIN = TopicConfig()


def _flight(settings: TopicConfig, topic: str = "t", generation: int = 0) -> Flight:
    record = Record(topic, b"v", None, None, 0, (), False)
    return Flight(StoredMessage(b"t\0id", b"id", record, generation, 8), settings)


def _routing(*names: str) -> tuple[Routing, dict[str, FakeCluster]]:
    clusters = {name: FakeCluster() for name in names}
    return Routing(cast(dict[str, Cluster], clusters)), clusters


def _down(cluster: FakeCluster) -> None:
    """The cluster found down: its probes failing for outage_after_seconds (here 0)."""
    cluster.health = ClusterHealth("fake", 0.0)
    cluster.health.probe_failed("cut off")
    assert cluster.down


def test_only_a_fallback_topic_with_its_local_cluster_down_goes_to_the_remote_one() -> None:
    routing, clusters = _routing(LOCAL, REMOTE)
    assert routing.cluster_for(_flight(FALLBACK)) == LOCAL  # never idleness: only down
    _down(clusters[LOCAL])
    assert routing.cluster_for(_flight(FALLBACK)) == REMOTE
    assert routing.cluster_for(_flight(PLAIN)) == LOCAL
    _down(clusters[REMOTE])
    assert routing.cluster_for(_flight(FALLBACK)) == LOCAL  # both down: the local waits

    alone, local_only = _routing(LOCAL)
    _down(local_only[LOCAL])
    assert alone.cluster_for(_flight(FALLBACK)) == LOCAL  # no remote cluster configured


def test_a_batch_goes_direct_only_when_it_simply_goes_to_the_local_cluster() -> None:
    routing, clusters = _routing(LOCAL, REMOTE)
    direct = routing.direct("t", PLAIN)
    assert direct is not None and direct[0] is clusters[LOCAL].p
    assert routing.direct("t", FALLBACK) is None  # each send may go to either cluster
    alone, _ = _routing(LOCAL)
    assert alone.direct("t", FALLBACK) is not None  # no remote: fallback means nothing


def test_a_local_send_not_acknowledged_in_its_delay_is_due_for_the_remote_cluster() -> None:
    routing, _ = _routing(LOCAL, REMOTE)
    slow, plain, answered = _flight(FALLBACK), _flight(PLAIN), _flight(FALLBACK)
    for f in (slow, plain, answered):
        routing.speculate(f, now=100.0)
    assert routing.due(100.2, {}) == []  # before speculative_send_delay_ms
    answered.done = True  # acknowledged meanwhile
    assert routing.due(100.25, {}) == [slow]  # the plain topic's send never speculates
    assert routing.due(200.0, {}) == []  # each is due once

    routing.again(slow, now=200.0)  # could not be handed to the remote producer yet
    assert routing.due(200.0 + SPECULATIVE_AGAIN / 2, {}) == []
    assert routing.due(200.0 + SPECULATIVE_AGAIN, {}) == [slow]


def test_a_speculative_send_is_dropped_once_sent_remote_or_its_topic_deleted() -> None:
    routing, _ = _routing(LOCAL, REMOTE)
    sent, deleted, kept = _flight(FALLBACK), _flight(FALLBACK, "old"), _flight(FALLBACK, "new")
    for f in (sent, deleted, kept):
        routing.speculate(f, now=0.0)
    sent.sent_remote = True  # the local cluster went down: it went remote already
    assert routing.due(1.0, {"old": 1, "new": 0}) == [kept]


def test_without_a_remote_cluster_nothing_is_sent_speculatively() -> None:
    routing, _ = _routing(LOCAL)
    routing.speculate(_flight(FALLBACK), now=0.0)
    assert routing.due(10.0, {}) == []
