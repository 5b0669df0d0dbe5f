"""The LMDB write-ahead buffer. The only module in Ferry that touches LMDB.

One LMDB environment holds:

- ``messages``: ``topic NUL id`` -> encoded record (see codec.py). FIFO per topic.
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
from itertools import islice
from pathlib import Path
from typing import Any, Literal, cast

import lmdb

from agent.buffer import codec, keys
from agent.buffer.space import InsufficientSpace as InsufficientSpace  # the daemon's
from agent.buffer.space import Space, prepare_lock_file
from agent.records import Record

log = logging.getLogger(__name__)

_COUNT = struct.Struct(">qq")  # messages, bytes
_SEQ = struct.Struct(">I")  # the sequence half of a message id (keys.ID)
_LAST_ID = b"last_id"
_AFTER_SEP = bytes([keys.SEP[0] + 1])  # topic + this sorts after every key of the topic
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
    counted is ``invalid``."""

    reason = "invalid"


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
    key: bytes  # LMDB key: topic NUL id
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
    kept as parallel lists (no object per message). ``sizes`` are the stored bytes."""

    topic: str
    cluster: str
    keys: list[bytes] = field(default_factory=list)
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
        existing = path / "data.mdb"
        start = max(initial_map_bytes, existing.stat().st_size if existing.exists() else 0)
        try:
            self._env = lmdb.open(
                str(path),
                map_size=min(start, self.map_cap),
                max_dbs=8,
                sync=True,
                metasync=True,
                writemap=False,
                map_async=False,
                readahead=False,
                readonly=readonly,
                lock=True,
            )
        except lmdb.Error as exc:
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
        self._messages = self._env.open_db(b"messages", create=not readonly)
        self._meta = self._env.open_db(b"meta", create=not readonly)
        self._state = self._env.open_db(b"state", create=not readonly)
        self._tracking = self._env.open_db(b"tracking", create=not readonly)
        self._main = self._env.open_db(None)
        self._dbs = (self._main, self._messages, self._meta, self._state, self._tracking)
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
                raise
        # set_mapsize() may only run while this process has no transaction open; every
        # transaction goes through _txn(), which counts them.
        self._gate = threading.Condition()
        self._active = 0
        self._resizing = False

    def close(self) -> None:
        if self.space is not None:
            self.space.close()
        self._env.close()

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
        s = txn.stat(self._messages)
        return int((s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]) * s["psize"])

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
            # Per topic: [key prefix, generation, messages added, bytes added].
            per_topic: dict[str, list[Any]] = {}
            items: list[tuple[bytes, bytes]] = []
            results: list[list[bytes] | BufferFull] = []
            pack_id = keys.ID.pack
            encode = codec.encode
            for gi, group in enumerate(batches):
                ids: list[bytes] = []
                encoded: list[tuple[bytes, bytes]] = []
                need = 0
                if isinstance(group, EncodedGroup):
                    # Ids and keys by list comprehension, a run at a time; counted per run.
                    added: list[tuple[list[Any], int, int]] = []
                    for topic, values, encoded_under in group.runs:
                        t = per_topic.get(topic)
                        if t is None:
                            t = per_topic[topic] = [keys.topic_prefix(topic),
                                                    self._generation(txn, topic), 0, 0]
                        if encoded_under != t[1]:
                            values = codec.with_generation(values, t[1])
                        n = len(values)
                        prefix = t[0]
                        run_keys, ts, seq = _run_keys(prefix, ts, seq, n)
                        size = sum(map(len, values)) + n * (len(prefix) + keys.ID_LEN)
                        need += size + n * RECORD_OVERHEAD + self._overflow(
                            values, len(prefix) + keys.ID_LEN)
                        plen = len(prefix)
                        ids += [k[plen:] for k in run_keys]
                        encoded += zip(run_keys, values, strict=True)
                        added.append((t, n, size))
                    if need > room:
                        results.append(BufferFull(
                            f"buffer full: {need} bytes do not fit in the {max(room, 0)} left"))
                        continue
                    disk_room, refusal = self._fit_on_disk(txn, need, disk_room)
                    if refusal is not None:
                        results.append(refusal)
                        continue
                    room -= need
                    for t, n, size in added:
                        t[2] += n
                        t[3] += size
                    items += encoded
                    results.append(ids)
                    _apply_state(txn, self._state, states[gi] if states is not None else None,
                                 ids)
                    continue
                try:
                    for r in group:
                        t = per_topic.get(r.topic)
                        if t is None:
                            t = per_topic[r.topic] = [keys.topic_prefix(r.topic),
                                                      self._generation(txn, r.topic), 0, 0]
                        if seq > 0xFFFFFFFF:
                            ts, seq = ts + 1, 0
                        mid = pack_id(ts, seq)
                        seq += 1
                        k = t[0] + mid
                        value = encode(r, t[1])
                        encoded.append((k, value))
                        ids.append(mid)
                        need += len(k) + len(value) + RECORD_OVERHEAD
                        if len(k) + len(value) + 8 > self._nodemax:
                            need += self._overflow((value,), len(k))
                except (struct.error, UnicodeEncodeError, OverflowError) as exc:
                    results.append(InvalidGroup(f"a record cannot be stored: {exc}"))
                    continue
                if need > room:
                    # The ids allocated for this group are simply never used.
                    results.append(BufferFull(
                        f"buffer full: {need} bytes do not fit in the {max(room, 0)} left"))
                    continue
                disk_room, refusal = self._fit_on_disk(txn, need, disk_room)
                if refusal is not None:
                    results.append(refusal)
                    continue
                room -= need
                for (k, value), r in zip(encoded, group, strict=True):
                    t = per_topic[r.topic]
                    t[2] += 1
                    t[3] += len(k) + len(value)
                items += encoded
                results.append(ids)
                _apply_state(txn, self._state, states[gi] if states is not None else None, ids)
            counts = {topic: [t[2], t[3]] for topic, t in per_topic.items() if t[2]}
            if items:
                with txn.cursor(self._messages) as cur:
                    cur.putmulti(items)
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
            items: list[tuple[list[bytes], list[bytes]]] = []
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
                prefix = keys.topic_prefix(topic)
                topic_keys, ts, seq = _run_keys(prefix, ts, seq, n)
                size = sum(map(len, values)) + n * (len(prefix) + keys.ID_LEN)
                need += size + n * RECORD_OVERHEAD + self._overflow(
                    values, len(prefix) + keys.ID_LEN)
                counts[topic] = [n, size]
                items.append((topic_keys, values))
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
                with txn.cursor(self._messages) as cur:
                    for topic_keys, values in items:
                        cur.putmulti(zip(topic_keys, values, strict=True))
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
        prefix = keys.topic_prefix(topic)
        start = prefix + after if after is not None else prefix
        with self._txn(write=False) as txn, txn.cursor(self._messages) as cur:
            if not cur.set_range(start):
                return []
            if after is not None and cur.key() == start and not cur.next():
                return []
            # The environment is opened without buffers=True, so keys and values are bytes.
            # Take ``limit`` items in C, then cut where the next topic starts (keys sort by
            # topic, and (k, v) tuples compare by key): no Python test per message.
            items = cast(list[tuple[bytes, bytes]], list(islice(cur.iternext(), limit)))
        if items and not items[-1][0].startswith(prefix):
            del items[bisect_left(items, (prefix[:-1] + _AFTER_SEP,)):]
        plen = len(prefix)
        # codec.decode's common case (no headers) inlined: this runs once per message on the
        # forwarder's hot path. Anything else, a corrupt value included, goes through decode.
        unpack = codec.HEADER.unpack_from
        hsize = codec.HEADER.size
        version_now = codec.VERSION
        out: list[StoredMessage | Corrupt] = []
        append = out.append
        for k, v in items:
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
                    append(Corrupt(k, k[plen:], topic, v, str(exc)))
                    continue
            append(StoredMessage(k, k[plen:], record, gen, len(k) + len(v)))
        return out

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
        prepared: list[tuple[list[tuple[bytes, bytes]], int]] = []
        for run in runs:
            entries: list[tuple[bytes, bytes]] = []
            if track:
                tail = f"{run.topic}\0{run.cluster}\0{run.note}".encode()
                entries = [(k[-id_len:], pack(delivered, p, o, now_ms) + tail)
                           for k, p, o in zip(run.keys, run.partitions, run.offsets,
                                              strict=True)]
            prepared.append((entries, sum(run.sizes)))

        def body(txn: lmdb.Transaction) -> tuple[list[bool], list[list[bool]]]:
            removed: list[bool] = []
            counts: dict[str, list[int]] = {}
            tracked: list[tuple[bytes, bytes]] = []
            # The tail of a tracking value ("topic NUL cluster NUL reason") repeats for nearly
            # every message of a batch: encode each distinct one once.
            tails: dict[tuple[str, str, str], bytes] = {}
            delete = txn.delete
            messages = self._messages
            for o in outcomes:
                ok = delete(o.key, b"", messages)  # positional: this runs once per message
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
                # A comprehension, not a loop of statements: this is the per-message hot path.
                ok_list = [delete(k, b"", messages) for k in run.keys]
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
            self._adjust_counts(txn, {t: c for t, c in counts.items() if c[0]}, -1)
            if tracked:
                with txn.cursor(self._tracking) as cur:
                    cur.putmulti(tracked)
                self._prune_tracking(txn, now_ms, len(tracked))
            return removed, run_removed

        result: tuple[list[bool], list[list[bool]]] = self._write(body)
        return result

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
            while n < limit and cur.first() and (n < excess or bytes(cur.key()) < cutoff):
                cur.delete()
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
            with txn.cursor(self._messages) as cur:
                for topic, n, b in counts:
                    prefix = keys.topic_prefix(topic)
                    oldest = None
                    if cur.set_range(prefix) and bytes(cur.key()).startswith(prefix):
                        oldest = keys.id_timestamp_ms(bytes(cur.key()[len(prefix):]))
                    out.append(TopicStats(topic, n, b, oldest))
        return out

    def locate(self, message_id: bytes) -> dict[str, Any] | None:
        """Where a recent message is: still buffered (and under which topic) or its outcome."""
        with self._txn(write=False) as txn:
            raw = txn.get(message_id, db=self._tracking)
            if raw is not None:
                return _unpack_outcome(bytes(raw))
            for topic in self._topic_names(txn):
                if txn.get(keys.message_key(topic, message_id), db=self._messages) is not None:
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


def _run_keys(prefix: bytes, ts: int, seq: int, n: int) -> tuple[list[bytes], int, int]:
    """Keys for ``n`` consecutive messages of one topic (``prefix``), from id ``(ts, seq)``
    on, and the ``(ts, seq)`` after them: ``append``'s id rule, a run at a time."""
    if seq + n - 1 > 0xFFFFFFFF:
        # The sequence would wrap within the run: ids one by one, as in append.
        out = []
        for _ in range(n):
            if seq > 0xFFFFFFFF:
                ts, seq = ts + 1, 0
            out.append(prefix + keys.ID.pack(ts, seq))
            seq += 1
        return out, ts, seq
    base = prefix + ts.to_bytes(8, "big")
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
