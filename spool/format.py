"""The binary spool file format, version 1: constants, the record type, encode and decode.

All integers are little-endian. A file is a header, blocks of records, and a trailer::

    file header (12 bytes)
        8s  magic b"FERRYSPL"
        u16 format version (1)
        u16 flags (0; readers reject unknown bits)
    block (12-byte header, then the records back to back)
        u32 body length in bytes (>= 1; 0 would be the trailer)
        u32 record count (>= 1)
        u32 CRC-32 (zlib.crc32) of the body
    record (28-byte fixed part, then the variable fields)
        u32 record length: every byte of the record, this field included (>= 28)
        u8  flags: 1 = has key, 2 = has partition key (other bits must be 0)
        u8  topic length (1..249)
        u16 header count
        i32 partition key (0 when absent)
        i64 timestamp, ms since the epoch
        u32 key length (0 when absent)
        u32 value length
        topic (ASCII), key, value
        per header: u16 name length, u32 value length, name (UTF-8), value
    trailer (24 bytes)
        u32 0 (where the next block's body length would be)
        8s  magic b"FERRYEND"
        u64 record count of the whole file
        u32 CRC-32 of the file header and every block header, in order

The trailer ends the file. Why blocks: ``verify`` checks a file (every body CRC, the trailer's
count and CRC) at the speed of zlib.crc32 without touching single records, and a reader
reads one block at a time (bounded memory), checks its CRC before yielding any of its records,
and decodes it with one ``struct.unpack_from`` per record and no record split across reads.
Writers close a block once it reaches BLOCK_TARGET_BYTES, so a block is at most that plus one
record. ``docs/spool.md`` is the prose version of this layout.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from ferry_client import topic_names
from ferry_client.topic_names import illegal_topic, is_legal_topic

MAGIC = b"FERRYSPL"
TRAILER_MAGIC = b"FERRYEND"
VERSION = 1
EXTENSION = ".ferry"
JSONL_EXTENSION = ".jsonl"
TEXT_EXTENSION = ".txt"
# Writers write under ".<name>.<random>.tmp" and rename; readers never list such names.
TEMP_SUFFIX = ".tmp"

FILE_HEADER = struct.Struct("<8sHH")
BLOCK_HEADER = struct.Struct("<III")
RECORD_HEADER = struct.Struct("<IBBHiqII")
HEADER_FIELD = struct.Struct("<HI")
TRAILER = struct.Struct("<I8sQI")

FLAG_KEY = 1
FLAG_PARTITION_KEY = 2
KNOWN_FLAGS = FLAG_KEY | FLAG_PARTITION_KEY

MAX_TOPIC_LENGTH = topic_names.MAX_LENGTH
# Sanity bounds, not Kafka limits: they keep a corrupt length field from making a reader
# allocate gigabytes, and bound a reader's memory to one block.
MAX_RECORD_BYTES = 256 * 1024 * 1024
BLOCK_TARGET_BYTES = 1024 * 1024
MAX_BLOCK_BYTES = MAX_RECORD_BYTES + BLOCK_TARGET_BYTES
PARTITION_KEY_MIN = -(2**31)
PARTITION_KEY_MAX = 2**31 - 1
TIMESTAMP_MIN = -(2**63)
TIMESTAMP_MAX = 2**63 - 1

Headers = tuple[tuple[str, bytes], ...]



class SpoolRecord(NamedTuple):
    """One message in a spool file.

    ``partition_key`` is Bruce's signed 32-bit partition key (it picks the partition), not the
    Kafka record ``key``. A NamedTuple because the reader builds hundreds of thousands per
    second and a tuple is the cheapest object Python builds.
    """

    topic: str
    value: bytes
    key: bytes | None = None
    partition_key: int | None = None
    timestamp_ms: int = 0
    headers: Headers = ()


class SpoolFormatError(ValueError):
    """A spool file breaks the format; the message names the file and where."""


def check_topic(topic: object) -> str:
    """``topic`` if it is a legal Kafka topic name, else ValueError saying why not."""
    if not isinstance(topic, str):
        raise ValueError(f"topic must be a string, not {type(topic).__name__}")
    if not is_legal_topic(topic):
        raise ValueError(illegal_topic(topic))
    return topic


def encode_file_header() -> bytes:
    return FILE_HEADER.pack(MAGIC, VERSION, 0)


def check_file_header(data: bytes, where: str) -> None:
    """SpoolFormatError unless ``data`` is a version 1 file header."""
    if len(data) < FILE_HEADER.size:
        raise SpoolFormatError(
            f"{where}: {len(data)} bytes is too short for a spool file header "
            f"({FILE_HEADER.size} bytes)"
        )
    magic, version, flags = FILE_HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise SpoolFormatError(f"{where}: not a Ferry spool file (magic {magic!r}, want {MAGIC!r})")
    if version != VERSION:
        raise SpoolFormatError(
            f"{where}: spool format version {version} is not supported (this reader reads "
            f"version {VERSION})"
        )
    if flags != 0:
        raise SpoolFormatError(f"{where}: unknown file header flags {flags:#06x}")


def encode_block_header(body: bytes, count: int) -> bytes:
    return BLOCK_HEADER.pack(len(body), count, zlib.crc32(body))


def encode_trailer(count: int, crc: int) -> bytes:
    return TRAILER.pack(0, TRAILER_MAGIC, count, crc)


def _check_partition_key(pk: int) -> int:
    if not PARTITION_KEY_MIN <= pk <= PARTITION_KEY_MAX:
        raise ValueError(f"partition_key {pk} is outside the signed 32-bit range")
    return pk


def encode_headers(headers: Headers) -> bytes:
    if len(headers) > 0xFFFF:
        raise ValueError(f"{len(headers)} headers is more than 65535")
    parts: list[bytes] = []
    for name, value in headers:
        if not isinstance(name, str):
            raise ValueError(f"header name must be a string, not {type(name).__name__}")
        if not isinstance(value, bytes):
            raise ValueError(f"header {name!r}: value must be bytes, not {type(value).__name__}")
        nb = name.encode("utf-8")
        if len(nb) > 0xFFFF:
            raise ValueError(f"header name of {len(nb)} bytes is longer than 65535")
        parts += (HEADER_FIELD.pack(len(nb), len(value)), nb, value)
    return b"".join(parts)


def encode_record(record: SpoolRecord) -> bytes:
    """One record's bytes; ValueError (with the reason) for a record the format cannot hold."""
    topic = check_topic(record.topic).encode("ascii")
    value = record.value
    if not isinstance(value, bytes):
        raise ValueError(f"value must be bytes, not {type(value).__name__}")
    key = record.key
    flags = 0
    if key is not None:
        if not isinstance(key, bytes):
            raise ValueError(f"key must be bytes or None, not {type(key).__name__}")
        flags |= FLAG_KEY
    else:
        key = b""
    pk = record.partition_key
    if pk is not None:
        if not isinstance(pk, int) or isinstance(pk, bool):
            raise ValueError(f"partition_key must be an int or None, not {type(pk).__name__}")
        flags |= FLAG_PARTITION_KEY
        _check_partition_key(pk)
    else:
        pk = 0
    ts = record.timestamp_ms
    if not isinstance(ts, int) or not TIMESTAMP_MIN <= ts <= TIMESTAMP_MAX:
        raise ValueError(f"timestamp_ms {ts!r} is not a signed 64-bit integer")
    headers = record.headers
    head_bytes = encode_headers(headers) if headers else b""
    length = RECORD_HEADER.size + len(topic) + len(key) + len(value) + len(head_bytes)
    if length > MAX_RECORD_BYTES:
        raise ValueError(f"record of {length} bytes is larger than {MAX_RECORD_BYTES}")
    return b"".join((
        RECORD_HEADER.pack(length, flags, len(topic), len(headers), pk, ts, len(key), len(value)),
        topic,
        key,
        value,
        head_bytes,
    ))


