"""Exactly-once topics held back, each on its own: one an ACL denies, one whose timestamps the
broker's clock refuses. Every exactly-once topic shares one transaction, so a topic that fails
inside it would abort the others' messages with it, for as long as it fails; held, it waits
out of the transactions (its messages in the buffer, their order kept) and is tried again
after a back-off, while the others commit.

A held topic is *stuck* as at-least-once topics are (stuck.py): its row and health name it
and the error, CRITICAL when only an operator can fix it. Its next commit releases it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from agent.forwarder.stuck import Stuck

FIRST_HOLD = 1.0  # seconds; doubled after each failed try, up to LONGEST_HOLD
LONGEST_HOLD = 30.0


class HeldTopics:
    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._hold: dict[str, float] = {}
        self._stuck: dict[str, Stuck] = {}
        # What the status reads from another thread: replaced whole, never changed in place.
        self.view: dict[str, dict[str, object]] = {}

    def waiting(self, topic: str, now: float) -> bool:
        """True while ``topic`` waits out its hold."""
        return self._until.get(topic, 0.0) > now

    def hold(self, topic: str, error: str, detail: str, operator: bool, cluster: str) -> float:
        """Hold ``topic`` back after it failed with ``error``; the seconds it waits."""
        hold = self._hold.get(topic, FIRST_HOLD / 2) * 2
        hold = self._hold[topic] = min(hold, LONGEST_HOLD)
        self._until[topic] = time.monotonic() + hold
        stuck = self._stuck.get(topic)
        if stuck is None:
            self._stuck[topic] = Stuck(error, cluster, detail, operator)
        else:
            stuck.again(error, cluster, detail, operator)
        self._publish()
        return hold

    def waits(self, topic: str, error: str, detail: str, cluster: str) -> None:
        """``topic`` waits on something outside it (a broker out of reach): no back-off, as
        nothing is sent meanwhile; its row says why until its next commit releases it."""
        stuck = self._stuck.get(topic)
        if stuck is None:
            self._stuck[topic] = Stuck(error, cluster, detail, False)
        elif (stuck.error, stuck.detail) != (error, detail):
            stuck.again(error, cluster, detail, False)
        else:
            return
        self._publish()

    def delivered(self, topics: Iterable[str]) -> None:
        """``topics`` committed: released, their back-off forgotten."""
        if not self._stuck and not self._hold:
            return
        for topic in topics:
            self._until.pop(topic, None)
            self._hold.pop(topic, None)
            self._stuck.pop(topic, None)
        self._publish()

    def _publish(self) -> None:
        self.view = {t: s.to_json() for t, s in self._stuck.items()}
