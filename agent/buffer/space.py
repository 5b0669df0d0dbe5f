"""The buffer's disk space: ``data.mdb`` allocated on the filesystem before LMDB needs it.

LMDB (without ``writemap``) writes a commit's pages with ``pwrite``. A page past the end of
the file makes the filesystem find a block for it then and there; on a full filesystem that
write fails (ENOSPC, which LMDB reports as EIO) and the whole commit with it. Deletes are no
exception: LMDB copies on write, so removing a message writes new pages too. A buffer whose
file cannot grow any more therefore cannot drain either, unless pages inside the file are
free -- the wedge of issue 23.

Pages inside the file's allocated extent never need the filesystem again: LMDB writes them in
place, and the pages it frees are reused. So the file is allocated (``posix_fallocate``) ahead
of what LMDB uses, and the part beyond LMDB's last page is split in two:

- the **reserve** (``buffer.reserve_bytes``): never used by new messages. Deletes, tracking
  and state writes may use it, so the forwarder can always drain, whatever the filesystem
  does meanwhile;
- the **growth margin** above it (as big again as the reserve), which new messages use before
  the file must grow again.

``buffer.preallocate = true`` allocates the whole map (``max_bytes`` plus the headroom) at
start instead. Either way, start-up fails with ``InsufficientSpace`` when the reserve is not
in the file already and the filesystem cannot provide it; a file that holds its reserve opens
on a full filesystem (a restart must not lose the agent). Design notes: docs/buffer.md.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

# posix_fallocate on a filesystem nearly full: after the whole extension is refused, try
# smaller ones down to this, so the file owns whatever was still free.
_MIN_GROWTH = 1024 * 1024
# After the filesystem refused to extend the file, try again no sooner than this unless it
# reports the room free: while it is full, every refused group would otherwise try (a few
# system calls each, possibly thousands a second).
_RETRY_SECONDS = 0.5


class InsufficientSpace(Exception):
    """The filesystem cannot give the buffer's file the space its settings ask for."""


