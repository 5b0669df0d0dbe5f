"""Ack levels against real Apache Kafka (3 nodes, RF 3, ``min.insync.replicas`` 2): what each
level keeps when brokers fail, counted at a real consumer (lost, duplicated).

- A partition leader killed -9 mid-stream: ``acks = "all"`` loses nothing and keeps per-key
  order; ``acks = "leader"`` is measured, not assumed (its loss window is what the old leader
  acknowledged and had not replicated yet when it died).
- Two nodes down, so the partitions have fewer in-sync replicas than
  ``min.insync.replicas``: an ``acks = "all"`` topic keeps everything buffered, without a
  busy loop, the status documents and ``ferry status`` say why, and all of it arrives once
  the nodes are back.
- A rolling restart (each node stopped as an operator does, started again, the cluster
  healthy again before the next) under traffic: nothing lost.

Messages go in as PartitionKey datagrams (key ``k<n>``, partition key ``n``): the socket
commits each one to the buffer before the next is read, and the agent's ``accepted`` count
says every one was taken. Values are ``<seq>`` per topic, so a consumer can tell lost,
duplicated and out-of-order ones apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry_client import FerryClient
from tests.agent_harness import REPO_ROOT, AgentProcess, write_config
from tests.apache_kafka import KafkaCluster
from tests.kafka import read_topic
from tests.waiting import wait_until

PARTITIONS = 3
KEYS = 12  # partition key n % 3 chooses the partition: four keys per partition


# -- sending -------------------------------------------------------------------------------


@dataclass
class Stream:
    """Numbered keyed datagrams to some topics, ``rate`` a second per topic, in a thread.

    Bounded in count (``total`` per topic) and time (``seconds``); ``sent`` counts what the
    kernel queued on the agent's socket, per topic."""

    socket_path: Path
    topics: list[str]
    total: int
    rate: float
    seconds: float = 120.0
    sent: int = 0
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> Stream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        try:
            with FerryClient(self.socket_path, timeout=30.0) as client:
                for seq in range(self.total):
                    if self.stop.is_set() or time.monotonic() - started > self.seconds:
                        return
                    key = seq % KEYS
                    for topic in self.topics:
                        client.send(topic, b"%06d" % seq, key=b"k%02d" % key,
                                    partition_key=key)
                    self.sent = seq + 1
                    # Pacing (a rate, not a wait for anything): the stream must still be
                    # flowing when a broker fails, rather than all be sent in a second.
                    ahead = started + self.sent / self.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
        except BaseException as exc:  # noqa: BLE001 - kept for join() to raise in the test
            self.error = exc

    def join(self, stop: bool = False) -> int:
        """Wait for the stream to end (``stop``: end it now); what it sent."""
        assert self._thread is not None
        if stop:
            self.stop.set()
        self._thread.join(self.seconds + 30)
        assert not self._thread.is_alive(), "stream did not end"
        if self.error is not None:
            raise AssertionError(f"stream failed after {self.sent}") from self.error
        return self.sent


# -- counting at the far end ---------------------------------------------------------------


@dataclass(frozen=True)
class Count:
    """What a consumer read of ``sent`` numbered messages."""

    sent: int
    read: int
    lost: list[int]
    duplicated: int  # copies beyond the first
    out_of_order: list[str]  # keys whose first copies are not in sequence order

    def figures(self) -> dict[str, Any]:
        lost = self.lost
        return {"sent": self.sent, "read": self.read, "lost": len(lost),
                "lost_range": [lost[0], lost[-1]] if lost else None,
                # Partition key n goes to partition n % PARTITIONS (Bruce's rule).
                "lost_partitions": sorted({seq % KEYS % PARTITIONS for seq in lost}),
                "duplicated": self.duplicated, "keys_out_of_order": len(self.out_of_order)}


def count(bootstrap: str, topic: str, sent: int) -> Count:
    records = read_topic(bootstrap, topic, timeout=60)  # sorted by (partition, offset)
    seen: Counter[int] = Counter()
    firsts: dict[bytes | None, list[int]] = {}
    for record in records:
        assert record.value is not None
        seq = int(record.value)
        if not seen[seq]:
            firsts.setdefault(record.key, []).append(seq)
        seen[seq] += 1
    lost = [seq for seq in range(sent) if not seen[seq]]
    unsent = sorted(set(seen) - set(range(sent)))
    assert not unsent, f"{topic}: read messages never sent: {unsent[:5]}"
    duplicated = sum(n - 1 for n in seen.values())
    disorder = [repr(key) for key, seqs in firsts.items() if seqs != sorted(seqs)]
    return Count(sent, len(records), lost, duplicated, disorder)


