"""Taking messages out of the buffer once they are delivered or discarded: the deletes, the
counts, the runs index's head, and the tracking entries that say what became of them, all
in one durable transaction."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import cast

import lmdb

from agent.buffer import clock, keys, tracking
from agent.buffer.environment import Environment
from agent.buffer.topic_counts import CountChange, TopicCounts
from agent.buffer.tracking import DeliveredRun, Outcome

_ID_LEN = keys.ID_LEN


@dataclass(slots=True)
class TrackingSettings:
    """Whether and how long outcomes are kept (read at each removal: tools change them)."""

    enabled: bool
    seconds: int
    max_entries: int


class Removal:
    def __init__(self, env: Environment, counts: TopicCounts) -> None:
        self._env = env
        self._counts = counts

    def remove_many(
        self, outcomes: Sequence[Outcome], runs: Sequence[DeliveredRun],
        settings: TrackingSettings,
    ) -> tuple[list[bool], list[list[bool]]]:
        """Delete ``outcomes``' messages and acknowledged ``runs`` in one transaction.

        Returns the removed flags of the outcomes, and of each run's keys (False: the
        message was already gone, e.g. a second cluster's acknowledgement)."""
        now_ms = clock.now_ms()
        pack = tracking.TRACK.pack
        states = tracking.STATES
        id_len = _ID_LEN
        track = settings.enabled
        delivered = states["delivered"]
        # The runs' tracking entries and sizes are made before the transaction, as if every
        # key were still there (the common case): the writer lock, which the ingest process's
        # commits wait for, is then held for the deletes and puts alone.
        # Built with map() and zip() over the run's columns: no Python code per message.
        prepared: list[tuple[list[tuple[bytes, bytes]], int]] = []
        for run in runs:
            entries: list[tuple[bytes, bytes]] = []
            if track:
                tail = f"{run.topic}\0{run.cluster}\0{run.note}".encode()
                if not len(run.ids) == len(run.partitions) == len(run.offsets):
                    raise ValueError(f"a delivered run of {run.topic} has columns of "
                                     "different lengths")
                # The tracking value with the tail in one pack: no join per message.
                with_tail = struct.Struct(f"{tracking.TRACK.format}{len(tail)}s").pack
                entries = list(zip(run.ids, map(with_tail, repeat(delivered), run.partitions,
                                                run.offsets, repeat(now_ms), repeat(tail)),
                                   strict=True))
            prepared.append((entries, sum(run.sizes)))
        env = self._env

        def body(txn: lmdb.Transaction) -> tuple[list[bool], list[list[bool]]]:
            removed: list[bool] = []
            counts: dict[str, CountChange] = {}
            tracked: list[tuple[bytes, bytes]] = []
            # The tail of a tracking value ("topic NUL cluster NUL reason") repeats for nearly
            # every message of a batch: encode each distinct one once.
            tails: dict[tuple[str, str, str], bytes] = {}
            delete = txn.delete
            records = env.records
            for o in outcomes:
                ok = delete(o.key[-id_len:], b"", records)  # positional: once per message
                removed.append(ok)
                if not ok:
                    continue
                c = counts.get(o.topic)
                if c is None:
                    c = counts[o.topic] = CountChange()
                c.messages += 1
                c.bytes += o.stored_bytes
                if track:
                    tk = (o.topic, o.cluster, o.reason)
                    tail = tails.get(tk)
                    if tail is None:
                        tail = tails[tk] = f"{o.topic}\0{o.cluster}\0{o.reason}".encode()
                    tracked.append((o.key[-id_len:],
                                    pack(states[o.state], o.partition, o.offset, now_ms) + tail))
            run_removed: list[list[bool]] = []
            for run, (entries, size) in zip(runs, prepared, strict=True):
                # map(): this is the per-message hot path (positional: b"" is any value).
                ok_list = list(map(delete, run.ids, repeat(b""), repeat(records)))
                run_removed.append(ok_list)
                c = counts.get(run.topic)
                if c is None:
                    c = counts[run.topic] = CountChange()
                if all(ok_list):
                    c.messages += len(ok_list)
                    c.bytes += size
                    tracked += entries
                else:
                    sel = [i for i, ok in enumerate(ok_list) if ok]
                    c.messages += len(sel)
                    c.bytes += sum(run.sizes[i] for i in sel)
                    if entries:
                        tracked += [entries[i] for i in sel]
            emptied = {t: c for t, c in counts.items() if c.messages}
            self._counts.adjust(txn, emptied, -1)
            self._drop_empty_runs(txn, emptied)
            if tracked:
                with txn.cursor(env.tracking) as cur:
                    cur.putmulti(tracked)
                tracking.prune(txn, env.tracking, now_ms=now_ms, track_seconds=settings.seconds,
                               max_entries=settings.max_entries, added=len(tracked))
            return removed, run_removed

        return env.write(body)

    def _drop_empty_runs(self, txn: lmdb.Transaction, topics: Iterable[str]) -> None:
        """Delete the runs at the head of each topic that no longer hold a record. Messages
        leave nearly in order, so this keeps a topic's first run non-empty (what
        ``topic_stats`` reads) at the cost of a lookup or two per topic and call; an empty
        run further on (a message acknowledged early) waits until it reaches the head."""
        with txn.cursor(self._env.runs) as runs, txn.cursor(self._env.records) as records:
            for topic in topics:
                tb = topic.encode("ascii")
                if not runs.set_key(tb):
                    continue
                while True:
                    run = cast(bytes, runs.value())
                    if (records.set_range(run[_ID_LEN:])
                            and cast(bytes, records.key()) <= run[:_ID_LEN]):
                        break  # it still holds a message
                    # Deleting moves to the next duplicate, or on to the next topic.
                    if not runs.delete() or runs.key() != tb:
                        break
