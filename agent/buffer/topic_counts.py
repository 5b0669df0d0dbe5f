"""Per-topic message counts and bytes (``meta``: ``n:topic`` -> messages, bytes).

Kept exact by changing them in the same transaction as the messages they count; a topic
whose count reaches zero loses its key, so the keys are the topics that have messages.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import lmdb

from agent.buffer import keys
from agent.buffer.environment import Environment
from agent.buffer.layout import COUNT_PREFIX

_COUNT = struct.Struct(">qq")  # messages, bytes
_ID_LEN = keys.ID_LEN


@dataclass(frozen=True, slots=True)
class TopicStats:
    topic: str
    messages: int
    bytes: int
    oldest_ms: int | None


@dataclass(slots=True)
class CountChange:
    """Messages and bytes one transaction adds to (or removes from) a topic."""

    messages: int = 0
    bytes: int = 0


class TopicCounts:
    def __init__(self, env: Environment) -> None:
        self._env = env

    def adjust(self, txn: lmdb.Transaction, changes: Mapping[str, CountChange],
               sign: int) -> None:
        """Add (``sign`` +1) or take away (-1) each topic's change."""
        meta = self._env.meta
        for topic, change in changes.items():
            ck = COUNT_PREFIX + topic.encode("ascii")
            raw = txn.get(ck, db=meta)
            cn, cb = _COUNT.unpack(raw) if raw else (0, 0)
            cn, cb = cn + sign * change.messages, cb + sign * change.bytes
            if cn <= 0:
                txn.delete(ck, db=meta)
            else:
                txn.put(ck, _COUNT.pack(cn, cb), db=meta)

    def topics(self) -> list[str]:
        """Topics that have buffered messages."""
        with self._env.txn(write=False) as txn:
            return self.names(txn)

    def names(self, txn: lmdb.Transaction) -> list[str]:
        with txn.cursor(self._env.meta) as cur:
            out = []
            if cur.set_range(COUNT_PREFIX):
                for k in cur.iternext(keys=True, values=False):
                    if not bytes(k).startswith(COUNT_PREFIX):
                        break
                    out.append(bytes(k[len(COUNT_PREFIX):]).decode("ascii"))
            return out

    def stats(self) -> list[TopicStats]:
        out = []
        with self._env.txn(write=False) as txn:
            with txn.cursor(self._env.meta) as meta:
                counts = []
                if meta.set_range(COUNT_PREFIX):
                    for k, v in meta:
                        if not bytes(k).startswith(COUNT_PREFIX):
                            break
                        n, b = _COUNT.unpack(v)
                        counts.append((bytes(k[len(COUNT_PREFIX):]).decode("ascii"), n, b))
            for topic, n, b in counts:
                first = self._first_id(txn, topic)
                out.append(TopicStats(topic, n, b,
                                      keys.id_timestamp_ms(first) if first else None))
        return out

    def _first_id(self, txn: lmdb.Transaction, topic: str) -> bytes | None:
        """The oldest buffered id of ``topic``: the first record of its first non-empty run."""
        tb = topic.encode("ascii")
        with txn.cursor(self._env.runs) as runs, txn.cursor(self._env.records) as records:
            if not runs.set_key(tb):
                return None
            while True:
                run = cast(bytes, runs.value())
                if (records.set_range(run[_ID_LEN:])
                        and cast(bytes, records.key()) <= run[:_ID_LEN]):
                    return cast(bytes, records.key())
                if not runs.next_dup():
                    return None
