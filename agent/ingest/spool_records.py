"""The records strategy of the spool intake: a hand-made file (``.jsonl``, ``.txt``) as
agent Records through the group committer, a batch at a time with the file's progress.

The intake (spool_intake.py) runs the file's lifecycle and hands this strategy the file's
reader from its committed progress on; binary files take the blocks strategy
(spool_blocks.py). The intake also commits a file's last progress through ``commit`` (a
file of no records, or one whose records are all in already), whichever its strategy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import assert_never

from agent.buffer.committer import Committer, Result
from agent.buffer.store import BufferFull, BufferUnavailable, InvalidGroup
from agent.ingest.spool_batch import BATCH, RETRY_SECONDS, WEIGHT, Pause, Unstorable
from agent.ingest.spool_progress import Progress
from agent.ingest.spool_screen import Refused, Screen
from agent.metrics import Registry
from agent.records import Record, Source
from spool.format import SpoolFormatError, SpoolRecord
from spool.reader import SpoolReader


class Records:
    """Hand-made files, record by record, through the committer."""

    def __init__(self, committer: Committer, registry: Registry, pause: Pause,
                 stop: threading.Event) -> None:
        self.committer = committer
        self.registry = registry
        self.pause = pause
        self.stop = stop

    def ingest(
        self, reader: SpoolReader, start: int, progress: Progress, max_batch_bytes: int,
        screen: Screen,
    ) -> bool:
        """The file from record ``start`` on, as agent Records through the committer; False
        if interrupted (what was committed stays committed, with its progress)."""
        records = reader.iter_records(start, verify_first=False)
        in_flight: tuple[_Pending, list[Record], dict[bytes, bytes], list[Refused]] | None
        in_flight = None
        read_to = start
        for batch, next_index, refused in batches(records, BATCH, max_batch_bytes, screen):
            puts = progress.puts(next_index)
            # Submit this batch only once the previous one is known to be stored, so a
            # refused batch can never be overtaken by a later one; reading this batch
            # overlapped with committing the previous one.
            if in_flight is not None and not self._settle_counting(screen, *in_flight):
                return False
            in_flight = (self._submit(batch, puts), batch, puts, refused)
            read_to = next_index
        if in_flight is not None and not self._settle_counting(screen, *in_flight):
            return False
        if read_to < progress.count:
            # Fewer lines than verify() counted: the file was rewritten in place meanwhile
            # (a writer that did not rename it into place). Deleting it now could take
            # lines still being written with it.
            raise SpoolFormatError(f"{progress.count} records counted, {read_to} read")
        return True

    def _submit(self, batch: list[Record], puts: dict[bytes, bytes]) -> _Pending:
        pending = _Pending()
        self.committer.submit(batch, Source.SPOOL, pending.done, state_puts=puts)
        return pending

    def _settle_counting(self, screen: Screen, pending: _Pending, batch: list[Record],
                         puts: dict[bytes, bytes], refused: list[Refused]) -> bool:
        """``_settle``, then count the records of the batch's stretch of the file that were
        not stored: only once the progress past them is committed, so a batch tried again
        (a full buffer) or a file resumed later counts each of them once."""
        if not self._settle(pending, batch, puts):
            return False
        screen.count(self.registry, refused)
        return True

    def _settle(self, pending: _Pending, batch: list[Record], puts: dict[bytes, bytes]) -> bool:
        """Wait for a submitted batch; if it was refused, commit it again until it is in."""
        pending.event.wait()
        match pending.result:
            case list():
                return True
            case InvalidGroup() as refused:
                # Refused for good, and already counted by the committer: committing it
                # again would only count its records a second time.
                raise Unstorable(str(refused))
            case BufferFull() | BufferUnavailable():
                return self.commit(batch, puts)
            case None:
                raise AssertionError("the writer set no result")
            case _:
                assert_never(pending.result)

    def commit(self, batch: list[Record], puts: dict[bytes, bytes]) -> bool:
        """Commit one batch with its progress; waits while the buffer is full. False if the
        intake stops meanwhile."""
        while not self.stop.is_set():
            result = self.committer.commit(batch, Source.SPOOL, state_puts=puts)
            match result:
                case list():
                    self.pause.ended()
                    return True
                case InvalidGroup():
                    # Counted (reason unencodable) by the committer.
                    raise Unstorable(str(result))
                case BufferFull() | BufferUnavailable():
                    # Intake pauses; the file waits on disk, its progress intact.
                    self.pause.refused(result)
                    self.stop.wait(RETRY_SECONDS)
                case _:
                    assert_never(result)
        return False


class _Pending:
    """A submitted batch's outcome, filled in by the writer thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Result | None = None  # set before ``event``

    def done(self, result: Result) -> None:
        self.result = result
        self.event.set()


def batches(
    records: Iterator[tuple[int, SpoolRecord]], size: int, max_bytes: int, screen: Screen
) -> Iterator[tuple[list[Record], int, list[Refused]]]:
    """Groups of agent Records, each with the index of the record after it and the records
    before that index that are not stored (``screen``: their Kafka topic never takes them).
    A group may be empty: its progress still passes the records left out."""
    now_ms = screen.now_ms
    limited = bool(screen.limits)
    batch: list[Record] = []
    refused: list[Refused] = []
    weight = 0
    last = -1
    for last, r in records:
        if limited:
            unfit = screen.refusal(last, r)
            if unfit is not None:
                refused.append(unfit)
                continue
        key = r.key
        batch.append(Record(r.topic, r.value, key, r.partition_key, r.timestamp_ms or now_ms,
                            r.headers, key is not None and r.partition_key is None))
        weight += len(r.value) + WEIGHT
        if len(batch) >= size or weight >= max_bytes:
            yield batch, last + 1, refused
            batch, refused = [], []
            weight = 0
    if batch or refused:
        yield batch, last + 1, refused
