"""The timestamp rule: what a message refused *alone* with ``INVALID_TIMESTAMP`` becomes.

A topic's ``message.timestamp.before.max.ms`` and ``after.max.ms`` are checked by the broker
against its own clock when the message arrives, not when Ferry accepted it. So a refusal has
three causes, told apart by the message's timestamp (``ts``), when Ferry accepted it
(``accepted``) and now:

- **it waited too long in the buffer** (an outage longer than ``before.max.ms``): the
  timestamp was fresh when Ferry accepted it, most of its age is Ferry's wait. Ferry took the
  message to deliver it, so it is sent again stamped with the send time, its own timestamp
  kept in the header ``ORIGINAL`` (milliseconds since the epoch, decimal) and counted in
  ``messages_restamped``. Never a discard.
- **this host's clock is ahead** of the brokers' (the timestamp is in the future, but no
  further ahead of Ferry's clock than ``SKEW`` when it was accepted): the message is kept and
  retried with back-off (it becomes acceptable as the clocks meet, or the clock is fixed),
  and its topic is flagged for an operator (health CRITICAL) naming the skew.
- **its own timestamp is impossible** (a client set it in the future, or it was already old
  when Ferry accepted it): Kafka's verdict on the message itself, discarded as ``invalid``.

Where the topic's ``before.max.ms`` is known (topic_limits.py), the first case is not left
to a refusal: a message whose wait in the buffer took it past the limit (``waited_too_long``)
is sent re-stamped at once, by both loops.
"""

from __future__ import annotations

from typing import Literal

# SKEW_MS: how far ahead of Ferry's clock a timestamp may be, at acceptance, and still be
# Ferry's own clock's; NO_LIMIT_MS: a before/after.max.ms at or past it is no limit. Shared
# with the intake, which refuses what a topic can never take (agent/record_batch.py).
from agent.record_batch import NO_LIMIT_MS, SKEW_MS

# The header a re-stamped message carries its original timestamp in.
ORIGINAL = "ferry-original-timestamp"

Verdict = Literal["restamp", "clock_ahead", "refuse"]
# Re-stamp this long before the limit is reached (at most a quarter of it): the message
# still travels to the broker after the check.
MARGIN_MS = 10_000


def verdict(ts_ms: int, accepted_ms: int, now_ms: int) -> Verdict:
    """What a message refused alone for its timestamp becomes (see the module's text)."""
    if ts_ms > now_ms:
        # In the future by the broker's clock too (it refused it): whose clock?
        return "clock_ahead" if ts_ms - accepted_ms <= SKEW_MS else "refuse"
    age_at_acceptance = accepted_ms - ts_ms
    waited = now_ms - accepted_ms
    # Most of its age spent in Ferry's buffer: Ferry's wait made it too old.
    return "restamp" if age_at_acceptance <= waited else "refuse"


Headers = list[tuple[str, str | bytes | None]]


def oldest_fresh(before_max_ms: int | None, now_ms: int) -> int:
    """The oldest timestamp a topic with ``before_max_ms`` takes now, with a margin; -1
    when the topic has no such limit (or it is not known)."""
    if before_max_ms is None or before_max_ms >= NO_LIMIT_MS:
        return -1
    return now_ms - before_max_ms + min(MARGIN_MS, before_max_ms // 4)


def waited_too_long(ts_ms: int, accepted_ms: int, now_ms: int, oldest: int) -> bool:
    """True when a message is older than ``oldest`` (``oldest_fresh``) because of its wait
    in Ferry's buffer: the same test as ``verdict``'s "restamp", before any refusal."""
    return ts_ms < oldest and accepted_ms - ts_ms <= now_ms - accepted_ms


def restamp_headers(headers: Headers | None, ts_ms: int) -> Headers:
    """The message's headers plus the original timestamp (a re-stamped send's)."""
    return [*(headers or ()), (ORIGINAL, str(ts_ms).encode())]
