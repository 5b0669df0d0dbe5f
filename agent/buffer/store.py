"""The LMDB write-ahead buffer, as the rest of Ferry sees it: ``Store``.

``Store`` opens the environment and hands each call to the room that does it:

| room | module |
| --- | --- |
| the environment, its databases and transactions | environment.py (layout: layout.py) |
| room against ``max_bytes`` and on disk | capacity.py (the file's allocation: space.py) |
| the one append path, and message ids | appender.py, ids.py |
| reading a topic in order, locating a message | reader.py (decoding: stored.py) |
| removal and what became of a message | removal.py, tracking.py |
| per-topic counts, topic generations | topic_counts.py, generations.py |
| ingest-side state keys | state.py |
| moving a layout-1 buffer at open | migration.py |

Only this package touches LMDB. Design notes are in docs/buffer.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from agent import reasons
from agent.buffer.appender import Appender, EncodedGroup
from agent.buffer.capacity import RECORD_OVERHEAD, Capacity
from agent.buffer.environment import Environment
from agent.buffer.generations import Generations
from agent.buffer.layout import DATABASES, MAX_DBS
from agent.buffer.migration import migrate_layout_1
from agent.buffer.reader import Reader
from agent.buffer.refusals import BufferFull, BufferUnavailable, DiskFull, InvalidGroup
from agent.buffer.removal import Removal, TrackingSettings
from agent.buffer.space import InsufficientSpace, Space
from agent.buffer.state import StateChange, StateKeys
from agent.buffer.stored import Corrupt, StoredMessage, message, messages, stored_size
from agent.buffer.topic_counts import TopicCounts, TopicStats
from agent.buffer.tracking import DeliveredRun, Outcome
from agent.records import Record

# What callers import from here (the names the buffer's users have always used).
__all__ = [
    "DATABASES", "DEFAULT_RESERVE", "MAX_DBS", "RECORD_OVERHEAD", "BufferFull",
    "BufferUnavailable", "Corrupt", "DeliveredRun", "DiskFull", "EncodedGroup",
    "InsufficientSpace", "InvalidGroup", "Outcome", "StateChange", "Store", "StoredMessage",
    "TopicStats", "message", "messages",
]

# LMDB needs room beyond the messages themselves: the free list, tracking, state, and space
# for the forwarder's deletes to proceed when ingest has been refused for being full.
_HEADROOM_FRACTION = 0.25
_HEADROOM_MIN = 64 * 1024 * 1024
_INITIAL_MAP = 256 * 1024 * 1024
# Allocated space beyond LMDB's last page that new messages never use (space.py): what the
# forwarder's deletes, tracking and state need to drain a buffer whose filesystem is full.
DEFAULT_RESERVE = 32 * 1024 * 1024


class Store:
    """An open buffer environment. Thread-safe; open once per process."""

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        *,
        initial_map_bytes: int = _INITIAL_MAP,
        track: bool = True,
        track_seconds: int = 3600,
        readonly: bool = False,
        reserve_bytes: int = DEFAULT_RESERVE,
        preallocate: bool = False,
        open_space: Literal["skip", "try", "require"] = "skip",
    ) -> None:
        """``reserve_bytes``/``preallocate``: the disk space kept ahead of LMDB (space.py),
        the reserve at most half the map's headroom; appends grow the file to keep it.
        ``open_space``: whether opening allocates it at once: "require" raises
        InsufficientSpace when the filesystem cannot provide it (the daemon's start-up),
        "try" logs that and opens all the same, "skip" (tools, the forwarder process,
        tests reading a running agent's buffer) leaves the file as it is."""
        self.path = path
        self.max_bytes = max_bytes
        headroom = max(int(max_bytes * _HEADROOM_FRACTION), _HEADROOM_MIN)
        self.map_cap = max_bytes + headroom
        self.track = track
        self.track_seconds = track_seconds
        # Tracking lives in the map's headroom, outside max_bytes: cap it by count so that it
        # can never fill the map (which would block even the forwarder's deletes). A quarter
        # of the headroom at ~512 bytes an entry (a long topic name is in each).
        self.max_tracking = max(10_000, (self.map_cap - max_bytes) // 4 // 512)
        self._env = env = Environment(path, map_cap=self.map_cap,
                                      initial_map_bytes=initial_map_bytes, readonly=readonly)
        self.space: Space | None = None
        if not readonly:
            # After lmdb.open: a new environment's file must hold LMDB's meta pages before
            # it is extended (a file of zeros is "not an LMDB file").
            self.space = Space(env.data_file, cap=self.map_cap,
                               reserve=min(reserve_bytes, headroom // 2),
                               preallocate=preallocate)
            try:
                if open_space != "skip":
                    self.space.open_check(env.used_end(), strict=open_space == "require")
            except BaseException:
                self.space.close()
                env.close()
                raise
        self.capacity = Capacity(env, self.space)
        self.counts = TopicCounts(env)
        self.state = StateKeys(env)
        self.topic_generations = Generations(env, self.state)
        self.appender = Appender(env, self.capacity, self.counts)
        self.reader = Reader(env, self.counts)
        self.removal = Removal(env, self.counts)
        if not readonly:
            migrate_layout_1(env)

    def close(self) -> None:
        if self.space is not None:
            self.space.close()
        self._env.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- capacity --------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of LMDB pages holding messages (what ``max_bytes`` limits)."""
        return self.capacity.used_bytes()

    def map_size(self) -> int:
        return self._env.map_size()

    # -- ingest side -----------------------------------------------------------------------
    def append(
        self,
        batches: Sequence[Sequence[Record] | EncodedGroup],
        *,
        states: Sequence[StateChange | None] | None = None,
        state_puts: Mapping[bytes, bytes] | None = None,
        state_deletes: Sequence[bytes] = (),
        enforce_limit: bool = True,
    ) -> list[list[bytes] | BufferFull]:
        """Commit several groups of records in one durable transaction.

        A group is a sequence of records or an ``EncodedGroup``.
        Returns, per group, its message ids, or ``BufferFull`` when that group did not fit:
        groups are all-or-nothing, and a group that does not fit does not stop later, smaller
        ones. ``states[i]`` is state to change together with group ``i`` (e.g. spool progress,
        an idempotency key); it is applied only if the group is stored, in group order.
        ``state_puts``/``state_deletes`` apply only if every group is stored.
        """
        return self.appender.append(
            batches, states=states, state_puts=state_puts, state_deletes=state_deletes,
            max_bytes=self.max_bytes if enforce_limit else None)

    def append_encoded(
        self,
        runs: Sequence[tuple[str, Sequence[bytes], int]],
        *,
        state_puts: Mapping[bytes, bytes] | None = None,
        state_deletes: Sequence[bytes] = (),
        enforce_limit: bool = True,
    ) -> int:
        """Commit pre-encoded messages in one durable transaction, all or nothing; their count.

        The bulk path of spool intake: ``runs`` are ``(topic, values, generation)``, each value
        already encoded by codec.py under ``generation``; a run whose topic has since moved to
        another generation is re-encoded under the current one here, inside the transaction.
        Each topic's messages get their ids in run order, so its FIFO order is the order of
        its runs (ids of different topics in one call are not in run order).
        ``state_puts``/``state_deletes`` are written in the same transaction. Raises
        BufferFull when the messages do not fit (nothing is written), BufferUnavailable
        ("disk_full") when the disk cannot take them, and BufferUnavailable as ``append``
        does.
        """
        group = EncodedGroup([(topic, list(values), generation)
                              for topic, values, generation in runs])
        # One group of one append: a progress-only batch (no messages) is not held back by
        # the disk check, as it needs no room for messages.
        (result,) = self.appender.append(
            [group], state_puts=state_puts, state_deletes=state_deletes,
            max_bytes=self.max_bytes if enforce_limit else None, empty_needs_disk=False)
        if isinstance(result, DiskFull):
            # Raised as the filesystem's refusal, which the spool intake counts by its
            # reason (disk_full) and waits out.
            raise BufferUnavailable(reasons.DISK_FULL, str(result))
        if isinstance(result, BufferFull):
            raise result
        return len(result)

    # -- state (ingest-side bookkeeping) ---------------------------------------------------
    def get_state(self, key: bytes) -> bytes | None:
        return self.state.get(key)

    def state_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return self.state.items(prefix)

    def update_state(
        self, puts: Mapping[bytes, bytes] | None = None, deletes: Iterable[bytes] = ()
    ) -> None:
        self.state.update(puts, deletes)

    def generation(self, topic: str) -> int:
        return self.topic_generations.of(topic)

    def generations(self) -> dict[str, int]:
        return self.topic_generations.all()

    def bump_generation(self, topic: str) -> int:
        """Start a new generation of ``topic``: its buffered messages will not be sent."""
        return self.topic_generations.bump(topic)

    # -- forwarder side --------------------------------------------------------------------
    def topics(self) -> list[str]:
        """Topics that have buffered messages."""
        return self.counts.topics()

    def read(
        self, topic: str, after: bytes | None, limit: int
    ) -> list[StoredMessage | Corrupt]:
        """Up to ``limit`` messages of ``topic`` in FIFO order, after message id ``after``."""
        return messages(topic, self.reader.read_values(topic, after, limit))

    def read_values(
        self, topic: str, after: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        """``read`` without decoding: up to ``limit`` ``(id, encoded value)`` pairs of
        ``topic`` in FIFO order, after message id ``after`` (``message`` decodes one)."""
        return self.reader.read_values(topic, after, limit)

    def remove(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """Durably delete messages that left the buffer; True per message actually removed.

        False means the message was already gone (a second cluster's acknowledgement).
        """
        return self.remove_many(outcomes, ())[0]

    def remove_many(
        self, outcomes: Sequence[Outcome], runs: Sequence[DeliveredRun]
    ) -> tuple[list[bool], list[list[bool]]]:
        """``remove`` for ``outcomes`` and for acknowledged ``runs``, in one transaction.

        Returns the removed flags of the outcomes, and of each run's keys."""
        return self.removal.remove_many(
            outcomes, runs, TrackingSettings(self.track, self.track_seconds, self.max_tracking))

    # -- inspection ------------------------------------------------------------------------
    def topic_stats(self) -> list[TopicStats]:
        return self.counts.stats()

    def locate(self, message_id: bytes) -> dict[str, Any] | None:
        """Where a recent message is: still buffered (and under which topic) or its outcome."""
        return self.reader.locate(message_id)

    def purge(self, topic: str) -> int:
        """Delete every buffered message of ``topic``; returns how many. For operators."""
        removed = 0
        while True:
            batch = self.read(topic, None, 5000)
            if not batch:
                return removed
            outcomes = [Outcome(m.key, stored_size(m), topic, "discarded", reason=reasons.PURGED)
                        for m in batch]
            removed += sum(self.remove(outcomes))

    def sync(self) -> None:
        self._env.sync()

    def reader_check(self) -> int:
        """Free the reader slots of processes that died in a read transaction; how many
        (environment.py says why)."""
        return self._env.reader_check()
