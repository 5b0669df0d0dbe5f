"""The LMDB write-ahead buffer. The only module in Ferry that touches LMDB.

One LMDB environment holds:

- ``records``: ``id`` -> encoded record (see codec.py). Ids only grow, so every message is
  appended at the end of this tree and its pages stay full whatever the topic names.
- ``topic_runs``: ``topic`` -> its runs, as sorted fixed-size duplicates ``last id, first
  id``: every id from first to last that has a record is a message of this topic, so a topic
  is read as a few contiguous stretches of ``records``. A message's handle
  (``StoredMessage.key``) is ``topic NUL id``.
- ``meta``: the id counter, and per-topic message count and bytes, kept exact by updating them
  in the same transaction as the messages.
- ``state``: small ingest-side state that must commit atomically with messages (spool file
  progress, idempotency keys, topic definitions and generations).
- ``tracking``: id -> what became of a recent message (delivered where, or discarded why).

Every write transaction is durable when ``commit`` returns (sync on, no writemap): that is the
moment Ferry may acknowledge. Several processes open the same environment (the ingest process
writes, the forwarder process reads and deletes); LMDB serialises their writers.

Design notes are in docs/buffer.md.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice, repeat
from pathlib import Path
from typing import Any, Literal, cast

import lmdb

from agent.buffer import codec, keys
from agent.buffer.compact import hold_shared
from agent.buffer.space import InsufficientSpace as InsufficientSpace  # the daemon's
from agent.buffer.space import Space, prepare_lock_file
from agent.records import Record

log = logging.getLogger(__name__)

_COUNT = struct.Struct(">qq")  # messages, bytes
_SEQ = struct.Struct(">I")  # the sequence half of a message id (keys.ID)
_LAST_ID = b"last_id"
_ID_LEN = keys.ID_LEN
_MAX_ID = b"\xff" * _ID_LEN
# Layout 1 kept messages under ``topic NUL id`` in one tree (``messages``): a topic that sorts
# before another buffered topic was inserted mid-tree, and LMDB's splits left those pages
# half full (458 bytes per 200-byte message instead of 275). Opening such a buffer moves its
# messages to layout 2 (``records`` + ``topic_runs``) in batches of this many.
_MIGRATE_BATCH = 20_000
# The named databases and their flags (compact.py copies them).
MAX_DBS = 8
DATABASES: dict[bytes, dict[str, Any]] = {
    b"records": {},
    b"topic_runs": {"dupsort": True, "dupfixed": True},
    b"meta": {},
    b"state": {},
    b"tracking": {},
}
_COUNT_PREFIX = b"n:"
_GEN_PREFIX = b"gen:"
# LMDB needs room beyond the messages themselves: the free list, tracking, state, and space
# for the forwarder's deletes to proceed when ingest has been refused for being full.
_HEADROOM_FRACTION = 0.25
_HEADROOM_MIN = 64 * 1024 * 1024
_INITIAL_MAP = 256 * 1024 * 1024
# Per-record overhead estimate (LMDB node header, key) used to decide fullness before writing.
RECORD_OVERHEAD = 48
# Less free space than this on the buffer's filesystem when a write fails means "disk full".
_LOW_DISK_BYTES = 16 * 1024 * 1024
# Allocated space beyond LMDB's last page that new messages never use (space.py): what the
# forwarder's deletes, tracking and state need to drain a buffer whose filesystem is full.
DEFAULT_RESERVE = 32 * 1024 * 1024
# What a commit may take on disk beyond its messages' estimate: the copied path of each tree
# it touches, counts, the id counter, state (pages).
_COMMIT_PAGES = 16


class BufferFull(Exception):
    """Accepting this would take the buffer past ``buffer.max_bytes``."""

    reason = "buffer_full"  # what messages_rejected counts it as


class InvalidGroup(BufferFull):
    """A record of the group cannot be encoded (a source let an out-of-range field through).

    A subclass of BufferFull only so callers that handle refusals keep working; the reason
    counted is ``unencodable`` (agent/reasons.py)."""

    reason = "unencodable"


class DiskFull(BufferFull):
    """The buffer's filesystem is full: storing this would use the reserve kept for deletes
    (space.py). Refused before anything was written; accepted again as the buffer drains
    or the filesystem frees up. A BufferFull so callers that handle refusals keep working."""

    reason = "disk_full"


class BufferUnavailable(Exception):
    """The disk refused the write (ENOSPC, EIO, ...); nothing of the transaction was kept."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class StateChange:
    """Ingest-side state to change in the same transaction as a group of messages."""

    puts: Mapping[bytes, bytes] = field(default_factory=dict)
    deletes: Sequence[bytes] = ()
    # State that depends on the ids the group is given inside the transaction (an
    # idempotency key's answer): called with them, its result is written with the group.
    derive: Callable[[list[bytes]], Mapping[bytes, bytes]] | None = None


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


# Not frozen (one is made per message read on the forwarder's hot path, and a frozen
# dataclass's __init__ costs several times as much); treat instances as immutable all the same.
@dataclass(slots=True, eq=False)
class StoredMessage:
    key: bytes  # the message's handle: topic NUL id (records are stored by id)
    id: bytes
    record: Record
    generation: int
    stored_bytes: int

    @property
    def topic(self) -> str:
        return self.record.topic

    @property
    def accepted_ms(self) -> int:
        return keys.id_timestamp_ms(self.id)


@dataclass(frozen=True, slots=True)
class Corrupt:
    """A stored value that does not decode; reported so the forwarder can discard it."""

    key: bytes
    id: bytes
    topic: str
    raw: bytes
    error: str


