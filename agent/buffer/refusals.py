"""Why the buffer refuses a write: the exceptions its callers handle, and naming a failed one.

A refusal is decided before anything is written (``BufferFull`` and its kinds), or reported
after LMDB aborted the transaction (``BufferUnavailable``); either way nothing of the
refused group is on disk.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb

from agent import reasons

# Less free space than this on the buffer's filesystem when a write fails means "disk full".
_LOW_DISK_BYTES = 16 * 1024 * 1024


class BufferFull(Exception):
    """Accepting this would take the buffer past ``buffer.max_bytes``."""

    reason = reasons.BUFFER_FULL  # what messages_rejected counts it as


class InvalidGroup(BufferFull):
    """A record of the group cannot be encoded (a source let an out-of-range field through).

    A subclass of BufferFull only so callers that handle refusals keep working; the reason
    counted is ``unencodable`` (agent/reasons.py)."""

    reason = reasons.UNENCODABLE


class DiskFull(BufferFull):
    """The buffer's filesystem is full: storing this would use the reserve kept for deletes
    (space.py). Refused before anything was written; accepted again as the buffer drains
    or the filesystem frees up. A BufferFull so callers that handle refusals keep working."""

    reason = reasons.DISK_FULL


class BufferUnavailable(Exception):
    """The disk refused the write (ENOSPC, EIO, ...); nothing of the transaction was kept."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# A group's refusal, as the writer hands it back rather than raises it (the committer's
# ``Result``). Callers ``match`` on it: an ``InvalidGroup`` (refused for good) before the
# ``BufferFull`` it is a kind of (refused for now), and ``assert_never`` after the last case,
# so that mypy names any kind a caller forgot.
Refusal = BufferFull | BufferUnavailable


def unavailable(exc: lmdb.Error, path: Path | None = None) -> BufferUnavailable:
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
        return BufferUnavailable(reasons.DISK_FULL, f"disk full under {path}: {text}")
    return BufferUnavailable(reasons.DISK_ERROR, f"buffer write failed: {text}")
