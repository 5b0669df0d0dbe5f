"""Delivery reports: what the producers said about each send. An acknowledged message goes
into its run for the batched delete (leaving.py) and its 201 is signalled at once; a failed
send goes to the retry rules (retries.py). Reports are recorded by the producers' callbacks
inside poll() and handled here, on the same thread, a batch at a time.
"""

from __future__ import annotations

import time
from itertools import repeat
from operator import add, is_not, methodcaller

from confluent_kafka import KafkaError, Message

from agent.buffer import keys
from agent.buffer.store import DeliveredRun
from agent.forwarder.flight import LOCAL, Flight
from agent.forwarder.loop_state import LoopState
from agent.forwarder.topic_state import TopicState

_partition = methodcaller("partition")


class Reports(LoopState):
    def _on_delivery(self, f: Flight, cluster: str, err: KafkaError | None, msg: Message) -> None:
        # Runs inside poll() on this thread: just record; _handle_reports does the work.
        self._reports.append((f, cluster, err, msg))

    def _handle_reports(self) -> bool:
        worked = False
        purge: set[tuple[str, str]] = set()
        acked_ids: list[bytes] = []  # ids (or topic NUL id handles) a cluster acknowledged
        for topic, st in [(t, st) for t, st in self._topics.items() if st.sink]:
            self._handle_sink_reports(topic, st, purge, acked_ids)
            worked = True
        if self._reports:
            self._handle_flight_reports(purge, acked_ids)
            worked = True
        if acked_ids:
            self._signal_acknowledged(acked_ids)
        for cluster, acks in purge:
            # Keep per-key order: messages still queued behind a failed one would otherwise
            # reach Kafka as soon as it answers again, ahead of the failed one's retry.
            # Failing them now puts them in their topic's retry queue, re-sent in id order.
            self.clusters[cluster].purge_queued(acks)
        return worked

    def _signal_acknowledged(self, acked: list[bytes]) -> None:
        """The one place that tells the HTTP stage which messages a cluster acknowledged:
        201s waiting for these are answered now (agent/signals/ack.py), whether or not the
        buffer's delete has committed yet. Called once the reports' outcomes are recorded."""
        self._ack_signal.send(acked)

    def _has_reports(self) -> bool:
        return bool(self._reports) or any(st.sink for st in self._topics.values())

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
        leaving = self.leaving
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
            settings = self.topic_settings(topic)
            for mid, v, sent, err, msg in entries:
                if err is None:
                    run.ids.append(mid)
                    acked_ids.append(mid)
                    run.sizes.append(base + len(mid) + len(v))
                    run.partitions.append(msg.partition() or 0)
                    run.offsets.append(msg.offset() or 0)
                    delivered += 1
                    continue
                f = self._flight(topic, mid, v, settings)
                f.sent_local_at = sent
                self.retries.report_failed(f, LOCAL, err, purge)
        if delivered:
            leaving.count_delivered(delivered)
            if st.stuck is not None:
                self.stuck_topics.unstuck(topic, st)
            # A sample is enough for the latency histogram.
            for i in range(0, len(entries), 64):
                if errs[i] is None:
                    self.registry.observe("produce_latency_seconds", now - sents[i],
                                          cluster=LOCAL)
            self.clusters[LOCAL].health.acknowledged()

    def _handle_flight_reports(self, purge: set[tuple[str, str]],
                               acked_ids: list[bytes]) -> None:
        # Copied, not swapped: the Flights in flight keep appending to this very list.
        reports = self._reports[:]
        self._reports.clear()
        now = time.monotonic()
        acked: set[str] = set()
        topics = self._topics
        leaving = self.leaving
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
                    self.stuck_topics.unstuck(topic, ts)
                if not i & 63:  # a sample is enough for the latency histogram
                    sent = f.sent_local_at if cluster == LOCAL else f.sent_remote_at
                    if sent:
                        self.registry.observe("produce_latency_seconds", now - sent,
                                              cluster=cluster)
                if f.done:
                    self.registry.inc("messages_duplicate_acks", topic=topic, cluster=cluster)
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
            self.retries.report_failed(f, cluster, err, purge)
        leaving.count_delivered(delivered)
        for cluster in acked:
            self.clusters[cluster].health.acknowledged()