@dataclass(slots=True)
class Outcome:
    """What became of a buffered message, written to ``tracking`` when it leaves the buffer."""

    key: bytes
    stored_bytes: int
    topic: str
    state: str  # "delivered" | "discarded"
    cluster: str = ""
    partition: int = -1
    offset: int = -1
    reason: str = ""


@dataclass(slots=True)
class DeliveredRun:
    """Messages of one topic that one cluster acknowledged: the forwarder's common outcome,
    kept as parallel lists (no object per message): message ids (not handles: ``records``
    is keyed by id, so the deletes take them as they are), and ``sizes``, the stored bytes."""

    topic: str
    cluster: str
    ids: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # Shown by locate() (GET /messages/{id}) beside the outcome, e.g. "committed in
    # transaction" for an exactly-once topic's messages.
    note: str = ""


# tracking value: state, partition, offset, at_ms, then "topic NUL cluster NUL reason".
_TRACK = struct.Struct(">Biqq")
_STATES = {"delivered": 1, "discarded": 2}
_STATE_NAMES = {v: k for k, v in _STATES.items()}


def _unpack_outcome(raw: bytes) -> dict[str, Any]:
    state, partition, offset, at_ms = _TRACK.unpack_from(raw)
    topic, cluster, reason = raw[_TRACK.size:].decode().split("\0")
    doc: dict[str, Any] = {"state": _STATE_NAMES.get(state, "unknown"), "topic": topic,
                           "at_ms": at_ms}
    if doc["state"] == "delivered":
        doc.update(cluster=cluster, partition=partition, offset=offset)
        if reason:
            doc["note"] = reason
    else:
        doc["reason"] = reason
    return doc


