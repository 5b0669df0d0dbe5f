"""A Kafka cluster as the forwarder sees it: producers per ack level, topic layouts, health.

Only the forwarder package touches Kafka, and within it only this module builds clients.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from agent.config import ForwarderConfig, KafkaClusterConfig
from agent.forwarder.brokers import STATS_INTERVAL_MS, BrokerWatch, queued_messages
from agent.forwarder.connections import connection_config
from agent.forwarder.health import ClusterHealth
from agent.forwarder.partitioner import TopicLayout
from agent.forwarder.probe import Probe
from agent.forwarder.topic_limits import ALONE, TopicLimits, batch_bytes, describe

log = logging.getLogger(__name__)

# A wait on several producers takes turns, no turn shorter than librdkafka's millisecond
# (a shorter poll timeout is truncated to 0 and would spin) and no round of turns longer than
# WAIT_ROUND: a report of any producer is served within a round.
WAIT_ROUND = 0.01
_MIN_TURN = 0.001


class _Polls(Protocol):
    def poll(self, timeout: float = ..., /) -> int: ...


def wait_for_reports(producers: Sequence[_Polls], timeout: float) -> bool:
    """Wait up to ``timeout`` for a delivery report of any of ``producers``, serving its
    callbacks; back as soon as one is served. False at once when there is no producer, so
    the caller decides how else to pause.

    One producer (the usual case) is one blocking poll. Several: one non-blocking poll each,
    then turns of blocking polls until one serves a report or the time is up. The rounds
    cost ``len(producers)`` polls per WAIT_ROUND at most, against a step of the loop per
    wait: cheap next to the work the wait spares."""
    if not producers:
        return False
    if len(producers) == 1:
        producers[0].poll(timeout)
        return True
    served = 0
    for p in producers:
        served += p.poll(0)
    if served:
        return True
    deadline = time.monotonic() + timeout
    turn = max(_MIN_TURN, min(timeout, WAIT_ROUND) / len(producers))
    while True:
        for p in producers:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            if p.poll(max(_MIN_TURN, min(turn, left))):
                return True


class _RateLimit(logging.Filter):
    """librdkafka repeats a failing connect's message every backoff; say it once a minute."""

    def __init__(self, every: float = 60.0) -> None:
        super().__init__()
        self.every = every
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = text.split("]", 1)[-1][:80]
        now = time.monotonic()
        if now - self._last.get(key, -self.every) < self.every:
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = now
        return True


_RDKAFKA_LOG = logging.getLogger("librdkafka")
_RDKAFKA_LOG.addFilter(_RateLimit())

METADATA_INTERVAL = 10.0  # seconds between full metadata refreshes while sending
# ... and while nothing is in flight: an idle agent's requests are a fleet's load (issue #38).
# Kept under idle_connection_seconds (idle_metadata_interval), so the refresh keeps the acks=all
# producer's one connection in use instead of letting it close and open again every period.
IDLE_METADATA_INTERVAL = 20.0


def _source(acks: str, batch: int) -> str:
    """How a producer's statistics are named (``Cluster.watch_brokers``)."""
    return f"{acks}-{batch}"


def idle_metadata_interval(idle_connection_seconds: float) -> float:
    """Seconds between full refreshes while nothing is in flight: IDLE_METADATA_INTERVAL,
    or less, to stay within three quarters of the idle connection period; never under the
    busy period."""
    if idle_connection_seconds <= 0:  # connections never closed
        return IDLE_METADATA_INTERVAL
    return max(METADATA_INTERVAL, min(IDLE_METADATA_INTERVAL, 0.75 * idle_connection_seconds))
METADATA_TIMEOUT = 3.0
LIMITS_INTERVAL = 60.0  # seconds between looks at the topics' limits (an operator may alter)
IDLE_LIMITS_INTERVAL = 120.0  # ... while nothing is in flight (a send makes it due sooner)
# How long a broker has been quiet before the probe checks whether it answers again
# (seconds; Probe.check_reach): past a slow answer, which the statistics see come.
REACH_CHECK_AFTER = 5.0
# A topic whose limits could not be learnt (the cluster unreachable when it was first sent
# to, DescribeConfigs denied) is asked again this often; meanwhile the defaults apply.
LIMITS_RETRY = 5.0
# librdkafka's own size check (message.max.bytes) counts a record's framing and headers,
# which Ferry's max_message_bytes (key + value) does not: left at its 1,000,000 it refused
# messages Ferry had accepted under Ferry's own default limit. Ferry's intake limit decides
# what is accepted and the topic's max.message.bytes what Kafka takes; librdkafka's check
# must be neither, so it is set out of the way.
MESSAGE_MAX_BYTES = 100 * 1024 * 1024
# librdkafka's default request.timeout.ms: how long a broker may hold an acks=all produce
# request waiting for its replicas.
REQUEST_TIMEOUT_MS = 30_000


