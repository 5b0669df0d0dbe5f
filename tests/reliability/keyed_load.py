"""Keyed load for the outage tests: senders of sequential messages ``<input>-<key>-<seq>``
over HTTP and the socket (``KeyedSender``, ``http_load``, ``socket_load``; ``KEYS`` partition
keys), and ``tally_of``, which holds what a topic ended with against what was acknowledged:
lost, duplicated, and, per key, out of send order or split over partitions (``KeyedTally``).
Used by test_outage.py, test_outage_exactly_once.py and
tests/forwarder/test_exactly_once_kafka.py.
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass, field

import httpx

from ferry_client import FerryClient
from tests.kafka import ConsumedMessage
from tests.reliability.harness import Agent, metric_total
from tests.waiting import wait_until

KEYS = 8


@dataclass
class KeyedTally:
    sent: int = 0
    acked: int = 0
    lost: int = 0
    duplicates: int = 0
    keys_split_over_partitions: int = 0
    out_of_order: int = 0  # first copies of a key's messages not in send order
    resend_regressions: int = 0  # later duplicate copies behind newer messages (allowed)
    lost_examples: list[str] = field(default_factory=list)
    order_examples: list[str] = field(default_factory=list)


class KeyedSender:
    """Sequential, keyed messages ``<input>-<key>-<seq>``; seq counts per key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seq = [itertools.count() for _ in range(KEYS)]
        self.sent: list[bytes] = []
        self.acked: set[bytes] = set()
        self.stop = threading.Event()
        self.errors: collections.Counter[str] = collections.Counter()

    def value(self, key: int) -> bytes:
        v = b"%s-%d-%08d" % (self.name.encode(), key, next(self.seq[key]))
        self.sent.append(v)
        return v


def http_load(agent: Agent, topic: str, sender: KeyedSender) -> None:
    url = f"{agent.http_url}/topics/{topic}"
    with httpx.Client(timeout=15.0) as client:
        for n in range(1_000_000):
            if sender.stop.is_set():
                return
            key = n % KEYS
            value = sender.value(key)
            try:
                r = client.post(url, content=value, headers={"Ferry-Partition-Key": str(key)})
            except httpx.HTTPError as exc:
                sender.errors[type(exc).__name__] += 1
                continue
            if r.status_code in (201, 202):
                sender.acked.add(value)
            else:
                sender.errors[f"status {r.status_code}"] += 1
            sender.stop.wait(0.003)  # pacing: a steady few hundred per second


def socket_load(agent: Agent, topic: str, sender: KeyedSender) -> None:
    """Rounds of datagrams; a round is acknowledged once the accepted counter covers it."""
    total = 0
    with FerryClient(agent.socket_path, timeout=5.0) as client, httpx.Client(timeout=5) as h:
        for _ in range(100_000):
            if sender.stop.is_set():
                return
            values = [sender.value(i % KEYS) for i in range(100)]
            for i, v in enumerate(values):
                client.send(topic, v, partition_key=i % KEYS)
            total += len(values)

            def counted(expected: int = total) -> bool:
                doc = h.get(agent.http_url + "/status/counters").json()
                return metric_total(doc, "messages_accepted", source="socket",
                                    topic=topic) >= expected

            wait_until(counted, timeout=10, interval=0.01, message="datagram round accepted")
            sender.acked.update(values)
            sender.stop.wait(0.05)


def tally_of(sender: KeyedSender, records: list[ConsumedMessage], blackhole_ms: int = 0
           ) -> KeyedTally:
    """``blackhole_ms``: wall-clock time of the blackhole, to say in the examples when each
    message of an out-of-order pair was sent (its Kafka timestamp is the send time)."""
    tally = KeyedTally(sent=len(sender.sent), acked=len(sender.acked))
    counts = collections.Counter(r.value for r in records)
    missing = sorted(sender.acked - counts.keys())
    tally.lost = len(missing)
    tally.lost_examples = [v.decode() for v in missing[:10]]
    tally.duplicates = sum(c - 1 for c in counts.values())
    by_key: dict[int, list[ConsumedMessage]] = collections.defaultdict(list)
    for r in records:  # read_topic: partition then offset order
        assert r.value is not None
        by_key[int(r.value.rsplit(b"-", 2)[1])].append(r)  # names may hold "-"
    for key, recs in by_key.items():
        if len({r.partition for r in recs}) > 1:
            tally.keys_split_over_partitions += 1
        seen: set[bytes] = set()
        last_first = -1
        last_first_ts = 0
        highest = -1
        for r in recs:
            assert r.value is not None
            seq = int(r.value.rsplit(b"-", 1)[1])
            if r.value in seen:
                if seq < highest:
                    tally.resend_regressions += 1
                continue
            seen.add(r.value)
            if seq < last_first:
                tally.out_of_order += 1
                if len(tally.order_examples) < 10:
                    tally.order_examples.append(
                        f"key {key}: seq {seq} (sent at {_rel(r.timestamp_ms, blackhole_ms)}) "
                        f"at offset {r.offset} of partition {r.partition}, after seq "
                        f"{last_first} (sent at {_rel(last_first_ts, blackhole_ms)})")
            if seq > last_first:
                last_first, last_first_ts = seq, r.timestamp_ms
            highest = max(highest, seq)
    return tally


def _rel(ts_ms: int, blackhole_ms: int) -> str:
    return f"blackhole{(ts_ms - blackhole_ms) / 1000:+.1f} s" if blackhole_ms else f"{ts_ms} ms"
