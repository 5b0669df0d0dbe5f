"""Each cluster's state (health.py) fed with its outstanding sends, its changes logged, and
the gauges the status page and alerts read (cluster state, stuck topics).

``ClusterWatch`` owns its counts of the local cluster's parked and retried sends and when to
count them and publish the gauges next; it reads each topic's state and which topics have
retries waiting (``Shared``), and writes nothing of the loop's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError

from agent.config import TopicConfig
from agent.forwarder import failures, holding
from agent.forwarder.clusters import Cluster
from agent.forwarder.flight import LOCAL, REMOTE
from agent.forwarder.health import Change
from agent.forwarder.shared import Shared, log
from agent.forwarder.transactions import ExactlyOnce
from agent.metrics import Registry

# How often the gauges are published, and the parked and retried sends counted when neither
# is needed every step (check_health).
GAUGES_SECONDS = 0.5
COUNT_SECONDS = 0.1


def count_client_error(registry: Registry, cluster: str, err: KafkaError) -> None:
    """A cluster's producers' error callback (``Cluster``'s ``on_error``): counted and
    sampled for the status page."""
    registry.inc("cluster_errors", cluster=cluster, error=err.name())
    registry.sample("error", err.name(), {"cluster": cluster, "detail": err.str()})


class ClusterWatch:
    def __init__(self, shared: Shared, clusters: dict[str, Cluster], registry: Registry,
                 topic_settings: Callable[[str], TopicConfig],
                 exactly_once: ExactlyOnce) -> None:
        self._topics = shared.topics
        self._retry_topics = shared.retry_topics
        self._limited = shared.limited
        self.clusters = clusters
        self.registry = registry
        self.topic_settings = topic_settings
        self.exactly_once = exactly_once
        self._parked = 0  # local sends of topics the local cluster says do not exist
        self._retrying = 0  # messages the local cluster failed, waiting for a retry to it
        self._eo_answers = 0  # the exactly-once sender's answers counted so far
        self._next_parked = 0.0
        self._next_gauges = 0.0

    def check_health(self, now: float) -> None:
        """Feed each cluster's state (health.py) with its outstanding sends; log changes."""
        if now >= self._next_parked or self._retry_topics or self.clusters[LOCAL].has_missing():
            # Every step while there are retries or missing topics: counted a step late, a
            # send of a missing topic or a message on its way to a retry read as unanswered,
            # and the cluster as down. Otherwise both counts are 0 but for a moment, and a
            # walk of the topics every 0.1 s is enough (not on the busy path's every step).
            self._parked = self._parked_sends()
            self._retrying = self._retrying_sends()
            self._next_parked = now + COUNT_SECONDS
        for name, c in self.clusters.items():
            h = c.health
            # Sends to a broker out of reach wait for it alone (brokers.py): they say nothing
            # of the rest of the cluster, which must not be called down for them.
            stranded = c.stranded()
            if name == LOCAL:
                h.sends(max(0, c.outstanding() + self._transactions(c) - stranded
                            - self._parked), self._retrying)
            else:
                h.sends(max(0, c.outstanding() - stranded))
            h.unreachable(c.unreachable_text(), c.partial())
            h.check()
            for change in h.changes():
                self._log_change(change)
                self._next_gauges = 0.0  # publish a new state at once, not in up to 0.5 s

    def _transactions(self, local: Cluster) -> int:
        """The exactly-once sender's sends waiting for a commit, counted as outstanding on
        the local cluster, and its answers (acknowledged sends, commits) as the cluster's
        acknowledgements. Counted while brokers are out of reach too: with the quorum lost
        the agent may see one dead broker only (the one its transactions used), and the
        survivor's partitions commit nothing either. (When the rest of the cluster does
        commit, its answers keep the cluster up.)"""
        eo = self.exactly_once
        answers = eo.answers
        if answers != self._eo_answers:
            self._eo_answers = answers
            local.health.acknowledged()
        return eo.unanswered()

    def _parked_sends(self) -> int:
        """Local sends of topics the local cluster's metadata says do not exist (auto-create
        off): librdkafka holds them for topic.metadata.propagation.max.ms (30 s) before
        failing them, and they wait for an operator to create the topic, not for the
        cluster. Counted as unanswered sends, one missing topic made the whole cluster down
        (and its fallback topics go remote); the topic is reported stuck instead. Fallback
        topics are left out: some of their sends may be the remote cluster's."""
        local = self.clusters[LOCAL]
        remote = REMOTE in self.clusters
        parked = 0
        for topic, st in self._topics.items():
            if st.sending and local.known_missing(topic) and not (
                    remote and self.topic_settings(topic).fallback_to_remote):
                parked += st.sending
        return parked

    def _retrying_sends(self) -> int:
        """Messages the local cluster failed that wait for a retry to it: unacknowledged as
        much as those in flight (health.py, ``sends``). Left out: fallback topics (a retry
        may go to either cluster), topics the cluster says do not exist (as parked sends)
        or whose last failure was the cluster's answer (failures.answered),
        and topics stuck on an error only an operator can fix (an ACL: the cluster answers,
        and the topic's own CRITICAL names the cause)."""
        local = self.clusters[LOCAL]
        remote = REMOTE in self.clusters
        retrying = 0
        for topic, st in self._topics.items():
            if not st.retry or (st.stuck is not None and st.stuck.operator):
                continue
            code = getattr(KafkaError, st.stuck.error, None) if st.stuck is not None else None
            if isinstance(code, int) and failures.answered(code):
                continue  # the cluster answered them (an unknown topic, say): no outage
            if remote and self.topic_settings(topic).fallback_to_remote:
                continue
            if local.known_missing(topic):
                continue
            retrying += len(st.retry)
        return retrying

    def _log_change(self, change: Change) -> None:
        if change.new == "down":
            self._limited.warning(f"down:{change.cluster}", "cluster %s is down: %s",
                                  change.cluster, change.reason)
        elif change.old == "down":
            self._limited.warning(f"back:{change.cluster}", "cluster %s is up again after "
                                  "%.0f s: %s", change.cluster, change.after_seconds,
                                  change.reason)
        else:
            log.info("cluster %s is %s: %s", change.cluster, change.new, change.reason)

    def publish_gauges(self, now: float) -> None:
        """The gauges, every GAUGES_SECONDS, and at once after a cluster's state changed."""
        if now >= self._next_gauges:
            self.gauges()
            self._next_gauges = now + GAUGES_SECONDS

    def gauges(self) -> None:
        reg = self.registry
        states: dict[str, Any] = {}
        for name, c in self.clusters.items():
            snap = c.health.snapshot()
            states[name] = snap.to_json()
            states[name]["unreachable_brokers"] = c.unreachable_brokers()
            if snap.state != "unknown":
                reg.set("cluster_up", 1.0 if snap.state == "up" else 0.0, cluster=name)
            reg.set("cluster_brokers_up", float(c.brokers), cluster=name)
            reg.set("messages_in_flight", float(c.outstanding()), cluster=name)
        reg.set_info("cluster_state", states)
        stuck = {t: {**st.stuck.to_json(), "retrying": len(st.retry) + st.in_flight}
                 for t, st in self._topics.items() if st.stuck is not None}
        stuck.update(self.exactly_once.held())  # exactly-once topics held back
        brokers = ""
        for t, st in self._topics.items():
            if st.held and t not in stuck:
                # Keyed messages left behind with their partition (holding.py): the topic
                # goes on, but its row says which partitions wait, and for whom.
                brokers = brokers or self.clusters[LOCAL].unreachable_text()
                stuck[t] = holding.row(st, LOCAL, brokers)
        reg.set_info("stuck_topics", stuck)
        reg.set("topics_stuck", float(len(stuck)))  # for alerting (FerryTopicStuck)
