"""What calling ``Producer.produce`` positionally saves over its documented keywords.

    .venv/bin/python bench/bench_produce_call.py [--messages 200000] [--rounds 5]

The forwarder's common send path hands each message to librdkafka with one ``produce()``
call. confluent-kafka documents keyword arguments (``produce(topic, value=None, key=None,
partition=-1, on_delivery=None, timestamp=0, headers=None)``); its C code also takes them
positionally, in an order that is not documented (a ``callback`` alias of ``on_delivery``
sits in the fifth place). This measures both forms on the same producer, alternating, with
no broker: the producer points at an unused loopback port, so every call only queues the
message (nothing is sent), which is the cost the forwarder's loop pays per message. The
queue is purged between rounds. Prints nanoseconds per call, median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from confluent_kafka import KafkaError, Message, Producer


def _report(sink: list[object], mid: bytes, err: KafkaError | None, msg: Message) -> None:
    sink.append((mid, err, msg))


def _positional(p: Producer, n: int, value: bytes, sink: list[object]) -> float:
    produce = p.produce
    t0 = time.perf_counter()
    for i in range(n):
        produce("bench", value, None, i & 3, partial(_report, sink, b"id"), None, 1_700_000)
    return time.perf_counter() - t0


def _keywords(p: Producer, n: int, value: bytes, sink: list[object]) -> float:
    produce = p.produce
    t0 = time.perf_counter()
    for i in range(n):
        produce("bench", value, key=None, partition=i & 3,
                on_delivery=partial(_report, sink, b"id"), timestamp=1_700_000)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    p = Producer({"bootstrap.servers": "127.0.0.1:9", "linger.ms": 60_000,
                  "queue.buffering.max.messages": 2 * args.messages,
                  "queue.buffering.max.kbytes": 2_097_151, "log_level": 0})
    value = b"x" * 200
    sink: list[object] = []
    runs: dict[str, list[float]] = {"positional": [], "keywords": []}
    for _ in range(args.rounds):
        for name, fn in (("positional", _positional), ("keywords", _keywords)):
            secs = fn(p, args.messages, value, sink)
            runs[name].append(secs / args.messages * 1e9)
            p.purge(in_queue=True, in_flight=True, blocking=True)
            p.poll(0)
            sink.clear()
    for name, ns in runs.items():
        print(f"{name:>10}: median {statistics.median(ns):6.0f} ns/call "
              f"(rounds: {', '.join(f'{x:.0f}' for x in ns)})")
    pos, kw = statistics.median(runs["positional"]), statistics.median(runs["keywords"])
    print(f"keywords cost {kw - pos:.0f} ns/call more ({(kw - pos) / pos:+.1%})")
    p.purge(in_queue=True, in_flight=True)
    p.flush(0)


if __name__ == "__main__":
    main()