# -- the agent's own figures ---------------------------------------------------------------


def topic_row(agent: AgentProcess, topic: str) -> dict[str, Any]:
    rows = agent.get_json("/status/topics")["topics"]
    return next((r for r in rows if r["topic"] == topic), {"topic": topic, "accepted": 0,
                                                            "delivered": 0, "discarded": 0,
                                                            "buffered": 0})


def delivered(agent: AgentProcess, topic: str) -> int:
    return int(topic_row(agent, topic)["delivered"])


def settled(agent: AgentProcess, topics: list[str], sent: int) -> bool:
    """Every message accepted, none left in the buffer, and each one counted as delivered
    or discarded (the counters reach the status documents a moment after the buffer)."""
    rows = [topic_row(agent, t) for t in topics]
    return (all(r["accepted"] == sent == r["delivered"] + r["discarded"] for r in rows)
            and sum(agent.buffered().values()) == 0)


def report(name: str, figures: dict[str, Any]) -> None:
    # One line per case, for the reliability table (pytest -s shows it; -rA keeps it).
    print(f"\nFIGURES {name} {json.dumps(figures, sort_keys=True)}")


# -- 1. ack levels under leader failure -------------------------------------------------------


def test_leader_killed_mid_stream_acks_all_loses_nothing_acks_leader_is_measured(
    apache_kafka: KafkaCluster, unique_topic: str, tmp_path: Path
) -> None:
    """kill -9 of the node leading partition 0 of the ``acks = "leader"`` topic while both
    topics stream.

    acks=all: nothing lost, per-key order of first copies kept. acks=leader: everything left
    the buffer only on a Kafka acknowledgement (``delivered`` = sent, nothing discarded) -- what
    it guarantees; what a consumer misses of it afterwards is reported, not assumed away."""
    all_topic, leader_topic = f"{unique_topic}-all", f"{unique_topic}-leader"
    for topic in (all_topic, leader_topic):
        apache_kafka.create_topic(topic, PARTITIONS)
    config = write_config(tmp_path, apache_kafka.bootstrap,
                          topics={all_topic: {"acks": "all"}, leader_topic: {"acks": "leader"}},
                          outage_after_seconds=10.0)
    # ~10 s of traffic, faster than the agent delivers on a loaded machine: the producers
    # always have requests in flight when the kill comes (after ~2 s), so the old leader has
    # acknowledged records its followers may not have fetched yet -- acks=leader's window.
    total, rate = 15000, 1500.0
    with AgentProcess(config) as agent:
        stream = Stream(agent.socket_path, [all_topic, leader_topic], total, rate).start()
        # Mid-stream: both topics have deliveries acknowledged, and most is still to come.
        wait_until(lambda: stream.sent >= total // 5
                   and min(delivered(agent, all_topic), delivered(agent, leader_topic)) > 0,
                   timeout=60, message="deliveries flowing on both topics")
        victim = apache_kafka.leader(leader_topic, 0)
        leads_all = [p for p in range(PARTITIONS) if apache_kafka.leader(all_topic, p) == victim]
        # Both topics lose a leader: Kafka spreads each topic's leaders over the nodes.
        assert leads_all, f"node {victim} leads no partition of the acks=all topic"
        killed_at = time.monotonic()
        before = {"all": delivered(agent, all_topic), "leader": delivered(agent, leader_topic)}
        sent_at_kill = stream.sent
        apache_kafka.kill(victim)
        sent = stream.join()
        assert sent == total
        assert all(n < total for n in before.values()), f"the kill came too late: {before}"
        # The old leader comes back as a follower: what it had and the new leader has not is
        # truncated away now, so the count below is final.
        apache_kafka.start_node(victim)
        wait_until(lambda: settled(agent, [all_topic, leader_topic], total), timeout=120,
                   interval=0.2, message="every message accepted and delivered")
        recovered = time.monotonic() - killed_at
        rows = {t: topic_row(agent, t) for t in (all_topic, leader_topic)}
    apache_kafka.wait_healthy()
    all_count = count(apache_kafka.bootstrap, all_topic, total)
    leader_count = count(apache_kafka.bootstrap, leader_topic, total)
    figures = {"killed_node": victim, "acks_all_partitions_led_by_it": leads_all,
               "sent_at_kill": sent_at_kill, "delivered_before_kill": before,
               "drained_after_kill_s": round(recovered, 1),
               "acks_all": all_count.figures(), "acks_leader": leader_count.figures(),
               "delivery_failures": [r["delivery_failures"] for r in rows.values()]}
    report("leader_killed", figures)
    for topic, row in rows.items():
        # Left the buffer only on an acknowledgement from Kafka: no discard, none skipped.
        assert (row["delivered"], row["discarded"]) == (total, 0), (topic, row)
    assert all_count.lost == [], figures
    assert all_count.out_of_order == [], figures


