"""The partition leader and the agent, both killed -9 mid-stream, on a 3-node Apache Kafka
cluster (RF 3, ``min.insync.replicas`` 2): every 2xx answer is in Kafka, and the exactly-once
topic shows a ``read_committed`` consumer each answered message exactly once.

Two HTTP senders post numbered messages, one per request and keyed, to an ``acks = "all"``
topic and to an exactly-once topic. Once each has answers, the node leading partition 0 of the
acks=all topic and the whole agent (its process group) are SIGKILLed together. The agent is
started again on the same buffer while the node is still down, the senders go on, and the node
is started again. Then the buffer drains and both topics are read back and counted.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.agent_harness import write_config
from tests.apache_kafka import KafkaCluster
from tests.kafka import read_topic
from tests.reliability.harness import Agent
from tests.waiting import wait_until

PARTITIONS = 3
KEYS = 6
PER_PHASE = 250  # answered messages per topic before the kill, and again after the restart
PHASE_SECONDS = 60.0


@dataclass
class Sender:
    """Posts numbered messages to one topic until told to stop or a request fails."""

    topic: str
    prefix: str
    url_host: str
    url_port: int
    next_seq: int = 0
    answered: list[str] = field(default_factory=list)
    failures: int = 0

    def run(self, stop: threading.Event, limit: int) -> None:
        connection = http.client.HTTPConnection(self.url_host, self.url_port, timeout=30)
        target = len(self.answered) + limit
        deadline = time.monotonic() + PHASE_SECONDS
        try:
            while not stop.is_set() and len(self.answered) < target:
                if time.monotonic() > deadline:
                    break
                value = f"{self.prefix}-{self.next_seq:06d}"
                key = str(self.next_seq % KEYS)
                self.next_seq += 1
                try:
                    connection.request(
                        "POST", f"/topics/{self.topic}", body=value.encode(),
                        headers={"Content-Type": "application/octet-stream",
                                 "Partition-Key": key},
                    )
                    answer = connection.getresponse()
                    answer.read()
                except (OSError, http.client.HTTPException):
                    # The agent was killed under this request: not answered, not counted.
                    self.failures += 1
                    return
                if 200 <= answer.status < 300:
                    self.answered.append(value)
        finally:
            connection.close()


def run_phase(senders: list[Sender], stop: threading.Event) -> list[threading.Thread]:
    threads = [threading.Thread(target=s.run, args=(stop, PER_PHASE), daemon=True)
               for s in senders]
    for thread in threads:
        thread.start()
    return threads


def tally(answered: list[str], values: list[str]) -> tuple[int, int]:
    """(lost, duplicated) of the answered messages among ``values`` read from Kafka."""
    counts = Counter(values)
    lost = sum(1 for value in answered if counts[value] == 0)
    duplicated = sum(counts[value] - 1 for value in answered if counts[value] > 1)
    return lost, duplicated


def test_leader_and_agent_killed_mid_stream_every_2xx_is_in_kafka(
    apache_kafka: KafkaCluster, unique_topic: str, tmp_path: Path
) -> None:
    all_topic, eo_topic = f"{unique_topic}-all", f"{unique_topic}-eo"
    for topic in (all_topic, eo_topic):
        apache_kafka.create_topic(topic, PARTITIONS)
    config = write_config(
        tmp_path, apache_kafka.bootstrap,
        topics={all_topic: {"acks": "all"},
                eo_topic: {"acks": "all", "delivery": "exactly_once"}},
        forwarder={"agent_id": f"acceptance-{unique_topic[-10:]}"},
        outage_after_seconds=10.0,
    )
    agent = Agent(config).start()
    host, port = agent.config.http.listen.rsplit(":", 1)
    senders = [Sender(all_topic, "all", host, int(port)), Sender(eo_topic, "eo", host, int(port))]
    try:
        stop = threading.Event()
        threads = run_phase(senders, stop)
        wait_until(lambda: all(len(s.answered) >= PER_PHASE // 2 for s in senders),
                   timeout=PHASE_SECONDS, message="answers on both topics before the kill")
        leader = apache_kafka.leader(all_topic, 0)
        apache_kafka.kill(leader)
        agent.kill()
        stop.set()
        for thread in threads:
            thread.join(timeout=40)
        assert not any(t.is_alive() for t in threads)

        # Back on the same buffer while the old leader is still down, then the node returns.
        agent = Agent(config).start()
        threads = run_phase(senders, threading.Event())
        apache_kafka.start_node(leader)
        for thread in threads:
            thread.join(timeout=PHASE_SECONDS + 40)
        assert all(len(s.answered) >= PER_PHASE for s in senders), [
            (s.topic, len(s.answered), s.failures) for s in senders
        ]
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=90,
                   message="buffer drained to Kafka", interval=0.2)
    finally:
        agent.kill()

    all_values = [m.value.decode() for m in read_topic(apache_kafka.bootstrap, all_topic, 60)
                  if m.value is not None]
    eo_values = [m.value.decode() for m in read_topic(apache_kafka.bootstrap, eo_topic, 60,
                                                      read_committed=True)
                 if m.value is not None]
    all_lost, all_dup = tally(senders[0].answered, all_values)
    eo_lost, eo_dup = tally(senders[1].answered, eo_values)
    report = {
        "killed_leader": leader,
        "acks_all": {"answered": len(senders[0].answered), "in_kafka": len(all_values),
                     "lost": all_lost, "duplicated": all_dup},
        "exactly_once": {"answered": len(senders[1].answered), "in_kafka": len(eo_values),
                         "lost": eo_lost, "duplicated": eo_dup,
                         "extra_unanswered": len(eo_values) - len(set(eo_values)) - eo_dup},
    }
    print(json.dumps(report))
    assert all_lost == 0, report
    assert eo_lost == 0 and eo_dup == 0, report
    # Exactly-once holds for every message, answered or not: nothing twice.
    assert len(eo_values) == len(set(eo_values)), report
    # Per key, the answered exactly-once messages arrive in the order they were sent.
    eo_records = read_topic(apache_kafka.bootstrap, eo_topic, 60, read_committed=True)
    by_key: dict[bytes | None, list[int]] = {}
    for record in eo_records:
        assert record.value is not None
        by_key.setdefault(record.key, []).append(int(record.value.decode().split("-")[1]))
    for key, seqs in by_key.items():
        assert seqs == sorted(seqs), f"key {key!r} out of order"
