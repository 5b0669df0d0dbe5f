"""spool.reader: binary, .jsonl and .txt readers, verify, and the spool directory listing."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from spool.format import (
    BLOCK_HEADER,
    FILE_HEADER,
    SpoolFormatError,
    SpoolRecord,
    encode_file,
    encode_record,
)
from spool.reader import (
    BinarySpoolReader,
    JsonLinesReader,
    SpoolBlock,
    TextLinesReader,
    list_ready_files,
    list_stale_temp_files,
    list_unrecognized_files,
    open_spool_file,
    read_spool_file,
    verify,
)
from tests.spool.samples import BUGGY_BODIES, RECORDS, file_with_body

ONE = len(encode_record(RECORDS[0]))


def write(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    return path


def multi_block_file(tmp_path: Path) -> tuple[Path, bytes]:
    """RECORDS in blocks of about four records."""
    data = encode_file(RECORDS, block_bytes=4 * ONE)
    return write(tmp_path, "multi.ferry", data), data


def block_offsets(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, body length, record count) of every block of an encoded file."""
    out: list[tuple[int, int, int]] = []
    pos = FILE_HEADER.size
    while True:
        length, count, _crc = BLOCK_HEADER.unpack_from(data, pos)
        if length == 0:
            return out
        out.append((pos, length, count))
        pos += BLOCK_HEADER.size + length


# --- binary files -------------------------------------------------------------------------------


def test_reads_every_record_with_its_index_and_verifies(tmp_path: Path) -> None:
    path, data = multi_block_file(tmp_path)
    assert len(block_offsets(data)) > 5
    reader = BinarySpoolReader(path)
    assert not reader.verified and reader.count is None
    assert list(reader) == list(enumerate(RECORDS))
    assert reader.verified and reader.count == len(RECORDS)
    assert verify(path) == len(RECORDS)
    assert verify(path, deep=True) == len(RECORDS)
    assert read_spool_file(path) == RECORDS


def test_resumes_from_an_index(tmp_path: Path) -> None:
    path, _ = multi_block_file(tmp_path)
    for start in (0, 1, 3, 4, 5, 17, 39, 40, 100):
        got = list(BinarySpoolReader(path).iter_records(start))
        assert got == list(enumerate(RECORDS))[start:]


def test_an_empty_file_has_no_records_but_is_valid(tmp_path: Path) -> None:
    path = write(tmp_path, "empty.ferry", encode_file([]))
    assert list(BinarySpoolReader(path)) == []
    assert verify(path) == 0


def test_a_record_larger_than_a_block_is_read_whole(tmp_path: Path) -> None:
    big = SpoolRecord("big", os.urandom(3 * 1024 * 1024), b"k")
    path = write(tmp_path, "big.ferry", encode_file([RECORDS[0], big, RECORDS[1]]))
    assert read_spool_file(path) == [RECORDS[0], big, RECORDS[1]]
    with pytest.raises(SpoolFormatError, match="this reader takes blocks up to 1048576 bytes"):
        BinarySpoolReader(path, max_block_bytes=1024 * 1024).verify()


def test_a_corrupt_byte_anywhere_is_caught_before_any_record_is_yielded(tmp_path: Path) -> None:
    _, data = multi_block_file(tmp_path)
    for offset in range(0, len(data), 7):
        broken = bytearray(data)
        broken[offset] ^= 0x40
        path = write(tmp_path, "corrupt.ferry", bytes(broken))
        with pytest.raises(SpoolFormatError):
            verify(path)
        reader = BinarySpoolReader(path)
        yielded: list[tuple[int, SpoolRecord]] = []
        with pytest.raises(SpoolFormatError):
            yielded.extend(reader)
        assert yielded == [] and not reader.verified, offset


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("body", "checksum mismatch in the block at offset 12 (records 0..{last}): the file is"),
        ("count", "checksum mismatch: trailer CRC"),
        ("trailer count", "trailer says 41 records but the file holds 40"),
        ("trailer crc", "checksum mismatch: trailer CRC"),
        ("trailer magic", "bad trailer"),
        ("garbage after", "unexpected bytes after the trailer"),
    ],
)
def test_corruption_messages_say_what_and_where(tmp_path: Path, where: str, message: str) -> None:
    _, data = multi_block_file(tmp_path)
    broken = bytearray(data)
    trailer = len(data) - 24
    if where == "body":
        broken[30] ^= 1
    elif where == "count":  # a block header field: the trailer's CRC covers block headers
        (second, _, _) = block_offsets(data)[1]
        struct.pack_into("<I", broken, second + 4, 3)
    elif where == "trailer count":
        struct.pack_into("<Q", broken, trailer + 12, 41)
    elif where == "trailer crc":
        broken[-1] ^= 1
    elif where == "trailer magic":
        broken[trailer + 4] ^= 1
    else:
        broken += b"\0"
    path = write(tmp_path, "c.ferry", bytes(broken))
    with pytest.raises(SpoolFormatError, match="c.ferry: ") as failure:
        verify(path)
    assert message.format(last=block_offsets(data)[0][2] - 1) in str(failure.value)


