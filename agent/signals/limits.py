"""Each topic's limits on the local cluster, published by the forwarder process for the
ingest process, which refuses before acknowledging what a topic can never take.

The forwarder learns a topic's ``max.message.bytes`` and timestamp limits by describing its
configuration (forwarder/topic_limits.py), and it learns them again every minute. The ingest
process has no Kafka client (only the forwarder touches Kafka), so the forwarder writes what
it learnt to ``<buffer>/topic_limits.json`` (``LimitsPublisher``): a temporary file renamed
over the old one, so a reader sees either snapshot whole, never half of one; and only when
something changed, so an unchanged minute costs no write. The ingest side (``LimitsView``)
keeps the snapshot in memory and looks at the file's identity (inode, size, mtime) at most
once a second: on the hot path a lookup is a dict ``get``, no file is read per message.

Only the local cluster's limits are published: a message that falls back to the remote
cluster may meet other limits there, and is left to the forwarder's rules. A topic not in the
snapshot (not learnt yet: its first messages, before the forwarder ever sent to it; or the
cluster would not describe it) has no limits here, and its messages are accepted as before.
The forwarder removes the file when it starts (``LimitsPublisher.clear``): limits an
operator raised while Ferry was down must not refuse anything, so nothing is refused until
they are learnt again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "topic_limits.json"
VERSION = 1
# How often a reader looks whether the file changed: the forwarder learns limits every
# minute, so a second's delay is nothing, and a stat per second is nothing either.
CHECK_INTERVAL = 1.0


def file_path(buffer_path: Path) -> Path:
    return buffer_path / FILE_NAME


@dataclass(frozen=True, slots=True)
class Limit:
    """One topic's limits on the local cluster (None: no such limit known)."""

    max_message_bytes: int
    before_max_ms: int | None = None
    after_max_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the forwarder knows: the compression its local producers use (the size Kafka
    compares with the limit is the compressed batch's) and each topic's limits."""

    compression: str = "none"
    topics: Mapping[str, Limit] = field(default_factory=dict)


EMPTY = Snapshot()


def encode(snapshot: Snapshot) -> bytes:
    doc = {"version": VERSION, "compression": snapshot.compression,
           "topics": {t: [lim.max_message_bytes, lim.before_max_ms, lim.after_max_ms]
                      for t, lim in sorted(snapshot.topics.items())}}
    return json.dumps(doc, separators=(",", ":")).encode()


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def decode(raw: bytes) -> Snapshot | None:
    """The snapshot in ``raw``, or None when it is not one Ferry wrote (ignored: nothing is
    refused on the strength of a file that cannot be read)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        return None
    compression, topics = doc.get("compression"), doc.get("topics")
    if not isinstance(compression, str) or not isinstance(topics, dict):
        return None
    found: dict[str, Limit] = {}
    for topic, entry in topics.items():
        if not (isinstance(entry, list) and len(entry) == 3):
            return None
        size = _opt_int(entry[0])
        if size is None or size <= 0:
            return None
        found[topic] = Limit(size, _opt_int(entry[1]), _opt_int(entry[2]))
    return Snapshot(compression, found)


class LimitsPublisher:
    """The forwarder's end: ``publish()`` whenever it learnt limits (it writes only what
    changed). Never fails the forwarder: a write that fails is logged, and the intake goes
    on with what it had."""

    def __init__(self, path: Path, compression: str) -> None:
        self.path = path
        self.compression = compression
        self._last: bytes | None = None
        # The metadata thread of the local cluster publishes; a lock all the same, as the
        # exactly-once thread shares that cluster.
        self._lock = threading.Lock()

    def clear(self) -> None:
        """No limits until they are learnt again (at the forwarder's start)."""
        with self._lock, contextlib.suppress(FileNotFoundError):
            self._last = None
            os.unlink(self.path)

    def publish(self, topics: Mapping[str, Limit]) -> bool:
        """Write the snapshot if it differs from the last one written; True if written."""
        raw = encode(Snapshot(self.compression, dict(topics)))
        with self._lock:
            if raw == self._last:
                return False
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(raw)
                # No fsync: a snapshot lost to a power cut is learnt again within a minute,
                # and meanwhile nothing is refused that Kafka would take.
                os.replace(tmp, self.path)
            except OSError as exc:
                log.warning("could not publish topic limits to %s: %s", self.path, exc)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                return False
            self._last = raw
            return True


class LimitsView:
    """The ingest process's end: ``get(topic)`` on the hot path of every source.

    Shared by the socket thread, the HTTP event loop and the spool thread: the snapshot is
    replaced whole (one reference), never changed in place, so a reader needs no lock."""

    def __init__(self, path: Path, *, interval: float = CHECK_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.interval = interval
        self.clock = clock
        self.snapshot = EMPTY
        self._identity: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._lock = threading.Lock()  # one reader re-reads; the others keep the old one

    def current(self) -> Snapshot:
        """The latest snapshot, looked for at most once per ``interval``."""
        if self.clock() >= self._next_check and self._lock.acquire(blocking=False):
            try:
                self._next_check = self.clock() + self.interval
                self._refresh()
            finally:
                self._lock.release()
        return self.snapshot

    def get(self, topic: str) -> Limit | None:
        return self.current().topics.get(topic)

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._identity = None
            self.snapshot = EMPTY
            return
        except OSError as exc:
            log.debug("cannot look at %s: %s", self.path, exc)
            return
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        if identity == self._identity:
            return
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._identity = None
            self.snapshot = EMPTY
            return
        except OSError as exc:
            log.debug("cannot read %s: %s", self.path, exc)
            return
        snapshot = decode(raw)
        if snapshot is None:
            log.warning("ignored %s: not a topic limits snapshot this Ferry reads", self.path)
            snapshot = EMPTY
        self._identity = identity
        self.snapshot = snapshot