# -- 2. too few in-sync replicas --------------------------------------------------------------



def ferry_status(agent: AgentProcess) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli.main", "status", "--url", agent.http_url],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    return done.returncode, done.stdout + done.stderr


def cluster_reason(agent: AgentProcess) -> str:
    rows = agent.get_json("/status/clusters")["clusters"]
    row = next(r for r in rows if r["name"] == "local")
    return f"{row['state']}: {row['reason']}"


WINDOW = 10.0  # seconds of watching the agent wait


def test_too_few_in_sync_replicas_keeps_everything_says_why_and_delivers_after(
    apache_kafka: KafkaCluster, unique_topic: str, tmp_path: Path
) -> None:
    """Two nodes stopped (controlled shutdowns, as an operator's): every partition is left with
    one in-sync replica, below ``min.insync.replicas`` 2, and Kafka refuses acks=all writes
    with NOT_ENOUGH_REPLICAS. The agent keeps every message, waits without spinning, and
    both /status/clusters and ``ferry status`` name the cause. Nodes back: all delivered."""
    topic = unique_topic
    apache_kafka.create_topic(topic, PARTITIONS)
    # A short message timeout: librdkafka gives up on its own retries every few seconds, so
    # Ferry's own retry path (failure, purge, backoff, send again) runs during the window.
    config = write_config(tmp_path, apache_kafka.bootstrap, topics={topic: {"acks": "all"}},
                          forwarder={"message_timeout_ms": 4000},
                          outage_after_seconds=2.0)
    warm, total = 30, 300
    with AgentProcess(config) as agent:
        with FerryClient(agent.socket_path) as client:
            for seq in range(warm):
                client.send(topic, b"%06d" % seq, key=b"k%02d" % (seq % KEYS),
                            partition_key=seq % KEYS)
            wait_until(lambda: delivered(agent, topic) == warm, timeout=60,
                       message="warm-up delivered")
            survivor = apache_kafka.leader(topic, 0)
            stopped = [n.node_id for n in apache_kafka.nodes if n.node_id != survivor]
            started = time.monotonic()
            for node_id in stopped:
                apache_kafka.stop_node(node_id)
            stop_s = time.monotonic() - started
            # The condition under test, as the cluster reports it: one replica in sync.
            isr = {p: apache_kafka.isr(topic, p) for p in range(PARTITIONS)}
            assert all(r == [survivor] for r in isr.values()), isr
            for seq in range(warm, total):
                client.send(topic, b"%06d" % seq, key=b"k%02d" % (seq % KEYS),
                            partition_key=seq % KEYS)
        wait_until(lambda: topic_row(agent, topic)["accepted"] == total, timeout=30,
                   message="every message accepted")
        reason = wait_until(
            lambda: "NOT_ENOUGH_REPLICAS" in (r := cluster_reason(agent)) and r,
            timeout=60, interval=0.2, message="/status/clusters says why")
        said_why_s = time.monotonic() - started
        code, text = wait_until(
            lambda: (r := ferry_status(agent))[0] == 2 and "NOT_ENOUGH_REPLICAS" in r[1] and r,
            timeout=60, interval=0.5, message="ferry status CRITICAL, naming the cause")

        # The wait itself: nothing leaves the buffer, nothing is discarded, and the agent
        # does not spin. WINDOW is a measuring period, not a wait for anything.
        row0, cpu0, t0 = topic_row(agent, topic), agent.cpu_seconds(), time.monotonic()
        time.sleep(WINDOW)
        row1, cpu1 = topic_row(agent, topic), agent.cpu_seconds()
        elapsed = time.monotonic() - t0
        cpu_share = (cpu1 - cpu0) / elapsed
        failures = row1["delivery_failures"] - row0["delivery_failures"]
        assert agent.buffered().get(topic, 0) == total - warm
        assert (row1["delivered"], row1["discarded"]) == (warm, 0), row1

        back_at = time.monotonic()
        for node_id in stopped:
            apache_kafka.start_node(node_id)
        restart_s = time.monotonic() - back_at
        wait_until(lambda: settled(agent, [topic], total), timeout=120, interval=0.2,
                   message="everything delivered once the nodes are back")
        drained = time.monotonic() - back_at
        after = cluster_reason(agent)
        final = topic_row(agent, topic)
    result = count(apache_kafka.bootstrap, topic, total)
    figures = {"isr": isr, "reason": reason, "ferry_status_exit": code, "stop_s": round(stop_s, 1),
               "said_why_after_stop_s": round(said_why_s, 1), "restart_s": round(restart_s, 1),
               "window_s": round(elapsed, 1), "agent_cpu_share": round(cpu_share, 3),
               "delivery_failures_in_window": failures,
               "drained_after_restart_s": round(drained, 1), "count": result.figures()}
    report("too_few_in_sync", figures)
    assert "CRITICAL" in text and "NOT_ENOUGH_REPLICAS" in text, text
    # The topic is named, with the cluster's figures; other teams' topics are not.
    assert f"{topic} partitions 0, 1, 2: 1 in-sync replica, min.insync.replicas 2" in reason
    assert reason.count("in-sync replica") == 1, reason  # every topic on the cluster is short
    assert "NOT_ENOUGH_REPLICAS" not in after
    # A busy loop keeps a core busy (share ~1.0); waiting costs a few percent of one.
    assert cpu_share < 0.35, figures
    # Each failed send is retried after a backoff of at least message_timeout_ms (the
    # producer's own wait): per buffered message, at most a few in the window.
    assert failures <= (total - warm) * (WINDOW / 4 + 1), figures
    assert after.startswith("up"), after
    assert final["discarded"] == 0 and final["delivered"] == total, final
    assert result.lost == [] and result.out_of_order == [], figures


