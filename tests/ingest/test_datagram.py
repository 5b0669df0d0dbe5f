"""Bruce's datagram format: byte-exact encoding, round trips, and every reject reason."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.buffer import codec
from agent.ingest.datagram import (
    INVALID_TOPIC,
    MALFORMED,
    TOO_LARGE,
    UNSUPPORTED_API_KEY,
    UNSUPPORTED_VERSION,
    Reject,
    parse,
    parse_encoded,
)
from agent.records import Record
from ferry_client.wire import encode_any_partition, encode_partition_key

LIMIT = 1_000_000

# Written out by hand from the spec, field by field, big-endian.
ANY_PARTITION_HEX = (
    "00000024"  # Size = 36, the whole datagram
    "0100"  # ApiKey 256 (AnyPartition)
    "0000"  # ApiVersion 0
    "0000"  # Flags 0
    "0002"  # TopicSize 2
    "7431"  # Topic "t1"
    "0000018bcfe56800"  # Timestamp 1_700_000_000_000 ms
    "00000001"  # KeySize 1
    "6b"  # Key "k"
    "00000005"  # ValueSize 5
    "68656c6c6f"  # Value "hello"
)
PARTITION_KEY_HEX = (
    "00000023"  # Size = 35
    "0101"  # ApiKey 257 (PartitionKey)
    "0000"  # ApiVersion 0
    "0000"  # Flags 0
    "01020304"  # PartitionKey 16909060
    "0002"  # TopicSize 2
    "7431"  # Topic "t1"
    "0000000000000001"  # Timestamp 1 ms
    "00000000"  # KeySize 0 (no key)
    "00000001"  # ValueSize 1
    "76"  # Value "v"
)


def build(
    *,
    api_key: int = 256,
    version: int = 0,
    flags: int = 0,
    partition_key: int = 7,
    topic: bytes = b"t",
    topic_size: int | None = None,
    timestamp_ms: int = 5,
    key: bytes = b"",
    key_size: int | None = None,
    value: bytes = b"v",
    value_size: int | None = None,
    trailing: bytes = b"",
    size: int | None = None,
) -> bytes:
    """A datagram from its fields, any of which may lie; independent of the module's Structs."""
    body = struct.pack(">h", flags)
    if api_key == 257:
        body += struct.pack(">i", partition_key)
    body += struct.pack(">h", len(topic) if topic_size is None else topic_size) + topic
    body += struct.pack(">qi", timestamp_ms, len(key) if key_size is None else key_size) + key
    body += struct.pack(">i", len(value) if value_size is None else value_size) + value
    body += trailing
    head = struct.pack(">hh", api_key, version)
    return struct.pack(">i", 4 + len(head) + len(body) if size is None else size) + head + body


def reject_reason(data: bytes, limit: int = LIMIT) -> str:
    with pytest.raises(Reject) as info:
        parse(data, limit)
    assert info.value.detail and str(info.value).startswith(info.value.reason)
    return info.value.reason


# --- byte-exact format ---------------------------------------------------------------------


def test_any_partition_encoding_matches_the_spec_byte_for_byte() -> None:
    encoded = encode_any_partition("t1", b"hello", key=b"k", timestamp_ms=1_700_000_000_000)
    assert encoded.hex() == ANY_PARTITION_HEX


def test_partition_key_encoding_matches_the_spec_byte_for_byte() -> None:
    encoded = encode_partition_key("t1", 0x01020304, b"v", timestamp_ms=1)
    assert encoded.hex() == PARTITION_KEY_HEX


def test_parse_hand_written_any_partition() -> None:
    record = parse(bytes.fromhex(ANY_PARTITION_HEX), LIMIT)
    assert record == Record(
        topic="t1",
        value=b"hello",
        key=b"k",
        partition_key=None,
        timestamp_ms=1_700_000_000_000,
        headers=(),
        hash_key=False,
    )


def test_parse_hand_written_partition_key() -> None:
    record = parse(bytes.fromhex(PARTITION_KEY_HEX), LIMIT)
    assert record == Record(
        topic="t1", value=b"v", key=None, partition_key=16909060, timestamp_ms=1, hash_key=False
    )