def request_timeout_ms(fwd: ForwarderConfig) -> int:
    """A produce request's timeout that ends before its messages' own timeout.

    Kafka's Java producer refuses a ``delivery.timeout.ms`` under ``linger.ms +
    request.timeout.ms``: a request the broker still holds when its messages time out (an
    ``acks = "all"`` write waiting for replicas that no controller removes from the ISR) is
    left with no verdict, and an idempotent producer must drain it before it bumps its epoch,
    its broker thread busy meanwhile (librdkafka issues #2565, #3692). Ferry keeps the request
    timeout inside the message timeout as Java does, which bounds that drain. A cluster's own
    ``properties`` still override it."""
    return max(1, min(REQUEST_TIMEOUT_MS, fwd.message_timeout_ms - math.ceil(fwd.linger_ms)))


def producer_config(
    name: str, acks: str, cluster: KafkaClusterConfig, fwd: ForwarderConfig
) -> dict[str, Any]:
    """librdkafka settings for one cluster and ack level.

    ``acks=all`` producers are idempotent (no duplicates or reordering from librdkafka's own
    retries). librdkafka only allows idempotence with acks=all, so ``leader`` producers use
    acks=1 without it, and are capped at one in-flight request per connection when ordering
    must survive retries.
    """
    conf: dict[str, Any] = connection_config(cluster)
    conf.update({
        "client.id": f"ferry-{name}-{acks}",
        "compression.type": fwd.compression,
        "linger.ms": fwd.linger_ms,
        "batch.num.messages": 10000,
        "message.max.bytes": MESSAGE_MAX_BYTES,
        "queue.buffering.max.messages": max(2 * fwd.max_in_flight_messages, 100000),
        "queue.buffering.max.kbytes": 1048576,
        # A message not acknowledged in this time is reported failed and Ferry re-sends it;
        # it never leaves the buffer unacknowledged.
        "message.timeout.ms": fwd.message_timeout_ms,
        "request.timeout.ms": request_timeout_ms(fwd),
        "retry.backoff.ms": fwd.retry_backoff_ms,
        "retry.backoff.max.ms": fwd.retry_backoff_max_ms,
    })
    if acks == "all":
        conf.update({"acks": "all", "enable.idempotence": True})
    else:
        conf.update({"acks": 1, "enable.idempotence": False,
                     "max.in.flight.requests.per.connection": 1})
    conf.update(cluster.properties)
    return conf


def batch_config(conf: dict[str, Any], batch: int) -> dict[str, Any]:
    """``conf`` for a producer of smaller batches: ``batch`` bytes at most (topic_limits.py),
    or one message a batch (``ALONE``: its own verdict from the broker, isolation.py)."""
    if not batch:
        return conf
    conf = dict(conf)
    conf["client.id"] = f"{conf['client.id']}-{'alone' if batch == ALONE else batch}"
    if batch == ALONE:
        conf["batch.num.messages"] = 1
        conf["linger.ms"] = 0
    else:
        conf["batch.size"] = batch
    return conf


