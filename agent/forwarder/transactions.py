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

A transaction Kafka refused a message of (too large, a bad timestamp, a record the topic
cannot take: failures.py's isolating errors) is aborted, a certain outcome, and done again at
once with the same producer: the suspects are then sent alone, each between two flushes, so
the broker's answer is about that message only (isolation.py). One refused alone is
discarded with Kafka's reason and the transaction done again without it; every other message
and topic goes on, delayed by one or two transactions.

A broker out of this agent's reach while the rest of the cluster answers (brokers.py): the
transaction waiting on it is aborted at the commit limit, as certain an outcome, and the next
ones leave its partitions out; a topic whose next message is keyed for one of them waits at
that message (docs/design.md, "One broker out of reach").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from agent import reasons
from agent.buffer import codec, keys
from agent.buffer.store import Corrupt, DeliveredRun, Outcome, Store, StoredMessage, message
from agent.config import FerryConfig, TopicConfig
from agent.forwarder import eligibility, failures, isolation, producing, timestamps
from agent.forwarder.clusters import Cluster, producer_config
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.forwarder.held_topics import HeldTopics
from agent.forwarder.partitioner import TopicLayout, choose, waits_for_reach
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
from agent.forwarder.suspects import Suspects
from agent.forwarder.topic_limits import ALONE
from agent.forwarder.transaction_size import TransactionSize, fitting
from agent.metrics import Registry
from agent.process.log_limit import LogLimit
from agent.record_batch import RECORD_OVERHEAD  # a record's weight in a batch, beside its value

log = logging.getLogger(__name__)

NOTE = "committed in transaction"
CLUSTER = "local"
# Kafka calls that wait for the cluster give up after this long (then: reopen, reconcile);
# a transaction's own flushes and commit wait forwarder.transaction_commit_timeout_ms.
CALL_TIMEOUT = 30.0
RETRY_INITIAL = 0.5
RETRY_MAX = 10.0
READ_BATCH = 2000
FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED}
# After an abort every message has its outcome; their reports come within this.
ABORTED_REPORTS_TIMEOUT = 5.0
# How long a produce() refused with "Erroneous state" waits for the report of the refusal
# behind it.
STATE_REPORTS_TIMEOUT = 1.0
# Reports that say librdkafka gave the open transaction up itself (it purges what was queued
# when a send failed inside it): the refusal behind them may not be reported yet.
PURGED = {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}
# How often the messages waiting for a transaction are counted (unanswered), at most.
WAITING_COUNT_INTERVAL = 1.0
# How long the sender waits between looks at the buffer (seconds): while exactly-once
# messages are buffered, and while none is. Each look opens a read transaction of the
# buffer: at 100 a second this thread took 2.5 % of a core on an agent with no exactly-once
# topic at all, more than the rest of the idle forwarder; at 20 a second, the first
# exactly-once message after a quiet spell waits at most 50 ms more, less than a commit.
BUSY_WAIT = 0.01
IDLE_WAIT = 0.05


def _report(sink: list[tuple[bytes, KafkaError | None, Message]], message_id: bytes,
            err: KafkaError | None, msg: Message) -> None:
    # The delivery callback of one send, bound to its id by a partial. Runs inside poll()
    # or flush() on this thread: just record; _commit does the work.
    sink.append((message_id, err, msg))


