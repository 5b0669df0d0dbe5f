"""Give a drained buffer's disk space back: LMDB's copy with compaction, agent stopped.

LMDB never shrinks its data file. Pages freed by deletes are reused for new messages, so
after a backlog drains the file stays at its high-water size (docs/buffer.md, "File size").
That is harmless (the next backlog reuses the space) but may be unwelcome on a small disk.
``compact`` writes a copy of every database, each appended in key order so its pages are
full, fsyncs it and renames it over the original. (LMDB's own copy with compaction,
``mdb_env_copy2`` with ``MDB_CP_COMPACT``, crashes the process on the ``topic_runs`` database:
a sorted-duplicates database with fixed-size values and more ids than fit in one page.)

Renaming a file that another process has mapped would leave that process writing to the old,
unlinked file: acknowledged messages would be lost. So every ``Store`` holds a shared
``flock`` on ``usage.lock`` in the buffer directory for as long as it is open (the agent's
two processes, ``ferry buffer`` commands: usage_lock.py), and compaction takes it
exclusively for its whole run: it refuses while anything has the buffer open, and an agent
started meanwhile refuses to open the buffer until compaction is done. The databases it
copies are named in layout.py, which the store reads too: neither imports the other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import lmdb

from agent.buffer.layout import DATABASES, LAYOUT_1_MESSAGES, MAX_DBS
from agent.buffer.usage_lock import BufferBusy, open_lock_file

__all__ = ["BufferBusy", "Compacted", "compact"]

_CHUNK = 50_000  # entries copied per transaction


@dataclass(frozen=True)
class Compacted:
    before_bytes: int
    after_bytes: int


def compact(directory: Path) -> Compacted:
    """Rewrite ``directory/data.mdb`` without its free pages. Raises BufferBusy when another
    process has the buffer open, OSError (ENOSPC) when the disk cannot hold the copy."""
    data = directory / "data.mdb"
    if not data.exists():
        raise FileNotFoundError(f"no buffer at {directory}")
    fd = open_lock_file(directory)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BufferBusy(f"the buffer {directory} is open by another process: stop the "
                             "agent (systemctl stop ferry) and any `ferry buffer` command "
                             "first") from None
        return _copy_and_replace(directory, data)
    finally:
        os.close(fd)  # releases the lock


def _copy_and_replace(directory: Path, data: Path) -> Compacted:
    before = data.stat().st_size
    work = directory / f".compact-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        src = lmdb.open(str(directory), readonly=True, max_dbs=MAX_DBS, lock=True)
        try:
            info, stat = src.info(), src.stat()
            in_use = (int(info["last_pgno"]) + 1) * int(stat["psize"])
            free = shutil.disk_usage(directory).free
            if free < in_use:
                raise OSError(28, f"the copy needs up to {in_use} bytes, {free} are free")
            dst = lmdb.open(str(work), map_size=max(int(info["map_size"]), 1 << 20),
                            max_dbs=MAX_DBS, sync=False, metasync=False)
            try:
                _copy_databases(src, dst)
                dst.sync(True)
            finally:
                dst.close()
        finally:
            src.close()
        copy = work / "data.mdb"
        fd = os.open(copy, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(copy, data)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    return Compacted(before, data.stat().st_size)


def _copy_databases(src: lmdb.Environment, dst: lmdb.Environment) -> None:
    """Every named database of ``src`` into ``dst``, in key order, ``_CHUNK`` entries a
    transaction. A layout-1 ``messages`` database is copied too (the next start migrates)."""
    names = {**DATABASES, LAYOUT_1_MESSAGES: {}}
    for name, flags in names.items():
        try:
            sdb = src.open_db(name, create=False, **flags)
        except lmdb.NotFoundError:
            continue
        ddb = dst.open_db(name, **flags)
        position: tuple[bytes, bytes] | None = None
        while True:
            with src.begin(db=sdb) as rtxn, rtxn.cursor() as cur:
                if position is None:
                    found = cur.first()
                else:
                    # Back to the last entry copied, then one past it.
                    found = (cur.set_key_dup(*position) if flags.get("dupsort")
                             else cur.set_key(position[0])) and cur.next()
                if not found:
                    break
                chunk = list(islice(cur.iternext(), _CHUNK))
            with dst.begin(write=True, db=ddb) as wtxn, wtxn.cursor() as out:
                _, added = out.putmulti(chunk, append=True)
            if added != len(chunk):
                raise RuntimeError(f"compaction copied {added} of {len(chunk)} entries of "
                                   f"{name.decode()}; the buffer is unchanged")
            position = chunk[-1]
            if len(chunk) < _CHUNK:
                break
