"""The buffer's disk space (agent/buffer/space.py, Store's room check) on a real filesystem.

A 16 MiB tmpfs per test: the buffer's file is allocated ahead of use, new messages are
refused (DiskFull) before the reserve is touched, and the reserve lets deletes, tracking and
state writes go on when the filesystem has no block left. Issue 23.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer.store import (
    BufferFull,
    BufferUnavailable,
    DeliveredRun,
    DiskFull,
    InsufficientSpace,
    Store,
    StoredMessage,
)
from agent.records import Record
from tests.filesystems import tmpfs

MB = 1024 * 1024
GROUP = 500


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (the tests run as root)."""
    with tmpfs(tmp_path / "disk", 16) as mnt:
        yield mnt


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0) -> Path:
    """Another program's file takes every block left on ``path``'s filesystem (but
    ``leave`` bytes)."""
    filler = path / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (MB, 4096):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
        if leave:
            f.truncate(f.tell() - leave)
    assert free_bytes(path) < 4096 * 2 + leave
    return filler


def group(topic: str = "t", n: int = GROUP, size: int = 200) -> list[Record]:
    return [Record(topic, b"v" * size) for _ in range(n)]


def append_until_refused(store: Store, limit: int = 2000) -> tuple[int, BufferFull]:
    stored = 0
    for _ in range(limit):
        (result,) = store.append([group()])
        if not isinstance(result, list):
            return stored, result
        stored += len(result)
    raise AssertionError(f"{stored} messages stored without a refusal")


def deliver_all(store: Store, topic: str = "t") -> int:
    n = 0
    while batch := [m for m in store.read(topic, None, 2000) if isinstance(m, StoredMessage)]:
        store.remove_many([], [DeliveredRun(topic, "local", [m.id for m in batch],
                                            [m.stored_bytes for m in batch],
                                            [0] * len(batch), list(range(len(batch))))])
        n += len(batch)
    return n


