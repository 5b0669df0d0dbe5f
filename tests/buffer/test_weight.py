"""agent/buffer/weight.py: what a queued record weighs against max_pending_bytes."""

from __future__ import annotations

from pathlib import Path

from agent.buffer.committer import Committer
from agent.buffer.store import Store
from agent.buffer.weight import (
    RECORD_OVERHEAD_BYTES,
    records_weight,
    runs_weight,
    values_weight,
)
from agent.metrics import Registry
from agent.records import Record


def test_a_record_weighs_its_key_and_value_and_the_overhead() -> None:
    records = [Record("t", b"abc", key=b"kk"), Record("t", b""), Record("u", b"x" * 100)]
    assert records_weight(records) == sum(r.size for r in records) + 3 * RECORD_OVERHEAD_BYTES
    assert records_weight([]) == 0
    # An empty message still weighs something: a flood of them must fill the queue.
    assert records_weight([Record("t", b"")]) == RECORD_OVERHEAD_BYTES > 0


def test_encoded_values_and_runs_weigh_their_bytes_and_the_overhead() -> None:
    assert values_weight([b"ab", b"cde"]) == 5 + 2 * RECORD_OVERHEAD_BYTES
    assert runs_weight([("t", [b"ab"], 0), ("u", [b"cde", b""], 3)]) == (
        5 + 3 * RECORD_OVERHEAD_BYTES)


def test_the_committer_queues_by_that_weight(tmp_path: Path) -> None:
    """Empty messages weigh only the overhead: ten of them fill a queue of ten overheads,
    and a submission is refused once the queue is over it (not at it)."""
    with Store(tmp_path / "b", 64 * 1024 * 1024) as store:
        limit = 10 * RECORD_OVERHEAD_BYTES
        committer = Committer(store, registry=Registry(), max_pending_bytes=limit)
        # Not started: what is submitted stays queued.
        assert committer.submit([Record("t", b"") for _ in range(10)], "http", block=False)
        # At the limit, not over it: still taken.
        assert committer.submit([Record("t", b"")], "http", block=False) is True
        # Now 11 records' weight is queued, over the limit: refused without waiting.
        assert committer.submit([Record("t", b"")], "http", block=False) is False
        committer.start()
        committer.close()
