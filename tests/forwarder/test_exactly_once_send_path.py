"""The exactly-once thread's send path: plain messages leave from their stored value with
positional produce() arguments (as in the at-least-once loop), the rest through the record;
every field must arrive as accepted, inside committed transactions, each with its ferry-id.
Real buffer, real tansu broker, a read_committed reader."""

from __future__ import annotations

import uuid
from pathlib import Path

from agent.buffer.store import Store
from agent.config import load_config
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.progress import tag
from agent.metrics import Registry
from agent.records import Record
from tests.agent_harness import write_config
from tests.kafka import Broker, create_topic, read_topic
from tests.send_records import records_of_every_kind
from tests.waiting import wait_until

PARTITIONS = 4


def test_every_field_arrives_as_accepted_in_transactions(tmp_path: Path, session_broker: Broker,
                                                         unique_topic: str) -> None:
    create_topic(session_broker.bootstrap, unique_topic, PARTITIONS)
    identity = f"eo-send-{uuid.uuid4().hex[:8]}"
    cfg = load_config(write_config(
        tmp_path, session_broker.bootstrap, http=False,
        topics={unique_topic: {"delivery": "exactly_once", "acks": "all", "ttl_seconds": 60}},
        forwarder={"agent_id": identity, "transaction_interval_ms": 20}))
    # Headers of its own take the record path: same fields, its headers and the ferry-id.
    records = records_of_every_kind(unique_topic)
    too_large = Record(unique_topic, b"x" * 2_000_000, timestamp_ms=1_000_009)
    registry = Registry()
    with Store(cfg.buffer.path, cfg.buffer.max_bytes) as store:
        [ids] = store.append([records])
        [big] = store.append([[too_large]])  # over max_message_bytes: discarded, counted
        assert isinstance(ids, list) and isinstance(big, list)
        forwarder = Forwarder(cfg, store, registry=registry)
        try:
            forwarder.start_probing()
            forwarder.exactly_once.start()
            wait_until(lambda: not store.topic_stats(), timeout=60,
                       message="the exactly-once topic drained")
            located = {r.value: store.locate(i) for r, i in zip(records, ids, strict=True)}
            big_state = store.locate(big[0])
        finally:
            forwarder.shutdown()
    consumed = read_topic(session_broker.bootstrap, unique_topic, 30, read_committed=True)
    # Each once (none twice), the big one not at all.
    assert sorted(m.value for m in consumed) == sorted(r.value for r in records)
    got = {m.value: m for m in consumed}
    parts = list(range(PARTITIONS))
    for r, message_id in zip(records, ids, strict=True):
        m = got[r.value]
        assert (m.key, m.timestamp_ms) == (r.key, r.timestamp_ms), r
        assert dict(m.headers) == {**dict(r.headers), "ferry-id": tag(identity, message_id)}, r
        if r.partition_key is not None:
            assert m.partition == parts[(r.partition_key & 0xFFFFFFFF) % PARTITIONS], r
        assert located[r.value] == {"state": "delivered", "topic": unique_topic,
                                    "cluster": "local", "partition": m.partition,
                                    "offset": m.offset, "note": "committed in transaction",
                                    "at_ms": located[r.value]["at_ms"]}, r
    assert got[b"any-1"].partition != got[b"keyed-any"].partition
    assert big_state is not None and big_state["state"] == "discarded"
    assert big_state["reason"] == "too_large"
    view = registry.view()
    assert view.total("messages_delivered") == len(records)
    assert view.total("messages_discarded") == 1
    # Delivered by committed transactions, not found again by a reconciliation after a
    # failed one (which would also leave each message in Kafka once).
    assert view.total("transactions_committed") >= 1
    assert view.total("transactions_aborted") == 0
