"""Exactly-once delivery for topics with ``delivery = "exactly_once"``.

One thread of the forwarder process owns these topics (the at-least-once loop skips them):
it reads each in FIFO order, sends batches inside Kafka transactions of one transactional
producer (``transactional.id`` = ``ferry-<agent identity>``), adds one progress record per
topic to each transaction, commits, and only then deletes the batch from the buffer.

Whenever the outcome of a transaction is uncertain (this process started, a commit failed,
the producer hit a fatal error) the producer is dropped and a new one opened: its
``init_transactions()`` settles the previous transaction, then the progress and a read-back
of the uncertain tail (progress.py) say which buffered messages are already in Kafka; those
leave the buffer as delivered and the rest is sent again. A blocking thread of its own keeps
commits, which wait for the cluster, out of the at-least-once loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from agent import reasons
from agent.buffer import codec, keys
from agent.buffer.store import Corrupt, DeliveredRun, Outcome, Store, StoredMessage, message
from agent.config import FerryConfig, TopicConfig
from agent.forwarder.clusters import Cluster, producer_config
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.forwarder.partitioner import choose
from agent.forwarder.plain import NOT_PLAIN, plain_values
from agent.forwarder.progress import (
    HEADER,
    Landed,
    Progress,
    agent_identity,
    client_config,
    ensure_topic,
    find_landed,
    progress_key,
    read_progress,
    tag,
)
from agent.metrics import Registry

log = logging.getLogger(__name__)

NOTE = "committed in transaction"
CLUSTER = "local"
# Kafka calls that wait for the cluster give up after this long (then: reopen, reconcile).
CALL_TIMEOUT = 30.0
RETRY_INITIAL = 0.5
RETRY_MAX = 10.0
READ_BATCH = 2000
FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED}


def _report(sink: list[tuple[bytes, KafkaError | None, Message]], message_id: bytes,
            err: KafkaError | None, msg: Message) -> None:
    # The delivery callback of one send, bound to its id by a partial. Runs inside poll()
    # or flush() on this thread: just record; _commit does the work.
    sink.append((message_id, err, msg))


class Fenced(Exception):
    """Another running instance uses this agent identity (a cloned host, two agents)."""


def _fenced_detail(exc: BaseException) -> str:
    """The fencing error behind ``exc`` (itself, or what it was raised from), else ""."""
    seen: BaseException | None = exc
    for _ in range(10):  # a chain of causes is short; bounded all the same
        if seen is None:
            return ""
        code = seen.args[0] if isinstance(seen, KafkaException) and seen.args else None
        if isinstance(code, KafkaError) and code.code() in FENCED:
            return str(code.str())
        seen = seen.__cause__ or seen.__context__
    return ""


@dataclass
class _Batch:
    """What one open transaction holds for one topic."""

    run: DeliveredRun
    last_id: bytes | None = None
    written: dict[int, int] = field(default_factory=dict)  # partition -> highest offset


class ExactlyOnce:
    def __init__(
        self,
        config: FerryConfig,
        store: Store,
        *,
        registry: Registry,
        topic_settings: Callable[[str], TopicConfig],
        cluster: Cluster,
        discard_log: DiscardLog,
        signal: Callable[[Iterable[bytes], Iterable[bytes]], object] | None = None,
    ) -> None:
        fwd = config.forwarder
        # Tells the HTTP stage which messages were committed (delivered) or discarded, as
        # the forwarder's loop does for the other topics (agent/signals/ack.py): a 201
        # waiting for an exactly-once message is answered when its transaction commits.
        self._signal = signal
        self.store = store
        self.registry = registry
        self.topic_settings = topic_settings
        self.cluster = cluster
        self.discard_log = discard_log
        self.identity = agent_identity(fwd.agent_id)
        self.transactional_id = f"ferry-{self.identity}"
        self.interval = fwd.transaction_interval_ms / 1000.0
        self.max_messages = fwd.transaction_max_messages
        self.progress_topic = fwd.progress_topic
        local = config.kafka.local
        self._producer_conf = producer_config(CLUSTER, "all", local, fwd)
        self._producer_conf.update({
            "client.id": "ferry-local-transactions",
            "transactional.id": self.transactional_id,
            # A transaction of a process that died is settled by the next init_transactions
            # at the latest; this bounds how long it holds read_committed readers back
            # should no successor come.
            "transaction.timeout.ms": 60_000,
            "message.timeout.ms": int(CALL_TIMEOUT * 1000),
        })
        self._client_conf = client_config(local.bootstrap_servers, dict(local.properties))
        self._producer: Producer | None = None
        self._progress: dict[str, Progress] = {}
        self._cursors: dict[str, bytes | None] = {}
        # (message id, error, message) per delivery report, in the order they come.
        self._reports: list[tuple[bytes, KafkaError | None, Message]] = []
        self._fenced = ""
        self._fenced_error = ""  # a fencing reported by the producer's error callback
        self._in_transaction = False
        self._retry_at = 0.0
        self._backoff = RETRY_INITIAL
        self._topic_ready: set[str] = set()  # reconciled since the producer was opened
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exactly-once", daemon=True)

    # -- the forwarder's hooks ------------------------------------------------------------------
    def owns(self, topic: str) -> bool:
        return self.topic_settings(topic).delivery == "exactly_once"

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self, timeout: float) -> None:
        """Let an open transaction finish (commit) within ``timeout``, then close."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        p, self._producer = self._producer, None
        if p is not None and not self._thread.is_alive():
            p.purge(in_queue=True, in_flight=True)
            p.flush(0)

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        log.info("exactly-once topics: agent identity %s (transactional.id %s)",
                 self.identity, self.transactional_id)
        while not self._stop.is_set():
            try:
                worked = self._step()
            except Fenced as exc:
                self._fence(str(exc))
                worked = False
            except Exception as exc:  # noqa: BLE001 - uncertain: reopen and reconcile
                self._trouble(exc)
                worked = False
            if not worked:
                self._stop.wait(0.01)

    def _step(self) -> bool:
        if self._fenced or time.monotonic() < self._retry_at:
            return False
        topics = [t for t in self.store.topics() if self.owns(t)]
        if not topics:
            return False
        if self._producer is None:
            self._open()
        for t in topics:
            if t not in self._topic_ready:
                self._reconcile(t)
        return self._transaction(topics)

    def _trouble(self, exc: BaseException) -> None:
        fenced = self._fenced_error or _fenced_detail(exc)
        if fenced:
            self._fence(fenced)
            return
        log.warning("exactly-once: %s; reopening the transactional producer and reconciling "
                    "in %.1f s (the messages wait in the buffer)", exc, self._backoff)
        self.registry.sample("error", "transaction", {"detail": str(exc)})
        self._drop_producer()
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RETRY_MAX)

    def _fence(self, detail: str) -> None:
        self._fenced = detail
        self.registry.set("transactions_fenced", 1.0)
        self.registry.sample("error", "fenced", {"detail": detail,
                                                 "transactional_id": self.transactional_id})
        log.error("exactly-once topics STOPPED: this agent's producer was fenced (%s): another "
                  "running agent uses the identity %r (a cloned host? set forwarder.agent_id "
                  "or regenerate /etc/machine-id), restart this agent once each has its own. "
                  "Messages of exactly-once topics wait in the buffer.", detail, self.identity)
        self._drop_producer()

    def _drop_producer(self) -> None:
        if self._in_transaction:
            self._in_transaction = False
            self.registry.inc("transactions_aborted", reason="failed")
        p, self._producer = self._producer, None
        self._topic_ready.clear()
        self._cursors.clear()
        if p is not None:
            # Nothing of an unfinished transaction counts: the next instance's
            # init_transactions settles it and the reconciliation reads what became of it.
            p.purge(in_queue=True, in_flight=True)
            p.flush(0)
        # After the purge: its reports (purged) come during that flush and count for nothing.
        self._reports.clear()

    # -- opening and reconciling ------------------------------------------------------------------
    def _open(self) -> None:
        ensure_topic(self._client_conf, self.progress_topic, CALL_TIMEOUT)
        conf = dict(self._producer_conf)
        conf["error_cb"] = self._client_error
        p = Producer(conf)
        try:
            p.init_transactions(CALL_TIMEOUT)
        except KafkaException:
            p.flush(0)
            raise
        # After init_transactions: the previous instance's transaction is settled, so what
        # read_committed shows now is final.
        self._progress = read_progress(self._client_conf, self.progress_topic, self.identity,
                                       CALL_TIMEOUT)
        self._producer = p
        log.info("exactly-once: transactional producer ready; progress known for %d topics",
                 len(self._progress))

    def _client_error(self, err: KafkaError) -> None:
        if err.code() in FENCED:
            # The fence can surface through any call that serves callbacks (poll, flush) and
            # not always as a KafkaException carrying its code: remembered here, it decides
            # what the next trouble is, whatever the exception (reopening would fence the
            # other agent in turn).
            self._fenced_error = err.str()
        self.registry.sample("error", err.name(), {"cluster": CLUSTER, "detail": err.str(),
                                                   "via": "transactions"})

    def _reconcile(self, topic: str) -> None:
        """Drop from the buffer what earlier instances already put into Kafka."""
        prog = self._progress.get(topic, Progress())
        head = self.store.read(topic, None, 1)
        if not head:
            landed = Landed({}, {})  # nothing buffered, so nothing uncertain
        else:
            landed = find_landed(self._client_conf, topic, self.identity, prog.scan_from,
                                 CALL_TIMEOUT)
        removed = self._drop_landed(topic, prog.last_id, landed)
        scan = dict(prog.scan_from)
        scan.update(landed.ends)
        self._progress[topic] = Progress(prog.last_id, scan)
        self._cursors[topic] = None
        self._topic_ready.add(topic)
        if removed:
            log.warning("exactly-once: %d buffered messages of %s were already committed to "
                        "Kafka (before a restart or an uncertain commit): removed, not re-sent",
                        removed, topic)
        self._publish_progress(topic)

    def _drop_landed(self, topic: str, last_id: bytes | None, landed: Landed) -> int:
        limit = max([last_id or b"", *landed.ids])
        if not limit:
            return 0
        removed = 0
        after: bytes | None = None
        while True:
            batch = self.store.read(topic, after, READ_BATCH)
            run = DeliveredRun(topic, CLUSTER, note=NOTE)
            done = False
            for m in batch:
                if m.id > limit:
                    done = True
                    break
                after = m.id
                where = landed.ids.get(m.id)
                if where is None and (last_id is None or m.id > last_id):
                    continue  # not in Kafka: sent again
                size = m.stored_bytes if isinstance(m, StoredMessage) else len(m.key) + len(m.raw)
                run.ids.append(m.id)
                run.sizes.append(size)
                p, o = where or (-1, -1)
                run.partitions.append(p)
                run.offsets.append(o)
            if run.ids:
                _, oks = self.store.remove_many((), [run])
                n = sum(oks[0])
                removed += n
                self._signal_outcomes(run.ids, ())  # in Kafka: committed before
                self.registry.inc("messages_delivered", n, topic=topic, cluster=CLUSTER)
            if done or len(batch) < READ_BATCH:
                return removed

    # -- transactions ---------------------------------------------------------------------------
    def _transaction(self, topics: list[str]) -> bool:
        p = self._producer
        assert p is not None
        started = time.monotonic()
        batches: dict[str, _Batch] = {}
        discards: list[Discard] = []
        outcomes: list[Outcome] = []
        count = 0
        begun = False
        while count < self.max_messages and not self._stop.is_set():
            read_any = False
            for topic in topics:
                if self.cluster.layout(topic) is None and not self.cluster.known_missing(topic):
                    continue  # partitions being looked up
                room = min(READ_BATCH, self.max_messages - count)
                if room <= 0:
                    break
                values = self.store.read_values(topic, self._cursors.get(topic), room)
                if not values:
                    continue
                read_any = True
                # Past everything read: a failure from here drops the producer, and that
                # clears the cursors (reconciled and read again).
                self._cursors[topic] = values[-1][0]
                b = batches.get(topic) or _Batch(DeliveredRun(topic, CLUSTER, note=NOTE))
                sent = self._send_values(p, topic, values, b, discards, outcomes)
                if sent:
                    batches[topic] = b
                    begun = True
                    count += sent
            if not begun and not discards:
                return False  # nothing to send
            if time.monotonic() - started >= self.interval:
                break
            p.poll(0 if read_any else 0.005)
        if discards:
            # Before the commit: a crash after it must find each discard in the log.
            self.discard_log.write(discards)
        if begun:
            self._in_transaction = True
            self._commit(p, batches, started)
            self._in_transaction = False
            self._signal_outcomes([i for b in batches.values() for i in b.run.ids], ())
        runs = [b.run for b in batches.values()]
        self.store.remove_many(outcomes, runs)
        if outcomes:
            self._signal_outcomes((), [o.key for o in outcomes if o.state == "discarded"])
        self._backoff = RETRY_INITIAL
        for topic, b in batches.items():
            self.registry.inc("messages_delivered", len(b.run.ids), topic=topic,
                              cluster=CLUSTER)
        for d in discards:
            self.registry.inc("messages_discarded", topic=d.topic, reason=d.reason)
            self.registry.sample("discarded", d.reason, {"topic": d.topic,
                                                         "id": d.message_id,
                                                         "detail": d.detail})
        return True

    def _send_values(self, p: Producer, topic: str, values: list[tuple[bytes, bytes]],
                     b: _Batch, discards: list[Discard], outcomes: list[Outcome]) -> int:
        """Send one read of ``topic`` inside the open transaction; the number sent.

        As in the at-least-once loop (send.py, ``Sending._send_values``), a plain message
        goes out from its stored value without a Record or StoredMessage, decoded by the same
        ``plain_values``; the producer gets slices of the value, positionally. Anything else
        takes ``_unsendable`` and ``_produce``, with the same rules."""
        settings = self.topic_settings(topic)
        gen = self.store.generation(topic)
        layout = self.cluster.layout(topic)
        has_pk, hash_key = codec.HAS_PARTITION_KEY, codec.HASH_KEY
        # The oldest message read is younger than the TTL: none of them needs the check.
        check_ttl = (int(time.time() * 1000) - keys.id_timestamp_ms(values[0][0])
                     > settings.ttl_seconds * 1000)
        prefix = f"{self.identity}:".encode()  # tag(): identity ":" hex id
        base = len(topic) + 1 + keys.ID_LEN  # stored bytes besides the value: topic NUL id
        produce = p.produce
        reports = self._reports
        ids, sizes = b.run.ids, b.run.sizes
        sent = 0
        # A transaction begins with the first message sent (a read of discards alone
        # needs none).
        open_ = self._in_transaction
        for mid, v, flags, ts, pk, key, value in plain_values(values, gen, check_ttl,
                                                              settings.max_message_bytes):
            if flags == NOT_PLAIN:
                m = message(topic, mid, v)
                dropped = self._unsendable(m, settings, gen)
                if dropped is not None:
                    discards.append(dropped[0])
                    outcomes.append(dropped[1])
                    continue
                assert isinstance(m, StoredMessage)
                if not open_:
                    p.begin_transaction()
                    self._in_transaction = open_ = True
                self._produce(p, m)
                ids.append(mid)
                sizes.append(m.stored_bytes)
                b.last_id = mid
                sent += 1
                continue
            if not open_:
                p.begin_transaction()
                self._in_transaction = open_ = True
            partition = choose(layout, pk if flags & has_pk else None, bool(flags & hash_key))
            headers: list[tuple[str, str | bytes | None]] = [
                (HEADER, prefix + mid.hex().encode())]
            while True:
                try:
                    # Positional, in produce()'s order (topic, value, key, partition,
                    # callback, on_delivery, timestamp, headers): see send.py's docstring.
                    # The report callback goes in the 5th place: given there, even as None,
                    # it hides the 6th (on_delivery, the same thing under another name).
                    produce(topic, value, key, partition, partial(_report, reports, mid),
                            None, ts, headers)
                    break
                except BufferError:
                    p.poll(0.05)  # the producer's queue is full: let it drain
            ids.append(mid)
            sizes.append(base + len(v))
            b.last_id = mid
            sent += 1
        return sent

    def _produce(self, p: Producer, m: StoredMessage) -> None:
        r = m.record
        partition = choose(self.cluster.layout(r.topic), r.partition_key, r.hash_key)
        headers: list[tuple[str, str | bytes | None]] = [
            *r.headers, (HEADER, tag(self.identity, m.id))]
        while True:
            try:
                p.produce(r.topic, r.value, r.key, partition=partition,
                          timestamp=r.timestamp_ms, headers=headers,
                          on_delivery=partial(_report, self._reports, m.id))
                return
            except BufferError:
                p.poll(0.05)  # the producer's queue is full: let it drain

    def _signal_outcomes(self, delivered: Iterable[bytes], discarded: Iterable[bytes]) -> None:
        if self._signal is not None:
            self._signal(delivered, discarded)

    def _commit(self, p: Producer, batches: dict[str, _Batch], started: float) -> None:
        left = p.flush(CALL_TIMEOUT)
        if left:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            f"{left} messages not acknowledged in time"))
        reports = self._reports[:]
        self._reports.clear()  # the same list: the callbacks of the next sends hold it
        # Where each message went, by id: reports come in order within a partition but
        # interleaved across partitions, so their order is not the run's.
        where: dict[bytes, tuple[int, int]] = {}
        for mid, err, msg in reports:
            if err is not None:
                if err.code() in FENCED:
                    raise Fenced(err.str())
                raise KafkaException(err)
            part = int(msg.partition() or 0)
            off = int(msg.offset() or 0)
            where[mid] = (part, off)
            b = batches.get(str(msg.topic()))
            if b is not None and off > b.written.get(part, -1):
                b.written[part] = off
        for topic, b in batches.items():
            try:
                placed = [where[i] for i in b.run.ids]
            except KeyError:
                raise KafkaException(KafkaError(KafkaError._STATE,
                                                f"delivery reports of {topic} missing")) from None
            b.run.partitions = [part for part, _ in placed]
            b.run.offsets = [off for _, off in placed]
            assert b.last_id is not None
            self._progress[topic] = self._progress.get(topic, Progress()).advanced(
                b.last_id, b.written)
            p.produce(self.progress_topic, self._progress[topic].encode(),
                      progress_key(self.identity, topic))
        p.commit_transaction(CALL_TIMEOUT)
        self.registry.inc("transactions_committed")
        self.registry.observe("transaction_seconds", time.monotonic() - started)
        for topic in batches:
            self._publish_progress(topic)

    def _publish_progress(self, topic: str) -> None:
        prog = self._progress.get(topic)
        if prog is not None and prog.last_id is not None:
            self.registry.set("transaction_progress_timestamp_seconds",
                              keys.id_timestamp_ms(prog.last_id) / 1000.0, topic=topic)

    def _unsendable(self, m: StoredMessage | Corrupt, settings: TopicConfig, gen: int
                    ) -> tuple[Discard, Outcome] | None:
        """The discard of a message that must not be sent (the same rules as at-least-once)."""
        if isinstance(m, Corrupt):
            return (Discard(reasons.CORRUPT, m.topic, keys.id_text(m.id),
                            keys.id_timestamp_ms(m.id), None, raw=m.raw, detail=m.error),
                    Outcome(m.key, len(m.key) + len(m.raw), m.topic, "discarded",
                            reason=reasons.CORRUPT))
        r = m.record
        reason = detail = ""
        if m.generation < gen:
            reason = reasons.GENERATION
            detail = "the topic was deleted after this message was accepted"
        elif len(r.value) + (len(r.key) if r.key else 0) > settings.max_message_bytes:
            reason = reasons.TOO_LARGE
            detail = f"{r.size} bytes > max_message_bytes={settings.max_message_bytes}"
        elif int(time.time() * 1000) - m.accepted_ms > settings.ttl_seconds * 1000:
            reason, detail = reasons.TTL, f"older than ttl_seconds={settings.ttl_seconds}"
        if not reason:
            return None
        log.warning("discarding message %s of %s: %s (%s)", keys.id_text(m.id), m.topic,
                    reason, detail)
        return (Discard(reason, m.topic, keys.id_text(m.id), m.accepted_ms, r, detail=detail),
                Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=reason))

    def stats(self) -> dict[str, Any]:
        return {"identity": self.identity, "fenced": self._fenced,
                "ready": self._producer is not None}
