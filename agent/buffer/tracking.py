"""What became of a message that left the buffer (``tracking``: id -> outcome), kept for
``track_seconds`` and at most ``max_tracking`` entries, for ``GET /messages/{id}``."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, cast

import lmdb

from agent.buffer import keys

# tracking value: state, partition, offset, at_ms, then "topic NUL cluster NUL reason".
TRACK = struct.Struct(">Biqq")
STATES = {"delivered": 1, "discarded": 2}
_STATE_NAMES = {v: k for k, v in STATES.items()}


@dataclass(slots=True)
class Outcome:
    """What became of a buffered message, written to ``tracking`` when it leaves the buffer."""

    key: bytes
    stored_bytes: int
    topic: str
    state: str  # "delivered" | "discarded"
    cluster: str = ""
    partition: int = -1
    offset: int = -1
    reason: str = ""


@dataclass(slots=True)
class DeliveredRun:
    """Messages of one topic that one cluster acknowledged: the forwarder's common outcome,
    kept as parallel lists (no object per message): message ids (not handles: ``records``
    is keyed by id, so the deletes take them as they are), and ``sizes``, the stored bytes."""

    topic: str
    cluster: str
    ids: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    # Shown by locate() (GET /messages/{id}) beside the outcome, e.g. "committed in
    # transaction" for an exactly-once topic's messages.
    note: str = ""


def unpack_outcome(raw: bytes) -> dict[str, Any]:
    """A tracking value as ``locate`` reports it."""
    state, partition, offset, at_ms = TRACK.unpack_from(raw)
    topic, cluster, reason = raw[TRACK.size:].decode().split("\0")
    doc: dict[str, Any] = {"state": _STATE_NAMES.get(state, "unknown"), "topic": topic,
                           "at_ms": at_ms}
    if doc["state"] == "delivered":
        doc.update(cluster=cluster, partition=partition, offset=offset)
        if reason:
            doc["note"] = reason
    else:
        doc["reason"] = reason
    return doc


def prune(txn: lmdb.Transaction, db: lmdb._Database, *, now_ms: int, track_seconds: int,
          max_entries: int, added: int) -> None:
    """Forget the oldest tracking entries: those past ``track_seconds``, and any beyond
    ``max_entries``. Removes at least as many as this transaction added when over the cap,
    so tracking can never outgrow it."""
    # Ids start with their acceptance time, so the oldest entries are at the front.
    cutoff = keys.ID.pack(max(now_ms - track_seconds * 1000, 0), 0)
    excess = int(txn.stat(db)["entries"]) - max_entries
    limit = max(2000, 2 * added)
    with txn.cursor(db) as cur:
        n = 0
        if not cur.first():
            return
        # delete() moves on to the next entry: one call per entry forgotten. Past the
        # last one the cursor is unpositioned and delete() says False.
        while n < limit and (n < excess or cast(bytes, cur.key()) < cutoff):
            if not cur.delete():
                break
            n += 1
