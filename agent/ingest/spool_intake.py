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

This module is the one lifecycle every file goes through: discover (the scan), claim, read
(verify or fingerprint, de-duplication, the progress to resume from), store, then finish
(delete or move to ``done/``) or quarantine, with the counters and reasons of each step. How
the records are stored is one of two strategies: ``Records`` (spool_records.py: a hand-made
file, as agent Records through the group committer) and ``Blocks`` (spool_blocks.py: a binary
file, its blocks encoded straight into buffer values and stored on a commit thread of their
own). Both commit each batch with the file's progress (spool_progress.py), screen records
(spool_screen.py), and pause and retry alike when the buffer has no room (spool_batch.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from agent import reasons
from agent.buffer.committer import ShuttingDown
from agent.buffer.store import InvalidGroup
from agent.ingest.runtime import Runtime
from agent.ingest.spool_batch import Pause, Unstorable
from agent.ingest.spool_blocks import Blocks
from agent.ingest.spool_progress import Identity, Progress, load
from agent.ingest.spool_records import Records
from agent.ingest.spool_screen import Screen
from agent.ingest.spool_seen import Seen, decide, probe_for
from agent.process.log_limit import LogLimit
from agent.records import Source
from spool.format import EXTENSION, SpoolFormatError
from spool.reader import (
    BinarySpoolReader,
    list_ready_files,
    list_stale_temp_files,
    list_unrecognized_files,
    open_spool_file,
)
from spool.writer import fsync_dir

log = logging.getLogger(__name__)

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


class _Wake(FileSystemEventHandler):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("created", "moved", "closed", "modified"):
            self.event.set()


class SpoolIntake:
    """The spool directories' intake thread: every file's one lifecycle (the module's
    docstring), its storing handed to the file's strategy (``Records`` or ``Blocks``)."""

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
        # Records not stored because their Kafka topic never takes them: a log line a minute
        # per topic and reason (each is counted and sampled).
        self._refusals = LogLimit(log)
        # The two ways a file's records are stored; one pause for room, whichever waits.
        pause = Pause(self.registry, log)
        self._records = Records(self.committer, self.registry, pause, self._stop)
        self._blocks = Blocks(self.store, self.registry, pause, self._stop)

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
        self._blocks.close()

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
        progress = load(self.store.get_state(key))
        resuming = progress is not None and progress.get("identity") == ident.doc()
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
            tracker = Progress(key, ident, count, seen_key if remember else None, remember)
            # What the Kafka topics can never take is not stored (counted, sampled, logged as
            # the other sources do); the rest of the file is ingested as usual.
            screen = Screen(self.runtime.limits.current(), int(time.time() * 1000),
                            root / name, self._refusals)
            # Store: the file's strategy, from its progress on.
            if isinstance(reader, BinarySpoolReader):
                if not self._blocks.ingest(reader, start, tracker, max_batch_bytes, screen):
                    return False
            elif not self._records.ingest(reader, start, tracker, max_batch_bytes, screen):
                return False
            # Nothing to store (no records, or all in already): its progress, "done", alone.
            if (count == 0 or start >= count) and not self._records.commit(
                    [], tracker.puts(count)):
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
        except Unstorable as exc:
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
        # Counted before its reason appears: whoever sees a .reason file finds it counted.
        self.registry.inc("spool_files_quarantined", reason=reason)
        self.registry.sample("quarantined", reason, {"source": Source.SPOOL,
                                                     "file": str(root / name),
                                                     "detail": detail})
        # Whole or not at all (written aside, then renamed): whoever watches quarantine/
        # for reasons never reads a half-written one.
        written = target.with_name(f".{target.name}.reason.tmp")
        written.write_text(
            f"{reason}: {detail}\nquarantined at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        os.replace(written, target.with_name(target.name + ".reason"))
        self.store.update_state(deletes=[key])
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
