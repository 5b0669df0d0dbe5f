"""How many bytes the next exactly-once transaction may hold: sized from the rate the last one
achieved, so that it finishes well inside the commit limit.

A transaction must be acknowledged and committed within ``forwarder.
transaction_commit_timeout_ms`` or it is given up, and everything in it is sent again. A
message count says nothing about how long that takes; the bytes per second a cluster takes
from this producer do (a producer quota is a byte rate per broker). So each transaction is
measured (its bytes, the seconds from its start to its commit) and the next one may hold what
that rate carries in a *target* share of the limit. A transaction that commits within the
target lets the next one hold twice as much (or what its rate carries in the target, if
more), so a cluster whose quota was lifted is back to full transactions within a few commits.
One given up is sized from what was acknowledged of it before the limit: never again the same
batch, at most half of it, however little of it was acknowledged.

Why a quarter of the limit: a client idle for a while may send a burst above its quota before
Kafka throttles it (the rate is measured over ``quota.window.num`` one-second windows), so a
transaction measured in that burst can overestimate the sustained rate about twice; a quarter
still leaves the next one twice the time it should need. The measurements behind it are in
docs/design.md ("Transactions under a quota").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

# The share of the commit limit a transaction is sized to take.
TARGET_SHARE = 0.25
# The rate that sizes transactions is the bytes the cluster took over this long: longer than
# Kafka's quota window (11 one-second samples by default), so the burst Kafka lets through
# before it throttles, and the throttle that follows, are averaged out.
HORIZON = 30.0
# Above this a budget is no budget: transaction_max_messages alone bounds a transaction.
UNBOUNDED = 1 << 34


class TransactionSize:
    """The byte budget of the next transaction (None: no budget, only the message count)."""

    def __init__(self, limit_seconds: float) -> None:
        self.target = limit_seconds * TARGET_SHARE
        self.budget: int | None = None
        # (when, bytes the cluster took) per transaction ended within HORIZON, and when
        # the oldest of them began.
        self._taken: deque[tuple[float, int]] = deque()
        self._since = 0.0

    def committed(self, sent_bytes: int, seconds: float, now: float) -> None:
        """A transaction of ``sent_bytes`` was acknowledged and committed in ``seconds``
        (from when it stopped collecting), at ``now`` (time.monotonic)."""
        self._took(sent_bytes, seconds, now)
        if self.budget is not None and sent_bytes * 2 < self.budget:
            return  # far from its budget: no measure of what the budget would take
        if seconds > self.target:
            # Too slow for the target: the next holds what this rate carries in it. Never
            # more than before: a slow commit is no evidence that more would be faster.
            carried = max(1, self._carried(sent_bytes, seconds))
            self.budget = carried if self.budget is None else min(self.budget, carried)
        elif self.budget is not None:
            # In time, and it used its budget: up to twice as much next, as far as the rate
            # over the horizon carries. A transaction's own time is no measure alone: Kafka
            # throttles a client *after* answering it, and lets a client that was quiet
            # send a burst first, so the cost of one transaction shows in the next ones.
            grown = min(self.budget * 2, max(self.budget, self._carried_lately(now)))
            self.budget = None if grown >= UNBOUNDED else grown

    def timed_out(self, sent_bytes: int, acked_bytes: int, seconds: float, now: float) -> None:
        """A transaction of ``sent_bytes`` was given up ``seconds`` after it stopped
        collecting, ``acked_bytes`` of it acknowledged: the next holds what the rate carries
        in the target (this one's, or over the horizon, the smaller), and never more than
        half of this one."""
        self._took(acked_bytes, seconds, now)
        half = max(1, sent_bytes // 2)
        rate = min(self._carried(acked_bytes, seconds), self._carried_lately(now))
        self.budget = max(1, min(half, rate))

    def _took(self, nbytes: int, seconds: float, now: float) -> None:
        taken = self._taken
        while taken and taken[0][0] < now - HORIZON:
            # What is left began no earlier than the end of what is dropped.
            self._since = taken.popleft()[0]
        if not taken:
            self._since = now - seconds
        taken.append((now, nbytes))

    def _carried_lately(self, now: float) -> int:
        """What the rate over the horizon carries in the target time."""
        return self._carried(sum(n for _, n in self._taken), now - self._since)

    def _carried(self, nbytes: int, seconds: float) -> int:
        """What ``nbytes`` in ``seconds`` carries in the target time."""
        return int(nbytes * self.target / max(seconds, 1e-3))

    def room(self, used: int) -> int | None:
        """Bytes the open transaction may still take, having taken ``used`` (None: no
        budget). 0 ends the transaction."""
        if self.budget is None:
            return None
        return max(0, self.budget - used)


def fitting(sizes: Sequence[int], allowance: int | None) -> int:
    """How many of the messages of ``sizes`` (in order) fit in ``allowance`` bytes (None: all
    of them): at least one, so that a message larger than the whole budget still goes."""
    if allowance is None:
        return len(sizes)
    n = total = 0
    for size in sizes:
        total += size
        if n and total > allowance:
            break
        n += 1
    return n
