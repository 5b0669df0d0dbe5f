"""What the forwarder's rooms share: its one logger, and ``Shared``, the loop's state that
the rooms made objects (leaving.py, ...) share with the rest of the loop (loop_state.py lists
the rooms)."""

from __future__ import annotations

import logging

from agent.forwarder.topic_state import TopicState
from agent.process.log_limit import LogLimit

# The forwarder's one logger, under the name it always had: log settings and alerts name it.
log = logging.getLogger("agent.forwarder.forwarder")


class Shared:
    """The loop's state that the rooms made objects share with the rest of the loop, named
    here and nowhere else. The rooms still made of ``LoopState`` reach its dict under its
    old name (``_topics``), bound once by the ``Forwarder``: their hot paths pay no extra
    lookup for it."""

    __slots__ = ("topics", "retry_topics", "in_flight", "limited")

    def __init__(self) -> None:
        # Each topic's state (topic_state.py), walked on every step; a topic's entry lives
        # while it holds something (``TopicState.holds_nothing``).
        self.topics: dict[str, TopicState] = {}
        # Topics with messages waiting for a retry (retries.py).
        self.retry_topics: set[str] = set()
        # Messages read and not yet deleted (in flight, retried, left behind or leaving):
        # against forwarder.max_in_flight_messages.
        self.in_flight = 0
        # Cluster state changes and stuck topics can repeat for hours: a line a minute each,
        # one limiter for both (stuck_topics.py, cluster_watch.py).
        self.limited = LogLimit(log)
