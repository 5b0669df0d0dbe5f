"""One broker out of the agent's reach, on real Apache Kafka (issue #36, item 6): the
partitions led by the brokers it reaches keep flowing for as long as the failure lasts,
past ``message_timeout_ms``, keyed messages for them included; keyed messages for the cut
broker's partitions wait in the buffer (agent/forwarder/holding.py) and follow, in key
order, once it answers; the status names the broker and the partitions that wait within
``outage_after_seconds`` and does not call the cluster down; nothing is lost.

The broker is cut off by its TcpProxy going silent (a blackhole: connections stay open,
nothing comes back), while the brokers still replicate to each other: it stays leader of
its partitions, as in a network partition between this host and that node."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic

from ferry_client import FerryClient
from tests.agent_harness import AgentProcess, write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.apache_delivery import cluster_row, status, tally, topic_row, values
from tests.reliability.checker import wait_transactions_settled
from tests.reliability.harness import metric_total
from tests.waiting import wait_until

OUTAGE_AFTER = 6.0
MESSAGE_TIMEOUT_MS = 8000
# The exactly-once case's commit limit: the transaction open at the cut is given up after it.
COMMIT_TIMEOUT_MS = 8000
PARTITIONS = 4
# How long the cut lasts once the exactly-once case's open transaction is given up (seconds):
# ``FERRY_PARTIAL_CUT_SECONDS=90`` outlasts brokers.py's 30 s hold.
CUT_SECONDS = float(os.environ.get("FERRY_PARTIAL_CUT_SECONDS", "20"))


def _delivered(agent: AgentProcess, topic: str) -> float:
    return metric_total(agent.get_json("/status/counters"), "messages_delivered", topic=topic)


def test_one_broker_out_of_reach_stops_only_its_partitions(
    tmp_path: Path, proxied_kafka: KafkaCluster
) -> None:
    cluster = proxied_kafka
    run = uuid.uuid4().hex[:8]
    topic = f"partial-{run}"
    cluster.create_topic(topic, PARTITIONS)
    leaders = {p: cluster.leader(topic, p) for p in range(PARTITIONS)}
    cut = leaders[0]
    waiting = sorted(p for p, node in leaders.items() if node == cut)
    assert len(waiting) < PARTITIONS, f"every partition led by node {cut}: {leaders}"
    config = write_config(
        tmp_path / "agent", cluster.proxied_bootstrap, topics={topic: {"acks": "all"}},
        forwarder={"message_timeout_ms": MESSAGE_TIMEOUT_MS},
        outage_after_seconds=OUTAGE_AFTER)
    sent: list[bytes] = []
    deliverable = 0  # sent, and not keyed for a partition the cut broker leads
    with AgentProcess(config) as agent, FerryClient(agent.socket_path, timeout=30) as client:

        def send(n: int) -> None:
            # Every other message AnyPartition (free to go to any partition), the others
            # PartitionKey, the keys going round every partition: a key keeps its partition,
            # so those of the cut broker's partitions wait for it.
            nonlocal deliverable
            for _ in range(n):
                i = len(sent)
                key = (i // 2) % (2 * PARTITIONS) if i % 2 else None
                value = f"m-{i:06d}-{'' if key is None else key}".encode()
                client.send(topic, value, partition_key=key)
                sent.append(value)
                deliverable += key is None or key % PARTITIONS not in waiting

        send(100)
        wait_until(lambda: _delivered(agent, topic) >= 100, timeout=60,
                   message="first messages sent")
        proxy = cluster.proxy(cut)
        proxy.blackhole()
        t0 = time.monotonic()
        try:
            # Named within outage_after_seconds (+ the one-second statistics), while sends go
            # on: the cluster stays up.
            def named() -> bool:
                send(10)
                row = cluster_row(status(agent), "local")
                assert row["state"] != "down", row
                return any(b["node"] == cut for b in row["unreachable_brokers"])

            wait_until(named, timeout=OUTAGE_AFTER + 2, interval=0.25,
                       message=f"broker {cut} named unreachable")
            named_after = time.monotonic() - t0
            row = cluster_row(status(agent), "local")
            parts = next(b["partitions"] for b in row["unreachable_brokers"]
                         if b["node"] == cut)
            assert sorted(parts) == [f"{topic}-{p}" for p in waiting], (parts, leaders)
            health = status(agent)["health"]
            assert any(p["check"] == "broker" and f"broker {cut}" in p["message"]
                       for p in health["problems"]), health
            # Delivery goes on past message_timeout_ms: each burst's messages for the
            # reachable partitions, keyed ones included, are delivered within a message
            # timeout, however long the cut lasts. (Most within a second; when the sends that
            # were on the wire to the cut broker time out, the keyless ones are re-sent
            # first, routed around it: a pause of about the time it took to name the broker,
            # 3-6 s here; the keyed ones wait in the buffer with their partition. Before,
            # keyed messages re-sent into the cut stopped the topic a message timeout at a
            # time, for as long as it lasted.)
            waits = []
            until = time.monotonic() + MESSAGE_TIMEOUT_MS / 1000 * 2
            while time.monotonic() < until:
                t_burst = time.monotonic()
                send(50)
                wait_until(lambda: _delivered(agent, topic) >= deliverable,
                           timeout=MESSAGE_TIMEOUT_MS / 1000, interval=0.05,
                           message="deliveries go on while the broker is cut")
                waits.append(round(time.monotonic() - t_burst, 2))
                assert cluster_row(status(agent), "local")["state"] != "down"
            print(f"named after {named_after:.1f} s; {len(waits)} bursts delivered while "
                  f"cut, the slowest in {max(waits)} s, median {sorted(waits)[len(waits) // 2]} s")
            # The keyed messages of the cut partitions wait, and the topic's row says so.
            assert _delivered(agent, topic) < len(sent)
            row = topic_row(status(agent), topic)
            assert row is not None and row["stuck"] is not None, row
            assert row["stuck"]["error"] == "BROKER_OUT_OF_REACH", row
        finally:
            proxy.restore()
        # The broker answers again: the probe's reach check (probe.py) finds it within a
        # probe period or two, well before the 30 s the statistics' hold would take with
        # nothing sent to it (brokers.py, HOLD_SECONDS); then everything left is sent.
        t1 = time.monotonic()
        wait_until(lambda: cluster_row(status(agent), "local")["unreachable_brokers"] == [],
                   timeout=10, message="the broker answers again")
        answered = time.monotonic() - t1
        wait_until(lambda: agent.buffered() == {}, timeout=60, message="drained after restore")
        print(f"answering again {answered:.1f} s and drained {time.monotonic() - t1:.1f} s "
              "after the restore")
        accepted = metric_total(agent.get_json("/status/counters"), "messages_accepted",
                                topic=topic)
    assert accepted == len(sent)
    stored = values(cluster.bootstrap, topic)  # in partition, then offset order
    counted = tally(sent, stored)
    print(counted)
    assert counted.lost == [], counted
    assert _out_of_key_order(stored) == [], "a key's messages out of their order"


def _out_of_key_order(stored: list[bytes | None]) -> list[bytes]:
    """The messages that reached their partition before an older one of their key (each
    message's first copy: a duplicate re-sent later is at-least-once, not disorder)."""
    last: dict[bytes, int] = {}
    seen: set[bytes] = set()
    behind = []
    for v in stored:
        if v is None or v in seen:
            continue
        seen.add(v)
        _, number, key = v.split(b"-")
        if key:
            if int(number) < last.get(key, -1):
                behind.append(v)
            last[key] = max(last.get(key, -1), int(number))
    return behind


def _create_led_by(cluster: KafkaCluster, topic: str, replicas: list[int]) -> None:
    """A compacted one-partition topic (as the progress topic is) whose leader is
    ``replicas[0]``."""
    admin = cluster.admin()  # held until the answer: a dropped client ends its requests
    futures = admin.create_topics([NewTopic(
        topic, num_partitions=1, replication_factor=-1, replica_assignment=[replicas],
        config={"cleanup.policy": "compact"})])
    futures[topic].result(30)
    wait_until(lambda: cluster.leader(topic) == replicas[0], timeout=30,
               message=f"{topic} led by node {replicas[0]}")


def _identity_coordinated_by(cluster: KafkaCluster, node: int, prefix: str) -> str:
    """An agent identity whose transactional id's coordinator is ``node``: the
    ``__transaction_state`` partition of ``ferry-<identity>`` is led by it (made first, by
    one transactional producer, if no test has yet)."""
    try:
        cluster.transaction_coordinator("ferry-any")
    except LookupError:
        maker = Producer({"bootstrap.servers": cluster.bootstrap,
                          "transactional.id": f"{prefix}-maker"})
        maker.init_transactions(60)
        maker.close()
    return next(f"{prefix}-{i}" for i in range(64)
                if cluster.transaction_coordinator(f"ferry-{prefix}-{i}") == node)


def test_exactly_once_with_a_broker_out_of_reach_goes_on_where_it_can_and_loses_nothing(
    tmp_path: Path, proxied_kafka: KafkaCluster
) -> None:
    """The same cut, two exactly-once topics (the cut broker is neither their transaction
    coordinator nor the progress topic's leader): ``keyed`` gets AnyPartition and
    PartitionKey datagrams, ``free`` AnyPartition only. The transaction open at the cut is
    aborted at the commit limit (a certain outcome: nothing to reconcile), and the next ones
    leave the broker's partitions out: ``free`` goes on committing during the cut, routed around it;
    ``keyed`` waits at its first PartitionKey message for a partition the cut broker leads,
    and its row says so. Across the cut and the restore read_committed sees each message of
    both topics once."""
    cluster = proxied_kafka
    run = uuid.uuid4().hex[:8]
    keyed, free = f"partial-eo-{run}", f"partial-eo-free-{run}"
    for topic in (keyed, free):
        cluster.create_topic(topic, PARTITIONS)
    # Every transaction needs the transaction coordinator and the progress topic's one
    # partition: both on the node kept, so the cut one leads only the topics' partitions
    # (a cut coordinator or progress leader stops every exactly-once topic: the docs say so).
    keep, cut = sorted(node.node_id for node in cluster.nodes)
    progress = f"partial-progress-{run}"
    _create_led_by(cluster, progress, [keep, cut])
    agent_id = _identity_coordinated_by(cluster, keep, f"partial-{run}")
    eo = {"delivery": "exactly_once", "acks": "all"}
    config = write_config(
        tmp_path / "agent", cluster.proxied_bootstrap, topics={keyed: eo, free: eo},
        forwarder={"message_timeout_ms": MESSAGE_TIMEOUT_MS, "agent_id": agent_id,
                   "progress_topic": progress,
                   "transaction_commit_timeout_ms": COMMIT_TIMEOUT_MS},
        outage_after_seconds=OUTAGE_AFTER)
    sent: dict[str, list[bytes]] = {keyed: [], free: []}
    with AgentProcess(config) as agent, FerryClient(agent.socket_path, timeout=30) as client:

        def send(n: int) -> None:
            for _ in range(n):
                mine = sent[keyed]
                value = f"e-{len(mine):06d}".encode()
                # Every other message keyed, the keys going round every partition.
                client.send(keyed, value,
                            partition_key=len(mine) // 2 if len(mine) % 2 else None)
                mine.append(value)
                value = f"f-{len(sent[free]):06d}".encode()
                client.send(free, value)
                sent[free].append(value)

        send(100)
        wait_until(lambda: min(_delivered(agent, t) for t in sent) >= 100, timeout=60,
                   message="first transactions")
        leaders = {p: cluster.leader(keyed, p) for p in range(PARTITIONS)}
        assert cut in leaders.values(), leaders
        assert cluster.transaction_coordinator(f"ferry-{agent_id}") == keep
        assert cluster.leader(progress) == keep
        proxy = cluster.proxy(cut)
        proxy.blackhole()
        t0 = time.monotonic()
        try:
            wait_until(lambda: (send(10), any(
                b["node"] == cut
                for b in cluster_row(status(agent), "local")["unreachable_brokers"]))[1],
                timeout=OUTAGE_AFTER + 2, interval=0.25, message=f"broker {cut} named")
            named_after = time.monotonic() - t0
            # The transaction open at the cut ends at the commit limit, aborted; then a new
            # producer (its first connection may be to the cut broker: up to librdkafka's
            # 10 s ApiVersion timeout) and ``free`` commits again.
            before = _delivered(agent, free)
            resumed_after = None
            # Once ``free`` commits again, the longest it goes without a commit while the
            # load goes on: a broker tried again for nothing (its partitions put back into
            # a transaction) would hold it to the commit limit.
            progress, last_progress, longest_gap = before, 0.0, 0.0
            end = time.monotonic() + COMMIT_TIMEOUT_MS / 1000 + CUT_SECONDS
            while time.monotonic() < end:
                send(20)
                now, delivered = time.monotonic(), _delivered(agent, free)
                if resumed_after is None and delivered > before:
                    resumed_after = now - t0
                if delivered > progress:
                    progress, last_progress = delivered, now
                elif last_progress:
                    longest_gap = max(longest_gap, now - last_progress)
                time.sleep(0.2)  # a paced load, not a synchronisation
            wait_until(lambda: _delivered(agent, free) >= len(sent[free]), timeout=30,
                       message="every message of the free topic committed during the cut")
            drained_free = time.monotonic() - t0
            row = topic_row(status(agent), keyed)
            assert row is not None and row["stuck"] is not None, row
            assert row["stuck"]["error"] == "BROKER_OUT_OF_REACH", row["stuck"]
            keyed_during = _delivered(agent, keyed)
        finally:
            proxy.restore()
        resumed = f"{resumed_after:.1f}" if resumed_after is not None else "never"
        print(f"named after {named_after:.1f} s; free: committing again {resumed} s "
              f"after the cut, then at most {longest_gap:.1f} s without a commit, all "
              f"{len(sent[free])} committed {drained_free:.1f} s after it; keyed: "
              f"{keyed_during:.0f} of {len(sent[keyed])} committed before the restore")
        assert longest_gap < COMMIT_TIMEOUT_MS / 1000, longest_gap
        wait_until(lambda: agent.buffered() == {}, timeout=120, message="drained after restore")
        # Released by its next commit; the status reads it from the forwarder's snapshot.
        wait_until(lambda: topic_row(status(agent), keyed)["stuck"] is None,  # type: ignore[index]
                   timeout=10, message="the keyed topic's row released")
    for topic, mine in sent.items():
        wait_transactions_settled(cluster.bootstrap, topic)
        counted = tally(mine, values(cluster.bootstrap, topic, read_committed=True))
        print(topic, counted)
        assert counted.lost == [] and counted.duplicated == {}, counted
