"""The one place that knows how ``Producer.produce()`` is called.

confluent-kafka documents ``produce(topic, value=None, key=None, partition=-1,
on_delivery=None, timestamp=0, headers=None)`` with keyword arguments. Ferry passes them by
position instead, in the order of its C implementation, which is not that documented
signature:

    topic, value, key, partition, callback, on_delivery, timestamp, headers

``callback`` is an alias of ``on_delivery``: Ferry gives its delivery callback in the 5th
place and ``None`` in the 6th (a callback in the 5th place wins). Parsing keywords cost more
than any other step of the forwarder's hot loop, about 40% more a call
(bench/bench_produce_call.py). Because the order is the library's detail, not its contract,
tests/forwarder/test_produce_arguments.py proves it on the installed version against a real
broker, through this module's two forms, and pyproject.toml bounds confluent-kafka to the
versions proved.

- ``positional(producer)`` hands back ``producer.produce`` itself, typed by ``Positional``
  (the order above, with Ferry's names): for the loops that call it once per message (the
  plain fast path of each delivery loop), which pay no Python call of Ferry's per message.
  mypy checks each positional argument against the name and type in its place.
- ``produce(producer, topic, value, key, partition=..., on_delivery=..., timestamp=...,
  headers=...)`` reads by name and makes the positional call here: for every other site (the
  general send path, the exactly-once loop's decoded messages, its progress records), where
  one more call per message costs nothing that matters.

The hot loops could go through ``produce`` too, but one Python function around the call
costs about 0.3 µs a message more, 17% of the call (bench/bench_produce_call.py
``--adapter --cpu``: 1.84 against 2.15 µs of the thread's CPU, medians of 15 rounds on a
loaded 2-core host): 3% of the forwarder thread's work per message on that host (about
10 µs), more on a fast one (3.4–4.1 µs). The fast path is kept free of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from confluent_kafka import KafkaError, Message, Producer

Headers = list[tuple[str, str | bytes | None]]
DeliveryCallback = Callable[[KafkaError | None, Message], None]


class Positional(Protocol):
    """``Producer.produce`` called by position, in the order of confluent-kafka's C code."""

    def __call__(self, topic: str, value: bytes | None, key: bytes | None, partition: int,
                 on_delivery: DeliveryCallback, unused: None, timestamp: int,
                 headers: Headers | None = None, /) -> None:
        """``partition`` -1: the producer's partitioner places it (by key). ``unused``: the
        library's ``on_delivery`` place, always None (the callback is in the place before).
        ``timestamp`` 0: the send time."""


def positional(producer: Producer) -> Positional:
    """``producer.produce`` itself, to be called positionally (``Positional``), for a loop
    that calls it once per message."""
    return producer.produce


def produce(producer: Producer, topic: str, value: bytes | None, key: bytes | None = None, *,
            partition: int = -1, on_delivery: DeliveryCallback | None = None,
            timestamp: int = 0, headers: Headers | None = None) -> None:
    """``producer.produce()`` by name (the same call as ``positional``'s, made here).
    Raises what it raises: ``BufferError`` (its queue full), ``KafkaException``."""
    producer.produce(topic, value, key, partition, on_delivery, None, timestamp, headers)
