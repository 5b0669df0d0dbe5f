"""Forwarder alone: a pre-filled buffer drained into a real broker, in this process.

    .venv/bin/python bench/bench_forwarder.py [--messages 300000] [--topics 4] [--profile]
                                              [--no-tune-gc] [--no-track]
                                              [--acks leader|all] [--broker kafka|tansu]

Fills a buffer with ``--messages`` 200-byte messages (half AnyPartition, half PartitionKey)
over ``--topics`` topics, then runs the forwarder's loop until every message is acknowledged
and removed. Prints the drain rate, the forwarder's CPU time per message (this process, which
includes librdkafka's threads), and with ``--profile`` the top functions by own time.

Then, in the same run and to the same broker, the baseline the issue measures the drain
against: a plain Python confluent-kafka producer (the forwarder's producer settings for the
same ack level, one delivery callback for all) pushing the same messages to the same
partitions from memory until every one is acknowledged; and the ratio of the two rates
(``--no-baseline`` skips it). ``--acks`` sets the topics' ack level, and so the baseline's
(default: the shipped default, ``leader``: acks=1, one request in flight per connection;
``all`` is idempotent with up to five).

The broker (``bench/brokers.py``): a 3-node Apache Kafka cluster, RF 3 and
``min.insync.replicas`` 2, by default; ``--broker tansu`` for one tansu process. For each of
the two runs the broker's CPU per message is printed (every node's JVM together).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka import KafkaError, Message, Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)
from brokers import CpuMeter, add_broker_option, start_broker  # noqa: E402

from agent.buffer.store import Store  # noqa: E402
from agent.config import FerryConfig, ForwarderConfig, TopicConfig, load_config  # noqa: E402
from agent.forwarder.clusters import producer_config  # noqa: E402
from agent.forwarder.forwarder import Forwarder  # noqa: E402
from agent.forwarder.process import GC_GEN0_THRESHOLD  # noqa: E402
from agent.metrics import Registry  # noqa: E402
from agent.process.gc_tuning import freeze_startup_heap  # noqa: E402
from agent.records import Record  # noqa: E402
from tests.agent_harness import write_config  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plain_producer(bootstrap: str, cfg: FerryConfig, topics: list[str], messages: int,
                   value: bytes, timeout: float, acks: str) -> tuple[int, float, float]:
    """A plain producer's run: (acknowledged, seconds, CPU seconds of this process)."""
    conf = producer_config("baseline", acks, cfg.kafka.local, cfg.forwarder)
    producer = Producer(conf)
    partitions = {t: sorted(producer.list_topics(t, timeout=10).topics[t].partitions)
                  for t in topics}
    acked = [0, 0]  # acknowledged, failed

    def done(err: KafkaError | None, _msg: Message) -> None:
        acked[1 if err is not None else 0] += 1

    produce = producer.produce
    rr = 0
    cpu0, t0 = _cpu(), time.perf_counter()
    deadline = t0 + timeout
    for i in range(messages):
        topic = topics[i % len(topics)]
        parts = partitions[topic]
        # The forwarder's placement: PartitionKey i mod n, AnyPartition round-robin.
        if i % 2:
            partition = parts[i % len(parts)]
        else:
            rr += 1
            partition = parts[rr % len(parts)]
        while True:
            try:
                produce(topic, value, None, partition=partition,
                        timestamp=int(time.time() * 1000), on_delivery=done)
                break
            except BufferError:
                producer.poll(0.01)
                if time.perf_counter() > deadline:
                    raise TimeoutError("the plain producer's queue never drained") from None
        if not i % 1000:
            producer.poll(0)
    while sum(acked) < messages and time.perf_counter() < deadline:
        producer.poll(0.01)
    took, cpu = time.perf_counter() - t0, _cpu() - cpu0
    producer.flush(5)
    if acked[1]:
        raise RuntimeError(f"the plain producer's sends failed: {acked[1]}")
    return acked[0], took, cpu


