"""What a Ferry process's memory really is: its own, apart from the buffer's mapped pages.

The buffer is an LMDB file mapped into both processes. Every page a reader touches counts in
the process's resident set (RSS) until the kernel needs it back, so after draining a backlog
RSS reads as gigabytes while the process's own memory (Python objects, librdkafka's queues)
is tens of MiB. Those pages are file cache, clean and reclaimable: a memory limit counts them
but the kernel drops them instead of killing the process (docs/buffer.md, "Memory").

Linux only: ``/proc/<pid>/smaps_rollup`` gives the totals and ``/proc/<pid>/smaps`` how much
of the buffer's mapping is resident. Anywhere else (or for a process that is gone) ``read``
returns None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int
    """Everything resident: the figure `ps` and `top` show."""
    anonymous_bytes: int
    """Memory the process made itself (heap, stacks, Python objects, librdkafka buffers)."""
    buffer_mapped_bytes: int
    """Resident pages of the buffer's data file: file cache, clean unless being written."""


def read(pid: int, buffer_file: Path) -> ProcessMemory | None:
    """The memory of process ``pid``; ``buffer_file`` is the buffer's ``data.mdb``."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            rollup = f.read()
        with open(f"/proc/{pid}/smaps", "rb") as f:
            smaps = f.read()
    except OSError:
        return None
    return parse(rollup, smaps, os.fsencode(os.path.realpath(buffer_file)))


def parse(rollup: bytes, smaps: bytes, buffer_file: bytes) -> ProcessMemory:
    """Totals from ``smaps_rollup``; the buffer's resident pages from the ``Rss`` of each
    mapping of exactly ``buffer_file`` in ``smaps``. The monitor thread runs this in the
    ingest process every few seconds: a search for the path, not a parse of every line,
    keeps it from holding the GIL for milliseconds."""
    mapped = 0
    header_end = b" " + buffer_file + b"\n"
    at = smaps.find(header_end)
    while at >= 0:
        rss_at = smaps.find(b"\nRss:", at)
        if rss_at >= 0:
            mapped += _kib(smaps, rss_at + 1)
        at = smaps.find(header_end, at + len(header_end))
    return ProcessMemory(_field(rollup, b"Rss:"), _field(rollup, b"Anonymous:"), mapped)


def _field(text: bytes, name: bytes) -> int:
    at = text.find(b"\n" + name)
    return _kib(text, at + 1) if at >= 0 else 0


def _kib(text: bytes, at: int) -> int:
    """Bytes of the "Name:   123 kB" line starting at ``at``."""
    end = text.find(b"\n", at)
    return int(text[at:end if end >= 0 else None].split()[1]) * 1024
