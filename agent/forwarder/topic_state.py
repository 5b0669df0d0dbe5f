"""What the forwarder's loop keeps per topic: its read cursor, its sends and retries, and
whether it is stuck."""

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
    # retry has been re-sent and every send of the topic has reported (_schedule_retry).
    recovering: bool = False
    # Sends failing with an error that is retried, none acknowledged since (stuck.py).
    stuck: Stuck | None = None
    waiting_since: float = 0.0  # partitions unknown since (monotonic; 0: known)
    # Reports of the topic's common-path sends (value_report).
    sink: list[ValueReport] = field(default_factory=list)

