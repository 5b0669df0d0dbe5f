"""Bruce's UNIX-datagram wire format, the decoding side: parse one datagram (into a Record or
straight into a buffer value). The encoder is the client's (``ferry_client/wire.py``), whose
constants this module shares; tests/ferry_client/test_wire.py checks each against the other.

Every datagram is one message, all integers big-endian (Kafka protocol notation)::

    GenericMessage      => Size:int32 ApiKey:int16 ApiVersion:int16 Message
    AnyPartition (256)  => Flags:int16 TopicSize:int16 Topic Timestamp:int64
                           KeySize:int32 Key ValueSize:int32 Value
    PartitionKey (257)  => Flags:int16 PartitionKey:int32 TopicSize:int16 Topic Timestamp:int64
                           KeySize:int32 Key ValueSize:int32 Value

``Size`` counts the whole datagram including itself; ``ApiVersion`` is 0 for both types;
``Flags`` must be 0; ``TopicSize`` must be > 0; ``Timestamp`` is milliseconds since the epoch.
An empty key (``KeySize`` 0) is "no key".

This module is pure (no I/O) and sits on the socket hot path, so :func:`parse` uses
precompiled :class:`struct.Struct` objects and checks every length against the datagram
before it slices anything. It raises nothing but :class:`Reject`, whatever the bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from struct import Struct

from agent.buffer.codec import encode_value

# The words of agent/reasons.py a datagram is rejected for, re-exported (the socket server
# and the tests name them through this module); bound as module globals, not read as
# reasons.X, as parse() raises them on the hot path.
from agent.reasons import (
    INVALID_TOPIC,
    MALFORMED,
    TOO_LARGE,
    UNSUPPORTED_API_KEY,
    UNSUPPORTED_VERSION,
)
from agent.records import Record
from ferry_client.topic_names import illegal_topic, is_legal_topic
from ferry_client.wire import ANY_PARTITION, API_VERSION, PARTITION_KEY

__all__ = [
    "ANY_PARTITION",
    "INVALID_TOPIC",
    "MALFORMED",
    "PARTITION_KEY",
    "TOO_LARGE",
    "UNSUPPORTED_API_KEY",
    "UNSUPPORTED_VERSION",
    "Reject",
    "parse",
    "parse_encoded",
]


_GENERIC = Struct(">ihh")  # Size ApiKey ApiVersion
# The generic header with the fixed fields before Topic.
_ANY_HEAD = Struct(">ihhhh")  # Size ApiKey ApiVersion Flags TopicSize
_KEY_HEAD = Struct(">ihhhih")  # Size ApiKey ApiVersion Flags PartitionKey TopicSize
_TS_KEYSIZE = Struct(">qi")  # Timestamp KeySize
_VALUESIZE = Struct(">i")  # ValueSize
_PK_TOPICSIZE = Struct(">ih")  # PartitionKey TopicSize, at offset 10 of a PartitionKey message
_PK_OFFSET = _GENERIC.size + 2  # after the generic header and Flags

_GENERIC_SIZE = _GENERIC.size  # 8
_ANY_HEAD_SIZE = _ANY_HEAD.size  # 12
_KEY_HEAD_SIZE = _KEY_HEAD.size  # 16
_TS_KEYSIZE_SIZE = _TS_KEYSIZE.size  # 12
_VALUESIZE_SIZE = _VALUESIZE.size  # 4
# Bytes after the topic when key and value are empty: Timestamp KeySize ValueSize.
_TAIL_MIN = _TS_KEYSIZE_SIZE + _VALUESIZE_SIZE

# Validated topic names by their raw bytes. Clients send a handful of topics millions of times;
# the cache skips the ASCII decode and the regex and hands every Record the same interned str.
# Only legal names get in, and it is emptied when full, so hostile input cannot grow it.
_TOPIC_CACHE: dict[bytes, str] = {}
_TOPIC_CACHE_MAX = 4096


class Reject(Exception):
    """A datagram Ferry will not accept.

    ``reason`` is one of the words of agent/reasons.py re-exported here (:data:`MALFORMED`,
    :data:`UNSUPPORTED_API_KEY`, :data:`UNSUPPORTED_VERSION`, :data:`INVALID_TOPIC`,
    :data:`TOO_LARGE`), fit for a metric label;
    ``detail`` says what exactly was wrong, for the log.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def parse(data: bytes | memoryview, max_message_bytes: Callable[[str], int] | int) -> Record:
    """Decode one datagram into a :class:`Record`, or raise :class:`Reject`.

    ``max_message_bytes`` is the limit on key + value, either one number or a function of the
    topic name. ``data`` may be any bytes-like object, e.g. a memoryview over a ``recv_into``
    buffer; key and value always come out as fresh ``bytes``.
    """
    if type(data) is not bytes:
        data = bytes(data)
    topic, partition_key, timestamp_ms, key_start, key_end, value_start = _fields(
        data, max_message_bytes)
    return Record(
        topic,
        data[value_start:],
        data[key_start:key_end] if key_end > key_start else None,
        partition_key,
        timestamp_ms,
    )


def parse_encoded(
    data: bytes | memoryview,
    max_message_bytes: Callable[[str], int] | int,
    generations: Mapping[str, int],
) -> tuple[str, bytes]:
    """Decode one datagram straight into its topic and buffer value, or raise :class:`Reject`.

    The socket's hot path: the same checks as :func:`parse`, but the value comes out already
    encoded as the buffer stores it (agent.buffer.codec, under the topic's generation from
    ``generations``, 0 when absent), with no :class:`Record` in between.
    """
    if type(data) is not bytes:
        # One copy up front: slicing bytes is then a single step, where bytes(view[a:b]) would
        # cost a call per field, and odd views (non-byte formats, strides) become plain bytes.
        data = bytes(data)
    topic, partition_key, timestamp_ms, key_start, key_end, value_start = _fields(
        data, max_message_bytes)
    return topic, encode_value(generations.get(topic, 0), timestamp_ms, partition_key,
                               data[key_start:key_end], data[value_start:])


