"""codec.encode_spool_block: spool blocks straight into buffer values, equal to encode()."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agent.buffer import codec
from agent.records import Record
from spool.format import SpoolFormatError, SpoolRecord, encode_file
from spool.reader import BinarySpoolReader, SpoolBlock
from tests.spool.samples import BUGGY_BODIES, file_with_body

NOW = 1_700_000_000_123
INT32 = st.integers(-(2**31), 2**31 - 1)

spool_records = st.builds(
    SpoolRecord,
    topic=st.sampled_from(["a", "b", "orders.v2"]),
    value=st.binary(max_size=300),
    key=st.none() | st.binary(max_size=40),
    partition_key=st.none() | INT32,
    timestamp_ms=st.sampled_from([0]) | st.integers(-(2**63), 2**63 - 1),
    headers=st.just(()),  # records with headers are the reader's (see below)
)


def expected(r: SpoolRecord, generation: int) -> bytes:
    """What the record-at-a-time path (agent Record + codec.encode) stores."""
    return codec.encode(Record(r.topic, r.value, r.key, r.partition_key,
                               r.timestamp_ms or NOW, r.headers,
                               r.key is not None and r.partition_key is None), generation)


def blocks_of(path: Path, records: list[SpoolRecord], block_bytes: int) -> list[SpoolBlock]:
    path.write_bytes(encode_file(records, block_bytes=block_bytes))
    return list(BinarySpoolReader(path).iter_blocks())


def encode_all(
    blocks: list[SpoolBlock], generations: dict[str, int], start: int = 0
) -> list[tuple[str, list[bytes], int]]:
    reader = BinarySpoolReader("unused.ferry")
    out: list[tuple[str, list[bytes], int]] = []
    for b in blocks:
        runs = codec.encode_spool_block(b.body, b.record_count, max(start - b.first, 0),
                                        generations, NOW, reader.topic_of)
        assert runs is not None
        out += runs
    return out


@settings(max_examples=200, deadline=None)
@given(records=st.lists(spool_records, min_size=1, max_size=60),
       block_bytes=st.sampled_from([1, 300, 1 << 20]), start=st.integers(0, 70))
def test_values_equal_encode_of_each_record_in_runs_of_one_topic(
    tmp_path_factory: pytest.TempPathFactory, records: list[SpoolRecord], block_bytes: int,
    start: int,
) -> None:
    path = tmp_path_factory.mktemp("bulk") / "f.ferry"
    generations = {"a": 3, "orders.v2": 1}
    blocks = [b for b in blocks_of(path, records, block_bytes) if b.first + b.record_count > start]
    runs = encode_all(blocks, generations, start)
    assert [(t, v) for t, vs, _ in runs for v in vs] == [
        (r.topic, expected(r, generations.get(r.topic, 0))) for r in records[start:]]
    assert all(vs for _, vs, _ in runs)
    assert all(g == generations.get(t, 0) for t, _, g in runs)
    for b in blocks:  # within a block, a run ends only where the topic changes
        per_block = encode_all([b], generations, start)
        assert all(per_block[i][0] != per_block[i + 1][0] for i in range(len(per_block) - 1))
    for b in blocks:  # by_topic: one run per topic, each in block order
        reader = BinarySpoolReader("unused.ferry")
        grouped = codec.encode_spool_block(b.body, b.record_count, max(start - b.first, 0),
                                           generations, NOW, reader.topic_of, by_topic=True)
        assert grouped is not None
        mine = records[max(start, b.first):b.first + b.record_count]
        assert len({t for t, _, _ in grouped}) == len(grouped)
        assert {t: (vs, g) for t, vs, g in grouped} == {
            t: ([expected(r, generations.get(t, 0)) for r in mine if r.topic == t],
                generations.get(t, 0)) for t in {r.topic for r in mine}}
    for topic, values, _ in runs:
        decoded = [codec.decode(topic, v) for v in values]
        assert all(g == generations.get(topic, 0) for _, g in decoded)


def test_decoded_fields_keep_key_partition_key_and_placement(tmp_path: Path) -> None:
    records = [SpoolRecord("t", b"v0"),
               SpoolRecord("t", b"v1", key=b""),  # an empty key is a key
               SpoolRecord("t", b"v2", key=b"k", partition_key=0),
               SpoolRecord("t", b"v3", partition_key=-5, timestamp_ms=42)]
    (run,) = encode_all(blocks_of(tmp_path / "f.ferry", records, 1 << 20), {})
    got = [codec.decode("t", v)[0] for v in run[1]]
    assert [(r.value, r.key, r.partition_key, r.hash_key, r.timestamp_ms) for r in got] == [
        (b"v0", None, None, False, NOW),
        (b"v1", b"", None, True, NOW),
        (b"v2", b"k", 0, False, NOW),
        (b"v3", None, -5, False, 42)]


def test_a_block_with_headers_is_left_to_the_reader(tmp_path: Path) -> None:
    records = [SpoolRecord("t", b"plain"), SpoolRecord("t", b"h", headers=(("n", b"1"),))]
    (block,) = blocks_of(tmp_path / "f.ferry", records, 1 << 20)
    assert codec.encode_spool_block(block.body, block.record_count, 0, {}, NOW,
                                    BinarySpoolReader("x").topic_of) is None


@pytest.mark.parametrize(
    ("body", "count", "message"), list(BUGGY_BODIES.values()), ids=list(BUGGY_BODIES)
)
def test_a_malformed_block_is_never_encoded(body: bytes, count: int, message: str) -> None:
    assert codec.encode_spool_block(body, count, 0, {}, NOW,
                                    BinarySpoolReader("x").topic_of) is None


def test_a_count_that_does_not_match_is_left_to_the_reader(tmp_path: Path) -> None:
    (block,) = blocks_of(tmp_path / "f.ferry", [SpoolRecord("t", b"v")] * 3, 1 << 20)
    topic_of = BinarySpoolReader("x").topic_of
    assert codec.encode_spool_block(block.body, 3, 0, {}, NOW, topic_of) is not None
    for wrong in (2, 4):
        assert codec.encode_spool_block(block.body, wrong, 0, {}, NOW, topic_of) is None


def test_a_topic_the_caller_refuses_is_left_to_the_reader(tmp_path: Path) -> None:
    (block,) = blocks_of(tmp_path / "f.ferry", [SpoolRecord("t", b"v")], 1 << 20)
    assert codec.encode_spool_block(block.body, 1, 0, {}, NOW, lambda raw: None) is None
    assert file_with_body(block.body, 1)  # the same body is a valid file otherwise


@pytest.mark.parametrize(("record", "taken"), [
    (SpoolRecord("t", b"v" * 100, key=b"k" * 20, timestamp_ms=NOW), True),  # at the room
    (SpoolRecord("t", b"v" * 101, key=b"k" * 20, timestamp_ms=NOW), False),
    (SpoolRecord("t", b"v", timestamp_ms=NOW - 1000), True),  # at the earliest
    (SpoolRecord("t", b"v", timestamp_ms=NOW - 1001), False),
    (SpoolRecord("t", b"v", timestamp_ms=NOW + 1000), True),  # at the latest
    (SpoolRecord("t", b"v", timestamp_ms=NOW + 1001), False),
    (SpoolRecord("t", b"v", timestamp_ms=0), True),  # no timestamp: stamped at intake
    (SpoolRecord("t", b"v", timestamp_ms=-7), True),
    (SpoolRecord("other", b"v" * 500, timestamp_ms=NOW + 10**9), True),  # no bounds
])
def test_a_record_outside_its_topic_s_bounds_leaves_its_block_to_the_reader(
    tmp_path: Path, record: SpoolRecord, taken: bool
) -> None:
    # The intake's first look at what a Kafka topic can never take (kafka_limits.Bounds).
    records = [SpoolRecord("t", b"fine", timestamp_ms=NOW), record, SpoolRecord("t", b"end")]
    (block,) = blocks_of(tmp_path / "f.ferry", records, 1 << 20)
    bounds = {"t": (120, NOW - 1000, NOW + 1000)}
    for by_topic in (False, True):
        runs = codec.encode_spool_block(block.body, 3, 0, {}, NOW,
                                        BinarySpoolReader("x").topic_of, by_topic=by_topic,
                                        bounds=bounds)
        assert (runs is not None) == taken
        if runs is not None:
            assert sorted(v for _, values, _ in runs for v in values) == sorted(
                expected(r, 0) for r in records)


@given(value=st.binary(max_size=50), key=st.none() | st.binary(max_size=10),
       old=st.integers(0, 2**32 - 1), new=st.integers(0, 2**32 - 1))
def test_with_generation_equals_encoding_under_the_other_generation(
    value: bytes, key: bytes | None, old: int, new: int
) -> None:
    record = Record("t", value, key, None, 5, (("h", b"x"),), False)
    assert codec.with_generation([codec.encode(record, old)], new) == [
        codec.encode(record, new)]


@settings(max_examples=400, deadline=None)
@given(records=st.lists(spool_records, min_size=1, max_size=8),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      max_size=4),
       count_delta=st.sampled_from([0, 0, 0, -1, 1]))
def test_a_damaged_block_is_encoded_only_if_the_reader_takes_it_and_then_identically(
    tmp_path_factory: pytest.TempPathFactory, records: list[SpoolRecord],
    flips: list[tuple[float, int]], count_delta: int,
) -> None:
    """Whatever the bytes of a block (one whose CRC was resealed by a buggy writer), the bulk
    encoder either declines or yields exactly what the reader's decoder + encode() yield."""
    path = tmp_path_factory.mktemp("damaged") / "f.ferry"
    (block,) = blocks_of(path, records, 1 << 30)
    body = bytearray(block.body)
    for where, value in flips:
        body[int(where * len(body))] = value
    count = max(block.record_count + count_delta, 1)
    reader = BinarySpoolReader(path)
    reader.topic_of(b"a")
    bulk = codec.encode_spool_block(bytes(body), count, 0, {}, NOW, reader.topic_of)
    damaged = SpoolBlock(0, count, block.offset, bytes(body))
    try:
        decoded = reader.decode_block(damaged)
    except SpoolFormatError:
        assert bulk is None
        event("the reader refuses the block")
        return
    if bulk is not None:
        event("both take the block")
        assert [(t, v) for t, vs, _ in bulk for v in vs] == [(r.topic, expected(r, 0))
                                                          for r in decoded]
    else:
        event("only the reader takes the block")
