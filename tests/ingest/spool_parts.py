"""A real buffer, committer and the spool intake's shared parts (a pause, a stop event, an
empty screen), for the tests of the intake's strategies without the intake around them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.buffer.committer import Committer
from agent.buffer.store import Store, StoredMessage
from agent.ingest.spool_batch import Pause
from agent.ingest.spool_progress import Identity, Progress, load
from agent.ingest.spool_screen import Screen
from agent.metrics import Registry
from agent.process.log_limit import LogLimit
from agent.signals.limits import EMPTY, Snapshot
from tests.waiting import wait_until

MB = 1024 * 1024
KEY = b"spool:0:test"
log = logging.getLogger("tests.spool_parts")


@dataclass
class Parts:
    store: Store
    committer: Committer
    registry: Registry
    pause: Pause
    stop: threading.Event

    def stored(self, topic: str) -> list[bytes]:
        return [m.record.value for m in self.store.read(topic, None, 100_000)
                if isinstance(m, StoredMessage)]

    def progress(self) -> dict[str, object] | None:
        return load(self.store.get_state(KEY))


@contextmanager
def parts(root: Path, max_bytes: int = 64 * MB) -> Iterator[Parts]:
    store = Store(root / "buffer", max_bytes, track=False, reserve_bytes=MB)
    registry = Registry()
    committer = Committer(store, registry=registry)
    committer.start()
    try:
        yield Parts(store, committer, registry, Pause(registry, log), threading.Event())
    finally:
        committer.close()
        store.close()


def progress_of(path: Path, count: int) -> Progress:
    return Progress(KEY, Identity.of(path), count, None, None)


def screen(path: Path, snapshot: Snapshot = EMPTY, now_ms: int = 1_700_000_000_000) -> Screen:
    return Screen(snapshot, now_ms, path, LogLimit(log))


def waits_while_full(p: Parts, ingest: Callable[[], bool]) -> list[bool]:
    """Run a strategy's ``ingest`` (a call on a file larger than the buffer) in a thread
    until the buffer refuses its batch and the strategy has tried again and paused, then
    stop it; its return value(s). Records that wait are never rejected: they stay in the
    file."""
    done: list[bool] = []
    run = threading.Thread(target=lambda: done.append(ingest()), daemon=True)
    run.start()
    view = p.registry.view
    wait_until(lambda: view().total("spool_batches_deferred", reason="buffer_full") > 1,
               message="the batch is refused, and tried again")
    assert view().total("spool_intake_paused") == 1
    assert view().total("messages_rejected", source="spool") == 0
    p.stop.set()
    run.join(10)
    return done
