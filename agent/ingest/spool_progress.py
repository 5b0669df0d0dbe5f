"""A spool file's progress: what commits with each of its batches, in the same LMDB
transaction, so that a crash at any point neither loses nor duplicates a record. After a
restart a claimed file whose identity matches its progress resumes at the recorded index;
once the last batch is in, the progress says "done" (and a binary file is remembered by name
and content, spool_seen.py) until the file is removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.ingest.spool_seen import Seen


@dataclass(frozen=True)
class Identity:
    """What tells one file from another file later written under the same name."""

    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Identity:
        st = path.stat()
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)

    def doc(self) -> list[int]:
        """As the progress records it."""
        return [self.inode, self.size, self.mtime_ns]


class Progress:
    """A file's progress records: what to commit with the batch that ends at an index."""

    def __init__(self, key: bytes, ident: Identity, count: int, seen_key: bytes | None,
                 seen: Seen | None) -> None:
        self.key = key
        self.ident = ident
        self.count = count
        self.seen_key = seen_key  # binary files: remembered by name and content once done
        self.seen = seen

    def puts(self, next_index: int) -> dict[bytes, bytes]:
        done = next_index >= self.count
        doc = {"identity": self.ident.doc(), "next": next_index, "done": done,
               "count": self.count}
        puts = {self.key: json.dumps(doc).encode()}
        if done and self.seen_key is not None and self.seen is not None:
            puts[self.seen_key] = self.seen.encode()
        return puts


def load(raw: bytes | None) -> dict[str, Any] | None:
    """A progress record as committed (``Progress.puts``); None if there is none, or it is
    not one."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
