"""Exactly-once topics on real Apache Kafka (issue #31): what a ``read_committed`` consumer gets
when the transactional producer dies mid-transaction, a broker or the transaction coordinator
is killed, a second agent takes the same identity, or the coordinator's traffic is delayed.

docs/design.md ("Exactly-once delivery") was written against tansu, which *commits* the open
transaction of a dead producer when a successor initialises; Kafka *aborts* it (KIP-98). The
progress record plus read-back of the uncertain tail must be right on both, and on Kafka the
read-back should find nothing after an abort: these tests count what it finds.

Every case counts, at a read_committed consumer, the acknowledged messages missing (lost) and
the extra copies (duplicated), and asserts both are 0, once the last commit's markers are
written (Kafka writes them after answering the commit: a reader that comes too early stops at
the start of that transaction). The shared 3-node cluster (``apache_kafka``: RF 3,
min.insync.replicas 2) serves every case but the two delayed-traffic ones, which need the
clients' traffic to pass through proxies and share a 2-node cluster of their own.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import agent.forwarder.transactions as transactions
from agent.buffer.store import Store
from agent.config import FerryConfig
from agent.forwarder.progress import Landed
from agent.metrics import Registry
from agent.records import Record
from tests.agent_harness import write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.zombie import crash_in_a_child, exactly_once_sender, stop_sender
from tests.kafka import ConsumedMessage, read_topic
from tests.reliability.checker import wait_transactions_settled
from tests.reliability.harness import Agent, metric_total
from tests.reliability.keyed_load import KeyedSender, KeyedTally, http_load, tally_of
from tests.waiting import wait_until

N = 300
KEYS = 7
PARTITIONS = 3
# Ferry's exactly-once thread gives a flush, commit or init up after this long (CALL_TIMEOUT in
# agent/forwarder/transactions.py); a hold of the coordinator's traffic must outlast it.
CALL_TIMEOUT = transactions.CALL_TIMEOUT


def _identity(hint: str) -> str:
    return f"kafka-{hint}-{uuid.uuid4().hex[:8]}"


def _committed(bootstrap: str, topic: str) -> list[ConsumedMessage]:
    """Everything a read_committed reader sees, once the last commit's markers are written
    (Kafka writes them after answering the commit)."""
    wait_transactions_settled(bootstrap, topic)
    return read_topic(bootstrap, topic, 120, read_committed=True)


def _uncommitted(bootstrap: str, topic: str) -> list[ConsumedMessage]:
    return read_topic(bootstrap, topic, 120)


def _lost_and_duplicated(expected: list[bytes], records: list[ConsumedMessage]
                         ) -> tuple[int, int]:
    counts = collections.Counter(r.value for r in records)
    lost = sum(1 for v in expected if counts[v] == 0)
    duplicated = sum(c - 1 for c in counts.values())
    return lost, duplicated


def _key_order_broken(records: list[ConsumedMessage]) -> list[bytes]:
    """Keys whose values (numbered in acceptance order) are not ascending in Kafka."""
    by_key: dict[bytes, list[bytes]] = collections.defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        assert r.key is not None and r.value is not None
        by_key[r.key].append(r.value)
    return [k for k, vs in by_key.items() if vs != sorted(vs)]


# --------------------------------------------------------------------------------------------
# 1. The zombie: the transactional producer killed mid-transaction
# --------------------------------------------------------------------------------------------


def _zombie_config(root: Path, bootstrap: str, topic: str, identity: str,
                   **forwarder: int) -> FerryConfig:
    return FerryConfig.model_validate({
        "buffer": {"path": str(root / "buffer"), "max_bytes": 64 * 1024 * 1024},
        "kafka": {"local": {"bootstrap_servers": bootstrap}},
        "forwarder": {"agent_id": identity, "linger_ms": 1, "transaction_interval_ms": 200,
                      "progress_topic": f"{topic}-progress", **forwarder},
        "topics": {topic: {"delivery": "exactly_once", "acks": "all"}},
    })


@pytest.fixture
def read_backs(monkeypatch: pytest.MonkeyPatch) -> list[Landed]:
    """What every read-back of this process found (the real one runs; it is only watched)."""
    found: list[Landed] = []
    real = transactions.find_landed

    def watched(*args: Any, **kwargs: Any) -> Landed:
        landed = real(*args, **kwargs)
        found.append(landed)
        return landed

    monkeypatch.setattr(transactions, "find_landed", watched)
    return found


@pytest.mark.parametrize("point", ["before_progress", "before_commit", "after_commit"])
def test_a_successor_aborts_the_zombie_transaction_and_sends_each_message_once(
    tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str, point: str,
    read_backs: list[Landed],
) -> None:
    """A child process runs the real sender and ``os._exit``s at ``point`` of its first
    transaction (tests/forwarder/test_exactly_once_zombie.py's child): every record of the
    batch acknowledged but no progress record; the progress record acknowledged but no commit;
    the commit done but the buffer not cleared. The successor's ``init_transactions`` makes
    Kafka abort the open transaction: the aborted copies stay in the log (a read_uncommitted
    reader sees them), a read_committed one sees each message once, in key order, and the
    read-back finds none of this agent's records (nothing of an aborted transaction is
    visible; after the commit the progress record alone covers the batch)."""
    topic = unique_topic
    apache_kafka.create_topic(topic, PARTITIONS)
    identity = _identity("zombie")
    config = _zombie_config(tmp_path, apache_kafka.bootstrap, topic, identity)
    store = Store(config.buffer.path, config.buffer.max_bytes)
    try:
        values = crash_in_a_child(config, store, topic, point)
        assert sum(s.messages for s in store.topic_stats()) == N  # nothing deleted yet
        if point != "after_commit":
            # The dead producer's records are in the log, inside a transaction still open:
            # read_committed readers stop at its first offset (the last stable offset).
            wait_until(lambda: len(_uncommitted(apache_kafka.bootstrap, topic)) == N,
                       timeout=30, message="the zombie's records in the log")
            assert read_topic(apache_kafka.bootstrap, topic, 30, read_committed=True) == []

        registry = Registry()
        successor = exactly_once_sender(config, store, registry)
        started = time.monotonic()
        successor.start()
        try:
            wait_until(lambda: sum(s.messages for s in store.topic_stats()) == 0,
                       timeout=60, message="buffer drained by the successor")
        finally:
            stop_sender(successor, 10)
        drained = time.monotonic() - started
        committed = _committed(apache_kafka.bootstrap, topic)
        in_log = _uncommitted(apache_kafka.bootstrap, topic)
    finally:
        store.close()
    lost, duplicated = _lost_and_duplicated(values, committed)
    found_by_read_back = sum(len(landed.ids) for landed in read_backs)
    print(f"\nzombie {point}: lost {lost}, duplicated {duplicated}, records in the log "
          f"{len(in_log)} (aborted copies {len(in_log) - len(committed)}), read-backs "
          f"{len(read_backs)} found {found_by_read_back}, successor drained in {drained:.1f} s")
    assert (lost, duplicated) == (0, 0)
    assert _key_order_broken(committed) == []
    assert registry.view().total("messages_delivered") == N
    # Kafka aborted the zombie's transaction: its copies are in the log, not visible.
    assert len(in_log) - len(committed) == (0 if point == "after_commit" else N)
    # The read-back ran (there were buffered messages) and found nothing: on Kafka the
    # uncertain tail is always aborted, and after the commit scan_from starts past it.
    assert read_backs and found_by_read_back == 0


# --------------------------------------------------------------------------------------------
# Running agents under keyed HTTP load (cases 3, 4, 6)
# --------------------------------------------------------------------------------------------


def _eo_agent_config(root: Path, bootstrap: str, topic: str, identity: str) -> Path:
    # ack_timeout_ms = 0: answered at fsync (202); what is under test is delivery from the
    # buffer, and a 201 wait (a transaction interval and more) would only pace the load.
    return write_config(root, bootstrap, spool=False,
                        topics={topic: {"delivery": "exactly_once", "acks": "all",
                                        "ack_timeout_ms": 0}},
                        forwarder={"agent_id": identity, "retry_backoff_max_ms": 1000})


class _Run:
    """One agent, one exactly-once topic, one keyed HTTP load thread."""

    def __init__(self, agent: Agent, topic: str) -> None:
        self.agent = agent
        self.topic = topic
        self.sender = KeyedSender("eo")
        self.thread = threading.Thread(target=http_load, args=(agent, topic, self.sender),
                                       daemon=True)
        self.t0 = time.monotonic()
        self.timeline: dict[str, float] = {}

    def mark(self, event: str) -> None:
        self.timeline[event] = round(time.monotonic() - self.t0, 1)

    def commits(self) -> float:
        return metric_total(self.agent.counters(), "transactions_committed")

    def wait_acked(self, more: int, timeout: float, why: str) -> None:
        base = len(self.sender.acked)
        wait_until(lambda: len(self.sender.acked) >= base + more, timeout=timeout,
                   message=f"{more} more messages acknowledged ({why})")

    def wait_commits(self, more: int, timeout: float, why: str) -> float:
        base = self.commits()
        wait_until(lambda: self.commits() >= base + more, timeout=timeout, interval=0.1,
                   message=f"{more} more transactions committed ({why})")
        return time.monotonic()

    def stop_load(self) -> None:
        self.sender.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the load thread did not stop"

    def drain(self, timeout: float = 120) -> None:
        wait_until(lambda: self.agent.buffered().get(self.topic, 0) == 0, timeout=timeout,
                   interval=0.2, message="exactly-once topic drained")
        self.mark("drained")


@pytest.fixture
def eo_run(tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str
           ) -> Iterator[tuple[_Run, str]]:
    """An agent on the shared cluster with load flowing and transactions committing."""
    apache_kafka.create_topic(unique_topic, PARTITIONS)
    identity = _identity("failover")
    config = _eo_agent_config(tmp_path / "agent", apache_kafka.bootstrap, unique_topic,
                              identity)
    with Agent(config) as agent:
        run = _Run(agent, unique_topic)
        run.thread.start()
        try:
            run.wait_acked(200, 30, "before the failure")
            run.wait_commits(3, 60, "before the failure")
            yield run, identity
        finally:
            run.stop_load()


def _read_back_removals(agent: Agent) -> int:
    """Buffered messages the agent found already in Kafka at a reopen (progress or
    read-back; the forwarder logs each such removal)."""
    found = re.findall(r"(\d+) buffered messages of \S+ were already committed",
                       agent.log_path.read_text(errors="replace"))
    return sum(int(n) for n in found)


def _report(run: _Run, tally: KeyedTally, **extra: Any) -> dict[str, Any]:
    counters = run.agent.counters()
    doc = {
        "timeline": run.timeline,
        "sent": tally.sent, "acked": tally.acked, "lost": tally.lost,
        "duplicates": tally.duplicates, "out_of_order": tally.out_of_order,
        "keys_split_over_partitions": tally.keys_split_over_partitions,
        "transactions_committed": metric_total(counters, "transactions_committed"),
        "transactions_aborted": metric_total(counters, "transactions_aborted"),
        "removed_at_reopen": _read_back_removals(run.agent),
        "client_errors": dict(run.sender.errors),
        **extra,
    }
    print("\n" + json.dumps(doc, indent=2))
    return doc


def _start_again(cluster: KafkaCluster, node: int) -> None:
    """Start a killed node and wait until it is a broker again. Its log recovery after a
    kill -9 can outlast the harness's 90 s start-up bound on a busy 2-core machine, so the
    wait here is longer (and bounded)."""
    cluster.start_node(node, wait=False)
    wait_until(lambda: node in cluster.live_brokers(), timeout=300, interval=0.5,
               message=f"node {node} a broker again")


def _assert_exact(tally: KeyedTally) -> None:
    assert tally.lost == 0, f"{tally.lost} acknowledged lost, e.g. {tally.lost_examples}"
    assert tally.duplicates == 0, f"{tally.duplicates} duplicates"
    assert tally.keys_split_over_partitions == 0, "a key spans partitions"
    assert tally.out_of_order == 0, f"key order broken: {tally.order_examples[:3]}"


# --------------------------------------------------------------------------------------------
# 3 and 4. kill -9 of the node that is the agent's transaction coordinator and leads one of
# the topic's partitions, mid-transaction
# --------------------------------------------------------------------------------------------


def test_a_coordinator_and_leader_killed_mid_transaction_leaves_each_message_once(
    apache_kafka: KafkaCluster, eo_run: tuple[_Run, str], artifacts_dir: Path,
) -> None:
    """kill -9 of the node leading the agent's ``__transaction_state`` partition (its
    transaction coordinator, for ``transactional.id = ferry-<agent_id>``), which also leads
    one of the topic's three partitions (Kafka spreads a new topic's leaders over the nodes),
    while transactions flow: the open transaction meets a dead coordinator and a dead
    partition leader at once. Transactions must commit again with the node down, and after
    it is started again; a read_committed reader sees every acknowledged message once, in
    key order. (One kill for both failovers: each restart of a JVM on a loaded 2-core
    machine costs a minute.)"""
    run, identity = eo_run
    node = apache_kafka.transaction_coordinator(f"ferry-{identity}")
    led = [p for p in range(PARTITIONS) if apache_kafka.leader(run.topic, p) == node]
    assert led, f"node {node} leads none of {run.topic}'s partitions"
    aborted_before = metric_total(run.agent.counters(), "transactions_aborted")
    run.mark("kill")
    killed_at = time.monotonic()
    apache_kafka.kill(node)
    # Leadership of both moves within the cluster's 4 s session timeout; the agent's next
    # transactions must commit without the node.
    first_commit = run.wait_commits(1, 90, f"node {node} down")
    run.mark("first_commit_without_the_node")
    run.wait_commits(5, 90, f"node {node} down")
    run.wait_acked(200, 30, "node down")
    assert apache_kafka.transaction_coordinator(f"ferry-{identity}") != node
    _start_again(apache_kafka, node)
    run.mark("node_started")
    run.wait_commits(5, 90, f"node {node} back")
    run.wait_acked(200, 30, "node back")
    run.stop_load()
    run.drain()
    tally = tally_of(run.sender, _committed(apache_kafka.bootstrap, run.topic))
    doc = _report(run, tally, node=node, partitions_led=led,
                  commit_stall_seconds=round(first_commit - killed_at, 1),
                  aborted_by_the_kill=metric_total(run.agent.counters(),
                                                   "transactions_aborted") - aborted_before)
    (artifacts_dir / "coordinator-kill.json").write_text(json.dumps(doc, indent=2))
    _assert_exact(tally)


# --------------------------------------------------------------------------------------------
# 5. Fencing: a second running agent with the same identity
# --------------------------------------------------------------------------------------------


def _post(agent: Agent, topic: str, values: list[bytes]) -> None:
    with httpx.Client(base_url=agent.http_url, timeout=10) as http:
        for i in range(0, len(values), 20):
            r = http.post(f"/topics/{topic}/batch", content=b"\n".join(values[i:i + 20]),
                          headers={"content-type": "application/x-ndjson"})
            assert r.status_code in (201, 202), r.text


def _eo_lines(agent: Agent) -> str:
    """The exactly-once thread's lines of an agent's log, for a failure message."""
    text = agent.log_path.read_text(errors="replace")
    return "\n".join(line[:400] for line in text.splitlines()
                     if "transactions" in line or "TXN" in line or "FENCE" in line)[-6000:]


def _values(name: str, n: int) -> list[bytes]:
    return [b"%s-%04d" % (name.encode(), i) for i in range(n)]


def test_a_second_agent_with_the_same_identity_fences_the_first_which_keeps_its_messages(
    tmp_path: Path, apache_kafka: KafkaCluster, unique_topic: str, artifacts_dir: Path,
) -> None:
    """Two agents, one ``agent_id`` (a cloned host), each its own buffer. What holds:

    - A delivers ``a1``; B starts with the same identity, and its ``init_transactions``
      fences A's producer; B delivers ``b1``.
    - A accepts ``a2`` (HTTP 202: durable in its buffer) but sends none of it: its next
      transaction meets the fence, it logs an ERROR naming the identity, its status page says
      fenced, and ``a2`` stays in its buffer whole. B is unaffected and delivers ``b2``.
    - A read_committed reader then sees exactly a1 + b1 + b2, each once.
    - A restarted with an identity of its own delivers ``a2``: every message either agent
      acknowledged is in Kafka exactly once.
    """
    topic = unique_topic
    apache_kafka.create_topic(topic, PARTITIONS)
    identity = _identity("clone")
    eo = {topic: {"delivery": "exactly_once", "acks": "all"}}
    config_a = write_config(tmp_path / "a", apache_kafka.bootstrap, topics=eo,
                            forwarder={"agent_id": identity})
    config_b = write_config(tmp_path / "b", apache_kafka.bootstrap, topics=eo,
                            forwarder={"agent_id": identity})
    a1, a2, b1, b2 = (_values(n, 100) for n in ("a1", "a2", "b1", "b2"))

    def drained(agent: Agent) -> None:
        wait_until(lambda: agent.buffered().get(topic, 0) == 0, timeout=60, interval=0.1,
                   message=f"{agent.config_path.parent.name} drained")

    with Agent(config_a) as agent_a:
        _post(agent_a, topic, a1)
        drained(agent_a)
        with Agent(config_b) as agent_b:
            _post(agent_b, topic, b1)
            drained(agent_b)
            _post(agent_a, topic, a2)
            try:
                wait_until(lambda: agent_a.get_json("/status/transactions")["fenced"],
                           timeout=60, message="agent A reports itself fenced")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- agent A ---\n{_eo_lines(agent_a)}\n"
                                     f"--- agent B ---\n{_eo_lines(agent_b)}") from None
            _post(agent_b, topic, b2)
            drained(agent_b)
            assert agent_b.get_json("/status/transactions")["fenced"] is False
            # Fenced: A holds a2 whole, and does not try again (no new producer).
            assert agent_a.buffered().get(topic, 0) == len(a2)
            while_fenced = _committed(apache_kafka.bootstrap, topic)
            assert agent_a.buffered().get(topic, 0) == len(a2)
        log_a = agent_a.log_path.read_text(errors="replace")
    stopped = [line for line in log_a.splitlines()
               if "ERROR" in line and "STOPPED" in line and identity in line]
    assert stopped, "no ERROR line saying the exactly-once topics stopped, naming the identity"
    lost, duplicated = _lost_and_duplicated(a1 + b1 + b2, while_fenced)
    leaked = sum(1 for r in while_fenced if r.value in set(a2))
    assert (lost, duplicated, leaked) == (0, 0, 0), (lost, duplicated, leaked)

    # The remedy docs/design.md gives: an identity of its own, and a restart.
    config_a = write_config(tmp_path / "a", apache_kafka.bootstrap, topics=eo,
                            forwarder={"agent_id": identity + "-a"})
    with Agent(config_a) as agent_a:
        drained(agent_a)
    final = _committed(apache_kafka.bootstrap, topic)
    lost, duplicated = _lost_and_duplicated(a1 + a2 + b1 + b2, final)
    doc = {"identity": identity, "fenced_log_line": stopped[0][:300],
           "in_kafka_while_fenced": len(while_fenced), "in_kafka_after_remedy": len(final),
           "lost": lost, "duplicated": duplicated}
    print("\n" + json.dumps(doc, indent=2))
    (artifacts_dir / "fencing.json").write_text(json.dumps(doc, indent=2))
    assert (lost, duplicated) == (0, 0)
    assert len(final) == 400


def test_a_fence_behind_the_exception_a_callback_raised_still_stops_the_topics(
    tmp_path: Path, unique_topic: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """What the test above caught on Kafka (one run in two): the fence surfaced in a poll()
    that was also serving delivery reports, so the exception that reached the sender's loop
    was CPython's ``SystemError: <function _report> returned a result with an exception
    set``, raised *from* the fatal ``_FENCED`` KafkaException. Taken for an ordinary failure,
    it made the agent reopen its producer, and that fenced the other agent in turn. The
    sender must see the fence behind it, stop, and not reopen."""
    from confluent_kafka import KafkaError, KafkaException

    config = _zombie_config(tmp_path, "127.0.0.1:9", unique_topic, _identity("unit"))
    store = Store(config.buffer.path, config.buffer.max_bytes)
    registry = Registry()
    try:
        sender = exactly_once_sender(config, store, registry)
        fenced = KafkaException(KafkaError(KafkaError._FENCED, "fenced by a newer instance",
                                           fatal=True))
        try:
            try:
                raise fenced
            except KafkaException as cause:
                raise SystemError("<function _report> returned a result with an exception "
                                  "set") from cause
        except SystemError as raised:
            sender._trouble(raised)
        assert registry.view().total("transactions_fenced") == 1
        assert sender.stats()["fenced"] == "fenced by a newer instance"
        assert any("STOPPED" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
        assert sender._step() is False  # fenced: no new producer, nothing sent
        # An unrelated failure is still one to reopen after, not a fence.
        other = exactly_once_sender(config, store, Registry())
        other._trouble(SystemError("something else"))
        assert other.stats()["fenced"] == ""
    finally:
        store.close()


# --------------------------------------------------------------------------------------------
# 6. Delayed, not dropped: the coordinator's traffic held past the producer's timeouts
# --------------------------------------------------------------------------------------------

HOLD_SECONDS = CALL_TIMEOUT + 5
# The EndTxn case: the commit gives up after transaction_commit_timeout_ms (30 s by default)
# and librdkafka's requests after request.timeout.ms (30 s by default, or message_timeout_ms
# less linger_ms). Both 10 s there, as both are 30 s by default; the hold outlasts them by
# 5 s, as HOLD_SECONDS outlasts CALL_TIMEOUT, so the new producer's InitProducerId is held
# too.
END_TXN_TIMEOUT_MS = 10_000
END_TXN_HOLD_SECONDS = END_TXN_TIMEOUT_MS / 1000 + 5


def _coordinator_log(cluster: KafkaCluster, node: int, transactional_id: str) -> list[str]:
    text = cluster.node(node).log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if transactional_id in line]


class _LogLines(logging.Handler):
    """Keeps the text of each record, not the record (nor its arguments)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_end_txn_held_past_the_commit_timeout_lands_late_and_nothing_is_sent_twice(
    tmp_path: Path, proxied_kafka: KafkaCluster, unique_topic: str,
    monkeypatch: pytest.MonkeyPatch, read_backs: list[Landed], artifacts_dir: Path,
) -> None:
    """The real sender, in this process, on 300 buffered messages; the moment its first
    transaction has every record and its progress record acknowledged, the coordinator's
    proxy is held, so the EndTxn (commit) is what waits. Ferry's commit gives up after its
    commit timeout (``transaction_commit_timeout_ms``, 10 s here, and librdkafka's request
    timeout with it), drops the producer and opens a new one, whose InitProducerId is held
    in turn until the restore; the held EndTxn reaches the coordinator after its client gave
    up (when the old connection closes, or at the restore). Whichever the coordinator
    settles first, the late commit or the new producer's epoch bump, a read_committed reader
    sees each message once: if the late EndTxn committed the batch, the successor's progress
    record covers it (nothing sent again); if it was fenced, the batch was aborted and is
    sent again (its aborted copy stays in the log, invisible)."""
    cluster = proxied_kafka
    topic = unique_topic
    cluster.create_topic(topic, 4)
    identity = _identity("endtxn")
    transactional_id = f"ferry-{identity}"
    held: list[float] = []
    coordinator: list[int] = []
    log_offset: list[int] = []

    class HoldingTheEndTxn(transactions.Producer):  # type: ignore[misc]  # untyped base
        def commit_transaction(self, *args: Any) -> None:
            if not held:
                # Records and progress record acknowledged: the hold catches the EndTxn.
                assert self.flush(30) == 0
                # Known only now: init_transactions creates __transaction_state.
                coordinator.append(cluster.transaction_coordinator(transactional_id))
                log_offset.append(cluster.node(coordinator[0]).log_path.stat().st_size)
                cluster.proxy(coordinator[0]).hold()
                held.append(time.monotonic())
            super().commit_transaction(*args)

    monkeypatch.setattr(transactions, "Producer", HoldingTheEndTxn)
    # The sender's log lines, as text: what it removed at the reopen as already committed.
    messages = _LogLines()
    sender_log = logging.getLogger("agent.forwarder.transactions")
    sender_log.addHandler(messages)
    config = _zombie_config(tmp_path, cluster.proxied_bootstrap, topic, identity,
                            transaction_commit_timeout_ms=END_TXN_TIMEOUT_MS,
                            message_timeout_ms=END_TXN_TIMEOUT_MS)
    store = Store(config.buffer.path, config.buffer.max_bytes)
    registry = Registry()
    sender = exactly_once_sender(config, store, registry)
    values = [f"m{i:05d}".encode() for i in range(N)]
    try:
        store.append([[Record(topic, v, key=f"k{i % KEYS}".encode(), hash_key=True)
                       for i, v in enumerate(values)]])
        sender.start()
        try:
            wait_until(lambda: held, timeout=60, message="the first commit reached")
            wait_until(lambda: registry.view().total("transactions_aborted") >= 1,
                       timeout=END_TXN_HOLD_SECONDS + 30, interval=0.1,
                       message="the held commit given up")
            gave_up = time.monotonic() - held[0]
            # Then hold on past the give-up, so the new producer's InitProducerId waits too:
            # the length of the delay is the point of the test.
            time.sleep(max(0.0, held[0] + END_TXN_HOLD_SECONDS - time.monotonic()))
        finally:
            if coordinator:
                cluster.proxy(coordinator[0]).restore()
        restored = time.monotonic()
        try:
            wait_until(lambda: sum(s.messages for s in store.topic_stats()) == 0,
                       timeout=120, interval=0.1, message="buffer drained after the restore")
        finally:
            stop_sender(sender, 10)
        drained = time.monotonic() - restored
    finally:
        store.close()
        sender_log.removeHandler(messages)
    committed = _committed(cluster.bootstrap, topic)
    in_log = _uncommitted(cluster.bootstrap, topic)
    lost, duplicated = _lost_and_duplicated(values, committed)
    removed = sum(int(n) for n in re.findall(
        r"(\d+) buffered messages of \S+ were already committed", "\n".join(messages.lines)))
    coordinator_lines = _coordinator_log(cluster, coordinator[0], transactional_id)
    with cluster.node(coordinator[0]).log_path.open("rb") as node_log:
        node_log.seek(log_offset[0])
        (artifacts_dir / "coordinator-node.log").write_bytes(node_log.read())
    doc = {
        "hold_seconds": END_TXN_HOLD_SECONDS, "coordinator": coordinator[0],
        "commit_gave_up_after": round(gave_up, 1),
        "drained_after_restore": round(drained, 1),
        "late_end_txn": "committed the batch" if removed == N else "fenced: batch aborted",
        "removed_at_reopen_as_already_committed": removed,
        "read_back_found": sum(len(landed.ids) for landed in read_backs),
        "records_in_log": len(in_log), "lost": lost, "duplicated": duplicated,
        "sender_warnings": [m for m in messages.lines if "exactly-once:" in m][:5],
        "transactions_aborted": registry.view().total("transactions_aborted"),
        "coordinator_log": [line[:240] for line in coordinator_lines],
    }
    print("\n" + json.dumps(doc, indent=2))
    (artifacts_dir / "late-end-txn.json").write_text(json.dumps(doc, indent=2))
    assert (lost, duplicated) == (0, 0)
    assert _key_order_broken(committed) == []
    # Either outcome, all-or-nothing: the late commit took the whole batch, or none of it.
    assert removed in (0, N)
    assert len(in_log) == (N if removed == N else 2 * N)
    assert doc["read_back_found"] == 0  # on Kafka: nothing uncertain is ever visible