def test_a_truncated_file_is_rejected_wherever_it_is_cut(tmp_path: Path) -> None:
    data = encode_file(RECORDS[:6], block_bytes=2 * ONE)
    assert len(block_offsets(data)) >= 3
    for cut in range(len(data)):
        path = write(tmp_path, "cut.ferry", data[:cut])
        with pytest.raises(SpoolFormatError) as failure:
            verify(path)
        assert "cut.ferry" in str(failure.value)
        yielded: list[tuple[int, SpoolRecord]] = []
        with pytest.raises(SpoolFormatError):
            yielded.extend(BinarySpoolReader(path))
        assert yielded == [], cut


def test_truncation_messages(tmp_path: Path) -> None:
    _, data = multi_block_file(tmp_path)
    [(_, _, first_count), (second, _, _), *_] = block_offsets(data)
    cases = {
        FILE_HEADER.size: "file ends after 0 records at offset 12 without a trailer",
        second: f"file ends after {first_count} records at offset {second} without a trailer",
        second + 5: f"truncated: file ends inside a block header at {second}",
        second + 20: f"truncated: file ends inside the block at offset {second} (8 of",
        len(data) - 3: "truncated: file ends inside the trailer",
        5: "too short for a spool file header",
    }
    for cut, message in cases.items():
        path = write(tmp_path, "t.ferry", data[:cut])
        with pytest.raises(SpoolFormatError) as failure:
            verify(path)
        assert message in str(failure.value), cut


def test_without_verify_first_intact_blocks_before_the_damage_are_read(tmp_path: Path) -> None:
    """What verify_first=False means: streaming stops at the first bad block."""
    _, data = multi_block_file(tmp_path)
    [(_, _, first), (_, _, second), (third, _, _), *_] = block_offsets(data)
    path = write(tmp_path, "cut.ferry", data[: third + 20])
    yielded: list[tuple[int, SpoolRecord]] = []
    with pytest.raises(SpoolFormatError, match="truncated"):
        yielded.extend(BinarySpoolReader(path).iter_records(verify_first=False))
    assert yielded == list(enumerate(RECORDS))[: first + second]


@pytest.mark.parametrize(
    ("body", "count", "message"), list(BUGGY_BODIES.values()), ids=list(BUGGY_BODIES)
)
def test_malformed_records_in_an_intact_file_stop_the_reader(
    tmp_path: Path, body: bytes, count: int, message: str
) -> None:
    path = write(tmp_path, "buggy.ferry", file_with_body(body, count))
    assert verify(path) == count  # the shallow check trusts an intact block
    with pytest.raises(SpoolFormatError, match="buggy.ferry") as failure:
        verify(path, deep=True)
    assert message in str(failure.value)
    yielded: list[tuple[int, SpoolRecord]] = []
    with pytest.raises(SpoolFormatError):
        yielded.extend(BinarySpoolReader(path))
    assert yielded == []  # a block is decoded whole before any of it is yielded


def test_not_a_spool_file(tmp_path: Path) -> None:
    path = write(tmp_path, "x.ferry", b"PK\x03\x04 this is a zip file")
    with pytest.raises(SpoolFormatError, match="not a Ferry spool file"):
        verify(path)


# --- hand-made files ----------------------------------------------------------------------------