def _fields(
    data: bytes, max_message_bytes: Callable[[str], int] | int
) -> tuple[str, int | None, int, int, int, int]:
    """Check one datagram; its topic, partition key, timestamp and where key and value lie.

    Returns ``(topic, partition_key, timestamp_ms, key_start, key_end, value_start)``; the
    value runs to the end of ``data``. Raises :class:`Reject`, and nothing else, whatever the
    bytes.
    """
    n = len(data)
    if n < _ANY_HEAD_SIZE:
        raise _reject_short(data)
    # AnyPartition's fixed fields in the same unpack as the generic header; for PartitionKey
    # the last two fields are really PartitionKey's first half and are read again below.
    size, api_key, version, flags, topic_size = _ANY_HEAD.unpack_from(data)
    if size != n:
        raise Reject(MALFORMED, f"Size field says {size} bytes but the datagram has {n}")
    if api_key == ANY_PARTITION:
        if version != API_VERSION:
            raise Reject(UNSUPPORTED_VERSION, f"AnyPartition version {version} (only 0 exists)")
        partition_key: int | None = None
        pos = _ANY_HEAD_SIZE
    elif api_key == PARTITION_KEY:
        if version != API_VERSION:
            raise Reject(UNSUPPORTED_VERSION, f"PartitionKey version {version} (only 0 exists)")
        if n < _KEY_HEAD_SIZE:
            raise Reject(MALFORMED, f"PartitionKey datagram of {n} bytes is truncated")
        partition_key, topic_size = _PK_TOPICSIZE.unpack_from(data, _PK_OFFSET)
        pos = _KEY_HEAD_SIZE
    else:
        raise _reject_api_key(api_key)
    if flags:
        raise Reject(MALFORMED, f"Flags is {flags}, must be 0")
    if topic_size <= 0:
        raise Reject(MALFORMED, f"TopicSize is {topic_size}, must be > 0")
    topic_end = pos + topic_size
    if topic_end + _TAIL_MIN > n:
        raise Reject(MALFORMED, f"TopicSize {topic_size} runs past the end of the datagram")
    timestamp_ms, key_size = _TS_KEYSIZE.unpack_from(data, topic_end)
    if key_size < 0:
        raise Reject(MALFORMED, f"KeySize is {key_size}, must be >= 0")
    key_start = topic_end + _TS_KEYSIZE_SIZE
    key_end = key_start + key_size
    if key_end + _VALUESIZE_SIZE > n:
        raise Reject(MALFORMED, f"KeySize {key_size} runs past the end of the datagram")
    (value_size,) = _VALUESIZE.unpack_from(data, key_end)
    if value_size < 0:
        raise Reject(MALFORMED, f"ValueSize is {value_size}, must be >= 0")
    value_start = key_end + _VALUESIZE_SIZE
    if value_start + value_size != n:
        if value_start + value_size > n:
            raise Reject(MALFORMED, f"ValueSize {value_size} runs past the end of the datagram")
        raise Reject(MALFORMED, f"{n - value_start - value_size} trailing bytes after the value")

    raw_topic = data[pos:topic_end]
    topic = _TOPIC_CACHE.get(raw_topic)
    if topic is None:
        topic = _check_topic(raw_topic)
    limit = max_message_bytes if isinstance(max_message_bytes, int) else max_message_bytes(topic)
    if key_size + value_size > limit:
        raise Reject(
            TOO_LARGE,
            f"key + value is {key_size + value_size} bytes, topic {topic!r} allows {limit}",
        )
    return topic, partition_key, timestamp_ms, key_start, key_end, value_start


def _reject_short(data: bytes) -> Reject:
    """The reason a datagram too short for any message is refused, checked in parse's order."""
    n = len(data)
    if n < _GENERIC_SIZE:
        return Reject(MALFORMED, f"datagram of {n} bytes is shorter than the 8-byte header")
    size, api_key, version = _GENERIC.unpack_from(data)
    if size != n:
        return Reject(MALFORMED, f"Size field says {size} bytes but the datagram has {n}")
    if api_key not in (ANY_PARTITION, PARTITION_KEY):
        return _reject_api_key(api_key)
    if version != API_VERSION:
        return Reject(UNSUPPORTED_VERSION, f"version {version} of ApiKey {api_key} (only 0)")
    return Reject(MALFORMED, f"datagram of {n} bytes is truncated")


def _reject_api_key(api_key: int) -> Reject:
    return Reject(UNSUPPORTED_API_KEY, f"ApiKey {api_key} (256 = AnyPartition, 257 = PartitionKey)")


def _check_topic(raw: bytes) -> str:
    """Decode and validate a topic name not yet in the cache; cache it when legal."""
    try:
        topic = raw.decode("ascii")
    except UnicodeDecodeError:
        raise Reject(INVALID_TOPIC, f"topic {raw[:64]!r} is not ASCII") from None
    if not is_legal_topic(topic):
        raise Reject(INVALID_TOPIC, illegal_topic(topic, shown=64))
    if len(_TOPIC_CACHE) >= _TOPIC_CACHE_MAX:
        _TOPIC_CACHE.clear()
    topic = sys.intern(topic)
    _TOPIC_CACHE[raw] = topic
    return topic