def test_coordinator_traffic_held_past_the_timeouts_then_delivered_late(
    tmp_path: Path, proxied_kafka: KafkaCluster, unique_topic: str, artifacts_dir: Path,
) -> None:
    """The whole agent under keyed HTTP load; every client connection to its transaction
    coordinator is held (bytes kept in order, nothing passed on) for longer than Ferry's call
    timeout and librdkafka's request timeout, at whatever point the transaction is, then
    released: AddPartitionsToTxn, EndTxn and the next producer's InitProducerId reach the
    coordinator late (a request whose client gave up and closed the connection is passed on
    at the close). Produce requests to the other node flow.

    librdkafka (2.16) speaks transaction protocol v1 (see the protocol test below): no
    KIP-890 epoch bump per transaction on the client side. Ferry never reuses a producer
    whose transaction outcome is unknown: it drops it, and its successor's
    ``init_transactions`` bumps the epoch, fencing whatever of the old one lands late."""
    cluster = proxied_kafka
    topic = unique_topic
    cluster.create_topic(topic, 4)
    identity = _identity("delay")
    transactional_id = f"ferry-{identity}"
    config = _eo_agent_config(tmp_path / "agent", cluster.proxied_bootstrap, topic, identity)
    with Agent(config) as agent:
        run = _Run(agent, topic)
        run.thread.start()
        # Known once the sender's first InitProducerId has made __transaction_state.
        node = wait_until(lambda: cluster.transaction_coordinator(transactional_id),
                          timeout=60, interval=0.2, ignore=(LookupError,),
                          message="the transaction coordinator known")
        try:
            run.wait_acked(200, 30, "before the hold")
            run.wait_commits(3, 60, "before the hold")
            log_before = len(_coordinator_log(cluster, node, transactional_id))
            aborted_before = metric_total(agent.counters(), "transactions_aborted")
            run.mark("hold")
            cluster.proxy(node).hold()
            acked_at_hold = len(run.sender.acked)
            # The delay is the point of the test, not a synchronisation. Commits are counted
            # from 5 s in: one whose EndTxn was answered just before the hold may reach the
            # status counters (published a few times a second) a moment after it.
            time.sleep(5)
            committed_before = run.commits()
            time.sleep(HOLD_SECONDS - 5)
            committed_during = run.commits() - committed_before
            acked_during = len(run.sender.acked) - acked_at_hold
            run.mark("restore")
            cluster.proxy(node).restore()
            restored_at = time.monotonic()
            first_commit = run.wait_commits(1, 120, "after the restore")
            run.mark("first_commit_after_restore")
            run.wait_commits(5, 60, "after the restore")
            run.wait_acked(200, 30, "after the restore")
        finally:
            cluster.proxy(node).restore()
            run.stop_load()
        run.drain()
        tally = tally_of(run.sender, _committed(cluster.bootstrap, topic))
        coordinator_lines = _coordinator_log(cluster, node, transactional_id)[log_before:]
        doc = _report(run, tally, hold_seconds=HOLD_SECONDS, coordinator=node,
                      committed_during_hold=committed_during,
                      acked_during_hold=acked_during,
                      recovery_seconds=round(first_commit - restored_at, 1),
                      aborted_by_the_hold=metric_total(agent.counters(),
                                                       "transactions_aborted")
                      - aborted_before,
                      coordinator_log=[line[:240] for line in coordinator_lines])
        (artifacts_dir / "delayed.json").write_text(json.dumps(doc, indent=2))
    assert committed_during == 0, "nothing can commit while the coordinator is unreachable"
    assert acked_during > 0, "the agent kept accepting during the hold"
    _assert_exact(tally)


