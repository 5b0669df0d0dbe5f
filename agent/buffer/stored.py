"""A buffered message as a read returns it: decoded (``StoredMessage``) or not decodable
(``Corrupt``), with the handle the forwarder passes back to remove it."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from agent.buffer import codec, keys
from agent.records import Record


# Not frozen (one is made per message read on the forwarder's hot path, and a frozen
# dataclass's __init__ costs several times as much); treat instances as immutable all the same.
@dataclass(slots=True, eq=False)
class StoredMessage:
    key: bytes  # the message's handle: topic NUL id (records are stored by id)
    id: bytes
    record: Record
    generation: int
    stored_bytes: int

    @property
    def topic(self) -> str:
        return self.record.topic

    @property
    def accepted_ms(self) -> int:
        return keys.id_timestamp_ms(self.id)


@dataclass(frozen=True, slots=True)
class Corrupt:
    """A stored value that does not decode; reported so the forwarder can discard it."""

    key: bytes
    id: bytes
    topic: str
    raw: bytes
    error: str


def stored_size(m: StoredMessage | Corrupt) -> int:
    """The bytes a message counts for in its topic's count (handle and value)."""
    if isinstance(m, Corrupt):
        return len(m.key) + len(m.raw)
    return m.stored_bytes


def messages(topic: str,
             items: Sequence[tuple[bytes, bytes]]) -> list[StoredMessage | Corrupt]:
    """``(id, value)`` pairs of ``Store.read_values`` decoded, as ``Store.read`` returns them."""
    prefix = keys.topic_prefix(topic)
    # codec.decode's common case (no headers) inlined: this runs once per message on the
    # exactly-once and fallback paths. Anything else, a corrupt value included, goes through decode.
    unpack = codec.HEADER.unpack_from
    hsize = codec.HEADER.size
    version_now = codec.VERSION
    out: list[StoredMessage | Corrupt] = []
    append = out.append
    for mid, v in items:
        k = prefix + mid
        try:
            version, flags, gen, ts, pk, klen, nheaders = unpack(v)
        except struct.error:  # shorter than a header: decode says why
            version = klen = nheaders = -1
        pos = hsize + klen
        if version == version_now and not nheaders and pos <= len(v):
            record = Record(topic, v[pos:], v[hsize:pos] if flags & codec.HAS_KEY else None,
                            pk if flags & codec.HAS_PARTITION_KEY else None, ts, (),
                            bool(flags & codec.HASH_KEY))
        else:
            try:
                record, gen = codec.decode(topic, v)
            except codec.CorruptRecord as exc:
                append(Corrupt(k, mid, topic, v, str(exc)))
                continue
        append(StoredMessage(k, mid, record, gen, len(k) + len(v)))
    return out


def message(topic: str, message_id: bytes, value: bytes) -> StoredMessage | Corrupt:
    """One ``(id, value)`` pair of ``Store.read_values`` as ``read`` returns it."""
    k = keys.topic_prefix(topic) + message_id
    try:
        record, gen = codec.decode(topic, value)
    except codec.CorruptRecord as exc:
        return Corrupt(k, message_id, topic, value, str(exc))
    return StoredMessage(k, message_id, record, gen, len(k) + len(value))
