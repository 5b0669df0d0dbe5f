"""The forwarder's run loop: buffer -> Kafka, and out of the buffer only once acknowledged.

One thread does everything (read, produce, handle delivery reports, delete), so no locks are
needed around the in-flight table; librdkafka's own threads do the network I/O. A message is
in exactly one of: the buffer only (not read yet), in flight (handed to a producer), waiting
for a retry, or leaving (acknowledged or discarded, waiting for the batched durable delete).

Per topic, the loop reads in FIFO order after a cursor; after a restart the cursors start at
the head again, so everything not deleted is sent again (at-least-once).
"""

from __future__ import annotations

import bisect
import logging
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import add, is_not, methodcaller
from typing import Any, TypeGuard

from confluent_kafka import KafkaError, KafkaException, Message

from agent.ack_signal import AckSender
from agent.ack_signal import socket_path as ack_socket_path
from agent.buffer import codec, keys
from agent.buffer.store import (
    Corrupt,
    DeliveredRun,
    Outcome,
    Store,
    StoredMessage,
    message,
    messages,
)
from agent.commit_signal import listen as listen_for_commits
from agent.commit_signal import socket_path as commit_socket_path
from agent.config import FerryConfig, TopicConfig
from agent.forwarder import failures
from agent.forwarder.clusters import Cluster
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.forwarder.health import Change
from agent.forwarder.partitioner import UNASSIGNED, TopicLayout, choose
from agent.forwarder.stuck import Stuck
from agent.forwarder.transactions import ExactlyOnce
from agent.log_limit import LogLimit
from agent.metrics import REGISTRY, Registry

log = logging.getLogger(__name__)

LOCAL = "local"
REMOTE = "remote"

# What to do about each Kafka error (retry or discard, and why): agent/forwarder/failures.py.
# The error a topic is stuck on while its partitions cannot be learnt (no send to fail).
NO_PARTITIONS = "NO_PARTITIONS"


# Errors after which an idempotent producer is rebuilt (at most every REPLACE_INTERVAL s).
STALE_PRODUCER = {
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError._MSG_TIMED_OUT,
}
REPLACE_INTERVAL = 5.0
# Most expired messages one step discards from a topic it cannot send to (_expire_head).
EXPIRE_PER_STEP = 2000
# While the discard log refuses lines (disk full, or at buffer.discard_log_max_bytes), the
# discarded messages wait in memory (and in the buffer); beyond this many, no new messages
# are read until they can leave, so memory stays bounded. Deliveries go on meanwhile.
MAX_HELD_DISCARDS = 20_000
# Acknowledged and discarded messages leave the buffer in one fsynced transaction per this
# many seconds or DELETE_BATCH_MESSAGES, whichever comes first. Nothing waits on the delete
# (a 201 is signalled at the delivery report, the space it frees is not needed within
# milliseconds), and each commit costs an fsync and holds the LMDB write lock the intake
# needs: at a few thousand 201s a second, 20 ms rather than 2 ms cut the forwarder's CPU per
# message by about a quarter (docs/design.md). A crash re-sends what was acknowledged but not
# yet deleted, as it always could (at-least-once).
DELETE_BATCH_SECONDS = 0.02
DELETE_BATCH_MESSAGES = 2000
# After a failed delete (disk trouble), or a refused discard-log write, try again this late.
DELETE_RETRY_SECONDS = 0.5
DISCARD_LOG_RETRY_SECONDS = 1.0


@dataclass(slots=True, eq=False)
class Flight:
    msg: StoredMessage
    settings: TopicConfig
    attempts: int = 0
    pending: int = 0  # produce() calls not yet reported
    sent_local_at: float | None = None
    sent_remote: bool = False
    sent_remote_at: float = 0.0
    done: bool = False
    last_error: str = ""
    # Where a local send's delivery report goes: the Flight itself is the on_delivery callback
    # of the common path, which saves a partial per message.
    sink: list[_Report] | None = None

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        # Runs inside poll() on the forwarder's thread: just record; _handle_reports works.
        assert self.sink is not None
        self.sink.append((self, LOCAL, err, msg))


_Report = tuple[Flight, str, KafkaError | None, Message]
_partition = methodcaller("partition")
# A report of the common path (_send_values): message id, its stored value, when it was sent,
# then the producer's (err, msg). No Flight exists for such a send until it fails.
_ValueReport = tuple[bytes, bytes, float, KafkaError | None, Message]


def _value_report(sink: list[_ValueReport], mid: bytes, value: bytes, sent: float,
                  err: KafkaError | None, msg: Message) -> None:
    # The on_delivery of a common-path send, bound per message by a partial (the cheapest
    # callable that carries the message: no object of Ferry's per send). Runs inside poll()
    # on the forwarder's thread: just record; _handle_reports does the work.
    sink.append((mid, value, sent, err, msg))


