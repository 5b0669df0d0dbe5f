"""ferry_client/wire.py: the encoder against the byte layout of Bruce's document and against the
agent's decoder (agent/ingest/datagram.py), in both directions.

The layout (seed documents 000 and 001, "Message Formats"; integers in the Kafka protocol's
notation, i.e. big-endian):

    GenericMessage      => Size:int32 ApiKey:int16 ApiVersion:int16 Message
    AnyPartitionMessage => Flags:int16 TopicSize:int16 Topic Timestamp:int64
                           KeySize:int32 Key ValueSize:int32 Value
    PartitionKeyMessage => Flags:int16 PartitionKey:int32 TopicSize:int16 Topic
                           Timestamp:int64 KeySize:int32 Key ValueSize:int32 Value
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.ingest import datagram as decoder
from agent.records import Record
from ferry_client import wire
from spool.format import is_legal_topic as spool_rule

LIMIT = 10_000_000

topics = st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=249).filter(
    lambda t: t not in (".", ".."))
int32s = st.integers(-(2**31), 2**31 - 1)
int64s = st.integers(-(2**63), 2**63 - 1)


def test_any_partition_matches_the_documented_layout_byte_for_byte() -> None:
    # Written out field by field from the document, not with the encoder's structs.
    expected = bytes.fromhex(
        "00000029"  # Size = 41: the whole datagram, Size included
        "0100"  # ApiKey 256 = AnyPartition
        "0000"  # ApiVersion 0
        "0000"  # Flags 0
        "0006" "636c69636b73"  # TopicSize 6, "clicks"
        "00000189c3a1e000"  # Timestamp 1691204313088 ms
        "00000002" "6b31"  # KeySize 2, "k1"
        "00000005" "68656c6c6f"  # ValueSize 5, "hello"
    )
    assert len(expected) == 41
    assert wire.encode_any_partition("clicks", b"hello", b"k1", 0x189C3A1E000) == expected


def test_partition_key_matches_the_documented_layout_byte_for_byte() -> None:
    expected = bytes.fromhex(
        "00000024"  # Size = 36
        "0101"  # ApiKey 257 = PartitionKey
        "0000"  # ApiVersion 0
        "0000"  # Flags 0
        "fffffff9"  # PartitionKey -7, signed
        "0001" "74"  # TopicSize 1, "t"
        "ffffffffffffffff"  # Timestamp -1
        "00000000"  # KeySize 0: no key
        "00000003" "616263"  # ValueSize 3, "abc"
    )
    assert len(expected) == 36
    assert wire.encode_partition_key("t", -7, b"abc", None, -1) == expected


def test_the_agent_decodes_the_documented_layout() -> None:
    # The same hand-built bytes, the other way: the agent's decoder reads what the document
    # describes, whoever encoded it (to_bruce, Bruce's other example clients).
    any_partition = bytes.fromhex(
        "00000029" "0100" "0000" "0000" "0006" "636c69636b73" "00000189c3a1e000"
        "00000002" "6b31" "00000005" "68656c6c6f")
    partition_key = bytes.fromhex(
        "00000024" "0101" "0000" "0000" "fffffff9" "0001" "74" "ffffffffffffffff" "00000000"
        "00000003" "616263")
    assert decoder.parse(any_partition, LIMIT) == Record(
        "clicks", b"hello", b"k1", None, 0x189C3A1E000)
    assert decoder.parse(partition_key, LIMIT) == Record("t", b"abc", None, -7, -1)


def test_decoder_and_encoder_share_the_constants() -> None:
    assert (wire.ANY_PARTITION, wire.PARTITION_KEY, wire.API_VERSION) == (256, 257, 0)
    assert decoder.ANY_PARTITION is wire.ANY_PARTITION
    assert decoder.PARTITION_KEY is wire.PARTITION_KEY


@given(topics, st.binary(max_size=300), st.none() | st.binary(min_size=1, max_size=50), int64s)
def test_any_partition_round_trips_through_the_agent(
    topic: str, value: bytes, key: bytes | None, timestamp_ms: int
) -> None:
    data = wire.encode_any_partition(topic, value, key, timestamp_ms)
    assert decoder.parse(data, LIMIT) == Record(topic, value, key, None, timestamp_ms)


@given(topics, int32s, st.binary(max_size=300), st.none() | st.binary(min_size=1, max_size=50),
       int64s)
def test_partition_key_round_trips_through_the_agent(
    topic: str, partition_key: int, value: bytes, key: bytes | None, timestamp_ms: int
) -> None:
    data = wire.encode_partition_key(topic, partition_key, value, key, timestamp_ms)
    assert decoder.parse(data, LIMIT) == Record(topic, value, key, partition_key, timestamp_ms)


@given(st.text(max_size=260))
def test_client_and_agent_agree_on_legal_topic_names(name: str) -> None:
    assert wire.is_legal_topic(name) == spool_rule(name)


@pytest.mark.parametrize("name", ["", ".", "..", "a" * 250, "has space", "caf\u00e9", "abc\n",
                                  "a/b", "a\x00"])
def test_illegal_topic_names(name: str) -> None:
    assert not wire.is_legal_topic(name) and not spool_rule(name)
    with pytest.raises(ValueError, match="not a legal Kafka topic name"):
        wire.encode_any_partition(name, b"v")
    with pytest.raises(ValueError, match="not a legal Kafka topic name"):
        wire.encode_partition_key(name, 1, b"v")


def test_longest_legal_topic_is_encoded() -> None:
    topic = "a" * 249
    assert decoder.parse(wire.encode_any_partition(topic, b"v"), LIMIT).topic == topic


@pytest.mark.parametrize("partition_key", [2**31, -(2**31) - 1, 1.5, "7", True, None])
def test_bad_partition_keys_are_refused(partition_key: object) -> None:
    with pytest.raises(ValueError, match="partition_key .* is not a signed 32-bit integer"):
        wire.encode_partition_key("t", partition_key, b"v")  # type: ignore[arg-type]


@pytest.mark.parametrize("timestamp_ms", [2**63, -(2**63) - 1, 1.5, "1"])
def test_bad_timestamps_are_refused(timestamp_ms: object) -> None:
    with pytest.raises(ValueError, match="timestamp_ms"):
        wire.encode_any_partition("t", b"v", None, timestamp_ms)  # type: ignore[arg-type]


def test_text_instead_of_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="value must be bytes"):
        wire.encode_any_partition("t", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key must be bytes"):
        wire.encode_partition_key("t", 1, b"v", "text")  # type: ignore[arg-type]


def test_default_timestamp_is_now() -> None:
    import time

    before = time.time_ns() // 1_000_000
    record = decoder.parse(wire.encode_any_partition("t", b"v"), LIMIT)
    assert before <= record.timestamp_ms <= time.time_ns() // 1_000_000
