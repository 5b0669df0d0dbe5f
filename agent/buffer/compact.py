"""Give a drained buffer's disk space back: LMDB's copy with compaction, agent stopped.

LMDB never shrinks its data file. Pages freed by deletes are reused for new messages, so
after a backlog drains the file stays at its high-water size (docs/buffer.md, "File size").
That is harmless (the next backlog reuses the space) but may be unwelcome on a small disk.
``compact`` writes a copy holding only the pages in use (``mdb_env_copy2`` with
``MDB_CP_COMPACT``), fsyncs it and renames it over the original.

Renaming a file that another process has mapped would leave that process writing to the old,
unlinked file: acknowledged messages would be lost. So every ``Store`` holds a shared
``flock`` on ``usage.lock`` in the buffer directory for as long as it is open (the agent's
two processes, ``ferry buffer`` commands), and compaction takes it exclusively for its whole
run: it refuses while anything has the buffer open, and an agent started meanwhile refuses to
open the buffer until compaction is done. ``flock`` locks belong to the open file, not the
process, so they do not disturb the ``fcntl`` locks LMDB keeps on ``lock.mdb``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import lmdb

USAGE_LOCK = "usage.lock"


class BufferBusy(Exception):
    """The buffer is in use by another process (or being compacted)."""


@dataclass(frozen=True)
class Compacted:
    before_bytes: int
    after_bytes: int


def hold_shared(directory: Path) -> int:
    """Take the shared usage lock of a buffer directory; returns the descriptor to close.
    Raises BufferBusy while ``ferry buffer compact`` runs."""
    fd = os.open(directory / USAGE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BufferBusy(f"the buffer {directory} is being compacted (ferry buffer compact); "
                         "start the agent when it is done") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def compact(directory: Path) -> Compacted:
    """Rewrite ``directory/data.mdb`` without its free pages. Raises BufferBusy when another
    process has the buffer open, OSError (ENOSPC) when the disk cannot hold the copy."""
    data = directory / "data.mdb"
    if not data.exists():
        raise FileNotFoundError(f"no buffer at {directory}")
    fd = os.open(directory / USAGE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
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
        env = lmdb.open(str(directory), readonly=True, max_dbs=8, lock=True)
        try:
            info, stat = env.info(), env.stat()
            in_use = (int(info["last_pgno"]) + 1) * int(stat["psize"])
            free = shutil.disk_usage(directory).free
            if free < in_use:
                raise OSError(28, f"the copy needs up to {in_use} bytes, {free} are free")
            env.copy(str(work), compact=True)
        finally:
            env.close()
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
