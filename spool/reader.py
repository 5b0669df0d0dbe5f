"""Reading spool files: the binary format, hand-made ``.jsonl`` and ``.txt``, and the listing.

Every reader is an iterator of ``(index, SpoolRecord)`` that holds one block (binary) or one
chunk (hand-made) in memory. ``index`` counts records from 0, so an ingester can commit "file F
up to index i" with its batch and, after a crash, resume with ``iter_records(start=i + 1)``.

A binary file is known good only once its trailer (count and CRC) checked out, and a streaming
reader sees the trailer last. So a whole file is checked before its first record is yielded:
``verify(path)`` does that at zlib.crc32 speed, and ``iter_records`` does it by default
(``verify_first``) through the same open file. A corrupt, truncated or half-written file is
rejected with SpoolFormatError before any of it is ingested; ``verified`` says the check passed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, NamedTuple

from ferry_client.topic_names import is_legal_topic
from spool.format import (
    BLOCK_HEADER,
    EXTENSION,
    FILE_HEADER,
    FLAG_KEY,
    FLAG_PARTITION_KEY,
    JSONL_EXTENSION,
    KNOWN_FLAGS,
    MAX_BLOCK_BYTES,
    PARTITION_KEY_MAX,
    PARTITION_KEY_MIN,
    RECORD_HEADER,
    TEMP_SUFFIX,
    TEXT_EXTENSION,
    TRAILER,
    TRAILER_MAGIC,
    Headers,
    SpoolFormatError,
    SpoolRecord,
    check_file_header,
    check_record_shape,
    decode_headers,
    decode_topic,
)

# Subdirectories of a spool directory the agent owns; never topics, never listed.
RESERVED_DIRS = frozenset({"done", "quarantine"})
# Hand-made files are read in chunks of this size.
CHUNK_SIZE = 1 << 20
# A hand-made line longer than this is refused rather than buffered without limit.
MAX_LINE_BYTES = 16 * 1024 * 1024

_new_record = tuple.__new__


class SpoolBlock(NamedTuple):
    """One block of a binary spool file whose CRC checked out; its records not yet decoded."""

    first: int  # index of the block's first record in the file
    record_count: int  # records in the block
    offset: int  # file offset of the body (for error messages)
    body: bytes


class Mark(NamedTuple):
    """Where a block of a binary file ends: records and record bytes so far, and the digest
    of those bytes."""

    records: int
    size: int
    digest: str


class Fingerprint(NamedTuple):
    """What a binary file holds, by content: a running SHA-256 over its records' bytes (the
    block bodies back to back, so it does not depend on where blocks are cut).

    Two files whose first ``size`` record bytes have the same digest hold the same first
    records, byte for byte; that is how the agent recognises a file it already ingested, or
    one that extends it, under the same name (a retried Spark task).
    """

    records: int
    size: int  # bytes of record data (the file less its header, block headers and trailer)
    digest: str  # of all ``size`` bytes
    marks: tuple[Mark, ...]  # one per block, in file order
    probe: str | None  # digest of the first ``probe_at`` bytes, when asked and within the file


def content_digest(data: bytes = b"") -> hashlib._Hash:
    """The running hash of a Fingerprint (SHA-256: fast with the CPU's SHA extensions)."""
    return hashlib.sha256(data)


def _hex(h: hashlib._Hash) -> str:
    return h.hexdigest()[:32]  # 128 bits: a collision is not a practical concern


class SpoolReader:
    """Base of the three readers: iteration with progress, the verified flag, closing."""

    path: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._count: int | None = None
        self._file: BinaryIO | None = None

    @property
    def verified(self) -> bool:
        """True once the whole file was checked and found complete and intact."""
        return self._count is not None

    @property
    def count(self) -> int | None:
        """Records in the file, known once ``verified``; None before."""
        return self._count

    def __iter__(self) -> Iterator[tuple[int, SpoolRecord]]:
        return self.iter_records()

    def iter_records(
        self, start: int = 0, *, verify_first: bool = True
    ) -> Iterator[tuple[int, SpoolRecord]]:
        """``(index, record)`` for every record from index ``start`` on.

        With ``verify_first`` (the default) the whole file is checked before the first record
        is yielded, through the same open file, so a corrupt or truncated file yields nothing;
        pass False only if ``verify`` just passed. Either way the file is read from its start
        (records before ``start`` are checked, not built) and SpoolFormatError ends the
        iteration at the first fault.
        """
        # zip with a counter pairs each record with its index in C (and reuses the pair tuple
        # when the caller unpacks it), cheaper than building pairs in the decode loop.
        return zip(itertools.count(max(start, 0)), self._iterate(max(start, 0), verify_first))

    def verify(self, *, deep: bool = False) -> int:
        """Check the whole file in bounded memory; its record count, or SpoolFormatError
        saying what is wrong and where. ``deep`` matters for binary files only."""
        raise NotImplementedError

    def _iterate(self, start: int, verify_first: bool) -> Iterator[SpoolRecord]:
        """The records from index ``start`` on."""
        raise NotImplementedError

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> SpoolReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open(self) -> BinaryIO:
        self.close()
        self._count = None
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        return self._file

    def _error(self, what: str) -> SpoolFormatError:
        return SpoolFormatError(f"{self.path}: {what}")


class BinarySpoolReader(SpoolReader):
    """Streams a binary spool file (layout in ``spool.format``), one block at a time."""

    def __init__(
        self, path: str | os.PathLike[str], *, max_block_bytes: int = MAX_BLOCK_BYTES
    ) -> None:
        super().__init__(path)
        self.max_block_bytes = max_block_bytes
        # Legal topics by their raw bytes, shared by decode_block and topic_of.
        self._topic_cache: dict[bytes, str] = {}

    def verify(self, *, deep: bool = False) -> int:
        """Check every block's CRC and the trailer's count and CRC at zlib.crc32 speed;
        ``deep=True`` decodes every record too (it catches a buggy writer's malformed records
        in an intact file, at the cost of a full decode)."""
        f = self._open()
        try:
            topics: dict[bytes, str] = {}
            for first, count, offset, body in self._blocks(f):
                if deep:
                    self._decode_block(body, first, count, first, offset, topics)
        finally:
            self.close()
        assert self._count is not None
        return self._count

    def fingerprint(self, probe_at: int | None = None) -> Fingerprint:
        """Verify the file (as ``verify()``) and hash its content in the same pass.

        ``probe_at``: also the digest of the first ``probe_at`` record bytes (``probe``), so a
        caller can check whether this file starts with what an earlier file held; None when
        the file holds fewer bytes.
        """
        h = content_digest()
        marks: list[Mark] = []
        size = 0
        probe: str | None = _hex(h) if probe_at == 0 else None
        f = self._open()
        try:
            for first, count, _offset, body in self._blocks(f):
                if probe_at is not None and size < probe_at <= size + len(body):
                    part = h.copy()
                    part.update(memoryview(body)[: probe_at - size])
                    probe = _hex(part)
                h.update(body)
                size += len(body)
                marks.append(Mark(first + count, size, _hex(h)))
        finally:
            self.close()
        assert self._count is not None
        return Fingerprint(self._count, size, _hex(h), tuple(marks), probe)

    def _iterate(self, start: int, verify_first: bool) -> Iterator[SpoolRecord]:
        f = self._open()
        try:
            if verify_first:
                for _ in self._blocks(f):
                    pass
                f.seek(0)
            topics: dict[bytes, str] = {}
            for first, count, offset, body in self._blocks(f):
                if first + count > start:
                    # A whole block is decoded before any of it is yielded: a malformed record
                    # stops the block, not half of it.
                    yield from self._decode_block(body, first, count, start, offset, topics)
        finally:
            self.close()

    def iter_blocks(self, start: int = 0, *, verify_first: bool = True) -> Iterator[SpoolBlock]:
        """The raw blocks holding the records from index ``start`` on, for bulk consumers.

        Each block's CRC is checked before it is yielded, and with ``verify_first`` (the
        default) the whole file is checked first, as in ``iter_records``. Records are not
        decoded: a consumer must either check them itself exactly as ``decode_block`` does, or
        call ``decode_block``, which raises SpoolFormatError for a malformed one. Blocks
        before ``start`` are skipped; the first block yielded may begin before ``start``.
        """
        start = max(start, 0)
        f = self._open()
        try:
            if verify_first:
                for _ in self._blocks(f):
                    pass
                f.seek(0)
            for first, count, offset, body in self._blocks(f):
                if first + count > start:
                    yield SpoolBlock(first, count, offset, body)
        finally:
            self.close()

    def decode_block(self, block: SpoolBlock, start: int = 0) -> list[SpoolRecord]:
        """The records of ``block`` from index ``start`` on, all of its records checked;
        SpoolFormatError names the first malformed one."""
        return self._decode_block(block.body, block.first, block.record_count, max(start, 0),
                                  block.offset, self._topic_cache)

    def topic_of(self, raw: bytes) -> str | None:
        """The topic a record names, or None if it is not a legal topic name (cached)."""
        topic = self._topic_cache.get(raw)
        if topic is None:
            try:
                topic = decode_topic(raw)
            except SpoolFormatError:
                return None
            if len(self._topic_cache) < 4096:
                self._topic_cache[raw] = topic
        return topic

    def _blocks(self, f: BinaryIO) -> Iterator[tuple[int, int, int, bytes]]:
        """``(first index, count, body offset, body)`` of each block, after checking its CRC;
        sets ``count`` once the trailer checked out."""
        header = _read_at_least(f, FILE_HEADER.size)
        check_file_header(header, str(self.path))
        crc = zlib.crc32(header)
        offset = FILE_HEADER.size
        index = 0
        while True:
            head = _read_at_least(f, BLOCK_HEADER.size)
            if len(head) < BLOCK_HEADER.size:
                if not head:
                    raise self._error(
                        f"file ends after {index} records at offset {offset} without a "
                        "trailer (truncated, or still being written)"
                    )
                raise self._error(f"truncated: file ends inside a block header at {offset}")
            length, count, body_crc = BLOCK_HEADER.unpack(head)
            if length == 0:
                self._check_trailer(head, index, crc, offset, f)
                self._count = index
                return
            if (
                length > self.max_block_bytes
                or count == 0
                or length < count * RECORD_HEADER.size
            ):
                raise self._error(
                    f"bad block header at offset {offset} ({length} bytes, {count} records; "
                    f"this reader takes blocks up to {self.max_block_bytes} bytes)"
                )
            crc = zlib.crc32(head, crc)
            body = _read_at_least(f, length)
            if len(body) < length:
                raise self._error(
                    f"truncated: file ends inside the block at offset {offset} "
                    f"({len(body)} of {length} bytes present)"
                )
            if zlib.crc32(body) != body_crc:
                raise self._error(
                    f"checksum mismatch in the block at offset {offset} (records {index}.."
                    f"{index + count - 1}): the file is corrupt"
                )
            yield index, count, offset + BLOCK_HEADER.size, body
            index += count
            offset += BLOCK_HEADER.size + length

    def _decode_block(
        self,
        body: bytes,
        first: int,
        count: int,
        start: int,
        body_offset: int,
        topics: dict[bytes, str],
    ) -> list[SpoolRecord]:
        """The block's records from index ``start`` on."""
        # The hot loop: one unpack_from per record, then only the slices a record needs.
        # Topics are cached by their raw bytes, and only legal ones enter the cache, so a hit
        # needs no further check (an empty or over-long topic can never hit).
        unpack = RECORD_HEADER.unpack_from
        new = _new_record
        cls = SpoolRecord
        fixed = RECORD_HEADER.size
        end = len(body)
        pos = 0
        index = first
        out: list[SpoolRecord] = []
        append = out.append
        try:
            while pos < end:
                length, flags, tlen, hcount, pk, ts, klen, vlen = unpack(body, pos)
                nxt = pos + length
                q = pos + fixed + tlen
                v = q + klen
                if (
                    nxt > end
                    or flags & ~KNOWN_FLAGS
                    or (hcount == 0 and v + vlen != nxt)
                    or (klen and not flags & FLAG_KEY)
                    or (pk and not flags & FLAG_PARTITION_KEY)
                ):
                    self._bad_record(body, pos, index, body_offset)
                raw = body[pos + fixed : q]
                topic = topics.get(raw)
                if topic is None:
                    topic = self._topic(raw, index, body_offset + pos)
                    if len(topics) < 4096:
                        topics[raw] = topic
                headers: Headers = (
                    self._headers(body, v + vlen, hcount, nxt, index, body_offset + pos)
                    if hcount
                    else ()
                )
                if index >= start:
                    append(
                        new(
                            cls,
                            (
                                topic,
                                body[v : v + vlen],
                                body[q:v] if flags & FLAG_KEY else None,
                                pk if flags & FLAG_PARTITION_KEY else None,
                                ts,
                                headers,
                            ),
                        )
                    )
                index += 1
                pos = nxt
        except struct.error:
            raise self._error(
                f"record {index} at offset {body_offset + pos}: record header runs past the "
                "end of its block"
            ) from None
        if index - first != count:
            raise self._error(
                f"the block at offset {body_offset - BLOCK_HEADER.size} says {count} records "
                f"but holds {index - first}"
            )
        return out

    def _topic(self, raw: bytes, index: int, offset: int) -> str:
        try:
            return decode_topic(raw)
        except SpoolFormatError as exc:
            raise self._error(f"record {index} at offset {offset}: {exc}") from None

    def _headers(
        self, buf: bytes, pos: int, count: int, end: int, index: int, offset: int
    ) -> Headers:
        try:
            headers, after = decode_headers(buf, pos, count, end)
        except SpoolFormatError as exc:
            raise self._error(f"record {index} at offset {offset}: {exc}") from None
        if after != end:
            raise self._error(
                f"record {index} at offset {offset}: record length does not match its fields"
            )
        return headers

    def _bad_record(self, body: bytes, pos: int, index: int, body_offset: int) -> None:
        where = f"record {index} at offset {body_offset + pos}"
        length, flags, tlen, hcount, pk, _ts, klen, vlen = RECORD_HEADER.unpack_from(body, pos)
        try:
            check_record_shape(length, flags, tlen, hcount, pk, klen, vlen)
        except SpoolFormatError as exc:
            raise self._error(f"{where}: {exc}") from None
        raise self._error(f"{where}: record of {length} bytes runs past the end of its block")

    def _check_trailer(self, head: bytes, count: int, crc: int, offset: int, f: BinaryIO) -> None:
        data = head + _read_at_least(f, TRAILER.size - len(head))
        if len(data) < TRAILER.size:
            raise self._error(f"truncated: file ends inside the trailer at offset {offset}")
        _zero, magic, want_count, want_crc = TRAILER.unpack(data)
        if magic != TRAILER_MAGIC:
            raise self._error(f"bad trailer at offset {offset} (magic {magic!r})")
        if want_crc != crc:
            raise self._error(
                f"checksum mismatch: trailer CRC {want_crc:#010x}, header CRC {crc:#010x} "
                "(the file is corrupt)"
            )
        if want_count != count:
            raise self._error(f"trailer says {want_count} records but the file holds {count}")
        if f.read(1):
            raise self._error(f"unexpected bytes after the trailer at offset {offset}")


def _read_at_least(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes; fewer only at end of file (raw reads may return short)."""
    data = f.read(n)
    if len(data) >= n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = f.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class _LinesReader(SpoolReader):
    """Common part of the hand-made formats: one message per non-empty line."""

    def __init__(self, path: str | os.PathLike[str], topic: str) -> None:
        super().__init__(path)
        if not is_legal_topic(topic):
            raise SpoolFormatError(
                f"{path}: directory name {topic!r} is not a legal Kafka topic name"
            )
        self.topic = topic
        self._timestamp_ms = 0

    def verify(self, *, deep: bool = False) -> int:
        """Parse every line (``deep`` changes nothing: parsing is the check)."""
        f = self._open()
        try:
            for _ in self._parse(f, 0):
                pass
        finally:
            self.close()
        assert self._count is not None
        return self._count

    def _iterate(self, start: int, verify_first: bool) -> Iterator[SpoolRecord]:
        f = self._open()
        try:
            if verify_first:
                for _ in self._parse(f, 0):
                    pass
                f.seek(0)
            yield from self._parse(f, start)
        finally:
            self.close()

    def _parse(self, f: BinaryIO, start: int) -> Iterator[SpoolRecord]:
        # Hand-made files carry no time; the file's mtime is stable across a resume.
        self._timestamp_ms = os.fstat(f.fileno()).st_mtime_ns // 1_000_000
        index = 0
        for lineno, line in _lines(f, self.path):
            if not line:
                continue
            if index >= start:
                yield self._record(line, lineno)
            index += 1
        self._count = index

    def _record(self, line: bytes, lineno: int) -> SpoolRecord:
        raise NotImplementedError


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its ``\\n`` or ``\\r\\n``), in bounded memory."""
    lineno = 0
    rest = b""
    while True:
        chunk = f.read(CHUNK_SIZE)
        if not chunk:
            break
        data = rest + chunk if rest else chunk
        lines = data.split(b"\n")
        rest = lines.pop()
        if len(rest) > MAX_LINE_BYTES:
            raise SpoolFormatError(
                f"{path}: line {lineno + len(lines) + 1} is longer than {MAX_LINE_BYTES} bytes"
            )
        for line in lines:
            lineno += 1
            yield lineno, line[:-1] if line.endswith(b"\r") else line
    if rest:
        yield lineno + 1, rest[:-1] if rest.endswith(b"\r") else rest


class TextLinesReader(_LinesReader):
    """``<spool>/<topic>/*.txt``: every non-empty line is one message value, as bytes."""

    def _record(self, line: bytes, lineno: int) -> SpoolRecord:
        return SpoolRecord(self.topic, line, None, None, self._timestamp_ms, ())


_JSONL_FIELDS = frozenset({"value", "key", "partition_key", "timestamp", "headers"})


class JsonLinesReader(_LinesReader):
    """``<spool>/<topic>/*.jsonl``: every non-empty line is a JSON object::

        {"value": "...", "key": "...", "partition_key": 7, "timestamp": 1700000000000,
         "headers": {"name": "value"}}

    ``value`` is required: a string is sent as its UTF-8 bytes, any other JSON value as its
    compact JSON text. ``key`` (string or null), ``partition_key`` (signed 32-bit integer),
    ``timestamp`` (ms since the epoch; default the file's mtime) and ``headers`` (object of
    strings) are optional. Any other field is an error, so a typo is not silently dropped.
    """

    def _record(self, line: bytes, lineno: int) -> SpoolRecord:
        where = f"{self.path}: line {lineno}"
        try:
            return self._decode(line, where)
        except RecursionError:
            raise SpoolFormatError(f"{where}: JSON nested too deeply") from None
        except UnicodeError as exc:
            # e.g. a lone surrogate escape (\ud800): valid JSON, not encodable as UTF-8.
            raise SpoolFormatError(f"{where}: text that is not valid Unicode ({exc})") from None

    def _decode(self, line: bytes, where: str) -> SpoolRecord:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise SpoolFormatError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise SpoolFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = obj.keys() - _JSONL_FIELDS
        if unknown:
            raise SpoolFormatError(
                f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_JSONL_FIELDS)}"
            )
        if "value" not in obj or obj["value"] is None:
            raise SpoolFormatError(f"{where}: 'value' is required and may not be null")
        raw = obj["value"]
        value = (
            raw.encode("utf-8")
            if isinstance(raw, str)
            else json.dumps(raw, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        )
        key = obj.get("key")
        if key is not None and not isinstance(key, str):
            raise SpoolFormatError(f"{where}: 'key' must be a string or null")
        pk = obj.get("partition_key")
        if pk is not None and (
            not isinstance(pk, int)
            or isinstance(pk, bool)
            or not PARTITION_KEY_MIN <= pk <= PARTITION_KEY_MAX
        ):
            raise SpoolFormatError(
                f"{where}: 'partition_key' must be an integer in the signed 32-bit range"
            )
        ts = obj.get("timestamp")
        if ts is None:
            ts = self._timestamp_ms
        elif not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts < 2**63:
            raise SpoolFormatError(f"{where}: 'timestamp' must be ms since the epoch (integer)")
        raw_headers = obj.get("headers") or {}
        if not isinstance(raw_headers, dict) or not all(
            isinstance(v, str) for v in raw_headers.values()
        ):
            raise SpoolFormatError(f"{where}: 'headers' must be an object of strings")
        headers = tuple((k, v.encode("utf-8")) for k, v in raw_headers.items())
        return SpoolRecord(
            self.topic,
            value,
            key.encode("utf-8") if key is not None else None,
            pk,
            ts,
            headers,
        )


def open_spool_file(path: str | os.PathLike[str]) -> SpoolReader:
    """The reader for ``path`` by its extension: ``.ferry`` binary, ``.jsonl``, ``.txt``.

    For ``.jsonl`` and ``.txt`` the topic is the name of the directory holding the file. Only
    use this on paths from ``list_ready_files`` (which never lists those files in the spool
    root, whose name is not a topic).
    """
    p = Path(path)
    if p.name.startswith(".") or p.name.endswith(TEMP_SUFFIX):
        raise SpoolFormatError(f"{p}: a temporary file (still being written), not a spool file")
    if p.suffix == EXTENSION:
        return BinarySpoolReader(p)
    if p.suffix == JSONL_EXTENSION:
        return JsonLinesReader(p, p.parent.name)
    if p.suffix == TEXT_EXTENSION:
        return TextLinesReader(p, p.parent.name)
    raise SpoolFormatError(
        f"{p}: unsupported spool file type {p.suffix!r} "
        f"(want {EXTENSION}, {JSONL_EXTENSION} or {TEXT_EXTENSION})"
    )


def verify(path: str | os.PathLike[str], *, deep: bool = False) -> int:
    """Check a whole spool file in bounded memory: its record count, or SpoolFormatError
    saying what is wrong. Binary: every block's CRC, the trailer's count and CRC (``deep``:
    every record decoded, too); hand-made: every line parses.
    """
    return open_spool_file(path).verify(deep=deep)


def read_spool_file(path: str | os.PathLike[str]) -> list[SpoolRecord]:
    """Every record of a (small) spool file, after the file verified; tests and tools."""
    records = [record for _, record in open_spool_file(path)]
    return records


def _is_temp(name: str) -> bool:
    return name.startswith(".") or name.endswith(TEMP_SUFFIX)


def _topic_dirs(spool_dir: Path) -> Iterator[os.DirEntry[str]]:
    with os.scandir(spool_dir) as entries:
        for entry in entries:
            if (
                entry.is_dir(follow_symlinks=False)
                and entry.name not in RESERVED_DIRS
                and not entry.name.startswith(".")
                and is_legal_topic(entry.name)
            ):
                yield entry


def _classify(spool_dir: Path) -> tuple[list[os.DirEntry[str]], list[os.DirEntry[str]]]:
    """(ready, unrecognized) file entries of a spool directory, temp files left out."""
    ready: list[os.DirEntry[str]] = []
    other: list[os.DirEntry[str]] = []
    with os.scandir(spool_dir) as entries:
        for entry in entries:
            if _is_temp(entry.name):
                continue
            if entry.is_file(follow_symlinks=False):
                (ready if entry.name.endswith(EXTENSION) else other).append(entry)
            elif entry.is_dir(follow_symlinks=False) and not (
                entry.name in RESERVED_DIRS or is_legal_topic(entry.name)
            ):
                other.append(entry)
    for topic_dir in _topic_dirs(spool_dir):
        with os.scandir(topic_dir.path) as entries:
            for entry in entries:
                if _is_temp(entry.name):
                    continue
                if entry.is_file(follow_symlinks=False) and entry.name.endswith(
                    (EXTENSION, JSONL_EXTENSION, TEXT_EXTENSION)
                ):
                    ready.append(entry)
                else:
                    other.append(entry)
    return ready, other


def _sorted_paths(entries: list[os.DirEntry[str]]) -> list[Path]:
    keyed = []
    for entry in entries:
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime_ns
        except FileNotFoundError:  # taken by another scanner meanwhile
            continue
        keyed.append((mtime, entry.path))
    keyed.sort()
    return [Path(p) for _, p in keyed]


def list_ready_files(spool_dir: str | os.PathLike[str]) -> list[Path]:
    """Files ready to ingest, oldest first (by mtime, then path): ``<spool>/*.ferry`` and
    ``<spool>/<topic>/*.{ferry,jsonl,txt}``.

    Never listed: names starting with ``.`` or ending ``.tmp`` (still being written), the
    agent's ``done/`` and ``quarantine/`` directories, directories whose name is not a legal
    topic, ``.jsonl``/``.txt`` in the spool root (no topic), deeper directories and other
    extensions (see ``list_unrecognized_files``). A file's identity for de-duplication is its
    path relative to ``spool_dir``.
    """
    ready, _ = _classify(Path(spool_dir))
    return _sorted_paths(ready)


def list_unrecognized_files(spool_dir: str | os.PathLike[str]) -> list[Path]:
    """What ``list_ready_files`` leaves alone that is not a temporary file or the agent's own:
    so the agent can log and count files a user dropped in the wrong place."""
    _, other = _classify(Path(spool_dir))
    return sorted(Path(e.path) for e in other)


def list_stale_temp_files(spool_dir: str | os.PathLike[str], older_than_s: float) -> list[Path]:
    """Temporary files (``.*`` or ``*.tmp``) not modified for ``older_than_s`` seconds: left by
    a writer that crashed, which never renames them, so they are safe to delete."""
    root = Path(spool_dir)
    cutoff = time.time_ns() - int(older_than_s * 1e9)
    stale: list[Path] = []
    dirs = [root] + [Path(d.path) for d in _topic_dirs(root)]
    for d in dirs:
        with os.scandir(d) as entries:
            for entry in entries:
                if not _is_temp(entry.name) or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mtime_ns < cutoff:
                        stale.append(Path(entry.path))
                except FileNotFoundError:
                    continue
    return sorted(stale)
