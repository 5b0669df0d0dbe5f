"""agent/process/memory.py: the agent's own memory told apart from the buffer's mapped pages."""

from __future__ import annotations

import os
from pathlib import Path

from agent.buffer.store import Corrupt, Store
from agent.process import memory
from agent.records import Record

SMAPS = b"""\
55d0c0a00000-55d0c0a21000 r--p 00000000 08:01 131 /usr/bin/python3.11
Size:                132 kB
Rss:                 128 kB
Anonymous:             0 kB
55d0c1000000-55d0c1400000 rw-p 00000000 00:00 0                          [heap]
Rss:                4096 kB
Anonymous:          4096 kB
7f0000000000-7f0040000000 r--s 00000000 08:01 777 /var/lib/ferry/my buffer/data.mdb
Rss:               65536 kB
Anonymous:             0 kB
7f1000000000-7f1000100000 r--s 00000000 08:01 778 /var/lib/ferry/my buffer/data.mdb.old
Rss:                1024 kB
Anonymous:             0 kB
7f2000000000-7f2000001000 rw-p 00000000 00:00 0
Rss:                   4 kB
Anonymous:             4 kB
VmFlags: rd wr mr mw me ac sd
"""


ROLLUP = b"""\
55d0c0a00000-7fffa8710000 ---p 00000000 00:00 0                          [rollup]
Rss:               70788 kB
Pss:               70000 kB
Anonymous:          4100 kB
"""


def test_totals_from_the_rollup_and_the_buffer_mapping_apart() -> None:
    mem = memory.parse(ROLLUP, SMAPS, b"/var/lib/ferry/my buffer/data.mdb")
    assert mem.rss_bytes == 70788 * 1024
    assert mem.anonymous_bytes == 4100 * 1024
    # Only the mapping of the buffer file itself, though its path has a space and another
    # file's name starts with it.
    assert mem.buffer_mapped_bytes == 65536 * 1024
    assert memory.parse(ROLLUP, SMAPS, b"/elsewhere/data.mdb").buffer_mapped_bytes == 0


def test_a_process_that_is_gone_has_no_figures(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert memory.read(pid, tmp_path / "data.mdb") is None


def test_reading_the_buffer_shows_as_mapped_pages_not_own_memory(tmp_path: Path) -> None:
    """What happens after a drain: every page read stays resident, counted in RSS."""
    path = tmp_path / "buffer"
    value = os.urandom(2000)
    with Store(path, 256 * 1024 * 1024) as store:
        for _ in range(10):
            store.append([[Record("t", value) for _ in range(1000)]])
        before = memory.read(os.getpid(), path / "data.mdb")
        read = [m for m in store.read("t", None, 10_000) if not isinstance(m, Corrupt)]
        assert len(read) == 10_000
        after = memory.read(os.getpid(), path / "data.mdb")
    assert before is not None and after is not None
    # 20 MB of values went through the map: most of it is now resident, and it is the
    # mapping's, not the process's own (which grew only by the Python objects still held).
    assert after.buffer_mapped_bytes >= 15_000_000
    assert after.buffer_mapped_bytes - before.buffer_mapped_bytes >= 10_000_000
    assert after.rss_bytes >= after.anonymous_bytes + after.buffer_mapped_bytes