def _timed_out(exc: BaseException) -> bool:
    """True when ``exc`` says a transaction was not acknowledged or committed in time: the
    flush's deadline, or librdkafka's message.timeout.ms (the same length), whichever came
    first."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(err, KafkaError) and err.code() in (KafkaError._TIMED_OUT,
                                                          KafkaError._MSG_TIMED_OUT)


def _refusal(err: KafkaError | None) -> bool:
    """A report that Kafka refused its message, its batch or its topic, or that librdkafka
    purged the queue of a transaction a refusal made abortable."""
    return err is not None and (failures.isolates(err.code())
                                or failures.needs_operator(err.code())
                                or err.code() in PURGED)


# The transactional producer's name in the cluster's broker watch (brokers.py).
STATS_SOURCE = "transactions"


class Refused(Exception):
    """A message sent alone inside the open transaction was refused: abort and decide."""


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
    unflushed: int = 0  # bytes produced since the last flush, for a topic's batch limit


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
        self.commit_timeout = fwd.transaction_commit_timeout_ms / 1000.0
        self.progress_topic = fwd.progress_topic
        local = config.kafka.local
        self._producer_conf = producer_config(CLUSTER, "all", local, fwd)
        self._producer_conf.update({
            "transactional.id": self.transactional_id,
            # A transaction of a process that died is settled by the next init_transactions
            # at the latest; this bounds how long it holds read_committed readers back
            # should no successor come.
            "transaction.timeout.ms": 60_000,
            # A message not acknowledged by the time its transaction is given up fails with
            # it, rather than lingering in the queue of a producer about to be dropped.
            "message.timeout.ms": fwd.transaction_commit_timeout_ms,
        })
        # A client.id of [kafka.local.properties] names this producer too, as it names the
        # others: what an operator's quota on that client id counts is all of Ferry's traffic.
        if "client.id" not in local.properties:
            self._producer_conf["client.id"] = "ferry-local-transactions"
        self._client_conf = client_config(local.bootstrap_servers, dict(local.properties))
        self._producer: Producer | None = None
        # Closed after idle_seconds with no exactly-once message buffered (_park_when_idle):
        # its connections (one to the transaction coordinator librdkafka keeps open, one it
        # keeps to the cluster) would otherwise stay while the agent idles. 0: never.
        self.idle_seconds = local.idle_connection_seconds
        self._parked = False  # closed idle, everything settled: reopened without reconciling
        self._active = 0.0  # when the producer last opened or committed (monotonic)
        self._progress: dict[str, Progress] = {}
        self._cursors: dict[str, bytes | None] = {}
        # (message id, error, message) per delivery report, in the order they come.
        # A new list for each transaction: reports of an aborted one that come late (its
        # purged messages) go to the old list, never into the next transaction's.
        self._reports: list[tuple[bytes, KafkaError | None, Message]] = []
        self._scanned = 0  # reports already looked at for a refusal (_refused_yet)
        self._fenced = ""
        self._fenced_error = ""  # a fencing reported by the producer's error callback
        self._in_transaction = False
        self._retry_at = 0.0
        self._backoff = RETRY_INITIAL
        self._topic_ready: set[str] = set()  # reconciled since the producer was opened
        # Messages Kafka refused a batch of: sent in windows until each has its verdict.
        self._suspects = Suspects()
        # Topics held out of the transactions for a while (an ACL, the clocks apart).
        self._held = HeldTopics()
        self._limited = LogLimit(log)
        # Bytes a transaction may hold besides transaction_max_messages: sized from the rate
        # the last one achieved, so a throttled cluster (a quota) gets transactions it can
        # finish in time (transaction_size.py).
        self._size = TransactionSize(self.commit_timeout)
        # When the open transaction began, and when it stopped collecting to be flushed and
        # committed: what the cluster's pace decides is the time from there.
        self._started = self._committing = 0.0
        self._rotation = 0  # which topic reads first: a small budget starves none
        # What the open transaction sent: id -> (topic, stored value), for the verdict on a
        # refused one. Bounded by transaction_max_messages; cleared as each one begins.
        self._sent: dict[bytes, tuple[str, bytes]] = {}
        # What the cluster's state reads of the transactions (cluster_watch.py, on the
        # forwarder's thread; an int written here only): a count of the local cluster's
        # answers to them, each acknowledged send and each commit, that only grows.
        self.answers = 0
        # Exactly-once messages buffered while no transaction is open (the producer being
        # opened, a topic reconciled, a back-off after trouble): they wait on the cluster as
        # much as the open transaction's. Counted at most once a second.
        self._waiting = 0
        self._waiting_at = 0.0
        self._owned = False  # exactly-once messages buffered, at the last look (_step)
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
                self._stop.wait(BUSY_WAIT if self._owned else IDLE_WAIT)

    def _step(self) -> bool:
        if self._fenced:
            self._waiting = 0  # reported as the fence, by name: not the cluster's silence
            return False
        if time.monotonic() < self._retry_at:
            return False
        now = time.monotonic()
        owned = [t for t in self.store.topics() if self.owns(t)]
        self._owned = bool(owned)
        topics = [t for t in owned if not self._held.waiting(t, now)]
        if not owned:
            self._park_when_idle(now)
        if not topics:
            self._waiting = 0
            return False
        if now >= self._waiting_at:
            self._waiting_at = now + WAITING_COUNT_INTERVAL
            wanted = set(topics)
            self._waiting = sum(s.messages for s in self.store.topic_stats()
                                if s.topic in wanted)
        if self._producer is None:
            if self._parked:
                self._producer = self._new_producer()
                self._parked = False
                log.info("exactly-once: transactional producer reopened after idling")
            else:
                self._open()
            self._active = time.monotonic()
        for t in topics:
            if t not in self._topic_ready:
                self._reconcile(t)
        worked = self._transaction(topics)
        if worked:
            self._active = time.monotonic()
        return worked

    def _park_when_idle(self, now: float) -> None:
        """Close the transactional producer once no exactly-once message has been buffered
        for ``idle_seconds``. Only between transactions, every one of them settled (committed
        or aborted, its messages removed from the buffer or read again): what the progress
        records and the cursors say stays true, so the next message reopens a producer
        (init_transactions) and goes on without a read-back (docs/design.md,
        "Connections")."""
        if (self._producer is None or self._in_transaction or self.idle_seconds <= 0
                or now - self._active < self.idle_seconds):
            return
        p, self._producer = self._producer, None
        self._parked = True
        p.flush(0)
        p.close()
        log.info("exactly-once: transactional producer closed after %.0f s without "
                 "exactly-once messages; the next one reopens it", now - self._active)

    def _trouble(self, exc: BaseException) -> None:
        fenced = self._fenced_error or _fenced_detail(exc)
        if fenced:
            self._fence(fenced)
            return
        err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
        if isinstance(err, KafkaError) and failures.answered(err.code()):
            self.answers += 1  # the cluster answered (an ACL, say): its state stays up
        if isinstance(err, KafkaError) and failures.needs_operator(err.code()):
            # An ACL (transactional id, progress group) or credentials: every exactly-once
            # topic waits, and says so by name, as a topic an ACL denies does.
            for topic in self.store.topics():
                if self.owns(topic):
                    self._hold(topic, err, operator=True,
                               detail=f"{err.str()}: {failures.policy(err.code()).why}")
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
        self._parked = False  # reopened in full: ensure the progress topic, reconcile
        self._topic_ready.clear()
        self._cursors.clear()
        if p is not None:
            # Nothing of an unfinished transaction counts: the next instance's
            # init_transactions settles it and the reconciliation reads what became of it.
            p.purge(in_queue=True, in_flight=True)
            p.flush(0)
        # After the purge: its reports (purged) count for nothing.
        self._new_reports()

    # -- opening and reconciling ------------------------------------------------------------------
    def _open(self) -> None:
        ensure_topic(self._client_conf, self.progress_topic, CALL_TIMEOUT,
                     admin=self.cluster.admin())
        p = self._new_producer()
        # After init_transactions: the previous instance's transaction is settled, so what
        # read_committed shows now is final.
        self._progress = read_progress(self._client_conf, self.progress_topic, self.identity,
                                       CALL_TIMEOUT)
        self._producer = p
        log.info("exactly-once: transactional producer ready; progress known for %d topics",
                 len(self._progress))

    def _new_producer(self) -> Producer:
        """A transactional producer, initialised: its init_transactions settles whatever
        transaction the previous one of this identity left open."""
        conf = dict(self._producer_conf)
        conf["error_cb"] = self._client_error
        self.cluster.watch_brokers(conf, STATS_SOURCE)
        p = Producer(conf)
        try:
            p.init_transactions(CALL_TIMEOUT)
        except KafkaException:
            p.flush(0)
            raise
        return p

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
        cursors, progress = dict(self._cursors), dict(self._progress)
        try:
            return self._transaction_once(p, topics)
        except (KafkaException, Refused) as exc:
            if _fenced_detail(exc):
                raise
            # What was acknowledged before the failure: read before a refusal's abort
            # starts the next transaction's reports.
            sent, acked = self._sent_bytes()
            # Not in time: the flush's deadline, or librdkafka's message.timeout.ms first
            # (then librdkafka purges the rest of the queue, which _flush takes for a
            # refusal, and the abort below finds none).
            late = _timed_out(exc) or any(
                err is not None and err.code() == KafkaError._MSG_TIMED_OUT
                for _, err, _ in self._reports)
            if self._abort_refused(p, exc, late):
                # Aborted: nothing of it counts. Read again from where it began.
                self._cursors, self._progress = cursors, progress
                return True
            if late:
                self._give_up_timed_out(sent, acked)
            raise

    def _sent_total(self) -> int:
        """Bytes the open transaction sent (stored values: what its budget counts)."""
        return sum(len(v) for _, v in self._sent.values())

    def _sent_bytes(self) -> tuple[int, int]:
        """Bytes the open transaction sent, and those of them acknowledged so far."""
        acked = 0
        for mid, err, _ in self._reports:
            if err is None and mid in self._sent:
                acked += len(self._sent[mid][1])
        return self._sent_total(), acked

    def _give_up_timed_out(self, sent: int, acked: int) -> None:
        """The open transaction was not acknowledged or committed within the commit timeout
        (a quota, a slow cluster, a broker out of reach): the next one is sized from the
        rate this one achieved."""
        now = time.monotonic()
        seconds = now - max(self._started, self._committing)
        self._size.timed_out(sent, acked, seconds, now)
        if self._in_transaction:  # else counted by its abort already
            self._in_transaction = False
            self.registry.inc("transactions_aborted", reason="timed_out")
        log.warning("exactly-once: a transaction of %d bytes was not committed within %.0f s "
                    "(%d bytes acknowledged: %.0f bytes/s); the next ones hold up to %s bytes",
                    sent, self.commit_timeout, acked, acked / max(seconds, 1e-3),
                    self._size.budget)

    def _abort_refused(self, p: Producer, exc: BaseException, late: bool = False) -> bool:
        """After a failure inside a transaction: if Kafka refused messages of it (their
        batch, or their topic, as an ACL does), abort it (a certain outcome), decide each
        refused message's fate, hold each refused topic back, and go on with a new producer
        of the same transactional id, without reconciling. False when the failure was
        anything else (the caller reopens and reconciles, as after any uncertain outcome)."""
        if not self._in_transaction:
            return False
        p.poll(0)  # serve the reports of the sends that failed
        err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
        if (not self._refused_in() and isinstance(err, KafkaError)
                and err.code() == KafkaError._STATE):
            # A refused batch makes the transaction abortable, and the next produce() may
            # say only that ("Erroneous state") before the refusal's report is served.
            p.flush(STATE_REPORTS_TIMEOUT)
        # Not in time while a broker is out of reach: its sends never came back. Aborted,
        # that is as certain an outcome as a refusal's (below).
        stranded = late and self.cluster.partial()
        if not self._refused_in() and not stranded:
            return False
        try:
            p.abort_transaction(CALL_TIMEOUT)
        except KafkaException:
            return False  # not abortable after all: reopen and reconcile
        # Every report of the aborted transaction, the refused ones among them.
        p.flush(ABORTED_REPORTS_TIMEOUT)
        refused, denied = self._refusals(), self._denials()
        errors = Counter(err.name() for _, err, _ in self._reports if err is not None)
        self._new_reports()
        self._in_transaction = False
        if not refused and not denied:
            log.warning("exactly-once: transaction aborted (%s); its reports: %s", exc,
                        dict(errors) or "none failed")
            self.registry.inc("transactions_aborted", reason="timed_out" if late else "failed")
            if not stranded:
                return False  # aborted for something else: reopen and reconcile, as before
            # Nothing to reconcile (that would read partitions the broker out of reach
            # leads, and wait on it); the transactions keep their size (the sends that did
            # not return say nothing of the rate the cluster takes). The new producer's epoch
            # fences whatever of the old one's sends lands late.
            self._replace_producer()
            log.warning("exactly-once: a transaction waiting on a broker out of reach (%s) "
                        "aborted; the next ones leave its partitions out",
                        self.cluster.unreachable_text())
            return True
        # librdkafka (2.16) leaves a producer whose transaction had a refused send unable
        # to send in the next one: its sequence numbers want an epoch bump it does not make.
        # A new producer of the same transactional id starts clean; the abort was certain,
        # so nothing needs reconciling.
        self._replace_producer()
        self.registry.inc("transactions_aborted", reason="refused")
        for topic, denial in denied.items():
            self._hold(topic, denial, operator=True)
        by_topic: dict[str, list[bytes]] = {}
        for mid in refused:
            sent = self._sent.get(mid)
            if sent is not None and sent[0] not in denied:
                by_topic.setdefault(sent[0], []).append(mid)
        for topic, mids in by_topic.items():
            new = sum(1 for m in mids if m not in self._suspects)
            if new:
                self.registry.inc("messages_isolated", new, topic=topic)
            self._suspects.refused(topic, mids, [m for m, (t, _) in self._sent.items()
                                                 if t == topic])
            alone_topic = self.cluster.batch(topic) == ALONE
            for mid in mids:
                if alone_topic or self._suspects.alone(mid):
                    self._judge(mid, refused[mid])
        return True

    def _refused_in(self) -> bool:
        """True when the open transaction's reports show Kafka refused a message or a
        topic of it, or that librdkafka purged its queue after such a refusal."""
        return any(_refusal(err) for _, err, _ in self._reports)

    def _replace_producer(self) -> None:
        old, self._producer = self._producer, None
        if old is not None:
            old.purge(in_queue=True, in_flight=True)
            old.flush(0)
        self._producer = self._new_producer()

    def _denials(self) -> dict[str, KafkaError]:
        """The topics of the open transaction refused whole, with an error only a person can
        fix (failures.py: an ACL, a topic missing)."""
        denied: dict[str, KafkaError] = {}
        for mid, err, _ in self._reports:
            if err is not None and failures.needs_operator(err.code()):
                sent = self._sent.get(mid)
                if sent is not None:
                    denied.setdefault(sent[0], err)
        return denied

    def _hold(self, topic: str, err: KafkaError, *, operator: bool, detail: str = "") -> None:
        """Hold ``topic`` out of the transactions for a while (held_topics.py)."""
        detail = detail or err.str()
        self.registry.inc("delivery_failures", topic=topic, cluster=CLUSTER, error=err.name())
        self.registry.sample("error", err.name(), {"topic": topic, "cluster": CLUSTER,
                                                   "detail": detail})
        wait = self._held.hold(topic, err.name(), detail, operator, CLUSTER)
        self._limited.log(logging.ERROR if operator else logging.WARNING, f"held:{topic}",
                          "exactly-once topic %s held back %.0f s: %s (%s); its messages "
                          "wait in the buffer, the other topics go on", topic, wait,
                          err.name(), detail)

    def _refusals(self) -> dict[bytes, KafkaError]:
        """The messages of the open transaction Kafka refused (or refused the batch of)."""
        return {mid: err for mid, err, _ in self._reports
                if err is not None and failures.isolates(err.code())}

    def _judge(self, mid: bytes, err: KafkaError) -> None:
        """A message sent alone in an aborted transaction was refused: isolation.py
        decides."""
        stored = self._stored(mid)
        if stored is None:
            self._suspects.judged(mid)
            return
        r = stored.record
        verdict = isolation.verdict(err.code(), True, mid in self._suspects.restamp,
                                    r.timestamp_ms, stored.accepted_ms,
                                    int(time.time() * 1000))
        detail = f"{err.name()}: {err.str()}"
        if verdict == "restamp":
            self._suspects.restamp.add(mid)
            self.registry.inc("messages_restamped", topic=r.topic)
        elif verdict == "clock_skew":
            # Kept: it becomes acceptable as the clocks meet. Its topic waits meanwhile
            # (its order), the other topics go on.
            skew = (r.timestamp_ms - time.time() * 1000) / 1000.0
            self._hold(r.topic, err, operator=True, detail=(
                f"{detail}: message {keys.id_text(mid)} has a timestamp {skew:+.0f} s from "
                "this host's clock, outside the topic's limits by the broker's: are the "
                "clocks apart?"))
        elif verdict == "discard":
            self._suspects.judged(mid)
            self.registry.inc("messages_refused", topic=r.topic, cluster=CLUSTER,
                              error=err.name())
            self._discard_now(stored, reasons.INVALID, f"{CLUSTER}: refused alone: {detail}")

    def _stored(self, mid: bytes) -> StoredMessage | None:
        """The message ``mid`` as the aborted transaction sent it (decoded)."""
        sent = self._sent.get(mid)
        if sent is None:
            return None
        m = message(sent[0], mid, sent[1])
        return m if isinstance(m, StoredMessage) else None

    def _discard_now(self, m: StoredMessage, reason: str, detail: str) -> None:
        """Discard ``m`` outside any transaction: in the discard log, then out of the
        buffer (the same order as everywhere: a crash between leaves it in both)."""
        log.warning("discarding message %s of %s: %s (%s)", keys.id_text(m.id), m.topic,
                    reason, detail)
        self.discard_log.write([Discard(reason, m.topic, keys.id_text(m.id), m.accepted_ms,
                                        m.record, detail=detail)])
        outcome = Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=reason)
        self.store.remove_many([outcome], [])
        self._signal_outcomes((), [m.key])
        self.registry.inc("messages_discarded", topic=m.topic, reason=reason)
        self.registry.sample("discarded", reason, {"topic": m.topic,
                                                   "id": keys.id_text(m.id), "detail": detail})

    def _transaction_once(self, p: Producer, topics: list[str]) -> bool:
        self._started = started = time.monotonic()
        self._sent.clear()
        self._new_reports()
        self._suspects.begin()
        held: set[str] = set()  # topics that wait for the next transaction (a window used)
        batches: dict[str, _Batch] = {}
        discards: list[Discard] = []
        outcomes: list[Outcome] = []
        count = 0
        used = 0  # bytes read into this transaction, counted only under a budget
        begun = False
        # Each transaction starts with the next topic: under a budget that one topic's
        # messages could fill alone, every topic still gets its turn.
        first = self._rotation % len(topics)
        self._rotation += 1
        order = topics[first:] + topics[:first]
        while count < self.max_messages and not self._stop.is_set():
            read_any = False
            for n, topic in enumerate(order):
                if topic in held:
                    continue
                if self.cluster.layout(topic) is None and not self.cluster.known_missing(topic):
                    continue  # partitions being looked up
                room = min(READ_BATCH, self.max_messages - count)
                left = self._size.room(used)
                if room <= 0 or left == 0:
                    break
                after = self._cursors.get(topic)
                values = self.store.read_values(topic, after, room)
                if not values:
                    continue
                if left is not None:
                    # An equal share of what the budget has left for each topic this pass
                    # still reads; what one leaves, the next pass gives to the others.
                    share = left // (len(order) - n)
                    values = values[:fitting([len(v) for _, v in values], share)]
                    used += sum(len(v) for _, v in values)
                read_any = True
                # Past everything read: a failure from here drops the producer, and that
                # clears the cursors (reconciled and read again).
                self._cursors[topic] = values[-1][0]
                b = batches.get(topic) or _Batch(DeliveredRun(topic, CLUSTER, note=NOTE))
                sent, stopped = self._send_values(p, topic, values, after, b, discards,
                                                  outcomes)
                if stopped:
                    held.add(topic)
                if sent:
                    batches[topic] = b
                    begun = True
                    count += sent
            if not begun and not discards:
                return False  # nothing to send
            if time.monotonic() - started >= self.interval or self._size.room(used) == 0:
                break
            p.poll(0 if read_any else 0.005)
        if discards:
            # Before the commit: a crash after it must find each discard in the log.
            self.discard_log.write(discards)
        if begun:
            self._in_transaction = True
            self._commit(p, batches, started)
            self._in_transaction = False
            delivered = [i for b in batches.values() for i in b.run.ids]
            self._signal_outcomes(delivered, ())
            self._suspects.delivered(batches, delivered)
            self._held.delivered(batches)
            now = time.monotonic()
            self._size.committed(self._sent_total(), now - self._committing, now)
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
                     after: bytes | None, b: _Batch, discards: list[Discard],
                     outcomes: list[Outcome]) -> tuple[int, bool]:
        """Send one read of ``topic`` inside the open transaction: the number sent, and True
        when the rest of the read waits for the next transaction (a suspect met after the
        topic's one window of this transaction; the cursor is put back before it).

        As in the at-least-once loop (send.py, ``Sending._send_values``), a plain message
        goes out from its stored value without a Record or StoredMessage, decoded by the same
        ``plain_values``; the producer gets slices of the value, positionally. Anything else
        takes ``_unsendable`` and ``_produce``, with the same rules. Suspects go out in a
        window (suspects.py)."""
        settings = self.topic_settings(topic)
        gen = self.store.generation(topic)
        layout = self.cluster.layout(topic)
        has_pk, hash_key = codec.HAS_PARTITION_KEY, codec.HASH_KEY
        # The oldest message read is younger than the TTL: none of them needs the check.
        check_ttl = (int(time.time() * 1000) - keys.id_timestamp_ms(values[0][0])
                     > settings.ttl_seconds * 1000)
        prefix = f"{self.identity}:".encode()  # tag(): identity ":" hex id
        base = len(topic) + 1 + keys.ID_LEN  # stored bytes besides the value: topic NUL id
        produce = producing.positional(p)
        reports = self._reports
        ids, sizes = b.run.ids, b.run.sizes
        suspects = self._suspects
        # A topic limited below librdkafka's batch size (topic_limits.py): the producer is
        # flushed before a batch of it would pass the limit (one transactional producer
        # serves every topic, so its batch size cannot be the topic's).
        batch = self.cluster.batch(topic)
        window = size = 0  # suspects still to go in the open window, and its size
        # Messages older than the topic takes (a long outage) are re-stamped (timestamps.py).
        now_ms = int(time.time() * 1000)
        limits = self.cluster.limits(topic)
        oldest = timestamps.oldest_fresh(limits.before_max_ms if limits else None, now_ms)
        sent = 0
        last = after
        # A transaction begins with the first message sent (a read of discards alone
        # needs none).
        open_ = self._in_transaction
        # A partial failure (a broker out of this agent's reach): a keyed message whose
        # partition it leads would hold the whole transaction until the commit limit, every
        # topic's messages with it. Its topic waits at that message instead (the buffer's
        # order is what the progress records rest on, so nothing after it goes either);
        # keyless messages go round-robin over the reachable partitions.
        partial_failure = layout is not None and bool(layout.reachable)
        for mid, v, flags, ts, pk, key, value in plain_values(values, gen, check_ttl,
                                                              settings.max_message_bytes,
                                                              oldest):
            if partial_failure:
                waits = self._waits_for_reach(topic, layout, settings, gen, mid, v, flags, pk,
                                              key)
                if waits is not None:
                    if window:
                        self._close_window(p)
                    self._cursors[topic] = last  # read again from here next time
                    return sent, True
            suspect = bool(suspects) and mid in suspects
            if suspect and not window:
                size = window = suspects.open_window(topic)
                if not window:
                    self._cursors[topic] = last  # read again from here next time
                    return sent, True
                self._flush(p)  # nothing before the window shares its batches
                b.unflushed = 0
            if flags == NOT_PLAIN or batch == ALONE or suspect:
                m = message(topic, mid, v)
                dropped = self._unsendable(m, settings, gen)
                if dropped is not None:
                    discards.append(dropped[0])
                    outcomes.append(dropped[1])
                    last = mid
                    continue
                assert isinstance(m, StoredMessage)
                if not open_:
                    p.begin_transaction()
                    self._in_transaction = open_ = True
                self._sent[mid] = (topic, v)
                if (mid not in suspects.restamp and timestamps.waited_too_long(
                        m.record.timestamp_ms, m.accepted_ms, now_ms, oldest)):
                    suspects.restamp.add(mid)
                    self.registry.inc("messages_restamped", topic=topic)
                if batch == ALONE:
                    self._produce_alone(p, m)
                else:
                    self._produce(p, m)
                ids.append(mid)
                sizes.append(m.stored_bytes)
            else:
                if not open_:
                    p.begin_transaction()
                    self._in_transaction = open_ = True
                if batch:
                    weight = len(v) + RECORD_OVERHEAD
                    if b.unflushed + weight > batch:
                        self._flush(p)
                        b.unflushed = 0
                    b.unflushed += weight
                partition = choose(layout, pk if flags & has_pk else None,
                                   bool(flags & hash_key))
                headers: list[tuple[str, str | bytes | None]] = [
                    (HEADER, prefix + mid.hex().encode())]
                while True:
                    try:
                        # Positional, in producing.Positional's order (topic, value, key,
                        # partition, on_delivery, None, timestamp, headers).
                        produce(topic, value, key, partition, partial(_report, reports, mid),
                                None, ts, headers)
                        break
                    except BufferError:
                        p.poll(0.05)  # the producer's queue is full: let it drain
                self._sent[mid] = (topic, v)
                ids.append(mid)
                sizes.append(base + len(v))
            b.last_id = mid
            last = mid
            sent += 1
            if window:
                suspects.in_window(mid, size)
                window -= suspect
                if not window:
                    self._close_window(p)
        if window:
            self._close_window(p)
        return sent, False

    def _waits_for_reach(self, topic: str, layout: TopicLayout | None, settings: TopicConfig,
                         gen: int, mid: bytes, v: bytes, flags: int, pk: int,
                         key: bytes | None) -> int | None:
        """The partition this message must wait for (partitioner.waits_for_reach), noted on
        the topic's row; None when it can go, or when it is not to be sent at all (corrupt,
        expired, too large...: the general path discards it, by eligibility.py's rule, rather
        than holding its topic for a partition it will never be sent to)."""
        if flags == NOT_PLAIN:
            m = message(topic, mid, v)
            if not isinstance(m, StoredMessage) or eligibility.judge(
                    m, settings, gen, settings.max_message_bytes,
                    int(time.time() * 1000)) is not None:
                return None
            r = m.record
            partition = waits_for_reach(layout, r.partition_key, r.hash_key, r.key)
        else:
            partition = waits_for_reach(layout, pk if flags & codec.HAS_PARTITION_KEY else None,
                                        bool(flags & codec.HASH_KEY), key)
        if partition is not None:
            self._held.waits(topic, "BROKER_OUT_OF_REACH",
                             f"keyed messages wait for partition {partition}, whose leader "
                             f"this agent cannot reach ({self.cluster.unreachable_text()}); "
                             "the topic goes on when it answers", CLUSTER)
        return partition

    def _produce(self, p: Producer, m: StoredMessage) -> None:
        r = m.record
        partition = choose(self.cluster.layout(r.topic), r.partition_key, r.hash_key)
        headers: list[tuple[str, str | bytes | None]] = [
            *r.headers, (HEADER, tag(self.identity, m.id))]
        timestamp = r.timestamp_ms
        if m.id in self._suspects.restamp:
            headers.append((timestamps.ORIGINAL, str(timestamp).encode()))
            timestamp = 0  # the send time
        while True:
            try:
                producing.produce(p, r.topic, r.value, r.key, partition=partition,
                                  on_delivery=partial(_report, self._reports, m.id),
                                  timestamp=timestamp, headers=headers)
                return
            except BufferError:
                p.poll(0.05)  # the producer's queue is full: let it drain

    def _new_reports(self) -> None:
        self._reports = []
        self._scanned = 0

    def _refused_yet(self) -> bool:
        """True when a report since the last look says Kafka refused a message or a topic
        of the open transaction (which is then abortable: nothing more of it will go), or
        that librdkafka purged its queue after such a refusal."""
        reports = self._reports
        new, self._scanned = reports[self._scanned:], len(reports)
        self.answers += sum(1 for _, err, _ in new if err is None)
        return any(_refusal(err) for _, err, _ in new)

    def _flush(self, p: Producer) -> int:
        """``p.flush``, in short steps that look for a refusal: after one, the transaction
        is abortable and its queued messages never go, so a plain flush would wait the whole
        commit timeout for them. ``Refused`` at once instead; else the messages left."""
        deadline = time.monotonic() + self.commit_timeout
        while True:
            left = p.flush(min(0.1, max(deadline - time.monotonic(), 0.0)))
            if self._refused_yet():
                raise Refused("Kafka refused messages of the transaction")  # reports kept
            if not left or time.monotonic() >= deadline:
                return int(left)

    def _close_window(self, p: Producer) -> None:
        """Flush a window's messages out; ``Refused`` when Kafka refused any of them."""
        self._flush(p)

    def _produce_alone(self, p: Producer, m: StoredMessage) -> None:
        """Send ``m`` in a batch of its own: everything before it is flushed first, and it
        is flushed before anything follows; its answer is then about it alone. Refused:
        ``Refused``, and the transaction is aborted and done again without it."""
        self._flush(p)
        self._produce(p, m)
        self._flush(p)

    def _signal_outcomes(self, delivered: Iterable[bytes], discarded: Iterable[bytes]) -> None:
        if self._signal is not None:
            self._signal(delivered, discarded)

    def _commit(self, p: Producer, batches: dict[str, _Batch], started: float) -> None:
        self._committing = time.monotonic()
        left = self._flush(p)
        if left:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            f"{left} messages not acknowledged in time"))
        # Every report is in, and _flush found no refusal among them.
        reports = self._reports
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
            producing.produce(p, self.progress_topic, self._progress[topic].encode(),
                              progress_key(self.identity, topic))
        p.commit_transaction(self.commit_timeout)
        self.answers += 1
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
        """The discard of a message that must not be sent, by the rule both loops apply
        (eligibility.py); None when it may be sent."""
        why = eligibility.judge(m, settings, gen, settings.max_message_bytes,
                                int(time.time() * 1000))
        if why is None:
            return None
        if isinstance(m, Corrupt):
            return (Discard(why.reason, m.topic, keys.id_text(m.id),
                            keys.id_timestamp_ms(m.id), None, raw=m.raw, detail=why.detail),
                    Outcome(m.key, len(m.key) + len(m.raw), m.topic, "discarded",
                            reason=why.reason))
        log.warning("discarding message %s of %s: %s (%s)", keys.id_text(m.id), m.topic,
                    why.reason, why.detail)
        return (Discard(why.reason, m.topic, keys.id_text(m.id), m.accepted_ms, m.record,
                        detail=why.detail),
                Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=why.reason))

    def held(self) -> dict[str, dict[str, object]]:
        """The exactly-once topics held back, as stuck topics (held_topics.py)."""
        return self._held.view

    def unanswered(self) -> int:
        """Messages waiting on the local cluster: those the open transaction sent, until
        its commit, or those buffered while no transaction could open. Outstanding sends,
        as the other producers' queued ones are (health.py), so that a cluster answering
        metadata but committing nothing (its quorum lost) is called down for them. Read
        from the forwarder's thread: a flag, a dict's length, an int."""
        return len(self._sent) if self._in_transaction else self._waiting

    def stats(self) -> dict[str, Any]:
        return {"identity": self.identity, "fenced": self._fenced,
                "ready": self._producer is not None, "closed_idle": self._parked}
