"""The blocks strategy of the spool intake: a binary file (``.ferry``) straight into the
store, without the committer and without a Record per message.

Blocks are encoded straight into buffer values (codec.encode_spool_block), and each batch
goes to the store in one transaction with the file's progress, on a commit thread of this
strategy's own: the next batch is encoded on the intake thread while the previous one
commits (the fsync releases the GIL). What the committer counts for the groups it commits
(``buffer_commits``, ``buffer_commit_seconds``, ``messages_accepted``, ``messages_rejected``)
is counted here for these batches, under ``writer``/``source`` ``spool``.

The intake (spool_intake.py) runs the file's lifecycle and hands this strategy the file's
reader from its committed progress on; hand-made files take the records strategy
(spool_records.py).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from agent.buffer import codec
from agent.buffer.codec import encode_spool_block
from agent.buffer.refusals import Refusal
from agent.buffer.store import BufferFull, BufferUnavailable, InvalidGroup, Store
from agent.ingest.spool_batch import BATCH, RETRY_SECONDS, WEIGHT, Pause, Run, Unstorable
from agent.ingest.spool_progress import Progress
from agent.ingest.spool_screen import Refused, Screen
from agent.metrics import Registry
from agent.records import Record, Source
from spool.format import SpoolRecord
from spool.reader import BinarySpoolReader


class Blocks:
    """Binary files, block by block, straight into the store on a commit thread."""

    def __init__(self, store: Store, registry: Registry, pause: Pause,
                 stop: threading.Event) -> None:
        self.store = store
        self.registry = registry
        self.pause = pause
        self.stop = stop
        # Batches commit on this thread while the intake thread encodes the next one.
        self._committing = ThreadPoolExecutor(1, thread_name_prefix="spool-commit")

    def close(self) -> None:
        """Wait for the batch in flight, if any; then no more batches."""
        self._committing.shutdown(wait=True)

    def ingest(
        self, reader: BinarySpoolReader, start: int, progress: Progress, max_batch_bytes: int,
        screen: Screen,
    ) -> bool:
        """The file from record ``start`` on, the bulk way; False if interrupted (what was
        committed stays committed, with its progress)."""
        batches = bulk_batches(reader, start, self.store.generations(), max_batch_bytes,
                                screen)
        in_flight: tuple[Future[Refusal | None], list[Run], dict[bytes, bytes],
                         list[Refused]] | None
        in_flight = None
        try:
            for runs, next_index, refused in batches:
                # As for hand-made files: a batch is handed over only once the previous one
                # is stored, so a refused batch is never overtaken by a later one.
                if in_flight is not None:
                    pending, in_flight = in_flight, None
                    if not self._settle(*pending[:3]):
                        return False
                    screen.count(self.registry, pending[3])
                if self.stop.is_set():
                    return False  # the file resumes from its committed progress next time
                puts = progress.puts(next_index)
                in_flight = (self._committing.submit(self._store_runs, runs, puts), runs, puts,
                             refused)
            if in_flight is not None:
                pending, in_flight = in_flight, None
                if not self._settle(*pending[:3]):
                    return False
                screen.count(self.registry, pending[3])
            return True
        finally:
            if in_flight is not None:
                # Leaving on an error (a malformed block): let the batch in flight finish
                # before the caller quarantines the file or forgets its progress. If it was
                # stored, so was its progress past its records not stored: count them.
                stored = in_flight[0]
                if stored.exception() is None and stored.result() is None:
                    screen.count(self.registry, in_flight[3])

    def _store_runs(self, runs: list[Run], puts: dict[bytes, bytes]) -> Refusal | None:
        """One batch and its progress in one durable transaction; None once stored, or why
        it was refused. Counts what the committer counts for other groups."""
        registry = self.registry
        started = time.perf_counter()
        try:
            self.store.append_encoded(runs, state_puts=puts)
        except InvalidGroup as exc:
            n = sum(len(r[1]) for r in runs)
            registry.inc("messages_rejected", n, source=Source.SPOOL, reason=InvalidGroup.reason)
            registry.sample("rejected", InvalidGroup.reason, {"source": Source.SPOOL,
                                                              "detail": str(exc), "messages": n})
            raise Unstorable(str(exc)) from None
        except (BufferFull, BufferUnavailable) as exc:
            # buffer_full, disk_full (the filesystem's reserve), or the disk's own error: the
            # batch waits in its file (counted by Pause.refused, not as a rejection).
            return exc
        registry.inc("buffer_commits", writer=Source.SPOOL)
        registry.observe("buffer_commit_seconds", time.perf_counter() - started,
                         writer=Source.SPOOL)
        accepted: dict[str, int] = {}
        for topic, values, _ in runs:
            accepted[topic] = accepted.get(topic, 0) + len(values)
        for topic, count in accepted.items():
            registry.inc("messages_accepted", count, source=Source.SPOOL, topic=topic)
        return None

    def _settle(
        self, pending: Future[Refusal | None], runs: list[Run], puts: dict[bytes, bytes]
    ) -> bool:
        """Wait for a batch handed to the commit thread; if it was refused, commit it again
        until it is in."""
        if pending.result() is None:
            return True
        return self._commit(runs, puts)

    def _commit(self, runs: list[Run], puts: dict[bytes, bytes]) -> bool:
        """Commit one batch with its progress; waits while the buffer is full."""
        while not self.stop.is_set():
            refused = self._store_runs(runs, puts)
            if refused is None:
                self.pause.ended()
                return True
            # Intake pauses; the file waits on disk, its progress intact.
            self.pause.refused(refused)
            self.stop.wait(RETRY_SECONDS)
        return False


def _encode_records(
    records: list[SpoolRecord], generations: Mapping[str, int], now_ms: int
) -> list[Run]:
    """Buffer values of decoded spool records (those with headers), in runs of one topic."""
    runs: list[Run] = []
    topic = ""
    values: list[bytes] = []
    generation = 0
    for r in records:
        if r.topic != topic or not runs:
            topic = r.topic
            values = []
            generation = generations.get(topic, 0)
            runs.append((topic, values, generation))
        key = r.key
        values.append(codec.encode(
            Record(topic, r.value, key, r.partition_key, r.timestamp_ms or now_ms, r.headers,
                   key is not None and r.partition_key is None),
            generation))
    return runs


def bulk_batches(
    reader: BinarySpoolReader,
    start: int,
    generations: Mapping[str, int],
    max_bytes: int,
    screen: Screen,
) -> Iterator[tuple[list[Run], int, list[Refused]]]:
    """Batches of encoded runs from index ``start`` on, each with the index of the record
    after it and the records before that index that are not stored (``screen``); cut at
    BATCH messages or once they weigh ``max_bytes``, as ``_batches`` does.

    What a Kafka topic can never take costs a block without such records three integer
    comparisons a record: the bulk encoder compares each record with its topic's
    ``kafka_limits.Bounds`` as it reads its lengths and timestamp anyway, and declines a block
    with a record outside them. Only such a block (rare: a record near or over its topic's
    max.message.bytes, or stamped near or out of its range) is decoded, as a block with
    headers is, and each of its records judged in full (``Screen.refusal``)."""
    now_ms = screen.now_ms
    bounds = screen.bounds or None
    runs: list[Run] = []
    refused: list[Refused] = []
    n = 0
    weight = 0
    next_index = start
    for block in reader.iter_blocks(start, verify_first=False):
        skip = max(start - block.first, 0)
        count = block.record_count - skip
        # An encoded message is shorter than its spool record, so this tells before encoding
        # that the whole block fits into the batch: then its messages can be grouped by topic
        # (a file whose records alternate between topics would otherwise make a run of one
        # message each), since the batch commits whole and each topic keeps its order.
        whole = n + count < BATCH and weight + len(block.body) + WEIGHT * count < max_bytes
        first = block.first + skip
        encoded = encode_spool_block(block.body, block.record_count, skip, generations, now_ms,
                                     reader.topic_of, by_topic=whole, bounds=bounds)
        if encoded is None:
            # Headers, a record its Kafka topic may never take, or something the bulk encoder
            # does not take: the reader decodes the block (raising SpoolFormatError if it is
            # malformed), the records the topics take are encoded by codec.
            placed = _screened_runs(reader.decode_block(block, start), first, screen,
                                    generations, refused)
        else:
            placed = _placed(encoded, first)
        if whole:
            stored = [run for run, _ in placed]
            runs += stored
            n += count
            weight += sum(sum(map(len, values)) for _, values, _ in stored) + WEIGHT * count
            next_index = block.first + block.record_count
            continue
        for (topic, values, generation), run_first in placed:
            i = 0
            while i < len(values):
                room = BATCH - n
                take = values if i == 0 and len(values) <= room else values[i:i + room]
                w = sum(map(len, take)) + WEIGHT * len(take)
                if weight + w >= max_bytes:
                    # Cut after the message that brings the batch to its byte cap.
                    sums = list(itertools.accumulate(len(v) + WEIGHT for v in take))
                    cut = bisect.bisect_left(sums, max_bytes - weight) + 1
                    take = take[:cut]
                    w = sums[cut - 1]
                runs.append((topic, take, generation))
                n += len(take)
                weight += w
                i += len(take)
                next_index = run_first + i
                if n >= BATCH or weight >= max_bytes:
                    yield runs, next_index, _due(refused, next_index)
                    runs, n, weight = [], 0, 0
        # Records of the block not stored, after its last run, are read all the same.
        next_index = block.first + block.record_count
    if runs or refused:
        yield runs, next_index, refused


def _placed(runs: list[Run], first: int) -> list[tuple[Run, int]]:
    """Consecutive runs, each with the file index of its first record (``first``: the
    first run's)."""
    placed = []
    for run in runs:
        placed.append((run, first))
        first += len(run[1])
    return placed


def _screened_runs(
    records: list[SpoolRecord], first: int, screen: Screen, generations: Mapping[str, int],
    refused: list[Refused],
) -> list[tuple[Run, int]]:
    """The encoded runs of the ``records`` (from file index ``first`` on) their Kafka topics
    take, each with its first record's file index; the others are added to ``refused``."""
    if not screen.limits:
        return _placed(_encode_records(records, generations, screen.now_ms), first)
    placed: list[tuple[Run, int]] = []
    kept: list[SpoolRecord] = []
    kept_first = first
    for index, r in enumerate(records, first):
        unfit = screen.refusal(index, r)
        if unfit is None:
            if not kept:
                kept_first = index
            kept.append(r)
            continue
        refused.append(unfit)
        if kept:
            placed += _placed(_encode_records(kept, generations, screen.now_ms), kept_first)
            kept = []
    if kept:
        placed += _placed(_encode_records(kept, generations, screen.now_ms), kept_first)
    return placed


def _due(refused: list[Refused], next_index: int) -> list[Refused]:
    """Take out of ``refused`` (in file order) those before ``next_index``."""
    if not refused or refused[0].record >= next_index:
        return []
    cut = bisect.bisect_left([r.record for r in refused], next_index)
    due = refused[:cut]
    del refused[:cut]
    return due
