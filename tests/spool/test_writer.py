"""spool.writer: atomic, durable publication of binary spool files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from spool.format import (
    BLOCK_TARGET_BYTES,
    SpoolFormatError,
    SpoolRecord,
    encode_columns,
    encode_record,
)
from spool.reader import (
    BinarySpoolReader,
    list_ready_files,
    open_spool_file,
    read_spool_file,
    verify,
)
from spool.writer import (
    STAGED_SUFFIX,
    SpoolWriter,
    leftover_final_name,
    publish_staged,
    remove_leftovers,
    unique_file_name,
    write_spool_file,
)

RECORDS = [SpoolRecord("orders", f"order {i}".encode(), f"{i}".encode(), i) for i in range(100)]


def test_write_spool_file_publishes_a_readable_file_and_nothing_else(tmp_path: Path) -> None:
    path = write_spool_file(tmp_path, "batch-1", RECORDS)
    assert path == tmp_path / "batch-1.ferry"
    assert os.listdir(tmp_path) == ["batch-1.ferry"]
    assert verify(path) == len(RECORDS)
    assert read_spool_file(path) == RECORDS
    assert list_ready_files(tmp_path) == [path]


def test_until_commit_only_an_ignored_temporary_file_exists(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path, "pending.ferry") as writer:
        writer.write_many(RECORDS)
        [temp] = os.listdir(tmp_path)
        assert temp.startswith(".pending.ferry.") and temp.endswith(".tmp")
        assert list_ready_files(tmp_path) == []
        with pytest.raises(SpoolFormatError, match="a temporary file"):
            open_spool_file(tmp_path / temp)
    assert os.listdir(tmp_path) == ["pending.ferry"]


def test_a_half_written_file_is_refused_even_under_a_ready_name(tmp_path: Path) -> None:
    """If someone renames a file that is still being written, the reader still refuses it."""
    with SpoolWriter(tmp_path, "growing") as writer:
        writer.write_many([SpoolRecord("t", bytes(1000))] * 3000)  # > the 1 MiB file buffer
        [temp] = os.listdir(tmp_path)
        half = tmp_path / "renamed-too-early.ferry"
        shutil.copyfile(tmp_path / temp, half)
        assert half.stat().st_size > 1_000_000
        with pytest.raises(SpoolFormatError, match="truncated|without a trailer"):
            verify(half)
        with pytest.raises(SpoolFormatError):
            next(iter(open_spool_file(half)))
        half.unlink()
    assert verify(tmp_path / "growing.ferry") == 3000


def test_an_exception_in_the_block_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="producer crashed"), SpoolWriter(
        tmp_path, "doomed"
    ) as writer:
        writer.write_many(RECORDS)
        raise RuntimeError("producer crashed")
    assert os.listdir(tmp_path) == []


def test_an_existing_name_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    first = write_spool_file(tmp_path, "same", RECORDS[:1])
    with pytest.raises(FileExistsError, match="already exists"):
        write_spool_file(tmp_path, "same", RECORDS[1:2])
    assert read_spool_file(first) == RECORDS[:1]
    assert os.listdir(tmp_path) == ["same.ferry"]  # the losing temp file is gone too

    inode = os.stat(first).st_ino
    # replace=True replaces a file whose records ours starts with (a re-published partition)...
    write_spool_file(tmp_path, "same", RECORDS[:2], replace=True)
    assert read_spool_file(first) == RECORDS[:2]
    assert os.stat(first).st_ino != inode  # replaced by rename, never rewritten in place
    assert os.listdir(tmp_path) == ["same.ferry"]
    # ...but never one holding other records: those are kept, and ours goes beside them.
    write_spool_file(tmp_path, "same", RECORDS[5:6], replace=True)
    assert read_spool_file(first) == RECORDS[:2]
    assert read_spool_file(tmp_path / "same.1.ferry") == RECORDS[5:6]


def test_files_are_group_readable_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        path = write_spool_file(tmp_path, "private-umask", RECORDS[:1])
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash-safety protocol: data durable under the temporary name, then the rename."""
    final = tmp_path / "durable.ferry"
    events: list[str] = []
    real_fsync = os.fsync

    def watching_fsync(fd: int) -> None:
        is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
        events.append(("dir" if is_dir else "file") + (" after" if final.exists() else " before"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watching_fsync)
    write_spool_file(tmp_path, "durable", RECORDS)
    assert events == ["file before", "dir after"]


def test_write_block_and_write_make_the_same_file(tmp_path: Path) -> None:
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_spool_file(a, "x", RECORDS)
    with SpoolWriter(b, "x") as writer:
        for body, count in encode_columns(
            "orders",
            [r.value for r in RECORDS],
            [r.key for r in RECORDS],
            [r.partition_key for r in RECORDS],
            0,
        ):
            writer.write_block(body, count)
    assert (a / "x.ferry").read_bytes() == (b / "x.ferry").read_bytes()


def test_large_writes_are_split_into_bounded_blocks(tmp_path: Path) -> None:
    record = SpoolRecord("t", bytes(100_000))
    path = write_spool_file(tmp_path, "big", [record] * 50)
    assert read_spool_file(path) == [record] * 50
    # A reader that takes blocks only a little over the target size reads it.
    reader = BinarySpoolReader(path, max_block_bytes=BLOCK_TARGET_BYTES + 200_000)
    assert reader.verify() == 50


def test_a_record_the_format_cannot_hold_is_refused_and_nothing_else_changes(
    tmp_path: Path,
) -> None:
    with SpoolWriter(tmp_path, "partial") as writer:
        writer.write(RECORDS[0])
        with pytest.raises(ValueError, match="not a legal Kafka topic name"):
            writer.write(SpoolRecord("bad topic", b"v"))
        writer.write(RECORDS[1])
    assert read_spool_file(tmp_path / "partial.ferry") == RECORDS[:2]


def test_a_finished_writer_refuses_more(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "done")
    writer.commit()
    with pytest.raises(ValueError, match="already committed or aborted"):
        writer.write(RECORDS[0])
    with pytest.raises(ValueError, match="already committed or aborted"):
        writer.commit()
    aborted = SpoolWriter(tmp_path, "aborted")
    aborted.abort()
    with pytest.raises(ValueError, match="already committed or aborted"):
        aborted.commit()
    assert os.listdir(tmp_path) == ["done.ferry"]
    assert verify(tmp_path / "done.ferry") == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "plain, non-empty file name"),
        ("a/b", "plain, non-empty file name"),
        (".hidden", "may not start with '.'"),
        ("x" * 200, "longer than 200 bytes"),
    ],
)
def test_bad_names_are_refused(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpoolWriter(tmp_path, name)
    assert os.listdir(tmp_path) == []


def test_a_missing_spool_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="spool directory .* does not exist"):
        SpoolWriter(tmp_path / "missing", "x")


