"""Spool file contents the spool and buffer tests share: sample records, and the block bodies
a buggy writer could produce (each a valid file but for its records, with the reader's
complaint) with ``file_with_body`` to wrap one in an otherwise correct file."""

from __future__ import annotations

import struct
import zlib

from spool.format import BLOCK_HEADER, FILE_HEADER, RECORD_HEADER, SpoolRecord, encode_record

RECORDS = [
    SpoolRecord(
        topic="orders" if i % 3 else "clicks",
        value=f"value {i}".encode() * (i % 5 + 1),
        key=f"k{i}".encode() if i % 2 else None,
        partition_key=i - 10 if i % 4 == 0 else None,
        timestamp_ms=1_700_000_000_000 + i,
        headers=(("n", str(i).encode()),) if i % 6 == 0 else (),
    )
    for i in range(40)
]


def file_with_body(body: bytes, count: int) -> bytes:
    """A file whose single block holds ``body`` with a correct CRC: a buggy writer's output."""
    header = FILE_HEADER.pack(b"FERRYSPL", 1, 0)
    block = BLOCK_HEADER.pack(len(body), count, zlib.crc32(body))
    crc = zlib.crc32(header + block)
    return header + block + body + struct.pack("<I8sQI", 0, b"FERRYEND", count, crc)


R0 = encode_record(RECORDS[0])
LONG = encode_record(SpoolRecord("t", b"x" * 100))
BUGGY_BODIES = {
    "zero length": (R0 + b"\0" * 30, 2, f"record 1 at offset {24 + len(R0)}: record length 0 is"),
    "count too high": (LONG, 2, "says 2 records but holds 1"),
    "cut record": (LONG + LONG[:40], 2, f"record 1 at offset {24 + len(LONG)}: record of"),
    "cut header": (LONG + LONG[:20], 2, "record header runs past the end of its block"),
    "bad topic": (RECORD_HEADER.pack(31, 0, 1, 0, 0, 0, 0, 2) + b" vv", 1, "' ' is not a legal"),
    "flags": (RECORD_HEADER.pack(31, 8, 1, 0, 0, 0, 0, 2) + b"tvv", 1, "unknown record flags"),
    "stray pk": (RECORD_HEADER.pack(31, 0, 1, 0, 7, 0, 0, 2) + b"tvv", 1, "partition key is not"),
    "stray key": (RECORD_HEADER.pack(31, 0, 1, 0, 0, 0, 1, 1) + b"tkv", 1, "key length is not 0"),
    "header": (RECORD_HEADER.pack(31, 0, 1, 1, 0, 0, 0, 2) + b"tvv", 1, "header 0 runs past"),
    "header tail": (
        RECORD_HEADER.pack(38, 0, 1, 1, 0, 0, 0, 2) + b"tvv" + struct.pack("<HI", 0, 0) + b"x",
        1,
        "record length does not match its fields",
    ),
    "long": (RECORD_HEADER.pack(99, 0, 1, 1, 0, 0, 0, 2) + b"tvv", 1, "runs past the end of its"),
}