def topic_dir(tmp_path: Path, topic: str = "orders") -> Path:
    directory = tmp_path / topic
    directory.mkdir(exist_ok=True)
    return directory


def test_txt_lines_are_messages_for_the_directory_topic(tmp_path: Path) -> None:
    path = topic_dir(tmp_path) / "a.txt"
    path.write_bytes(b"first\nsecond\r\n\n\xff\x00binary\nlast without newline")
    os.utime(path, ns=(0, 1_234_567_000_000))
    records = read_spool_file(path)
    assert records == [
        SpoolRecord("orders", value, None, None, 1_234_567, ())
        for value in (b"first", b"second", b"\xff\x00binary", b"last without newline")
    ]
    assert verify(path) == 4
    assert list(TextLinesReader(path, "orders").iter_records(2)) == [
        (2, records[2]), (3, records[3])
    ]


def test_jsonl_fields(tmp_path: Path) -> None:
    path = topic_dir(tmp_path, "events") / "b.jsonl"
    lines = [
        {"value": "plain ü"},
        {"value": {"nested": [1, 2]}, "key": "k", "partition_key": -7},
        {"value": 42, "key": None, "timestamp": 1_700_000_000_000, "headers": {"h": "v"}},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    os.utime(path, ns=(0, 5_000_000_000))
    assert read_spool_file(path) == [
        SpoolRecord("events", "plain ü".encode(), None, None, 5000, ()),
        SpoolRecord("events", b'{"nested":[1,2]}', b"k", -7, 5000, ()),
        SpoolRecord("events", b"42", None, None, 1_700_000_000_000, (("h", b"v"),)),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('["value"]', "line 2: expected a JSON object, got list"),
        ('{"key": "k"}', "line 2: 'value' is required"),
        ('{"value": null}', "line 2: 'value' is required and may not be null"),
        ('{"value": "v", "partitionKey": 1}', "line 2: unknown field(s) ['partitionKey']"),
        ('{"value": "v", "key": 5}', "line 2: 'key' must be a string or null"),
        ('{"value": "v", "partition_key": 2147483648}', "'partition_key' must be an integer"),
        ('{"value": "v", "partition_key": true}', "'partition_key' must be an integer"),
        ('{"value": "v", "partition_key": 1.5}', "'partition_key' must be an integer"),
        ('{"value": "v", "timestamp": "now"}', "'timestamp' must be ms since the epoch"),
        ('{"value": "v", "headers": {"h": 1}}', "'headers' must be an object of strings"),
        ('{"value": "v", "headers": ["h"]}', "'headers' must be an object of strings"),
    ],
)
def test_a_bad_jsonl_line_rejects_the_file_before_any_record(
    tmp_path: Path, line: str, message: str
) -> None:
    path = topic_dir(tmp_path) / "bad.jsonl"
    path.write_text('{"value": "good"}\n' + line + '\n{"value": "after"}\n')
    with pytest.raises(SpoolFormatError, match="bad.jsonl") as failure:
        verify(path)
    assert message in str(failure.value)
    yielded: list[tuple[int, SpoolRecord]] = []
    with pytest.raises(SpoolFormatError):
        yielded.extend(JsonLinesReader(path, "orders"))
    assert yielded == []


def test_a_directory_that_is_not_a_topic_name(tmp_path: Path) -> None:
    path = topic_dir(tmp_path, "not a topic") / "a.txt"
    path.write_text("x\n")
    with pytest.raises(SpoolFormatError, match="'not a topic' is not a legal Kafka topic name"):
        open_spool_file(path)


def test_an_overlong_line_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("spool.reader.MAX_LINE_BYTES", 100)
    monkeypatch.setattr("spool.reader.CHUNK_SIZE", 64)
    path = topic_dir(tmp_path) / "long.txt"
    path.write_bytes(b"short\n" + b"x" * 500 + b"\nshort\n")
    with pytest.raises(SpoolFormatError, match="line 2 is longer than 100 bytes"):
        verify(path)


def test_lines_split_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("spool.reader.CHUNK_SIZE", 7)
    path = topic_dir(tmp_path) / "chunks.txt"
    values = [f"line number {i}".encode() for i in range(30)]
    path.write_bytes(b"\r\n".join(values))
    assert [r.value for r in read_spool_file(path)] == values