def test_unique_file_names_are_unique_valid_and_sort_by_time() -> None:
    names = [unique_file_name("job-") for _ in range(100)]
    assert len(set(names)) == 100
    assert all(n.startswith("job-") and n.endswith(".ferry") for n in names)
    assert [n[4:24] for n in names] == sorted(n[4:24] for n in names)


def test_a_staged_file_is_finished_but_ignored_until_published(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, "spark-job-00001")
    writer.write_many(RECORDS)
    staged = writer.commit(publish=False)
    assert staged == writer.staged_path
    assert staged.name == f".spark-job-00001.ferry.{writer.token}{STAGED_SUFFIX}"
    assert os.listdir(tmp_path) == [staged.name]  # the temporary file became this one
    assert list_ready_files(tmp_path) == []
    copy = tmp_path / "check" / "staged-copy.ferry"  # readers refuse dot-names themselves
    copy.parent.mkdir()
    shutil.copyfile(staged, copy)
    assert verify(copy) == len(RECORDS)  # complete and fsynced, only not published
    shutil.rmtree(copy.parent)
    writer.abort()  # a no-op once committed: the staged file stays for its publisher
    assert staged.exists()

    path = publish_staged(staged, "spark-job-00001.ferry")
    assert path == tmp_path / "spark-job-00001.ferry"
    assert list_ready_files(tmp_path) == [path]
    assert os.listdir(tmp_path) == [path.name]
    assert read_spool_file(path) == RECORDS


def test_publishing_a_staged_file_replaces_an_earlier_one(tmp_path: Path) -> None:
    write_spool_file(tmp_path, "part", RECORDS[:10])
    writer = SpoolWriter(tmp_path, "part")
    writer.write_many(RECORDS)
    publish_staged(writer.commit(publish=False), "part.ferry")
    assert read_spool_file(tmp_path / "part.ferry") == RECORDS
    assert os.listdir(tmp_path) == ["part.ferry"]


