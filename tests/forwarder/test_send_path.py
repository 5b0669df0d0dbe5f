"""The forwarder's common send path (a local cluster, partitions known) hands each message to
librdkafka from its stored value, with the arguments passed positionally: every field must
arrive as accepted. Real buffer, real tansu broker, the forwarder's own loop."""

from __future__ import annotations

from pathlib import Path

from agent.buffer.store import Store
from agent.config import load_config
from agent.forwarder.forwarder import Forwarder
from agent.metrics import Registry
from tests.agent_harness import write_config
from tests.kafka import Broker, create_topic, read_topic
from tests.send_records import records_of_every_kind
from tests.waiting import wait_until

PARTITIONS = 4


def _drain(forwarder: Forwarder, registry: Registry, count: int) -> None:
    def delivered() -> bool:
        if not forwarder.step():
            forwarder._wait(0.01)
        return registry.view().total("messages_delivered") >= count

    wait_until(delivered, timeout=30, interval=0.001, message="every message delivered")


def test_every_field_arrives_as_accepted(tmp_path: Path, session_broker: Broker,
                                         unique_topic: str) -> None:
    create_topic(session_broker.bootstrap, unique_topic, PARTITIONS)
    cfg = load_config(write_config(tmp_path, session_broker.bootstrap, http=False))
    # Headers take the general path (a Flight): same fields, plus the headers.
    records = records_of_every_kind(unique_topic)
    registry = Registry()
    with Store(cfg.buffer.path, cfg.buffer.max_bytes) as store:
        [ids] = store.append([records])
        assert isinstance(ids, list)
        forwarder = Forwarder(cfg, store, registry=registry)
        try:
            _drain(forwarder, registry, len(records))
            wait_until(lambda: not store.topic_stats(), message="the buffer emptied")
            located = {r.value: store.locate(i) for r, i in zip(records, ids, strict=True)}
        finally:
            forwarder.shutdown()
    got = {m.value: m for m in read_topic(session_broker.bootstrap, unique_topic)}
    assert sorted(got) == sorted(r.value for r in records)
    parts = list(range(PARTITIONS))
    for r in records:
        m = got[r.value]
        assert (m.key, m.timestamp_ms) == (r.key, r.timestamp_ms), r
        assert dict(m.headers) == dict(r.headers), r
        if r.partition_key is not None:
            assert m.partition == parts[(r.partition_key & 0xFFFFFFFF) % PARTITIONS], r
        # The tracking entry names where it went, from the delivery report.
        assert located[r.value] == {"state": "delivered", "topic": unique_topic,
                                    "cluster": "local", "partition": m.partition,
                                    "offset": m.offset, "at_ms": located[r.value]["at_ms"]}
    # Round-robin spreads the AnyPartition messages (Bruce: the next partition each time).
    assert got[b"any-1"].partition != got[b"keyed-any"].partition
    assert registry.view().total("messages_delivered") == len(records)