def test_partition_key_is_signed_int32() -> None:
    encoded = encode_partition_key("t1", -2, b"v", timestamp_ms=1)
    assert encoded[10:14] == bytes.fromhex("fffffffe")
    assert parse(encoded, LIMIT).partition_key == -2
    for out_of_range in (2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match="32-bit"):
            encode_partition_key("t1", out_of_range, b"v")


def test_empty_key_and_empty_value() -> None:
    record = parse(encode_any_partition("t", b"", key=b"", timestamp_ms=0), LIMIT)
    assert (record.key, record.value, record.timestamp_ms) == (None, b"", 0)


def test_encode_defaults_timestamp_to_now() -> None:
    import time

    before = time.time_ns() // 1_000_000
    record = parse(encode_any_partition("t", b"v"), LIMIT)
    after = time.time_ns() // 1_000_000
    assert before <= record.timestamp_ms <= after


def test_memoryview_and_bytearray_inputs() -> None:
    data = bytes.fromhex(ANY_PARTITION_HEX)
    buffer = bytearray(data + b"garbage beyond the received length")
    for view in (memoryview(buffer)[: len(data)], memoryview(data), bytearray(data)):
        record = parse(view, LIMIT)  # type: ignore[arg-type]  # bytearray: also accepted
        assert (record.topic, record.key, record.value) == ("t1", b"k", b"hello")
        assert type(record.value) is bytes and type(record.key) is bytes
    # The record must not alias the receive buffer, which the socket loop reuses.
    record = parse(memoryview(buffer)[: len(data)], LIMIT)
    buffer[:] = bytes(len(buffer))
    assert record.value == b"hello"


def test_encode_refuses_what_ferry_would_reject() -> None:
    for topic in ("", "has space", "caf\u00e9", "a" * 250, ".", "..", "abc\n"):
        with pytest.raises(ValueError, match="topic"):
            encode_any_partition(topic, b"v")
        with pytest.raises(ValueError, match="topic"):
            encode_partition_key(topic, 1, b"v")
    with pytest.raises(ValueError, match="timestamp"):
        encode_any_partition("t", b"v", timestamp_ms=2**63)


# --- rejects -------------------------------------------------------------------------------


def test_baseline_of_build_is_valid() -> None:
    assert parse(build(), LIMIT).value == b"v"
    assert parse(build(api_key=257), LIMIT).partition_key == 7


@pytest.mark.parametrize("length", range(8))
def test_shorter_than_the_generic_header(length: int) -> None:
    assert reject_reason(build()[:length]) == MALFORMED


@pytest.mark.parametrize("api_key", [256, 257])
def test_size_field_disagrees_with_datagram_length(api_key: int) -> None:
    good = build(api_key=api_key)
    assert reject_reason(build(api_key=api_key, size=len(good) + 1)) == MALFORMED
    assert reject_reason(build(api_key=api_key, size=len(good) - 1)) == MALFORMED
    assert reject_reason(build(api_key=api_key, size=-1)) == MALFORMED


@pytest.mark.parametrize("api_key", [256, 257])
def test_truncated_datagram_with_matching_size(api_key: int) -> None:
    good = build(api_key=api_key, key=b"key", value=b"value")
    for length in range(8, len(good)):
        cut = struct.pack(">i", length) + good[4:length]
        assert reject_reason(cut) == MALFORMED, length


@pytest.mark.parametrize("api_key", [256, 257])
def test_trailing_bytes(api_key: int) -> None:
    assert reject_reason(build(api_key=api_key, trailing=b"x")) == MALFORMED


@pytest.mark.parametrize("api_key", [256, 257])
def test_flags_must_be_zero(api_key: int) -> None:
    assert reject_reason(build(api_key=api_key, flags=1)) == MALFORMED
    assert reject_reason(build(api_key=api_key, flags=-1)) == MALFORMED


@pytest.mark.parametrize("api_key", [256, 257])
def test_topic_size_must_be_positive(api_key: int) -> None:
    assert reject_reason(build(api_key=api_key, topic=b"", topic_size=0)) == MALFORMED
    assert reject_reason(build(api_key=api_key, topic_size=-1)) == MALFORMED


def test_topic_size_past_end() -> None:
    assert reject_reason(build(topic_size=1000)) == MALFORMED


