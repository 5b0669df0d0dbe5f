"""``ferry replay FILE``: put the messages of a discard log back in the buffer, each once.

Replay remembers every line it put back, in the buffer's ``state`` database, written in the
same LMDB transaction as the messages themselves: a crash between "stored" and "remembered"
cannot exist, so nothing is lost and nothing doubled. A second run of the same file, or a run
resumed after the buffer was full, puts back only what is missing.

State keys:

- ``replay-id:<digest>`` -> the time it was put back (ms, ASCII digits)
- ``replay-day:<day>:<digest>`` -> empty: a day index, so a day's entries are dropped
  together without scanning every entry
- ``replay-count:<day>`` -> how many lines that day holds (ASCII digits): which days exist,
  and how much is remembered, in a few keys

None of them starts with ``REPLAYED`` (``replayed:``), whose keys the daemon sums into
``messages_accepted{source="replay"}``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from agent.buffer.store import BufferFull, Store
from agent.config import FerryConfig
from agent.forwarder.discard_log import ReplayError, parse_discards
from agent.records import REPLAYED, Record

PREFIX = b"replay-id:"
INDEX = b"replay-day:"
COUNT = b"replay-count:"
# How long a put-back line is remembered. Replay is an operator's step after fixing what made
# the messages fail; running a file again (by mistake, or to finish a run the full buffer
# stopped) happens within hours or days, and a file is moved away once replayed (the discard
# log's size limit asks for that, docs/buffer.md). A month covers that with room to spare.
# Time alone does not bound the space, though: the entries (about 140 bytes per line, both
# keys) live in the LMDB map's headroom beyond buffer.max_bytes, which the forwarder's deletes
# need when the buffer is full. So they are also held to a quarter of that headroom
# (``limit``), the share tracking gets too: past it, the oldest days are forgotten first.
REMEMBER_DAYS = 30
_ENTRY_BYTES = 160  # per remembered line, for ``limit``: a little over the 143 measured
BATCH = 5000
_DAY_MS = 86_400_000
# Fields of a discard-log line that differ between two discards of one buffered message (a
# crash after the log line was written but before the delete discards it again): they are
# left out of its identity, so both lines name the same message.
_PER_DISCARD = frozenset(("reason", "discarded_ms", "attempts", "detail"))


def line_identity(raw: bytes) -> bytes:
    """What names the message of a discard-log line across files and runs.

    Ferry writes the message's buffer id on every line, but an id is only unique within one
    buffer's history (it is the accept time in ms and a counter), and a hand-made or filtered
    file may have none. So the identity is a digest of the whole line without the fields of
    the discard itself (``_PER_DISCARD``): topic, id, accept time and the message's key,
    value, partition key, timestamp and headers. Two lines share it only if they carry the
    same message, with the same id if they have one.
    """
    doc = json.loads(raw)
    # The repr of JSON values (str, int, float, bool, None, lists) is fixed by the language,
    # so the digest is stable across runs and releases; it costs less than json.dumps.
    kept = sorted((k, v) for k, v in doc.items() if k not in _PER_DISCARD)
    return hashlib.blake2b(repr(kept).encode(), digest_size=16).digest()


def _upto(f: BinaryIO, end: int, path: Path) -> Iterator[bytes]:
    """The lines of ``f`` from its start to byte ``end``, nothing written after that."""
    f.seek(0)
    pos = 0
    while pos < end:
        raw = f.readline(end - pos)
        if not raw:
            raise ReplayError(f"{path} was cut short while being replayed (at byte {pos}, "
                              f"not {end})")
        pos += len(raw)
        yield raw


def _check(f: BinaryIO, path: Path) -> tuple[int, int]:
    """Check every line of the open discard log, as far as it is written now; returns how
    many lines it holds and where they end. Replay puts back those bytes and no others
    (``_with_identities``): a line appended to a live log after the check waits for the
    next run, checked by it."""
    end = os.fstat(f.fileno()).st_size
    lines = sum(1 for _ in parse_discards(_upto(f, end, path), path))
    return lines, end


def _with_identities(f: BinaryIO, path: Path, end: int) -> Iterator[tuple[Record, bytes]]:
    """The records of the discard log's first ``end`` bytes, each with its line's identity.

    The identity needs the line's own fields (a missing timestamp becomes "now" in the
    record, which would change the digest on every run), so it is taken from the raw line
    the record was built from.
    """
    for _, raw, record in parse_discards(_upto(f, end, path), path):
        yield record, line_identity(raw)


def _day_key(day: int, digest: bytes) -> bytes:
    return INDEX + b"%08d:" % day + digest


def _day_count_key(day: int) -> bytes:
    return COUNT + b"%08d" % day


def limit(store: Store) -> int:
    """How many lines may be remembered: a quarter of the map's headroom."""
    return max(10_000, (store.map_cap - store.max_bytes) // 4 // _ENTRY_BYTES)


def prune(store: Store, now_ms: int, *, keep: int | None = None) -> int:
    """Forget the days put back more than REMEMBER_DAYS days ago, then the oldest days while
    more than ``keep`` lines (default ``limit(store)``) are remembered; returns how many
    lines were forgotten. Today's lines are never forgotten for the limit: a run the full
    buffer stopped must find them when it is resumed. So what is kept is at most the limit
    plus one day's replays."""
    keep = limit(store) if keep is None else keep
    today = now_ms // _DAY_MS
    days = sorted((int(k[len(COUNT):]), int(v)) for k, v in store.state_items(COUNT))
    held = sum(n for _, n in days)
    removed = 0
    for day, n in days:
        if day >= today or (day >= today - REMEMBER_DAYS and held <= keep):
            break
        removed += _forget_day(store, day)
        held -= n
    return removed


def _forget_day(store: Store, day: int) -> int:
    deletes: list[bytes] = []
    removed = 0
    for index_key, _ in store.state_items(INDEX + b"%08d:" % day):
        deletes += [index_key, PREFIX + index_key[len(INDEX) + 9:]]
        removed += 1
        if len(deletes) >= 2 * BATCH:
            store.update_state(deletes=deletes)
            deletes = []
    # The count goes last: a run that dies half-way leaves it, and the next finishes the day.
    store.update_state(deletes=[*deletes, _day_count_key(day)])
    return removed


def replay(config: FerryConfig, path: Path, clock: Callable[[], float] = time.time) -> int:
    """Run ``ferry replay``: exit status 0, or 1 with a message on standard error."""
    try:
        f = path.open("rb")
    except OSError as exc:
        print(f"ferry replay: {exc}; nothing was put back", file=sys.stderr)
        return 1
    with f:
        return _replay(config, path, f, clock)


def _replay(config: FerryConfig, path: Path, f: BinaryIO, clock: Callable[[], float]) -> int:
    try:
        # Check the whole file first, so a bad line puts nothing back (all or nothing).
        lines, end = _check(f, path)
    except (ReplayError, OSError) as exc:
        print(f"ferry replay: {exc}; nothing was put back", file=sys.stderr)
        return 1
    total = skipped = repeated = 0
    try:
        with Store(config.buffer.path, config.buffer.max_bytes,
                   reserve_bytes=config.buffer.reserve_bytes) as store, \
                _ReplayLock(config.buffer.path / "replay.lock"):
            now_ms = int(clock() * 1000)
            prune(store, now_ms)
            stamp = str(now_ms).encode()
            day = now_ms // _DAY_MS
            batch: list[Record] = []
            puts: dict[bytes, bytes] = {}
            for record, digest in _with_identities(f, path, end):
                key = PREFIX + digest
                if key in puts:
                    repeated += 1
                    continue
                before = store.get_state(key)
                if before is not None:
                    # Put back by this run, in an earlier batch, or by an earlier run.
                    if before == stamp:
                        repeated += 1
                    else:
                        skipped += 1
                    continue
                batch.append(record)
                puts[key] = stamp
                puts[_day_key(day, digest)] = b""
                if len(batch) >= BATCH:
                    total += _put(store, batch, puts, day)
                    batch, puts = [], {}
            if batch:
                total += _put(store, batch, puts, day)
    except (ReplayError, BufferFull, OSError) as exc:
        when = ("once there is room" if isinstance(exc, BufferFull)
                else "once it is done" if isinstance(exc, _Busy) else "once that is fixed")
        print(f"ferry replay: {exc} ({total} messages were put back before it; run it again "
              f"{when}: what was put back is skipped)", file=sys.stderr)
        return 1
    print(f"replayed {total} messages from {path} ({_summary(lines, skipped, repeated)})")
    return 0


def _summary(lines: int, skipped: int, repeated: int) -> str:
    parts = [f"{lines} lines"]
    if skipped:
        parts.append(f"{skipped} already replayed before, skipped")
    if repeated:
        parts.append(f"{repeated} repeating an earlier line of the file (one message "
                     "discarded twice), put back once")
    return "; ".join(parts)


def _put(store: Store, batch: list[Record], puts: dict[bytes, bytes], day: int) -> int:
    """Store a batch with what remembers it, in one transaction. (One ``ferry replay`` at a
    time: the counts read here cannot change before the transaction.)"""
    count = _day_count_key(day)
    puts[count] = str(int(store.get_state(count) or b"0") + len(batch)).encode()
    # The running totals the daemon counts as messages_accepted{source="replay"}: only what
    # is put back, never a skipped line.
    added: dict[str, int] = {}
    for r in batch:
        added[r.topic] = added.get(r.topic, 0) + 1
    for topic, n in added.items():
        key = REPLAYED + topic.encode()
        puts[key] = str(int(store.get_state(key) or b"0") + n).encode()
    (result,) = store.append([batch], state_puts=puts)
    if isinstance(result, BufferFull):
        raise result
    return len(batch)


class _Busy(OSError):
    pass


class _ReplayLock:
    """One ``ferry replay`` per buffer at a time: a line is looked up before the transaction
    that stores it, so two runs of one file at once could each find it missing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _ReplayLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise _Busy(f"another `ferry replay` is running on {self.path.parent}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the lock
