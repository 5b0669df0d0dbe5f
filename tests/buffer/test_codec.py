"""The buffer's value encoding: exact round trips, and nothing but CorruptRecord on bad bytes."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.buffer import codec
from agent.buffer.codec import CorruptRecord, decode, encode
from agent.records import Record

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)

records = st.builds(
    Record,
    topic=st.just("t"),
    value=st.binary(max_size=200),
    key=st.none() | st.binary(max_size=50),
    partition_key=st.none() | INT32,
    timestamp_ms=INT64,
    headers=st.lists(st.tuples(st.text(max_size=20), st.binary(max_size=30)), max_size=5).map(
        tuple
    ),
    hash_key=st.booleans(),
)


def _fields(r: Record) -> tuple[object, ...]:
    return (r.topic, r.value, r.key, r.partition_key, r.timestamp_ms, r.headers, r.hash_key)


@given(records, st.integers(0, 2**32 - 1))
def test_round_trip_preserves_every_field(record: Record, generation: int) -> None:
    back, gen = decode("t", encode(record, generation))
    assert _fields(back) == _fields(record)
    assert gen == generation


def test_none_key_and_empty_key_stay_distinct() -> None:
    none_back, _ = decode("t", encode(Record("t", b"v", key=None, timestamp_ms=1), 0))
    empty_back, _ = decode("t", encode(Record("t", b"v", key=b"", timestamp_ms=1), 0))
    assert none_back.key is None
    assert empty_back.key == b""


def test_partition_key_none_and_zero_stay_distinct() -> None:
    none_back, _ = decode("t", encode(Record("t", b"v", partition_key=None), 0))
    zero_back, _ = decode("t", encode(Record("t", b"v", partition_key=0), 0))
    assert none_back.partition_key is None
    assert zero_back.partition_key == 0


@pytest.mark.parametrize("pk", [-1, -7, -(2**31), 2**31 - 1])
def test_extreme_and_negative_partition_keys_round_trip(pk: int) -> None:
    back, _ = decode("t", encode(Record("t", b"v", partition_key=pk), 3))
    assert back.partition_key == pk


def test_headers_keep_order_duplicates_and_binary_values() -> None:
    headers = (("b", b"\x00\xff"), ("a", b""), ("b", b"second"), ("ünïcode", b"x" * 300))
    back, _ = decode("t", encode(Record("t", b"payload", headers=headers), 0))
    assert back.headers == headers
    assert back.value == b"payload"


def test_topic_comes_from_the_caller_not_the_bytes() -> None:
    data = encode(Record("written-as", b"v"), 0)
    back, _ = decode("read-as", data)
    assert back.topic == "read-as"


def test_layout_is_the_documented_version_1_header() -> None:
    data = encode(Record("t", b"VAL", key=b"K", partition_key=-2, timestamp_ms=5,
                         headers=(("h", b"hv"),), hash_key=True), 9)
    assert data == (
        struct.pack(">BBIqiIH", 1, codec.HAS_KEY | codec.HAS_PARTITION_KEY | codec.HASH_KEY,
                    9, 5, -2, 1, 1)
        + b"K" + struct.pack(">H", 1) + b"h" + struct.pack(">I", 2) + b"hv" + b"VAL"
    )


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (b"\x01\x00", "shorter than the fixed header"),
        (struct.pack(">BBIqiIH", 2, 0, 0, 0, 0, 0, 0) + b"v", "unknown version"),
        (struct.pack(">BBIqiIH", 1, codec.HAS_KEY, 0, 0, 0, 100, 0) + b"short",
         "key longer than the data"),
        (struct.pack(">BBIqiIH", 1, 0, 0, 0, 0, 0, 1), "header count without headers"),
        (struct.pack(">BBIqiIH", 1, 0, 0, 0, 0, 0, 1) + struct.pack(">H", 1) + b"\xff"
         + struct.pack(">I", 0), "header name not UTF-8"),
        (struct.pack(">BBIqiIH", 1, 0, 0, 0, 0, 0, 1) + struct.pack(">H", 1) + b"h"
         + struct.pack(">I", 50) + b"xx", "header value longer than the data"),
    ],
)
def test_corrupt_bytes_raise_corrupt_record(data: bytes, why: str) -> None:
    with pytest.raises(CorruptRecord):
        decode("t", data)


def test_truncating_a_valid_record_inside_its_headers_is_detected() -> None:
    data = encode(Record("t", b"", key=b"key", headers=(("name", b"value"),)), 0)
    # Every cut that ends before the (empty) value loses part of the key or headers.
    for cut in range(len(data)):
        with pytest.raises(CorruptRecord):
            decode("t", data[:cut])


@settings(max_examples=300)
@given(st.binary(max_size=120))
def test_arbitrary_bytes_decode_or_raise_corrupt_record_only(data: bytes) -> None:
    try:
        record, _ = decode("t", data)
    except CorruptRecord:
        return
    assert isinstance(record.value, bytes)


@given(records, st.binary(min_size=1, max_size=8))
def test_arbitrary_suffix_or_prefix_never_raises_anything_else(record: Record, junk: bytes) -> None:
    data = encode(record, 1)
    for mangled in (junk + data, data[: len(data) // 2] + junk, bytes([data[0] ^ 0xFF]) + data[1:]):
        with contextlib.suppress(CorruptRecord):
            decode("t", mangled)
