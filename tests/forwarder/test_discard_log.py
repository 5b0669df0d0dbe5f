"""The discard log: what is written can be read back and replayed exactly; bad lines are named."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.forwarder.discard_log import Discard, DiscardLog, ReplayError, read_discards
from agent.records import Record


def discard(record: Record | None, *, reason: str = "ttl", raw: bytes | None = None) -> Discard:
    topic = record.topic if record is not None else "t"
    return Discard(reason=reason, topic=topic, message_id="00" * 12, accepted_ms=1_700_000_000_000,
                   record=record, raw=raw, attempts=3, detail="expired")


def fields(r: Record) -> tuple[object, ...]:
    return (r.topic, r.value, r.key, r.partition_key, r.timestamp_ms, r.headers, r.hash_key)


def test_round_trip_preserves_every_field(tmp_path: Path) -> None:
    written = [
        Record("orders", b"\x00\xffvalue", key=b"k1", partition_key=-5, timestamp_ms=1234,
               headers=(("trace", b"\x01\x02"), ("trace", b""), ("ü", b"x")), hash_key=False),
        Record("orders", b"", key=None, partition_key=None, timestamp_ms=99, hash_key=True),
        Record("clicks", b"v", key=b"", partition_key=0, timestamp_ms=1_700_000_000_123),
    ]
    log = DiscardLog(tmp_path / "sub" / "discards.jsonl")
    log.write([discard(r) for r in written[:2]])
    log.write([discard(written[2])])
    back = list(read_discards(log.path))
    assert [n for n, _ in back] == [1, 2, 3]
    assert [fields(r) for _, r in back] == [fields(r) for r in written]
    # None vs empty stay distinct through JSON.
    assert back[1][1].key is None and back[2][1].key == b""
    assert back[1][1].partition_key is None and back[2][1].partition_key == 0


def test_each_line_says_why_and_when(tmp_path: Path) -> None:
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"v", timestamp_ms=1), reason="max_attempts")])
    (line,) = log.path.read_text().splitlines()
    doc = json.loads(line)
    assert doc["reason"] == "max_attempts"
    assert doc["topic"] == "t"
    assert doc["attempts"] == 3
    assert doc["accepted_ms"] == 1_700_000_000_000
    assert isinstance(doc["discarded_ms"], int) and doc["discarded_ms"] > 0


def test_epoch_timestamp_zero_is_kept(tmp_path: Path) -> None:
    # A client may send timestamp 0; replay must not replace it with "now".
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"v", timestamp_ms=0))])
    ((_, record),) = list(read_discards(log.path))
    assert record.timestamp_ms == 0


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path: Path) -> None:
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"a", timestamp_ms=1))])
    with log.path.open("a") as f:
        f.write("\n   \n")
    log.write([discard(Record("t", b"b", timestamp_ms=2))])
    assert [(n, r.value) for n, r in read_discards(log.path)] == [(1, b"a"), (4, b"b")]


def test_empty_write_creates_nothing(tmp_path: Path) -> None:
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([])
    assert not log.path.exists()


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        '{"topic": "t", "value": "!!!not base64!!!"}',
        '{"value": "dg=="}',  # no topic
        '{"topic": "t", "value": "dg==", "key": 5}',
        '{"topic": "t", "value": "dg==", "headers": [["only-name"]]}',
        '["a", "list"]',  # valid JSON, but not a discard-log object
        "42",
    ],
)
def test_a_corrupt_line_raises_replay_error_naming_its_line(tmp_path: Path, bad: str) -> None:
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"ok", timestamp_ms=1))])
    with log.path.open("a") as f:
        f.write(bad + "\n")
    replayed: list[bytes] = []
    with pytest.raises(ReplayError, match=r"\b2\b"):
        for _, record in read_discards(log.path):
            replayed.append(record.value)
    assert replayed == [b"ok"]  # lines before the bad one were still read


@pytest.mark.parametrize(
    "bad",
    [
        '{"topic": "t", "value": "dg==", "partition_key": "7"}',  # not an integer
        '{"topic": "t", "value": "dg==", "partition_key": 4294967296}',  # not 32-bit
        '{"topic": "t\u00ebst", "value": "dg=="}',  # not a legal (ASCII) topic name
        '{"topic": "t", "value": "dg==", "timestamp_ms": 1e30}',  # not a 64-bit timestamp
    ],
)
def test_a_line_the_buffer_could_not_store_is_refused_when_read(tmp_path: Path, bad: str) -> None:
    # `ferry replay` reads the whole file first so that a bad line puts nothing back. A line
    # that parses but cannot be stored (Store.append raises struct.error/UnicodeEncodeError)
    # must be caught here, naming its line, or replay stops half-way with a traceback.
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"ok", timestamp_ms=1))])
    with log.path.open("a") as f:
        f.write(bad + "\n")
    with pytest.raises(ReplayError, match=r"\b2\b"):
        list(read_discards(log.path))


def test_an_undecodable_message_is_reported_as_not_replayable(tmp_path: Path) -> None:
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"fine", timestamp_ms=1)),
               discard(None, reason="corrupt", raw=b"\x01\x02garbage")])
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert lines[1]["raw"] is not None and "value" not in lines[1]  # raw bytes kept for people
    reader = read_discards(log.path)
    assert next(reader)[1].value == b"fine"
    with pytest.raises(ReplayError) as err:
        next(reader)
    message = str(err.value)
    assert "line 2" in message
    assert "corrupt" in message
    assert "cannot be replayed" in message


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.builds(
            Record,
            topic=st.sampled_from(["a", "b.c", "d_e-f"]),
            value=st.binary(max_size=64),
            key=st.none() | st.binary(max_size=16),
            partition_key=st.none() | st.integers(-(2**31), 2**31 - 1),
            timestamp_ms=st.integers(0, 2**53),
            headers=st.lists(st.tuples(st.text(max_size=8), st.binary(max_size=8)),
                             max_size=3).map(tuple),
            hash_key=st.booleans(),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_any_records_round_trip(tmp_path: Path, written: list[Record]) -> None:
    path = tmp_path / "prop.jsonl"
    path.unlink(missing_ok=True)
    DiscardLog(path).write([discard(r) for r in written])
    assert [fields(r) for _, r in read_discards(path)] == [fields(r) for r in written]


def test_a_write_cut_short_by_a_full_disk_leaves_no_fragment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(Record("t", b"first"))])
    real_write = os.write

    def half_then_full(fd: int, data: memoryview | bytes) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", half_then_full)
        with pytest.raises(OSError):
            log.write([discard(Record("t", b"second"))])
    log.write([discard(Record("t", b"second"))])  # the caller's retry, once there is room
    assert [r.value for _, r in read_discards(log.path)] == [b"first", b"second"]