@dataclass(slots=True)
class _TopicState:
    cursor: bytes | None = None
    in_flight: int = 0
    drained_at: float = 0.0
    expiry_check_at: float = 0.0
    retry: list[Flight] = field(default_factory=list)  # waiting to be re-sent, in id order
    retry_at: float = 0.0
    sending: int = 0  # produce() calls of this topic not yet reported
    # Set when a send of the topic is scheduled again; new messages are read only once every
    # retry has been re-sent and every send of the topic has reported (_schedule_retry).
    recovering: bool = False
    # Sends failing with an error that is retried, none acknowledged since (stuck.py).
    stuck: Stuck | None = None
    waiting_since: float = 0.0  # partitions unknown since (monotonic; 0: known)
    # Reports of the topic's common-path sends (_value_report).
    sink: list[_ValueReport] = field(default_factory=list)


class _Trouble:
    """A step that fails again and again (a delete on a full disk, a discard log that
    refuses lines), logged when it starts failing and when it works again, with counts:
    not at every attempt (the issue saw 23 lines a second)."""

    def __init__(self, what: str, registry: Registry, sample: str) -> None:
        self.what = what
        self.registry = registry
        self.sample = sample
        self.since = 0.0  # 0: working
        self.attempts = 0

    def failed(self, exc: BaseException, waiting: int, then: str) -> None:
        self.attempts += 1
        if self.since:
            return
        self.since = time.monotonic()
        log.error("%s failed: %s; %d messages wait in the buffer, %s (logged again once "
                  "it works)", self.what, exc, waiting, then)
        self.registry.sample("error", self.sample, {"detail": f"{self.what}: {exc}",
                                                    "messages": waiting})

    def worked(self, done: int) -> None:
        if not self.since:
            return
        log.warning("%s works again after %d failed attempts over %.1f s (%d messages now)",
                    self.what, self.attempts, time.monotonic() - self.since, done)
        self.since = 0.0
        self.attempts = 0


@dataclass
class _Leaving:
    """What waits for the next batched durable delete. Acknowledged messages, the common
    case, go in ``runs`` (lists per topic and cluster, no object per message); discards
    as ``outcomes`` (with their ``flights`` and ``discards``, index for index)."""

    outcomes: list[Outcome] = field(default_factory=list)
    flights: list[Flight | None] = field(default_factory=list)
    discards: list[Discard] = field(default_factory=list)
    runs: dict[tuple[str, str], DeliveredRun] = field(default_factory=dict)
    delivered: int = 0  # messages in runs
    since: float = 0.0
    logged: int = 0  # discards[:logged] are in the discard log already
    retry_at: float = 0.0  # after a failed delete: not before then

    def __len__(self) -> int:
        return len(self.outcomes) + self.delivered


