"""What the forwarder's loop keeps per topic: its read cursor, its sends and retries, and
whether it is stuck.

The loop walks every entry on every step, so an entry lives only while it holds something:
``holds_nothing`` says when it can go (``Forwarder._prune_topics``). A topic with buffered
messages gets a fresh entry at the next scan, whose cursor starts at the topic's head again;
that re-reads nothing, since an entry is dropped only when no message of the topic is in
flight, waiting for a retry, or waiting for its delete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.forwarder.flight import Flight, ValueReport
from agent.forwarder.stuck import Stuck


@dataclass(slots=True)
class TopicState:
    cursor: bytes | None = None
    in_flight: int = 0
    drained_at: float = 0.0
    expiry_check_at: float = 0.0
    retry: list[Flight] = field(default_factory=list)  # waiting to be re-sent, in id order
    retry_at: float = 0.0
    sending: int = 0  # produce() calls of this topic not yet reported
    # Set when a send of the topic is scheduled again; new messages are read only once every
    # retry has been re-sent and every send of the topic has reported (Retries.schedule).
    recovering: bool = False
    # Sends failing with an error that is retried, none acknowledged since (stuck.py).
    stuck: Stuck | None = None
    waiting_since: float = 0.0  # partitions unknown since (monotonic; 0: known)
    # Reports of the topic's common-path sends (value_report).
    sink: list[ValueReport] = field(default_factory=list)
    # Partitions whose keyed messages are left behind in the buffer, their leader out of
    # reach: partition -> the first id left behind (holding.py).
    held: dict[int, bytes] = field(default_factory=dict)
    held_since: float = 0.0  # wall clock, shown on the topic's row
    rewinding: bool = False  # reads nothing until settled, then from its head (holding.py)
    rewind_check_at: float = 0.0  # monotonic: the next look at the oldest held's TTL

    def holds_nothing(self) -> bool:
        """Nothing of the topic is in flight, waiting for a retry or a report, or leaving
        (``in_flight`` counts a message until its delete), none left behind with its
        partition (holding.py: the cursor is past them), and no state must outlive the
        entry: a stuck topic keeps its reason until it delivers again, a topic waiting for
        its partitions keeps the time it began to wait."""
        return not (self.in_flight or self.sending or self.retry or self.sink
                    or self.recovering or self.stuck is not None or self.waiting_since
                    or self.held)
