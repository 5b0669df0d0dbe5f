"""Delivery reports: what the producers said about each send. An acknowledged message goes
into its run for the batched delete (leaving.py) and its 201 is signalled at once; a failed
send goes to the retry rules (retries.py). Reports are recorded by the producers' callbacks
inside poll() and handled here, on the same thread, a batch at a time.

``Reports`` is a room object: it is made with what it shares with the loop (``Shared``), the
room objects it hands outcomes to (``Leaving``, ``StuckTopics``, ``Retries``) and the signal
to the HTTP stage; it calls nothing else of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from itertools import repeat
from operator import add, is_not, methodcaller

from confluent_kafka import KafkaError, Message

from agent.buffer import keys
from agent.buffer.store import DeliveredRun
from agent.config import TopicConfig
from agent.forwarder.clusters import Cluster
from agent.forwarder.flight import LOCAL, Flight, Report, flight_of
from agent.forwarder.leaving import Leaving
from agent.forwarder.retries import Retries
from agent.forwarder.shared import Shared
from agent.forwarder.stuck_topics import StuckTopics
from agent.forwarder.topic_state import TopicState
from agent.metrics import Registry
from agent.signals.ack import AckSender

_partition = methodcaller("partition")


class Reports:
    __slots__ = ("_topics", "_clusters", "_registry", "_leaving", "_stuck_topics", "_retries",
                 "_topic_settings", "_ack_signal", "sink")

    def __init__(self, shared: Shared, clusters: Mapping[str, Cluster], registry: Registry,
                 leaving: Leaving, stuck_topics: StuckTopics, retries: Retries,
                 topic_settings: Callable[[str], TopicConfig], ack_signal: AckSender) -> None:
        self._topics = shared.topics
        self._clusters = clusters
        self._registry = registry
        self._leaving = leaving
        self._stuck_topics = stuck_topics
        self._retries = retries
        self._topic_settings = topic_settings
        self._ack_signal = ack_signal  # tells the HTTP stage what was acknowledged (201s)
        # One list for the forwarder's life: every Flight sent to the local cluster holds it
        # as its on_delivery's sink (flight.py), and the sends' partials of on_delivery
        # append to it too. The loop reads nothing of it but this name.
        self.sink: list[Report] = []

    def on_delivery(self, f: Flight, cluster: str, err: KafkaError | None, msg: Message) -> None:
        # Runs inside poll() on this thread: just record; handle() does the work.
        self.sink.append((f, cluster, err, msg))

    def handle(self) -> bool:
        """The reports recorded since the last call: acknowledged messages into their runs
        for the batched delete (and their 201s signalled), failed sends to the retry rules.
        True if there were any."""
        worked = False
        purge: set[tuple[str, str]] = set()
        acked_ids: list[bytes] = []  # ids (or topic NUL id handles) a cluster acknowledged
        for topic, st in [(t, st) for t, st in self._topics.items() if st.sink]:
            self._handle_sink_reports(topic, st, purge, acked_ids)
            worked = True
        if self.sink:
            self._handle_flight_reports(purge, acked_ids)
            worked = True
        if acked_ids:
            self._signal_acknowledged(acked_ids)
        for cluster, acks in purge:
            # Keep per-key order: messages still queued behind a failed one would otherwise
            # reach Kafka as soon as it answers again, ahead of the failed one's retry.
            # Failing them now puts them in their topic's retry queue, re-sent in id order.
            self._clusters[cluster].purge_queued(acks)
        return worked

    def _signal_acknowledged(self, acked: list[bytes]) -> None:
        """The one place that tells the HTTP stage which messages a cluster acknowledged:
        201s waiting for these are answered now (agent/signals/ack.py), whether or not the
        buffer's delete has committed yet. Called once the reports' outcomes are recorded."""
        self._ack_signal.send(acked)

    def pending(self) -> bool:
        """Whether reports are recorded and not handled yet."""
        return bool(self.sink) or any(st.sink for st in self._topics.values())

    def _handle_sink_reports(self, topic: str, st: TopicState,
                             purge: set[tuple[str, str]], acked_ids: list[bytes]) -> None:
        """The reports of ``topic``'s common-path sends (_send_values), all to the local
        cluster. An acknowledged message goes into its run for the batched delete straight
        from the report, columns at a time; only a failed one becomes a Flight, and then
        follows the same rules as any other (retry, discard, purge)."""
        # Copied, not swapped: the callbacks of the sends in flight hold this very list.
        entries = st.sink[:]
        st.sink.clear()
        st.sending -= len(entries)
        now = time.monotonic()
        leaving = self._leaving
        runs = leaving.delivered_runs(now)
        run = runs.get((topic, LOCAL))
        if run is None:
            run = runs[(topic, LOCAL)] = DeliveredRun(topic, LOCAL)
        mids, values, sents, errs, msgs = zip(*entries, strict=True)
        # Stored bytes, as read() counts them: the handle (topic NUL id) and the value.
        base = len(topic) + 1
        # By identity: a KafkaError refuses to be compared with None (tuple.count fails).
        if not any(map(is_not, errs, repeat(None))):
            # map() where it can be: C calls, no Python code per message. A delivered
            # message always has its partition; its offset may be unknown (None).
            run.ids += mids
            acked_ids += mids
            run.sizes += map(add, repeat(base + keys.ID_LEN), map(len, values))
            run.partitions += map(_partition, msgs)
            run.offsets += [m.offset() or 0 for m in msgs]
            delivered = len(entries)
        else:
            delivered = 0
            settings = self._topic_settings(topic)
            for mid, v, sent, err, msg in entries:
                if err is None:
                    run.ids.append(mid)
                    acked_ids.append(mid)
                    run.sizes.append(base + len(mid) + len(v))
                    run.partitions.append(msg.partition() or 0)
                    run.offsets.append(msg.offset() or 0)
                    delivered += 1
                    continue
                f = flight_of(topic, mid, v, settings, self.sink)
                f.sent_local_at = sent
                self._retries.report_failed(f, LOCAL, err, purge)
        if delivered:
            leaving.count_delivered(delivered)
            if st.stuck is not None:
                self._stuck_topics.unstuck(topic, st)
            # A sample is enough for the latency histogram.
            for i in range(0, len(entries), 64):
                if errs[i] is None:
                    self._registry.observe("produce_latency_seconds", now - sents[i],
                                           cluster=LOCAL)
            self._clusters[LOCAL].health.acknowledged()

    def _handle_flight_reports(self, purge: set[tuple[str, str]],
                               acked_ids: list[bytes]) -> None:
        # Copied, not swapped: the Flights in flight keep appending to this very list.
        reports = self.sink[:]
        self.sink.clear()
        now = time.monotonic()
        acked: set[str] = set()
        topics = self._topics
        leaving = self._leaving
        runs = leaving.delivered_runs(now)
        delivered = 0
        for i, (f, cluster, err, msg) in enumerate(reports):
            f.pending -= 1
            m = f.msg
            topic = m.record.topic
            ts = topics[topic]
            ts.sending -= 1
            if err is None:
                acked.add(cluster)
                if ts.stuck is not None:
                    self._stuck_topics.unstuck(topic, ts)
                if not i & 63:  # a sample is enough for the latency histogram
                    sent = f.sent_local_at if cluster == LOCAL else f.sent_remote_at
                    if sent:
                        self._registry.observe("produce_latency_seconds", now - sent,
                                               cluster=cluster)
                if f.done:
                    self._registry.inc("messages_duplicate_acks", topic=topic, cluster=cluster)
                    continue
                f.done = True
                run = runs.get((topic, cluster))
                if run is None:
                    run = runs[(topic, cluster)] = DeliveredRun(topic, cluster)
                run.ids.append(m.id)
                run.sizes.append(m.stored_bytes)
                run.partitions.append(msg.partition() or 0)
                run.offsets.append(msg.offset() or 0)
                acked_ids.append(m.id)
                delivered += 1
                continue
            if f.done:
                continue
            self._retries.report_failed(f, cluster, err, purge)
        leaving.count_delivered(delivered)
        for cluster in acked:
            self._clusters[cluster].health.acknowledged()
