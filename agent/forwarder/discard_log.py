"""The discard log: one JSON line per message Ferry gave up on, written before it is deleted.

Each line holds everything needed to send the message again (``ferry replay FILE``): topic,
base64 key and value, partition key, client timestamp, headers, plus why and when it was
discarded. Lines are fsynced before the buffer deletes the messages, so a crash in between
leaves a message in both places but never in neither (it is discarded and logged again; replay
puts such a twin back once, agent/cli/replay.py).

The file never holds a broken line: a write the disk cuts short is truncated away at once,
and a line a crash cut short is cut off before the next write (its messages were still in
the buffer, and are discarded and written again). It is bounded by
``buffer.discard_log_max_bytes``: past it, writes are refused like a full disk, and the
forwarder keeps those messages in the buffer until there is room (docs/buffer.md).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.records import Record
from ferry_client.topic_names import is_legal_topic

log = logging.getLogger(__name__)
# How far back to look for the end of the last whole line (a line holds one message, base64).
_TAIL_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class Discard:
    reason: str
    topic: str
    message_id: str
    accepted_ms: int | None
    record: Record | None  # None when the stored bytes did not decode
    raw: bytes | None = None
    attempts: int = 0
    detail: str = ""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def to_line(d: Discard, now_ms: int) -> dict[str, Any]:
    line: dict[str, Any] = {
        "reason": d.reason,
        "topic": d.topic,
        "id": d.message_id,
        "accepted_ms": d.accepted_ms,
        "discarded_ms": now_ms,
        "attempts": d.attempts,
        "detail": d.detail,
    }
    if d.record is not None:
        r = d.record
        line.update(
            timestamp_ms=r.timestamp_ms,
            partition_key=r.partition_key,
            hash_key=r.hash_key,
            key=_b64(r.key),
            value=_b64(r.value),
            headers=[[n, _b64(v)] for n, v in r.headers],
        )
    else:
        line["raw"] = _b64(d.raw)
    return line


class DiscardLogFull(OSError):
    """Writing would take the discard log past ``buffer.discard_log_max_bytes``."""


class DiscardLog:
    def __init__(self, path: Path, max_bytes: int = 0) -> None:
        self.path = path
        self.max_bytes = max_bytes  # 0: no limit
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._tail_checked = False

    def write(self, discards: Sequence[Discard]) -> None:
        """Append and fsync, all lines or none. Raises OSError when the disk refuses, and
        DiscardLogFull at the size limit (the caller keeps the messages buffered and tries
        again later)."""
        if not discards:
            return
        now_ms = int(time.time() * 1000)
        data = "".join(
            json.dumps(to_line(d, now_ms), separators=(",", ":")) + "\n" for d in discards
        ).encode()
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                size = os.fstat(fd).st_size
                if not self._tail_checked:
                    size = _cut_partial_line(fd, size, self.path)
                    self._tail_checked = True
                if self.max_bytes and size + len(data) > self.max_bytes:
                    raise DiscardLogFull(
                        f"the discard log {self.path} is full: {size} bytes, and "
                        f"{len(discards)} more lines ({len(data)} bytes) would pass "
                        f"buffer.discard_log_max_bytes = {self.max_bytes}; move it away "
                        "(after `ferry replay` if its messages are wanted)")
                try:
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    os.fsync(fd)
                except OSError:
                    # A part written (disk full) would glue the retry's first line onto a
                    # fragment, and `ferry replay` refuses a file with a broken line.
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, size)
                    raise
            finally:
                os.close(fd)


def _cut_partial_line(fd: int, size: int, path: Path) -> int:
    """Truncate a last line that does not end in a newline (a crash in the middle of a
    write); returns the size after. The messages on it were not deleted yet."""
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            keep = start + nl + 1
            break
        end = start
    else:
        keep = 0
    os.ftruncate(fd, keep)
    log.warning("cut a partial last line of %d bytes off the discard log %s (a write cut "
                "short by a crash; its messages stayed in the buffer)", size - keep, path)
    return keep


class ReplayError(ValueError):
    pass


def read_discards(path: Path) -> Iterator[tuple[int, Record]]:
    """Records of a discard log, with their line numbers; raises ReplayError on a bad line."""
    with path.open("rb") as f:
        for lineno, _, record in parse_discards(f, path):
            yield lineno, record


def parse_discards(lines: Iterable[bytes], path: Path) -> Iterator[tuple[int, bytes, Record]]:
    """The records of a discard log's ``lines`` (read from ``path``, named in errors), each
    with its line number and the line itself; raises ReplayError on a bad line."""
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        yield lineno, raw, _record(raw, lineno, path)


def _record(raw: bytes, lineno: int, path: Path) -> Record:
    try:
        doc = json.loads(raw)
        if doc.get("value") is None:
            raise ReplayError(f"line {lineno}: no decodable message (reason "
                              f"{doc.get('reason')!r}); it cannot be replayed")
        key = doc.get("key")
        topic = doc["topic"]
        pk = doc.get("partition_key")
        ts = doc.get("timestamp_ms")
        if not is_legal_topic(topic):
            raise ValueError(f"{topic!r} is not a legal topic name")
        if pk is not None and (type(pk) is not int or not -(2**31) <= pk < 2**31):
            raise ValueError(f"partition_key {pk!r} is not a 32-bit integer")
        if ts is not None and (type(ts) is not int or not -(2**63) <= ts < 2**63):
            raise ValueError(f"timestamp_ms {ts!r} is not a 64-bit integer")
        return Record(
            topic=str(doc["topic"]),
            value=base64.b64decode(doc["value"], validate=True),
            key=base64.b64decode(key, validate=True) if key is not None else None,
            partition_key=doc.get("partition_key"),
            timestamp_ms=int(time.time() * 1000 if doc.get("timestamp_ms") is None
                             else doc["timestamp_ms"]),
            headers=tuple((str(n), base64.b64decode(v)) for n, v in
                          doc.get("headers") or ()),
            hash_key=bool(doc.get("hash_key", False)),
        )
    except ReplayError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReplayError(f"{path}:{lineno}: not a discard-log line: {exc}") from None
