"""What a message weighs as a Kafka record batch, and what a topic can never take: the one
rule both the intake (which refuses before it acknowledges) and the forwarder (which sizes
its batches) count with.

A broker refuses a record batch larger than the topic's ``max.message.bytes`` as it arrives:
the batch *as sent*, i.e. after the producer's compression. The smallest batch Ferry can
ever send a message in is a batch holding that message alone, so the intake asks of each
message "does even its batch of one exceed the limit?":

- uncompressed, the answer is exact (``batch_of_one``): the v2 batch header, the record's
  framing (varints) and its key, value and headers. At or under the limit it is accepted,
  whatever else is known;
- compressed, Python has no lz4, zstd or snappy here and confluent-kafka does not expose
  librdkafka's compressors. For lz4 and snappy a *provable floor* of any compressor's output
  stands in (``compressed_floor``): a match can only save bytes where the input repeats a
  4-byte string, so a message without such repeats cannot shrink (an incompressible one is
  refused, a repetitive one is accepted). For gzip, zlib compresses it at its strongest
  level. For zstd nothing sound is known, and the message is accepted (the forwarder's
  refusal rules see to it if Kafka refuses it).

The refusal is conservative on purpose: it counts what the client gave, not the headers Ferry
may add on the way (the exactly-once tag, a re-stamped timestamp), so a message that fits only
without them is accepted and left to the forwarder's rules, never refused for what Kafka
would take.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Literal

# The v2 record batch header (baseOffset 8, batchLength 4, partitionLeaderEpoch 4, magic 1,
# crc 4, attributes 2, lastOffsetDelta 4, baseTimestamp 8, maxTimestamp 8, producerId 8,
# producerEpoch 2, baseSequence 4, records count 4): counted in max.message.bytes, and never
# compressed.
BATCH_HEADER = 61
# What a record weighs in a batch besides its stored value, on the safe side: the record's
# framing (at most 36 bytes of varints and attributes) and a header Ferry adds (the
# exactly-once tag with the agent's identity, or a re-stamped message's original time).
# The forwarder weighs its batches with it.
RECORD_OVERHEAD = 160
# Timestamps, as both the intake and the forwarder's timestamp rule read them: how far ahead
# of Ferry's clock a timestamp may be and still be taken for Ferry's own clock's (a client's
# clock a little ahead, the time a send took, this host's clock a little behind the brokers'),
# and the limit past which a topic's before/after.max.ms means "no limit" (Kafka's old default
# is Long.MAX_VALUE).
SKEW_MS = 60_000
NO_LIMIT_MS = 10 * 365 * 86_400_000

Headers = Sequence[tuple[str, bytes | None]]

# The framing each codec adds at least: lz4's frame (magic 4, flags 2, header checksum 1,
# end mark 4), snappy's length varint (raw; xerial's framing is longer).
_LZ4_FRAME = 11
_SNAPPY_FRAME = 1
# Another zlib than Python's (librdkafka links its own) may compress a little better: what
# zlib's strongest level gives, less this share, is taken as what any zlib gives.
_GZIP_SLACK = 0.01
_GZIP_HEADER = 18  # gzip's header and trailer around the deflate stream
# distinct 4-grams are counted in pieces this large, stopping once the floor is known past
# the limit: the set never holds much more than the limit's worth of them.
_PIECE = 64 * 1024


def varint_size(n: int) -> int:
    """Bytes of ``n`` as Kafka's zigzag varint (varlong alike)."""
    z = (n << 1) ^ (n >> 63)
    size = 1
    while z >= 0x80:
        z >>= 7
        size += 1
    return size


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _body_size(key_len: int | None, value_len: int, headers: Headers) -> int:
    """A record's body in a batch of one (attributes, timestamp and offset deltas 0)."""
    size = 3 + (varint_size(key_len) + key_len if key_len is not None else 1)
    size += varint_size(value_len) + value_len + varint_size(len(headers))
    for name, value in headers:
        n = len(name.encode())
        size += varint_size(n) + n
        size += varint_size(len(value)) + len(value) if value is not None else 1
    return size


def batch_of_one(key_len: int | None, value_len: int, headers: Headers = ()) -> int:
    """The exact size of an uncompressed v2 batch holding only this record (``key_len`` None
    for no key): what the broker compares with ``max.message.bytes``."""
    body = _body_size(key_len, value_len, headers)
    return BATCH_HEADER + varint_size(body) + body


def record_bytes(key: bytes | None, value: bytes, headers: Headers = ()) -> bytes:
    """The record as a batch of one holds it: what a compressing producer compresses."""
    parts = [b"\x00\x00\x00",  # attributes, timestamp delta 0, offset delta 0
             _varint(-1) if key is None else _varint(len(key)) + key,
             _varint(len(value)), value, _varint(len(headers))]
    for name, hvalue in headers:
        raw = name.encode()
        parts += [_varint(len(raw)), raw,
                  _varint(-1) if hvalue is None else _varint(len(hvalue)) + hvalue]
    body = b"".join(parts)
    return _varint(len(body)) + body


