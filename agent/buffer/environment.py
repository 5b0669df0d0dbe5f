"""The buffer's LMDB environment: opening it, its named databases, and its transactions.

Every write transaction is durable when it commits (sync on, no writemap): that is the
moment Ferry may acknowledge. Several processes open the same environment (the ingest process
writes, the forwarder process reads and deletes); LMDB serialises their writers. Within a
process, ``set_mapsize`` may only run while no transaction is open, so every transaction
goes through ``txn``, which counts them.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from agent import reasons
from agent.buffer.layout import DATABASES, MAX_DBS
from agent.buffer.refusals import BufferFull, unavailable
from agent.buffer.space import InsufficientSpace, prepare_lock_file
from agent.buffer.usage_lock import hold_shared

log = logging.getLogger(__name__)

T = TypeVar("T")


class Environment:
    """An open LMDB environment with the buffer's databases. Thread-safe."""

    def __init__(self, path: Path, *, map_cap: int, initial_map_bytes: int,
                 readonly: bool) -> None:
        self.path = path
        self.map_cap = map_cap
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
            prepare_lock_file(path)
        # Shared while open, so that compaction can never rename the file under us.
        # A read-only opener (a tool without write access to the directory) may not be able
        # to create the lock file; a rename under it only shows it stale data.
        self._usage_fd: int | None = None
        try:
            self._usage_fd = hold_shared(path)
        except OSError:
            if not readonly:
                raise
        self.data_file = path / "data.mdb"
        existing = self.data_file
        start = max(initial_map_bytes, existing.stat().st_size if existing.exists() else 0)
        try:
            self.lmdb = lmdb.open(
                str(path),
                map_size=min(start, map_cap),
                max_dbs=MAX_DBS,
                sync=True,
                metasync=True,
                writemap=False,
                map_async=False,
                readahead=False,
                readonly=readonly,
                lock=True,
            )
        except lmdb.Error as exc:
            self.release_usage()
            # A new environment's first pages could not be written: say why, clearly.
            refusal = unavailable(exc, path)
            if refusal.reason == reasons.DISK_FULL and not readonly:
                raise InsufficientSpace(f"cannot create the buffer: {refusal}") from None
            raise
        # A map another process grew is larger than ours: adopt it.
        self.lmdb.set_mapsize(0)
        # Reader slots of processes that died inside a read transaction (a forwarder killed
        # with SIGKILL) pin old pages: nothing freed since could be reused, and the map would
        # fill. LMDB clears them only when asked.
        self.reader_check()
        # LMDB keeps a node (key + value + 8 bytes) of up to about half a page in the leaf;
        # a bigger value gets whole overflow pages of its own (mdb.c: me_nodemax, OVPAGES).
        self.psize = int(self.lmdb.stat()["psize"])
        self.nodemax = ((self.psize - 16) // 2 & -2) - 2
        dbs = {name: self.lmdb.open_db(name, create=not readonly, **flags)
               for name, flags in DATABASES.items()}
        self.records, self.runs = dbs[b"records"], dbs[b"topic_runs"]
        self.meta, self.state, self.tracking = dbs[b"meta"], dbs[b"state"], dbs[b"tracking"]
        self.main = self.lmdb.open_db(None)
        # Every tree that holds pages (what the free-list estimate subtracts: capacity.py).
        self.all_dbs = (self.main, self.records, self.runs, self.meta, self.state,
                        self.tracking)
        self._gate = threading.Condition()
        self._active = 0
        self._resizing = False

    def close(self) -> None:
        self.lmdb.close()
        self.release_usage()

    def release_usage(self) -> None:
        if self._usage_fd is not None:
            os.close(self._usage_fd)
            self._usage_fd = None

    # -- transactions ----------------------------------------------------------------------
    @contextmanager
    def txn(self, write: bool) -> Iterator[lmdb.Transaction]:
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._active += 1
        try:
            for attempt in range(3):
                try:
                    txn = self.lmdb.begin(write=write)
                    break
                except lmdb.MapResizedError:
                    # Another process grew the map; adopt its size and try again. Step out
                    # of the active count meanwhile, or two threads doing this would wait
                    # for each other.
                    if attempt == 2:
                        raise
                    with self._gate:
                        self._active -= 1
                        self._gate.notify_all()
                    self._exclusive(lambda: self.lmdb.set_mapsize(0))
                    with self._gate:
                        while self._resizing:
                            self._gate.wait()
                        self._active += 1
            try:
                yield txn
            except BaseException:
                txn.abort()
                raise
            else:
                txn.commit()
        finally:
            with self._gate:
                self._active -= 1
                self._gate.notify_all()

    def _exclusive(self, action: Callable[[], object]) -> None:
        """Run ``action`` once no other transaction of this process is open."""
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._resizing = True
            try:
                while self._active > 0:
                    self._gate.wait()
                action()
            finally:
                self._resizing = False
                self._gate.notify_all()

    def write(self, body: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``body(txn)`` in a durable write transaction, growing the map when it fills."""
        while True:
            try:
                with self.txn(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError:
                current = self.lmdb.info()["map_size"]
                if current >= self.map_cap:
                    if self.reader_check():
                        continue  # a dead process's reader held the free pages: try again
                    raise BufferFull("the buffer's LMDB map is at its maximum size") from None
                self._exclusive(functools.partial(self.lmdb.set_mapsize,
                                                  min(self.map_cap, current * 2)))
            except lmdb.Error as exc:
                # A dead process's reader slot keeps LMDB from reusing freed pages, so a
                # commit may have needed pages the file does not have: clear and retry.
                if self.reader_check():
                    continue
                raise unavailable(exc, self.path) from None

    # -- the file --------------------------------------------------------------------------
    def map_size(self) -> int:
        return int(self.lmdb.info()["map_size"])

    def used_end(self) -> int:
        """Where LMDB's last page ends: beyond it, the file is space LMDB has never used.
        (Read from the latest commit; inside a write transaction, before it writes.)"""
        return (int(self.lmdb.info()["last_pgno"]) + 1) * self.psize

    def sync(self) -> None:
        self.lmdb.sync(True)

    def reader_check(self) -> int:
        """Free the reader slots of processes that died in a read transaction; how many.

        Their snapshots keep every page freed since from being reused. Called when the
        environment opens, when the map is full, and by the daemon after the forwarder
        process died."""
        try:
            return int(self.lmdb.reader_check())
        except lmdb.Error as exc:
            log.warning("could not check the buffer's reader slots: %s", exc)
            return 0