def encode_columns(
    topics: str | Sequence[str | None],
    values: Sequence[bytes | None],
    keys: Sequence[bytes | None] | None = None,
    partition_keys: Sequence[int | None] | None = None,
    timestamps: int | Sequence[int | None] = 0,
    headers: Sequence[Headers | None] | None = None,
    *,
    block_bytes: int = BLOCK_TARGET_BYTES,
) -> Iterator[tuple[bytes, int]]:
    """Records given column by column (as a Spark task holds them), as block bodies.

    Yields ``(body, count)`` for ``SpoolWriter.write_block``; a body is closed once it
    reaches ``block_bytes``. ``topics`` and ``timestamps`` may be one value for every row.
    The fast path of the Spark writer: one ``pack`` and a few appends per row. ValueError
    names the 0-based row for anything the format cannot hold (a null value, an illegal
    topic, a partition key out of range) or a value that is not bytes.
    """
    n = len(values)
    topic_cache: dict[str, bytes] = {}
    fixed_topic = check_topic(topics).encode("ascii") if isinstance(topics, str) else None
    fixed_ts = timestamps if isinstance(timestamps, int) else None
    parts: list[bytes] = []
    append = parts.append
    pack = RECORD_HEADER.pack
    fixed = RECORD_HEADER.size
    size = 0
    first = 0
    row = 0
    try:
        for row in range(n):
            if fixed_topic is not None:
                tb = fixed_topic
            else:
                topic = topics[row]
                cached = topic_cache.get(topic)  # type: ignore[arg-type]
                if cached is None:
                    if topic is None:
                        raise ValueError("topic is null")
                    cached = check_topic(topic).encode("ascii")
                    topic_cache[topic] = cached
                tb = cached
            value = values[row]
            if value is None:
                raise ValueError("value is null")
            if type(value) is not bytes:
                raise ValueError(f"value must be bytes, not {type(value).__name__}")
            flags = 0
            klen = 0
            key = keys[row] if keys is not None else None
            if key is not None:
                if type(key) is not bytes:
                    raise ValueError(f"key must be bytes, not {type(key).__name__}")
                flags = FLAG_KEY
                klen = len(key)
            pk = partition_keys[row] if partition_keys is not None else None
            if pk is not None:
                flags |= FLAG_PARTITION_KEY
                _check_partition_key(pk)
            else:
                pk = 0
            if fixed_ts is not None:
                ts = fixed_ts
            else:
                row_ts = timestamps[row]  # type: ignore[index]
                if row_ts is None:
                    raise ValueError("timestamp is null")
                ts = row_ts
            hdrs = headers[row] if headers is not None else None
            if hdrs:
                hb = encode_headers(hdrs)
                hcount = len(hdrs)
            else:
                hb = b""
                hcount = 0
            length = fixed + len(tb) + klen + len(value) + len(hb)
            if length > MAX_RECORD_BYTES:
                raise ValueError(f"record of {length} bytes is larger than {MAX_RECORD_BYTES}")
            append(pack(length, flags, len(tb), hcount, pk, ts, klen, len(value)))
            append(tb)
            if klen:
                append(key)  # type: ignore[arg-type]
            append(value)
            if hcount:
                append(hb)
            size += length
            if size >= block_bytes:
                yield b"".join(parts), row + 1 - first
                parts.clear()
                size = 0
                first = row + 1
    except (ValueError, struct.error) as exc:
        raise ValueError(f"row {row}: {exc}") from exc
    if parts:
        yield b"".join(parts), n - first


