"""What the intake refuses because the Kafka topic can never take it (agent/ingest/
kafka_limits.py), without a broker: the limits are written as the forwarder publishes them
(agent/signals/limits.py) before the first message, and each source's answer, count and
stored messages are checked. tests/ingest/test_kafka_limits_kafka.py does it end to end on
Apache Kafka."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.buffer import codec
from agent.ingest import kafka_limits
from agent.record_batch import SKEW_MS, batch_of_one, impossible_timestamp
from agent.records import Record
from agent.signals.limits import Limit, LimitsPublisher, file_path
from ferry_client.wire import encode_any_partition
from tests.http.harness import Served, make_config, start
from tests.ingest.harness import Running
from tests.waiting import wait_until

LIMIT = 10_000
MINUTE = 60_000


def _limits(buffer: Path, compression: str = "lz4") -> None:
    LimitsPublisher(file_path(buffer), compression).publish(
        {"small": Limit(LIMIT, None, MINUTE)})


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def factory(**sections: Any) -> Served:
        started.append(start(make_config(tmp_path, **sections)))
        return started[-1]

    yield factory
    for served in started:
        served.stop()


def _compressible(size: int) -> bytes:
    return (b"the same few words again and again " * (size // 30 + 1))[:size]


def test_http_refuses_what_the_topic_can_never_take_with_413_naming_its_limit(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve()
    _limits(tmp_path / "buffer")  # before the first publish: the first one looks
    oversize = served.client.post("/topics/small", content=os.urandom(20_000))
    assert oversize.status_code == 413, oversize.text
    doc = oversize.json()
    assert doc["code"] == "too_large_for_topic"
    assert "max.message.bytes=10000" in doc["message"] and "lz4" in doc["message"]
    # Compressible: lz4 brings it under the limit, Kafka takes it.
    assert served.client.post("/topics/small", content=_compressible(20_000)).status_code \
        == 202
    assert served.client.post("/topics/small", content=os.urandom(9_000)).status_code == 202
    # Another topic, not limited: unchanged.
    assert served.client.post("/topics/other", content=os.urandom(20_000)).status_code == 202
    # A batch with one message the topic can never take is refused whole, naming it.
    batch = served.client.post("/topics/small/batch", json=["ok", os.urandom(15_000).hex()])
    assert batch.status_code == 413 and "message [1]" in batch.json()["message"], batch.text
    # With an Idempotency-Key the same verdict.
    keyed = served.client.post("/topics/small", content=os.urandom(20_000),
                               headers={"Idempotency-Key": "k-1"})
    assert keyed.status_code == 413, keyed.text
    assert [len(m.record.value) for m in served.messages("small")] == [20_000, 9_000]
    assert served.counter("messages_rejected", source="http",
                          reason="too_large_for_topic") == 4


def test_http_without_compression_refuses_over_the_exact_batch_size(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve()
    _limits(tmp_path / "buffer", "none")
    # A batch of one adds 61 bytes of header and 11 of record framing (record length 3,
    # attributes and deltas 3, no key 1, value length 3, no headers 1) to the value.
    assert served.client.post("/topics/small", content=b"x" * 9_928).status_code == 202
    answer = served.client.post("/topics/small", content=b"x" * 9_929)
    assert answer.status_code == 413 and "10001 bytes" in answer.json()["message"]


def test_http_accepts_everything_while_the_limits_are_unknown(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    assert served.client.post("/topics/small", content=os.urandom(20_000)).status_code == 202


@pytest.fixture
def limited(tmp_path: Path, start_running: Callable[..., Running]
            ) -> Running:
    running = start_running()
    _limits(tmp_path / "buffer")  # before the first datagram: the first one looks
    return running


def test_datagrams_the_topic_can_never_take_are_counted_and_the_rest_stored(
    limited: Running,
) -> None:
    now = int(time.time() * 1000)
    sent = [
        ("small", os.urandom(9_000), now, True),
        ("small", os.urandom(20_000), now, False),  # too large even compressed
        ("small", _compressible(20_000), now, True),
        ("small", b"future", now + 2 * 3_600_000, False),  # 2 h ahead, the topic takes 60 s
        ("small", b"past", now - 2 * 3_600_000, True),  # no before.max.ms: taken
        ("small", b"no time", 0, True),  # stamped at the send
        ("other", os.urandom(20_000), now + 2 * 3_600_000, True),  # no limits known
    ]
    for topic, value, ts, _ in sent:
        limited.send(encode_any_partition(topic, value, None, ts))
    wait_until(lambda: limited.counter("messages_received") == len(sent), timeout=30,
               message="every datagram received")
    wait_until(lambda: limited.counter("messages_accepted") == 5, timeout=30,
               message="5 accepted")
    assert limited.counter("messages_rejected", source="socket",
                           reason="too_large_for_topic") == 1
    assert limited.counter("messages_rejected", source="socket",
                           reason="timestamp_out_of_range") == 1
    assert [m.record.value for m in limited.stored("small")] == [
        v for t, v, _, ok in sent if ok and t == "small"]
    samples = limited.registry.view().samples
    assert any("max.message.bytes=10000" in str(s) for s in samples.values()), samples


@pytest.mark.parametrize("max_bytes", [200, 10_000, 1_048_588, 64 << 20])
def test_a_record_within_its_topic_s_bounds_is_one_the_topic_takes(max_bytes: int) -> None:
    # Bounds stand in for refusal() on the spool's hot path: nothing they let through may be
    # a record refusal() would refuse, whatever the key's share and the timestamp.
    now = 1_700_000_000_000
    limit = Limit(max_bytes, 3_600_000, 60_000)
    room, earliest, latest = kafka_limits.bounds(limit, now)
    for key_len in (None, 0, 1, 63, 64, 8191, 8192, room // 2, room):
        value_len = room - (key_len or 0)
        assert batch_of_one(key_len, value_len) <= max_bytes, (key_len, value_len)
    assert room > max_bytes - 100  # and they leave out little
    assert impossible_timestamp(earliest, now, limit.before_max_ms, limit.after_max_ms) is None
    assert impossible_timestamp(latest, now, limit.before_max_ms, limit.after_max_ms) is None
    assert impossible_timestamp(earliest - 1, now, limit.before_max_ms, limit.after_max_ms)
    assert impossible_timestamp(latest + 1, now, limit.before_max_ms, limit.after_max_ms)
    assert latest == now + 60_000 + SKEW_MS
    unlimited = kafka_limits.bounds(Limit(max_bytes), now)
    assert (unlimited.earliest, unlimited.latest) == (-(2**63), 2**63 - 1)


def test_a_stored_message_gets_the_verdict_of_its_fields() -> None:
    # stored_refusal (a datagram's, as the buffer stores it) and refusal (the fields) agree.
    now = int(time.time() * 1000)
    limit = Limit(LIMIT, None, MINUTE)
    cases = [(None, b"x" * 9_928, now, ()), (None, b"x" * 9_929, now, ()),
             (b"kk", b"x" * 9_926, now, ()), (b"kk", b"x" * 9_927, now, ()),
             (None, b"v", now + 3_600_000, ()), (None, b"v", 0, ()),
             (b"k", b"v" * 9_000, now, (("h", b"w" * 1_000),))]
    verdicts = []
    for key, value, ts, headers in cases:
        stored = codec.encode(Record("small", value, key, None, ts, headers), 0)
        verdict = kafka_limits.refusal("small", limit, "none", key, value, ts, now, headers)
        assert kafka_limits.stored_refusal("small", limit, "none", stored, now) == verdict
        verdicts.append(None if verdict is None else verdict[0])
    assert verdicts == [None, "too_large_for_topic", None, "too_large_for_topic",
                        "timestamp_out_of_range", None, "too_large_for_topic"]
