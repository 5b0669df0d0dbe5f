"""Idempotency-Key: a retried publish within the window gets the first answer, stores nothing.

Entries live in the buffer's ``state`` database:

- ``idem:<topic> NUL <key>`` -> JSON ``{"t": accepted ms, "fp": request fingerprint,
  "ids": [message ids], "batch": bool}``
- ``idemx:<minute> : <topic> NUL <key>`` -> empty: a time index, so expired entries are found
  minute by minute without scanning every entry.
- ``idem-pruned`` -> the last minute whose entries were pruned.

A key is scoped to its topic. The fingerprint covers the body and every header that shapes
the stored messages, so reusing a key for a different request is refused (422) rather than
silently answered with another request's ids. Two concurrent requests with one key are
serialised in memory: the second waits for the first and then replays its answer.

Expired entries are ignored when looked up and deleted lazily, a minute at a time, by
``prune()`` (a worker thread, at most once per ``PRUNE_INTERVAL``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.buffer import keys
from agent.buffer.store import Store

log = logging.getLogger(__name__)

PREFIX = b"idem:"
INDEX = b"idemx:"
PRUNED = b"idem-pruned"
MAX_KEY_LENGTH = 255
PRUNE_INTERVAL = 60.0
_BUCKET = 60  # seconds per index bucket
_MAX_BUCKETS_PER_PRUNE = 24 * 60  # catch up at most a day per run after a long stop


class BadKey(ValueError):
    """The Idempotency-Key header is unusable (400)."""


@dataclass(frozen=True, slots=True)
class Entry:
    accepted_ms: int
    fingerprint: str
    ids: list[bytes]
    batch: bool

    def encode(self) -> bytes:
        return json.dumps({"t": self.accepted_ms, "fp": self.fingerprint,
                           "ids": [keys.id_text(i) for i in self.ids], "batch": self.batch},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Entry:
        doc = json.loads(raw)
        return cls(int(doc["t"]), str(doc["fp"]), [bytes.fromhex(i) for i in doc["ids"]],
                   bool(doc["batch"]))


def check_key(raw: bytes) -> bytes:
    """The header value if usable as a key: 1-255 visible ASCII characters."""
    if not 0 < len(raw) <= MAX_KEY_LENGTH or not all(0x21 <= b <= 0x7E for b in raw):
        raise BadKey("Idempotency-Key must be 1 to 255 visible ASCII characters")
    return raw


def fingerprint(parts: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.hexdigest()


def _bucket(ms: int) -> int:
    return ms // 1000 // _BUCKET


def _index_key(bucket: int, state_key: bytes) -> bytes:
    return INDEX + b"%010d:" % bucket + state_key[len(PREFIX):]


class Idempotency:
    """Look-ups, the state to commit for a new entry, and pruning."""

    def __init__(self, store: Store, window_seconds: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.window_ms = window_seconds * 1000
        self._clock = clock
        self._marked = store.get_state(PRUNED) is not None
        self._next_prune = 0.0

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0

    @staticmethod
    def state_key(topic: str, key: bytes) -> bytes:
        return PREFIX + topic.encode("ascii") + keys.SEP + key

    def lookup(self, state_key: bytes) -> Entry | None:
        raw = self.store.get_state(state_key)
        if raw is None:
            return None
        try:
            entry = Entry.decode(raw)
        except (ValueError, KeyError, TypeError):
            log.error("ignoring an unreadable idempotency entry %r", state_key[:80])
            return None
        if self._now_ms() - entry.accepted_ms > self.window_ms:
            return None
        return entry

    def puts(self, state_key: bytes, entry: Entry) -> dict[bytes, bytes]:
        """What to commit to remember ``entry``."""
        out = {state_key: entry.encode(), _index_key(_bucket(entry.accepted_ms), state_key): b""}
        if not self._marked:
            # Pruning starts from here; written with the first entry so none is older.
            out[PRUNED] = str(_bucket(entry.accepted_ms) - 1).encode()
            self._marked = True
        return out

    def now_ms(self) -> int:
        return self._now_ms()

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def prune_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_prune:
            return False
        self._next_prune = now + PRUNE_INTERVAL
        return True

    def prune(self) -> int:
        """Delete entries older than the window; returns how many. Blocking (disk writes)."""
        raw = self.store.get_state(PRUNED)
        if raw is None:
            return 0
        done = int(raw)
        # A bucket is expired once its newest possible entry is older than the window.
        last = _bucket(self._now_ms() - self.window_ms) - 1
        removed = 0
        bucket = done
        stop = min(last, done + _MAX_BUCKETS_PER_PRUNE)
        deletes: list[bytes] = []
        while bucket < stop:
            bucket += 1
            for index_key, _ in self.store.state_items(INDEX + b"%010d:" % bucket):
                deletes.append(index_key)
                state_key = PREFIX + index_key[len(INDEX) + 11:]
                current = self.store.get_state(state_key)
                try:
                    mine = current is not None and _bucket(Entry.decode(current).accepted_ms) \
                        <= bucket
                except (ValueError, KeyError, TypeError):
                    mine = True
                if mine:  # not re-used since: a newer entry under the key has its own index
                    deletes.append(state_key)
                    removed += 1
            if len(deletes) >= 5000 or bucket == stop:
                self.store.update_state({PRUNED: str(bucket).encode()}, deletes=deletes)
                deletes = []
        return removed
