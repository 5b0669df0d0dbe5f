"""The send path: building a message and handing it to a producer.

The common case sends from the stored value without decoding it (plain.py): the header is
read and the producer gets slices of the value.

produce() is called positionally, in the order of confluent-kafka's C implementation, not
its documented keywords (about 40% cheaper a call): producing.py owns that order, handing the
hot loop the bound method (``positional``) and every other site a call by name
(``produce``).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from agent.buffer import codec
from agent.buffer.store import Corrupt, StoredMessage, message
from agent.config import TopicConfig
from agent.forwarder import failures, holding, producing, timestamps
from agent.forwarder.flight import LOCAL, REMOTE, Flight, flight_of, value_report
from agent.forwarder.loop_state import LoopState
from agent.forwarder.partitioner import UNASSIGNED, TopicLayout, choose
from agent.forwarder.plain import NOT_PLAIN, plain_values
from agent.forwarder.topic_limits import ALONE
from agent.forwarder.topic_state import TopicState


def stamped(f: Flight) -> tuple[int, timestamps.Headers | None]:
    """The timestamp and headers ``f`` is produced with: its own, or the send time (0 to
    librdkafka) and its own in a header when it is re-stamped (timestamps.py)."""
    r = f.msg.record
    headers: timestamps.Headers | None = list(r.headers) if r.headers else None
    if f.restamp:
        return 0, timestamps.restamp_headers(headers, r.timestamp_ms)
    return r.timestamp_ms, headers


class Sending(LoopState):
    def _send_values(self, topic: str, values: list[tuple[bytes, bytes]], st: TopicState,
                     settings: TopicConfig, gen: int, check_ttl: bool, now_ms: int,
                     producer: Any, layout: TopicLayout, now: float) -> None:
        """The common case, kept tight (it runs once per message): one local cluster, the
        topic's partitions known. Plain messages (``plain_values``) go to the producer as
        slices of their stored value: no Record, StoredMessage or Flight per message (a
        Flight is made only for a send that fails). Anything else goes through
        ``_send_one``, with the same rules as ``_send``."""
        produce = producing.positional(producer)
        sink = st.sink
        has_pk, hash_key = codec.HAS_PARTITION_KEY, codec.HASH_KEY
        round_robin = layout.round_robin
        for_partition_key = layout.for_partition_key
        parts = layout.partitions
        n = len(parts)
        inline = layout.all_available()
        rr = layout.position
        # A partial failure, or messages of a partition left behind (holding.py): keyed
        # messages are looked at one by one; otherwise (the common case) none is.
        held = st.held
        holding_now = bool(held) or bool(layout.reachable)
        keyed = has_pk | hash_key
        sent = 0
        mid = b""
        # Messages older than the topic takes (a long outage) are re-stamped (timestamps.py).
        limits = self.clusters[LOCAL].limits(topic)
        oldest = timestamps.oldest_fresh(limits.before_max_ms if limits else None, now_ms)
        for mid, v, flags, ts, pk, key, value in plain_values(values, gen, check_ttl,
                                                              settings.max_message_bytes,
                                                              oldest):
            if flags == NOT_PLAIN:
                if self._send_one(message(topic, mid, v), st, settings, gen, check_ttl,
                                  now_ms, producer, layout, now, oldest):
                    break  # queued for a retry: the rest of the batch waits behind it
                continue
            if holding_now and flags & keyed:
                waits = holding.partition_to_hold(layout, held, pk if flags & has_pk else None,
                                                  bool(flags & hash_key), key)
                if waits is not None:
                    holding.hold(st, waits, mid)  # left in the buffer, behind the cursor
                    continue
            if flags & has_pk:
                # Bruce's rule (partitioner.py), inline while every partition has a leader.
                partition = parts[(pk & 0xFFFFFFFF) % n] if inline else for_partition_key(pk)
            elif flags & hash_key:
                partition = -1
            elif inline:
                rr = (rr + 1) % n
                partition = parts[rr]
            else:
                partition = round_robin()
            try:
                # Positional, in producing.Positional's order (topic, value, key,
                # partition, on_delivery, None, timestamp): no call of Ferry's per message.
                produce(topic, value, key, partition, partial(value_report, sink, mid, v, now),
                        None, ts)
            except BufferError:
                # The producer's queue is full. This one waits for a retry, and so does the
                # rest of the batch (read again from here later): a later message of the same
                # key must not go out first.
                f = flight_of(topic, mid, v, settings, self.reports.sink)
                st.in_flight += 1
                self.shared.in_flight += 1
                self.retries.schedule(f, 0.05)
                break
            except KafkaException as exc:
                f = flight_of(topic, mid, v, settings, self.reports.sink)
                st.in_flight += 1
                self.shared.in_flight += 1
                self._refused_at_once(f, LOCAL, exc)
                if st.recovering:
                    break  # refused for now and queued for a retry: as above
                continue
            sent += 1
        # Past the last message looked at (sent, discarded, or queued for a retry): set once
        # per batch, nothing in the loop reads it.
        st.cursor = mid
        if inline:
            layout.position = rr
        st.in_flight += sent
        self.shared.in_flight += sent
        st.sending += sent

    def _send_one(self, m: StoredMessage | Corrupt, st: TopicState, settings: TopicConfig,
                  gen: int, check_ttl: bool, now_ms: int, producer: Any,
                  layout: TopicLayout, now: float, oldest: int) -> bool:
        """A message of the common path that needs the general checks (eligibility.py),
        sent with a Flight. True when the rest of its batch must wait (it is queued for a
        retry)."""
        if not self._sendable(m, settings, gen, check_ttl, now_ms):
            return False
        r = m.record
        waits = holding.partition_to_hold(layout, st.held, r.partition_key, r.hash_key, r.key)
        if waits is not None:
            holding.hold(st, waits, m.id)  # left in the buffer, behind the cursor
            return False
        f = Flight(m, settings)
        f.sink = self.reports.sink
        self._restamp_if_stale(f, now_ms, oldest)
        timestamp, headers = stamped(f)
        pk = r.partition_key
        if pk is not None:
            partition = layout.for_partition_key(pk)
        elif r.hash_key:
            partition = -1
        else:
            partition = layout.round_robin()
        st.in_flight += 1
        self.shared.in_flight += 1
        try:
            producing.produce(producer, r.topic, r.value, r.key, partition=partition,
                              on_delivery=f, timestamp=timestamp, headers=headers)
        except BufferError:
            self.retries.schedule(f, 0.05)  # the producer's queue is full: see _send_values
            return True
        except KafkaException as exc:
            self._refused_at_once(f, LOCAL, exc)
            return st.recovering
        f.sent_local_at = now
        f.pending = 1
        st.sending += 1
        return False

    def _send(self, f: Flight, now: float) -> None:
        """Send ``f`` to the cluster routing.py names, and have a fallback topic's local send
        sent to the remote cluster too if it is not acknowledged in time."""
        cluster = self.routing.cluster_for(f)
        sent = self._produce(f, cluster)
        if sent is None:
            self.retries.schedule(f, 0.05)  # cannot be sent right now: see _produce
        elif sent and cluster == LOCAL:
            self.routing.speculate(f, now)

    def _due_speculative(self, now: float) -> bool:
        """Send to the remote cluster the fallback topics' local sends not acknowledged in
        their delay (routing.py)."""
        due = self.routing.due(now, self._generations)
        for f in due:
            if self._produce(f, REMOTE) is None:
                self.routing.again(f, now)  # remote partitions not known yet
        return bool(due)

    def _produce(self, f: Flight, cluster_name: str) -> bool | None:
        """Hand ``f`` to a cluster's producer.

        True: sent. None: cannot be sent right now (partitions not known yet, producer queue
        full); nothing was done and the caller decides when to try again. False: refused and
        already handled as a failure."""
        cluster = self.clusters[cluster_name]
        r = f.msg.record
        layout = cluster.layout(r.topic)
        if layout is None and not cluster.known_missing(r.topic):
            return None  # partitions not known yet: a PartitionKey message must not guess
        partition = choose(layout, r.partition_key, r.hash_key)
        producer = cluster.producer(f.settings.acks,
                                    ALONE if f.alone else cluster.batch(r.topic))
        if not f.restamp:
            limits = cluster.limits(r.topic)
            now_ms = int(time.time() * 1000)
            self._restamp_if_stale(f, now_ms, timestamps.oldest_fresh(
                limits.before_max_ms if limits else None, now_ms))
        timestamp, headers = stamped(f)
        try:
            producing.produce(
                producer,
                r.topic,
                r.value,
                r.key,
                partition=partition if partition != UNASSIGNED else -1,
                on_delivery=partial(self.reports.on_delivery, f, cluster_name),
                timestamp=timestamp,
                headers=headers,
            )
        except BufferError:
            return None
        except KafkaException as exc:
            self._refused_at_once(f, cluster_name, exc)
            return False
        if cluster_name == LOCAL:
            f.sent_local_at = time.monotonic()
        else:
            f.sent_remote = True
            f.sent_remote_at = time.monotonic()
        f.pending += 1
        self._topics.setdefault(r.topic, TopicState()).sending += 1
        return True

    def _restamp_if_stale(self, f: Flight, now_ms: int, oldest: int) -> None:
        """Re-stamp ``f`` when its wait in the buffer took it past its topic's oldest
        timestamp (timestamps.py), and count it once."""
        if not f.restamp and timestamps.waited_too_long(
                f.msg.record.timestamp_ms, f.msg.accepted_ms, now_ms, oldest):
            f.restamp = True
            self.registry.inc("messages_restamped", topic=f.msg.topic)

    def _refused_at_once(self, f: Flight, cluster: str, exc: KafkaException) -> None:
        """produce() refused the message itself (e.g. larger than the producer allows).

        Only Kafka's own verdicts can discard a message; anything else raised here would be
        a bug in Ferry, which must cost a retry, never a message."""
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        code = err.code() if err is not None else None
        if err is not None and (err.fatal() or code == KafkaError._FATAL):
            # A producer in librdkafka's fatal state refuses every produce() this way, and no
            # delivery report will come to say so: start a fresh one.
            self.retries.replace_producer(cluster, f.settings.acks, err)
        # produce() checks the message alone, before any batch: its verdict is final.
        refused = code is not None and failures.refused_alone(code)
        if refused and err is not None:
            self.registry.inc("messages_refused", topic=f.msg.topic, cluster=cluster,
                              error=err.name())
        self.retries.failed(f, cluster, str(exc), permanent=refused,
                            code=err.name() if err is not None else "error",
                            operator=code is not None and failures.needs_operator(code))
