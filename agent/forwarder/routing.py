"""Cluster choice: a message goes to the local cluster; a topic with fallback_to_remote goes
to the remote one when the local cluster is found down (health.py), and is also sent there
speculatively when the local send is not acknowledged in speculative_send_delay_ms (Hermes'
fallback). Only a cluster found down sends traffic away, never idleness.
"""

from __future__ import annotations

from typing import Any

from agent.config import TopicConfig
from agent.forwarder.flight import LOCAL, REMOTE, Flight
from agent.forwarder.loop_state import LoopState


class Routing(LoopState):
    def _direct_route(self, topic: str, settings: TopicConfig) -> tuple[Any, Any] | None:
        """(producer, layout) when a batch of ``topic`` simply goes to the local cluster."""
        local = self.clusters[LOCAL]
        if settings.fallback_to_remote and REMOTE in self.clusters:
            return None
        layout = local.layout(topic)
        if layout is None:
            return None
        return local.producer(settings.acks, local.batch(topic)), layout

    def _layout_known(self, topic: str) -> bool:
        local = self.clusters[LOCAL]
        if local.layout(topic) is not None or local.known_missing(topic):
            return True
        remote = self.clusters.get(REMOTE)
        if local.down and remote is not None:
            return remote.layout(topic) is not None or remote.known_missing(topic)
        return False

    def _send(self, f: Flight, now: float) -> None:
        local = self.clusters[LOCAL]
        remote = self.clusters.get(REMOTE)
        fallback = f.settings.fallback_to_remote and remote is not None
        # Only a cluster found down (health.py) sends traffic away: never idleness.
        if fallback and remote is not None and local.down and remote.up:
            if self._produce(f, REMOTE) is None:
                self._schedule_retry(f, 0.05)
            return
        sent = self._produce(f, LOCAL)
        if sent is None:
            self._schedule_retry(f, 0.05)
        elif sent and fallback:
            delay = f.settings.speculative_send_delay_ms / 1000.0
            self._speculative.append((now + delay, f))

    def _due_speculative(self, now: float) -> bool:
        worked = False
        remote = self.clusters.get(REMOTE)
        while self._speculative and self._speculative[0][0] <= now:
            _, f = self._speculative.popleft()
            if f.done or f.sent_remote or remote is None:
                continue
            if f.msg.generation < self._generations.get(f.msg.topic, 0):
                continue  # the topic was deleted meanwhile: only the local send's answer counts
            worked = True
            if self._produce(f, REMOTE) is None:
                self._speculative.append((now + 0.02, f))  # remote partitions not known yet
        return worked
