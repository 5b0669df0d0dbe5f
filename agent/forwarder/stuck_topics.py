"""Topics that cannot deliver: flagged (stuck.py) when a send fails with an error that is
retried, or when their partitions cannot be learnt, and shown on their row and in health
until their next acknowledgement. Never a reason to discard.

``StuckTopics`` keeps no state of its own: what it flags is each topic's ``stuck`` (its
``TopicState``, in ``Shared.topics``), and its rate-limited warnings share the loop's one
``LogLimit`` with the cluster watch (``Shared.limited``).
"""

from __future__ import annotations

import time

from agent.forwarder.clusters import Cluster
from agent.forwarder.flight import LOCAL
from agent.forwarder.shared import Shared, log
from agent.forwarder.stuck import Stuck
from agent.forwarder.topic_state import TopicState

# What to do about each Kafka error (retry or discard, and why): agent/forwarder/failures.py.
# The error a topic is stuck on while its partitions cannot be learnt (no send to fail).
NO_PARTITIONS = "NO_PARTITIONS"


class StuckTopics:
    def __init__(self, shared: Shared, clusters: dict[str, Cluster]) -> None:
        self._topics = shared.topics
        self._limited = shared.limited
        self._clusters = clusters

    def stuck(self, topic: str, code: str, cluster: str, error: str, operator: bool) -> None:
        """A send of ``topic`` failed and is retried: the topic is stuck until its next
        acknowledgement, shown on its row and in health (failures.py says how loud)."""
        st = self._topics.setdefault(topic, TopicState())
        if st.stuck is not None:
            st.stuck.again(code, cluster, error, operator)
            return
        st.stuck = Stuck(code, cluster, error, operator)
        if operator:
            # Loud: only a person can fix it (an ACL, a missing topic), and until then the
            # topic's backlog grows. Kept, never discarded for it (docs/design.md).
            self._limited.warning(f"stuck:{topic}", "topic %s cannot be delivered: %s at "
                                  "cluster %s (%s); its messages stay buffered and are retried "
                                  "until ttl_seconds", topic, code, cluster, error)

    def waiting_for_layout(self, topic: str, st: TopicState, now: float,
                           present: bool) -> None:
        """A topic with messages whose partitions cannot be learnt (its cluster unreachable,
        or not answering for it) sends nothing, so no send fails to say why: after
        outage_after_seconds it is stuck on NO_PARTITIONS, with the cluster's state.
        ``present``: the topic has buffered messages, as the reader last scanned."""
        if not st.waiting_since:
            st.waiting_since = now
            return
        local = self._clusters[LOCAL]
        if not present or now - st.waiting_since < local.config.outage_after_seconds:
            return
        h = local.health
        detail = (f"its partitions are not known after {now - st.waiting_since:.0f} s; "
                  f"cluster {LOCAL} is {h.state}" + (f": {h.reason}" if h.reason else ""))
        if st.stuck is None:
            self.stuck(topic, NO_PARTITIONS, LOCAL, detail, False)
        elif st.stuck.error == NO_PARTITIONS:
            # Kept current, not frozen at the moment it began: the cluster's verdict (and its
            # cause, e.g. refused credentials) often comes after the topic began to wait.
            st.stuck.detail = detail

    def unstuck(self, topic: str, st: TopicState) -> None:
        stuck = st.stuck
        st.stuck = None
        if stuck is not None and stuck.operator:
            log.warning("topic %s delivers again after %d failed sends over %.0f s (%s)",
                        topic, stuck.failures, time.time() - stuck.since, stuck.error)
