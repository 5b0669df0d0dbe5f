"""What a Ferry process's memory really is: its own, apart from the buffer's mapped pages.

The buffer is an LMDB file mapped into both processes. Every page a reader touches counts in
the process's resident set (RSS) until the kernel needs it back, so after draining a backlog
RSS reads as gigabytes while the process's own memory (Python objects, librdkafka's queues)
is tens of MiB. Those pages are file cache, clean and reclaimable: a memory limit counts them
but the kernel drops them instead of killing the process (docs/buffer.md, "Memory").

Linux only: ``/proc/<pid>/smaps`` gives, per mapping, how much of it is resident. Anywhere
else (or for a process that is gone) ``read`` returns None.
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
        with open(f"/proc/{pid}/smaps", "rb") as f:
            text = f.read()
    except OSError:
        return None
    return parse_smaps(text, os.fsencode(os.path.realpath(buffer_file)))


def parse_smaps(text: bytes, buffer_file: bytes) -> ProcessMemory:
    """Sum ``/proc/<pid>/smaps``: all ``Rss``, all ``Anonymous``, and the ``Rss`` of the
    mappings of ``buffer_file``."""
    rss = anonymous = mapped = 0
    in_buffer = False
    for line in text.splitlines():
        if not line:
            continue
        first = line.split(None, 1)[0]
        if not first.endswith(b":"):
            # A mapping's header: "start-end perms offset dev inode [path]". The path may
            # contain spaces, so take everything after the fifth field.
            fields = line.split(None, 5)
            in_buffer = len(fields) == 6 and fields[5].rstrip() == buffer_file
            continue
        if first == b"Rss:":
            kib = int(line.split()[1])
            rss += kib
            if in_buffer:
                mapped += kib
        elif first == b"Anonymous:":
            anonymous += int(line.split()[1])
    return ProcessMemory(rss * 1024, anonymous * 1024, mapped * 1024)
