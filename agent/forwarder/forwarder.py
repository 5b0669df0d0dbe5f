"""The forwarder's run loop: buffer -> Kafka, and out of the buffer only once acknowledged.

One thread does everything (read, produce, handle delivery reports, delete), so no locks are
needed around the in-flight table; librdkafka's own threads do the network I/O. A message is
in exactly one of: the buffer only (not read yet), in flight (handed to a producer), waiting
for a retry, or leaving (acknowledged or discarded, waiting for the batched durable delete).

The loop is made of rooms, one file each (loop_state.py lists them); this file holds the
loop itself: its state, one step, the idle wait, and stopping.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from agent.buffer.store import Store
from agent.config import FerryConfig, TopicConfig
from agent.forwarder.cluster_watch import ClusterWatch, count_client_error
from agent.forwarder.clusters import Cluster, producer_config, wait_for_reports
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.flight import LOCAL, REMOTE
from agent.forwarder.leaving import Leaving
from agent.forwarder.loop_state import log
from agent.forwarder.reading import Reading
from agent.forwarder.reports import Reports
from agent.forwarder.retries import Retries
from agent.forwarder.routing import Routing
from agent.forwarder.send import Sending
from agent.forwarder.shared import Shared
from agent.forwarder.stuck_topics import StuckTopics
from agent.forwarder.topic_limits import TopicLimits
from agent.forwarder.transactions import ExactlyOnce
from agent.metrics import REGISTRY, Registry
from agent.signals.ack import AckSender
from agent.signals.ack import socket_path as ack_socket_path
from agent.signals.commit import listen as listen_for_commits
from agent.signals.commit import socket_path as commit_socket_path
from agent.signals.limits import Limit, LimitsPublisher
from agent.signals.limits import file_path as limits_file_path

# The idle loop waits IDLE_WAIT for a delivery report (or a commit) before its next step, and
# QUIET_WAIT once nothing happened for QUIET_AFTER: 500 steps a second, each walking the
# topics and the clusters, cost 6-7 % of a core with nothing to do (an idle agent, or one
# waiting out an outage with its sends in flight for minutes). A commit, and a report of any
# producer of any cluster (within clusters.WAIT_ROUND when there are several), still end the
# wait; what else a step does (retries due after their back-off, the batched delete, gauges,
# the clusters' states) can wait 50 ms.
IDLE_WAIT = 0.002
QUIET_AFTER = 0.5
QUIET_WAIT = 0.05
# How often the start jitter's wait looks whether the agent is stopping.
START_JITTER_POLL = 0.1


class Forwarder(Reading, Sending):
    def __init__(
        self,
        config: FerryConfig,
        store: Store,
        *,
        registry: Registry = REGISTRY,
        discard_log: DiscardLog | None = None,
        topic_settings: Callable[[str], TopicConfig] | None = None,
        clusters: dict[str, Cluster] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        # Tells the HTTP stage that outcomes were recorded (agent/signals/ack.py).
        self._ack_signal = AckSender(ack_socket_path(config.buffer.path))
        # New commits wake the idle loop at once (agent/signals/commit.py).
        self._commits = listen_for_commits(commit_socket_path(config.buffer.path))
        self.registry = registry
        self.discard_log = discard_log or DiscardLog(config.discard_log_path,
                                                     config.buffer.discard_log_max_bytes)
        self.topic_settings = topic_settings or config.topic
        fwd = config.forwarder
        if clusters is None:
            on_error = partial(count_client_error, registry)
            clusters = {LOCAL: Cluster(LOCAL, config.kafka.local, fwd, on_error)}
            if config.kafka.remote is not None:
                clusters[REMOTE] = Cluster(REMOTE, config.kafka.remote, fwd, on_error)
        self.clusters = clusters
        # The local cluster's topic limits, for the intake to refuse what a topic can never
        # take (agent/signals/limits.py). Only the local one: a remote cluster's limits only
        # matter to a message that falls back, which the forwarder's own rules handle.
        self._limits = LimitsPublisher(limits_file_path(config.buffer.path),
                                       _compression(config))
        self._limits.clear()
        clusters[LOCAL].on_limits = self._publish_limits
        self.max_in_flight = fwd.max_in_flight_messages
        self.per_topic_cap = max(1000, self.max_in_flight // 4)
        self.shared = Shared()
        # The same dict, under the name the rooms made of LoopState use (shared.py).
        self._topics = self.shared.topics
        self._generations = {}
        self._next_topic_scan = 0.0
        self._present = set()  # topics with buffered messages, as last scanned
        # Discards, and the batched durable delete of what left (leaving.py).
        self.leaving = Leaving(self.shared, store, registry, self.discard_log,
                               self._ack_signal)
        # Which cluster a message goes to; the speculative sends (routing.py).
        self.routing = Routing(self.clusters)
        # Topics that cannot deliver, shown until they do (stuck_topics.py).
        self.stuck_topics = StuckTopics(self.shared, self.clusters)
        # What a failed send becomes; the retries due (retries.py). It sends through the
        # loop's two send acts (send.py), named here.
        self.retries = Retries(self.shared, self.clusters, registry, self.leaving,
                               self.stuck_topics, backoff_initial=fwd.retry_backoff_ms / 1000.0,
                               backoff_max=fwd.retry_backoff_max_ms / 1000.0,
                               send=self._send, produce=self._produce)
        # The producers' delivery reports (reports.py).
        self.reports = Reports(self.shared, self.clusters, registry, self.leaving,
                               self.stuck_topics, self.retries, self.topic_settings,
                               self._ack_signal)
        # Topics with delivery = "exactly_once" are sent by their own thread (transactions.py)
        # and skipped by this loop.
        self.exactly_once = ExactlyOnce(config, store, registry=registry,
                                        topic_settings=self.topic_settings,
                                        cluster=self.clusters[LOCAL],
                                        discard_log=self.discard_log,
                                        signal=self._ack_signal.send)
        # Each cluster's state, fed with its sends; the gauges (cluster_watch.py).
        self.cluster_watch = ClusterWatch(self.shared, self.clusters, registry,
                                          self.topic_settings, self.exactly_once)

    def start_probing(self) -> None:
        """Every cluster's state from probes, from now on, with or without traffic."""
        for c in self.clusters.values():
            c.start_probing()

    # -- the loop --------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool]) -> None:
        if not self._wait_start_jitter(should_stop):
            self.shutdown()
            return
        self.start_probing()
        self.exactly_once.start()
        last_work = time.monotonic()
        while not should_stop():
            if self.step():
                last_work = time.monotonic()
            else:
                # Idle: wait for delivery reports a moment rather than spin; longer once
                # nothing happened for a while (see QUIET_WAIT).
                quiet = time.monotonic() - last_work >= QUIET_AFTER
                self._wait(QUIET_WAIT if quiet else IDLE_WAIT)
        self.shutdown()

    def _wait_start_jitter(self, should_stop: Callable[[], bool]) -> bool:
        """Wait a random part of ``start_jitter_seconds`` before any Kafka client exists
        (config.py says why). False when told to stop meanwhile."""
        delay = random.uniform(0.0, self.config.forwarder.start_jitter_seconds)
        if delay <= 0:
            return True
        log.info("connecting to Kafka in %.1f s (start_jitter_seconds=%g)",
                 delay, self.config.forwarder.start_jitter_seconds)
        until = time.monotonic() + delay
        while (left := until - time.monotonic()) > 0:
            if should_stop():
                return False
            time.sleep(min(left, START_JITTER_POLL))
        return True

    def step(self) -> bool:
        """One pass: read and send, handle reports, retries and deletes. True if it did work."""
        now = time.monotonic()
        worked = self._read_and_send(now)
        self._poll()
        worked |= self.reports.handle()
        worked |= self.retries.due(now, self._generations)
        worked |= self._due_speculative(now)
        self.cluster_watch.check_health(now)
        if self.leaving.due(now):
            self.shared.in_flight -= self.leaving.flush()
            worked = True
        self.cluster_watch.publish_gauges(now)
        return worked

    def _wait(self, timeout: float) -> None:
        if self._commits is not None and not any(st.sending for st in self._topics.values()):
            # No delivery report to wait for (acknowledged messages waiting for their
            # batched delete wait for nothing): wait for the next commit instead, and read
            # every topic when it comes (agent/signals/commit.py).
            if self._commits.wait(timeout):
                for st in self._topics.values():
                    st.drained_at = 0.0
                # The commit may be of a topic the loop does not hold (new, or dropped once it
                # drained): the next step looks at the buffer's topics, whenever it last did.
                self._next_topic_scan = 0.0
            return
        producers = [p for c in self.clusters.values() for p in c.producers()]
        if not wait_for_reports(producers, timeout):
            time.sleep(timeout)  # nothing to wait on yet; bounded idle pause

    def _poll(self) -> None:
        for c in self.clusters.values():
            c.poll()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Give in-flight messages a moment to be acknowledged, then record what was."""
        deadline = time.monotonic() + timeout
        self.exactly_once.stop(timeout)
        while self.shared.in_flight > 0 and time.monotonic() < deadline:
            self._poll()
            self.reports.handle()
            if self.leaving.waiting():
                self.shared.in_flight -= self.leaving.flush()
            if not self.reports.pending():
                self._wait(0.01)
        self.reports.handle()
        if self.leaving.waiting():
            self.shared.in_flight -= self.leaving.flush()
        for c in self.clusters.values():
            c.close(0.5)
        if self._commits is not None:
            self._commits.close()

    def _publish_limits(self, limits: dict[str, TopicLimits]) -> None:
        self._limits.publish({t: Limit(lim.max_message_bytes, lim.before_max_ms,
                                       lim.after_max_ms) for t, lim in limits.items()})

    def topic_count(self) -> int:
        """Topics whose state the loop keeps, and walks on every step: those with buffered
        messages, or with anything in flight, retried, leaving or stuck (topic_state.py)."""
        return len(self._topics)

    def stats(self) -> dict[str, Any]:
        return {"in_flight": self.shared.in_flight,
                "retries": sum(len(s.retry) for s in self._topics.values()),
                "topics": {t: s.in_flight for t, s in self._topics.items()}}


def _compression(config: FerryConfig) -> str:
    """The codec the local cluster's producers compress with: forwarder.compression, unless
    the cluster's librdkafka properties set it (either name; the last one set wins, as
    librdkafka applies them in order)."""
    conf = producer_config(LOCAL, "all", config.kafka.local, config.forwarder)
    codec = "none"
    for name, value in conf.items():
        if name in ("compression.type", "compression.codec"):
            codec = str(value)
    return codec
