"""A producer killed in the middle of a transaction (issue 22): ``crash_in_a_child`` buffers
N keyed messages and runs the real exactly-once sender on them in a child process that dies
with ``os._exit(CRASHED)`` at one of three points of its first transaction: its records
acknowledged but no progress record yet (``before_progress``), the progress record
acknowledged but no commit (``before_commit``), the commit done but the buffer not yet
cleared (``after_commit``). ``exactly_once_sender`` builds the sender a successor runs.
Used on tansu (test_exactly_once_zombie.py) and on Apache Kafka (test_exactly_once_kafka.py).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

from confluent_kafka import Producer

from agent.buffer.store import Store
from agent.config import FerryConfig
from agent.forwarder.clusters import Cluster
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.transactions import ExactlyOnce
from agent.metrics import Registry
from agent.records import Record

N = 300
KEYS = 7
CRASHED = 9


def exactly_once_sender(config: FerryConfig, store: Store, registry: Registry) -> ExactlyOnce:
    cluster = Cluster("local", config.kafka.local, config.forwarder)
    return ExactlyOnce(config, store, registry=registry, topic_settings=config.topic,
                       cluster=cluster, discard_log=DiscardLog(config.buffer.path / "d.jsonl"))


def stop_sender(sender: ExactlyOnce, timeout: float) -> None:
    """Stop ``sender`` and close the cluster ``exactly_once_sender`` built for it (its
    metadata thread and producer): left open, they stay connected for the rest of the session
    and another test counting a cluster's connections or requests counts theirs too."""
    try:
        sender.stop(timeout)
    finally:
        sender.cluster.close(5)


def _crashing_producer(point: str, progress_topic: str) -> type[Producer]:
    class Crashing(Producer):  # type: ignore[misc]  # confluent_kafka has no typed subclassing
        def produce(self, topic: str, *args: Any, **kwargs: Any) -> None:
            if point == "before_progress" and topic == progress_topic:
                os._exit(CRASHED)  # every record of the batch is acknowledged (flushed)
            super().produce(topic, *args, **kwargs)

        def commit_transaction(self, *args: Any) -> None:
            if point == "before_commit":
                self.flush(30)  # the progress record is on the broker too
                os._exit(CRASHED)
            super().commit_transaction(*args)
            if point == "after_commit":
                os._exit(CRASHED)

    return Crashing


def _child(config_data: dict[str, Any], point: str) -> None:
    import agent.forwarder.transactions as transactions

    config = FerryConfig.model_validate(config_data)
    transactions.Producer = _crashing_producer(point, config.forwarder.progress_topic)
    store = Store(config.buffer.path, config.buffer.max_bytes)
    sender = exactly_once_sender(config, store, Registry())
    sender.start()
    threading.Event().wait(60)  # the crash ends this process; a timeout fails the test
    os._exit(0)


def crash_in_a_child(config: FerryConfig, store: Store, topic: str, point: str) -> list[bytes]:
    """Buffer N keyed messages, then run the real transactional sender in a child process
    that dies at ``point``; returns the values, in the order they were buffered."""
    values = [f"m{i:05d}".encode() for i in range(N)]
    store.append([[Record(topic, v, key=f"k{i % KEYS}".encode(), hash_key=True)
                   for i, v in enumerate(values)]])
    child = multiprocessing.get_context("spawn").Process(
        target=_child, args=(config.model_dump(mode="json", by_alias=True), point))
    child.start()
    child.join(90)
    assert child.exitcode == CRASHED, f"the child did not crash at {point}"
    return values