@pytest.mark.parametrize("api_key", [256, 257])
def test_negative_key_size(api_key: int) -> None:
    assert reject_reason(build(api_key=api_key, key_size=-1)) == MALFORMED
    assert reject_reason(build(api_key=api_key, key_size=-(2**31))) == MALFORMED


def test_key_size_past_end() -> None:
    assert reject_reason(build(key=b"k", key_size=1000)) == MALFORMED
    assert reject_reason(build(key=b"k", key_size=2**31 - 1)) == MALFORMED


def test_negative_or_overlong_value_size() -> None:
    assert reject_reason(build(value_size=-1)) == MALFORMED
    assert reject_reason(build(value_size=2)) == MALFORMED
    assert reject_reason(build(value_size=0)) == MALFORMED  # the value byte is then trailing


@pytest.mark.parametrize("api_key", [258, 0, 1, 255, -1, 0x7FFF])
def test_unsupported_api_key(api_key: int) -> None:
    assert reject_reason(build(api_key=api_key)) == UNSUPPORTED_API_KEY


def test_unsupported_api_key_in_a_datagram_too_short_for_any_message() -> None:
    assert reject_reason(struct.pack(">ihh", 8, 258, 0)) == UNSUPPORTED_API_KEY


@pytest.mark.parametrize("api_key", [256, 257])
@pytest.mark.parametrize("version", [1, -1, 2])
def test_unsupported_version(api_key: int, version: int) -> None:
    assert reject_reason(build(api_key=api_key, version=version)) == UNSUPPORTED_VERSION
    assert reject_reason(struct.pack(">ihh", 8, api_key, version)) == UNSUPPORTED_VERSION


@pytest.mark.parametrize(
    "topic",
    [
        b"has space",
        "caf\u00e9".encode(),  # non-ASCII
        b"\xff",
        b"a" * 250,  # Kafka allows at most 249
        b".",
        b"..",
        b"slash/topic",
        b"abc\n",
        b"nul\x00",
    ],
)
@pytest.mark.parametrize("api_key", [256, 257])
def test_bad_topic(topic: bytes, api_key: int) -> None:
    assert reject_reason(build(api_key=api_key, topic=topic)) == INVALID_TOPIC


def test_longest_legal_topic_is_accepted() -> None:
    assert parse(build(topic=b"a" * 249), LIMIT).topic == "a" * 249


def test_too_large_counts_key_plus_value() -> None:
    assert parse(build(key=b"kk", value=b"vvv"), 5).value == b"vvv"  # exactly at the limit
    assert reject_reason(build(key=b"kk", value=b"vvvv"), 5) == TOO_LARGE
    assert reject_reason(build(value=b"x" * 6), 5) == TOO_LARGE
    assert reject_reason(build(key=b"k" * 6, value=b""), 5) == TOO_LARGE


def test_too_large_uses_the_topics_own_limit() -> None:
    limits = {"small": 3, "big": 100}
    data_small = build(topic=b"small", value=b"x" * 10)
    data_big = build(topic=b"big", value=b"x" * 10)
    with pytest.raises(Reject) as info:
        parse(data_small, limits.__getitem__)
    assert info.value.reason == TOO_LARGE and "small" in info.value.detail
    assert parse(data_big, limits.__getitem__).value == b"x" * 10


def test_bad_topic_is_reported_before_too_large() -> None:
    assert reject_reason(build(topic=b"bad topic", value=b"x" * 10), 1) == INVALID_TOPIC


def test_a_rejected_topic_stays_rejected_and_a_legal_one_stays_legal() -> None:
    # The topic cache must hold only legal names.
    for _ in range(3):
        assert reject_reason(build(topic=b"no way")) == INVALID_TOPIC
        assert parse(build(topic=b"fine"), LIMIT).topic == "fine"


# --- properties ----------------------------------------------------------------------------

legal_topics = st.from_regex(r"[A-Za-z0-9._-]{1,249}", fullmatch=True).filter(
    lambda t: t not in (".", "..")
)
int64s = st.integers(-(2**63), 2**63 - 1)
int32s = st.integers(-(2**31), 2**31 - 1)


@given(st.binary(max_size=600))
def test_arbitrary_bytes_parse_or_reject(data: bytes) -> None:
    try:
        record = parse(data, LIMIT)
    except Reject as exc:
        assert exc.reason in (MALFORMED, UNSUPPORTED_API_KEY, UNSUPPORTED_VERSION, INVALID_TOPIC)
    else:
        assert isinstance(record, Record)