# --- dispatch and listing -----------------------------------------------------------------------


def test_open_spool_file_dispatches_by_extension(tmp_path: Path) -> None:
    d = topic_dir(tmp_path)
    (d / "a.txt").write_text("x\n")
    (d / "a.jsonl").write_text('{"value": "x"}\n')
    write(d, "a.ferry", encode_file(RECORDS[:1]))
    assert isinstance(open_spool_file(d / "a.txt"), TextLinesReader)
    assert isinstance(open_spool_file(d / "a.jsonl"), JsonLinesReader)
    assert isinstance(open_spool_file(d / "a.ferry"), BinarySpoolReader)
    with pytest.raises(SpoolFormatError, match="unsupported spool file type '.csv'"):
        open_spool_file(d / "a.csv")
    for temp in (".a.ferry.1234.tmp", ".a.txt", "a.ferry.tmp"):
        with pytest.raises(SpoolFormatError, match="a temporary file"):
            open_spool_file(d / temp)


def make_tree(root: Path) -> dict[str, Path]:
    """A spool directory with one of everything; mtimes make the ready order a.. z."""
    paths = {
        "ready": [
            "b-top.ferry", "orders/c.jsonl", "orders/d.txt", "orders/e.ferry", "clicks/f.txt",
        ],
        "temp": [
            ".b-top.ferry.1f2e.tmp", "half.ferry.tmp", "orders/.c.jsonl", "orders/x.txt.tmp",
        ],
        "agent": ["done/old.ferry", "quarantine/bad.ferry", "done/orders/old.txt"],
        "unrecognized": [
            "top.txt", "top.jsonl", "notes.md", "orders/data.csv", "not a topic/a.txt",
        ],
    }
    out: dict[str, Path] = {}
    for i, name in enumerate(p for group in paths.values() for p in group):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_file(RECORDS[:1]))
        os.utime(path, ns=(0, 1_000_000_000 * (i + 1)))
        out[name] = path
    (root / "orders" / "nested").mkdir()
    return out


