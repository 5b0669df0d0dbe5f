"""What waits for the forwarder's next batched durable delete (leaving.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.buffer.store import DeliveredRun, Outcome
from agent.forwarder.discard_log import Discard
from agent.forwarder.flight import Flight


@dataclass
class LeavingBatch:
    """Acknowledged messages, the common case, go in ``runs`` (lists per topic and cluster,
    no object per message); discards as ``outcomes`` (with their ``flights`` and
    ``discards``, index for index)."""

    outcomes: list[Outcome] = field(default_factory=list)
    flights: list[Flight | None] = field(default_factory=list)
    discards: list[Discard] = field(default_factory=list)
    runs: dict[tuple[str, str], DeliveredRun] = field(default_factory=dict)
    delivered: int = 0  # messages in runs
    since: float = 0.0
    logged: int = 0  # discards[:logged] are in the discard log already
    retry_at: float = 0.0  # after a failed delete: not before then

    def __len__(self) -> int:
        return len(self.outcomes) + self.delivered

    def discarded_topics(self) -> set[str]:
        """Topics with discards waiting here: messages read, not in flight, not yet gone."""
        return {o.topic for o in self.outcomes}