class Space:
    """Keeps ``data.mdb`` allocated to ``used + reserve`` and more (up to ``cap``).

    Thread-safe. ``allocated`` is how much of the file is known to be backed by the
    filesystem (its size after Ferry's last allocation: everything below it was either
    written by LMDB or allocated here)."""

    def __init__(self, file: Path, *, cap: int, reserve: int, preallocate: bool) -> None:
        self.file = file
        self.cap = cap
        self.reserve = min(reserve, cap)
        self.preallocate = preallocate
        self._lock = threading.Lock()
        self._fd = os.open(file, os.O_RDWR | os.O_CLOEXEC)
        self.allocated = os.fstat(self._fd).st_size
        self.supported = True  # False on a filesystem without fallocate (then: best effort)
        # The filesystem refused to extend the file; logged once per change.
        self.refused = False
        self._refused_at = 0.0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def open_check(self, used: int, *, strict: bool) -> None:
        """At start: allocate what the settings ask for. Holes in the file (one copied
        sparsely) are filled too, from offset 0. ``strict``: raise InsufficientSpace when
        the reserve is not there and cannot be had; else log it and go on."""
        want = self.cap if self.preallocate else used + 2 * self.reserve
        want = min(max(want, used + self.reserve), self.cap)
        have = self.allocated
        with self._lock:
            got = self._allocate(0, want, fill_holes=True)
        if got >= min(used + self.reserve, self.cap):
            return
        free = _free_bytes(self.file.parent)
        what = ("preallocate the whole buffer (buffer.preallocate = true)" if self.preallocate
                else f"keep a reserve of {_mib(self.reserve)} beyond the {_mib(used)} in use")
        message = (f"the buffer's file {self.file} needs {_mib(want)} to {what}, but the "
                   f"filesystem gave it only {_mib(max(got, have))} ({_mib(free)} free). "
                   "Free disk space, move buffer.path to a larger filesystem, or lower "
                   "buffer.reserve_bytes / buffer.max_bytes (docs/buffer.md, 'Disk space')")
        if strict:
            raise InsufficientSpace(message)
        log.error("%s; running on without it", message)

    def ensure(self, end: int) -> bool:
        """Make the file allocated up to ``end`` (capped at ``cap``), growing by a margin
        beyond it; True when it is. Cheap when it already is."""
        end = min(end, self.cap)
        if self.allocated >= end:
            return True
        with self._lock:
            if self.allocated >= end:
                return True
            now = time.monotonic()
            if (self.refused and now - self._refused_at < _RETRY_SECONDS
                    and _free_bytes(self.file.parent) < end - self.allocated):
                return False  # (one statvfs: space that returns is used at once)
            target = min(self.cap, end + self.reserve)
            got = self._allocate(self.allocated, target, fill_holes=False)
            ok = got >= end
            if not ok:
                self._refused_at = now
            if not ok and not self.refused:
                self.refused = True
                log.warning(
                    "the filesystem of the buffer (%s) is full: %s could not grow beyond %s "
                    "(%s free). New messages are refused (disk_full) before the %s reserve "
                    "is touched; deletes go on, so the buffer drains as Kafka takes messages",
                    self.file.parent, self.file.name, _mib(got),
                    _mib(_free_bytes(self.file.parent)), _mib(self.reserve))
            elif ok and self.refused:
                self.refused = False
                log.warning("the filesystem of the buffer (%s) has room again: %s "
                            "allocated to %s", self.file.parent, self.file.name, _mib(got))
            return ok

    def _allocate(self, start: int, target: int, *, fill_holes: bool) -> int:
        """Allocate the file up to ``target``; on ENOSPC as much as can be had. Returns
        ``allocated`` afterwards. Caller holds the lock."""
        if target <= self.allocated and not fill_holes:
            return self.allocated
        if not self.supported:
            self.allocated = max(self.allocated, os.fstat(self._fd).st_size)
            return self.allocated
        if fill_holes:
            target = max(target, self.allocated)
        goal = target
        while start < target:
            try:
                os.posix_fallocate(self._fd, start, goal - start)
                start, goal = goal, target  # then try for the rest again
                continue
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    # Neither the filesystem nor glibc's emulation can do it: LMDB's own
                    # writes will have to do (docs/buffer.md says which filesystems).
                    self.supported = False
                    log.warning("cannot preallocate %s (%s): the buffer's space is not "
                                "reserved on this filesystem", self.file, exc)
                    break
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    log.warning("preallocating %s failed: %s", self.file, exc)
                    break
            # No room for all of it: take as much as there is, in halving steps. Part may
            # have been allocated already (ext4 moves the file's size as it goes).
            start = max(start, min(os.fstat(self._fd).st_size, goal))
            if goal - start <= _MIN_GROWTH:
                break
            goal = start + (goal - start) // 2
        self.allocated = max(self.allocated, os.fstat(self._fd).st_size)
        return self.allocated


# LMDB's lock file for its default 126 readers (mdb_env_setup_locks sizes it so).
_LOCK_FILE_BYTES = 8192


def prepare_lock_file(directory: Path) -> None:
    """Allocate LMDB's lock file before LMDB maps it. LMDB extends it with ftruncate (a hole)
    and writes it through a shared mapping: on a full filesystem the first write to a page
    without a block is a SIGBUS that kills the process, not an error. Raises
    InsufficientSpace when even that much cannot be had."""
    lock = directory / "lock.mdb"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        size = os.fstat(fd).st_size
        # An existing one (another process may have it mapped) only has holes filled.
        os.posix_fallocate(fd, 0, size or _LOCK_FILE_BYTES)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise InsufficientSpace(
            f"cannot allocate the buffer's lock file {lock}: {exc.strerror} "
            f"({_mib(_free_bytes(directory))} free). Free disk space or move buffer.path "
            "(docs/buffer.md, 'Disk space')") from None
    finally:
        os.close(fd)


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"
