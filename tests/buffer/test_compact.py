"""agent/buffer/compact.py: a drained buffer's file shrinks, and never under a running agent."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from agent.buffer.compact import BufferBusy, compact
from agent.buffer.store import Corrupt, Store
from agent.buffer.usage_lock import USAGE_LOCK
from agent.records import Record
from tests.agent_harness import AgentProcess, ferry, write_config

MAX = 512 * 1024 * 1024


def backlog_drained(path: Path) -> None:
    """60 MB through the buffer, then drained; 200 messages of another topic stay."""
    value = os.urandom(3000)
    with Store(path, MAX) as store:
        store.append([[Record("keep", b"keep-%d" % i) for i in range(200)]])
        for _ in range(20):
            store.append([[Record("backlog", value) for _ in range(1000)]])
        assert store.purge("backlog") == 20_000


def test_compaction_gives_the_space_back_and_keeps_every_message(tmp_path: Path) -> None:
    path = tmp_path / "buffer"
    backlog_drained(path)
    before = (path / "data.mdb").stat().st_size
    assert before >= 60_000_000  # LMDB keeps its high-water size
    done = compact(path)
    assert done.before_bytes == before
    assert done.after_bytes == (path / "data.mdb").stat().st_size < 2_000_000
    assert not [p for p in path.iterdir() if p.name.startswith(".compact")]
    with Store(path, MAX) as store:
        kept = [m for m in store.read("keep", None, 1000)]
        assert not [m for m in kept if isinstance(m, Corrupt)]
        assert [m.record.value for m in kept if not isinstance(m, Corrupt)] == [
            b"keep-%d" % i for i in range(200)]
        # Still a working buffer: ids go on increasing after the copy.
        new = store.append([[Record("keep", b"after")]])[0]
        assert isinstance(new, list) and new[0] > kept[-1].id


def test_compaction_refuses_while_the_buffer_is_open(tmp_path: Path) -> None:
    path = tmp_path / "buffer"
    backlog_drained(path)
    before = (path / "data.mdb").read_bytes()
    with Store(path, MAX), pytest.raises(BufferBusy, match="stop the agent"):
        compact(path)
    assert (path / "data.mdb").read_bytes() == before


def test_a_buffer_being_compacted_cannot_be_opened(tmp_path: Path) -> None:
    path = tmp_path / "buffer"
    backlog_drained(path)
    fd = os.open(path / USAGE_LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what compact() holds while it runs
        with pytest.raises(BufferBusy, match="being compacted"):
            Store(path, MAX)
    finally:
        os.close(fd)
    Store(path, MAX).close()


def test_ferry_buffer_compact_against_a_running_agent_then_stopped(tmp_path: Path) -> None:
    """The command as an operator runs it: refused (exit 1, one line) while `ferry run` has
    the buffer, done once it stopped. The agent needs no broker for this."""
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    with AgentProcess(cfg) as agent:
        path = agent.config.buffer.path
        refused = ferry("buffer", "--config", str(cfg), "compact")
        assert refused.returncode == 1
        assert "open by another process" in refused.stderr
        assert "Traceback" not in refused.stderr
    done = ferry("buffer", "--config", str(cfg), "compact")
    assert done.returncode == 0, done.stderr
    assert f"compacted {path}/data.mdb" in done.stdout
