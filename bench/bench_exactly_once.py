"""Exactly-once beside at-least-once, in one run: delivery rate and end-to-end latency.

    .venv/bin/python bench/bench_exactly_once.py [--messages 200000] [--rounds 2]
                                                 [--intervals 20,100,500]
                                                 [--broker kafka|tansu]

Rate: a buffer pre-filled with ``--messages`` 200-byte messages of one topic is drained into
the broker by the whole agent (ingest + forwarder processes), once with the topic's default
``delivery = "at_least_once"`` and once with ``"exactly_once"`` (``acks = "all"`` for both,
so only the delivery differs), alternating for ``--rounds`` rounds. Timed from the first
message leaving the buffer to the buffer being empty (sampled every 10 ms), so the start-up
of the processes and of the transactional producer is not counted.

Latency: for at-least-once and for each ``forwarder.transaction_interval_ms`` of
``--intervals``, 2,000 datagrams at 1,000/s, each carrying its send time; a consumer with
``isolation.level=read_committed`` (``read_uncommitted`` for at-least-once) notes when each
becomes visible. Prints p50 / p99 of send -> visible.

The broker (``bench/brokers.py``): a 3-node Apache Kafka cluster (RF 3,
``min.insync.replicas`` 2) by default, ``--broker tansu`` for one tansu process. Each drain
prints the broker's CPU per message too (every node's JVM together, over the drain).
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)
from brokers import BenchBroker, CpuMeter, add_broker_option, start_broker  # noqa: E402
from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from agent.buffer.store import Store  # noqa: E402
from agent.config import load_config  # noqa: E402
from agent.daemon.agent import Agent  # noqa: E402
from agent.metrics import Registry  # noqa: E402
from agent.records import Record  # noqa: E402
from ferry_client import FerryClient  # noqa: E402
from tests.agent_harness import write_config  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

PARTITIONS = 8
STAMP = struct.Struct(">q")


def _config(root: Path, bootstrap: str, topic: str, delivery: str, interval_ms: int) -> Path:
    return write_config(root, bootstrap, http=False,
                        buffer={"max_bytes": 4 * 1024**3},
                        topics={topic: {"acks": "all", "delivery": delivery}},
                        forwarder={"linger_ms": 5, "agent_id": f"bench-{uuid.uuid4().hex[:8]}",
                                   "transaction_interval_ms": interval_ms})


def drain_rate(broker: BenchBroker, delivery: str, messages: int,
               interval_ms: int) -> tuple[float, float]:
    """(messages per second, the broker's CPU microseconds per message) of one drain."""
    topic = f"rate-{delivery}-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, PARTITIONS)
    meter = CpuMeter(broker)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(_config(Path(tmp), broker.bootstrap, topic, delivery, interval_ms))
        with Store(cfg.buffer.path, cfg.buffer.max_bytes) as store:
            value = b"v" * 200
            for start in range(0, messages, 20_000):
                n = min(20_000, messages - start)
                store.append([[Record(topic, value) for _ in range(n)]])
        agent = Agent(cfg, registry=Registry())
        agent.start()
        try:
            first = end = None
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                stats = agent.store.topic_stats()
                left = stats[0].messages if stats else 0
                now = time.perf_counter()
                if first is None and left < messages:
                    first = now
                    meter.start()
                if left == 0:
                    end = now
                    break
                time.sleep(0.01)  # sampling the buffer, not synchronising anything
        finally:
            agent.stop()
    if first is None or end is None:
        raise RuntimeError(f"{delivery}: not drained in time")
    if end - first < 0.1:
        # The buffer is sampled every 10 ms: a drain shorter than ten samples has no rate
        # worth printing (a whole drain between two samples once printed 2e9 msg/s).
        sys.exit(f"{delivery}: {messages} messages drained within {end - first:.3f} s, too "
                 "few to time at a 10 ms sampling interval: use more --messages")
    return messages / (end - first), meter.per_message_us(messages)


def latency(broker: BenchBroker, delivery: str, interval_ms: int, count: int = 2000,
            rate: float = 1000.0) -> tuple[float, float]:
    bootstrap = broker.bootstrap
    topic = f"lat-{delivery}-{interval_ms}-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, PARTITIONS)
    seen: dict[int, float] = {}
    stop = threading.Event()
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 5, "log_level": 0,
        "isolation.level": ("read_committed" if delivery == "exactly_once"
                            else "read_uncommitted")})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])

    def consume() -> None:
        while not stop.is_set():
            for m in consumer.consume(1000, 0.05):
                if m.error() is None and m.value():
                    seen[STAMP.unpack(m.value()[:8])[0]] = time.time_ns()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(_config(Path(tmp), bootstrap, topic, delivery, interval_ms))
        agent = Agent(cfg, registry=Registry())
        agent.start()
        try:
            assert cfg.socket.path is not None
            sent: list[int] = []
            with FerryClient(cfg.socket.path) as client:
                # One message first, delivered before timing: start-up is not latency.
                client.send(topic, STAMP.pack(0) + b"x" * 192)
                wait_until(lambda: 0 in seen, timeout=60, message="the first message")
                t0 = time.perf_counter()
                for i in range(count):
                    target = t0 + i / rate
                    pause = target - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)  # pacing the load generator
                    stamp = time.time_ns()
                    client.send(topic, STAMP.pack(stamp) + b"x" * 192)
                    sent.append(stamp)
            wait_until(lambda: all(s in seen for s in sent), timeout=120,
                       message="every message visible")
        finally:
            stop.set()
            reader.join(5)
            consumer.close()
            agent.stop()
    lat = sorted((seen[s] - s) / 1e9 for s in sent)
    return statistics.median(lat), lat[int(len(lat) * 0.99) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--intervals", default="20,100,500")
    add_broker_option(ap)
    args = ap.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    intervals = [int(x) for x in args.intervals.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp, start_broker(args.broker, Path(tmp)) as b:
        print(b.describe())
        print(f"machine: {os.cpu_count()} cores; {args.messages} x 200 B per drain; "
              f"{PARTITIONS} partitions; acks=all")
        rates: dict[str, list[float]] = {"at_least_once": [], "exactly_once": []}
        for r in range(args.rounds):
            for delivery in rates:
                rate, broker_us = drain_rate(b, delivery, args.messages, 100)
                rates[delivery].append(rate)
                print(f"round {r + 1}: {delivery:<14} drained at {rate:,.0f} msg/s; broker "
                      f"CPU {broker_us:.1f} us per message")
        alo = statistics.median(rates["at_least_once"])
        eo = statistics.median(rates["exactly_once"])
        print(f"median: at-least-once {alo:,.0f} msg/s, exactly-once {eo:,.0f} msg/s "
              f"(transaction_interval_ms 100): ratio {eo / alo:.2f}")
        p50, p99 = latency(b, "at_least_once", 100)
        print(f"latency at_least_once (read_uncommitted): p50 {p50 * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms")
        for interval in intervals:
            p50, p99 = latency(b, "exactly_once", interval)
            print(f"latency exactly_once, transaction_interval_ms {interval} "
                  f"(read_committed): p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")


if __name__ == "__main__":
    main()
