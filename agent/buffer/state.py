"""Ingest-side state kept in the buffer (``state``): spool file progress, idempotency keys,
topic definitions and generations. It lives beside the messages so that a change to it can
commit in the same transaction as the messages it describes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import lmdb

from agent.buffer.environment import Environment


@dataclass(frozen=True, slots=True)
class StateChange:
    """Ingest-side state to change in the same transaction as a group of messages."""

    puts: Mapping[bytes, bytes] = field(default_factory=dict)
    deletes: Sequence[bytes] = ()
    # State that depends on the ids the group is given inside the transaction (an
    # idempotency key's answer): called with them, its result is written with the group.
    derive: Callable[[list[bytes]], Mapping[bytes, bytes]] | None = None


def write_state(txn: lmdb.Transaction, db: lmdb._Database,
                puts: Mapping[bytes, bytes] | None, deletes: Iterable[bytes] = ()) -> None:
    """Put then delete state keys: every write of ``state`` goes through here."""
    if puts:
        for k, v in puts.items():
            txn.put(k, v, db=db)
    for k in deletes:
        txn.delete(k, db=db)


def apply_change(txn: lmdb.Transaction, db: lmdb._Database, change: StateChange | None,
                 ids: list[bytes]) -> None:
    """Write a stored group's state change (``ids``: the ids the group was given)."""
    if change is None:
        return
    write_state(txn, db, change.puts, change.deletes)
    if change.derive is not None:
        write_state(txn, db, change.derive(ids))


class StateKeys:
    """Reading and writing ``state`` on its own, outside an append."""

    def __init__(self, env: Environment) -> None:
        self._env = env

    def get(self, key: bytes) -> bytes | None:
        with self._env.txn(write=False) as txn:
            value = txn.get(key, db=self._env.state)
            return bytes(value) if value is not None else None

    def items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every key that starts with ``prefix``, with its value, in key order."""
        with self._env.txn(write=False) as txn, txn.cursor(self._env.state) as cur:
            out = []
            if cur.set_range(prefix):
                for k, v in cur:
                    if not bytes(k).startswith(prefix):
                        break
                    out.append((bytes(k), bytes(v)))
            return out

    def update(self, puts: Mapping[bytes, bytes] | None = None,
               deletes: Iterable[bytes] = ()) -> None:
        """Put and delete keys in one durable transaction."""
        db = self._env.state
        self._env.write(lambda txn: write_state(txn, db, puts, deletes))
