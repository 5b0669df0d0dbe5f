"""Giving message ids, and the runs of consecutive ids that index a topic (``topic_runs``).

An id is (accepted-at milliseconds, sequence) (keys.py). They are given inside the write
transaction from the counter under ``last_id`` in ``meta``, so they are unique and
increasing across processes and restarts even if the clock steps back. A transaction gives
each topic one stretch of consecutive ids; no other topic's id can lie inside a stretch, so
a topic is indexed by its runs, ``[topic, first id, last id]``, not by one entry per message.
"""

from __future__ import annotations

import struct

import lmdb

from agent.buffer import clock, keys
from agent.buffer.layout import LAST_ID

_SEQ = struct.Struct(">I")  # the sequence half of a message id (keys.ID)
_MAX_SEQ = 0xFFFFFFFF


class IdCounter:
    """The next id to give in one write transaction: read from ``last_id`` when it starts,
    advanced a run at a time, and written back once at its end (``save``)."""

    __slots__ = ("ts", "seq")

    def __init__(self, txn: lmdb.Transaction, meta: lmdb._Database) -> None:
        raw = txn.get(LAST_ID, db=meta)
        last_ts, seq = keys.ID.unpack(raw) if raw else (0, 0)
        # The clock only moves the ids forward: a clock stepped back keeps the last time.
        ts = max(clock.now_ms(), last_ts)
        self.ts = ts
        self.seq = seq + 1 if ts == last_ts else 0

    def take(self, n: int) -> list[bytes]:
        """Ids for ``n`` consecutive messages."""
        ids, self.ts, self.seq = run_ids(self.ts, self.seq, n)
        return ids

    def save(self, txn: lmdb.Transaction, meta: lmdb._Database) -> None:
        """Record the last id given (call only when this transaction gave any)."""
        txn.put(LAST_ID, keys.ID.pack(self.ts, max(self.seq - 1, 0)), db=meta)


def run_ids(ts: int, seq: int, n: int) -> tuple[list[bytes], int, int]:
    """Ids for ``n`` consecutive messages from ``(ts, seq)`` on, and the ``(ts, seq)`` after
    them. A sequence that would pass 2**32 - 1 carries into the next millisecond."""
    if seq + n - 1 > _MAX_SEQ:
        # The sequence would wrap within the run: ids one by one.
        out = []
        for _ in range(n):
            if seq > _MAX_SEQ:
                ts, seq = ts + 1, 0
            out.append(keys.ID.pack(ts, seq))
            seq += 1
        return out, ts, seq
    base = ts.to_bytes(8, "big")
    pack_seq = _SEQ.pack
    return [base + pack_seq(i) for i in range(seq, seq + n)], ts, seq + n


def follows(prev: bytes, nxt: bytes) -> bool:
    """Whether id ``nxt`` is the very next id after ``prev`` (no id can lie between)."""
    ts, seq = keys.ID.unpack(prev)
    return nxt == (keys.ID.pack(ts, seq + 1) if seq < _MAX_SEQ else keys.ID.pack(ts + 1, 0))


def extend_runs(runs: list[list[bytes]], tb: bytes, first: bytes,
                last: bytes | None = None) -> None:
    """Add ids ``first`` to ``last`` (given one after another to topic ``tb``) to ``runs``
    ([topic, first id, last id], in id order): the last run grows when they follow it
    directly in the same topic, as a stretch of one topic's ids has nothing else inside."""
    if runs:
        run = runs[-1]
        if run[0] == tb and follows(run[2], first):
            run[2] = last or first
            return
    runs.append([tb, first, last or first])


def run_span(first: bytes, last: bytes) -> int:
    """How many ids ``first`` to ``last`` take at most (ids are (ms, sequence) pairs)."""
    ts1, seq1 = keys.ID.unpack(first)
    ts2, seq2 = keys.ID.unpack(last)
    span: int = (ts2 - ts1) * 0x100000000 + seq2 - seq1 + 1  # a wrapped sequence too
    return span
