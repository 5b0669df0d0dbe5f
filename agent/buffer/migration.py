"""Moving a layout-1 buffer to the current layout, once, at the first open after an upgrade.

Layout 1 kept messages under ``topic NUL id`` in one tree (``messages``): a topic that sorts
before another buffered topic was inserted mid-tree, and LMDB's splits left those pages
half full (458 bytes per 200-byte message instead of 275). Layout 2 keeps them by id in
``records``, indexed by ``topic_runs`` (layout.py).
"""

from __future__ import annotations

import logging
import time
from itertools import islice
from typing import cast

import lmdb

from agent.buffer import keys
from agent.buffer.environment import Environment
from agent.buffer.ids import extend_runs
from agent.buffer.layout import LAYOUT_1_MESSAGES

log = logging.getLogger(__name__)

_ID_LEN = keys.ID_LEN
# Messages moved per transaction (read at each call: a test makes it small).
MIGRATE_BATCH = 20_000


def migrate_layout_1(env: Environment) -> None:
    """Move the messages of ``messages`` into ``records`` and ``topic_runs``, then drop the
    old tree. Each batch moves in one transaction (put new, delete old), so a crash in
    between loses and duplicates nothing: the next open goes on from where this one stopped."""
    try:
        old = env.lmdb.open_db(LAYOUT_1_MESSAGES, create=False)
    except lmdb.NotFoundError:
        return
    with env.txn(write=False) as txn:
        total = int(txn.stat(old)["entries"])
    if total:
        log.warning("buffer: moving %d messages to the current layout (once, at the "
                    "first start after an upgrade)", total)
    started = time.monotonic()
    moved = 0
    batch_size = MIGRATE_BATCH

    def body(txn: lmdb.Transaction) -> int:
        with txn.cursor(old) as cur:
            if not cur.first():
                txn.drop(old, delete=True)
                return 0
            batch = cast(list[tuple[bytes, bytes]], list(islice(cur.iternext(), batch_size)))
            # The old tree is in (topic, id) order: ids that follow each other within a
            # topic were given in one stretch, so no other topic's id lies between them.
            runs: list[list[bytes]] = []
            for k, _ in batch:
                extend_runs(runs, k[:-_ID_LEN - 1], k[-_ID_LEN:])
            with txn.cursor(env.records) as rc:
                rc.putmulti(sorted((k[-_ID_LEN:], v) for k, v in batch))
            with txn.cursor(env.runs) as ic:
                ic.putmulti([(tb, last + first) for tb, first, last in runs])
            cur.first()
            for _ in batch:
                cur.delete()
        return len(batch)

    while n := env.write(body):
        moved += n
        if moved % (50 * batch_size) == 0:
            log.info("buffer: moved %d of %d messages", moved, total)
    if total:
        log.warning("buffer: moved %d messages in %.1f s", moved, time.monotonic() - started)
