"""Whether a buffered message may be sent: the one rule both delivery loops apply.

A message read from the buffer is sent unless one of these discards it, checked in this
order (the first that applies names the reason):

1. ``corrupt``: its stored value does not decode;
2. ``generation``: its topic was deleted after it was accepted (an older generation);
3. ``too_large``: key and value weigh more than the topic's ``max_message_bytes`` (sources
   that cannot refuse at once, spool files, let these through);
4. ``ttl``: it is older than the topic's ``ttl_seconds``.

``judge`` is called by the at-least-once loop when it reads (reading.py, ``_sendable``, for
every message the plain fast path does not take), before each retry (retries.py), when it
expires the head of a topic it cannot send to (reading.py, ``_expire_head``), and by the
exactly-once loop (transactions.py, ``_unsendable``). How a discard then leaves the buffer
stays each loop's own (in flight or not, in a transaction or not); what it is discarded for
is decided here, so a new delivery rule is one change in this file and one test run
(tests/forwarder/test_eligibility.py) on both loops.

The plain fast path (plain.py, ``plain_values``) does not call this per message: it only
lets through messages none of these rules can concern (the topic's current generation, no
TTL to check, small enough, a header that reads), and hands every other one here.
"""

from __future__ import annotations

from typing import NamedTuple

from agent import reasons
from agent.buffer.store import Corrupt, StoredMessage
from agent.config import TopicConfig


class Unsendable(NamedTuple):
    """Why a message is discarded instead of sent: a reason of reasons.py and its detail
    (the discard log's and the log line's text; a caller may add to it, as a retry adds its
    last error)."""

    reason: str
    detail: str


def judge(m: StoredMessage | Corrupt, settings: TopicConfig, generation: int,
          max_bytes: int, now_ms: int, check_ttl: bool = True) -> Unsendable | None:
    """None when ``m`` may be sent; else why it is discarded.

    ``generation`` is its topic's current one, ``max_bytes`` the most key and value may
    weigh, ``now_ms`` the wall clock in milliseconds. ``check_ttl`` False skips the TTL: the
    at-least-once loop passes it when even the oldest message of the read is younger than
    the TTL (messages are in acceptance order), so no message of it can have expired."""
    if isinstance(m, Corrupt):
        return Unsendable(reasons.CORRUPT, m.error)
    if m.generation < generation:
        return Unsendable(reasons.GENERATION,
                          "the topic was deleted after this message was accepted")
    r = m.record
    if len(r.value) + (len(r.key) if r.key else 0) > max_bytes:
        return Unsendable(reasons.TOO_LARGE, f"{r.size} bytes > max_message_bytes={max_bytes}")
    if check_ttl and now_ms - m.accepted_ms > settings.ttl_seconds * 1000:
        return Unsendable(reasons.TTL, f"older than ttl_seconds={settings.ttl_seconds}")
    return None