# --------------------------------------------------------------------------------------------
# Research: which transaction protocol librdkafka speaks to Kafka 4.1
# --------------------------------------------------------------------------------------------


def test_librdkafka_speaks_transaction_protocol_v1_to_a_cluster_with_version_2_finalized(
    apache_kafka: KafkaCluster, unique_topic: str,
) -> None:
    """A fact the tests above rest on, pinned so that an upgrade that changes it fails here
    (and the docs get updated): the cluster has ``transaction.version=2`` (KIP-890's
    transaction protocol v2) finalized, but librdkafka, confluent-kafka 2.16's client, adds
    each partition to the transaction explicitly (AddPartitionsToTxn) and ends it with an
    EndTxn below v5, i.e. protocol v1: no epoch bump per transaction on the client side.
    (librdkafka's KIP-890 support is an open request: confluentinc/librdkafka#5423.)"""
    node_log = apache_kafka.nodes[0].log_path.read_text(errors="replace")
    assert re.search(r"finalizedFeatures=\{[^}]*transaction\.version=2", node_log)
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger(f"librdkafka-protocol-{unique_topic}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Collect())
    apache_kafka.create_topic(unique_topic, 1)
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": apache_kafka.bootstrap,
                         "transactional.id": _identity("protocol"), "debug": "protocol",
                         "logger": logger})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(unique_topic, b"one")
    producer.commit_transaction(30)
    producer.flush(5)
    sent = collections.Counter(
        (m.group(1), int(m.group(2)))
        for m in (re.search(r"Sent (\w+)Request \(v(\d+)", line) for line in lines) if m)
    print(f"\nrequests sent by librdkafka: {dict(sent)}")
    end_txn = [v for (name, v) in sent if name == "EndTxn"]
    produce = [v for (name, v) in sent if name == "Produce"]
    assert any(name == "AddPartitionsToTxn" for name, _ in sent)
    assert end_txn and max(end_txn) < 5, end_txn
    assert produce and max(produce) < 12, produce
