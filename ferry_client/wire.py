"""Bruce's UNIX-datagram wire format, the encoding side: one message, one datagram.

All integers are big-endian (the Kafka protocol's notation, which Bruce's document uses)::

    GenericMessage      => Size:int32 ApiKey:int16 ApiVersion:int16 Message
    AnyPartition (256)  => Flags:int16 TopicSize:int16 Topic Timestamp:int64
                           KeySize:int32 Key ValueSize:int32 Value
    PartitionKey (257)  => Flags:int16 PartitionKey:int32 TopicSize:int16 Topic Timestamp:int64
                           KeySize:int32 Key ValueSize:int32 Value

``Size`` counts the whole datagram including itself; ``ApiVersion`` is 0 for both types;
``Flags`` is 0; ``TopicSize`` is > 0; ``Timestamp`` is milliseconds since the epoch; an empty
key (``KeySize`` 0) means "no key".

Standard library only: applications import this without the agent (the agent's decoder,
``agent/ingest/datagram.py``, takes its constants from here). A datagram gets no reply, so
everything Ferry would reject for its form is refused here with :class:`ValueError` instead.
"""

from __future__ import annotations

import time
from struct import Struct

from ferry_client.topic_names import illegal_topic, is_legal_topic

__all__ = [
    "ANY_PARTITION",
    "API_VERSION",
    "PARTITION_KEY",
    "encode_any_partition",
    "encode_partition_key",
    "is_legal_topic",
]

ANY_PARTITION = 256
PARTITION_KEY = 257
API_VERSION = 0

_ANY_HEAD = Struct(">ihhhh")  # Size ApiKey ApiVersion Flags TopicSize
_KEY_HEAD = Struct(">ihhhih")  # Size ApiKey ApiVersion Flags PartitionKey TopicSize
_TS_KEYSIZE = Struct(">qi")  # Timestamp KeySize
_VALUESIZE = Struct(">i")  # ValueSize
# Bytes after the topic when key and value are empty: Timestamp KeySize ValueSize.
_TAIL = _TS_KEYSIZE.size + _VALUESIZE.size

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

def encode_any_partition(
    topic: str,
    value: bytes,
    key: bytes | None = None,
    timestamp_ms: int | None = None,
) -> bytes:
    """One AnyPartition (ApiKey 256, version 0) datagram; Ferry spreads these round-robin.

    ``timestamp_ms`` defaults to now. Raises :class:`ValueError` for an illegal topic name or
    a field that does not fit the format.
    """
    raw_topic = _topic(topic)
    value, key = _bytes("value", value), _bytes("key", key or b"")
    timestamp_ms = _timestamp(timestamp_ms)
    size = _ANY_HEAD.size + len(raw_topic) + _TAIL + len(key) + len(value)
    _check_size(size)
    return b"".join((
        _ANY_HEAD.pack(size, ANY_PARTITION, API_VERSION, 0, len(raw_topic)),
        raw_topic,
        _TS_KEYSIZE.pack(timestamp_ms, len(key)),
        key,
        _VALUESIZE.pack(len(value)),
        value,
    ))


def encode_partition_key(
    topic: str,
    partition_key: int,
    value: bytes,
    key: bytes | None = None,
    timestamp_ms: int | None = None,
) -> bytes:
    """One PartitionKey (ApiKey 257, version 0) datagram.

    ``partition_key`` is a signed 32-bit integer that picks the partition (key mod the topic's
    partition count); it is unrelated to the Kafka record ``key``. Raises :class:`ValueError`
    as :func:`encode_any_partition` does, and for a partition key outside int32.
    """
    raw_topic = _topic(topic)
    # bool is an int, but True as a partition key is a caller's mistake, not a choice.
    if (not isinstance(partition_key, int) or isinstance(partition_key, bool)
            or not _INT32_MIN <= partition_key <= _INT32_MAX):
        raise ValueError(f"partition_key {partition_key!r} is not a signed 32-bit integer "
                         f"({_INT32_MIN} to {_INT32_MAX})")
    value, key = _bytes("value", value), _bytes("key", key or b"")
    timestamp_ms = _timestamp(timestamp_ms)
    size = _KEY_HEAD.size + len(raw_topic) + _TAIL + len(key) + len(value)
    _check_size(size)
    return b"".join((
        _KEY_HEAD.pack(size, PARTITION_KEY, API_VERSION, 0, partition_key, len(raw_topic)),
        raw_topic,
        _TS_KEYSIZE.pack(timestamp_ms, len(key)),
        key,
        _VALUESIZE.pack(len(value)),
        value,
    ))


def _topic(topic: str) -> bytes:
    if not is_legal_topic(topic):
        raise ValueError(illegal_topic(topic, shown=64))
    return topic.encode("ascii")  # legal names are ASCII, at most 249 bytes: fits int16


def _bytes(name: str, data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise ValueError(f"{name} must be bytes, not {type(data).__name__} "
                     "(encode text first, e.g. value.encode())")


def _timestamp(timestamp_ms: int | None) -> int:
    if timestamp_ms is None:
        return time.time_ns() // 1_000_000
    if (not isinstance(timestamp_ms, int) or isinstance(timestamp_ms, bool)
            or not _INT64_MIN <= timestamp_ms <= _INT64_MAX):
        raise ValueError(f"timestamp_ms {timestamp_ms!r} is not a signed 64-bit integer "
                         "(milliseconds since the epoch)")
    return timestamp_ms


def _check_size(size: int) -> None:
    if size > _INT32_MAX:
        raise ValueError(f"message of {size} bytes does not fit the int32 Size field")
