"""Isolation in the exactly-once loop: which messages are suspects, and how many go together.

A transaction Kafka refused a batch of is aborted whole, so every message of the refused
batches is a *suspect* (isolation.py): it is sent again inside a *window*, a run of suspects
flushed before and after, so that their batches hold nothing else, and their answers speak of
them alone. A window of one message is that message's verdict.

Windows halve, as Kafka's Java producer splits a batch refused as too large: a refused window
of n suspects makes the next one n/2, and an accepted window lets the next one double. One
refused record among n suspects is found in about 2 log2(n) transactions instead of n flushes
in a row; and a transaction holds at most one window per topic, after which it commits what it
has, so an aborted window costs the other topics one transaction, never their messages.
"""

from __future__ import annotations

from collections.abc import Iterable


class Suspects:
    def __init__(self) -> None:
        self._ids: set[bytes] = set()
        self._group: dict[str, int] = {}  # topic -> suspects in its next window
        # Sent with the send time (timestamps.py): too old for the topic after their wait
        # in the buffer (found before sending, or refused alone for it). Until delivered.
        self.restamp: set[bytes] = set()
        # The open transaction's windows: id -> the size of the window it went in.
        self._windowed: dict[bytes, int] = {}
        self._opened: set[str] = set()  # topics whose window the open transaction used

    def __contains__(self, mid: object) -> bool:
        return mid in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def begin(self) -> None:
        """A transaction begins: no window used yet."""
        self._windowed.clear()
        self._opened.clear()

    def open_window(self, topic: str) -> int:
        """The size of the window ``topic`` opens now, or 0 when this transaction had one
        already (the caller stops reading the topic until the next transaction)."""
        if topic in self._opened:
            return 0
        self._opened.add(topic)
        return self._group.get(topic, 1)

    def in_window(self, mid: bytes, size: int) -> None:
        self._windowed[mid] = size

    def alone(self, mid: bytes) -> bool:
        """True when ``mid`` was sent in a window of its own: its answer is its verdict."""
        return self._windowed.get(mid) == 1

    def refused(self, topic: str, refused: Iterable[bytes], sent: Iterable[bytes]) -> None:
        """The transaction was aborted: ``refused`` (of ``topic``) were in refused batches,
        ``sent`` is everything of ``topic`` it sent. Refused ones are suspects; window
        members that were not refused are cleared (their batches were accepted)."""
        refused = set(refused)
        windows = [self._windowed[m] for m in refused if m in self._windowed]
        for mid in sent:
            if mid in self._windowed and mid not in refused:
                self._ids.discard(mid)
        self._ids.update(refused)
        if windows:
            self._group[topic] = max(1, max(windows) // 2)
        elif refused:
            self._group[topic] = max(1, len(refused) // 2)

    def judged(self, mid: bytes) -> None:
        """``mid`` has its verdict (discarded): no longer a suspect."""
        self._ids.discard(mid)
        self.restamp.discard(mid)

    def delivered(self, topics: Iterable[str], ids: list[bytes]) -> None:
        """The transaction committed: its messages are no longer suspects (nor re-stamped),
        and a topic whose window was accepted may try a window twice as large next."""
        if self.restamp:
            self.restamp.difference_update(ids)
        if not self._ids:
            return
        self._ids.difference_update(ids)
        for topic in topics:
            if topic in self._opened and topic in self._group:
                self._group[topic] *= 2
        if not self._ids:
            self._group.clear()
