"""The append path: groups of messages into the buffer in one durable transaction.

Every message that enters the buffer goes through ``Appender.append``: records from the
committer (HTTP, spool files read line by line), values the datagram socket encoded on its
own thread (``EncodedGroup``), and the spool intake's bulk batches (``Store.append_encoded``).
Within a transaction each group is all or nothing: it is measured against the room left
(``max_bytes``, then the disk: capacity.py) before anything is written, and a group that does
not fit is refused without stopping later, smaller ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import lmdb

from agent.buffer import codec, keys
from agent.buffer.capacity import RECORD_OVERHEAD, Capacity
from agent.buffer.environment import Environment
from agent.buffer.generations import generation_in
from agent.buffer.ids import IdCounter
from agent.buffer.refusals import BufferFull, InvalidGroup
from agent.buffer.state import StateChange, apply_change, write_state
from agent.buffer.topic_counts import CountChange, TopicCounts
from agent.records import Record

log = logging.getLogger(__name__)

_ID_LEN = keys.ID_LEN
_UNLIMITED = 1 << 62


@dataclass(slots=True)
class EncodedGroup:
    """An all-or-nothing group of messages already encoded by codec.py, for ``append``.

    ``runs`` are ``(topic, values, generation)``: each value encoded under ``generation``
    (re-encoded in the transaction if the topic has moved on). The socket's path: values are
    built on the receiving thread, so the writer thread makes no Record or value per message.
    """

    runs: list[tuple[str, list[bytes], int]]

    def __len__(self) -> int:
        return sum(len(values) for _, values, _ in self.runs)


@dataclass(slots=True, eq=False)
class _TopicEntry:
    """One topic's share of an append transaction: what its accepted groups add."""

    topic_bytes: bytes
    handle_len: int  # of ``topic NUL``: a message's stored bytes count its handle
    generation: int  # what its values must be encoded under
    added: int = 0  # messages
    added_bytes: int = 0
    values: list[bytes] = field(default_factory=list)  # accepted, in the order they came
    ids: list[bytes] = field(default_factory=list)  # given to ``values``, once allocated
    handed_out: int = 0  # how many of ``ids`` the accepted groups have taken so far


@dataclass(slots=True, eq=False)
class _Segment:
    """Consecutive messages of one group in one topic, before the group is accepted."""

    entry: _TopicEntry
    values: list[bytes]
    size: int  # their stored bytes (handles and values)