def test_leftovers_of_chosen_names_are_removed_and_nothing_else(tmp_path: Path) -> None:
    staged = SpoolWriter(tmp_path, "job-a-00000")
    staged.write_many(RECORDS)
    staged_path = staged.commit(publish=False)
    pending = SpoolWriter(tmp_path, "job-a-00001")  # a temporary file, never finished
    other = SpoolWriter(tmp_path, "job-b-00000")
    other.write_many(RECORDS)
    other_path = other.commit(publish=False)
    published = write_spool_file(tmp_path, "job-a-00002", RECORDS)
    (tmp_path / ".job-a-00003.ferry.notatoken.staged").write_bytes(b"")  # not a writer's
    assert leftover_final_name(staged_path.name) == "job-a-00000.ferry"
    assert leftover_final_name(pending.temp_path.name) == "job-a-00001.ferry"
    assert leftover_final_name("job-a-00002.ferry") is None

    removed = remove_leftovers(tmp_path, lambda name: name.startswith("job-a-"))
    assert removed == sorted([staged_path, pending.temp_path])
    assert sorted(os.listdir(tmp_path)) == sorted(
        [other_path.name, published.name, ".job-a-00003.ferry.notatoken.staged"]
    )
    with pytest.raises(FileNotFoundError):  # the killed writer's rename now fails
        pending.commit()


# -- publishing over a name that is taken: never replace records the agent has not read ------
def _file(directory: Path, name: str, values: list[bytes]) -> Path:
    """A finished spool file of ``values`` (one block per 10 records) at directory/name."""
    directory.mkdir(exist_ok=True)
    with SpoolWriter(directory, name, replace=False) as w:
        for i in range(0, len(values), 10):
            body = b"".join(encode_record(SpoolRecord("t", v)) for v in values[i:i + 10])
            w.write_block(body, len(values[i:i + 10]))
    return directory / name


def _published(spool: Path) -> dict[str, list[bytes]]:
    return {p.name: [r.value for r in read_spool_file(p)] for p in list_ready_files(spool)}


ROWS = [b"row-%03d" % i for i in range(100)]


@pytest.mark.parametrize(("waiting", "ours", "published"), [
    # a failed attempt's prefix waits; the retry's whole partition replaces it
    (ROWS[:40], ROWS, {"p.ferry": ROWS}),
    # the same file again (a rerun): replaced, nothing changes
    (ROWS, ROWS, {"p.ferry": ROWS}),
    # a killed attempt finishing after the rerun: its prefix adds nothing and is dropped
    (ROWS, ROWS[:40], {"p.ferry": ROWS}),
    # other rows under the same name (a nondeterministic rerun): both kept, ours renamed
    (ROWS[:50], ROWS[50:], {"p.ferry": ROWS[:50], "p.1.ferry": ROWS[50:]}),
])
def test_publishing_never_replaces_records_the_agent_has_not_read(
    tmp_path: Path, waiting: list[bytes], ours: list[bytes], published: dict[str, list[bytes]]
) -> None:
    spool = tmp_path / "spool"
    _file(spool, "p.ferry", waiting)  # published earlier, not yet claimed by the agent
    staged = _file(tmp_path / "task", "p.ferry", ours)
    # Task mode: the writer publishes itself (replace=True); driver mode: publish_staged.
    with SpoolWriter(spool, "p.ferry", replace=True) as w:
        for record in read_spool_file(staged):
            w.write(record)
    assert _published(spool) == published
    assert [n for n in os.listdir(spool) if n.startswith(".")] == []  # nothing left behind


def test_a_staged_file_published_over_other_content_keeps_both(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    _file(spool, "p.ferry", ROWS[:30])
    writer = SpoolWriter(spool, "p.ferry", replace=True)
    writer.write_many(SpoolRecord("t", v) for v in ROWS[30:])
    staged = writer.commit(publish=False)
    assert publish_staged(staged, "p.ferry") == spool / "p.1.ferry"
    assert _published(spool) == {"p.ferry": ROWS[:30], "p.1.ferry": ROWS[30:]}


def test_a_file_written_in_place_under_the_name_is_not_replaced(tmp_path: Path) -> None:
    """Whatever waits under the name and is not a complete spool file (someone writing it in
    place) is never taken for a prefix: ours goes under another name."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "p.ferry").write_bytes(b"FERRYSPL half")
    with SpoolWriter(spool, "p.ferry", replace=True) as w:
        w.write(SpoolRecord("t", b"ours"))
    assert (spool / "p.ferry").read_bytes() == b"FERRYSPL half"
    assert [r.value for r in read_spool_file(spool / "p.1.ferry")] == [b"ours"]
