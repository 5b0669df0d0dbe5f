"""spool.format: the byte layout, encoding rules and record decoding."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spool.format import (
    BLOCK_HEADER,
    FILE_HEADER,
    MAX_RECORD_BYTES,
    RECORD_HEADER,
    TRAILER,
    SpoolFormatError,
    SpoolRecord,
    check_file_header,
    check_topic,
    decode_record,
    encode_columns,
    encode_file,
    encode_record,
    is_legal_topic,
)

topics = st.from_regex(r"[A-Za-z0-9._-]{1,249}", fullmatch=True).filter(
    lambda t: t not in (".", "..")
)
records = st.builds(
    SpoolRecord,
    topic=topics,
    value=st.binary(max_size=300),
    key=st.none() | st.binary(max_size=50),
    partition_key=st.none() | st.integers(-(2**31), 2**31 - 1),
    timestamp_ms=st.integers(-(2**63), 2**63 - 1),
    headers=st.lists(st.tuples(st.text(max_size=20), st.binary(max_size=20)), max_size=4).map(
        tuple
    ),
)


def test_the_documented_byte_layout() -> None:
    """One record, byte for byte as docs/spool.md describes it."""
    record = SpoolRecord("t.1", b"VAL", b"K", -2, 1_700_000_000_123, (("h", b"xy"),))
    data = encode_file([record])

    assert data[:12] == b"FERRYSPL" + b"\x01\x00" + b"\x00\x00"
    body = (
        struct.pack("<I", 28 + 3 + 1 + 3 + 2 + 4 + 1 + 2)  # record length
        + bytes([1 | 2])  # flags: key, partition key
        + bytes([3])  # topic length
        + struct.pack("<H", 1)  # header count
        + struct.pack("<i", -2)
        + struct.pack("<q", 1_700_000_000_123)
        + struct.pack("<I", 1)  # key length
        + struct.pack("<I", 3)  # value length
        + b"t.1" + b"K" + b"VAL"
        + struct.pack("<HI", 1, 2) + b"h" + b"xy"
    )
    block_header = struct.pack("<III", len(body), 1, zlib.crc32(body))
    assert data[12:24] == block_header
    assert data[24 : 24 + len(body)] == body
    trailer = data[24 + len(body) :]
    crc = zlib.crc32(data[:12] + block_header)
    assert trailer == struct.pack("<I", 0) + b"FERRYEND" + struct.pack("<QI", 1, crc)
    assert (FILE_HEADER.size, BLOCK_HEADER.size, RECORD_HEADER.size, TRAILER.size) == (
        12, 12, 28, 24,
    )


def test_absent_key_and_partition_key_are_flags_not_zero_values() -> None:
    absent = encode_record(SpoolRecord("t", b"v"))
    empty = encode_record(SpoolRecord("t", b"v", b"", 0))
    assert absent[4] == 0 and empty[4] == 3
    assert decode_record(absent)[0] == SpoolRecord("t", b"v", None, None)
    assert decode_record(empty)[0] == SpoolRecord("t", b"v", b"", 0)


@given(records)
def test_a_record_round_trips(record: SpoolRecord) -> None:
    data = encode_record(record)
    decoded, end = decode_record(b"xx" + data, 2)
    assert decoded == record
    assert end == 2 + len(data)


@pytest.mark.parametrize(
    "topic",
    ["a", "A-Z_a.z-0_9", "x" * 249, "..."],
)
def test_legal_topics(topic: str) -> None:
    assert is_legal_topic(topic)
    assert check_topic(topic) == topic


@pytest.mark.parametrize("topic", ["", ".", "..", "x" * 250, "a b", "a/b", "tópico", "a\n"])
def test_illegal_topics_are_refused(topic: str) -> None:
    assert not is_legal_topic(topic)
    with pytest.raises(ValueError, match="not a legal Kafka topic name"):
        encode_record(SpoolRecord(topic, b"v"))


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (SpoolRecord("t", "text"), "value must be bytes"),  # type: ignore[arg-type]
        (SpoolRecord("t", b"v", "k"), "key must be bytes or None"),  # type: ignore[arg-type]
        (SpoolRecord("t", b"v", None, 2**31), "outside the signed 32-bit range"),
        (SpoolRecord("t", b"v", None, -(2**31) - 1), "outside the signed 32-bit range"),
        (SpoolRecord("t", b"v", None, True), "partition_key must be an int"),
        (SpoolRecord("t", b"v", None, None, 2**63), "not a signed 64-bit integer"),
        (SpoolRecord("t", b"v", headers=(("h", "s"),)), "value must be bytes"),  # type: ignore[arg-type]
        (SpoolRecord("t", b"v", headers=((1, b"s"),)), "header name must be a string"),  # type: ignore[arg-type]
        (SpoolRecord(None, b"v"), "topic must be a string"),  # type: ignore[arg-type]
    ],
)
def test_records_the_format_cannot_hold_are_refused(record: SpoolRecord, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_record(record)


def test_a_record_larger_than_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than"):
        encode_record(SpoolRecord("t", bytes(MAX_RECORD_BYTES)))


@given(st.lists(records, min_size=1, max_size=30))
def test_encode_columns_matches_encode_record(rows: list[SpoolRecord]) -> None:
    blocks = list(
        encode_columns(
            [r.topic for r in rows],
            [r.value for r in rows],
            [r.key for r in rows],
            [r.partition_key for r in rows],
            [r.timestamp_ms for r in rows],
            [r.headers for r in rows],
        )
    )
    assert blocks == [(b"".join(encode_record(r) for r in rows), len(rows))]


def test_encode_columns_takes_one_topic_and_one_timestamp_for_all_rows() -> None:
    [(body, count)] = encode_columns("fixed", [b"a", b"b"], timestamps=42)
    assert count == 2
    assert body == encode_record(SpoolRecord("fixed", b"a", timestamp_ms=42)) + encode_record(
        SpoolRecord("fixed", b"b", timestamp_ms=42)
    )


def test_encode_columns_closes_a_block_at_the_target_size() -> None:
    values = [bytes(100)] * 10
    one = len(encode_record(SpoolRecord("t", bytes(100))))
    blocks = list(encode_columns("t", values, block_bytes=3 * one))
    assert [count for _, count in blocks] == [3, 3, 3, 1]
    assert all(len(body) == count * one for body, count in blocks)


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"values": [b"a", None]}, "row 1: value is null"),
        ({"values": [b"a", "s"]}, "row 1: value must be bytes"),
        ({"topics": ["t", None]}, "row 1: topic is null"),
        ({"topics": ["t", "a b"]}, "row 1: 'a b' is not a legal Kafka topic name"),
        ({"keys": [None, "k"]}, "row 1: key must be bytes"),
        ({"partition_keys": [1, 2**40]}, "row 1: partition_key 1099511627776 is outside"),
        ({"timestamps": [1, None]}, "row 1: timestamp is null"),
        ({"timestamps": [1, 2**64]}, "row 1: "),
        ({"headers": [None, (("h", None),)]}, "row 1: header 'h': value must be bytes"),
    ],
)
def test_encode_columns_names_the_bad_row(columns: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"topics": ["t", "t"], "values": [b"a", b"b"]} | columns
    with pytest.raises(ValueError) as failure:
        list(encode_columns(**args))  # type: ignore[arg-type]
    assert str(failure.value).startswith(message)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"FERRYSP", "too short for a spool file header"),
        (b"NOTFERRY\x01\x00\x00\x00", "not a Ferry spool file"),
        (b"FERRYSPL\x02\x00\x00\x00", "version 2 is not supported"),
        (b"FERRYSPL\x01\x00\x01\x00", "unknown file header flags"),
    ],
)
def test_bad_file_headers_are_refused(header: bytes, message: str) -> None:
    with pytest.raises(SpoolFormatError, match=message):
        check_file_header(header, "f")


def _raw_record(
    *, length: int | None = None, flags: int = 0, tlen: int = 1, hcount: int = 0, pk: int = 0,
    klen: int = 0, vlen: int = 1, tail: bytes = b"tv",
) -> bytes:
    if length is None:
        length = 28 + len(tail)
    return RECORD_HEADER.pack(length, flags, tlen, hcount, pk, 0, klen, vlen) + tail


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x00" * 10, "record header runs past the end"),
        (_raw_record(length=10), "shorter than a record header"),
        (_raw_record(length=MAX_RECORD_BYTES + 1), "larger than"),
        (_raw_record(flags=4), "unknown record flags"),
        (_raw_record(tlen=0, tail=b"v"), "topic length 0"),
        (_raw_record(klen=1, tail=b"tkv"), "key length is not 0 for a record without a key"),
        (_raw_record(pk=5), "partition key is not 0"),
        (_raw_record(vlen=5), "does not match its fields"),
        (_raw_record(length=40, hcount=1), "runs past the end of the data"),
        (_raw_record(tail=b" v"), "not a legal Kafka topic name"),
        (_raw_record(hcount=1, tail=b"tv" + struct.pack("<HI", 1, 9) + b"h"), "header 0 runs"),
        (_raw_record(hcount=1, tail=b"tv" + struct.pack("<HI", 1, 0) + b"\xff"), "not UTF-8"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_records_are_refused(data: bytes, message: str) -> None:
    # (the reader's fast path makes the same checks; tests/spool/test_reader.py covers it)
    with pytest.raises(SpoolFormatError, match=message):
        decode_record(data)
