"""The buffer's LMDB layout: its named databases, their flags, and the fixed keys in them.

Shared by the store (which opens them) and by compaction (which copies them), so that
neither has to import the other.

- ``records``: ``id`` -> encoded record (codec.py). Ids only grow, so every message is
  appended at the end of this tree and its pages stay full whatever the topic names.
- ``topic_runs``: ``topic`` -> its runs, as sorted fixed-size duplicates ``last id, first
  id`` (ids.py): every id from first to last that has a record is a message of this topic.
- ``meta``: the id counter, and per-topic message count and bytes.
- ``state``: small ingest-side state that commits atomically with messages (state.py).
- ``tracking``: id -> what became of a recent message (tracking.py).
"""

from __future__ import annotations

from typing import Any

MAX_DBS = 8
DATABASES: dict[bytes, dict[str, Any]] = {
    b"records": {},
    b"topic_runs": {"dupsort": True, "dupfixed": True},
    b"meta": {},
    b"state": {},
    b"tracking": {},
}
# Layout 1's single tree (``topic NUL id`` -> record), moved away at open (migration.py);
# compaction still copies it, so that a buffer compacted before its first start migrates.
LAYOUT_1_MESSAGES = b"messages"

# meta: the last id given (ids.py), and per topic ``n:topic`` -> (messages, bytes).
LAST_ID = b"last_id"
COUNT_PREFIX = b"n:"
# state: ``gen:topic`` -> the topic's generation, as decimal text (generations.py).
GEN_PREFIX = b"gen:"
