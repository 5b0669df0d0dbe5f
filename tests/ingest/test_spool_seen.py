"""What the intake does with a binary file whose name it ingested before, by content."""

from __future__ import annotations

import collections
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.ingest.spool_seen import Seen, decide, probe_for
from spool.format import SpoolRecord, encode_file
from spool.reader import BinarySpoolReader

Rows = list[bytes]


def fingerprint(tmp: Path, rows: Rows, block_bytes: int, probe: int | None) -> object:
    path = tmp / "f.ferry"
    path.write_bytes(encode_file([SpoolRecord("t", v, timestamp_ms=1) for v in rows],
                                 block_bytes=block_bytes))
    return BinarySpoolReader(path).fingerprint(probe)


def ingest_twice(tmp: Path, a: Rows, a_block: int, b: Rows, b_block: int) -> tuple[
        collections.Counter[bytes], str]:
    """What the intake buffers from file ``a`` and then file ``b`` of the same name."""
    fa = fingerprint(tmp, a, a_block, None)
    first = decide(None, fa)  # type: ignore[arg-type]
    assert first.outcome == "new" and first.start == 0 and first.remember is not None
    seen = Seen.decode(first.remember.encode())  # as it comes back from the buffer's state
    assert seen == first.remember
    fb = fingerprint(tmp, b, b_block, probe_for(seen))
    second = decide(seen, fb)  # type: ignore[arg-type]
    return collections.Counter(a + b[second.start:]), second.outcome


rows_st = st.lists(st.binary(min_size=0, max_size=40), min_size=1, max_size=60)
block_st = st.sampled_from([1, 40, 100, 1 << 20])


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=rows_st, cut=st.integers(0, 60), a_block=block_st, b_block=block_st)
def test_a_prefix_then_the_whole_file_ingests_every_row_once(
    tmp_path: Path, rows: Rows, cut: int, a_block: int, b_block: int
) -> None:
    """A task failing upstream of the writer publishes a prefix; its retry the whole."""
    prefix = rows[: min(cut, len(rows))] or rows[:1]
    got, outcome = ingest_twice(tmp_path, prefix, a_block, rows, b_block)
    assert got == collections.Counter(rows)
    assert outcome == ("duplicate" if len(prefix) == len(rows) else "extension")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=rows_st, cut=st.integers(1, 60), block=block_st)
def test_the_whole_file_then_a_prefix_cut_at_a_block_ingests_nothing_twice(
    tmp_path: Path, rows: Rows, cut: int, block: int
) -> None:
    """A shorter attempt published after the whole file (a killed speculative attempt) adds
    nothing, when it ends where a block of the whole file ends (the writer cuts blocks at the
    same rows for the same input)."""
    fw = fingerprint(tmp_path, rows, block, None)
    ends = [m.records for m in fw.marks]  # type: ignore[attr-defined]
    prefix = rows[: ends[min(cut, len(ends)) - 1]]
    got, outcome = ingest_twice(tmp_path, rows, block, prefix, block)
    assert outcome == "duplicate"
    assert got == collections.Counter(rows)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=rows_st, b=rows_st, a_block=block_st, b_block=block_st)
def test_other_content_under_the_same_name_is_never_lost(
    tmp_path: Path, a: Rows, b: Rows, a_block: int, b_block: int
) -> None:
    """Whatever the two files hold, every row of each is ingested at least once; rows are
    skipped only when the second file starts with exactly the bytes of the first."""
    got, outcome = ingest_twice(tmp_path, a, a_block, b, b_block)
    for row, n in (collections.Counter(a) | collections.Counter(b)).items():
        assert got[row] >= n
    if outcome == "diverged":
        assert got == collections.Counter(a + b)
    if outcome in ("duplicate", "extension") and len(b) >= len(a):
        assert b[: len(a)] == a


def test_an_entry_without_content_fingerprints_is_taken_as_never_seen() -> None:
    """Entries written before fingerprints (size and count only) prove nothing: such a name's
    file is ingested whole rather than skipped on a size match."""
    assert Seen.decode(b'{"size": 120, "count": 3, "at": 1700000000}') is None
    assert Seen.decode(b"not json") is None
    assert Seen.decode(None) is None