def decode_headers(data: bytes, pos: int, count: int, end: int) -> tuple[Headers, int]:
    """``count`` headers starting at ``pos`` (not past ``end``), and the offset after them."""
    out: list[tuple[str, bytes]] = []
    unpack = HEADER_FIELD.unpack_from
    size = HEADER_FIELD.size
    for i in range(count):
        if pos + size > end:
            raise SpoolFormatError(f"header {i} runs past the end of its record")
        nlen, vlen = unpack(data, pos)
        pos += size
        if pos + nlen + vlen > end:
            raise SpoolFormatError(f"header {i} runs past the end of its record")
        try:
            name = data[pos : pos + nlen].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpoolFormatError(f"header {i}: name is not UTF-8 ({exc})") from None
        pos += nlen
        out.append((name, data[pos : pos + vlen]))
        pos += vlen
    return tuple(out), pos


def check_record_shape(
    length: int, flags: int, tlen: int, hcount: int, pk: int, klen: int, vlen: int
) -> None:
    """The checks on a record that need nothing but its fixed part; SpoolFormatError."""
    if length < RECORD_HEADER.size:
        raise SpoolFormatError(f"record length {length} is shorter than a record header")
    if length > MAX_RECORD_BYTES:
        raise SpoolFormatError(f"record length {length} is larger than {MAX_RECORD_BYTES}")
    if flags & ~KNOWN_FLAGS:
        raise SpoolFormatError(f"unknown record flags {flags:#04x}")
    if tlen == 0 or tlen > MAX_TOPIC_LENGTH:
        raise SpoolFormatError(f"topic length {tlen} is outside 1..{MAX_TOPIC_LENGTH}")
    if not flags & FLAG_KEY and klen:
        raise SpoolFormatError("key length is not 0 for a record without a key")
    if not flags & FLAG_PARTITION_KEY and pk:
        raise SpoolFormatError("partition key is not 0 for a record without one")
    fields = RECORD_HEADER.size + tlen + klen + vlen
    if fields > length or (hcount == 0 and fields != length):
        raise SpoolFormatError(f"record length {length} does not match its fields ({fields})")


