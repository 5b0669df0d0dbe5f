"""What the records of one spool file are judged by before they are stored: the Kafka
topics' limits (agent/signals/limits.py). A record its Kafka topic can never take is left
out, counted and logged, and the rest of its file ingested: a valid file is not corrupt.

Both spool strategies (spool_records.py, spool_blocks.py) screen with it; the intake counts
what it left out once the progress past those records is committed (``Screen.count``).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from agent.ingest import kafka_limits
from agent.metrics import Registry
from agent.process.log_limit import LogLimit
from agent.records import Source
from agent.signals.limits import Snapshot
from spool.format import SpoolRecord


class Refused(NamedTuple):
    """A record of a spool file not stored: its Kafka topic can never take it."""

    record: int  # its index in the file
    topic: str
    reason: str  # agent/reasons.py: too_large_for_topic, timestamp_out_of_range
    detail: str


class Screen:
    """What the records of one file are judged by: the Kafka topics' limits as the forwarder
    last published them (agent/signals/limits.py) when the file's intake began, this host's
    clock then, and the file's name for the log. A topic whose limits are not known takes
    everything."""

    def __init__(self, snapshot: Snapshot, now_ms: int, path: Path, said: LogLimit) -> None:
        self.limits = snapshot.topics
        self.compression = snapshot.compression
        self.now_ms = now_ms
        self.path = path
        self.said = said
        self.bounds = {topic: kafka_limits.bounds(limit, now_ms)
                       for topic, limit in self.limits.items()}

    def refusal(self, index: int, r: SpoolRecord) -> Refused | None:
        """Why record ``index`` is not stored, or None. The record's timestamp is the one
        Kafka will judge: the file's own for a binary record (0: none, stamped at intake,
        never refused), the line's or else the file's mtime for a hand-made file."""
        limit = self.limits.get(r.topic)
        if limit is None:
            return None
        room, earliest, latest = self.bounds[r.topic]
        ts, key = r.timestamp_ms, r.key
        if earliest <= ts <= latest or ts <= 0:
            # The common verdict without a call (no headers), or with the size arithmetic
            # alone (headers): only what may not fit is judged in full (compression).
            if not r.headers:
                if len(r.value) + (len(key) if key is not None else 0) <= room:
                    return None
            elif not kafka_limits.may_be_too_large(limit, None if key is None else len(key),
                                                   len(r.value), r.headers):
                return None
        found = kafka_limits.refusal(r.topic, limit, self.compression, r.key, r.value,
                                     r.timestamp_ms, self.now_ms, r.headers)
        return None if found is None else Refused(index, r.topic, *found)

    def count(self, registry: Registry, refused: list[Refused]) -> None:
        """Count, sample and log (a line a minute per topic and reason, with the count of
        the lines left out) records not stored, once their batch is."""
        for no in refused:
            registry.inc("messages_rejected", source=Source.SPOOL, reason=no.reason)
            registry.sample("rejected", no.reason, {"source": Source.SPOOL,
                                                    "file": str(self.path), "record": no.record,
                                                    "topic": no.topic, "detail": no.detail})
            self.said.warning(f"{no.reason} {no.topic}",
                              "spool file %s: record %d to topic %r not stored (%s): %s",
                              self.path, no.record, no.topic, no.reason, no.detail)
