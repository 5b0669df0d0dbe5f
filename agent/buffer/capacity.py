"""How much room the buffer has: the bytes its messages take against ``max_bytes``, and the
disk room a write transaction may still use without touching the reserve (space.py).

Both are estimates made before anything is written, so that a group that does not fit is
refused whole, up front, rather than failing LMDB's commit half-way.
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb

from agent.buffer.environment import Environment
from agent.buffer.refusals import BufferFull, DiskFull
from agent.buffer.space import Space

# Per-record overhead estimate (LMDB node header, key) used to decide fullness before writing.
RECORD_OVERHEAD = 48
# What a commit may take on disk beyond its messages' estimate: the copied path of each tree
# it touches, counts, the id counter, state (pages).
_COMMIT_PAGES = 16


class Capacity:
    """The room checks of one environment; ``space`` is None for a read-only opener."""

    def __init__(self, env: Environment, space: Space | None) -> None:
        self._env = env
        self.space = space

    def used_bytes(self) -> int:
        """Bytes of LMDB pages holding messages (what ``max_bytes`` limits)."""
        with self._env.txn(write=False) as txn:
            return self.used(txn)

    def used(self, txn: lmdb.Transaction) -> int:
        pages = 0
        for db in (self._env.records, self._env.runs):
            s = txn.stat(db)
            pages += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return int(pages * self._env.psize)

    def overflow(self, values: Sequence[bytes], key_len: int) -> int:
        """Bytes beyond their length that ``values`` take when LMDB stores them on overflow
        pages (whole pages each): a 2,100-byte value takes 4,096 bytes. Counted into the room
        a group needs, or one commit of big values could overshoot max_bytes nearly 2x."""
        limit = self._env.nodemax - 8 - key_len
        if not values or max(map(len, values)) <= limit:
            return 0  # the common case, at C speed
        psize = self._env.psize
        return sum(((15 + len(v)) // psize + 1) * psize - len(v)
                   for v in values if len(v) > limit)

    def disk_room(self, txn: lmdb.Transaction) -> int:
        """Bytes new messages may still take in this write transaction without the
        filesystem and without the reserve: the file's allocated part beyond LMDB's last
        page, less the reserve, plus the pages on LMDB's free list. (The free list is
        estimated as the pages no tree holds; pages freed too recently to be reused yet and
        the free list's own pages are counted too, which the reserve absorbs.)"""
        space = self.space
        if space is None:
            return 1 << 62
        env = self._env
        last = int(env.lmdb.info()["last_pgno"]) + 1
        held = 2  # the two meta pages
        for db in env.all_dbs:
            s = txn.stat(db)
            held += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return (space.allocated - last * env.psize - space.reserve
                + max(last - held, 0) * env.psize)

    def fit_on_disk(self, txn: lmdb.Transaction, need: int, room: int | None
                    ) -> tuple[int, BufferFull | None]:
        """Whether ``need`` more bytes of messages fit on disk in this transaction, given
        ``room`` (what ``disk_room`` left after the groups before; None: not asked yet).
        Returns the room left after them and None, or the room and the refusal: DiskFull,
        or BufferFull when the map itself is at its cap. Grows the file if it must."""
        if room is None:
            room = self.disk_room(txn)
        # Pages are not filled to the brim (a split leaves two half-full pages): count
        # twice the bytes, and the pages each commit copies.
        disk = 2 * need + _COMMIT_PAGES * self._env.psize
        if disk <= room:
            return room - disk, None
        space = self.space
        assert space is not None  # disk_room is unlimited without it
        taken = self.disk_room(txn) - room  # by earlier groups of this transaction
        if space.ensure(self._env.used_end() + space.reserve + taken + disk):
            room = self.disk_room(txn) - taken
            if disk <= room:
                return room - disk, None
        if space.allocated >= space.cap:
            return room, BufferFull(f"the buffer's LMDB map is nearly full: {disk} bytes "
                                    f"do not fit in the {max(room, 0)} left beside its "
                                    "reserve")
        return room, DiskFull(f"disk full under {self._env.path}: {disk} bytes do not fit in "
                              f"the {max(room, 0)} left beside the {space.reserve}-byte reserve")
