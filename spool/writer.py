"""Writing binary spool files so that a reader never sees half of one.

A SpoolWriter writes to a dot-prefixed temporary name (which ``list_ready_files`` never lists),
appends the trailer, fsyncs the file, renames it to its final name, and fsyncs the directory
so the rename itself survives a crash. Until the rename the file does not exist for the agent;
after it, the whole file does.

A writer whose caller decides later whether the file may be published at all (the Spark
writer's driver commit: only the attempts Spark counted as successful) stages it instead:
``commit(publish=False)`` finishes and fsyncs the file and renames it to
``.<name>.<token>.staged``, still a dot-file no listing returns, and ``publish_staged`` later
renames it to its final name. ``remove_leftovers`` deletes the temporary and staged files of
given final names (attempts that lost, or a job that failed).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from spool.format import (
    BLOCK_HEADER,
    BLOCK_TARGET_BYTES,
    EXTENSION,
    MAX_BLOCK_BYTES,
    TEMP_SUFFIX,
    SpoolFormatError,
    SpoolRecord,
    encode_file_header,
    encode_record,
    encode_trailer,
)
from spool.reader import BinarySpoolReader

_BUFFER = 1 << 20
FILE_MODE = 0o640
# A finished file waiting for someone to publish it: ".<name>.<token>.staged". The leading dot
# keeps it out of spool.reader.list_ready_files, like a temporary file.
STAGED_SUFFIX = ".staged"
# ".<final name>.<16 hex digits>.tmp" or ".staged": what SpoolWriter leaves before publishing.
_LEFTOVER_RE = re.compile(r"\.(.+)\.([0-9a-f]{16})(\.tmp|\.staged)")


def check_file_name(name: str) -> str:
    """``name`` as a spool file name (``.ferry`` appended if missing); ValueError if it is a
    path, hidden, or a temporary name."""
    if not name or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"spool file name {name!r} must be a plain, non-empty file name")
    if name.startswith("."):
        raise ValueError(f"spool file name {name!r} may not start with '.' (temporary files do)")
    if not name.endswith(EXTENSION):
        name += EXTENSION
    if name.endswith(TEMP_SUFFIX):  # pragma: no cover - impossible after the suffix above
        raise ValueError(f"spool file name {name!r} may not end with {TEMP_SUFFIX}")
    if len(name.encode("utf-8")) > 200:
        raise ValueError(f"spool file name {name!r} is longer than 200 bytes")
    return name


def unique_file_name(prefix: str = "") -> str:
    """A name no other writer will pick: ``<prefix><ns since epoch>-<random>.ferry``; sorts by
    creation time."""
    return check_file_name(f"{prefix}{time.time_ns():020d}-{secrets.token_hex(6)}{EXTENSION}")


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolWriter:
    """Writes one binary spool file; use as a context manager::

        with SpoolWriter(spool_dir, "orders-0001") as w:
            w.write(SpoolRecord("orders", b"..."))
        # here the file is in place, fsynced; an exception instead deletes the temp file

    ``replace=False`` (default) refuses to overwrite an existing file of that name, because
    an overwritten file the agent has not ingested yet is lost. Writers that re-write the same
    content under a fixed name on a retry (the Spark writer) pass ``replace=True``: the file
    then supersedes one that holds a prefix of its records, and goes under another name
    beside one that holds other records (``publish_superseding``); ``path`` says where.
    """

    def __init__(
        self, spool_dir: str | os.PathLike[str], name: str, *, replace: bool = False
    ) -> None:
        self.directory = Path(spool_dir)
        self.name = check_file_name(name)
        self.path = self.directory / self.name
        self.replace = replace
        self.count = 0
        self._crc = 0  # over the file header and block headers: the trailer's CRC
        self._pending: list[bytes] = []  # records of the block being filled
        self._pending_bytes = 0
        self._done = False
        if not self.directory.is_dir():
            raise FileNotFoundError(f"spool directory {self.directory} does not exist")
        # Unique per writer, so two attempts at the same file never write into one temp file.
        self.token = secrets.token_hex(8)
        self.temp_path = self.directory / f".{self.name}.{self.token}{TEMP_SUFFIX}"
        self.staged_path = self.directory / f".{self.name}.{self.token}{STAGED_SUFFIX}"
        fd = os.open(self.temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        self._file = os.fdopen(fd, "wb", buffering=_BUFFER)
        try:
            # The agent reads spool files through the directory's group (docs/packaging.md),
            # so the mode is set explicitly: a writer's umask of 077 must not hide the file.
            os.fchmod(fd, FILE_MODE)
            header = encode_file_header()
            self._crc = zlib.crc32(header)
            self._file.write(header)
        except BaseException:
            self.abort()
            raise

    def write(self, record: SpoolRecord) -> None:
        """Append one record; ValueError if the format cannot hold it (nothing is written)."""
        self._check_open()
        data = encode_record(record)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= BLOCK_TARGET_BYTES:
            self._flush_pending()

    def write_many(self, records: Iterable[SpoolRecord]) -> None:
        for record in records:
            self.write(record)

    def write_block(self, body: bytes | memoryview, count: int) -> None:
        """Append ``count`` records already encoded back to back (``encode_columns`` yields
        such bodies) as one block; the caller vouches that ``body`` is exactly that."""
        self._check_open()
        self._flush_pending()
        self._write_block(body, count)

    def _flush_pending(self) -> None:
        if self._pending:
            body = b"".join(self._pending)
            count = len(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._write_block(body, count)

    def _write_block(self, body: bytes | memoryview, count: int) -> None:
        if count < 1 or not body or len(body) > MAX_BLOCK_BYTES:
            raise ValueError(f"a block of {len(body)} bytes and {count} records is not allowed")
        head = BLOCK_HEADER.pack(len(body), count, zlib.crc32(body))
        self._crc = zlib.crc32(head, self._crc)
        self._file.write(head)
        self._file.write(body)
        self.count += count

    def commit(self, *, publish: bool = True) -> Path:
        """Finish the file and publish it under its final name; returns that path.

        ``publish=False`` stages it instead: the same finished, fsynced file, renamed to
        ``staged_path`` (a dot-file no reader lists), which is returned; ``publish_staged``
        publishes it later, and ``remove_leftovers`` drops it if it must never be.
        """
        self._check_open()
        try:
            self._flush_pending()
            self._file.write(encode_trailer(self.count, self._crc))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if not publish:
                os.rename(self.temp_path, self.staged_path)
            elif self.replace:
                self.path = publish_superseding(self.temp_path, self.path)
            else:
                self._publish_exclusive()
            self._done = True
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.directory)
        return self.path if publish else self.staged_path

    def _publish_exclusive(self) -> None:
        # link() fails if the name exists, where rename() would silently replace it.
        try:
            os.link(self.temp_path, self.path)
        except FileExistsError:
            raise FileExistsError(
                f"spool file {self.path} already exists (pass replace=True to overwrite)"
            ) from None
        except OSError:  # a file system without hard links: check, then rename
            if self.path.exists():
                raise FileExistsError(f"spool file {self.path} already exists") from None
            os.rename(self.temp_path, self.path)
            return
        os.unlink(self.temp_path)

    def abort(self) -> None:
        """Drop the temporary file; the final name is left untouched."""
        if self._done:
            return
        self._done = True
        try:
            self._file.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp_path)

    def _check_open(self) -> None:
        if self._done:
            raise ValueError(f"spool writer for {self.path} is already committed or aborted")

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and not self._done:
            self.commit()
        else:
            self.abort()


def write_spool_file(
    spool_dir: str | os.PathLike[str],
    name: str,
    records: Iterable[SpoolRecord],
    *,
    replace: bool = False,
) -> Path:
    """Write ``records`` to ``spool_dir/name`` atomically; the final path."""
    with SpoolWriter(spool_dir, name, replace=replace) as writer:
        writer.write_many(records)
    return writer.path


def publish_staged(
    staged: str | os.PathLike[str], final_name: str, *, sync: bool = True
) -> Path:
    """Rename a file ``SpoolWriter.commit(publish=False)`` staged to ``final_name`` in the same
    directory, replacing a file of that name (a re-published partition); fsync the directory
    unless ``sync=False`` (a caller publishing many files fsyncs each directory once)."""
    staged = Path(staged)
    final = publish_superseding(staged, staged.parent / check_file_name(final_name))
    if sync:
        fsync_dir(staged.parent)
    return final


def publish_superseding(finished: Path, final: Path) -> Path:
    """Move the finished file ``finished`` to ``final`` without ever replacing a file there
    that holds records it does not hold; returns where its records now are.

    A file waiting under ``final`` has not been claimed by the agent yet (the agent renames a
    file away before reading it), so replacing it blindly could lose it: a task killed in a
    failed job can finish its cut-short file after the rerun published the whole partition,
    and a rerun that partitions rows differently writes other rows under the same names. So:
    the name is free: take it (a hard link, which fails rather than replace); the file there
    is a byte prefix of ours (or the same): replace it; ours is a prefix of it: ours adds
    nothing and is dropped; anything else: ours goes under a new name (``NAME.1.ferry``, ...)
    and both are ingested whole. Only two writers publishing the same name at the same moment
    (speculative attempts in one directory) can still race past this check.
    """
    target = final
    for attempt in itertools.count(1):
        try:
            os.link(finished, target)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: check, then rename
            if not target.exists():
                os.rename(finished, target)
                return target
        else:
            os.unlink(finished)
            return target
        try:
            relation = _relation(finished, target)
        except FileNotFoundError:
            continue  # the agent claimed it meanwhile: the name is free again
        if relation == "extends":
            os.replace(finished, target)
            return target
        if relation == "within":
            os.unlink(finished)
            return target
        target = final.with_name(f"{final.name[: -len(EXTENSION)]}.{attempt}{EXTENSION}")
    raise AssertionError("unreachable")


def _relation(ours: Path, theirs: Path) -> str:
    """"extends" if ``theirs`` holds a byte prefix of ``ours``'s records (or the same),
    "within" if ``ours`` holds a prefix of ``theirs``'s, else "different" (also when
    ``theirs`` is not a complete spool file)."""
    try:
        their = BinarySpoolReader(theirs).fingerprint()
    except SpoolFormatError:
        return "different"
    mine = BinarySpoolReader(ours).fingerprint(their.size)
    if mine.probe == their.digest:
        return "extends"
    if mine.size < their.size and BinarySpoolReader(theirs).fingerprint(mine.size).probe == (
            mine.digest):
        return "within"
    return "different"


def leftover_final_name(file_name: str) -> str | None:
    """The final name a SpoolWriter's temporary or staged file ``file_name`` was meant for,
    or None if ``file_name`` is not one."""
    match = _LEFTOVER_RE.fullmatch(file_name)
    return match.group(1) if match else None


def remove_leftovers(
    spool_dir: str | os.PathLike[str], final_name_matches: Callable[[str], bool]
) -> list[Path]:
    """Delete the temporary and staged files in ``spool_dir`` (not its subdirectories) of
    every final name ``final_name_matches`` accepts; returns what was deleted. A file that
    vanishes meanwhile (another cleaner, a writer finishing) is skipped."""
    removed: list[Path] = []
    with os.scandir(spool_dir) as entries:
        for entry in entries:
            final = leftover_final_name(entry.name)
            if final is None or not final_name_matches(final):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    if removed:
        fsync_dir(spool_dir)
    return sorted(removed)
