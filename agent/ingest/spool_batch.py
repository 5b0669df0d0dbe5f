"""What both spool strategies (spool_records.py, spool_blocks.py) share about a batch: its
caps, the pause while the buffer has no room for it, and its refusal for good.

A file is ingested in batches; each commits with the file's progress (spool_progress.py).
A batch the buffer has no room for (its ``max_bytes``, the disk's reserve, a disk error)
waits in its file and is tried again (``Pause``); a batch it can never take (a record it
cannot encode) ends the file's intake (``Unstorable``: the intake quarantines the file).
"""

from __future__ import annotations

import logging
import time

from agent.buffer.refusals import Refusal
from agent.buffer.weight import RECORD_OVERHEAD_BYTES
from agent.metrics import Registry

# Messages per batch at most.
BATCH = 20000
# Bytes counted per message on top of its value when capping a batch: the committer's own
# figure, so a batch sized here is never held back there.
WEIGHT = RECORD_OVERHEAD_BYTES
# How long a batch the buffer refused waits before it is tried again.
RETRY_SECONDS = 0.5
# A run of one topic's messages, encoded under the given topic generation.
Run = tuple[str, list[bytes], int]


class Unstorable(Exception):
    """The buffer refuses a batch of the file for good (InvalidGroup), not for lack of room."""


class Pause:
    """A pause of the intake for room in the buffer: each refused attempt counted
    (spool_batches_deferred{reason}), the gauge spool_intake_paused, and a log line when it
    starts and one when it ends, with what happened in between (a long outage would
    otherwise log a line every half second). The records are not counted as rejected: they
    wait in their file, and nothing was refused to anyone. One for the intake, whichever
    strategy's batch was refused; it logs as the intake (``log``)."""

    def __init__(self, registry: Registry, log: logging.Logger) -> None:
        self.registry = registry
        self.log = log
        self.since: float | None = None
        self.attempts = 0

    def refused(self, why: Refusal) -> None:
        self.attempts += 1
        reason = why.reason
        self.registry.inc("spool_batches_deferred", reason=reason)
        if self.since is None:
            self.since = time.monotonic()
            self.registry.set("spool_intake_paused", 1.0)
            self.log.warning("spool intake paused: the buffer refused a batch (%s: %s); the "
                             "file waits on disk with its progress, and is retried every "
                             "%g s", reason, why, RETRY_SECONDS)

    def ended(self) -> None:
        if self.since is not None:
            self.registry.set("spool_intake_paused", 0.0)
            self.log.info("spool intake resumed after %.0f s and %d refused attempts",
                          time.monotonic() - self.since, self.attempts)
            self.since, self.attempts = None, 0