@dataclass(frozen=True, slots=True)
class TopicStats:
    topic: str
    messages: int
    bytes: int
    oldest_ms: int | None


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
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
            prepare_lock_file(path)
        # Shared while open, so that compaction can never rename the file under us.
        # A read-only opener (a tool without write access to the directory) may not be able
        # to create the lock file; a rename under it only shows it stale data.
        self._usage_fd: int | None = None
        try:
            self._usage_fd = hold_shared(path)
        except OSError:
            if not readonly:
                raise
        existing = path / "data.mdb"
        start = max(initial_map_bytes, existing.stat().st_size if existing.exists() else 0)
        try:
            self._env = lmdb.open(
                str(path),
                map_size=min(start, self.map_cap),
                max_dbs=MAX_DBS,
                sync=True,
                metasync=True,
                writemap=False,
                map_async=False,
                readahead=False,
                readonly=readonly,
                lock=True,
            )
        except lmdb.Error as exc:
            self._release_usage()
            # A new environment's first pages could not be written: say why, clearly.
            refusal = _unavailable(exc, path)
            if refusal.reason == "disk_full" and not readonly:
                raise InsufficientSpace(f"cannot create the buffer: {refusal}") from None
            raise
        # A map another process grew is larger than ours: adopt it.
        self._env.set_mapsize(0)
        # Reader slots of processes that died inside a read transaction (a forwarder killed
        # with SIGKILL) pin old pages: nothing freed since could be reused, and the map would
        # fill. LMDB clears them only when asked.
        self.reader_check()
        # LMDB keeps a node (key + value + 8 bytes) of up to about half a page in the leaf;
        # a bigger value gets whole overflow pages of its own (mdb.c: me_nodemax, OVPAGES).
        self._psize = int(self._env.stat()["psize"])
        self._nodemax = ((self._psize - 16) // 2 & -2) - 2
        dbs = {name: self._env.open_db(name, create=not readonly, **flags)
               for name, flags in DATABASES.items()}
        self._records, self._runs = dbs[b"records"], dbs[b"topic_runs"]
        self._meta, self._state, self._tracking = dbs[b"meta"], dbs[b"state"], dbs[b"tracking"]
        self._main = self._env.open_db(None)
        self._dbs = (self._main, self._records, self._runs, self._meta, self._state,
                     self._tracking)
        self.space: Space | None = None
        if not readonly:
            # After lmdb.open: a new environment's file must hold LMDB's meta pages before
            # it is extended (a file of zeros is "not an LMDB file").
            self.space = Space(existing, cap=self.map_cap,
                               reserve=min(reserve_bytes, headroom // 2),
                               preallocate=preallocate)
            try:
                if open_space != "skip":
                    self.space.open_check(self._used_end(), strict=open_space == "require")
            except BaseException:
                self.space.close()
                self._env.close()
                self._release_usage()
                raise
        # set_mapsize() may only run while this process has no transaction open; every
        # transaction goes through _txn(), which counts them.
        self._gate = threading.Condition()
        self._active = 0
        self._resizing = False
        if not readonly:
            self._migrate_layout_1()

    def _migrate_layout_1(self) -> None:
        """Move the messages of a layout-1 buffer (``messages``: ``topic NUL id``) into
        ``records`` and ``topic_runs``, then drop the old tree. Each batch moves in one
        transaction (put new, delete old), so a crash in between loses and duplicates
        nothing: the next open goes on from where this one stopped."""
        try:
            old = self._env.open_db(b"messages", create=False)
        except lmdb.NotFoundError:
            return
        with self._txn(write=False) as txn:
            total = int(txn.stat(old)["entries"])
        if total:
            log.warning("buffer: moving %d messages to the current layout (once, at the "
                        "first start after an upgrade)", total)
        started = time.monotonic()
        moved = 0

        def body(txn: lmdb.Transaction) -> int:
            with txn.cursor(old) as cur:
                if not cur.first():
                    txn.drop(old, delete=True)
                    return 0
                batch = cast(list[tuple[bytes, bytes]],
                             list(islice(cur.iternext(), _MIGRATE_BATCH)))
                # The old tree is in (topic, id) order: ids that follow each other within a
                # topic were given in one stretch, so no other topic's id lies between them.
                runs: list[list[bytes]] = []
                for k, _ in batch:
                    _extend_runs(runs, k[:-_ID_LEN - 1], k[-_ID_LEN:])
                with txn.cursor(self._records) as rc:
                    rc.putmulti(sorted((k[-_ID_LEN:], v) for k, v in batch))
                with txn.cursor(self._runs) as ic:
                    ic.putmulti([(tb, last + first) for tb, first, last in runs])
                cur.first()
                for _ in batch:
                    cur.delete()
            return len(batch)

        while n := self._write(body):
            moved += n
            if moved % (50 * _MIGRATE_BATCH) == 0:
                log.info("buffer: moved %d of %d messages", moved, total)
        if total:
            log.warning("buffer: moved %d messages in %.1f s", moved,
                        time.monotonic() - started)

    def close(self) -> None:
        if self.space is not None:
            self.space.close()
        self._env.close()
        self._release_usage()

    def _release_usage(self) -> None:
        if self._usage_fd is not None:
            os.close(self._usage_fd)
            self._usage_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------------------------
    @contextmanager
    def _txn(self, write: bool) -> Iterator[lmdb.Transaction]:
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._active += 1
        try:
            for attempt in range(3):
                try:
                    txn = self._env.begin(write=write)
                    break
                except lmdb.MapResizedError:
                    # Another process grew the map; adopt its size and try again. Step out
                    # of the active count meanwhile, or two threads doing this would wait
                    # for each other.
                    if attempt == 2:
                        raise
                    with self._gate:
                        self._active -= 1
                        self._gate.notify_all()
                    self._exclusive(lambda: self._env.set_mapsize(0))
                    with self._gate:
                        while self._resizing:
                            self._gate.wait()
                        self._active += 1
            try:
                yield txn
            except BaseException:
                txn.abort()
                raise
            else:
                txn.commit()
        finally:
            with self._gate:
                self._active -= 1
                self._gate.notify_all()

    def _exclusive(self, action: Any) -> None:
        """Run ``action`` once no other transaction of this process is open."""
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._resizing = True
            try:
                while self._active > 0:
                    self._gate.wait()
                action()
            finally:
                self._resizing = False
                self._gate.notify_all()

    def _write(self, body: Any) -> Any:
        """Run ``body(txn)`` in a durable write transaction, growing the map when it fills."""
        while True:
            try:
                with self._txn(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError:
                current = self._env.info()["map_size"]
                if current >= self.map_cap:
                    if self.reader_check():
                        continue  # a dead process's reader held the free pages: try again
                    raise BufferFull("the buffer's LMDB map is at its maximum size") from None
                new = min(self.map_cap, current * 2)
                self._exclusive(lambda size=new: self._env.set_mapsize(size))
            except lmdb.Error as exc:
                # A dead process's reader slot keeps LMDB from reusing freed pages, so a
                # commit may have needed pages the file does not have: clear and retry.
                if self.reader_check():
                    continue
                raise _unavailable(exc, self.path) from None

    # -- capacity --------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of LMDB pages holding messages (what ``max_bytes`` limits)."""
        with self._txn(write=False) as txn:
            return self._used(txn)

    def _used(self, txn: lmdb.Transaction) -> int:
        pages = 0
        for db in (self._records, self._runs):
            s = txn.stat(db)
            pages += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return int(pages * self._psize)

    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    def _used_end(self) -> int:
        """Where LMDB's last page ends: beyond it, the file is space LMDB has never used.
        (Read from the latest commit; inside a write transaction, before it writes.)"""
        return (int(self._env.info()["last_pgno"]) + 1) * self._psize

    def _disk_room(self, txn: lmdb.Transaction) -> int:
        """Bytes new messages may still take in this write transaction without the
        filesystem and without the reserve: the file's allocated part beyond LMDB's last
        page, less the reserve, plus the pages on LMDB's free list. (The free list is
        estimated as the pages no tree holds; pages freed too recently to be reused yet and
        the free list's own pages are counted too, which the reserve absorbs.)"""
        space = self.space
        if space is None:
            return 1 << 62
        last = int(self._env.info()["last_pgno"]) + 1
        held = 2  # the two meta pages
        for db in self._dbs:
            s = txn.stat(db)
            held += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return (space.allocated - last * self._psize - space.reserve
                + max(last - held, 0) * self._psize)

    def _fit_on_disk(self, txn: lmdb.Transaction, need: int, room: int | None
                     ) -> tuple[int, BufferFull | None]:
        """Whether ``need`` more bytes of messages fit on disk in this transaction, given
        ``room`` (what ``_disk_room`` left after the groups before; None: not asked yet).
        Returns the room left after them and None, or the room and the refusal: DiskFull,
        or BufferFull when the map itself is at its cap. Grows the file if it must."""
        if room is None:
            room = self._disk_room(txn)
        # Pages are not filled to the brim (a split leaves two half-full pages): count
        # twice the bytes, and the pages each commit copies.
        disk = 2 * need + _COMMIT_PAGES * self._psize
        if disk <= room:
            return room - disk, None
        space = self.space
        assert space is not None  # _disk_room is unlimited without it
        taken = self._disk_room(txn) - room  # by earlier groups of this transaction
        if space.ensure(self._used_end() + space.reserve + taken + disk):
            room = self._disk_room(txn) - taken
            if disk <= room:
                return room - disk, None
        if space.allocated >= space.cap:
            return room, BufferFull(f"the buffer's LMDB map is nearly full: {disk} bytes "
                                    f"do not fit in the {max(room, 0)} left beside its "
                                    "reserve")
        return room, DiskFull(f"disk full under {self.path}: {disk} bytes do not fit in the "
                              f"{max(room, 0)} left beside the {space.reserve}-byte reserve")

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

        def body(txn: lmdb.Transaction) -> list[list[bytes] | BufferFull]:
            room = self.max_bytes - self._used(txn) if enforce_limit else 1 << 62
            disk_room: int | None = None if enforce_limit else 1 << 62
            refusal: BufferFull | None
            raw = txn.get(_LAST_ID, db=self._meta)
            last_ts, seq = keys.ID.unpack(raw) if raw else (0, 0)
            ts = max(int(time.time() * 1000), last_ts)
            if ts == last_ts:
                seq += 1
            else:
                seq = 0
            # Per topic: [key prefix, generation, messages added, bytes added, topic bytes,
            # its accepted values in order].
            per_topic: dict[str, list[Any]] = {}
            # Per accepted group: its segments, (topic entry, number of values), in order.
            accepted: list[tuple[int, list[tuple[list[Any], int]]]] = []
            results: list[list[bytes] | BufferFull] = []
            encode = codec.encode
            for gi, group in enumerate(batches):
                segments: list[tuple[list[Any], list[bytes], int]] = []  # (t, values, bytes)
                need = 0
                if isinstance(group, EncodedGroup):
                    for topic, values, encoded_under in group.runs:
                        t = per_topic.get(topic)
                        if t is None:
                            t = per_topic[topic] = self._topic_entry(txn, topic)
                        if encoded_under != t[1]:
                            values = codec.with_generation(values, t[1])
                        n = len(values)
                        size = sum(map(len, values)) + n * (len(t[0]) + _ID_LEN)
                        need += size + n * RECORD_OVERHEAD + self._overflow(values, _ID_LEN)
                        segments.append((t, values, size))
                else:
                    try:
                        for r in group:
                            t = per_topic.get(r.topic)
                            if t is None:
                                t = per_topic[r.topic] = self._topic_entry(txn, r.topic)
                            value = encode(r, t[1])
                            size = len(t[0]) + _ID_LEN + len(value)
                            need += size + RECORD_OVERHEAD
                            if _ID_LEN + len(value) + 8 > self._nodemax:
                                need += self._overflow((value,), _ID_LEN)
                            segments.append((t, [value], size))
                    except (struct.error, UnicodeEncodeError, OverflowError) as exc:
                        results.append(InvalidGroup(f"a record cannot be stored: {exc}"))
                        continue
                if need > room:
                    results.append(BufferFull(
                        f"buffer full: {need} bytes do not fit in the {max(room, 0)} left"))
                    continue
                disk_room, refusal = self._fit_on_disk(txn, need, disk_room)
                if refusal is not None:
                    results.append(refusal)
                    continue
                room -= need
                for t, values, size in segments:
                    t[2] += len(values)
                    t[3] += size
                    t[5] += values
                accepted.append((gi, [(t, len(values)) for t, values, _ in segments]))
                results.append([])  # its ids, below
            # Ids are given a topic at a time, each topic's messages in the order they came:
            # one stretch of ids per topic and transaction, however the groups interleave
            # topics, so a topic reads as one run of ``records`` (ids of different topics
            # are in no particular order, as FIFO order is per topic).
            items: list[tuple[bytes, bytes]] = []  # (id, value), ids increasing
            runs: list[list[bytes]] = []
            given: dict[int, list[bytes]] = {}  # id(topic entry) -> its ids
            for t in per_topic.values():
                n = t[2]
                if not n:
                    continue
                topic_ids, ts, seq = _run_ids(ts, seq, n)
                items += zip(topic_ids, t[5], strict=True)
                runs.append([t[4], topic_ids[0], topic_ids[-1]])
                given[id(t)] = topic_ids
            taken: dict[int, int] = {}
            for gi, group_segments in accepted:
                ids: list[bytes] = []
                for t, n in group_segments:
                    at = taken.get(id(t), 0)
                    ids += given[id(t)][at:at + n]
                    taken[id(t)] = at + n
                results[gi] = ids
                _apply_state(txn, self._state, states[gi] if states is not None else None, ids)
            counts = {topic: [t[2], t[3]] for topic, t in per_topic.items() if t[2]}
            if items:
                self._put_messages(txn, items, runs)
                txn.put(_LAST_ID, keys.ID.pack(ts, max(seq - 1, 0)), db=self._meta)
                self._adjust_counts(txn, counts, +1)
            if (state_puts or state_deletes) and not any(
                    isinstance(r, BufferFull) for r in results):
                for sk, sv in (state_puts or {}).items():
                    txn.put(sk, sv, db=self._state)
                for sk in state_deletes:
                    txn.delete(sk, db=self._state)
            return results

        result: list[list[bytes] | BufferFull] = self._write(body)
        return result

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
        Ids are allocated in the transaction as in ``append``; each topic's messages get
        them in run order, so its FIFO order is the order of its runs (ids of different
        topics in one call are not in run order). Counts are updated once per topic.
        ``state_puts``/``state_deletes`` are written in the same transaction. Raises
        BufferFull when the messages do not fit (nothing is written), and BufferUnavailable
        as ``append`` does.
        """

        # Runs of one topic are stored together, in run order: each topic's FIFO order is the
        # order of its runs, and a file whose records alternate between topics costs one
        # key list and one putmulti per topic rather than per run.
        groups: dict[str, tuple[list[bytes], set[int]]] = {}
        for topic, values, encoded_under in runs:
            group = groups.get(topic)
            if group is None:
                group = groups[topic] = ([], set())
            group[0].extend(values)
            group[1].add(encoded_under)

        def body(txn: lmdb.Transaction) -> int:
            room = self.max_bytes - self._used(txn) if enforce_limit else 1 << 62
            raw = txn.get(_LAST_ID, db=self._meta)
            last_ts, seq = keys.ID.unpack(raw) if raw else (0, 0)
            ts = max(int(time.time() * 1000), last_ts)
            seq = seq + 1 if ts == last_ts else 0
            items: list[tuple[str, list[bytes], list[bytes]]] = []
            counts: dict[str, list[int]] = {}
            need = 0
            for topic, (values, encoded_under) in groups.items():
                n = len(values)
                if not n:
                    continue
                generation = self._generation(txn, topic)
                if encoded_under != {generation}:
                    # Rare (the topic was deleted or recreated since): every value is
                    # rewritten under the current generation, inside this transaction.
                    values = codec.with_generation(values, generation)
                topic_ids, ts, seq = _run_ids(ts, seq, n)
                size = sum(map(len, values)) + n * (len(topic) + 1 + _ID_LEN)
                need += size + n * RECORD_OVERHEAD + self._overflow(values, _ID_LEN)
                counts[topic] = [n, size]
                items.append((topic, topic_ids, values))
            if need > room:
                raise BufferFull(f"buffer full: {need} bytes do not fit in the {max(room, 0)} left")
            if enforce_limit and need:
                _, refusal = self._fit_on_disk(txn, need, None)
                if isinstance(refusal, DiskFull):
                    # Raised as the filesystem's refusal, which the spool intake counts
                    # by its reason (disk_full) and waits out.
                    raise BufferUnavailable("disk_full", str(refusal))
                if refusal is not None:
                    raise refusal
            if items:
                records: list[tuple[bytes, bytes]] = []
                runs: list[list[bytes]] = []
                for topic, topic_ids, values in items:  # ids increase from run to run
                    records += zip(topic_ids, values, strict=True)
                    _extend_runs(runs, topic.encode("ascii"), topic_ids[0], topic_ids[-1])
                self._put_messages(txn, records, runs)
                txn.put(_LAST_ID, keys.ID.pack(ts, max(seq - 1, 0)), db=self._meta)
                self._adjust_counts(txn, counts, +1)
            for sk, sv in (state_puts or {}).items():
                txn.put(sk, sv, db=self._state)
            for sk in state_deletes:
                txn.delete(sk, db=self._state)
            return sum(c[0] for c in counts.values())

        result: int = self._write(body)
        return result

    def _overflow(self, values: Sequence[bytes], key_len: int) -> int:
        """Bytes beyond their length that ``values`` take when LMDB stores them on overflow
        pages (whole pages each): a 2,100-byte value takes 4,096 bytes. Counted into the room
        a group needs, or one commit of big values could overshoot max_bytes nearly 2x."""
        limit = self._nodemax - 8 - key_len
        if not values or max(map(len, values)) <= limit:
            return 0  # the common case, at C speed
        psize = self._psize
        return sum(((15 + len(v)) // psize + 1) * psize - len(v)
                   for v in values if len(v) > limit)

    def _topic_entry(self, txn: lmdb.Transaction, topic: str) -> list[Any]:
        """``append``'s per-topic working entry: [handle prefix, generation, messages added,
        bytes added, topic bytes, accepted values]."""
        return [keys.topic_prefix(topic), self._generation(txn, topic), 0, 0,
                topic.encode("ascii"), []]

    def _put_messages(self, txn: lmdb.Transaction, records: list[tuple[bytes, bytes]],
                      runs: list[list[bytes]]) -> None:
        """Store ``records`` (id, value), ids increasing, and their ``runs`` ([topic, first
        id, last id], from ``_extend_runs``).

        Both are appends: ids are allocated above ``last_id`` in this very transaction, so
        each is past the end of ``records`` and of its topic's runs (LMDB's MDB_APPEND and
        MDB_APPENDDUP: pages filled to the brim, no key comparisons on the way down)."""
        index = [(tb, last + first) for tb, first, last in runs]
        with txn.cursor(self._records) as cur:
            _, added = cur.putmulti(records, append=True)
            if added != len(records):
                # Only if last_id was behind the stored ids (a buffer restored from pieces):
                # store the rest the ordinary way. A real collision aborts the transaction.
                log.warning("buffer ids out of order; storing %d messages without append",
                            len(records) - added)
                _, more = cur.putmulti(records, overwrite=False)
                if added + more != len(records):
                    raise RuntimeError("message ids collide with stored ones")
        with txn.cursor(self._runs) as cur:
            _, added = cur.putmulti(index, append=True)
            if added != len(index):
                _, more = cur.putmulti(index, dupdata=False)
                if added + more != len(index):
                    raise RuntimeError("message ids collide with stored ones")

    def _adjust_counts(
        self, txn: lmdb.Transaction, counts: Mapping[str, list[int]], sign: int
    ) -> None:
        for topic, (n, b) in counts.items():
            ck = _COUNT_PREFIX + topic.encode("ascii")
            raw = txn.get(ck, db=self._meta)
            cn, cb = _COUNT.unpack(raw) if raw else (0, 0)
            cn, cb = cn + sign * n, cb + sign * b
            if cn <= 0:
                txn.delete(ck, db=self._meta)
            else:
                txn.put(ck, _COUNT.pack(cn, cb), db=self._meta)

    # -- state (ingest-side bookkeeping) ---------------------------------------------------
    def get_state(self, key: bytes) -> bytes | None:
        with self._txn(write=False) as txn:
            value = txn.get(key, db=self._state)
            return bytes(value) if value is not None else None

    def state_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        with self._txn(write=False) as txn, txn.cursor(self._state) as cur:
            out = []
            if cur.set_range(prefix):
                for k, v in cur:
                    if not bytes(k).startswith(prefix):
                        break
                    out.append((bytes(k), bytes(v)))
            return out

    def update_state(
        self, puts: Mapping[bytes, bytes] | None = None, deletes: Iterable[bytes] = ()
    ) -> None:
        def body(txn: lmdb.Transaction) -> None:
            for k, v in (puts or {}).items():
                txn.put(k, v, db=self._state)
            for k in deletes:
                txn.delete(k, db=self._state)

        self._write(body)

    def _generation(self, txn: lmdb.Transaction, topic: str) -> int:
        raw = txn.get(_GEN_PREFIX + topic.encode("ascii"), db=self._state)
        return int(raw) if raw else 0

    def generation(self, topic: str) -> int:
        with self._txn(write=False) as txn:
            return self._generation(txn, topic)

    def generations(self) -> dict[str, int]:
        return {k[len(_GEN_PREFIX):].decode("ascii"): int(v)
                for k, v in self.state_items(_GEN_PREFIX)}

    def bump_generation(self, topic: str) -> int:
        """Start a new generation of ``topic``: its buffered messages will not be sent."""

        def body(txn: lmdb.Transaction) -> int:
            gen = self._generation(txn, topic) + 1
            txn.put(_GEN_PREFIX + topic.encode("ascii"), str(gen).encode(), db=self._state)
            return gen

        result: int = self._write(body)
        return result

    # -- forwarder side --------------------------------------------------------------------
    def topics(self) -> list[str]:
        """Topics that have buffered messages."""
        with self._txn(write=False) as txn:
            return self._topic_names(txn)

    def _topic_names(self, txn: lmdb.Transaction) -> list[str]:
        with txn.cursor(self._meta) as cur:
            out = []
            if cur.set_range(_COUNT_PREFIX):
                for k in cur.iternext(keys=True, values=False):
                    if not bytes(k).startswith(_COUNT_PREFIX):
                        break
                    out.append(bytes(k[len(_COUNT_PREFIX):]).decode("ascii"))
            return out

    def read(
        self, topic: str, after: bytes | None, limit: int
    ) -> list[StoredMessage | Corrupt]:
        """Up to ``limit`` messages of ``topic`` in FIFO order, after message id ``after``."""
        return messages(topic, self.read_values(topic, after, limit))

    def read_values(
        self, topic: str, after: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        """``read`` without decoding: up to ``limit`` ``(id, encoded value)`` pairs of
        ``topic`` in FIFO order, after message id ``after``. The forwarder's common path
        decodes the header itself and hands slices straight to the producer, so it makes no
        Record or StoredMessage per message (``message`` decodes one when it needs it)."""
        tb = topic.encode("ascii")
        items: list[tuple[bytes, bytes]] = []
        with (self._txn(write=False) as txn, txn.cursor(self._runs) as runs,
              txn.cursor(self._records) as records):
            # The first run whose last id is past ``after`` (dups are ``last id, first id``).
            if not (runs.set_key(tb) if after is None
                    else runs.set_range_dup(tb, after + _MAX_ID)):
                return []
            start = after + b"\0" if after is not None else b""  # sorts just after it
            while len(items) < limit:
                run = cast(bytes, runs.value())
                last, first = run[:_ID_LEN], run[_ID_LEN:]
                # A run emptied by messages that left out of order (not yet dropped, as it
                # is not at the head) starts past its end: nothing to take from it.
                if (records.set_range(max(first, start))
                        and cast(bytes, records.key()) <= last):
                    # The environment is opened without buffers=True, so keys and values
                    # are bytes. Take what the run can hold in C, then cut where it ends
                    # ((k, v) tuples compare by key): no Python per message.
                    want = min(limit - len(items), _run_span(first, last))
                    got = cast(list[tuple[bytes, bytes]],
                               list(islice(records.iternext(), want)))
                    if got and got[-1][0] > last:
                        del got[bisect_left(got, (last + b"\0",)):]
                    items += got
                if not runs.next_dup():
                    break
        return items

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

        now_ms = int(time.time() * 1000)
        pack = _TRACK.pack
        states = _STATES
        id_len = keys.ID_LEN
        track = self.track
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
                with_tail = struct.Struct(f"{_TRACK.format}{len(tail)}s").pack
                entries = list(zip(run.ids, map(with_tail, repeat(delivered), run.partitions,
                                                run.offsets, repeat(now_ms), repeat(tail)),
                                   strict=True))
            prepared.append((entries, sum(run.sizes)))

        def body(txn: lmdb.Transaction) -> tuple[list[bool], list[list[bool]]]:
            removed: list[bool] = []
            counts: dict[str, list[int]] = {}
            tracked: list[tuple[bytes, bytes]] = []
            # The tail of a tracking value ("topic NUL cluster NUL reason") repeats for nearly
            # every message of a batch: encode each distinct one once.
            tails: dict[tuple[str, str, str], bytes] = {}
            delete = txn.delete
            records = self._records
            for o in outcomes:
                ok = delete(o.key[-id_len:], b"", records)  # positional: once per message
                removed.append(ok)
                if not ok:
                    continue
                c = counts.get(o.topic)
                if c is None:
                    c = counts[o.topic] = [0, 0]
                c[0] += 1
                c[1] += o.stored_bytes
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
                    c = counts[run.topic] = [0, 0]
                if all(ok_list):
                    c[0] += len(ok_list)
                    c[1] += size
                    tracked += entries
                else:
                    sel = [i for i, ok in enumerate(ok_list) if ok]
                    c[0] += len(sel)
                    c[1] += sum(run.sizes[i] for i in sel)
                    if entries:
                        tracked += [entries[i] for i in sel]
            emptied = {t: c for t, c in counts.items() if c[0]}
            self._adjust_counts(txn, emptied, -1)
            self._drop_empty_runs(txn, emptied)
            if tracked:
                with txn.cursor(self._tracking) as cur:
                    cur.putmulti(tracked)
                self._prune_tracking(txn, now_ms, len(tracked))
            return removed, run_removed

        result: tuple[list[bool], list[list[bool]]] = self._write(body)
        return result

    def _drop_empty_runs(self, txn: lmdb.Transaction, topics: Iterable[str]) -> None:
        """Delete the runs at the head of each topic that no longer hold a record. Messages
        leave nearly in order, so this keeps a topic's first run non-empty (what
        ``topic_stats`` reads) at the cost of a lookup or two per topic and call; an empty
        run further on (a message acknowledged early) waits until it reaches the head."""
        with txn.cursor(self._runs) as runs, txn.cursor(self._records) as records:
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

    def _prune_tracking(self, txn: lmdb.Transaction, now_ms: int, added: int) -> None:
        """Forget the oldest tracking entries: those past ``track_seconds``, and any beyond
        ``max_tracking``. Removes at least as many as this transaction added when over the cap,
        so tracking can never outgrow it."""
        # Ids start with their acceptance time, so the oldest entries are at the front.
        cutoff = keys.ID.pack(max(now_ms - self.track_seconds * 1000, 0), 0)
        excess = int(txn.stat(self._tracking)["entries"]) - self.max_tracking
        limit = max(2000, 2 * added)
        with txn.cursor(self._tracking) as cur:
            n = 0
            if not cur.first():
                return
            # delete() moves on to the next entry: one call per entry forgotten. Past the
            # last one the cursor is unpositioned and delete() says False.
            while n < limit and (n < excess or cast(bytes, cur.key()) < cutoff):
                if not cur.delete():
                    break
                n += 1

    # -- inspection ------------------------------------------------------------------------
    def topic_stats(self) -> list[TopicStats]:
        out = []
        with self._txn(write=False) as txn:
            with txn.cursor(self._meta) as meta:
                counts = []
                if meta.set_range(_COUNT_PREFIX):
                    for k, v in meta:
                        if not bytes(k).startswith(_COUNT_PREFIX):
                            break
                        n, b = _COUNT.unpack(v)
                        counts.append((bytes(k[len(_COUNT_PREFIX):]).decode("ascii"), n, b))
            for topic, n, b in counts:
                first = self._first_id(txn, topic)
                out.append(TopicStats(topic, n, b,
                                      keys.id_timestamp_ms(first) if first else None))
        return out

    def _first_id(self, txn: lmdb.Transaction, topic: str) -> bytes | None:
        """The oldest buffered id of ``topic``: the first record of its first non-empty run."""
        tb = topic.encode("ascii")
        with txn.cursor(self._runs) as runs, txn.cursor(self._records) as records:
            if not runs.set_key(tb):
                return None
            while True:
                run = cast(bytes, runs.value())
                if (records.set_range(run[_ID_LEN:])
                        and cast(bytes, records.key()) <= run[:_ID_LEN]):
                    return cast(bytes, records.key())
                if not runs.next_dup():
                    return None

    def locate(self, message_id: bytes) -> dict[str, Any] | None:
        """Where a recent message is: still buffered (and under which topic) or its outcome."""
        with self._txn(write=False) as txn:
            raw = txn.get(message_id, db=self._tracking)
            if raw is not None:
                return _unpack_outcome(bytes(raw))
            if len(message_id) != _ID_LEN or txn.get(message_id, db=self._records) is None:
                return None
            with txn.cursor(self._runs) as runs:
                for topic in self._topic_names(txn):
                    # The topic's first run whose last id is at or past the message's.
                    if (runs.set_range_dup(topic.encode("ascii"), message_id + bytes(_ID_LEN))
                            and cast(bytes, runs.value())[_ID_LEN:] <= message_id):
                        return {"state": "buffered", "topic": topic}
        return None

    def purge(self, topic: str) -> int:
        """Delete every buffered message of ``topic``; returns how many. For operators."""
        removed = 0
        while True:
            batch = self.read(topic, None, 5000)
            if not batch:
                return removed
            outcomes = [Outcome(m.key, _stored(m), topic, "discarded", reason="purged")
                        for m in batch]
            removed += sum(self.remove(outcomes))

    def sync(self) -> None:
        self._env.sync(True)

    def reader_check(self) -> int:
        """Free the reader slots of processes that died in a read transaction; how many.

        Their snapshots keep every page freed since from being reused. Called when the
        environment opens, when the map is full, and by the daemon after the forwarder
        process died."""
        try:
            return int(self._env.reader_check())
        except lmdb.Error as exc:
            log.warning("could not check the buffer's reader slots: %s", exc)
            return 0


def messages(topic: str,
             items: Sequence[tuple[bytes, bytes]]) -> list[StoredMessage | Corrupt]:
    """``(id, value)`` pairs of ``Store.read_values`` decoded, as ``Store.read`` returns them."""
    prefix = keys.topic_prefix(topic)
    # codec.decode's common case (no headers) inlined: this runs once per message on the
    # exactly-once and fallback paths. Anything else, a corrupt value included, goes through decode.
    unpack = codec.HEADER.unpack_from
    hsize = codec.HEADER.size
    version_now = codec.VERSION
    out: list[StoredMessage | Corrupt] = []
    append = out.append
    for mid, v in items:
        k = prefix + mid
        try:
            version, flags, gen, ts, pk, klen, nheaders = unpack(v)
        except struct.error:  # shorter than a header: decode says why
            version = klen = nheaders = -1
        pos = hsize + klen
        if version == version_now and not nheaders and pos <= len(v):
            record = Record(topic, v[pos:], v[hsize:pos] if flags & codec.HAS_KEY else None,
                            pk if flags & codec.HAS_PARTITION_KEY else None, ts, (),
                            bool(flags & codec.HASH_KEY))
        else:
            try:
                record, gen = codec.decode(topic, v)
            except codec.CorruptRecord as exc:
                append(Corrupt(k, mid, topic, v, str(exc)))
                continue
        append(StoredMessage(k, mid, record, gen, len(k) + len(v)))
    return out


def message(topic: str, message_id: bytes, value: bytes) -> StoredMessage | Corrupt:
    """One ``(id, value)`` pair of ``Store.read_values`` as ``read`` returns it."""
    k = keys.topic_prefix(topic) + message_id
    try:
        record, gen = codec.decode(topic, value)
    except codec.CorruptRecord as exc:
        return Corrupt(k, message_id, topic, value, str(exc))
    return StoredMessage(k, message_id, record, gen, len(k) + len(value))


def _follows(prev: bytes, nxt: bytes) -> bool:
    """Whether id ``nxt`` is the very next id after ``prev`` (no id can lie between)."""
    ts, seq = keys.ID.unpack(prev)
    return nxt == (keys.ID.pack(ts, seq + 1) if seq < 0xFFFFFFFF else keys.ID.pack(ts + 1, 0))


def _extend_runs(runs: list[list[bytes]], tb: bytes, first: bytes,
                 last: bytes | None = None) -> None:
    """Add ids ``first`` to ``last`` (given one after another to topic ``tb``) to ``runs``
    ([topic, first id, last id], in id order): the last run grows when they follow it
    directly in the same topic, as a stretch of one topic's ids has nothing else inside."""
    if runs:
        run = runs[-1]
        if run[0] == tb and _follows(run[2], first):
            run[2] = last or first
            return
    runs.append([tb, first, last or first])


