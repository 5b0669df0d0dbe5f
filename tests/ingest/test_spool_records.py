"""spool_records.py: the records strategy (hand-made files through the committer)."""

from __future__ import annotations

from pathlib import Path

from agent.ingest.spool_records import Records, batches
from agent.signals.limits import Limit, Snapshot
from spool.format import SpoolRecord
from spool.reader import open_spool_file
from tests.ingest.spool_parts import parts, progress_of, screen, waits_while_full


def test_batches_are_cut_at_their_count_and_their_weight(tmp_path: Path) -> None:
    records = enumerate(SpoolRecord("t", b"v" * 100) for _ in range(10))
    by_count = list(batches(records, 4, 1 << 20, screen(tmp_path)))
    assert [(len(b), end) for b, end, _ in by_count] == [(4, 4), (4, 8), (2, 10)]
    records = enumerate(SpoolRecord("t", b"v" * 100) for _ in range(10))
    # Each record weighs its value and the committer's overhead: the cap is reached at
    # the record that brings the batch to it.
    by_weight = list(batches(records, 100, 250, screen(tmp_path)))
    assert all(len(b) <= 3 for b, _, _ in by_weight)
    assert sum(len(b) for b, _, _ in by_weight) == 10 and by_weight[-1][1] == 10


def test_what_the_screen_refuses_goes_with_the_batch_its_progress_passes(
    tmp_path: Path
) -> None:
    limits = Snapshot(topics={"t": Limit(max_message_bytes=200)})
    values = [b"small", b"x" * 5000, b"small", b"y" * 5000, b"y" * 5000]
    got = list(batches(enumerate(SpoolRecord("t", v) for v in values), 1, 1 << 20,
                       screen(tmp_path, limits)))
    assert [([r.value for r in b], end, [no.record for no in refused])
            for b, end, refused in got] == [
        ([b"small"], 1, []), ([b"small"], 3, [1]),
        # Nothing left to store after the last: an empty batch still carries its progress.
        ([], 5, [3, 4])]
    assert {no.reason for _, _, refused in got for no in refused} == {"too_large_for_topic"}


def test_a_file_is_stored_in_order_with_its_progress(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    path = tmp_path / "t" / "lines.txt"
    path.write_text("".join(f"line {i}\n" for i in range(2500)))
    with parts(tmp_path) as p:
        reader = open_spool_file(path)
        count = reader.verify()
        strategy = Records(p.committer, p.registry, p.pause, p.stop)
        # From a resumed index on: what came before is in already.
        assert strategy.ingest(reader, 500, progress_of(path, count), 4096, screen(path))
        reader.close()
        assert p.stored("t") == [b"line %d" % i for i in range(500, 2500)]
        progress = p.progress()
        assert progress is not None and progress["next"] == 2500 and progress["done"]
        assert p.registry.view().total("messages_accepted", source="spool") == 2000


def test_a_full_buffer_pauses_the_file_until_the_intake_stops(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    path = tmp_path / "t" / "big.txt"
    path.write_text("".join("x" * 1000 + "\n" for _ in range(100)))
    with parts(tmp_path, max_bytes=64 * 1024) as p:
        reader = open_spool_file(path)
        count = reader.verify()
        strategy = Records(p.committer, p.registry, p.pause, p.stop)
        done = waits_while_full(p, lambda: strategy.ingest(
            reader, 0, progress_of(path, count), 1 << 20, screen(path)))
        reader.close()
        assert done == [False] and p.stored("t") == [] and p.progress() is None