def test_list_ready_files_lists_only_finished_files_oldest_first(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    ready = ["b-top.ferry", "orders/c.jsonl", "orders/d.txt", "orders/e.ferry", "clicks/f.txt"]
    assert list_ready_files(tmp_path) == [tree[name] for name in ready]
    # Oldest first, whatever the names: touch the first one last.
    os.utime(tree["b-top.ferry"], ns=(0, 10**12))
    assert list_ready_files(tmp_path)[-1] == tree["b-top.ferry"]


def test_list_unrecognized_files_reports_misplaced_files(tmp_path: Path) -> None:
    make_tree(tmp_path)
    assert list_unrecognized_files(tmp_path) == sorted(
        tmp_path / name
        for name in (
            "top.txt", "top.jsonl", "notes.md", "orders/data.csv", "not a topic", "orders/nested"
        )
    )


def test_list_stale_temp_files(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    now = time.time_ns()
    os.utime(tree["half.ferry.tmp"], ns=(now, now))
    stale = list_stale_temp_files(tmp_path, older_than_s=3600)
    assert stale == sorted(
        tree[name] for name in (".b-top.ferry.1f2e.tmp", "orders/.c.jsonl", "orders/x.txt.tmp")
    )
    assert tree["half.ferry.tmp"] in list_stale_temp_files(tmp_path, older_than_s=-1)


# --- raw blocks, for bulk consumers -----------------------------------------------------------


def test_iter_blocks_yields_checked_blocks_that_decode_to_the_records(tmp_path: Path) -> None:
    path, data = multi_block_file(tmp_path)
    reader = BinarySpoolReader(path)
    blocks = list(reader.iter_blocks())
    assert [(b.offset - BLOCK_HEADER.size, len(b.body), b.record_count) for b in blocks] == (
        block_offsets(data))
    assert [b.first for b in blocks] == [sum(b.record_count for b in blocks[:i])
                                         for i in range(len(blocks))]
    assert [r for b in blocks for r in reader.decode_block(b)] == RECORDS


def test_iter_blocks_from_an_index_starts_at_the_block_holding_it(tmp_path: Path) -> None:
    path, _ = multi_block_file(tmp_path)
    reader = BinarySpoolReader(path)
    blocks = list(reader.iter_blocks(start=9))
    assert blocks[0].first <= 9 < blocks[0].first + blocks[0].record_count
    assert [r for b in blocks for r in reader.decode_block(b, 9)] == RECORDS[9:]
    assert list(reader.iter_blocks(start=len(RECORDS))) == []


def test_iter_blocks_checks_the_whole_file_before_the_first_block(tmp_path: Path) -> None:
    _, data = multi_block_file(tmp_path)
    flipped = bytearray(data)
    flipped[-30] ^= 0x01  # in the last block
    path = write(tmp_path, "bad.ferry", bytes(flipped))
    yielded: list[SpoolBlock] = []
    with pytest.raises(SpoolFormatError, match="checksum mismatch"):
        yielded.extend(BinarySpoolReader(path).iter_blocks())
    assert yielded == []
    with pytest.raises(SpoolFormatError, match="checksum mismatch"):
        yielded.extend(BinarySpoolReader(path).iter_blocks(verify_first=False))
    assert 0 < len(yielded) < len(block_offsets(data))  # intact blocks before the damage


@pytest.mark.parametrize(
    ("body", "count", "message"), list(BUGGY_BODIES.values()), ids=list(BUGGY_BODIES)
)
def test_decode_block_names_the_malformed_record(
    tmp_path: Path, body: bytes, count: int, message: str
) -> None:
    path = write(tmp_path, "buggy.ferry", file_with_body(body, count))
    reader = BinarySpoolReader(path)
    (block,) = reader.iter_blocks()
    with pytest.raises(SpoolFormatError, match="buggy.ferry") as failure:
        reader.decode_block(block)
    assert message in str(failure.value)


def test_topic_of_accepts_only_legal_topic_names(tmp_path: Path) -> None:
    reader = BinarySpoolReader(tmp_path / "unused.ferry")
    assert reader.topic_of(b"orders.v2_x-y") == "orders.v2_x-y"
    assert reader.topic_of(b"orders.v2_x-y") == "orders.v2_x-y"  # cached
    for bad in (b"", b"a b", b"t\xff", b"x" * 250, b"caf\xc3\xa9"):
        assert reader.topic_of(bad) is None


def test_a_fingerprint_is_of_the_records_bytes_not_of_where_blocks_are_cut(
    tmp_path: Path,
) -> None:
    records = [SpoolRecord("t", b"v-%d" % i, key=b"k" if i % 2 else None) for i in range(500)]
    small, large = tmp_path / "small.ferry", tmp_path / "large.ferry"
    small.write_bytes(encode_file(records, block_bytes=300))
    large.write_bytes(encode_file(records, block_bytes=1 << 20))
    a = BinarySpoolReader(small).fingerprint()
    b = BinarySpoolReader(large).fingerprint()
    assert (a.records, a.size, a.digest) == (b.records, b.size, b.digest) == (
        500, a.marks[-1].size, a.marks[-1].digest)
    assert len(a.marks) > 10 and len(b.marks) == 1
    # The digest at any record boundary of one file is the other's mark there.
    for mark in a.marks:
        assert BinarySpoolReader(large).fingerprint(mark.size).probe == mark.digest
    assert BinarySpoolReader(large).fingerprint(b.size + 1).probe is None
    # One byte of one value differs: another digest.
    changed = list(records)
    changed[250] = SpoolRecord("t", b"v-25X", key=b"k" if 250 % 2 else None)
    other = tmp_path / "other.ferry"
    other.write_bytes(encode_file(changed, block_bytes=300))
    assert BinarySpoolReader(other).fingerprint().digest != a.digest


def test_a_fingerprint_verifies_the_file_as_it_hashes_it(tmp_path: Path) -> None:
    path = tmp_path / "cut.ferry"
    path.write_bytes(encode_file([SpoolRecord("t", b"x" * 100)] * 50)[:-30])
    with pytest.raises(SpoolFormatError, match="truncated|without a trailer"):
        BinarySpoolReader(path).fingerprint()