def test_its_own_messages_fill_the_filesystem_then_it_drains_and_accepts_again(
    disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.buffer.space")
    with Store(disk / "b", 1024 * MB, reserve_bytes=2 * MB, open_space="require") as s:
        assert s.space is not None
        stored, refusal = append_until_refused(s)
        # Refused before the filesystem refused LMDB anything: counted as the disk's fault,
        # nothing half-written, and the buffer's file holds the rest of the filesystem.
        assert isinstance(refusal, DiskFull) and refusal.reason == "disk_full"
        assert stored > 40_000  # 16 MiB less the reserve, 200-byte messages
        assert free_bytes(disk) < MB
        assert (disk / "b" / "data.mdb").stat().st_size == s.space.allocated
        assert s.topic_stats()[0].messages == stored
        # The file cannot grow: said once, not per refusal.
        for _ in range(20):
            assert isinstance(s.append([group()])[0], DiskFull)
        grew = [r for r in caplog.records if "could not grow" in r.getMessage()]
        assert len(grew) == 1, caplog.text
        # Deletes (with their tracking entries) go on in the reserve, to the last message.
        assert deliver_all(s) == stored
        assert s.topic_stats() == []
        # And new messages fit into the pages the drain freed, the filesystem still full.
        more, refusal = append_until_refused(s)
        assert more > stored // 2, f"{more} stored after draining {stored}"
        assert isinstance(refusal, DiskFull)


def test_filled_by_another_file_deletes_still_work_and_space_returns_when_it_goes(
    disk: Path
) -> None:
    with Store(disk / "b", 1024 * MB, reserve_bytes=2 * MB, open_space="require") as s:
        for _ in range(10):
            assert isinstance(s.append([group()])[0], list)
        filler = fill(disk)
        stored = 10 * GROUP
        more, refusal = append_until_refused(s)
        stored += more
        assert isinstance(refusal, DiskFull)
        assert deliver_all(s) == stored  # the filesystem has not one free block
        assert isinstance(s.append([group()])[0], list)  # room in the file's freed pages
        deliver_all(s)
        filler.unlink()
        # The file grows again: more than the full filesystem ever let it hold.
        after, _ = append_until_refused(s)
        assert after > stored + MB // 200


def test_state_and_deletes_may_use_the_reserve_new_messages_may_not(disk: Path) -> None:
    with Store(disk / "b", 1024 * MB, reserve_bytes=4 * MB, open_space="require") as s:
        fill(disk)
        append_until_refused(s)
        # Ingest-side state (spool progress, topic definitions) still commits...
        s.update_state({b"spool:k%d" % i: b"x" * 100 for i in range(2000)})
        assert s.get_state(b"spool:k1999") == b"x" * 100
        # ...and a message group refused for the disk is refused whole by append_encoded too,
        # as the filesystem's refusal the spool intake waits out.
        with pytest.raises(BufferUnavailable) as refused:
            s.append_encoded([("t", [b"\0" * 300] * 2000, 0)])
        assert refused.value.reason == "disk_full"


def test_start_up_fails_clearly_when_the_reserve_cannot_be_had(disk: Path) -> None:
    fill(disk, leave=2 * MB)
    with pytest.raises(InsufficientSpace, match=r"reserve of 4\.0 MiB.*buffer\.reserve_bytes"):
        Store(disk / "b", 1024 * MB, reserve_bytes=4 * MB, open_space="require")
    # As a tool would open it: said in the log, not raised.
    with Store(disk / "b", 1024 * MB, reserve_bytes=4 * MB, open_space="try") as s:
        assert s.topic_stats() == []


def test_a_new_buffer_on_a_full_filesystem_is_an_error_not_a_crash(disk: Path) -> None:
    """LMDB writes its lock file through a shared mapping: on a full filesystem, a page
    without a block is a SIGBUS. The store allocates it first, and says what is wrong."""
    fill(disk)
    with pytest.raises(InsufficientSpace, match=r"lock file .*No space left"):
        Store(disk / "b", 1024 * MB, open_space="require")


def test_a_buffer_that_holds_its_reserve_opens_on_a_full_filesystem(disk: Path) -> None:
    """A restart while another program has filled the disk must not lose the agent."""
    with Store(disk / "b", 1024 * MB, reserve_bytes=2 * MB, open_space="require") as s:
        ids = s.append([group()])[0]
        assert isinstance(ids, list)
    fill(disk)
    with Store(disk / "b", 1024 * MB, reserve_bytes=2 * MB, open_space="require") as s:
        assert deliver_all(s) == GROUP


def test_preallocate_takes_the_whole_map_at_start(tmp_path: Path) -> None:
    with Store(tmp_path / "b", MB, preallocate=True, open_space="require") as s:
        assert s.space is not None and s.space.allocated == s.map_cap
        assert (tmp_path / "b" / "data.mdb").stat().st_size == s.map_cap
    # It stays so: LMDB (without writemap) never truncates the file.
    with Store(tmp_path / "b", MB, preallocate=True, open_space="require") as s:
        assert isinstance(s.append([group()])[0], list)
    assert (tmp_path / "b" / "data.mdb").stat().st_size == s.map_cap


def test_preallocate_refuses_to_start_when_the_map_does_not_fit(disk: Path) -> None:
    # 1 MiB of messages + LMDB's 64 MiB minimum headroom: more than the 16 MiB disk.
    with pytest.raises(InsufficientSpace, match=r"preallocate the whole buffer"):
        Store(disk / "b", MB, preallocate=True, open_space="require")


def test_writes_inside_the_allocated_file_need_no_block_of_the_filesystem(disk: Path) -> None:
    with Store(disk / "b", 1024 * MB, reserve_bytes=MB, open_space="require") as s:
        assert s.space is not None
        allocated = s.space.allocated
        fill(disk)
        for _ in range(3):
            assert isinstance(s.append([group(n=100)])[0], list)
        assert deliver_all(s) == 300
        assert (disk / "b" / "data.mdb").stat().st_size == allocated


def test_tools_opening_the_buffer_do_not_grow_it(disk: Path) -> None:
    """`ferry buffer topics` and test harnesses open the store while the agent runs: they
    must not take the filesystem's free space into the buffer's file."""
    with Store(disk / "b", 1024 * MB, reserve_bytes=2 * MB, open_space="require"):
        pass
    size = (disk / "b" / "data.mdb").stat().st_size
    with Store(disk / "b", 1024 * MB, reserve_bytes=6 * MB) as s:
        assert s.topic_stats() == []
    assert (disk / "b" / "data.mdb").stat().st_size == size


def test_while_the_filesystem_is_full_refusals_do_not_each_try_to_grow_the_file(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store(disk / "b", 1024 * MB, reserve_bytes=2 * MB, open_space="require") as s:
        fill(disk)
        append_until_refused(s)
        calls: list[int] = []
        fallocate = os.posix_fallocate

        def counting(fd: int, offset: int, length: int) -> None:
            calls.append(length)
            fallocate(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", counting)
        for _ in range(200):
            assert isinstance(s.append([group()])[0], DiskFull)
        assert len(calls) < 20, f"{len(calls)} fallocate calls for 200 refused groups"
