"""Spool directory intake: files dropped by people, scripts and Spark jobs, into the buffer.

A file is first **claimed**: renamed into the agent's own ``<spool>/.ingesting/`` under the
same relative path. From then on nobody else writes that name, so a file replaced at its old
name (``os.replace``, as a retried Spark task does) is a new file, read in its turn, and the
file the agent removes is always the one it read. A file is ingested in batches; each batch
commits together with the file's progress (its name, identity and the index of the next
record) in one LMDB transaction, so a crash at any point neither loses nor duplicates a record:
after a restart the claimed file resumes at the recorded index. Once the last batch is in, the
progress says "done" and the claimed file is deleted (or moved to ``done/``).

Binary files are remembered by name and *content* (``spool_seen``): a file that comes again
under a name already ingested is skipped if it holds the same records, ingested only beyond the
prefix already ingested if it extends them, and ingested whole (counted, logged) if it differs.

Files that break the format go to ``quarantine/`` with a ``.reason`` file beside them, before
any of their records is ingested (``verify`` checks a whole file first). A record its Kafka
topic can never take (the topic's limits as the forwarder learnt them) is left out, counted
and logged, and the rest of its file ingested (``_Screen``): a valid file is not corrupt. The
watchdog observer wakes the intake thread on new files; a periodic scan catches what inotify
misses.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, assert_never

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from agent import reasons
from agent.buffer import codec
from agent.buffer.codec import encode_spool_block
from agent.buffer.committer import Result, ShuttingDown
from agent.buffer.refusals import Refusal
from agent.buffer.store import BufferFull, BufferUnavailable, InvalidGroup
from agent.buffer.weight import RECORD_OVERHEAD_BYTES
from agent.ingest import kafka_limits
from agent.ingest.runtime import Runtime
from agent.ingest.spool_seen import Seen, decide, probe_for
from agent.metrics import Registry
from agent.process.log_limit import LogLimit
from agent.records import Record, Source
from agent.signals.limits import Snapshot
from spool.format import EXTENSION, SpoolFormatError, SpoolRecord
from spool.reader import (
    BinarySpoolReader,
    SpoolReader,
    list_ready_files,
    list_stale_temp_files,
    list_unrecognized_files,
    open_spool_file,
)
from spool.writer import fsync_dir

log = logging.getLogger(__name__)

BATCH = 20000
PROGRESS = b"spool:"  # state key prefix: spool:<dir index>:<relative path>
SEEN = b"spool-seen:"  # binary files fully ingested, by name, for de-duplication
# The agent's own directory in each spool directory: files claimed for intake, under their
# relative path. A leading dot: the listing never offers it, and no topic can be named so.
CLAIMED = ".ingesting"
# A hand-made file modified more recently than this may still be being written.
SETTLE_SECONDS = 1.0
# A binary file that fails verification this soon after its last change is retried later
# (a writer may still be writing it in place) rather than quarantined.
CORRUPT_GRACE_SECONDS = 10.0
# Staged Spark files (``.NAME.TOKEN.staged``) wait for their job's commit on the driver.
STAGED_SUFFIX = ".staged"


@dataclass(frozen=True)
class Identity:
    """What tells one file from another file later written under the same name."""

    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Identity:
        st = path.stat()
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


class _Wake(FileSystemEventHandler):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("created", "moved", "closed", "modified"):
            self.event.set()


class SpoolIntake:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.config = runtime.config.spool
        self.committer = runtime.committer
        self.store = runtime.store
        self.registry = runtime.registry
        self.dirs = [Path(d) for d in self.config.dirs]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._reported: set[tuple[Path, str]] = set()  # files _failed() counted and logged
        self._unrecognized: set[Path] = set()  # as of the last scan
        # When the intake thread must look again at a file left for later (a hand-made file
        # still settling, a binary one perhaps still being written): one deadline, the
        # earliest, that the loop's own wait honours. A timer per such file would start a
        # thread per file on every scan (a burst of fresh files, as many threads).
        self._recheck_at: float | None = None  # time.monotonic()
        self._observer: Any = None
        self._thread = threading.Thread(target=self._run, name="spool-intake", daemon=True)
        self._pause = _Pause(self.registry)
        # Records not stored because their Kafka topic never takes them: a log line a minute
        # per topic and reason (each is counted and sampled).
        self._refusals = LogLimit(log)
        # Binary files' batches commit on this thread while the intake thread encodes the
        # next one (the fsync releases the GIL).
        self._committing = ThreadPoolExecutor(1, thread_name_prefix="spool-commit")

    def start(self) -> None:
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        observer = Observer()
        handler = _Wake(self._wake)
        for d in self.dirs:
            observer.schedule(handler, str(d), recursive=True)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
        if self._thread.is_alive():
            self._thread.join(30.0)
        if self._observer is not None:
            self._observer.join(5.0)
        self._committing.shutdown(wait=True)

    def wake(self) -> None:
        """Scan now (tests and the CLI use it; the observer does it on file events)."""
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        next_cleanup = 0.0
        while not self._stop.is_set():
            try:
                self.scan_once()
                if time.monotonic() >= next_cleanup:
                    self._cleanup()
                    next_cleanup = time.monotonic() + 600
            except ShuttingDown:
                return
            except Exception:  # noqa: BLE001 - the intake thread must survive any one file
                log.exception("spool scan failed")
            self._wake.wait(self._until_next_scan())
            self._wake.clear()

    def _until_next_scan(self) -> float:
        """Seconds the loop waits for a file event before it scans again: the scan interval,
        or less when a file left for later is due sooner. The deadline is spent here: the next
        scan sets a new one for what it leaves for later again."""
        wait = self.config.scan_interval_seconds
        due, self._recheck_at = self._recheck_at, None
        if due is not None:
            wait = min(wait, max(0.0, due - time.monotonic()))
        return wait

    def scan_once(self) -> int:
        """Ingest every ready file once, files already claimed first; returns how many were
        finished."""
        pending: list[tuple[int, Path, Path, bool]] = []
        for i, d in enumerate(self.dirs):
            pending += [(i, d, f, True) for f in _claimed_files(d)]
            pending += [(i, d, f, False) for f in list_ready_files(d)]
        self.registry.set("spool_files_pending", float(len(pending)))
        self._forget_reported_gone({path for _, _, path, _ in pending})
        self._warn_unrecognized()
        finished = 0
        for n, (index, root, path, claimed) in enumerate(pending):
            if self._stop.is_set():
                break
            try:
                if claimed:
                    done = self._ingest(index, root, path)
                else:
                    taken = self._claim(root, path)
                    done = taken is not None and self._ingest(index, root, taken)
                if done:
                    finished += 1
            except ShuttingDown:
                raise
            except Exception:  # noqa: BLE001 - one file's trouble must not starve the others
                self._failed(path, "error", "could not be handled; it stays and is tried "
                             "again", exc_info=True)
            self.registry.set("spool_files_pending", float(len(pending) - n - 1))
        return finished

    def _warn_unrecognized(self) -> None:
        """Files dropped where the intake never looks (a .txt in the spool root, a .csv, a
        directory whose name is no topic): counted, and each logged once, so they are not
        left behind unnoticed."""
        found = {f for d in self.dirs for f in list_unrecognized_files(d)}
        self.registry.set("spool_files_unrecognized", float(len(found)))
        new, self._unrecognized = found - self._unrecognized, found
        for path in sorted(new):
            log.warning("spool file %s is not where Ferry reads files (binary .ferry files "
                            "in the spool directory or a topic directory; .jsonl/.txt in a "
                            "topic directory, docs/spool.md): it is left alone", path)

    def _forget_reported_gone(self, listed: set[Path]) -> None:
        """Forget the failures of files the scan no longer lists (removed by someone, or
        finished, quarantined or claimed by the intake), so that what ``_failed`` remembers
        is bounded by the files present, and a new file later made under such a name is
        counted and logged as the new file it is. A failing file stays listed, claimed or
        not (``_failed`` is only given paths a scan lists: a file at its name, or in
        ``.ingesting/``), so it is still logged once."""
        if self._reported:
            self._reported = {r for r in self._reported if r[0] in listed}

    def _failed(self, path: Path, reason: str, detail: str, exc_info: bool = False) -> None:
        """Count a file Ferry cannot finish with and log it at ERROR, once per file and reason
        (it stays where it is and is tried again every scan; later failures log at DEBUG)."""
        first = (path, reason) not in self._reported
        if first:
            self._reported.add((path, reason))
            self.registry.inc("spool_files_failed", reason=reason)
        log.log(logging.ERROR if first else logging.DEBUG, "spool file %s: %s", path, detail,
                exc_info=exc_info and first)

    # -- one file --------------------------------------------------------------------------
    def _key(self, prefix: bytes, index: int, name: str) -> bytes:
        # fsencode: a file name need not be UTF-8; its bytes come back as they were.
        return prefix + os.fsencode(f"{index}:{name}")

    def _claim(self, root: Path, path: Path) -> Path | None:
        """Rename a ready file into ``.ingesting/`` (same relative path): from here on the
        agent reads, and later removes, only that file, whatever appears at the old name.
        None if it is not to be taken now."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        age = time.time() - st.st_mtime
        if path.suffix != EXTENSION and age < SETTLE_SECONDS:
            # A hand-made file may still be being written in place: looked at again once it
            # settles (at most SETTLE_SECONDS away, even if its time is in the future).
            self._wake_later(min(SETTLE_SECONDS - age, SETTLE_SECONDS))
            return None
        rel = path.relative_to(root)
        target = root / CLAIMED / rel
        if target.exists():
            # An earlier file of that name is still being ingested (it resumes first); this
            # one waits where it is, never over it.
            return None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, target)
        except FileNotFoundError:
            return None  # taken away meanwhile
        except OSError as exc:
            self._failed(path, "unremovable", "cannot be claimed for intake (renamed into "
                         f"{root / CLAIMED}): {exc.strerror or exc}; it is not read until it "
                         "can be: make its directory writable for the ferry group "
                         "(docs/spool.md)")
            return None
        self._reported.discard((path, "unremovable"))
        # Durable before any of it is committed: after a power loss the file is either still
        # at its name or claimed, with the progress that goes with its identity either way.
        with contextlib.suppress(OSError):
            fsync_dir(target.parent)
            fsync_dir(path.parent)
        return target

    def _ingest(self, index: int, root: Path, path: Path) -> bool:
        """Ingest a claimed file (``root/.ingesting/NAME``) from its committed progress on,
        then remove it; False if it is not finished now (it stays claimed)."""
        name = path.relative_to(root / CLAIMED).as_posix()
        try:
            ident = Identity.of(path)
        except FileNotFoundError:
            return False
        age = time.time() - ident.mtime_ns / 1e9
        binary = path.suffix == EXTENSION
        key = self._key(PROGRESS, index, name)
        seen_key = self._key(SEEN, index, name)
        progress = _load(self.store.get_state(key))
        resuming = progress is not None and progress.get("identity") == _ident_doc(ident)
        if resuming and progress is not None and progress.get("done"):
            # A crash came between "done" and the delete, or the delete was refused.
            return self._finish(root, path, key)
        start = int(progress["next"]) if resuming and progress is not None else 0
        seen = self._seen(seen_key) if binary else None
        reader = open_spool_file(path)
        try:
            try:
                if isinstance(reader, BinarySpoolReader):
                    fp = reader.fingerprint(probe_for(seen))
                    count = fp.records
                else:
                    count = reader.verify()
            except SpoolFormatError as exc:
                if binary and age < CORRUPT_GRACE_SECONDS:
                    self._wake_later(SETTLE_SECONDS)
                    return False  # perhaps still being written in place: look again later
                self._quarantine(root, path, key, reasons.CORRUPT, str(exc))
                return False
            except OSError as exc:
                log.warning("cannot read spool file %s: %s", path, exc)
                return False
            except Exception as exc:  # noqa: BLE001 - a reader bug must not block the spool
                log.exception("spool file %s could not be read", path)
                self._quarantine(root, path, key, reasons.UNREADABLE,
                                 f"{type(exc).__name__}: {exc}")
                return False
            remember: Seen | None = None
            if isinstance(reader, BinarySpoolReader) and self.config.dedup_retention_seconds:
                decision = decide(seen, fp)
                remember = decision.remember
                if not resuming:
                    start = decision.start
                    self._report_repeat(path, decision.outcome, seen, count, start)
                    if decision.outcome == "duplicate":
                        return self._finish(root, path, None)
            # A batch must fit in an empty buffer, or it could never be committed.
            limit = self.runtime.config.buffer.max_bytes
            max_batch_bytes = max(64 * 1024, min(8 << 20, limit // 8))
            tracker = _Progress(key, ident, count, seen_key if remember else None, remember)
            # What the Kafka topics can never take is not stored (counted, sampled, logged as
            # the other sources do); the rest of the file is ingested as usual.
            screen = _Screen(self.runtime.limits.current(), int(time.time() * 1000),
                             root / name, self._refusals)
            if isinstance(reader, BinarySpoolReader):
                if not self._ingest_blocks(reader, start, tracker, max_batch_bytes, screen):
                    return False
            elif not self._ingest_records(reader, start, tracker, max_batch_bytes, screen):
                return False
            if (count == 0 or start >= count) and not self._commit([], tracker.puts(count)):
                return False
            if Identity.of(path) != ident:
                # Written to in place while it was read (a writer that does not rename its
                # files into place): what was committed stays, the file is kept whole.
                raise SpoolFormatError("the file was modified in place while it was read")
        except SpoolFormatError as exc:
            # verify() passed, so the file changed under us; what was committed stays, the
            # rest is quarantined with the index it stopped at.
            self._quarantine(root, path, key, reasons.CORRUPT, f"changed while being read: {exc}")
            return False
        except _Unstorable as exc:
            # The buffer refuses a record of it for good (e.g. a header name it cannot
            # encode): waiting cannot help, and the files behind it must not wait for ever.
            self._quarantine(root, path, key, InvalidGroup.reason, str(exc))
            return False
        finally:
            reader.close()
        self.registry.inc("spool_files_ingested")
        return self._finish(root, path, key)

    def _seen(self, seen_key: bytes) -> Seen | None:
        seen = Seen.decode(self.store.get_state(seen_key))
        if seen is None or seen.age_at(time.time()) > self.config.dedup_retention_seconds:
            return None
        return seen

    def _report_repeat(
        self, path: Path, outcome: str, seen: Seen | None, count: int, start: int
    ) -> None:
        """Count and log a file whose name was ingested before; nothing for a new name."""
        if seen is None or outcome == "new":
            return
        skipped = min(start, count)
        if skipped:
            self.registry.inc("spool_records_skipped", skipped, reason=outcome)
        if outcome == "duplicate":
            self.registry.inc("spool_files_duplicate")
            log.info("spool file %s: its %d records were ingested before under this name "
                     "(same content): removed without ingesting them again", path, count)
        elif outcome == "extension":
            self.registry.inc("spool_files_extended")
            log.info("spool file %s: its first %d records were ingested before under this "
                     "name (same content; a retried task): ingesting records %d to %d",
                     path, start, start, count - 1)
        else:
            self.registry.inc("spool_files_diverged")
            log.warning("spool file %s: a file of this name was ingested before (%d records) "
                        "with other content (a nondeterministic Spark plan, or a name used "
                        "again): all %d records are ingested; some may be duplicates",
                        path, seen.records, count)

    def _ingest_records(
        self, reader: SpoolReader, start: int, progress: _Progress, max_batch_bytes: int,
        screen: _Screen,
    ) -> bool:
        """A hand-made file, as agent Records through the committer; False if interrupted."""
        records = reader.iter_records(start, verify_first=False)
        in_flight: tuple[_Pending, list[Record], dict[bytes, bytes], list[_Refused]] | None
        in_flight = None
        read_to = start
        for batch, next_index, refused in _batches(records, BATCH, max_batch_bytes, screen):
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

    def _ingest_blocks(
        self, reader: BinarySpoolReader, start: int, progress: _Progress, max_batch_bytes: int,
        screen: _Screen,
    ) -> bool:
        """A binary file, the bulk way: blocks are encoded straight into buffer values
        (codec.encode_spool_block), without a Record per message, and each batch goes to the
        store in one transaction with the file's progress. The next batch is encoded while
        the previous one commits on the commit thread. False if interrupted (what was
        committed stays committed, with its progress)."""
        batches = _bulk_batches(reader, start, self.store.generations(), max_batch_bytes,
                                screen)
        in_flight: tuple[Future[Refusal | None], list[_Run], dict[bytes, bytes],
                         list[_Refused]] | None
        in_flight = None
        try:
            for runs, next_index, refused in batches:
                # As for hand-made files: a batch is handed over only once the previous one
                # is stored, so a refused batch is never overtaken by a later one.
                if in_flight is not None:
                    pending, in_flight = in_flight, None
                    if not self._settle_bulk(*pending[:3]):
                        return False
                    screen.count(self.registry, pending[3])
                if self._stop.is_set():
                    return False  # the file resumes from its committed progress next time
                puts = progress.puts(next_index)
                in_flight = (self._committing.submit(self._store_runs, runs, puts), runs, puts,
                             refused)
            if in_flight is not None:
                pending, in_flight = in_flight, None
                if not self._settle_bulk(*pending[:3]):
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

    def _store_runs(self, runs: list[_Run], puts: dict[bytes, bytes]) -> Refusal | None:
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
            raise _Unstorable(str(exc)) from None
        except (BufferFull, BufferUnavailable) as exc:
            # buffer_full, disk_full (the filesystem's reserve), or the disk's own error: the
            # batch waits in its file (counted by _Pause.refused, not as a rejection).
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

    def _settle_bulk(
        self, pending: Future[Refusal | None], runs: list[_Run], puts: dict[bytes, bytes]
    ) -> bool:
        """Wait for a batch handed to the commit thread; if it was refused, commit it again
        until it is in."""
        if pending.result() is None:
            return True
        return self._commit_bulk(runs, puts)

    def _commit_bulk(self, runs: list[_Run], puts: dict[bytes, bytes]) -> bool:
        """Commit one batch with its progress; waits while the buffer is full."""
        while not self._stop.is_set():
            refused = self._store_runs(runs, puts)
            if refused is None:
                self._pause.ended()
                return True
            # Intake pauses; the file waits on disk, its progress intact.
            self._pause.refused(refused)
            self._stop.wait(0.5)
        return False

    def _submit(self, batch: list[Record], puts: dict[bytes, bytes]) -> _Pending:
        pending = _Pending()
        self.committer.submit(batch, Source.SPOOL, pending.done, state_puts=puts)
        return pending

    def _settle_counting(self, screen: _Screen, pending: _Pending, batch: list[Record],
                         puts: dict[bytes, bytes], refused: list[_Refused]) -> bool:
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
                raise _Unstorable(str(refused))
            case BufferFull() | BufferUnavailable():
                return self._commit(batch, puts)
            case None:
                raise AssertionError("the writer set no result")
            case _:
                assert_never(pending.result)

    def _commit(self, batch: list[Record], puts: dict[bytes, bytes]) -> bool:
        """Commit one batch with its progress; waits while the buffer is full."""
        while not self._stop.is_set():
            result = self.committer.commit(batch, Source.SPOOL, state_puts=puts)
            match result:
                case list():
                    self._pause.ended()
                    return True
                case InvalidGroup():
                    # Counted (reason unencodable) by the committer.
                    raise _Unstorable(str(result))
                case BufferFull() | BufferUnavailable():
                    # Intake pauses; the file waits on disk, its progress intact.
                    self._pause.refused(result)
                    self._stop.wait(0.5)
                case _:
                    assert_never(result)
        return False

    def _finish(self, root: Path, path: Path, key: bytes | None) -> bool:
        """Delete (or move to done/) a claimed file that was ingested, then forget its
        progress; False when it cannot be removed (it stays, marked done, and is tried again
        next scan)."""
        name = path.relative_to(root / CLAIMED)
        try:
            if self.config.after_ingest == "move":
                target = _unused(root / "done" / name)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._failed(path, "unremovable", "ingested, but it cannot be "
                         f"{'moved' if self.config.after_ingest == 'move' else 'deleted'}: "
                         f"{exc.strerror or exc}")
            return False
        self._reported.discard((path, "unremovable"))
        log.info("spool file %s %s", root / name,
                 "moved to done/" if self.config.after_ingest == "move" else "removed")
        # The delete (or move) made durable before the progress is forgotten: after a power
        # loss the file must not come back without its "done", to be read a second time.
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)
            if self.config.after_ingest == "move":
                fsync_dir((root / "done" / name).parent)
        if key is not None:
            self.store.update_state(deletes=[key])
        return True

    def _quarantine(self, root: Path, path: Path, key: bytes, reason: str, detail: str) -> None:
        name = path.relative_to(root / CLAIMED)
        target = _unused(root / "quarantine" / name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(target))
        except FileNotFoundError:
            return
        except OSError as exc:
            self._failed(path, "unremovable", f"to be quarantined ({reason}: {detail}), but "
                         f"it cannot be moved: {exc.strerror or exc}")
            return
        target.with_name(target.name + ".reason").write_text(
            f"{reason}: {detail}\nquarantined at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        self.store.update_state(deletes=[key])
        self.registry.inc("spool_files_quarantined", reason=reason)
        self.registry.sample("quarantined", reason, {"source": Source.SPOOL,
                                                     "file": str(root / name),
                                                     "detail": detail})
        log.error("spool file %s quarantined to %s: %s", root / name, target, detail)

    def _wake_later(self, seconds: float) -> None:
        """Have the intake thread scan again in ``seconds`` (or sooner): the earliest such
        deadline of a scan is the one kept, and no thread is started for it."""
        due = time.monotonic() + seconds
        if self._recheck_at is None or due < self._recheck_at:
            self._recheck_at = due

    def _cleanup(self) -> None:
        """Forget progress of files that are gone, and de-duplication entries past their
        retention; delete temporary files dead writers left behind (runs at start, then
        every 10 minutes)."""
        deletes: list[bytes] = []
        for k, _ in self.store.state_items(PROGRESS):
            # fsdecode: the key holds the file name's bytes (see _key), UTF-8 or not.
            index_s, _, rel = os.fsdecode(k[len(PROGRESS):]).partition(":")
            index = int(index_s)
            if index >= len(self.dirs) or not (
                (self.dirs[index] / CLAIMED / rel).exists() or (self.dirs[index] / rel).exists()
            ):
                deletes.append(k)
        now = time.time()
        retention = self.config.dedup_retention_seconds
        for k, v in self.store.state_items(SEEN):
            seen = Seen.decode(v)
            if seen is None or seen.age_at(now) > retention:
                deletes.append(k)
        if deletes:
            self.store.update_state(deletes=deletes)
        shortest = min(self.config.stale_temp_seconds, self.config.staged_retention_seconds)
        for d in self.dirs:
            for stale in list_stale_temp_files(d, shortest):
                staged = stale.name.endswith(STAGED_SUFFIX)
                limit = (self.config.staged_retention_seconds if staged
                         else self.config.stale_temp_seconds)
                with contextlib.suppress(OSError):
                    if now - stale.stat().st_mtime < limit:
                        continue
                    stale.unlink()
                    log.info("deleted %s spool file %s (not modified for %.0f s: its writer "
                             "is gone)", "staged" if staged else "temporary", stale, limit)


# A run of one topic's messages, encoded under the given topic generation.
_Run = tuple[str, list[bytes], int]
# Bytes counted per message on top of its value when capping a batch: the committer's own
# figure, so a batch sized here is never held back there.
_WEIGHT = RECORD_OVERHEAD_BYTES


class _Pause:
    """A pause of the intake for room in the buffer: each refused attempt counted
    (spool_batches_deferred{reason}), the gauge spool_intake_paused, and a log line when it
    starts and one when it ends, with what happened in between (a long outage would
    otherwise log a line every half second). The records are not counted as rejected: they
    wait in their file, and nothing was refused to anyone."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.since: float | None = None
        self.attempts = 0

    def refused(self, why: Refusal) -> None:
        self.attempts += 1
        reason = why.reason
        self.registry.inc("spool_batches_deferred", reason=reason)
        if self.since is None:
            self.since = time.monotonic()
            self.registry.set("spool_intake_paused", 1.0)
            log.warning("spool intake paused: the buffer refused a batch (%s: %s); the file "
                        "waits on disk with its progress, and is retried every 0.5 s",
                        reason, why)

    def ended(self) -> None:
        if self.since is not None:
            self.registry.set("spool_intake_paused", 0.0)
            log.info("spool intake resumed after %.0f s and %d refused attempts",
                     time.monotonic() - self.since, self.attempts)
            self.since, self.attempts = None, 0


class _Progress:
    """A file's progress records: what to commit with the batch that ends at an index."""

    def __init__(self, key: bytes, ident: Identity, count: int, seen_key: bytes | None,
                 seen: Seen | None) -> None:
        self.key = key
        self.ident = ident
        self.count = count
        self.seen_key = seen_key  # binary files: remembered by name and content once done
        self.seen = seen

    def puts(self, next_index: int) -> dict[bytes, bytes]:
        done = next_index >= self.count
        doc = {"identity": _ident_doc(self.ident), "next": next_index, "done": done,
               "count": self.count}
        puts = {self.key: json.dumps(doc).encode()}
        if done and self.seen_key is not None and self.seen is not None:
            puts[self.seen_key] = self.seen.encode()
        return puts


def _encode_records(
    records: list[SpoolRecord], generations: Mapping[str, int], now_ms: int
) -> list[_Run]:
    """Buffer values of decoded spool records (those with headers), in runs of one topic."""
    runs: list[_Run] = []
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


class _Pending:
    """A submitted batch's outcome, filled in by the writer thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Result | None = None  # set before ``event``

    def done(self, result: Result) -> None:
        self.result = result
        self.event.set()


def _batches(
    records: Iterator[tuple[int, SpoolRecord]], size: int, max_bytes: int, screen: _Screen
) -> Iterator[tuple[list[Record], int, list[_Refused]]]:
    """Groups of agent Records, each with the index of the record after it and the records
    before that index that are not stored (``screen``: their Kafka topic never takes them).
    A group may be empty: its progress still passes the records left out."""
    now_ms = screen.now_ms
    limited = bool(screen.limits)
    batch: list[Record] = []
    refused: list[_Refused] = []
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
        weight += len(r.value) + _WEIGHT
        if len(batch) >= size or weight >= max_bytes:
            yield batch, last + 1, refused
            batch, refused = [], []
            weight = 0
    if batch or refused:
        yield batch, last + 1, refused


def _bulk_batches(
    reader: BinarySpoolReader,
    start: int,
    generations: Mapping[str, int],
    max_bytes: int,
    screen: _Screen,
) -> Iterator[tuple[list[_Run], int, list[_Refused]]]:
    """Batches of encoded runs from index ``start`` on, each with the index of the record
    after it and the records before that index that are not stored (``screen``); cut at
    BATCH messages or once they weigh ``max_bytes``, as ``_batches`` does.

    What a Kafka topic can never take costs a block without such records three integer
    comparisons a record: the bulk encoder compares each record with its topic's
    ``kafka_limits.Bounds`` as it reads its lengths and timestamp anyway, and declines a block
    with a record outside them. Only such a block (rare: a record near or over its topic's
    max.message.bytes, or stamped near or out of its range) is decoded, as a block with
    headers is, and each of its records judged in full (``_Screen.refusal``)."""
    now_ms = screen.now_ms
    bounds = screen.bounds or None
    runs: list[_Run] = []
    refused: list[_Refused] = []
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
        whole = n + count < BATCH and weight + len(block.body) + _WEIGHT * count < max_bytes
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
            weight += sum(sum(map(len, values)) for _, values, _ in stored) + _WEIGHT * count
            next_index = block.first + block.record_count
            continue
        for (topic, values, generation), run_first in placed:
            i = 0
            while i < len(values):
                room = BATCH - n
                take = values if i == 0 and len(values) <= room else values[i:i + room]
                w = sum(map(len, take)) + _WEIGHT * len(take)
                if weight + w >= max_bytes:
                    # Cut after the message that brings the batch to its byte cap.
                    sums = list(itertools.accumulate(len(v) + _WEIGHT for v in take))
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


def _placed(runs: list[_Run], first: int) -> list[tuple[_Run, int]]:
    """Consecutive runs, each with the file index of its first record (``first``: the
    first run's)."""
    placed = []
    for run in runs:
        placed.append((run, first))
        first += len(run[1])
    return placed


def _screened_runs(
    records: list[SpoolRecord], first: int, screen: _Screen, generations: Mapping[str, int],
    refused: list[_Refused],
) -> list[tuple[_Run, int]]:
    """The encoded runs of the ``records`` (from file index ``first`` on) their Kafka topics
    take, each with its first record's file index; the others are added to ``refused``."""
    if not screen.limits:
        return _placed(_encode_records(records, generations, screen.now_ms), first)
    placed: list[tuple[_Run, int]] = []
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


def _due(refused: list[_Refused], next_index: int) -> list[_Refused]:
    """Take out of ``refused`` (in file order) those before ``next_index``."""
    if not refused or refused[0].record >= next_index:
        return []
    cut = bisect.bisect_left([r.record for r in refused], next_index)
    due = refused[:cut]
    del refused[:cut]
    return due


class _Refused(NamedTuple):
    """A record of a spool file not stored: its Kafka topic can never take it."""

    record: int  # its index in the file
    topic: str
    reason: str  # agent/reasons.py: too_large_for_topic, timestamp_out_of_range
    detail: str


class _Screen:
    """What the records of one file are judged by: the Kafka topics' limits as the forwarder
    last published them (agent/signals/limits.py) when the file's intake began, this host's
    clock then, and the file's name for the log. A topic whose limits are not known takes
    everything."""

    def __init__(self, snapshot: Snapshot, now_ms: int, path: Path, said: LogLimit) -> None:
        self.limits = snapshot.topics
        self.compression = snapshot.compression
        self.now_ms = now_ms
        self.path = path
        self.said = said
        self.bounds = {topic: kafka_limits.bounds(limit, now_ms)
                       for topic, limit in self.limits.items()}

    def refusal(self, index: int, r: SpoolRecord) -> _Refused | None:
        """Why record ``index`` is not stored, or None. The record's timestamp is the one
        Kafka will judge: the file's own for a binary record (0: none, stamped at intake,
        never refused), the line's or else the file's mtime for a hand-made file."""
        limit = self.limits.get(r.topic)
        if limit is None:
            return None
        room, earliest, latest = self.bounds[r.topic]
        ts, key = r.timestamp_ms, r.key
        if earliest <= ts <= latest or ts <= 0:
            # The common verdict without a call (no headers), or with the size arithmetic
            # alone (headers): only what may not fit is judged in full (compression).
            if not r.headers:
                if len(r.value) + (len(key) if key is not None else 0) <= room:
                    return None
            elif not kafka_limits.may_be_too_large(limit, None if key is None else len(key),
                                                   len(r.value), r.headers):
                return None
        found = kafka_limits.refusal(r.topic, limit, self.compression, r.key, r.value,
                                     r.timestamp_ms, self.now_ms, r.headers)
        return None if found is None else _Refused(index, r.topic, *found)

    def count(self, registry: Registry, refused: list[_Refused]) -> None:
        """Count, sample and log (a line a minute per topic and reason, with the count of
        the lines left out) records not stored, once their batch is."""
        for no in refused:
            registry.inc("messages_rejected", source=Source.SPOOL, reason=no.reason)
            registry.sample("rejected", no.reason, {"source": Source.SPOOL,
                                                    "file": str(self.path), "record": no.record,
                                                    "topic": no.topic, "detail": no.detail})
            self.said.warning(f"{no.reason} {no.topic}",
                              "spool file %s: record %d to topic %r not stored (%s): %s",
                              self.path, no.record, no.topic, no.reason, no.detail)


def _claimed_files(root: Path) -> list[Path]:
    """Files claimed earlier and not finished (a crash, a full buffer, a stop), oldest first:
    ``.ingesting/NAME`` and ``.ingesting/TOPIC/NAME``."""
    claimed = root / CLAIMED
    found: list[tuple[int, str]] = []
    try:
        entries = list(os.scandir(claimed))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            with os.scandir(entry.path) as inner:
                entries_inner = [e for e in inner if e.is_file(follow_symlinks=False)]
            for e in entries_inner:
                found.append((e.stat(follow_symlinks=False).st_mtime_ns, e.path))
        elif entry.is_file(follow_symlinks=False):
            found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
    return [Path(p) for _, p in sorted(found)]


def _ident_doc(ident: Identity) -> list[int]:
    return [ident.inode, ident.size, ident.mtime_ns]


def _load(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class _Unstorable(Exception):
    """The buffer refuses a batch of the file for good (InvalidGroup), not for lack of room."""


def _unused(target: Path) -> Path:
    """``target``, or ``target.1``, ``.2``, ...: never replace a file already quarantined
    (it may be the only copy of records never ingested), nor its ``.reason``."""
    candidate = target
    for n in itertools.count(1):
        if not candidate.exists() and not candidate.with_name(candidate.name + ".reason"
                                                               ).exists():
            return candidate
        candidate = target.with_name(f"{target.name}.{n}")
    raise AssertionError("unreachable")