# -- 3. rolling restart ----------------------------------------------------------------------


def test_rolling_restart_under_traffic_loses_nothing(
    apache_kafka: KafkaCluster, unique_topic: str, tmp_path: Path
) -> None:
    """Each node in turn stopped (SIGTERM: a controlled shutdown), started again, and the
    cluster fully in sync again before the next, while an acks=all topic streams."""
    topic = unique_topic
    apache_kafka.create_topic(topic, PARTITIONS)
    config = write_config(tmp_path, apache_kafka.bootstrap, topics={topic: {"acks": "all"}},
                          outage_after_seconds=10.0)
    # Traffic until the last node is back: a node's stop and start took 20-95 s on the
    # loaded 2-core machine, so the stream is bounded by a count and a time well beyond
    # three of them.
    total, rate = 100 * 600, 100.0
    steps: list[dict[str, Any]] = []
    with AgentProcess(config) as agent:
        stream = Stream(agent.socket_path, [topic], total, rate, seconds=600.0).start()
        wait_until(lambda: delivered(agent, topic) > 0, timeout=60,
                   message="deliveries flowing before the first restart")
        for node in apache_kafka.nodes:
            at, t0 = stream.sent, time.monotonic()
            apache_kafka.stop_node(node.node_id)
            t1 = time.monotonic()
            apache_kafka.start_node(node.node_id)
            t2 = time.monotonic()
            apache_kafka.wait_healthy()
            steps.append({"node": node.node_id, "sent_at_stop": at,
                          "stop_s": round(t1 - t0, 1), "start_s": round(t2 - t1, 1),
                          "in_sync_s": round(time.monotonic() - t2, 1)})
        sent = stream.join(stop=True)
        # Every restart happened under traffic: the stream was ended by us, not its bounds.
        during = sent
        wait_until(lambda: settled(agent, [topic], sent), timeout=120, interval=0.2,
                   message="everything delivered")
        row = topic_row(agent, topic)
    result = count(apache_kafka.bootstrap, topic, sent)
    figures = {"steps": steps, "sent": sent, "sent_by_last_restart": during,
               "delivery_failures": row["delivery_failures"], "count": result.figures()}
    report("rolling_restart", figures)
    assert steps[0]["sent_at_stop"] > 0 and during < total, figures
    assert (row["delivered"], row["discarded"]) == (sent, 0), row
    assert result.lost == [], figures
    assert result.out_of_order == [], figures
