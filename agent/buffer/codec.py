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
from collections.abc import Callable, Mapping, Sequence

from agent.records import Headers, Record
from spool.format import RECORD_HEADER as SPOOL_RECORD

HEADER = struct.Struct(">BBIqiIH")
VERSION = 1
HAS_KEY = 1
HAS_PARTITION_KEY = 2
HASH_KEY = 4
_NAME = struct.Struct(">H")
_VLEN = struct.Struct(">I")
_GENERATION = struct.Struct(">I")
_GENERATION_OFFSET = 2  # after version and flags


# What encoding a record that cannot be stored raises (a header name that is not UTF-8
# encodable, a number out of its field's range): the group is refused (``InvalidGroup``).
UNENCODABLE = (struct.error, UnicodeEncodeError, OverflowError)


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


def encode_value(
    generation: int, timestamp_ms: int, partition_key: int | None, key: bytes, value: bytes
) -> bytes:
    """What ``encode`` makes of a record without headers placed round-robin or by partition
    key (a Bruce datagram), from its fields: no Record needed. An empty ``key`` is no key."""
    flags = HAS_KEY if key else 0
    if partition_key is None:
        partition_key = 0
    else:
        flags |= HAS_PARTITION_KEY
    return HEADER.pack(VERSION, flags, generation, timestamp_ms, partition_key, len(key),
                       0) + key + value


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


# -- bulk: binary spool records straight into buffer values ---------------------------------
# Spool record flags (1 key, 2 partition key) -> buffer flags. A spool key without a partition
# key is placed by librdkafka's key hash, as for every other spool record.
_FROM_SPOOL_FLAGS = (0, HAS_KEY | HASH_KEY, HAS_PARTITION_KEY, HAS_KEY | HAS_PARTITION_KEY)
# The bounds of a topic without any (encode_spool_block): no record is outside them.
_UNBOUNDED = (2**63, -(2**63), 2**63)


def encode_spool_block(
    body: bytes,
    count: int,
    skip: int,
    generations: Mapping[str, int],
    now_ms: int,
    topic_of: Callable[[bytes], str | None],
    *,
    by_topic: bool = False,
    bounds: Mapping[str, tuple[int, int, int]] | None = None,
) -> list[tuple[str, list[bytes], int]] | None:
    """Buffer values for the records of one binary spool block body, without Record objects.

    ``body`` is a block body that passed its CRC check (spool.format describes the layout).
    Returns runs of consecutive records of one topic: ``(topic, values, generation)``, the
    values encoded under ``generation = generations.get(topic, 0)``, leaving out the block's
    first ``skip`` records (they are checked all the same). A record without a timestamp
    gets ``now_ms``. With ``by_topic`` there is one run per topic instead, each holding the
    topic's records in block order (for a caller that takes the whole block at once: order
    within a topic is what the buffer keeps).

    ``bounds`` gives topics ``(room, earliest, latest)``: the most bytes of key and value
    together, and the oldest and newest timestamp (a timestamp of 0 or less is always within)
    of a record the caller takes without a closer look (the intake's look at what a Kafka
    topic can never take, agent/ingest/kafka_limits.py). A record outside its topic's bounds
    makes the whole block declined (None), as a record with headers does: such records are
    rare, and this way the common block costs three integer comparisons a record, not a call.

    Returns None, having decided nothing, for any block it does not handle in bulk: a record
    with headers, a record that breaks the format, a topic ``topic_of`` does not accept, a
    count that does not match. The caller then decodes the block with the spool reader,
    which either raises the precise error or yields records for ``encode``. So this function
    never accepts what the reader would refuse.
    """
    unpack = SPOOL_RECORD.unpack_from
    pack = HEADER.pack
    fixed = SPOOL_RECORD.size
    flag_map = _FROM_SPOOL_FLAGS
    end = len(body)
    pos = 0
    index = 0
    runs: list[tuple[str, list[bytes], int]] = []
    # None, not b"": the first record's topic must always be looked up (and an empty one
    # refused), or its value would go to a list that is in no run and vanish.
    raw_topic: bytes | None = None
    values: list[bytes] = []
    append = values.append
    generation = 0
    room, earliest, latest = _UNBOUNDED
    # by_topic: raw topic -> (its run's list.append, generation, and the topic's bounds)
    seen: dict[bytes, tuple[Callable[[bytes], None], int, int, int, int]] = {}
    try:
        while pos < end:
            length, flags, tlen, hcount, pk, ts, klen, vlen = unpack(body, pos)
            nxt = pos + length
            q = pos + fixed + tlen
            if (
                hcount
                or flags > 3
                or q + klen + vlen != nxt
                or nxt > end
                or (klen and not flags & 1)
                or (pk and not flags & 2)
            ):
                return None
            raw = body[pos + fixed : q]
            if raw != raw_topic:
                raw_topic = raw
                known = seen.get(raw)
                if known is not None:
                    append, generation, room, earliest, latest = known
                else:
                    topic = topic_of(raw)
                    if topic is None:
                        return None
                    values = []
                    append = values.append
                    generation = generations.get(topic, 0)
                    runs.append((topic, values, generation))
                    room, earliest, latest = (bounds.get(topic, _UNBOUNDED) if bounds
                                              else _UNBOUNDED)
                    if by_topic:
                        seen[raw] = (append, generation, room, earliest, latest)
            if klen + vlen > room or ts > latest or earliest > ts > 0:
                return None
            if index >= skip:
                # Key and value lie back to back in both layouts: one slice carries both.
                append(pack(VERSION, flag_map[flags], generation, ts or now_ms, pk, klen, 0)
                       + body[q:nxt])
            index += 1
            pos = nxt
    except struct.error:
        return None
    if index != count:
        return None
    return [run for run in runs if run[1]]


def with_generation(values: Sequence[bytes], generation: int) -> list[bytes]:
    """``values`` re-encoded under another topic generation (the rest unchanged)."""
    gen = _GENERATION.pack(generation)
    start = _GENERATION_OFFSET
    stop = start + _GENERATION.size
    return [v[:start] + gen + v[stop:] for v in values]
