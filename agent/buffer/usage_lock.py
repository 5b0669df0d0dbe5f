"""The buffer directory's usage lock: a shared ``flock`` held by every open ``Store``.

Compaction (compact.py) renames a new file over ``data.mdb``; a process that has the old
one mapped would go on writing to an unlinked file. So every opener holds ``usage.lock``
shared for as long as it is open, and compaction takes it exclusively for its whole run.
``flock`` locks belong to the open file, not the process, so they do not disturb the
``fcntl`` locks LMDB keeps on ``lock.mdb``.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

USAGE_LOCK = "usage.lock"


class BufferBusy(Exception):
    """The buffer is in use by another process (or being compacted)."""


def open_lock_file(directory: Path) -> int:
    return os.open(directory / USAGE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)


def hold_shared(directory: Path) -> int:
    """Take the shared usage lock of a buffer directory; returns the descriptor to close.
    Raises BufferBusy while ``ferry buffer compact`` runs."""
    fd = open_lock_file(directory)
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
