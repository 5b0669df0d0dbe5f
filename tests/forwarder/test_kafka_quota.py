"""A producer quota on real Apache Kafka (issue #36): Kafka throttles the agent's client id to
a byte rate per broker, and a backlog several times what that rate passes within the
exactly-once commit limit is delivered all the same, at-least-once and exactly-once, while an
unrelated exactly-once topic keeps committing.

Before: the exactly-once loop sent its whole backlog in one transaction, gave it up at the
commit limit, and sent the same batch again (issue #36: 0 of 3,000 delivered in 240 s). Now
each transaction is sized from the rate the last ones achieved (agent/forwarder/
transaction_size.py). Each case counts at a real consumer (``read_committed`` for the
exactly-once topics): lost 0, duplicated 0 on the exactly-once topics, and how many records
the aborted transactions left in the log (what was sent again).

The quota is on a client id of this test's own (``client.id`` in
``[kafka.local.properties]``, which names every client of the agent), so a quota left behind
by a failed removal throttles nobody else on the shared cluster.

To drain in well under a minute, the commit limit is 5 s (``forwarder.
transaction_commit_timeout_ms``; 30 s by default) and the quota 20 KB/s per broker: the
exactly-once backlog is about four times what the three brokers pass in one limit, and more
than the burst Kafka lets a quiet client send before it throttles (about 11 s of quota), so
the first transaction, which holds all of it, cannot commit in time.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from ferry_client import FerryClient, FerryHttp
from tests.agent_harness import AgentProcess, write_config
from tests.apache_kafka import KafkaCluster
from tests.forwarder.apache_delivery import tally, values
from tests.kafka import read_topic
from tests.reliability.checker import wait_transactions_settled
from tests.reliability.harness import metric_total
from tests.waiting import wait_until

QUOTA = 20 * 1024  # bytes a second, per broker
COMMIT_TIMEOUT_MS = 5000
SIZE = 1000
EO_BACKLOG = 1200  # messages of SIZE: ~1.2 MB, ~4 x what 3 brokers pass in 5 s at QUOTA
ALO_BACKLOG = 300
OTHER = 200
PARTITIONS = 3


def _value(prefix: str, i: int) -> bytes:
    # Incompressible: Kafka counts the bytes on the wire, after lz4.
    head = f"{prefix}-{i:06d}-".encode()
    return head + os.urandom(SIZE - len(head))


def _counter(agent: AgentProcess, name: str, **labels: str) -> float:
    return metric_total(agent.get_json("/status/counters"), name, **labels)


@pytest.mark.parametrize("kafka", ["apache_kafka", "newest_kafka"])
def test_a_backlog_under_a_producer_quota_is_delivered_exactly_once_and_others_go_on(
    tmp_path: Path, request: pytest.FixtureRequest, kafka: str
) -> None:
    """On the pinned Kafka and on the newest release (issue #36 was found on 4.4)."""
    apache_kafka: KafkaCluster = request.getfixturevalue(kafka)
    print(f"Apache Kafka {apache_kafka.version}")
    run = uuid.uuid4().hex[:8]
    client_id = f"ferry-quota-{run}"
    alo, eo, other = f"quota-{run}", f"quota-eo-{run}", f"quota-other-eo-{run}"
    for topic in (alo, eo, other):
        apache_kafka.create_topic(topic, PARTITIONS)
    exactly_once = {"delivery": "exactly_once", "acks": "all"}
    config = write_config(
        tmp_path / "agent", apache_kafka.bootstrap,
        # ack_timeout_ms 0: answered once buffered, so publishing is not paced by the quota.
        topics={alo: {"acks": "all"}, eo: exactly_once,
                other: {**exactly_once, "ack_timeout_ms": 0}},
        forwarder={"agent_id": f"quota-{run}",
                   "transaction_commit_timeout_ms": COMMIT_TIMEOUT_MS},
        extra=f'[kafka.local.properties]\n"client.id" = "{client_id}"\n')
    sent = {alo: [_value("alo", i) for i in range(ALO_BACKLOG)],
            eo: [_value("eo", i) for i in range(EO_BACKLOG)]}
    published: list[bytes] = []
    with apache_kafka.client_quota(client_id, QUOTA), AgentProcess(config) as agent:
        start = time.monotonic()
        with FerryClient(agent.socket_path, timeout=30) as client:
            for topic, messages in sent.items():
                for i, value in enumerate(messages):
                    client.send(topic, value, partition_key=i % PARTITIONS)
        wait_until(lambda: all(_counter(agent, "messages_accepted", topic=t) >= len(m)
                               for t, m in sent.items()),
                   timeout=30, message="every datagram accepted")
        # The unrelated topic's messages arrive behind the whole backlog, and go out
        # while the backlog still waits: they are not queued behind it.
        with FerryHttp(agent.http_url, timeout=30.0, attempts=3) as http:
            for i in range(OTHER):
                value = f"other-{i:06d}".encode()
                http.publish(other, value)
                published.append(value)
        wait_until(lambda: agent.buffered().get(other, 0) == 0, timeout=60, interval=0.2,
                   message="the unrelated topic delivered")
        other_done = time.monotonic() - start
        eo_waiting = agent.buffered().get(eo, 0)
        wait_until(lambda: agent.buffered() == {}, timeout=80, interval=0.5,
                   message="the backlog delivered under the quota")
        drained = time.monotonic() - start
        counters = agent.get_json("/status/counters")
    timed_out = metric_total(counters, "transactions_aborted", reason="timed_out")
    aborted = metric_total(counters, "transactions_aborted")
    committed = metric_total(counters, "transactions_committed")
    wait_transactions_settled(apache_kafka.bootstrap, eo)
    everything = read_topic(apache_kafka.bootstrap, eo, 60)
    visible = [r.value for r in read_topic(apache_kafka.bootstrap, eo, 60,
                                           read_committed=True)]
    resent = len(everything) - len(visible)
    print(f"unrelated topic delivered {other_done:.1f} s in ({eo_waiting} exactly-once "
          f"messages still waiting); drained {drained:.1f} s; transactions: {committed:.0f} "
          f"committed, {aborted:.0f} aborted ({timed_out:.0f} timed out); records of aborted "
          f"transactions in the log: {resent}")

    counted = tally(sent[eo], visible)
    print(eo, counted)
    assert counted.lost == [] and counted.duplicated == {}, counted
    counted = tally(sent[alo], values(apache_kafka.bootstrap, alo))
    print(alo, counted)
    assert counted.lost == [], counted
    wait_transactions_settled(apache_kafka.bootstrap, other)
    counted = tally(published, [r.value for r in read_topic(
        apache_kafka.bootstrap, other, 60, read_committed=True)])
    print(other, counted)
    assert counted.lost == [] and counted.duplicated == {}, counted
    # Progress, not the same batch again and again. The first transaction holds the whole
    # backlog and is given up (nothing says yet how fast the cluster takes bytes); after
    # it, what aborted transactions leave in the log is less than one more backlog (before
    # the fix every attempt was the whole backlog again), and far more transactions commit
    # than are given up.
    assert resent < 2 * EO_BACKLOG, resent
    assert committed > 3 * aborted, (committed, aborted)
    # The unrelated topic went out while the throttled one still had a backlog.
    assert eo_waiting > 0, "the quota did not hold the backlog back: nothing was tested"
