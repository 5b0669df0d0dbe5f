"""The memory budget of request bodies in flight, shared by every HTTP connection.

Each connection's own limits (the body limit, 4 MiB queued ahead of its answers) bound what
one client can make Ferry hold, but not what many do together: 300 connections each halfway
through a 16 MiB batch hold 2.4 GB. Every body byte read is taken from this budget as it
arrives (and a gzip body's decoded bytes as they are decoded) and given back when its
request is answered or dropped; a body that finds the budget spent is answered 503
``body_budget`` and its connection closed (issue #37, item 4). It lives on the HTTP event
loop's thread only, so it needs no lock.
"""

from __future__ import annotations

from agent import reasons
from agent.ingest.http.errors import HttpError

# Retry-After of a 503 body_budget: bodies in flight are answered within milliseconds to a
# body deadline (http.body_timeout_seconds), so a second is a fair first wait.
RETRY_AFTER = 1.0


class BodyBudget:
    """Bytes of request bodies held at once, at most ``limit``."""

    __slots__ = ("limit", "held", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0  # bodies refused for want of it, since the start

    def take(self, size: int) -> bool:
        """Take ``size`` bytes; False (nothing taken) if that would pass the limit."""
        held = self.held + size
        if held > self.limit:
            self.refused += 1
            return False
        self.held = held
        return True

    def give(self, size: int) -> None:
        self.held -= size

    def spent(self) -> HttpError:
        """The answer to a body that found the budget spent."""
        return HttpError(503, reasons.BODY_BUDGET,
                         f"the agent holds {self.limit} bytes of request bodies already "
                         "(http.max_body_bytes_in_flight); retry later",
                         reason=reasons.BODY_BUDGET, retry_after=RETRY_AFTER, close=True)
