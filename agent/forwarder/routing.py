"""Cluster choice: a message goes to the local cluster; a topic with fallback_to_remote goes
to the remote one when the local cluster is found down (health.py), and is also sent there
speculatively when the local send is not acknowledged in speculative_send_delay_ms (Hermes'
fallback). Only a cluster found down sends traffic away, never idleness.

``Routing`` decides and keeps the speculative sends' queue; it produces nothing: the loop
hands each send it names to a producer (send.py), so this room calls no other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from agent.config import TopicConfig
from agent.forwarder.clusters import Cluster
from agent.forwarder.flight import LOCAL, REMOTE, Flight

# How soon a speculative send that could not be handed to the remote producer (its
# partitions not known yet, its queue full) is tried again, in seconds.
SPECULATIVE_AGAIN = 0.02


class Routing:
    __slots__ = ("_clusters", "_speculative")

    def __init__(self, clusters: Mapping[str, Cluster]) -> None:
        self._clusters = clusters
        # (when, flight): local sends of fallback topics, to be sent to the remote cluster
        # too when not acknowledged by then; in the order they are due (one delay a topic
        # setting, appended as sent: a later send of another topic with a shorter delay can
        # wait behind one due later, by at most the difference).
        self._speculative: deque[tuple[float, Flight]] = deque()

    def direct(self, topic: str, settings: TopicConfig) -> tuple[Any, Any] | None:
        """(producer, layout) when a batch of ``topic`` simply goes to the local cluster:
        not a fallback topic, its partitions known."""
        local = self._clusters[LOCAL]
        if settings.fallback_to_remote and REMOTE in self._clusters:
            return None
        layout = local.layout(topic)
        if layout is None:
            return None
        return local.producer(settings.acks, local.batch(topic)), layout

    def layout_known(self, topic: str) -> bool:
        """Whether the cluster ``topic`` would go to knows its partitions (or knows it has
        none): until then its messages wait in the buffer."""
        local = self._clusters[LOCAL]
        if local.layout(topic) is not None or local.known_missing(topic):
            return True
        remote = self._clusters.get(REMOTE)
        if local.down and remote is not None:
            return remote.layout(topic) is not None or remote.known_missing(topic)
        return False

    def cluster_for(self, f: Flight) -> str:
        """The cluster ``f`` is sent to first: the remote one only for a fallback topic while
        the local cluster is down and the remote one up."""
        if f.settings.fallback_to_remote:
            remote = self._clusters.get(REMOTE)
            if remote is not None and self._clusters[LOCAL].down and remote.up:
                return REMOTE
        return LOCAL

    def speculate(self, f: Flight, now: float) -> None:
        """``f`` was just sent to the local cluster: for a fallback topic, send it to the
        remote one too if the local one has not acknowledged it in the topic's delay."""
        if f.settings.fallback_to_remote and REMOTE in self._clusters:
            self._speculative.append((now + f.settings.speculative_send_delay_ms / 1000.0, f))

    def again(self, f: Flight, now: float) -> None:
        """A speculative send that could not be handed over yet: try it again shortly."""
        self._speculative.append((now + SPECULATIVE_AGAIN, f))

    def due(self, now: float, generations: Mapping[str, int]) -> list[Flight]:
        """The speculative sends due by ``now`` that are still wanted: not acknowledged or
        failed meanwhile, not already sent to the remote cluster, and of a topic not deleted
        since (only the local send's answer counts then)."""
        queue = self._speculative
        if not queue or queue[0][0] > now:
            return []
        due: list[Flight] = []
        while queue and queue[0][0] <= now:
            _, f = queue.popleft()
            if f.done or f.sent_remote:
                continue
            if f.msg.generation < generations.get(f.msg.topic, 0):
                continue
            due.append(f)
        return due
