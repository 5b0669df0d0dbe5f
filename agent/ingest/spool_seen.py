"""What the spool intake remembers of binary files it ingested, and what it does with a file
that comes again under the same name.

A name comes again when a Spark task is retried, a speculative attempt finishes, a job is
re-run with the same ``jobId`` or a micro-batch is replayed: the writer names files after what
they hold (job, partition), not after the attempt. The agent compares *content*, never size:
it keeps, per name, the fingerprint of what it ingested (``spool.reader.Fingerprint``: a
running SHA-256 over the record bytes with a mark at every block end) and decides:

- the same bytes, or a prefix of them: a **duplicate**; nothing is ingested again;
- the same bytes followed by more (a task that failed upstream of the writer published the
  first part, its retry the whole): an **extension**; only the records after the prefix;
- anything else (a nondeterministic plan, or a different file reusing the name): the file
  **diverged**; it is ingested whole, counted and logged. Never lose, even if it duplicates.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

from spool.reader import Fingerprint, Mark

Outcome = Literal["new", "duplicate", "extension", "diverged"]


@dataclass(frozen=True)
class Seen:
    """What was ingested under one name: its fingerprint's marks, and when."""

    records: int
    size: int
    digest: str
    marks: tuple[Mark, ...]
    at: float  # time.time() when the file was done

    @classmethod
    def of(cls, fp: Fingerprint, at: float | None = None) -> Seen:
        return cls(fp.records, fp.size, fp.digest, fp.marks,
                   time.time() if at is None else at)

    def encode(self) -> bytes:
        # Marks as three parallel lists: a 3M-row file has ~700 of them.
        return json.dumps({
            "v": 2, "records": self.records, "size": self.size, "digest": self.digest,
            "at": self.at, "mark_records": [m.records for m in self.marks],
            "mark_sizes": [m.size for m in self.marks],
            "mark_digests": [m.digest for m in self.marks],
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> Seen | None:
        """The entry, or None for none or one this version cannot use: an entry written before
        content fingerprints (size and count only) proves nothing about content, so such a
        name is taken as never seen (ingested whole: never lose)."""
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("v") != 2:
                return None
            marks = tuple(Mark(int(r), int(s), str(d)) for r, s, d in zip(
                doc["mark_records"], doc["mark_sizes"], doc["mark_digests"], strict=True))
            return cls(int(doc["records"]), int(doc["size"]), str(doc["digest"]), marks,
                       float(doc["at"]))
        except (ValueError, KeyError, TypeError):
            return None

    def age_at(self, now: float) -> float:
        return now - self.at


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    start: int  # the index of the first record to ingest (records == start: none)
    remember: Seen | None  # what to keep for the name once the file is done (None: keep)


def probe_for(seen: Seen | None) -> int | None:
    """The byte offset a new file's fingerprint must be probed at to compare with ``seen``."""
    return None if seen is None else seen.size


def decide(seen: Seen | None, fp: Fingerprint, now: float | None = None) -> Decision:
    """What to do with a verified file ``fp`` whose name was ingested before as ``seen``.

    ``fp.probe`` must be the digest at ``probe_for(seen)``.
    """
    if seen is None:
        return Decision("new", 0, Seen.of(fp, now))
    if fp.records == 0:
        return Decision("duplicate", 0, None)  # nothing in it to ingest, nothing to remember
    if fp.size >= seen.size and fp.probe == seen.digest:
        if fp.size == seen.size:
            return Decision("duplicate", fp.records, None)
        # Equal bytes split into equal records: the prefix is exactly seen.records records.
        return Decision("extension", seen.records, Seen.of(fp, now))
    if fp.size < seen.size and Mark(fp.records, fp.size, fp.digest) in seen.marks:
        # An earlier, shorter attempt published after the whole file: nothing new in it.
        return Decision("duplicate", fp.records, None)
    return Decision("diverged", 0, Seen.of(fp, now))