@st.composite
def mutated_datagrams(draw: st.DrawFn) -> bytes:
    """Valid datagrams with bytes overwritten, cut or appended; Size fixed up or not."""
    if draw(st.booleans()):
        data = encode_any_partition(
            draw(legal_topics), draw(st.binary(max_size=50)), draw(st.binary(max_size=20)), 0
        )
    else:
        data = encode_partition_key(
            draw(legal_topics), draw(int32s), draw(st.binary(max_size=50)), None, 0
        )
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(buf) - 1))
        buf[at] = draw(st.integers(0, 255))
    buf = buf[: draw(st.integers(0, len(buf)))] + draw(st.binary(max_size=8))
    if draw(st.booleans()) and len(buf) >= 4:
        buf[:4] = struct.pack(">i", len(buf))
    return bytes(buf)


@given(mutated_datagrams(), st.integers(0, 100))
def test_mutated_datagrams_parse_or_reject(data: bytes, limit: int) -> None:
    try:
        record = parse(data, limit)
    except Reject:
        return
    assert isinstance(record, Record)
    assert record.size <= limit
    # Whatever was accepted re-encodes to exactly the same bytes.
    if record.partition_key is None:
        again = encode_any_partition(record.topic, record.value, record.key, record.timestamp_ms)
    else:
        again = encode_partition_key(
            record.topic, record.partition_key, record.value, record.key, record.timestamp_ms
        )
    assert again == data


@given(legal_topics, st.binary(max_size=300), st.none() | st.binary(max_size=100), int64s)
def test_any_partition_round_trip(
    topic: str, value: bytes, key: bytes | None, timestamp_ms: int
) -> None:
    record = parse(encode_any_partition(topic, value, key, timestamp_ms), LIMIT)
    assert record == Record(topic, value, key or None, None, timestamp_ms, (), False)


@given(legal_topics, int32s, st.binary(max_size=300), st.none() | st.binary(max_size=100), int64s)
def test_partition_key_round_trip(
    topic: str, partition_key: int, value: bytes, key: bytes | None, timestamp_ms: int
) -> None:
    record = parse(encode_partition_key(topic, partition_key, value, key, timestamp_ms), LIMIT)
    assert record == Record(topic, value, key or None, partition_key, timestamp_ms, (), False)


# --- parse_encoded: the socket's path, straight to buffer values ----------------------------


def outcome(parser: object, data: bytes, limit: int) -> object:
    try:
        return parser(data, limit)  # type: ignore[operator]
    except Reject as exc:
        return exc.reason


@given(mutated_datagrams(), st.integers(0, 100), st.integers(0, 2**32 - 1))
def test_parse_encoded_agrees_with_parse_then_encode(
    data: bytes, limit: int, generation: int
) -> None:
    """Same verdict for every datagram; when accepted, the value decodes to parse's record."""
    expected = outcome(parse, data, limit)
    got = outcome(lambda d, lim: parse_encoded(d, lim, {"other": 7, **_gens(d, generation)}),
                  data, limit)
    if isinstance(expected, str):
        assert got == expected
        return
    assert isinstance(expected, Record) and isinstance(got, tuple)
    topic, value = got
    assert topic == expected.topic
    assert value == codec.encode(expected, generation)
    assert codec.decode(topic, value) == (expected, generation)


def _gens(data: bytes, generation: int) -> dict[str, int]:
    try:
        return {parse(data, 1 << 30).topic: generation}
    except Reject:
        return {}


@given(legal_topics, int32s, st.binary(max_size=300), st.none() | st.binary(max_size=100), int64s)
def test_parse_encoded_round_trip_and_unknown_topic_generation(
    topic: str, partition_key: int, value: bytes, key: bytes | None, timestamp_ms: int
) -> None:
    data = encode_partition_key(topic, partition_key, value, key, timestamp_ms)
    got_topic, stored = parse_encoded(memoryview(bytearray(data)), LIMIT, {})
    record, generation = codec.decode(got_topic, stored)
    assert generation == 0  # a topic missing from the map is generation 0
    assert record == Record(topic, value, key or None, partition_key, timestamp_ms, (), False)
