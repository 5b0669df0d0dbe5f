"""What a queued record weighs against the committer's ``max_pending_bytes``.

A record costs more than its key and value while it waits (its Record or encoded value, the
submission's lists), and a flood of empty messages must still fill the queue. Sources that
size their own batches against that limit (spool intake) use the same figure, so that a batch
they think fits is not held back by the committer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agent.records import Record

# Bytes a queued record weighs beyond its key and value.
RECORD_OVERHEAD_BYTES = 64


def records_weight(records: Sequence[Record]) -> int:
    """The weight of a group of records: what ``Record.size`` adds up, without a property
    call per record (big batches), plus the overhead of each."""
    return (sum([len(r.value) + len(r.key) if r.key else len(r.value) for r in records])
            + RECORD_OVERHEAD_BYTES * len(records))


def values_weight(values: Sequence[bytes]) -> int:
    """The weight of encoded values (each a whole stored record)."""
    return sum(map(len, values)) + RECORD_OVERHEAD_BYTES * len(values)


def runs_weight(runs: Iterable[tuple[str, Sequence[bytes], int]]) -> int:
    """The weight of an encoded group's ``(topic, values, generation)`` runs."""
    return sum([values_weight(values) for _, values, _ in runs])
