"""What the intake refuses because the Kafka topic can never take it, in the words every
source answers, counts and logs with.

The forwarder learns each topic's limits on the local cluster and publishes them
(agent/signals/limits.py); the rule itself is agent/record_batch.py, the one the forwarder
counts its batches with. Here: the cheap first look each source makes on its hot path
(``may_be_too_large``), the full verdict for the few messages that fail it (``too_large``:
it may compress the message, so the HTTP stage calls it off its event loop), and the
timestamp check (``bad_timestamp``). A topic whose limits are not known refuses nothing.

The decision a source makes of one message, and the word it counts it under, is
``refusal`` (a message's fields: the spool's records) or ``stored_refusal`` (a message the
way the buffer stores it: a datagram). A source that looks at many records of a few topics
(the spool's blocks) first compares each with its topic's ``Bounds`` (two or three integer
comparisons, no call), and asks ``refusal`` only of a record outside them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from agent import reasons
from agent.buffer import codec
from agent.record_batch import (
    Headers,
    batch_of_one,
    impossible_timestamp,
    never_fits,
    timestamp_window,
)
from agent.signals.limits import Limit

# A value without key or headers at least this much under the limit fits uncompressed, known
# without computing its exact batch: a batch of one adds the batch header (61) and at most 15
# bytes of record framing to it.
SLACK = 76
# The same with a key (no headers): the key's length takes at most 5 bytes where "no key"
# takes 1, and key and value together are what is counted; so a batch of one is at most
# key + value + 80 bytes (batch header 61, record length 5, attributes and deltas 3, key and
# value lengths 5 each, header count 1), whatever the split.
KEYED_SLACK = 80

# (reason, detail): the word a refusal is counted under (agent/reasons.py) and its sentence.
Refusal = tuple[str, str]


class Bounds(NamedTuple):
    """What a topic surely takes, for a per-record look without a call: a record without
    headers whose key and value together are at most ``room`` bytes, stamped between
    ``earliest`` and ``latest`` or not stamped at all (0 or less). A record outside them is
    not necessarily refused: ``refusal`` decides."""

    room: int
    earliest: int
    latest: int


def bounds(limit: Limit, now_ms: int) -> Bounds:
    earliest, latest = timestamp_window(now_ms, limit.before_max_ms, limit.after_max_ms)
    return Bounds(limit.max_message_bytes - KEYED_SLACK, earliest, latest)


def may_be_too_large(limit: Limit, key_len: int | None, value_len: int,
                     headers: Headers = ()) -> bool:
    """False when the message fits ``limit`` uncompressed (the common case, decided by
    arithmetic); True when ``too_large`` must look closer."""
    if key_len is None and not headers and value_len + SLACK <= limit.max_message_bytes:
        return False
    return batch_of_one(key_len, value_len, headers) > limit.max_message_bytes


def too_large(topic: str, limit: Limit, compression: str, key: bytes | None, value: bytes,
              headers: Headers = ()) -> str | None:
    """Why the topic can never take this message (the detail of a ``too_large_for_topic``
    refusal), or None when it can or it cannot be told. May compress: off event loops."""
    verdict = never_fits(limit.max_message_bytes, compression, key, value, headers)
    if not verdict:
        return None
    size = batch_of_one(None if key is None else len(key), len(value), headers)
    squeezed = "" if compression == "none" else \
        f", and cannot fit compressed with {compression} (Ferry's producer compression)"
    return (f"the message is {size} bytes as a Kafka record batch of its own{squeezed}: "
            f"over max.message.bytes={limit.max_message_bytes} of Kafka topic {topic!r}, "
            "which never takes it")


def bad_timestamp(topic: str, limit: Limit, ts_ms: int, now_ms: int | None = None
                  ) -> str | None:
    """Why the topic can never take a message a client stamped ``ts_ms`` (the detail of a
    ``timestamp_out_of_range`` refusal), or None."""
    if limit.before_max_ms is None and limit.after_max_ms is None:
        return None
    now = int(time.time() * 1000) if now_ms is None else now_ms
    timing = impossible_timestamp(ts_ms, now, limit.before_max_ms, limit.after_max_ms)
    if timing is None:
        return None
    if timing == "future":
        return (f"its timestamp {ts_ms} is {(ts_ms - now) / 1000:.0f} s ahead of this host's "
                f"clock: past message.timestamp.after.max.ms={limit.after_max_ms} of Kafka "
                f"topic {topic!r}, which never takes it")
    return (f"its timestamp {ts_ms} is {(now - ts_ms) / 1000:.0f} s old: past "
            f"message.timestamp.before.max.ms={limit.before_max_ms} of Kafka topic {topic!r}, "
            "which never takes it")


def refusal(topic: str, limit: Limit, compression: str, key: bytes | None, value: bytes,
            ts_ms: int, now_ms: int, headers: Headers = ()) -> Refusal | None:
    """Why a topic with ``limit`` can never take this message: too large even alone in a
    batch and compressed (``too_large_for_topic``), or a client-set timestamp out of its
    range (``timestamp_out_of_range``); None when it can. May compress: off event loops."""
    if may_be_too_large(limit, None if key is None else len(key), len(value), headers):
        why = too_large(topic, limit, compression, key, value, headers)
        if why is not None:
            return reasons.TOO_LARGE_FOR_TOPIC, why
    why = bad_timestamp(topic, limit, ts_ms, now_ms)
    if why is not None:
        return reasons.TIMESTAMP_OUT_OF_RANGE, why
    return None


_HEADER = codec.HEADER
_HEADER_SIZE = codec.HEADER.size


def stored_refusal(topic: str, limit: Limit, compression: str, stored: bytes, now_ms: int
                   ) -> Refusal | None:
    """``refusal`` of a message encoded the way the buffer stores it (codec: its header,
    the key, the value), reading the lengths from the header: key and value are sliced out
    only for the few ``may_be_too_large`` picks (a datagram's hot path)."""
    _, flags, _, ts, _, klen, hcount = _HEADER.unpack_from(stored)
    if hcount:  # not a datagram's: decoded whole
        record, _ = codec.decode(topic, stored)
        return refusal(topic, limit, compression, record.key, record.value,
                       record.timestamp_ms, now_ms, record.headers)
    key_len = klen if flags & codec.HAS_KEY else None
    start = _HEADER_SIZE + klen
    if may_be_too_large(limit, key_len, len(stored) - start):
        return refusal(topic, limit, compression,
                       stored[_HEADER_SIZE:start] if key_len is not None else None,
                       stored[start:], ts, now_ms)
    why = bad_timestamp(topic, limit, ts, now_ms)
    if why is not None:
        return reasons.TIMESTAMP_OUT_OF_RANGE, why
    return None


def first_too_large(topic: str, limit: Limit, compression: str, key: bytes | None,
                    values: Sequence[bytes], indices: Sequence[int],
                    headers: Headers = ()) -> tuple[int, str] | None:
    """The first of ``values`` (by ``indices``, those ``may_be_too_large`` picked) the topic
    can never take, and why; None when it takes them all. For the HTTP stage's executor."""
    for i in indices:
        why = too_large(topic, limit, compression, key, values[i], headers)
        if why is not None:
            return i, why
    return None
