"""Encoding of a buffered message's value: a fixed header, the key, headers, then the value.

Version 1 layout (big-endian)::

    u8  format version (1)
    u8  flags: 1 = has key, 2 = has partition key, 4 = partition by key hash
    u32 topic generation at acceptance (messages of an older generation are discarded)
    i64 client timestamp, ms since the epoch
    i32 partition key (0 when absent)
    u32 key length
    u16 header count
    key bytes
    per header: u16 name length, name (UTF-8), u32 value length, value
    value bytes (the rest)
"""

from __future__ import annotations

import struct

from agent.records import Headers, Record

HEADER = struct.Struct(">BBIqiIH")
VERSION = 1
HAS_KEY = 1
HAS_PARTITION_KEY = 2
HASH_KEY = 4
_NAME = struct.Struct(">H")
_VLEN = struct.Struct(">I")


class CorruptRecord(Exception):
    """A stored value does not decode; the forwarder discards it as ``corrupt``."""


def encode(record: Record, generation: int) -> bytes:
    flags = 0
    key = record.key
    if key is not None:
        flags |= HAS_KEY
    else:
        key = b""
    pk = record.partition_key
    if pk is not None:
        flags |= HAS_PARTITION_KEY
    else:
        pk = 0
    if record.hash_key:
        flags |= HASH_KEY
    head = HEADER.pack(VERSION, flags, generation, record.timestamp_ms, pk, len(key),
                       len(record.headers))
    if not record.headers:
        return head + key + record.value
    parts = [head, key]
    for name, value in record.headers:
        nb = name.encode("utf-8")
        parts += (_NAME.pack(len(nb)), nb, _VLEN.pack(len(value)), value)
    parts.append(record.value)
    return b"".join(parts)


def decode(topic: str, data: bytes) -> tuple[Record, int]:
    """The record and the topic generation it was accepted under."""
    try:
        version, flags, generation, ts, pk, klen, nheaders = HEADER.unpack_from(data, 0)
        if version != VERSION:
            raise CorruptRecord(f"unknown record format version {version}")
        pos = HEADER.size
        key = data[pos:pos + klen] if flags & HAS_KEY else None
        pos += klen
        headers: Headers = ()
        if nheaders:
            hs = []
            for _ in range(nheaders):
                (nlen,) = _NAME.unpack_from(data, pos)
                pos += 2
                name = data[pos:pos + nlen].decode("utf-8")
                pos += nlen
                (vlen,) = _VLEN.unpack_from(data, pos)
                pos += 4
                hs.append((name, data[pos:pos + vlen]))
                pos += vlen
            headers = tuple(hs)
        if pos > len(data):
            raise CorruptRecord("record is shorter than its header says")
        # Positional: this runs once per message on the forwarder's hot path.
        record = Record(topic, data[pos:], key, pk if flags & HAS_PARTITION_KEY else None, ts,
                        headers, bool(flags & HASH_KEY))
        return record, generation
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptRecord(str(exc)) from None