class Cluster:
    def __init__(
        self,
        name: str,
        config: KafkaClusterConfig,
        forwarder: ForwarderConfig,
        on_error: Callable[[str, KafkaError], None] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.forwarder = forwarder
        self._on_error = on_error
        # By (acks, batch): batch 0 is librdkafka's default batch size, any other value a
        # producer for topics limited below it, or for messages sent alone (batch_config).
        self._producers: dict[tuple[str, int], Producer] = {}
        self._limits: dict[str, TopicLimits] = {}  # learnt from the cluster (topic_limits.py)
        self._described: set[str] = set()  # topics whose limits were asked for at least once
        # Topics with a layout (from a full refresh) whose limits are still to be asked for:
        # described without a metadata request (which would re-create a deleted topic on an
        # auto-create cluster).
        self._undescribed: set[str] = set()
        self._layouts: dict[str, TopicLayout] = {}
        self._missing: set[str] = set()  # looked up, not in the cluster's metadata
        self._wanted: set[str] = set()
        # Topics the forwarder asked about (it sends to them); _layouts holds every topic of
        # the cluster's full metadata refreshes, other teams' too.
        self._used: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.brokers = 0
        # The one state every reader uses (routing, health, status): agent/forwarder/health.py
        self.health = ClusterHealth(name, config.outage_after_seconds)
        # Brokers out of this agent's reach while the rest answers (brokers.py): their
        # partitions are routed around, and health names them.
        # Half of outage_after_seconds: named well within it (the statistics come every
        # second); not under 2 s, which a loaded broker's answer can take.
        self.brokers_watch = BrokerWatch(quiet_after=max(2.0, config.outage_after_seconds / 2))
        # Out of reach (brokers.py), and of those the ones routed around (only in a partial
        # failure: partial()).
        self._out_of_reach: frozenset[int] = frozenset()
        self._unreachable: frozenset[int] = frozenset()
        self._unreachable_logged: set[int] = set()
        self._probe: Probe | None = None
        self._reach_lock = threading.Lock()  # _reach_changed: a poll() and the probe thread
        # Told every topic's limits whenever they were learnt or forgotten (the forwarder
        # publishes the local cluster's to the intake: agent/signals/limits.py).
        self.on_limits: Callable[[dict[str, TopicLimits]], None] | None = None
        # source -> the messages its client held by its last statistics (sending()).
        self._queued: dict[str, int] = {}
        self._thread = threading.Thread(target=self._metadata_loop, name=f"metadata-{name}",
                                        daemon=True)

    # -- producers -------------------------------------------------------------------------
    def producer(self, acks: str, batch: int = 0) -> Producer:
        """The producer for ``acks`` building batches of ``batch`` bytes at most (0:
        librdkafka's default; ``ALONE``: one message a batch). Made on first use."""
        p = self._producers.get((acks, batch))
        if p is None:
            conf = batch_config(producer_config(self.name, acks, self.config, self.forwarder),
                                batch)
            conf["error_cb"] = self._error
            conf["logger"] = _RDKAFKA_LOG
            self.watch_brokers(conf, _source(acks, batch))
            p = self._producers[(acks, batch)] = Producer(conf)
            self._ensure_metadata_thread()
        return p

    def watch_brokers(self, conf: dict[str, Any], source: str) -> None:
        """Have the client of ``conf`` report its brokers (brokers.py) as ``source``."""
        conf["statistics.interval.ms"] = STATS_INTERVAL_MS
        conf["stats_cb"] = lambda stats: self._stats(source, stats)

    def _stats(self, source: str, stats: str) -> None:
        # Served inside poll() of that client: note, and let the loop act (poll()).
        queued = queued_messages(stats)
        if queued is not None:
            self._queued[source] = queued
        if self.brokers_watch.sample(source, stats):
            self._reach_changed()

    def _out_of_reach_addresses(self) -> dict[int, str]:
        """The brokers for the probe's reach check: those quiet for ``REACH_CHECK_AFTER``.
        One found out of reach for a moment (an answer slow on a loaded host) is left to
        the statistics, which see its answer come: a check would open a connection for
        nothing (an idle agent holds one per broker, no more). Only in a partial failure:
        with most of the cluster out of reach nothing is routed around, and a fleet's agents
        would each add a connection a probe period to every dead broker."""
        if not self.partial():
            return {}
        now = time.time()
        return {u.node: u.address for u in self.brokers_watch.unreachable().values()
                if now - u.since >= REACH_CHECK_AFTER}

    def _reached(self, node: int, answered: bool) -> None:
        """Whether a broker out of reach answered the probe's request to it alone (probe
        thread)."""
        if not answered:
            self.brokers_watch.unanswered(node)
        elif self.brokers_watch.answered(node):
            self._reach_changed()

    def _reach_changed(self) -> None:
        """The brokers out of reach changed: route around those now out of reach, and log
        who left and who came back. From a client's statistics (in poll()) or the probe's
        reach check (its thread): one at a time."""
        with self._reach_lock:
            now = self.brokers_watch.nodes()
            self._out_of_reach = now
            # Routed around only in a partial failure: with more than half the brokers out
            # of reach (a lost quorum, the whole cluster cut off) there is nowhere better to
            # send to, and keys stay where they are, as before any of this.
            routed = now if self.partial() else frozenset()
            with self._lock:
                newly = routed - self._unreachable
                self._unreachable = routed
                for lay in self._layouts.values():
                    lay.route_around(routed)
            for u in self.brokers_watch.unreachable().values():
                if u.node in newly:
                    log.warning("cluster %s: broker %d (%s) does not answer this agent for "
                                "%.0f s; its partitions wait, the others are sent to: %s",
                                self.name, u.node, u.address, time.time() - u.since,
                                ", ".join(f"{t}-{p}" for t, p in u.partitions) or "none")
            for node in self._unreachable_logged - now:
                log.warning("cluster %s: broker %d answers again", self.name, node)
            self._unreachable_logged = set(now)

    def unreachable_text(self) -> str:
        """The brokers out of reach in words, for health ("" : none)."""
        return self.brokers_watch.describe()

    def unreachable_brokers(self) -> list[dict[str, object]]:
        """The brokers out of reach, for the status documents."""
        return [u.to_json() for u in self.brokers_watch.unreachable().values()]

    def partial(self) -> bool:
        """Some brokers out of reach, at most half of those in metadata: a partial failure,
        whose stranded sends say nothing of the rest. More than half (two of three nodes
        killed, the quorum with them) is the cluster's failure, judged whole."""
        unreachable = len(self._out_of_reach)
        return unreachable > 0 and 2 * unreachable <= self.brokers

    def stranded(self) -> int:
        """Sends waiting for unreachable brokers (brokers.py), while the failure is partial:
        left out of the cluster's unanswered sends."""
        return self.brokers_watch.stranded() if self.partial() else 0

    def batch(self, topic: str) -> int:
        """The batch size ``topic``'s messages are sent in (``producer``'s ``batch``)."""
        return batch_bytes(self._limits.get(topic))

    def limits(self, topic: str) -> TopicLimits | None:
        """``topic``'s limits as last learnt from the cluster, or None (not learnt yet, or
        the cluster would not describe it)."""
        return self._limits.get(topic)

    def _ensure_metadata_thread(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            with contextlib.suppress(RuntimeError):  # started by another caller just now
                self._thread.start()

    def replace_producer(self, acks: str) -> None:
        """Drop the producers of ``acks`` after a fatal error; the next send builds fresh
        ones."""
        for key in [k for k in self._producers if k[0] == acks]:
            old = self._producers.pop(key)
            # Purged messages are reported failed (and so re-sent by the forwarder).
            old.purge(in_queue=True, in_flight=True)
            deadline = time.monotonic() + 2.0
            while len(old) > 0 and time.monotonic() < deadline:
                old.poll(0.05)
            old.close()
            self._queued.pop(_source(*key), None)  # the fresh one counts by len() at first

    def purge_queued(self, acks: str) -> None:
        """Fail the messages a producer holds that were not sent yet (safe: none of them
        reached a broker); each is reported with ``_PURGE_QUEUE`` and sent again later."""
        for key, p in list(self._producers.items()):
            if key[0] == acks:
                p.purge(in_queue=True, in_flight=False, blocking=False)

    def start_probing(self) -> None:
        """Probe the cluster on a period from now on, with or without traffic."""
        if self._probe is None and not self._stop.is_set():
            self._probe = Probe(self.name, self.config, self.health, _RDKAFKA_LOG,
                                topics=self.topics, named=self.probe_topic,
                                out_of_reach=self._out_of_reach_addresses,
                                reached=self._reached)
            self._probe.start()

    def admin(self) -> AdminClient | None:
        """The probe's admin client, for the cluster's occasional admin requests (None
        before probing starts): one client, and the connection its probes keep open."""
        return self._probe.admin if self._probe is not None else None

    @property
    def up(self) -> bool:
        return self.health.up

    @property
    def down(self) -> bool:
        return self.health.down

    def _error(self, err: KafkaError) -> None:
        # A cause to show, not a verdict: the probes and the sends decide (health.py).
        self.health.client_error(err.str(),
                                 generic=err.code() == KafkaError._ALL_BROKERS_DOWN)
        if self._on_error is not None:
            self._on_error(self.name, err)

    def poll(self) -> int:
        return sum(p.poll(0) for p in list(self._producers.values()))

    def outstanding(self) -> int:
        return sum(len(p) for p in self._producers.values())

    def producers(self) -> list[Producer]:
        """Its producers, for a wait on their delivery reports (``wait_for_reports``)."""
        return list(self._producers.values())

    # -- topic layouts ---------------------------------------------------------------------
    def layout(self, topic: str) -> TopicLayout | None:
        """The topic's partitions, or None while they are being looked up."""
        with self._lock:
            self._used.add(topic)
            lay = self._layouts.get(topic)
            if lay is not None and topic not in self._described:
                # Known from a full refresh, but not its limits: its first batch would not
                # know its size (topic_limits.py). One DescribeConfigs first.
                self._undescribed.add(topic)
                self._wake.set()
                lay = None
            elif lay is None and topic not in self._missing and topic not in self._wanted:
                self._wanted.add(topic)
                self._wake.set()
        if lay is None:
            self._ensure_metadata_thread()
        return lay

    def topics(self) -> list[str]:
        """The topics the forwarder has looked up here (it sends to them)."""
        with self._lock:
            return sorted(self._used)

    def probe_topic(self) -> str | None:
        """A topic the probe may name: one the forwarder sends to that the cluster's
        metadata lists (so librdkafka holds no unknown topic to look up again every second);
        None before there is one."""
        with self._lock:
            return next((t for t in sorted(self._used) if t in self._layouts), None)

    def sending(self) -> bool:
        """Whether any producer of this cluster holds a message (queued, in flight, or its
        delivery report not yet served), by its statistics of the last second: a producer's
        ``len()`` counts every callback waiting for poll(), the statistics' own too, which
        would make an idle cluster look busy for a moment every second (and the metadata
        thread, which asks, refresh at the busy period). A producer with no statistics yet
        counts by its ``len()``."""
        for (acks, batch), p in list(self._producers.items()):
            queued = self._queued.get(_source(acks, batch))
            if (len(p) if queued is None else queued) > 0:
                return True
        return False

    def layout_count(self) -> int:
        """How many topics' layouts are held: the cluster's topics, and no deleted ones past
        the next full refresh."""
        with self._lock:
            return len(self._layouts)

    def forget(self, topic: str) -> None:
        """The forwarder holds nothing of ``topic`` any more: stop listing it among the
        topics it sends to (the probe's diagnosis reads them), so that topics which come
        and go do not pile up here. A topic found missing is forgotten too (a send looks it
        up again through ``layout``); its layout stays until a full refresh no longer lists
        it (``refresh``), and so do its limits (the exactly-once loop may still send to it:
        forgetting them would send its next messages with the defaults)."""
        with self._lock:
            self._used.discard(topic)
            self._missing.discard(topic)

    def has_missing(self) -> bool:
        """Some topic looked up here is not in the cluster's metadata (read without the
        lock: a set's truth is read whole)."""
        return bool(self._missing)

    def known_missing(self, topic: str) -> bool:
        with self._lock:
            return topic in self._missing

    def refresh(self, topic: str | None = None) -> None:
        """Fetch metadata now (all topics, or one — which auto-creates it where allowed)."""
        producer = self._producers.get(("all", 0)) or self._producers.get(("leader", 0)) \
            or self.producer("all")
        md = producer.list_topics(topic=topic, timeout=METADATA_TIMEOUT)
        layouts: dict[str, TopicLayout] = {}
        missing: set[str] = set()
        for name, tm in md.topics.items():
            if tm.error is not None and tm.error.code() in (
                KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC
            ):
                missing.add(name)
                continue
            parts = tuple(sorted(tm.partitions))
            if not parts:
                missing.add(name)
                continue
            leaders = tuple(tm.partitions[p].leader for p in parts)
            lay = TopicLayout(parts, (), leaders)
            lay.route_around(self._unreachable)
            layouts[name] = lay
        pruned: list[str] = []
        with self._lock:
            self.brokers = len(md.brokers)
            for name, lay in layouts.items():
                old = self._layouts.get(name)
                if old is not None and old.partitions == lay.partitions:
                    old.leaders = lay.leaders  # keep the round-robin position
                    old.route_around(self._unreachable)
                else:
                    self._layouts[name] = lay
                    lay.route_around(self._unreachable)  # as it is now, under the lock
                self._missing.discard(name)
                self._wanted.discard(name)
            for name in missing:
                self._missing.add(name)
                self._wanted.discard(name)
            if topic is None:
                # A full refresh lists every topic of the cluster: a layout it no longer
                # lists, of a topic the forwarder does not send to, belongs to a deleted
                # topic, and would otherwise stay for ever (topics that come and go).
                for name in [n for n in self._layouts
                             if n not in layouts and n not in self._used]:
                    del self._layouts[name]
                pruned = [n for n in self._described
                          if n not in layouts and n not in self._used]
                for name in pruned:
                    self._described.discard(name)
                    self._limits.pop(name, None)
        if pruned:
            self._told_limits()  # outside the lock: it writes a file

    def learn_limits(self, topics: list[str]) -> None:
        """Describe ``topics``' configurations and keep their limits (topic_limits.py).
        Through the probe's admin client: no connection of its own. Without a probe (not
        started yet) nothing is learnt and the defaults apply."""
        probe = self._probe
        with self._lock:
            self._described.update(topics)  # asked, whatever the answer: sends may go on
        if probe is None or not topics or not probe.controller_accepts():
            # Without a controller that takes connections the request would only make
            # librdkafka reconnect to it without back-off until its timeout (probe.py): the
            # limits are asked for again in LIMITS_RETRY, and the defaults apply meanwhile.
            return
        learnt = describe(probe.admin, topics, METADATA_TIMEOUT)
        for topic, new in learnt.items():
            old = self._limits.get(topic)
            if old != new:
                log.info("topic %s on cluster %s: max.message.bytes=%d%s; sent in batches of "
                         "%s", topic, self.name, new.max_message_bytes,
                         ", compacted" if new.compacted else "",
                         {0: "the default size", ALONE: "one message"}.get(
                             batch_bytes(new), f"{batch_bytes(new)} bytes at most"))
        self._limits.update(learnt)
        if learnt:
            self._told_limits()

    def _told_limits(self) -> None:
        callback = self.on_limits
        if callback is None:
            return
        try:
            callback(dict(self._limits))
        except Exception:  # noqa: BLE001 - telling the intake must not stop the metadata loop
            log.exception("publishing the limits of cluster %s failed", self.name)

    def _metadata_loop(self) -> None:
        next_full = full_at = 0.0
        idle_full = idle_metadata_interval(self.config.idle_connection_seconds)
        next_limits = limits_at = 0.0
        next_unknown = 0.0
        while not self._stop.is_set():
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._lock:
                    wanted = sorted(self._wanted)
                    undescribed = self._undescribed
                    self._undescribed = set()
                # The limits before the layout: a topic is sent to once its layout is
                # known, and its first batch is then already of the right size.
                self.learn_limits(sorted({t for t in wanted if t not in self._described}
                                         | undescribed))
                for topic in wanted:
                    self.refresh(topic)
                # Idle, the periodic looks come less often; a send makes them due at the
                # busy period again, counted from the last look.
                busy = self.sending()
                if busy:
                    next_limits = min(next_limits, limits_at + LIMITS_INTERVAL)
                    next_full = min(next_full, full_at + METADATA_INTERVAL)
                if time.monotonic() >= next_limits:
                    self.learn_limits(self.topics())
                    limits_at = time.monotonic()
                    next_limits = limits_at + (LIMITS_INTERVAL if busy else IDLE_LIMITS_INTERVAL)
                    next_unknown = next_limits
                elif time.monotonic() >= next_unknown:
                    self.learn_limits([t for t in self.topics() if t not in self._limits])
                    next_unknown = time.monotonic() + LIMITS_RETRY
                if time.monotonic() >= next_full:
                    self.refresh()
                    full_at = time.monotonic()
                    next_full = full_at + (METADATA_INTERVAL if busy else idle_full)
            except KafkaException as exc:
                self.brokers = 0
                log.debug("metadata refresh of %s failed: %s", self.name, exc)
                next_full = time.monotonic() + 1.0
            except Exception:  # noqa: BLE001 - the metadata thread must outlive surprises
                log.exception("metadata refresh of %s failed", self.name)
                next_full = time.monotonic() + 1.0

    def close(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._probe is not None:
            self._probe.stop()
        deadline = time.monotonic() + timeout
        for p in self._producers.values():
            p.flush(max(deadline - time.monotonic(), 0))
            # What is still unacknowledged stays in the buffer and is sent again next time;
            # purge it so librdkafka does not hold the process up trying to deliver it.
            p.purge(in_queue=True, in_flight=True)
            p.flush(0)
        # The metadata thread uses the producers: let its last lookup end first.
        if self._thread.is_alive():
            self._thread.join(METADATA_TIMEOUT + 0.5)
        if not self._thread.is_alive():
            for p in self._producers.values():
                # Close while the interpreter is whole: a producer destroyed at exit can hang
                # when librdkafka calls back into Python (the logger) during teardown.
                p.close()
            self._producers.clear()