def _run_span(first: bytes, last: bytes) -> int:
    """How many ids ``first`` to ``last`` take at most (ids are (ms, sequence) pairs)."""
    ts1, seq1 = keys.ID.unpack(first)
    ts2, seq2 = keys.ID.unpack(last)
    span: int = (ts2 - ts1) * 0x100000000 + seq2 - seq1 + 1  # a wrapped sequence too
    return span


def _run_ids(ts: int, seq: int, n: int) -> tuple[list[bytes], int, int]:
    """Ids for ``n`` consecutive messages from ``(ts, seq)`` on, and the ``(ts, seq)`` after
    them: ``append``'s id rule, a run at a time."""
    if seq + n - 1 > 0xFFFFFFFF:
        # The sequence would wrap within the run: ids one by one, as in append.
        out = []
        for _ in range(n):
            if seq > 0xFFFFFFFF:
                ts, seq = ts + 1, 0
            out.append(keys.ID.pack(ts, seq))
            seq += 1
        return out, ts, seq
    base = ts.to_bytes(8, "big")
    pack_seq = _SEQ.pack
    return [base + pack_seq(i) for i in range(seq, seq + n)], ts, seq + n


def _apply_state(
    txn: lmdb.Transaction, db: Any, change: StateChange | None, ids: list[bytes]
) -> None:
    """Write a stored group's state change (``ids``: the ids the group was given)."""
    if change is None:
        return
    for sk, sv in change.puts.items():
        txn.put(sk, sv, db=db)
    for sk in change.deletes:
        txn.delete(sk, db=db)
    if change.derive is not None:
        for sk, sv in change.derive(ids).items():
            txn.put(sk, sv, db=db)


def _stored(m: StoredMessage | Corrupt) -> int:
    if isinstance(m, Corrupt):
        return len(m.key) + len(m.raw)
    return m.stored_bytes


def _unavailable(exc: lmdb.Error, path: Path | None = None) -> BufferUnavailable:
    """Name a failed write. LMDB reports a short write on a full disk as EIO, so ask the
    filesystem how much room is left rather than trusting the error code alone."""
    text = str(exc)
    code = getattr(exc, "errno", None)
    full = code == errno.ENOSPC or "No space left" in text
    if not full and path is not None:
        try:
            st = os.statvfs(path)
            low = max(1 << 20, min(_LOW_DISK_BYTES, st.f_blocks * st.f_frsize // 50))
            full = st.f_bavail * st.f_frsize < low
        except OSError:
            pass
    if full:
        return BufferUnavailable("disk_full", f"disk full under {path}: {text}")
    return BufferUnavailable("disk_error", f"buffer write failed: {text}")