class Appender:
    def __init__(self, env: Environment, capacity: Capacity, counts: TopicCounts) -> None:
        self._env = env
        self._capacity = capacity
        self._counts = counts

    def append(
        self,
        groups: Sequence[Sequence[Record] | EncodedGroup],
        *,
        states: Sequence[StateChange | None] | None = None,
        state_puts: Mapping[bytes, bytes] | None = None,
        state_deletes: Sequence[bytes] = (),
        max_bytes: int | None,
        empty_needs_disk: bool = True,
    ) -> list[list[bytes] | BufferFull]:
        """Store ``groups`` in one durable transaction; per group its ids, or its refusal.

        ``max_bytes``: the limit the groups must fit under, None for no limit and no disk
        check. ``states[i]`` is written with group ``i`` if it is stored; ``state_puts`` and
        ``state_deletes`` only if every group is. ``empty_needs_disk=False`` lets a group of
        no messages past the disk check (the spool intake's progress-only commits).
        """
        env, capacity = self._env, self._capacity

        def body(txn: lmdb.Transaction) -> list[list[bytes] | BufferFull]:
            room = max_bytes - capacity.used(txn) if max_bytes is not None else _UNLIMITED
            disk_room: int | None = None if max_bytes is not None else _UNLIMITED
            per_topic: dict[str, _TopicEntry] = {}
            # Per accepted group: its index and segments.
            accepted: list[tuple[int, list[_Segment]]] = []
            results: list[list[bytes] | BufferFull] = []
            # Read before the groups are measured: their ids carry the time they came in.
            counter = IdCounter(txn, env.meta)
            for gi, group in enumerate(groups):
                if isinstance(group, EncodedGroup):
                    segments, need = self._measure_encoded(txn, group, per_topic)
                else:
                    try:
                        segments, need = self._measure_records(txn, group, per_topic)
                    except codec.UNENCODABLE as exc:
                        results.append(InvalidGroup(f"a record cannot be stored: {exc}"))
                        continue
                if need > room:
                    results.append(BufferFull(
                        f"buffer full: {need} bytes do not fit in the {max(room, 0)} left"))
                    continue
                if need or empty_needs_disk:
                    disk_room, refusal = capacity.fit_on_disk(txn, need, disk_room)
                    if refusal is not None:
                        results.append(refusal)
                        continue
                room -= need
                for seg in segments:
                    entry = seg.entry
                    entry.added += len(seg.values)
                    entry.added_bytes += seg.size
                    entry.values += seg.values
                accepted.append((gi, segments))
                results.append([])  # its ids, below
            given = self._give_ids(txn, counter, per_topic)
            for gi, group_segments in accepted:
                ids: list[bytes] = []
                for seg in group_segments:
                    entry = seg.entry
                    at = entry.handed_out
                    entry.handed_out = end = at + len(seg.values)
                    ids += entry.ids[at:end]
                results[gi] = ids
                if states is not None and (change := states[gi]) is not None:
                    apply_change(txn, env.state, change, ids)
            if given:
                counter.save(txn, env.meta)
                self._counts.adjust(txn, {topic: CountChange(e.added, e.added_bytes)
                                          for topic, e in per_topic.items() if e.added}, +1)
            if (state_puts or state_deletes) and not any(
                    isinstance(r, BufferFull) for r in results):
                write_state(txn, env.state, state_puts, state_deletes)
            return results

        return env.write(body)

    def _measure_encoded(self, txn: lmdb.Transaction, group: EncodedGroup,
                         per_topic: dict[str, _TopicEntry]) -> tuple[list[_Segment], int]:
        """An encoded group's values under their topics' current generations, a segment per
        run, and the bytes it needs (messages, LMDB's per-record overhead, overflow pages)."""
        segments: list[_Segment] = []
        need = 0
        overflow = self._capacity.overflow
        for topic, values, encoded_under in group.runs:
            entry = per_topic.get(topic)
            if entry is None:
                entry = per_topic[topic] = self._entry(txn, topic)
            if encoded_under != entry.generation:
                # Rare (the topic was deleted or recreated since): rewritten under the
                # current generation, inside this transaction.
                values = codec.with_generation(values, entry.generation)
            n = len(values)
            size = sum(map(len, values)) + n * (entry.handle_len + _ID_LEN)
            need += size + n * RECORD_OVERHEAD + overflow(values, _ID_LEN)
            segments.append(_Segment(entry, values, size))
        return segments, need

    def _measure_records(self, txn: lmdb.Transaction, group: Sequence[Record],
                         per_topic: dict[str, _TopicEntry]) -> tuple[list[_Segment], int]:
        """``_measure_encoded`` for records: each encoded here. Raises what encoding a bad
        record raises (the group is then refused as unencodable)."""
        segments: list[_Segment] = []
        need = 0
        overflow = self._capacity.overflow
        encode = codec.encode
        nodemax = self._env.nodemax
        seg: _Segment | None = None
        for r in group:
            entry = per_topic.get(r.topic)
            if entry is None:
                entry = per_topic[r.topic] = self._entry(txn, r.topic)
            value = encode(r, entry.generation)
            size = entry.handle_len + _ID_LEN + len(value)
            need += size + RECORD_OVERHEAD
            if _ID_LEN + len(value) + 8 > nodemax:
                need += overflow((value,), _ID_LEN)
            # Records of one topic in a row share a segment; a change of topic starts one,
            # so the group's ids come back in the order of its records.
            if seg is not None and seg.entry is entry:
                seg.values.append(value)
                seg.size += size
            else:
                seg = _Segment(entry, [value], size)
                segments.append(seg)
        return segments, need

    def _entry(self, txn: lmdb.Transaction, topic: str) -> _TopicEntry:
        tb = topic.encode("ascii")
        return _TopicEntry(tb, len(tb) + 1, generation_in(txn, self._env.state, topic))

    def _give_ids(self, txn: lmdb.Transaction, counter: IdCounter,
                  per_topic: Mapping[str, _TopicEntry]) -> bool:
        """Give the accepted messages their ids and store them; whether there were any.

        Ids are given a topic at a time, each topic's messages in the order they came: one
        stretch of ids per topic and transaction, however the groups interleave topics, so a
        topic reads as one run of ``records`` (ids of different topics are in no particular
        order, as FIFO order is per topic)."""
        items: list[tuple[bytes, bytes]] = []  # (id, value), ids increasing
        runs: list[tuple[bytes, bytes]] = []  # (topic, last id + first id)
        for entry in per_topic.values():
            if not entry.added:
                continue
            entry.ids = counter.take(entry.added)
            items += zip(entry.ids, entry.values, strict=True)
            runs.append((entry.topic_bytes, entry.ids[-1] + entry.ids[0]))
        if items:
            self._put(txn, items, runs)
        return bool(items)

    def _put(self, txn: lmdb.Transaction, records: list[tuple[bytes, bytes]],
             index: list[tuple[bytes, bytes]]) -> None:
        """Store ``records`` (id, value), ids increasing, and their runs' ``index`` entries.

        Both are appends: ids are given above ``last_id`` in this very transaction, so each
        is past the end of ``records`` and of its topic's runs (LMDB's MDB_APPEND and
        MDB_APPENDDUP: pages filled to the brim, no key comparisons on the way down)."""
        with txn.cursor(self._env.records) as cur:
            _, added = cur.putmulti(records, append=True)
            if added != len(records):
                # Only if last_id was behind the stored ids (a buffer restored from pieces):
                # store the rest the ordinary way. A real collision aborts the transaction.
                log.warning("buffer ids out of order; storing %d messages without append",
                            len(records) - added)
                _, more = cur.putmulti(records, overwrite=False)
                if added + more != len(records):
                    raise RuntimeError("message ids collide with stored ones")
        with txn.cursor(self._env.runs) as cur:
            _, added = cur.putmulti(index, append=True)
            if added != len(index):
                _, more = cur.putmulti(index, dupdata=False)
                if added + more != len(index):
                    raise RuntimeError("message ids collide with stored ones")
