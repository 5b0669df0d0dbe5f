"""The rule of what a topic can never take (agent/record_batch.py): the exact size of a
batch of one, the floors of compressed sizes, and the timestamp range. The sizes are checked
against Apache Kafka itself in tests/ingest/test_kafka_limits_kafka.py."""

from __future__ import annotations

import os

import pytest

from agent.record_batch import (
    BATCH_HEADER,
    NO_LIMIT_MS,
    SKEW_MS,
    batch_of_one,
    impossible_timestamp,
    never_fits,
    record_bytes,
    varint_size,
)

LIMIT = 10_000
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


@pytest.mark.parametrize("n", [0, 1, 63, 64, 8191, 8192, 20_000, 1_048_576])
def test_varint_sizes_are_kafka_s_zigzag(n: int) -> None:
    # zigzag doubles, 7 bits a byte: 63 is one byte, 64 two; 8191 two, 8192 three; 2^20 four.
    expected = {0: 1, 1: 1, 63: 1, 64: 2, 8191: 2, 8192: 3, 20_000: 3, 1_048_576: 4}[n]
    assert varint_size(n) == expected
    assert varint_size(-1) == 1


@pytest.mark.parametrize("key", [None, b"", b"k" * 200])
@pytest.mark.parametrize("headers", [(), (("a", b"x"),), (("trace", None), ("é", b"v" * 70))])
@pytest.mark.parametrize("size", [0, 50, 64, 9_900, 20_000])
def test_the_size_of_a_batch_of_one_is_the_record_it_holds_plus_the_batch_header(
    key: bytes | None, headers: tuple[tuple[str, bytes | None], ...], size: int
) -> None:
    value = b"v" * size
    assert batch_of_one(None if key is None else len(key), size, headers) == \
        BATCH_HEADER + len(record_bytes(key, value, headers))


@pytest.mark.parametrize("codec", CODECS)
def test_a_message_whose_batch_fits_uncompressed_is_never_refused(codec: str) -> None:
    value = os.urandom(LIMIT - 100)
    assert batch_of_one(None, len(value)) <= LIMIT
    assert never_fits(LIMIT, codec, None, value) is False
    # Exactly at the limit too: "over" means over.
    exact = os.urandom(LIMIT - (batch_of_one(None, LIMIT - 100) - (LIMIT - 100)))
    assert batch_of_one(None, len(exact)) == LIMIT
    assert never_fits(LIMIT, codec, None, exact) is False
    assert never_fits(LIMIT, "none", None, exact + b"x") is True


@pytest.mark.parametrize("codec,verdict", [("none", True), ("gzip", True), ("snappy", True),
                                           ("lz4", True), ("zstd", None)])
def test_an_incompressible_message_over_the_limit_never_fits(codec: str,
                                                             verdict: bool | None) -> None:
    assert never_fits(LIMIT, codec, None, os.urandom(20_000)) is verdict


@pytest.mark.parametrize("codec,verdict", [("none", True), ("gzip", False),
                                           ("snappy", False), ("lz4", False), ("zstd", None)])
def test_a_compressible_message_over_the_limit_fits_when_the_producer_compresses(
    codec: str, verdict: bool | None
) -> None:
    # Text-like: a few hundred distinct words, repeated.
    words = [os.urandom(4).hex().encode() for _ in range(300)]
    value = b" ".join(words[i * 7 % 300] for i in range(2500))[:20_000]
    assert never_fits(LIMIT, codec, None, value) is verdict


@pytest.mark.parametrize("codec", ["lz4", "snappy"])
def test_the_floor_sees_a_repeat_far_back(codec: str) -> None:
    # 8,000 random bytes twice: a compressor copies the second half in a few bytes, so it
    # fits 10,000, and the floor must not say otherwise.
    half = os.urandom(8_000)
    assert never_fits(LIMIT, codec, None, half + half) is False
    # 12,000 random bytes, repeated or not, are over 10,000 whatever lz4 does. Snappy's floor
    # is weaker (its shortest copy costs 2 bytes, so it grants repeats twice their worth):
    # it accepts this one, and the forwarder's rules see to it. Accepting is the safe side.
    big = os.urandom(12_000)
    assert never_fits(LIMIT, codec, None, big + big) is (codec == "lz4")


def test_an_unknown_codec_refuses_nothing_it_cannot_judge() -> None:
    assert never_fits(LIMIT, "brotli", None, os.urandom(20_000)) is None


NOW = 1_800_000_000_000
HOUR = 3_600_000


@pytest.mark.parametrize("ts,before,after,expected", [
    (NOW + 2 * HOUR, None, 60_000, "future"),
    (NOW + 60_000 + SKEW_MS, None, 60_000, None),  # within the margin: the forwarder's call
    (NOW + 60_000 + SKEW_MS + 1, None, 60_000, "future"),
    (NOW - 2 * HOUR, 60_000, None, "old"),
    (NOW - 60_000 - SKEW_MS, 60_000, None, None),
    (NOW - 2 * HOUR, None, None, None),  # no limits known
    (NOW + 2 * HOUR, NO_LIMIT_MS, 2**63 - 1, None),  # Kafka's "no limit"
    (0, 60_000, 60_000, None),  # no client time: librdkafka stamps 0 with the send time
    (-5, 60_000, 60_000, None),
    (NOW + 30 * 60_000, None, HOUR, None),  # Kafka 4's default after.max.ms, 1 h
])
def test_a_timestamp_is_impossible_only_past_the_topic_s_range_and_a_margin(
    ts: int, before: int | None, after: int | None, expected: str | None
) -> None:
    assert impossible_timestamp(ts, NOW, before, after) == expected
