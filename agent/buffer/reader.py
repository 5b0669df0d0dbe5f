"""Reading the buffer in order: a topic's messages in FIFO order, through its runs, and
where a single message is."""

from __future__ import annotations

from bisect import bisect_left
from itertools import islice
from typing import Any, cast

from agent.buffer import keys, tracking
from agent.buffer.environment import Environment
from agent.buffer.ids import run_span
from agent.buffer.topic_counts import TopicCounts

_ID_LEN = keys.ID_LEN
_MAX_ID = b"\xff" * _ID_LEN


class Reader:
    def __init__(self, env: Environment, counts: TopicCounts) -> None:
        self._env = env
        self._counts = counts

    def read_values(
        self, topic: str, after: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` ``(id, encoded value)`` pairs of ``topic`` in FIFO order, after
        message id ``after``, undecoded: the forwarder's common path decodes the header
        itself and hands slices straight to the producer, so it makes no Record or
        StoredMessage per message (stored.py decodes when it needs to)."""
        tb = topic.encode("ascii")
        items: list[tuple[bytes, bytes]] = []
        env = self._env
        with (env.txn(write=False) as txn, txn.cursor(env.runs) as runs,
              txn.cursor(env.records) as records):
            # The first run whose last id is past ``after`` (dups are ``last id, first id``).
            if not (runs.set_key(tb) if after is None
                    else runs.set_range_dup(tb, after + _MAX_ID)):
                return []
            start = after + b"\0" if after is not None else b""  # sorts just after it
            while len(items) < limit:
                run = cast(bytes, runs.value())
                last, first = run[:_ID_LEN], run[_ID_LEN:]
                # A run emptied by messages that left out of order (not yet dropped, as it
                # is not at the head) starts past its end: nothing to take from it.
                if (records.set_range(max(first, start))
                        and cast(bytes, records.key()) <= last):
                    # The environment is opened without buffers=True, so keys and values
                    # are bytes. Take what the run can hold in C, then cut where it ends
                    # ((k, v) tuples compare by key): no Python per message.
                    want = min(limit - len(items), run_span(first, last))
                    got = cast(list[tuple[bytes, bytes]],
                               list(islice(records.iternext(), want)))
                    if got and got[-1][0] > last:
                        del got[bisect_left(got, (last + b"\0",)):]
                    items += got
                if not runs.next_dup():
                    break
        return items

    def locate(self, message_id: bytes) -> dict[str, Any] | None:
        """Where a recent message is: still buffered (and under which topic) or its outcome."""
        env = self._env
        with env.txn(write=False) as txn:
            raw = txn.get(message_id, db=env.tracking)
            if raw is not None:
                return tracking.unpack_outcome(bytes(raw))
            if len(message_id) != _ID_LEN or txn.get(message_id, db=env.records) is None:
                return None
            with txn.cursor(env.runs) as runs:
                for topic in self._counts.names(txn):
                    # The topic's first run whose last id is at or past the message's.
                    if (runs.set_range_dup(topic.encode("ascii"), message_id + bytes(_ID_LEN))
                            and cast(bytes, runs.value())[_ID_LEN:] <= message_id):
                        return {"state": "buffered", "topic": topic}
        return None
