"""spool_progress.py: what a spool file's batches commit, and reading it back."""

from __future__ import annotations

import json
from pathlib import Path

from agent.ingest.spool_progress import Identity, Progress, load
from agent.ingest.spool_seen import Seen


def test_the_progress_says_done_at_the_last_index_and_only_then_remembers_the_file(
    tmp_path: Path
) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    ident = Identity.of(path)
    seen = Seen(records=3, size=10, digest="d", marks=(), at=1.0)
    progress = Progress(b"spool:0:f", ident, 3, b"spool-seen:0:f", seen)
    middle = progress.puts(2)
    assert list(middle) == [b"spool:0:f"]
    assert json.loads(middle[b"spool:0:f"]) == {
        "identity": [ident.inode, ident.size, ident.mtime_ns], "next": 2, "done": False,
        "count": 3}
    last = progress.puts(3)
    assert load(last[b"spool:0:f"]) == {"identity": ident.doc(), "next": 3, "done": True,
                                        "count": 3}
    assert Seen.decode(last[b"spool-seen:0:f"]) == seen


def test_another_file_under_the_name_has_another_identity(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    first = Identity.of(path)
    other = tmp_path / "g"
    other.write_bytes(b"yy")
    other.replace(path)
    assert Identity.of(path) != first


def test_what_is_not_a_progress_record_reads_as_none() -> None:
    assert load(None) is None
    assert load(b"not json") is None
    assert load(b"[1, 2]") is None
    assert load(b'{"next": 1}') == {"next": 1}