def decode_topic(raw: bytes) -> str:
    """A topic name as stored; SpoolFormatError if it is not a legal one."""
    try:
        topic = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SpoolFormatError(f"topic {raw!r} is not a legal Kafka topic name") from None
    if not is_legal_topic(topic):
        raise SpoolFormatError(f"topic {topic!r} is not a legal Kafka topic name")
    return topic


def decode_record(data: bytes, pos: int = 0) -> tuple[SpoolRecord, int]:
    """The record at ``data[pos:]`` and the offset just after it.

    The reader inlines this logic for speed; this function is for tools and tests.
    """
    if pos + RECORD_HEADER.size > len(data):
        raise SpoolFormatError("record header runs past the end of the data")
    length, flags, tlen, hcount, pk, ts, klen, vlen = RECORD_HEADER.unpack_from(data, pos)
    check_record_shape(length, flags, tlen, hcount, pk, klen, vlen)
    end = pos + length
    if end > len(data):
        raise SpoolFormatError(f"record of {length} bytes runs past the end of the data")
    p = pos + RECORD_HEADER.size
    topic = decode_topic(data[p : p + tlen])
    p += tlen
    key = data[p : p + klen] if flags & FLAG_KEY else None
    p += klen
    value = data[p : p + vlen]
    p += vlen
    headers: Headers = ()
    if hcount:
        headers, p = decode_headers(data, p, hcount, end)
    if p != end:
        raise SpoolFormatError(f"record length {length} does not match its fields")
    pk_or_none = pk if flags & FLAG_PARTITION_KEY else None
    return SpoolRecord(topic, value, key, pk_or_none, ts, headers), end


def encode_file(records: Iterable[SpoolRecord], *, block_bytes: int = BLOCK_TARGET_BYTES) -> bytes:
    """A whole spool file in memory (tests and small tools; SpoolWriter streams)."""
    header = encode_file_header()
    out = [header]
    crc = zlib.crc32(header)
    total = 0
    body: list[bytes] = []
    size = 0

    def close_block() -> None:
        nonlocal crc, total, size
        data = b"".join(body)
        block = encode_block_header(data, len(body))
        crc = zlib.crc32(block, crc)
        out.extend((block, data))
        total += len(body)
        body.clear()
        size = 0

    for record in records:
        encoded = encode_record(record)
        body.append(encoded)
        size += len(encoded)
        if size >= block_bytes:
            close_block()
    if body:
        close_block()
    out.append(encode_trailer(total, crc))
    return b"".join(out)