def _forwarder_settings(args: argparse.Namespace) -> dict[str, float]:
    """[forwarder] as a user gets it, unless --producer-linger-ms says otherwise (the tests'
    config helper sets linger_ms = 1, which is not the default)."""
    linger = ForwarderConfig().linger_ms if args.producer_linger_ms is None \
        else args.producer_linger_ms
    return {"linger_ms": linger}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--topics", type=int, default=4)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--producer-linger-ms", type=float, default=None,
                    help="forwarder.linger_ms (default: the shipped default)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the plain-producer baseline")
    ap.add_argument("--no-tune-gc", action="store_true",
                    help="keep CPython's GC defaults (the forwarder process tunes them)")
    ap.add_argument("--acks", choices=["leader", "all"], default=TopicConfig().acks,
                    help="the topics' ack level, and the baseline's (default: the shipped "
                         "default)")
    ap.add_argument("--no-track", action="store_true",
                    help="status.track_messages = false: no tracking entry per message "
                         "(the default keeps one, for GET /messages/{id})")
    add_broker_option(ap)
    args = ap.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    topics = [f"fwd-bench-{i}" for i in range(args.topics)]
    with tempfile.TemporaryDirectory() as tmp, start_broker(args.broker, Path(tmp)) as broker:
        for t in topics:
            broker.create_topic(t, 8)
        meter = CpuMeter(broker)
        cfg = load_config(write_config(Path(tmp), broker.bootstrap, http=False,
                                       buffer={"max_bytes": 8 * 1024**3},
                                       forwarder=_forwarder_settings(args),
                                       topics={"default": {"acks": args.acks}}))
        value = b"v" * args.size
        with Store(cfg.buffer.path, cfg.buffer.max_bytes, track=not args.no_track) as store:
            t0 = time.perf_counter()
            per_batch = 10_000
            for start in range(0, args.messages, per_batch):
                n = min(per_batch, args.messages - start)
                groups = [[Record(topics[(start + i) % len(topics)], value,
                                  partition_key=(start + i) if i % 2 else None)
                           for i in range(n)]]
                store.append(groups)
            fill = time.perf_counter() - t0
            registry = Registry()
            forwarder = Forwarder(cfg, store, registry=registry)
            if not args.no_tune_gc:  # as the forwarder process does after its startup
                freeze_startup_heap(GC_GEN0_THRESHOLD)
            profiler = cProfile.Profile() if args.profile else None
            meter.start()
            cpu0, t0, main0 = _cpu(), time.perf_counter(), time.thread_time()
            deadline = t0 + args.timeout
            if profiler:
                profiler.enable()
            while time.perf_counter() < deadline:
                if not forwarder.step():
                    forwarder._wait(0.002)
                if registry.view().total("messages_delivered") >= args.messages \
                        and not store.topic_stats():
                    break
            if profiler:
                profiler.disable()
            took, cpu = time.perf_counter() - t0, _cpu() - cpu0
            main_cpu = time.thread_time() - main0
            broker_us = meter.per_message_us(registry.view().total("messages_delivered"))
            delivered = registry.view().total("messages_delivered")
            forwarder.shutdown()
            for c in forwarder.clusters.values():
                c.close(5.0)
        print(broker.describe())
        print(f"machine: {os.cpu_count()} cores; {args.messages} x {args.size} B over "
              f"{args.topics} topics (buffer filled in {fill:.1f} s); "
              f"forwarder.linger_ms {cfg.forwarder.linger_ms:g}; acks {args.acks}; tracking "
              f"{'off' if args.no_track else 'on'}")
        print(f"delivered and removed: {delivered:.0f} in {took:.2f} s = "
              f"{delivered / took:,.0f} msg/s")
        print(f"forwarder process CPU: {cpu:.2f} s = {cpu / max(delivered, 1) * 1e6:.1f} us "
              "per message, of which the forwarder's own thread "
              f"{main_cpu / max(delivered, 1) * 1e6:.1f} us (the rest: librdkafka's threads)")
        print(f"broker CPU during the drain: {broker_us:.1f} us per message")
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)
        if not args.no_baseline:
            meter.start()
            acked, ptook, pcpu = plain_producer(broker.bootstrap, cfg, topics, args.messages,
                                                value, args.timeout, args.acks)
            broker_us = meter.per_message_us(acked)
            print(f"plain producer, same messages and broker: {acked} in {ptook:.2f} s = "
                  f"{acked / ptook:,.0f} msg/s, {pcpu / max(acked, 1) * 1e6:.1f} us CPU per "
                  f"message; broker CPU {broker_us:.1f} us per message")
            print(f"drain / plain producer: {(delivered / took) / (acked / ptook):.2f}")


if __name__ == "__main__":
    main()
