"""spool_blocks.py: the blocks strategy (binary files straight into the store)."""

from __future__ import annotations

from pathlib import Path

from agent.ingest.spool_batch import BATCH
from agent.ingest.spool_blocks import Blocks, bulk_batches
from agent.signals.limits import Limit, Snapshot
from spool.format import SpoolRecord, encode_file
from spool.reader import BinarySpoolReader
from tests.ingest.spool_parts import parts, progress_of, screen, waits_while_full


def _file(path: Path, records: list[SpoolRecord], block_bytes: int = 4096) -> Path:
    path.write_bytes(encode_file(records, block_bytes=block_bytes))
    return path


def test_batches_are_cut_at_their_weight_and_resume_at_an_index(tmp_path: Path) -> None:
    records = [SpoolRecord("a" if i % 3 else "b", b"%05d" % i + b"v" * 200,
                           timestamp_ms=1) for i in range(3000)]
    path = _file(tmp_path / "f.ferry", records)
    reader = BinarySpoolReader(path)
    reader.verify()
    got = list(bulk_batches(reader, 100, {}, 64 * 1024, screen(path)))
    reader.close()
    ends = [end for _, end, _ in got]
    assert ends == sorted(ends) and ends[-1] == 3000 and len(ends) > 5
    values = [v for runs, _, _ in got for _, vs, _ in runs for v in vs]
    assert len(values) == 2900  # from index 100 on, each once
    assert all(sum(len(v) for _, vs, _ in runs for v in vs) <= 64 * 1024 + 1024
               for runs, _, _ in got)
    assert all(sum(len(vs) for _, vs, _ in runs) <= BATCH for runs, _, _ in got)


def test_what_the_screen_refuses_is_left_out_and_reported_with_its_batch(
    tmp_path: Path
) -> None:
    limits = Snapshot(topics={"t": Limit(max_message_bytes=300)})
    records = [SpoolRecord("t", b"x" * (5000 if i in (3, 7) else 10), timestamp_ms=1)
               for i in range(10)]
    path = _file(tmp_path / "f.ferry", records)
    reader = BinarySpoolReader(path)
    reader.verify()
    got = list(bulk_batches(reader, 0, {}, 1 << 20, screen(path, limits)))
    reader.close()
    assert [no.record for _, _, refused in got for no in refused] == [3, 7]
    assert sum(len(vs) for runs, _, _ in got for _, vs, _ in runs) == 8


def test_a_file_is_stored_in_batches_with_its_progress(tmp_path: Path) -> None:
    records = [SpoolRecord("t", b"%05d" % i, timestamp_ms=1) for i in range(5000)]
    path = _file(tmp_path / "f.ferry", records)
    with parts(tmp_path) as p:
        strategy = Blocks(p.store, p.registry, p.pause, p.stop)
        reader = BinarySpoolReader(path)
        count = reader.verify()
        assert strategy.ingest(reader, 0, progress_of(path, count), 16 * 1024, screen(path))
        reader.close()
        strategy.close()
        assert p.stored("t") == [b"%05d" % i for i in range(5000)]
        progress = p.progress()
        assert progress is not None and progress["next"] == 5000 and progress["done"]
        view = p.registry.view()
        # Counted as the committer counts the groups it commits, as the spool's writer.
        assert view.total("buffer_commits", writer="spool") > 1
        assert view.total("messages_accepted", source="spool", topic="t") == 5000


def test_a_full_buffer_pauses_the_file_until_the_intake_stops(tmp_path: Path) -> None:
    records = [SpoolRecord("t", b"x" * 1000, timestamp_ms=1) for _ in range(200)]
    path = _file(tmp_path / "f.ferry", records)
    with parts(tmp_path, max_bytes=64 * 1024) as p:
        strategy = Blocks(p.store, p.registry, p.pause, p.stop)
        reader = BinarySpoolReader(path)
        count = reader.verify()
        done = waits_while_full(p, lambda: strategy.ingest(
            reader, 0, progress_of(path, count), 1 << 20, screen(path)))
        strategy.close()
        reader.close()
        assert done == [False] and p.stored("t") == [] and p.progress() is None