def _distinct_over(data: bytes, enough: int) -> bool:
    """True when ``data`` holds more than ``enough`` distinct 4-byte strings; it stops
    counting as soon as it knows."""
    seen: set[bytes] = set()
    n = len(data)
    for start in range(0, max(n - 3, 0), _PIECE):
        end = min(start + _PIECE, n - 3)
        view = data[start:end + 3]
        seen.update(view[i:i + 4] for i in range(end - start))
        if len(seen) > enough:
            return True
    return False


def compressed_over(codec: str, records: bytes, room: int) -> bool | None:
    """Whether ``codec`` cannot bring ``records`` (``record_bytes``) to ``room`` bytes or
    fewer, by any compressor of that format; None when that cannot be told (zstd, or a
    codec this does not know).

    lz4 and snappy: a match of length L (at least 4) costs at least 3 bytes in lz4 and 2 in
    snappy, and each of its first L - 3 positions starts a 4-byte string seen earlier. With
    d distinct 4-byte strings among the n - 3 positions, at most n - 3 - d positions repeat,
    so lz4's output is at least n - (n - 3 - d) = d + 3 bytes, and snappy's at least
    n - 2 (n - 3 - d) = 2d - n + 6 bytes (a short copy may save twice its repeats)."""
    n = len(records)
    if codec == "lz4":
        # d + 3 + framing > room  <=>  d > room - 3 - framing
        return _distinct_over(records, room - 3 - _LZ4_FRAME)
    if codec == "snappy":
        # 2d - n + 6 + framing > room  <=>  d > (room + n - 6 - framing) / 2
        return _distinct_over(records, (room + n - 6 - _SNAPPY_FRAME) // 2)
    if codec == "gzip":
        deflated = zlib.compressobj(9, zlib.DEFLATED, -15)
        size = len(deflated.compress(records)) + len(deflated.flush()) + _GZIP_HEADER
        return size - int(size * _GZIP_SLACK) > room
    if codec == "none":
        return n > room
    return None


def never_fits(limit: int, codec: str, key: bytes | None, value: bytes,
               headers: Headers = ()) -> bool | None:
    """True when a topic with ``max.message.bytes = limit``, written by a producer
    compressing with ``codec``, can never take this message; False when it can; None when
    compression may make it fit and that cannot be told.

    The cheap check first (exact, no bytes touched): most messages end there. Compressing is
    for those over the limit, and may take milliseconds: call it off an event loop."""
    if batch_of_one(None if key is None else len(key), len(value), headers) <= limit:
        return False
    if codec == "none":
        return True
    return compressed_over(codec, record_bytes(key, value, headers), limit - BATCH_HEADER)


Timing = Literal["old", "future"]


def timestamp_window(now_ms: int, before_max_ms: int | None, after_max_ms: int | None
                     ) -> tuple[int, int]:
    """The oldest and the newest client-set timestamp a topic with these
    ``message.timestamp.before.max.ms`` and ``after.max.ms`` takes, judged by this host's
    clock at acceptance (``now_ms``), with ``SKEW_MS`` to spare on both sides (see
    ``impossible_timestamp``); an unknown or unlimited side is the i64 range's end. For a
    source that looks at many records against one topic with two comparisons each."""
    earliest, latest = -(2**63), 2**63 - 1
    if before_max_ms is not None and before_max_ms < NO_LIMIT_MS:
        earliest = now_ms - before_max_ms - SKEW_MS
    if after_max_ms is not None and after_max_ms < NO_LIMIT_MS:
        latest = now_ms + after_max_ms + SKEW_MS
    return earliest, latest


def impossible_timestamp(ts_ms: int, now_ms: int, before_max_ms: int | None,
                         after_max_ms: int | None) -> Timing | None:
    """"old" or "future" when a topic with these ``message.timestamp.before.max.ms`` and
    ``after.max.ms`` can never take a message a client stamped ``ts_ms``, judged by this
    host's clock at acceptance (``now_ms``); None when it can.

    A margin of ``SKEW_MS`` on both sides: the brokers' clock may differ from this host's,
    and within it the forwarder's own rule decides (forwarder/timestamps.py: a message that
    then waits too long is re-stamped; a clock ahead is retried). A timestamp of 0 or less
    is no client's time: librdkafka stamps 0 with the send time."""
    if ts_ms <= 0:
        return None
    earliest, latest = timestamp_window(now_ms, before_max_ms, after_max_ms)
    if ts_ms < earliest:
        return "old"
    if ts_ms > latest:
        return "future"
    return None
