"""What calling ``Producer.produce`` positionally saves over its documented keywords.

    .venv/bin/python bench/bench_produce_call.py [--messages 200000] [--rounds 5]
                                                 [--adapter] [--cpu]

The forwarder's common send path hands each message to librdkafka with one ``produce()``
call. confluent-kafka documents keyword arguments (``produce(topic, value=None, key=None,
partition=-1, on_delivery=None, timestamp=0, headers=None)``); its C code also takes them
positionally, in an order that is not documented (a ``callback`` alias of ``on_delivery``
sits in the fifth place). This measures both forms on the same producer, alternating, with
no broker: the producer points at an unused loopback port, so every call only queues the
message (nothing is sent), which is the cost the forwarder's loop pays per message. The
queue is purged between rounds. Prints nanoseconds per call, median over the rounds.

``--adapter`` adds a third form: the call made through ``agent/forwarder/producing.py``'s
``produce`` (by name, one Python function around the positional call), what the forwarder's
hot loops would pay per message were they to go through it rather than take the bound method
(``producing.positional``). ``--cpu`` times the calling thread's CPU rather than the wall
clock: on a loaded host it shows the cost of the call without the waits for a core.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from confluent_kafka import KafkaError, Message, Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.forwarder import producing  # noqa: E402

clock = time.perf_counter


def _report(sink: list[object], mid: bytes, err: KafkaError | None, msg: Message) -> None:
    sink.append((mid, err, msg))


def _positional(p: Producer, n: int, value: bytes, sink: list[object]) -> float:
    produce = p.produce
    t0 = clock()
    for i in range(n):
        produce("bench", value, None, i & 3, partial(_report, sink, b"id"), None, 1_700_000)
    return clock() - t0


def _keywords(p: Producer, n: int, value: bytes, sink: list[object]) -> float:
    produce = p.produce
    t0 = clock()
    for i in range(n):
        produce("bench", value, key=None, partition=i & 3,
                on_delivery=partial(_report, sink, b"id"), timestamp=1_700_000)
    return clock() - t0


def _adapter(p: Producer, n: int, value: bytes, sink: list[object]) -> float:
    produce = producing.produce
    t0 = clock()
    for i in range(n):
        produce(p, "bench", value, None, partition=i & 3,
                on_delivery=partial(_report, sink, b"id"), timestamp=1_700_000)
    return clock() - t0


def main() -> None:
    global clock
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--adapter", action="store_true",
                    help="also through producing.produce (a Python call around it)")
    ap.add_argument("--cpu", action="store_true", help="time the thread's CPU, not the wall")
    args = ap.parse_args()
    if args.cpu:
        clock = time.thread_time
    p = Producer({"bootstrap.servers": "127.0.0.1:9", "linger.ms": 60_000,
                  "queue.buffering.max.messages": 2 * args.messages,
                  "queue.buffering.max.kbytes": 2_097_151, "log_level": 0})
    value = b"x" * 200
    sink: list[object] = []
    forms = [("positional", _positional), ("keywords", _keywords)]
    if args.adapter:
        forms.append(("adapter", _adapter))
    runs: dict[str, list[float]] = {name: [] for name, _ in forms}
    for _ in range(args.rounds):
        for name, fn in forms:
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
    if args.adapter:
        ad = statistics.median(runs["adapter"])
        print(f"the adapter costs {ad - pos:.0f} ns/call more ({(ad - pos) / pos:+.1%})")
    p.purge(in_queue=True, in_flight=True)
    p.flush(0)


if __name__ == "__main__":
    main()
