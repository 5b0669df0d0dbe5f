"""The plain-message fast path's decode, shared by both send loops.

Most buffered messages are plain: no headers of their own, the topic's current generation,
young enough that no TTL needs checking, small enough. Those are sent from their stored
value without a Record or StoredMessage: the header is read here and the producer gets
slices of the value. The at-least-once loop (send.py, ``Sending._send_values``) and the
exactly-once one (transactions.py, ``ExactlyOnce._send_values``) both read through
``plain_values``, so what counts as plain is decided in this one place.

Plain is only the fast path's filter: it lets through what none of the send-eligibility
rules can concern, and every message it does not take is judged by the one rule
(eligibility.py) before it is sent or discarded.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from agent.buffer import codec

# The flags ``plain_values`` gives a message that is not plain.
NOT_PLAIN = -1
_NOT_PLAIN = (NOT_PLAIN, 0, 0, None, b"")


def plain_values(values: list[tuple[bytes, bytes]], gen: int, check_ttl: bool,
                 max_message_bytes: int, oldest_ts: int = -1
                 ) -> Iterator[tuple[bytes, bytes, int, int, int, bytes | None, bytes]]:
    """``(id, stored value, flags, timestamp, partition key, key, value)`` for each pair of
    ``Store.read_values``, decoded from the header alone: no Record or StoredMessage.

    ``flags`` is ``NOT_PLAIN`` for anything but a plain message, which the caller then
    decodes fully (``message``), judges by eligibility.py's rule, and sends through the
    general path. Not plain: headers of its own, an older generation than ``gen``, a TTL to
    check (``check_ttl``: the oldest message read is older than the topic's TTL), key and
    value possibly larger than ``max_message_bytes``, a timestamp older than ``oldest_ts``
    (it may need re-stamping: timestamps.py), a value that does not decode."""
    unpack = codec.HEADER.unpack_from
    hsize = codec.HEADER.size
    version_now = codec.VERSION
    has_key = codec.HAS_KEY
    # Stored value = header + key + value: more than this and key + value may be too large.
    max_plain = max_message_bytes + hsize
    for mid, v in values:
        try:
            version, flags, g, ts, pk, klen, nheaders = unpack(v)
        except struct.error:  # shorter than a header: the general path discards it as corrupt
            yield (mid, v, *_NOT_PLAIN)
            continue
        pos = hsize + klen
        if (version != version_now or nheaders or g < gen or check_ttl
                or pos > len(v) or len(v) > max_plain or ts < oldest_ts):
            yield (mid, v, *_NOT_PLAIN)
            continue
        yield mid, v, flags, ts, pk, v[hsize:pos] if flags & has_key else None, v[pos:]