class Forwarder:
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
        # Tells the HTTP stage that outcomes were recorded (agent/ack_signal.py).
        self._ack_signal = AckSender(ack_socket_path(config.buffer.path))
        # New commits wake the idle loop at once (agent/commit_signal.py).
        self._commits = listen_for_commits(commit_socket_path(config.buffer.path))
        self.registry = registry
        self.discard_log = discard_log or DiscardLog(config.discard_log_path,
                                                     config.buffer.discard_log_max_bytes)
        self.topic_settings = topic_settings or config.topic
        fwd = config.forwarder
        if clusters is None:
            clusters = {LOCAL: Cluster(LOCAL, config.kafka.local, fwd, self._client_error)}
            if config.kafka.remote is not None:
                clusters[REMOTE] = Cluster(REMOTE, config.kafka.remote, fwd, self._client_error)
        self.clusters = clusters
        self.max_in_flight = fwd.max_in_flight_messages
        self.per_topic_cap = max(1000, self.max_in_flight // 4)
        self.backoff_initial = fwd.retry_backoff_ms / 1000.0
        self.backoff_max = fwd.retry_backoff_max_ms / 1000.0
        self._topics: dict[str, _TopicState] = {}
        self._in_flight = 0
        # One list for the forwarder's life: every local Flight in flight holds it as its sink.
        self._reports: list[_Report] = []
        self._retry_topics: set[str] = set()
        self._speculative: deque[tuple[float, Flight]] = deque()
        self._leaving = _Leaving()
        self._generations: dict[str, int] = {}
        self._next_topic_scan = 0.0
        self._present: set[str] = set()  # topics with buffered messages, as last scanned
        self._next_gauges = 0.0
        self._parked = 0  # local sends of topics the local cluster says do not exist
        self._next_parked = 0.0
        self._replaced: dict[tuple[str, str], float] = {}
        self._delete_trouble = _Trouble("removing messages from the buffer", registry,
                                        "buffer_delete")
        self._log_trouble = _Trouble("writing the discard log", registry, "discard_log")
        self._log_retry_at = 0.0
        # Cluster state changes and stuck topics can repeat for hours: a line a minute each.
        self._limited = LogLimit(log)
        # Topics with delivery = "exactly_once" are sent by their own thread (transactions.py)
        # and skipped by this loop.
        self.exactly_once = ExactlyOnce(config, store, registry=registry,
                                        topic_settings=self.topic_settings,
                                        cluster=self.clusters[LOCAL],
                                        discard_log=self.discard_log,
                                        signal=self._ack_signal.send)

    def start_probing(self) -> None:
        """Every cluster's state from probes, from now on, with or without traffic."""
        for c in self.clusters.values():
            c.start_probing()

    # -- the loop --------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool]) -> None:
        self.start_probing()
        self.exactly_once.start()
        while not should_stop():
            if not self.step():
                # Idle: wait for delivery reports a moment rather than spin.
                self._wait(0.002)
        self.shutdown()

    def step(self) -> bool:
        """One pass: read and send, handle reports, retries and deletes. True if it did work."""
        now = time.monotonic()
        worked = self._read_and_send(now)
        self._poll()
        worked |= self._handle_reports()
        worked |= self._due_retries(now)
        worked |= self._due_speculative(now)
        self._check_health(now)
        lv = self._leaving
        n = len(lv)
        if n and now >= lv.retry_at and (n >= DELETE_BATCH_MESSAGES
                                         or now - lv.since >= DELETE_BATCH_SECONDS):
            self._flush_leaving()
            worked = True
        if now >= self._next_gauges:
            self._gauges()
            self._next_gauges = now + 0.5
        return worked

    def _wait(self, timeout: float) -> None:
        if self._commits is not None and not any(st.sending for st in self._topics.values()):
            # No delivery report to wait for (acknowledged messages waiting for their
            # batched delete wait for nothing): wait for the next commit instead, and read
            # every topic when it comes (agent/commit_signal.py).
            if self._commits.wait(timeout):
                for st in self._topics.values():
                    st.drained_at = 0.0
            return
        if not any(c.wait(timeout) for c in self.clusters.values()):
            time.sleep(timeout)  # nothing to wait on yet; bounded idle pause

    def _poll(self) -> None:
        for c in self.clusters.values():
            c.poll()

    # -- reading ---------------------------------------------------------------------------
    def _read_and_send(self, now: float) -> bool:
        lv = self._leaving
        if len(lv.discards) - lv.logged >= MAX_HELD_DISCARDS:
            return False  # the discard log refuses lines: hold no more (see the constant)
        if now >= self._next_topic_scan:
            present = self.store.topics()
            for t in present:
                self._topics.setdefault(t, _TopicState())
            self._present = set(present)
            self._generations = self.store.generations()
            self._next_topic_scan = now + 0.01
        worked = False
        for topic, st in self._topics.items():
            if self.exactly_once.owns(topic):
                continue  # sent in transactions by self.exactly_once
            room = min(self.per_topic_cap - st.in_flight, self.max_in_flight - self._in_flight)
            if st.recovering:
                if st.retry or st.sending:
                    continue
                st.recovering = False  # everything re-sent has been acknowledged (or left)
            if room <= 0:
                continue
            if st.drained_at and now - st.drained_at < 0.001:
                continue
            if not self._layout_known(topic):
                # Partitions being looked up (or the cluster is unreachable): the messages
                # wait in the buffer, but the TTL still applies to them.
                worked |= self._expire_head(topic, st, now)
                self._waiting_for_layout(topic, st, now)
                continue
            if st.waiting_since:
                st.waiting_since = 0.0
                if st.stuck is not None and st.stuck.error == NO_PARTITIONS:
                    self._unstuck(topic, st)
            values = self.store.read_values(topic, st.cursor, min(room, 2000))
            if not values:
                st.drained_at = now
                continue
            st.drained_at = 0.0
            worked = True
            settings = self.topic_settings(topic)
            ttl_ms = settings.ttl_seconds * 1000
            gen = self._generations.get(topic, 0)
            now_ms = int(time.time() * 1000)
            # Messages are in acceptance order: if the newest one read is older than the TTL,
            # the check is needed per message; if the oldest one is younger, for none.
            check_ttl = now_ms - keys.id_timestamp_ms(values[0][0]) > ttl_ms
            max_size = settings.max_message_bytes
            direct = self._direct_route(topic, settings)
            if direct is not None:
                # The common case sends from the undecoded values (no object per message).
                self._send_values(topic, values, st, settings, gen, check_ttl, now_ms, ttl_ms,
                                  direct[0], direct[1], now)
                continue
            for m in messages(topic, values):
                st.cursor = m.id
                if not self._sendable(m, settings, gen, max_size, check_ttl, now_ms, ttl_ms):
                    continue
                st.in_flight += 1
                self._in_flight += 1
                self._send(Flight(m, settings), now)
                if st.recovering:
                    break  # it is queued for a retry: the rest of the batch waits behind it
        return worked

    def _sendable(self, m: StoredMessage | Corrupt, settings: TopicConfig, gen: int,
                  max_size: int, check_ttl: bool, now_ms: int, ttl_ms: int
                  ) -> TypeGuard[StoredMessage]:
        """False when ``m`` must not be sent (and was discarded, with its reason)."""
        if isinstance(m, Corrupt):
            self._discard_corrupt(m)
            return False
        if m.generation < gen:
            self._discard(Flight(m, settings), "generation",
                          "the topic was deleted after this message was accepted")
            return False
        r = m.record
        if len(r.value) + (len(r.key) if r.key else 0) > max_size:
            # Sources that cannot refuse at once (spool files) let these through.
            self._discard(Flight(m, settings), "too_large",
                          f"{r.size} bytes > max_message_bytes={settings.max_message_bytes}")
            return False
        if check_ttl and now_ms - m.accepted_ms > ttl_ms:
            self._discard(Flight(m, settings), "ttl",
                          f"older than ttl_seconds={settings.ttl_seconds}")
            return False
        return True

    def _send_values(self, topic: str, values: list[tuple[bytes, bytes]], st: _TopicState,
                     settings: TopicConfig, gen: int, check_ttl: bool, now_ms: int,
                     ttl_ms: int, producer: Any, layout: TopicLayout, now: float) -> None:
        """The common case, kept tight (it runs once per message): one local cluster, the
        topic's partitions known. The header of each stored value is read here and the
        producer gets slices of it: no Record, StoredMessage or Flight per message (a Flight
        is made only for a send that fails). Anything but a plain message (headers, an
        older generation, a TTL or size to check, a value that does not decode) goes
        through ``_send_one``, with the same rules as ``_send``. The exactly-once thread
        has the same loop (transactions.py, ``ExactlyOnce._send_values``): a change to what
        counts as plain belongs in both."""
        produce = producer.produce
        sink = st.sink
        unpack = codec.HEADER.unpack_from
        hsize = codec.HEADER.size
        version_now = codec.VERSION
        has_key, has_pk, hash_key = codec.HAS_KEY, codec.HAS_PARTITION_KEY, codec.HASH_KEY
        # Stored value = header + key + value: more than this and key + value may be too large.
        max_plain = settings.max_message_bytes + hsize
        round_robin = layout.round_robin
        for_partition_key = layout.for_partition_key
        parts = layout.partitions
        n = len(parts)
        inline = layout.all_available()
        rr = layout.position
        sent = 0
        mid = b""
        for mid, v in values:
            try:
                version, flags, g, ts, pk, klen, nheaders = unpack(v)
            except struct.error:  # shorter than a header: _send_one discards it as corrupt
                version = klen = nheaders = -1
            pos = hsize + klen
            if (version != version_now or nheaders or g < gen or check_ttl
                    or pos > len(v) or len(v) > max_plain):
                if self._send_one(message(topic, mid, v), st, settings, gen, check_ttl,
                                  now_ms, ttl_ms, produce, layout, now):
                    break  # queued for a retry: the rest of the batch waits behind it
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
                # Positional, in the order of confluent-kafka's produce() (topic, value, key,
                # partition, callback, on_delivery, timestamp): parsing keywords cost more
                # than any other step of this loop (tests/forwarder/test_send_path.py checks
                # every field arrives).
                produce(topic, v[pos:], v[hsize:pos] if flags & has_key else None, partition,
                        partial(_value_report, sink, mid, v, now), None, ts)
            except BufferError:
                # The producer's queue is full. This one waits for a retry, and so does the
                # rest of the batch (read again from here later): a later message of the same
                # key must not go out first.
                f = self._flight(topic, mid, v, settings)
                st.in_flight += 1
                self._in_flight += 1
                self._schedule_retry(f, 0.05)
                break
            except KafkaException as exc:
                f = self._flight(topic, mid, v, settings)
                st.in_flight += 1
                self._in_flight += 1
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
        self._in_flight += sent
        st.sending += sent

    def _flight(self, topic: str, mid: bytes, value: bytes, settings: TopicConfig) -> Flight:
        """The Flight of a common-path message that needs one (its send failed): decoded
        again from its stored value, which decoded when it was sent."""
        m = message(topic, mid, value)
        assert isinstance(m, StoredMessage)
        f = Flight(m, settings)
        f.sink = self._reports
        return f

    def _send_one(self, m: StoredMessage | Corrupt, st: _TopicState, settings: TopicConfig,
                  gen: int, check_ttl: bool, now_ms: int, ttl_ms: int, produce: Any,
                  layout: TopicLayout, now: float) -> bool:
        """A message of the common path that needs the general checks, sent with a Flight.
        True when the rest of its batch must wait (it is queued for a retry)."""
        if not self._sendable(m, settings, gen, settings.max_message_bytes, check_ttl, now_ms,
                              ttl_ms):
            return False
        r = m.record
        f = Flight(m, settings)
        f.sink = self._reports
        pk = r.partition_key
        if pk is not None:
            partition = layout.for_partition_key(pk)
        elif r.hash_key:
            partition = -1
        else:
            partition = layout.round_robin()
        st.in_flight += 1
        self._in_flight += 1
        try:
            produce(r.topic, r.value, r.key, partition=partition, timestamp=r.timestamp_ms,
                    headers=list(r.headers) if r.headers else None, on_delivery=f)
        except BufferError:
            self._schedule_retry(f, 0.05)  # the producer's queue is full: see _send_values
            return True
        except KafkaException as exc:
            self._refused_at_once(f, LOCAL, exc)
            return st.recovering
        f.sent_local_at = now
        f.pending = 1
        st.sending += 1
        return False

    def _direct_route(self, topic: str, settings: TopicConfig) -> tuple[Any, Any] | None:
        """(producer, layout) when a batch of ``topic`` simply goes to the local cluster."""
        local = self.clusters[LOCAL]
        if settings.fallback_to_remote and REMOTE in self.clusters:
            return None
        layout = local.layout(topic)
        if layout is None:
            return None
        return local.producer(settings.acks), layout

    def _expire_head(self, topic: str, st: _TopicState, now: float) -> bool:
        """Discard expired messages at the head of a topic that cannot be sent right now.

        Messages are in acceptance order, so the expired ones are a prefix (undecodable ones
        in it are discarded as such). At most ``EXPIRE_PER_STEP`` a call: a long outage can
        leave millions expired, and what is discarded is held until its batched delete."""
        if now < st.expiry_check_at:
            return False
        settings = self.topic_settings(topic)
        cutoff_ms = int(time.time() * 1000) - settings.ttl_seconds * 1000
        worked = False
        budget = EXPIRE_PER_STEP
        while budget > 0:
            want = min(1000, budget)
            batch = self.store.read(topic, st.cursor, want)
            for m in batch:
                if isinstance(m, Corrupt):
                    self._discard_corrupt(m)
                elif m.accepted_ms < cutoff_ms:
                    self._discard(Flight(m, settings), "ttl",
                                  f"older than ttl_seconds={settings.ttl_seconds}")
                else:
                    st.expiry_check_at = now + 1.0  # the head is young enough: look again later
                    return worked
                st.cursor = m.id
                worked = True
                budget -= 1
            if len(batch) < want:
                st.expiry_check_at = now + 1.0  # all of the topic expired and discarded
                return worked
        return worked  # more may have expired: the next step goes on, after the delete

    def _layout_known(self, topic: str) -> bool:
        local = self.clusters[LOCAL]
        if local.layout(topic) is not None or local.known_missing(topic):
            return True
        remote = self.clusters.get(REMOTE)
        if local.down and remote is not None:
            return remote.layout(topic) is not None or remote.known_missing(topic)
        return False

    # -- sending ---------------------------------------------------------------------------
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
        producer = cluster.producer(f.settings.acks)
        try:
            producer.produce(
                r.topic,
                value=r.value,
                key=r.key,
                partition=partition if partition != UNASSIGNED else -1,
                timestamp=r.timestamp_ms,
                headers=list(r.headers) if r.headers else None,
                on_delivery=partial(self._on_delivery, f, cluster_name),
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
        self._topics.setdefault(r.topic, _TopicState()).sending += 1
        return True

    def _refused_at_once(self, f: Flight, cluster: str, exc: KafkaException) -> None:
        """produce() refused the message itself (e.g. larger than the producer allows).

        Only Kafka's own verdicts can discard a message; anything else raised here would be
        a bug in Ferry, which must cost a retry, never a message."""
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        code = err.code() if err is not None else None
        if err is not None and (err.fatal() or code == KafkaError._FATAL):
            # A producer in librdkafka's fatal state refuses every produce() this way, and no
            # delivery report will come to say so: start a fresh one.
            self._replace_producer(cluster, f.settings.acks, err)
        self._failed(f, cluster, str(exc),
                     permanent=code is not None and failures.discards(code),
                     code=err.name() if err is not None else "error",
                     operator=code is not None and failures.needs_operator(code))

    def _on_delivery(self, f: Flight, cluster: str, err: KafkaError | None, msg: Message) -> None:
        # Runs inside poll() on this thread: just record; _handle_reports does the work.
        self._reports.append((f, cluster, err, msg))

    def _handle_reports(self) -> bool:
        worked = False
        purge: set[tuple[str, str]] = set()
        acked_ids: list[bytes] = []  # ids (or topic NUL id handles) a cluster acknowledged
        for topic, st in [(t, st) for t, st in self._topics.items() if st.sink]:
            self._handle_value_reports(topic, st, purge, acked_ids)
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
        201s waiting for these are answered now (agent/ack_signal.py), whether or not the
        buffer's delete has committed yet. Called once the reports' outcomes are recorded."""
        self._ack_signal.send(acked)

    def _has_reports(self) -> bool:
        return bool(self._reports) or any(st.sink for st in self._topics.values())

    def _handle_value_reports(self, topic: str, st: _TopicState,
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
        lv = self._leaving
        if not len(lv):
            lv.since = now
        run = lv.runs.get((topic, LOCAL))
        if run is None:
            run = lv.runs[(topic, LOCAL)] = DeliveredRun(topic, LOCAL)
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
                self._report_failed(f, LOCAL, err, purge)
        if delivered:
            lv.delivered += delivered
            if st.stuck is not None:
                self._unstuck(topic, st)
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
        lv = self._leaving
        if not len(lv):
            lv.since = now
        runs = lv.runs
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
                    self._unstuck(topic, ts)
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
            self._report_failed(f, cluster, err, purge)
        lv.delivered += delivered
        for cluster in acked:
            self.clusters[cluster].health.acknowledged()

    def _report_failed(self, f: Flight, cluster: str, err: KafkaError,
                       purge: set[tuple[str, str]]) -> None:
        """A delivery report said ``f``'s send to ``cluster`` failed."""
        code = err.code()
        if err.fatal() or (f.settings.acks == "all" and code in STALE_PRODUCER):
            # An idempotent producer whose id the cluster forgot (e.g. a cluster rebuilt
            # from scratch) never recovers by itself: start a fresh one.
            self._replace_producer(cluster, f.settings.acks, err)
        if failures.answered(code):
            self.clusters[cluster].health.answered()  # the cluster is up, the message is not
        permanent = failures.discards(code)
        if not permanent and code != KafkaError._PURGE_QUEUE:
            purge.add((cluster, f.settings.acks))
        self._failed(f, cluster, err.str() or err.name(), permanent=permanent,
                     code=err.name(), attempt=code != KafkaError._PURGE_QUEUE,
                     operator=failures.needs_operator(code))

    def _replace_producer(self, cluster: str, acks: str, err: KafkaError) -> None:
        now = time.monotonic()
        if now - self._replaced.get((cluster, acks), 0.0) < REPLACE_INTERVAL and not err.fatal():
            return
        self._replaced[(cluster, acks)] = now
        log.warning("recreating the %s acks=%s producer after %s", cluster, acks, err.str())
        self.clusters[cluster].replace_producer(acks)

    def _failed(
        self, f: Flight, cluster: str, error: str, *, permanent: bool, code: str = "error",
        attempt: bool = True, operator: bool = False,
    ) -> None:
        """A send of ``f`` failed: discard it (permanent), or try the other cluster, or
        schedule a retry. ``attempt`` False: Ferry itself withdrew the send (a purge), which
        does not count against ``max_attempts``."""
        f.last_error = error
        self.registry.inc("delivery_failures", topic=f.msg.topic, cluster=cluster, error=code)
        self.registry.sample("error", code, {"topic": f.msg.topic, "cluster": cluster,
                                             "id": keys.id_text(f.msg.id), "detail": error})
        if f.pending > 0:
            # The other cluster may still acknowledge it: its answer decides, even when this
            # one refused the message for good (e.g. the remote cluster's ACLs differ).
            return
        if permanent:
            self._discard(f, "invalid", f"{cluster}: {error}", in_flight=True)
            return
        remote = self.clusters.get(REMOTE)
        # Hermes' fallback: the local send failed, try the remote datacenter at once.
        if (cluster == LOCAL and f.settings.fallback_to_remote and remote is not None
                and not f.sent_remote and self._produce(f, REMOTE) is not None):
            return  # sent; or refused at once, and already handled as the remote's failure
        if attempt:
            f.attempts += 1
        if attempt and f.settings.max_attempts and f.attempts >= f.settings.max_attempts:
            self._discard(f, "attempts", f"{f.attempts} attempts, last error: {error}",
                          in_flight=True)
            return
        if attempt:
            self._stuck(f.msg.topic, code, cluster, error, operator)
        delay = min(self.backoff_initial * (2 ** min(max(f.attempts - 1, 0), 16)),
                    self.backoff_max)
        self._schedule_retry(f, delay)

    def _stuck(self, topic: str, code: str, cluster: str, error: str, operator: bool) -> None:
        """A send of ``topic`` failed and is retried: the topic is stuck until its next
        acknowledgement, shown on its row and in health (failures.py says how loud)."""
        st = self._topics.setdefault(topic, _TopicState())
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

    def _waiting_for_layout(self, topic: str, st: _TopicState, now: float) -> None:
        """A topic with messages whose partitions cannot be learnt (its cluster unreachable,
        or not answering for it) sends nothing, so no send fails to say why: after
        outage_after_seconds it is stuck on NO_PARTITIONS, with the cluster's state."""
        if not st.waiting_since:
            st.waiting_since = now
            return
        local = self.clusters[LOCAL]
        if topic not in self._present or now - st.waiting_since < local.config.outage_after_seconds:
            return
        h = local.health
        detail = (f"its partitions are not known after {now - st.waiting_since:.0f} s; "
                  f"cluster {LOCAL} is {h.state}" + (f": {h.reason}" if h.reason else ""))
        if st.stuck is None:
            self._stuck(topic, NO_PARTITIONS, LOCAL, detail, False)
        elif st.stuck.error == NO_PARTITIONS:
            # Kept current, not frozen at the moment it began: the cluster's verdict (and its
            # cause, e.g. refused credentials) often comes after the topic began to wait.
            st.stuck.detail = detail

    def _unstuck(self, topic: str, st: _TopicState) -> None:
        stuck = st.stuck
        st.stuck = None
        if stuck is not None and stuck.operator:
            log.warning("topic %s delivers again after %d failed sends over %.0f s (%s)",
                        topic, stuck.failures, time.time() - stuck.since, stuck.error)

    def _schedule_retry(self, f: Flight, delay: float) -> None:
        """Queue ``f`` to be sent again after ``delay``, behind nothing newer of its topic.

        Retries are kept per topic and re-sent in message-id order, and the topic reads no new
        messages until every retry has been re-sent and every send of the topic has reported:
        otherwise messages accepted later could overtake the failed ones once the cluster is
        back, breaking per-key order within a cluster. Waiting for the re-sent ones to report,
        not just to be re-sent, matters when the network returns just as they time out again:
        librdkafka fails timed-out messages up to a second late, and a newer message queued
        behind them could already be on the wire by then, where no purge can reach it."""
        st = self._topics.setdefault(f.msg.topic, _TopicState())
        st.recovering = True
        bisect.insort(st.retry, f, key=lambda x: x.msg.id)
        st.retry_at = max(st.retry_at, time.monotonic() + delay)
        self._retry_topics.add(f.msg.topic)

    def _due_retries(self, now: float) -> bool:
        worked = False
        now_ms = int(time.time() * 1000)
        for topic in list(self._retry_topics):
            st = self._topics[topic]
            if st.retry_at > now or st.sending > 0:
                continue  # wait until every earlier send of the topic has reported
            due, st.retry = st.retry, []
            st.retry_at = 0.0
            self._retry_topics.discard(topic)
            gen = self._generations.get(topic, 0)
            for i, f in enumerate(due):
                if f.done:
                    continue
                worked = True
                if f.msg.generation < gen:
                    self._discard(f, "generation", "the topic was deleted after this message "
                                  f"was accepted; last error: {f.last_error}", in_flight=True)
                    continue
                if now_ms - f.msg.accepted_ms > f.settings.ttl_seconds * 1000:
                    self._discard(f, "ttl", f"older than ttl_seconds={f.settings.ttl_seconds};"
                                  f" last error: {f.last_error}", in_flight=True)
                    continue
                f.sent_remote = False
                self._send(f, now)
                if st.retry:
                    # It could not be sent (producer queue full, refused for now) and is queued
                    # again: the ones behind it wait too, or they would overtake it.
                    for g in due[i + 1:]:
                        if not g.done:
                            bisect.insort(st.retry, g, key=lambda x: x.msg.id)
                    break
        return worked

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

    # -- health ----------------------------------------------------------------------------
    def _check_health(self, now: float) -> None:
        """Feed each cluster's state (health.py) with its outstanding sends; log changes."""
        if now >= self._next_parked:
            self._parked = self._parked_sends()
            self._next_parked = now + 0.1  # a scan of the topics: not at every step
        for name, c in self.clusters.items():
            h = c.health
            h.sends(max(0, c.outstanding() - self._parked) if name == LOCAL else c.outstanding())
            h.check()
            for change in h.changes():
                self._log_change(change)
                self._next_gauges = 0.0  # publish a new state at once, not in up to 0.5 s

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

    def _client_error(self, cluster: str, err: KafkaError) -> None:
        self.registry.inc("cluster_errors", cluster=cluster, error=err.name())
        self.registry.sample("error", err.name(), {"cluster": cluster, "detail": err.str()})

    # -- leaving the buffer ----------------------------------------------------------------
    def _discard(self, f: Flight, reason: str, detail: str, in_flight: bool = False) -> None:
        f.done = True
        m = f.msg
        d = Discard(reason, m.topic, keys.id_text(m.id), m.accepted_ms, m.record,
                    attempts=f.attempts, detail=detail)
        self._leave(f if in_flight else None,
                    Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=reason),
                    discard=d)
        log.warning("discarding message %s of %s: %s (%s)", d.message_id, m.topic, reason, detail)

    def _discard_corrupt(self, m: Corrupt) -> None:
        d = Discard("corrupt", m.topic, keys.id_text(m.id), keys.id_timestamp_ms(m.id), None,
                    raw=m.raw, detail=m.error)
        self._leave(None, Outcome(m.key, len(m.key) + len(m.raw), m.topic, "discarded",
                                  reason="corrupt"), discard=d)
        log.error("discarding undecodable message %s of %s: %s", d.message_id, m.topic, m.error)

    def _leave(self, f: Flight | None, outcome: Outcome, discard: Discard) -> None:
        lv = self._leaving
        if not len(lv):
            lv.since = time.monotonic()
        lv.outcomes.append(outcome)
        lv.flights.append(f)
        lv.discards.append(discard)

    def _flush_leaving(self) -> None:
        lv = self._leaving
        now = time.monotonic()
        # Discard-log lines first: a crash between the two leaves a message in both.
        # Each line once: after a failed delete only the discards added since are new.
        if lv.logged < len(lv.discards) and now >= self._log_retry_at:
            try:
                self.discard_log.write(lv.discards[lv.logged:])
            except Exception as exc:  # noqa: BLE001 - disk full, log at its limit: later
                self._log_retry_at = now + DISCARD_LOG_RETRY_SECONDS
                self._log_trouble.failed(exc, len(lv.discards) - lv.logged,
                                         "and deliveries go on meanwhile")
            else:
                self._log_trouble.worked(len(lv.discards) - lv.logged)
                lv.logged = len(lv.discards)
        # What may leave now: every acknowledged run, and the discards in the discard log.
        # The rest waits for the log without holding up deliveries.
        ready = lv.logged
        runs = list(lv.runs.values())
        if not runs and not ready:
            lv.retry_at = self._log_retry_at
            return
        try:
            removed, runs_removed = self.store.remove_many(lv.outcomes[:ready], runs)
        except Exception as exc:  # noqa: BLE001 - disk trouble: keep everything, try later
            self._delete_trouble.failed(exc, len(lv), "retried every "
                                        f"{DELETE_RETRY_SECONDS:g} s")
            lv.retry_at = now + DELETE_RETRY_SECONDS
            return
        self._delete_trouble.worked(ready + lv.delivered)
        # Waits for discarded messages end now (202); acknowledged ones were signalled
        # when their delivery reports came (_handle_reports).
        self._ack_signal.send((), [o.key for o in lv.outcomes[:ready]
                                   if o.state == "discarded"])
        self._leaving = _Leaving()
        if ready < len(lv.outcomes):
            rest = self._leaving
            rest.outcomes = lv.outcomes[ready:]
            rest.flights = lv.flights[ready:]
            rest.discards = lv.discards[ready:]
            rest.since = now
            del lv.outcomes[ready:], lv.flights[ready:], lv.discards[ready:]
        reg = self.registry
        delivered: dict[tuple[str, str], int] = {}
        dup: dict[tuple[str, str], int] = {}
        topics = self._topics
        for outcome, f, ok in zip(lv.outcomes, lv.flights, removed, strict=True):
            topic = outcome.topic
            if f is not None:
                st = topics.get(topic)
                if st is not None:
                    st.in_flight -= 1
                self._in_flight -= 1
            if outcome.state == "delivered":
                key = (topic, outcome.cluster)
                target = delivered if ok else dup
                target[key] = target.get(key, 0) + 1
        for run, oks in zip(runs, runs_removed, strict=True):
            # Every message of a run was in flight.
            st = topics.get(run.topic)
            if st is not None:
                st.in_flight -= len(oks)
            self._in_flight -= len(oks)
            key = (run.topic, run.cluster)
            n = sum(oks)
            if n:
                delivered[key] = delivered.get(key, 0) + n
            if n < len(oks):
                dup[key] = dup.get(key, 0) + len(oks) - n
        for (topic, cluster), n in delivered.items():
            reg.inc("messages_delivered", n, topic=topic, cluster=cluster)
        for (topic, cluster), n in dup.items():
            reg.inc("messages_duplicate_acks", n, topic=topic, cluster=cluster)
        for d in lv.discards:
            reg.inc("messages_discarded", topic=d.topic, reason=d.reason)
            reg.sample("discarded", d.reason, {"topic": d.topic, "id": d.message_id,
                                               "detail": d.detail})

    def _gauges(self) -> None:
        reg = self.registry
        states: dict[str, Any] = {}
        for name, c in self.clusters.items():
            snap = c.health.snapshot()
            states[name] = snap.to_json()
            if snap.state != "unknown":
                reg.set("cluster_up", 1.0 if snap.state == "up" else 0.0, cluster=name)
            reg.set("cluster_brokers_up", float(c.brokers), cluster=name)
            reg.set("messages_in_flight", float(c.outstanding()), cluster=name)
        reg.set_info("cluster_state", states)
        stuck = {t: {**st.stuck.to_json(), "retrying": len(st.retry) + st.in_flight}
                 for t, st in self._topics.items() if st.stuck is not None}
        reg.set_info("stuck_topics", stuck)
        reg.set("topics_stuck", float(len(stuck)))  # for alerting (FerryTopicStuck)

    # -- stopping --------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Give in-flight messages a moment to be acknowledged, then record what was."""
        deadline = time.monotonic() + timeout
        self.exactly_once.stop(timeout)
        while self._in_flight > 0 and time.monotonic() < deadline:
            self._poll()
            self._handle_reports()
            if len(self._leaving):
                self._flush_leaving()
            if not self._has_reports():
                self._wait(0.01)
        self._handle_reports()
        if len(self._leaving):
            self._flush_leaving()
        for c in self.clusters.values():
            c.close(0.5)
        if self._commits is not None:
            self._commits.close()

    def stats(self) -> dict[str, Any]:
        return {"in_flight": self._in_flight,
                "retries": sum(len(s.retry) for s in self._topics.values()),
                "topics": {t: s.in_flight for t, s in self._topics.items()}}
