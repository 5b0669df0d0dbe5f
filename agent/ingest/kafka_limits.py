"""What the intake refuses because the Kafka topic can never take it, in the words every
source answers, counts and logs with.

The forwarder learns each topic's limits on the local cluster and publishes them
(agent/signals/limits.py); the rule itself is agent/record_batch.py, the one the forwarder
counts its batches with. Here: the cheap first look each source makes on its hot path
(``may_be_too_large``), the full verdict for the few messages that fail it (``too_large``:
it may compress the message, so the HTTP stage calls it off its event loop), and the
timestamp check (``bad_timestamp``). A topic whose limits are not known refuses nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from agent.record_batch import Headers, batch_of_one, impossible_timestamp, never_fits
from agent.signals.limits import Limit

# A value without key or headers at least this much under the limit fits uncompressed, known
# without computing its exact batch: a batch of one adds the batch header (61) and at most 15
# bytes of record framing to it.
SLACK = 76


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
