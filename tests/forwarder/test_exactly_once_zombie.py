"""Exactly-once across a producer killed in the middle of a transaction (issue 22).

A child process runs the real exactly-once sender (agent/forwarder/transactions.py) on a
buffer and dies with ``os._exit`` at one of three points of its first transaction: its
records acknowledged but no progress record yet, the progress record acknowledged but no
commit, and the commit done but the buffer not yet cleared. A successor on the same buffer
and identity must then leave every message in Kafka exactly once for a read_committed reader.

tansu commits the dead producer's open transaction when the successor initialises (Kafka
aborts it), so the first two points are the ones a transactions-only design gets wrong.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from agent.buffer.store import Store
from agent.config import FerryConfig
from agent.metrics import Registry
from agent.records import Record
from tests.forwarder.zombie import N, crash_in_a_child, exactly_once_sender, stop_sender
from tests.kafka import Broker, _reader, topic_partitions
from tests.waiting import wait_until


def _config(root: Path, bootstrap: str, topic: str) -> FerryConfig:
    return FerryConfig.model_validate({
        "buffer": {"path": str(root / "buffer"), "max_bytes": 64 * 1024 * 1024},
        "kafka": {"local": {"bootstrap_servers": bootstrap}},
        "forwarder": {"agent_id": "zombie-test", "linger_ms": 1,
                      "transaction_interval_ms": 200,
                      "progress_topic": f"{topic}-progress"},
        "topics": {topic: {"delivery": "exactly_once", "acks": "all"}},
    })


def _read_committed(bootstrap: str, topic: str, *, seconds: float = 30.0,
                    require_end: bool = True) -> list[tuple[int, int, bytes, bytes]]:
    parts = topic_partitions(bootstrap, topic) or []
    consumer = _reader(bootstrap, **{"isolation.level": "read_committed",
                                     "enable.partition.eof": True})
    out: list[tuple[int, int, bytes, bytes]] = []
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        pending = set(parts)
        deadline = time.monotonic() + seconds
        while pending and time.monotonic() < deadline:
            m = consumer.poll(0.1)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() == -191:  # _PARTITION_EOF
                    pending.discard(int(m.partition() or 0))
                continue
            out.append((int(m.partition() or 0), int(m.offset() or 0), m.key() or b"",
                        m.value() or b""))
        assert not pending or not require_end, f"partitions {pending} not read to the end"
    finally:
        consumer.close()
    return out


@pytest.mark.parametrize("point", ["before_progress", "before_commit", "after_commit"])
def test_successor_leaves_each_message_once(tmp_path: Path, broker: Broker, unique_topic: str,
                                            point: str) -> None:
    topic = unique_topic
    config = _config(tmp_path, broker.bootstrap, topic)
    store = Store(config.buffer.path, config.buffer.max_bytes)
    try:
        values = crash_in_a_child(config, store, topic, point)
        # The buffer still holds everything: the crash came before the delete.
        assert sum(s.messages for s in store.topic_stats()) == N
        if point != "after_commit":
            # The dead producer's transaction is still open: read_committed readers are held
            # back at its start (tansu gives them no end either), and see none of it.
            assert _read_committed(broker.bootstrap, topic, seconds=2.0, require_end=False) == []

        registry = Registry()
        successor = exactly_once_sender(config, store, registry)
        successor.start()
        try:
            wait_until(lambda: not store.topic_stats() or
                       sum(s.messages for s in store.topic_stats()) == 0,
                       timeout=60, message="buffer drained by the successor")
        finally:
            stop_sender(successor, 10)
        records = _read_committed(broker.bootstrap, topic)
        counts = Counter(v for _, _, _, v in records)
        assert sorted(counts) == values, "lost messages"
        assert [v for v, n in counts.items() if n > 1] == [], "duplicates"
        # Per key, Kafka holds the messages in acceptance order.
        by_key: dict[bytes, list[bytes]] = {}
        for _, _, k, v in sorted(records):
            by_key.setdefault(k, []).append(v)
        for k, vs in by_key.items():
            assert vs == sorted(vs), f"key {k!r} out of order"
        assert registry.view().total("messages_delivered") == N
    finally:
        store.close()


def test_a_second_running_agent_with_the_same_identity_fences_the_first_loudly(
    tmp_path: Path, broker: Broker, unique_topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two hosts from one cloned image: same identity, each its own buffer. The one that
    starts second fences the first, which stops its exactly-once topics and says so, rather
    than fencing back (the two would take turns, each reading the other's progress)."""
    topic = unique_topic
    first_cfg = _config(tmp_path / "first", broker.bootstrap, topic)
    second_cfg = _config(tmp_path / "second", broker.bootstrap, topic)
    first_store = Store(first_cfg.buffer.path, first_cfg.buffer.max_bytes)
    second_store = Store(second_cfg.buffer.path, second_cfg.buffer.max_bytes)
    first_reg, second_reg = Registry(), Registry()
    first = exactly_once_sender(first_cfg, first_store, first_reg)
    second = exactly_once_sender(second_cfg, second_store, second_reg)

    def buffered(store: Store) -> int:
        return sum(s.messages for s in store.topic_stats())

    try:
        first_store.append([[Record(topic, b"first-%d" % i) for i in range(50)]])
        first.start()
        wait_until(lambda: buffered(first_store) == 0, timeout=60, message="first delivers")
        second_store.append([[Record(topic, b"second-%d" % i) for i in range(50)]])
        second.start()
        wait_until(lambda: buffered(second_store) == 0, timeout=60, message="second delivers")
        # The first one's next transaction meets the fence.
        first_store.append([[Record(topic, b"after-%d" % i) for i in range(50)]])
        wait_until(lambda: first_reg.view().total("transactions_fenced") == 1, timeout=60,
                   message="the first agent fenced")
        assert buffered(first_store) == 50  # kept, not lost, not sent
        assert any("STOPPED" in r.getMessage() and "zombie-test" in r.getMessage()
                   for r in caplog.records if r.levelname == "ERROR")
        assert ("error", "fenced") in first_reg.view().samples
        assert second_reg.view().total("transactions_fenced") == 0
    finally:
        stop_sender(first, 5)
        stop_sender(second, 5)
        first_store.close()
        second_store.close()
    values = [v for _, _, _, v in _read_committed(broker.bootstrap, topic)]
    assert sorted(values) == sorted([b"first-%d" % i for i in range(50)]
                                    + [b"second-%d" % i for i in range(50)])
