"""Topic generations: a topic deleted or recreated starts a new generation, and messages
buffered under an older one are not sent (the forwarder compares). Kept in ``state`` as
``gen:topic`` -> decimal text; a topic never bumped is at generation 0."""

from __future__ import annotations

import lmdb

from agent.buffer.environment import Environment
from agent.buffer.layout import GEN_PREFIX
from agent.buffer.state import StateKeys

# Sources that encode messages before the writer thread does (the datagram socket, the
# committer's packs: packing.py) encode under their topic's generation as last read, at most
# this long ago. The buffer re-encodes a group whose topic was deleted or recreated since,
# so a stale view costs a copy, never a message sent under the wrong generation.
GENERATIONS_MAX_AGE = 1.0


def generation_in(txn: lmdb.Transaction, state: lmdb._Database, topic: str) -> int:
    """``topic``'s generation as this transaction sees it (what an append encodes under)."""
    raw = txn.get(GEN_PREFIX + topic.encode("ascii"), db=state)
    return int(raw) if raw else 0


class Generations:
    def __init__(self, env: Environment, state: StateKeys) -> None:
        self._env = env
        self._state = state

    def of(self, topic: str) -> int:
        with self._env.txn(write=False) as txn:
            return generation_in(txn, self._env.state, topic)

    def all(self) -> dict[str, int]:
        """Every topic that has been bumped, with its generation."""
        return {k[len(GEN_PREFIX):].decode("ascii"): int(v)
                for k, v in self._state.items(GEN_PREFIX)}

    def bump(self, topic: str) -> int:
        """Start a new generation of ``topic``: its buffered messages will not be sent."""
        db = self._env.state

        def body(txn: lmdb.Transaction) -> int:
            gen = generation_in(txn, db, topic) + 1
            txn.put(GEN_PREFIX + topic.encode("ascii"), str(gen).encode(), db=db)
            return gen

        result: int = self._env.write(body)
        return result
