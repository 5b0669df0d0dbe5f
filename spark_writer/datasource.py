"""The ``ferry`` Spark data source: DataFrames and streams into Ferry spool files.

Each Spark task writes its partition to one binary spool file (temporary name, fsync; see
``spool.writer``) named after what it writes, not after the attempt:

    batch:  spark-<job id>-<partition>.ferry               (job id: random per save(), or
                                                            .option("jobId", ...))
    stream: spark-<query id>-<batch id>-<partition>.ferry  (query id survives restarts)

Who publishes it (renames it to that name, where the agent sees it) is the ``publish`` option:

- ``"driver"`` (default): the task leaves its finished file *staged*
  (``.<name>.<token>.staged``, a dot-file the agent never reads) and its commit message says
  where. Only the driver's ``commit()`` knows which attempts Spark counted as successful, so
  it publishes exactly their files and deletes every other attempt's leftovers; ``abort()``
  (a failed job or micro-batch) deletes them all. Needs one spool directory that the driver
  sees too (a shared mount).
- ``"task"``: each task publishes its own file (a spool directory per node, one agent per
  node). A failed attempt may then have published a truncated partition under the final
  name; the agent takes a re-published name only for what goes beyond the bytes it already
  delivered, which is correct because the retry's file starts with the same bytes: same rows
  in, same file out (rows without a ``timestamp`` column get timestamp 0, which the agent
  replaces by its ingest time, instead of the task's clock).

Why: PySpark ends a writer's input *normally* when something upstream of it fails (a Python
UDF, mapInArrow) or Spark kills the task, so a task cannot tell a cut-short partition from a
whole one. See ``docs/spool.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from spool.format import (
    BLOCK_TARGET_BYTES,
    EXTENSION,
    HEADER_FIELD,
    MAX_RECORD_BYTES,
    RECORD_HEADER,
    check_topic,
)
from spool.writer import SpoolWriter, fsync_dir, publish_staged, remove_leftovers

NAME = "ferry"
COLUMNS = ("topic", "value", "key", "partition_key", "timestamp", "headers")
# Local properties Spark's micro-batch engine sets on every task of a batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")
PUBLISH_MODES = ("driver", "task")
# The agent's default [topics] max_message_bytes (agent/config.py TopicConfig; not imported:
# executors have no agent). The agent discards a spool record whose key + value exceed its
# topic's limit, so the writer refuses it first, where the job can still fail.
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000
_ROW_RE = re.compile(r"row (\d+): (.*)", re.DOTALL)
# A block body: encode_columns makes bytes, encode_arrow zero-copy slices of one buffer.
Body = bytes | memoryview

_STRINGISH = (BinaryType, StringType)
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


class FerrySchemaError(ValueError):
    """The DataFrame or the options do not fit the ferry data source; raised on the driver
    before any task runs."""


class FerryPublishError(RuntimeError):
    """The driver cannot publish the files of a finished job (publish mode "driver")."""


@dataclass(frozen=True)
class FerryCommitMessage(WriterCommitMessage):
    """What one task wrote.

    ``path``: the file, None for an empty partition; in publish mode "driver" the staged file
    (``staged`` is True), in mode "task" the published one. ``name``: the final file name
    (also for an empty partition); ``group``: the name prefix every file of this job
    (stream: of this query's micro-batch) shares, so the driver finds their leftovers.
    """

    path: str | None
    host: str
    rows: int
    name: str = ""
    group: str = ""
    staged: bool = False


@dataclass(frozen=True)
class WritePlan:
    """Everything a task needs, checked on the driver and shipped (pickled) to the tasks."""

    spool_dir: str
    topic: str | None  # the fixed topic, or None to read the "topic" column
    columns: frozenset[str]
    publish: str = "driver"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


def _headers_ok(dt: DataType) -> bool:
    if isinstance(dt, MapType):
        return isinstance(dt.keyType, StringType) and isinstance(dt.valueType, _STRINGISH)
    if isinstance(dt, ArrayType) and isinstance(dt.elementType, StructType):
        fields = {f.name: f.dataType for f in dt.elementType.fields}
        return (
            set(fields) == {"key", "value"}
            and isinstance(fields["key"], StringType)
            and isinstance(fields["value"], _STRINGISH)
        )
    return False


_EXPECTED: dict[str, tuple[str, Callable[[DataType], bool]]] = {
    "topic": ("string", lambda dt: isinstance(dt, StringType)),
    "value": ("binary or string", lambda dt: isinstance(dt, _STRINGISH)),
    "key": ("binary or string", lambda dt: isinstance(dt, _STRINGISH)),
    "partition_key": ("int (or byte, short, long within the int range)",
                      lambda dt: isinstance(dt, _INTEGRAL)),
    "timestamp": ("timestamp, timestamp_ntz, or long (ms since the epoch)",
                  lambda dt: isinstance(dt, TimestampType | TimestampNTZType | LongType)),
    "headers": ("array<struct<key:string,value:binary>> or map<string,binary> "
                "(string values allowed)", _headers_ok),
}


def plan_write(schema: StructType, options: Mapping[str, str], overwrite: bool) -> WritePlan:
    """Check the DataFrame's schema and the options; FerrySchemaError listing every problem."""
    problems: list[str] = []
    if overwrite:
        problems.append(
            'mode "overwrite" is not supported: a spool only appends (messages already '
            'handed to Ferry cannot be taken back); use mode("append")'
        )
    path = options.get("path")
    if not path:
        problems.append('no spool directory: use .save("/path/to/spool") or .option("path", ...)')
    else:
        if path.startswith("file://"):
            path = path[len("file://") :]
        elif path.startswith("file:"):
            path = path[len("file:") :]
        if "://" in path or not os.path.isabs(path):
            problems.append(
                f"path {options.get('path')!r} must be an absolute local directory (the "
                "spool directory of the Ferry agent on every node, or a shared mount)"
            )
    fields = {f.name: f.dataType for f in schema.fields}
    unknown = sorted(set(fields) - set(COLUMNS))
    for name in unknown:
        hint = f" (did you mean {name.lower()!r}?)" if name.lower() in COLUMNS else ""
        problems.append(f"unknown column {name!r}{hint}; allowed: {', '.join(COLUMNS)}")
    job_id = options.get("jobId")
    if job_id is not None and not _ID_RE.fullmatch(job_id):
        problems.append(f'option "jobId" {job_id!r} must be 1-100 characters of A-Z a-z 0-9 . _ -')
    topic = options.get("topic")
    if topic is not None:
        try:
            check_topic(topic)
        except ValueError as exc:
            problems.append(f'option "topic": {exc}')
        if "topic" in fields:
            problems.append(
                'both a "topic" column and .option("topic", ...) are given; drop one'
            )
    elif "topic" not in fields:
        problems.append('no topic: add a string column "topic" or .option("topic", "name")')
    if "value" not in fields:
        problems.append('column "value" (binary or string) is missing')
    publish = options.get("publish", "driver")
    if publish not in PUBLISH_MODES:
        problems.append(f'option "publish" {publish!r} must be "driver" (the default: the '
                        'driver publishes the files of successful tasks; needs a spool '
                        'directory the driver sees) or "task" (a spool directory per node)')
    max_bytes = _positive_int(options.get("maxMessageBytes", str(DEFAULT_MAX_MESSAGE_BYTES)))
    if max_bytes is None:
        problems.append(f'option "maxMessageBytes" {options.get("maxMessageBytes")!r} must be a '
                        "positive integer (bytes of key + value per row; the agent's topic "
                        f"max_message_bytes, default {DEFAULT_MAX_MESSAGE_BYTES})")
    for name, dt in fields.items():
        if name in _EXPECTED:
            want, ok = _EXPECTED[name]
            if not ok(dt):
                problems.append(f"column {name!r} is {dt.simpleString()}; expected {want}")
    if problems:
        raise FerrySchemaError(
            "ferry data source: cannot write this DataFrame:\n  - " + "\n  - ".join(problems)
        )
    assert path is not None and max_bytes is not None
    return WritePlan(spool_dir=path, topic=topic, columns=frozenset(fields), publish=publish,
                     max_message_bytes=max_bytes)


def _positive_int(text: str) -> int | None:
    try:
        number = int(text.strip().replace("_", ""))
    except ValueError:
        return None
    return number if number > 0 else None


def _timestamps_ms(column: pa.Array) -> pa.Array:
    """A timestamp column (or a long column of ms) as int64 ms since the epoch."""
    if pa.types.is_timestamp(column.type):
        column = pc.cast(column, pa.timestamp("ms", tz=column.type.tz), safe=False)
    return column.cast(pa.int64())


# Spark does not wait for the tasks of a failed job before the driver's abort: it kills them,
# and a task's Python worker may even begin (or read its input) after the abort.
_ABORTED = ("the job was aborted while this task was still writing (Spark kills the running "
            "tasks of a failed job)")


def _aborted(abort_marker: str | None) -> bool:
    return abort_marker is not None and os.path.exists(abort_marker)


def write_partition(
    plan: WritePlan,
    batches: Iterator[pa.RecordBatch],
    file_name: str,
    group: str,
    abort_marker: str | None = None,
) -> FerryCommitMessage:
    """Write one task's rows as ``plan.spool_dir/file_name``, staged or published as
    ``plan.publish`` says; no file for no rows (the temporary file is created with the first
    row). If ``abort_marker`` exists (the driver aborted the job: this is a task Spark is
    killing, or one whose worker started late) once the temporary file is created, or once
    the file is staged, the file is deleted at once and RuntimeError raised."""
    host = socket.gethostname()
    if not os.path.isdir(plan.spool_dir):
        raise FileNotFoundError(
            f"ferry: spool directory {plan.spool_dir} does not exist on {host} (run the Ferry "
            "agent on every Spark node, or point the path at a shared spool directory)"
        )
    staged = plan.publish == "driver"
    writer: SpoolWriter | None = None
    rows = 0
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if writer is None:
                writer = SpoolWriter(plan.spool_dir, file_name, replace=True)
                # Checked after the file exists, not before: the abort creates the marker
                # before it lists the directory, so either its sweep sees this file or this
                # check sees the marker. A file created after the sweep would otherwise stay
                # for good if Spark kills the worker before it ends (it does, 2 s after it
                # kills the task).
                if _aborted(abort_marker):
                    raise RuntimeError(f"ferry: {file_name} not written: {_ABORTED}")
            try:
                for body, count in _encode_batch(plan, batch):
                    writer.write_block(body, count)
            except ValueError as exc:
                raise ValueError(f"ferry: {file_name} not written: {_renumber(exc, rows)}") from exc
            rows += batch.num_rows
        path = str(writer.commit(publish=not staged)) if writer is not None else None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if staged and path is not None and _aborted(abort_marker):
        # The driver's abort() creates the marker before it deletes the job's staged files,
        # so a file staged after that sweep is seen here, and one staged before it is swept.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise RuntimeError(f"ferry: {file_name} not kept: {_ABORTED}")
    return FerryCommitMessage(path=path, host=host, rows=rows, name=file_name, group=group,
                              staged=staged and path is not None)


def _renumber(exc: ValueError, earlier_rows: int) -> str:
    """The encoders count rows per Arrow batch; the user wants the row of the partition."""
    match = _ROW_RE.match(str(exc))
    if match is None:
        return str(exc)
    return f"row {earlier_rows + int(match.group(1))} of the partition: {match.group(2)}"


def _encode_batch(plan: WritePlan, batch: pa.RecordBatch) -> Iterator[tuple[Body, int]]:
    """The batch as block bodies."""
    names = batch.schema.names

    def col(name: str) -> pa.Array | None:
        return batch.column(names.index(name)) if name in plan.columns else None

    value = col("value")
    assert value is not None  # plan_write made sure it exists
    return encode_arrow(
        plan.topic if plan.topic is not None else col("topic"),
        value,
        col("key"),
        col("partition_key"),
        col("timestamp"),
        col("headers"),
        max_message_bytes=plan.max_message_bytes,
    )


# The fixed part of a record (spool.format.RECORD_HEADER) as a packed numpy record.
_RECORD_DTYPE = np.dtype(
    [
        ("length", "<u4"),
        ("flags", "u1"),
        ("topic_length", "u1"),
        ("header_count", "<u2"),
        ("partition_key", "<i4"),
        ("timestamp", "<i8"),
        ("key_length", "<u4"),
        ("value_length", "<u4"),
    ]
)
assert _RECORD_DTYPE.itemsize == RECORD_HEADER.size
# A header entry's head (spool.format.HEADER_FIELD): name length, value length.
_HEADER_DTYPE = np.dtype([("name_length", "<u2"), ("value_length", "<u4")])
assert _HEADER_DTYPE.itemsize == HEADER_FIELD.size
_MAX_HEADERS = 0xFFFF
_MAX_HEADER_NAME_BYTES = 0xFFFF


def _as_large_binary(column: pa.Array) -> pa.Array:
    if pa.types.is_large_binary(column.type):
        return column
    return column.cast(pa.large_binary())


def _first_row(mask: Any) -> int:
    return int(np.flatnonzero(mask)[0])


def _binaries(lengths: Any, data: pa.Buffer | np.ndarray[Any, Any], n: int) -> pa.Array:
    """A large_binary array of ``n`` values of equal ``lengths`` (an int) back to back in
    ``data``."""
    offsets = np.arange(n + 1, dtype=np.int64) * lengths
    buffer = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    return pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), buffer])


@dataclass(frozen=True)
class HeaderPieces:
    """A batch's header entries, ready to be interleaved with the rest of the records."""

    heads: pa.Array  # per entry: its 6-byte head (name length, value length)
    names: pa.Array  # per entry: the name's UTF-8 bytes
    values: pa.Array  # per entry: the value
    counts: Any  # per row: how many entries (int64)
    row_bytes: Any  # per row: the bytes of its entries (int64)


def _interleave(
    pieces: list[pa.Array], headers: HeaderPieces | None
) -> tuple[pa.Buffer, int, int]:
    """Row by row: element i of every piece, then row i's header entries ([head, name,
    value] each), then row i + 1's: one ``take`` over the concatenation of everything.
    Returns the data and where in it row 0 starts and the last row ends."""
    k = len(pieces)
    n = len(pieces[0])
    rows = np.arange(n, dtype=np.int64)
    if headers is None:
        order = (rows[:, None] + np.arange(k, dtype=np.int64) * n).ravel()
        everything = pieces
    else:
        m = len(headers.heads)
        per_row = k + 3 * headers.counts  # elements of row i in the result
        row_first = np.cumsum(per_row) - per_row
        order = np.empty(k * n + 3 * m, dtype=np.int64)
        for p in range(k):
            order[row_first + p] = rows + p * n
        entry_row = np.repeat(rows, headers.counts)
        row_first_entry = np.cumsum(headers.counts) - headers.counts
        entry_in_row = np.arange(m, dtype=np.int64) - row_first_entry[entry_row]
        position = row_first[entry_row] + k + 3 * entry_in_row
        entries = np.arange(m, dtype=np.int64)
        for q in range(3):
            order[position + q] = entries + (k * n + q * m)
        everything = [*pieces, headers.heads, headers.names, headers.values]
    interleaved = pa.concat_arrays(everything).take(pa.array(order))
    base = interleaved.offset  # take returns an unsliced array, but be exact
    offsets = np.frombuffer(interleaved.buffers()[1], dtype=np.int64)
    return interleaved.buffers()[2], int(offsets[base]), int(offsets[base + len(order)])


def _as_list(column: pa.Array) -> pa.Array:
    """A map<string, v> column as the list<struct<key, value>> it is underneath."""
    if not pa.types.is_map(column.type):
        return column
    return pa.Array.from_buffers(pa.list_(column.values.type), len(column), column.buffers()[:2],
                                 column.null_count, column.offset, children=[column.values])


def encode_headers_arrow(column: pa.Array) -> HeaderPieces | None:
    """A batch's header entries for the bytes that end each record, vectorized.

    ``column`` is ``list<struct<key: string, value: binary|string>>`` or a map of those; a
    null or empty list means no headers. Per entry the spool layout wants a head (2-byte
    name length, 4-byte value length), the name and the value; None when no row has a
    header. ValueError names the 0-based row, with the messages of
    ``spool.format.encode_headers``.
    """
    lists = _as_list(column)
    n = len(lists)
    counts = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    counts = counts.astype(np.int64)
    too_many = counts > _MAX_HEADERS
    if too_many.any():
        row = _first_row(too_many)
        raise ValueError(f"row {row}: {int(counts[row])} headers is more than {_MAX_HEADERS}")
    row_ends = np.cumsum(counts)
    m = int(row_ends[-1]) if n else 0
    if m == 0:
        return None

    def row_of(mask: Any) -> int:  # the row of the first entry in mask
        return int(np.searchsorted(row_ends, _first_row(mask), side="right"))

    entries = pc.list_flatten(lists)  # only non-null lists' entries, in row order
    if entries.null_count:
        raise ValueError(f"row {row_of(entries.is_null().to_numpy(zero_copy_only=False))}: "
                         "a header is null")
    names = pc.struct_field(entries, "key")
    values = pc.struct_field(entries, "value")
    if names.null_count:
        raise ValueError(f"row {row_of(names.is_null().to_numpy(zero_copy_only=False))}: "
                         "a header name is null")
    if values.null_count:
        mask = values.is_null().to_numpy(zero_copy_only=False)
        name = names[_first_row(mask)].as_py()
        raise ValueError(f"row {row_of(mask)}: header {name!r} has a null value")
    names = _as_large_binary(names)
    values = _as_large_binary(values)
    name_lengths = pc.binary_length(names).to_numpy()
    too_long = name_lengths > _MAX_HEADER_NAME_BYTES
    if too_long.any():
        raise ValueError(f"row {row_of(too_long)}: header name of "
                         f"{int(name_lengths[_first_row(too_long)])} bytes is longer than "
                         f"{_MAX_HEADER_NAME_BYTES}")
    value_lengths = pc.binary_length(values).to_numpy()
    heads = np.empty(m, dtype=_HEADER_DTYPE)
    heads["name_length"] = name_lengths
    heads["value_length"] = value_lengths
    entry_bytes = HEADER_FIELD.size + name_lengths.astype(np.int64) + value_lengths
    # Row r's entries are row_ends[r - 1]..row_ends[r]: its bytes, by the running sum.
    through = np.concatenate(([0], np.cumsum(entry_bytes)))[row_ends]
    row_bytes = np.diff(through, prepend=0)
    return HeaderPieces(_binaries(HEADER_FIELD.size, heads, m), names, values, counts, row_bytes)


def encode_arrow(
    topic: str | pa.Array,
    value: pa.Array,
    key: pa.Array | None = None,
    partition_key: pa.Array | None = None,
    timestamp: pa.Array | None = None,
    headers: pa.Array | None = None,
    *,
    block_bytes: int = BLOCK_TARGET_BYTES,
    max_message_bytes: int | None = None,
) -> Iterator[tuple[Body, int]]:
    """Records from Arrow columns, as ``(block body, count)``.

    The same bytes as ``spool.format.encode_columns`` but vectorized: numpy builds every
    record's fixed part (and every header entry's head) at once, and one Arrow ``take``
    interleaves fixed parts, topics, keys, values and header bytes into a single buffer that
    blocks are zero-copy slices of. This is what keeps the Spark writer near ``df.write.json``
    speed. Without ``timestamp`` every record gets timestamp 0 (the agent stamps such a
    record with its ingest time), so the same rows always make the same bytes.
    ``max_message_bytes`` refuses a row whose key + value are longer (what the agent weighs
    against a topic's ``max_message_bytes``). ValueError names the 0-based row.
    """
    n = len(value)
    if n == 0:
        return iter(())
    if value.null_count:
        raise ValueError(f"row {_first_row(value.is_null().to_numpy(zero_copy_only=False))}: "
                         "value is null")
    values = _as_large_binary(value)
    if isinstance(topic, str):
        tb = check_topic(topic).encode("ascii")
        topics = _binaries(len(tb), pa.py_buffer(tb * n), n)
        topic_lengths: Any = len(tb)
    else:
        if topic.null_count:
            mask = topic.is_null().to_numpy(zero_copy_only=False)
            raise ValueError(f"row {_first_row(mask)}: topic is null")
        for name in pc.unique(topic).to_pylist():
            try:
                check_topic(name)
            except ValueError as exc:
                row = pc.index(topic, name).as_py()
                raise ValueError(f"row {row}: {exc}") from None
        topics = _as_large_binary(topic)
        topic_lengths = pc.binary_length(topics).to_numpy()
    record = np.zeros(n, dtype=_RECORD_DTYPE)
    value_lengths = pc.binary_length(values).to_numpy()
    flags = np.zeros(n, dtype=np.uint8)
    pieces = [topics]
    key_lengths: Any = 0
    if key is not None:
        has_key = key.is_valid().to_numpy(zero_copy_only=False)
        keys = _as_large_binary(key).fill_null(b"")
        key_lengths = pc.binary_length(keys).to_numpy()
        flags |= has_key.astype(np.uint8) * 1
        record["key_length"] = key_lengths
        pieces.append(keys)
    pieces.append(values)
    if partition_key is not None:
        has_pk = partition_key.is_valid().to_numpy(zero_copy_only=False)
        pk = partition_key.fill_null(0).cast(pa.int64()).to_numpy()
        bad = (pk < -(2**31)) | (pk > 2**31 - 1)
        if bad.any():
            row = _first_row(bad)
            raise ValueError(
                f"row {row}: partition_key {int(pk[row])} is outside the signed 32-bit range"
            )
        flags |= has_pk.astype(np.uint8) * 2
        record["partition_key"] = pk
    if timestamp is not None:
        ms = _timestamps_ms(timestamp)
        if ms.null_count:
            mask = ms.is_null().to_numpy(zero_copy_only=False)
            raise ValueError(f"row {_first_row(mask)}: timestamp is null")
        record["timestamp"] = ms.to_numpy()
    # else 0, from np.zeros: never the clock, or a retried task would write other bytes.
    if max_message_bytes is not None:
        sizes = key_lengths + value_lengths  # an array: value_lengths is one
        too_large = sizes > max_message_bytes
        if too_large.any():
            row = _first_row(too_large)
            raise ValueError(f"row {row}: key and value of {int(sizes[row])} bytes are more "
                             f"than maxMessageBytes={max_message_bytes}")
    lengths = RECORD_HEADER.size + topic_lengths + key_lengths + value_lengths
    header_pieces = encode_headers_arrow(headers) if headers is not None else None
    if header_pieces is not None:
        lengths = lengths + header_pieces.row_bytes
        record["header_count"] = header_pieces.counts
    too_big = lengths > MAX_RECORD_BYTES
    if too_big.any():
        row = _first_row(too_big)
        raise ValueError(f"row {row}: record of {int(lengths[row])} bytes is larger than "
                         f"{MAX_RECORD_BYTES}")
    record["length"] = lengths
    record["flags"] = flags
    record["topic_length"] = topic_lengths
    record["value_length"] = value_lengths
    pieces.insert(0, _binaries(RECORD_HEADER.size, record, n))
    # Row i is pieces[0][i], pieces[1][i], ..., its headers: one take from one array.
    data, start, end = _interleave(pieces, header_pieces)
    ends = np.cumsum(lengths)
    assert end - start == int(ends[-1]), "interleaving lost bytes"
    return _blocks(data, start, ends, block_bytes)


def _blocks(
    data: pa.Buffer, start: int, ends: Any, block_bytes: int
) -> Iterator[tuple[Body, int]]:
    """Split records (ending at byte ``ends[i]`` after ``start``) into bodies of about
    ``block_bytes``: a body is closed once it reaches the target, like encode_columns."""
    view = memoryview(data)
    n = len(ends)
    first = 0
    done = 0
    while first < n:
        last = int(np.searchsorted(ends, done + block_bytes, side="left"))
        last = min(last + 1, n)
        end = int(ends[last - 1])
        yield view[start + done : start + end], last - first
        first = last
        done = end


def _task() -> TaskContext:
    ctx = TaskContext.get()
    if ctx is None:  # pragma: no cover - write() only ever runs inside a Spark task
        raise RuntimeError("ferry: write() called outside a Spark task")
    return ctx


def _group_matcher(groups: set[str]) -> Callable[[str], bool]:
    """Whether a final file name is one of a partition's of these groups (name prefixes)."""
    patterns = [re.compile(re.escape(group) + r"\d{5,}" + re.escape(EXTENSION)) for group in groups]
    return lambda name: any(p.fullmatch(name) for p in patterns)


def _messages(messages: Sequence[WriterCommitMessage | None]) -> list[FerryCommitMessage]:
    return [m for m in messages if isinstance(m, FerryCommitMessage)]


def publish_files(plan: WritePlan, messages: Sequence[WriterCommitMessage | None],
                  groups: set[str]) -> None:
    """The driver's commit: publish the files of the tasks Spark counted as successful (it
    hands only theirs to commit), then delete every other attempt's leftovers of ``groups``.

    Publish mode "driver": all or nothing as far as this driver can tell: if any successful
    task's staged file is not visible here, nothing is published (FerryPublishError, and
    Spark's abort then deletes the staged files). Mode "task": the tasks published.
    """
    done = _messages(messages)
    groups = groups | {m.group for m in done if m.group}
    staged = [m for m in done if m.staged and m.path is not None]
    if staged:
        missing = [m for m in staged if not os.path.isfile(m.path or "")]
        if missing:
            first = missing[0]
            raise FerryPublishError(
                f"ferry: {len(missing)} of {len(staged)} staged spool files are not visible on "
                f"the driver ({socket.gethostname()}), e.g. {first.path} written on "
                f"{first.host}; nothing was published. With .option(\"publish\", \"driver\") "
                "(the default) the driver publishes the files, so the spool directory must be "
                "one directory shared by the driver and every executor. With a spool "
                "directory on every node (one Ferry agent per Spark node) use "
                '.option("publish", "task"); see docs/spool.md'
            )
        directories = set()
        for m in staged:
            assert m.path is not None
            publish_staged(m.path, m.name, sync=False)
            directories.add(os.path.dirname(m.path))
        for directory in sorted(directories):
            fsync_dir(directory)
    _remove_leftovers(plan, groups)


def _remove_leftovers(plan: WritePlan, groups: set[str]) -> None:
    """Delete the temporary and staged files of ``groups`` that this host sees: attempts that
    failed or were killed, or (abort) a whole failed job. With a spool directory per node the
    driver sees only its own node's (if any); the agent deletes stale temporary files."""
    if groups and os.path.isdir(plan.spool_dir):
        remove_leftovers(plan.spool_dir, _group_matcher(groups))


class FerryBatchWriter(DataSourceArrowWriter):
    """Batch writes: one file per partition, named by (job id, partition)."""

    def __init__(self, plan: WritePlan, job_id: str) -> None:
        self.plan = plan
        self.job_id = job_id

    @property
    def group(self) -> str:
        return f"spark-{self.job_id}-"

    @property
    def abort_marker(self) -> str:
        """Created by abort() (publish mode "driver"): a task that creates or stages its file
        after the job was aborted deletes it. A dot-file, like the leftovers (the agent
        ignores it, and deletes it as a stale temporary file, after an hour by default); a
        rerun with the same jobId removes it on the driver before its tasks start
        (``prepare``)."""
        return os.path.join(self.plan.spool_dir, f".{self.group}aborted")

    def prepare(self) -> None:
        """On the driver, before any task: forget an earlier abort of the same job id."""
        if self.plan.publish == "driver":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.abort_marker)

    def file_name(self, partition: int) -> str:
        return f"{self.group}{partition:05d}{EXTENSION}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
        name = self.file_name(_task().partitionId())
        marker = self.abort_marker if self.plan.publish == "driver" else None
        return write_partition(self.plan, iterator, name, self.group, marker)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Publish the successful tasks' staged files; drop every other attempt's."""
        publish_files(self.plan, messages, {self.group})

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """The job failed: delete every temporary and staged file of this job that this host
        sees (mode "driver": nothing of the job is published). Tasks Spark is still killing,
        or whose Python worker begins only now, may create or stage files after this; the
        abort marker, created before the sweep, makes them delete those. In mode "task"
        finished tasks' files are already published: rerun with the same ``jobId`` so that
        they are rewritten, not duplicated."""
        if self.plan.publish == "driver" and os.path.isdir(self.plan.spool_dir):
            fd = os.open(self.abort_marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
            os.close(fd)
            fsync_dir(self.plan.spool_dir)
        _remove_leftovers(self.plan, {self.group})


def query_id_from_checkpoint(location: str | None) -> str | None:
    """The streaming query's id from its checkpoint's ``metadata`` file (``{"id": ...}``), if
    the checkpoint is on a file system this process can read; else None. The driver's
    commit and abort are not told the query id, and a micro-batch whose every task failed
    sends no message that carries it."""
    if not location:
        return None
    if location.startswith("file://"):
        location = location[len("file://") :]
    elif location.startswith("file:"):
        location = location[len("file:") :]
    if "://" in location or not os.path.isabs(location):
        return None
    try:
        with open(os.path.join(location, "metadata"), encoding="utf-8") as f:
            query_id = json.loads(f.readline()).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    return query_id if isinstance(query_id, str) and _ID_RE.fullmatch(query_id) else None


class FerryStreamWriter(DataSourceStreamArrowWriter):
    """Streaming writes: one file per (query, micro-batch, partition)."""

    def __init__(self, plan: WritePlan, checkpoint: str | None = None) -> None:
        self.plan = plan
        self.checkpoint = checkpoint  # the checkpointLocation option

    @staticmethod
    def group_of(query_id: str, batch_id: int) -> str:
        return f"spark-{query_id}-{batch_id:010d}-"

    @classmethod
    def file_name(cls, query_id: str, batch_id: int, partition: int) -> str:
        return f"{cls.group_of(query_id, batch_id)}{partition:05d}{EXTENSION}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
        ctx = _task()
        query_id = ctx.getLocalProperty(QUERY_ID_PROPERTY)
        batch_id = ctx.getLocalProperty(BATCH_ID_PROPERTY)
        if not query_id or batch_id is None:
            raise RuntimeError(
                "ferry: this task carries no streaming query or batch id (continuous "
                "processing is not supported; use a micro-batch trigger)"
            )
        name = self.file_name(query_id, int(batch_id), ctx.partitionId())
        return write_partition(self.plan, iterator, name, self.group_of(query_id, int(batch_id)))

    def _groups(self, messages: list[WriterCommitMessage | None], batch_id: int) -> set[str]:
        """This micro-batch's name group: from the tasks' messages (empty partitions
        included), or from the checkpoint when no task reported and it is readable here."""
        groups = {m.group for m in _messages(messages) if m.group}
        query_id = query_id_from_checkpoint(self.checkpoint) if not groups else None
        return groups | ({self.group_of(query_id, batch_id)} if query_id else set())

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Publish the successful tasks' staged files; drop every other attempt's."""
        publish_files(self.plan, messages, self._groups(messages, batchId))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Delete this micro-batch's temporary and staged files that this host sees (if the
        query id is known: from a task that reported, or from a checkpoint readable here).
        Spark replays a failed micro-batch under the same query and batch id, and that
        commit deletes whatever is left."""
        _remove_leftovers(self.plan, self._groups(messages, batchId))


class FerryDataSource(DataSource):
    """``df.write.format("ferry")`` / ``df.writeStream.format("ferry")``.

    Options: ``path`` (the spool directory; ``save(path)`` sets it), ``topic`` (one topic for
    every row, instead of a ``topic`` column), ``jobId`` (batch only: names the files, so a
    rerun of a failed job with the same id rewrites instead of duplicating), ``publish``
    (``"driver"``, the default, or ``"task"``; see the module's docstring),
    ``maxMessageBytes`` (largest key + value of a row; default 1000000).
    """

    batch_writer: type[FerryBatchWriter] = FerryBatchWriter
    stream_writer: type[FerryStreamWriter] = FerryStreamWriter

    @classmethod
    def name(cls) -> str:
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> FerryBatchWriter:
        plan = plan_write(schema, self.options, overwrite)
        writer = self.batch_writer(plan, self.options.get("jobId") or uuid.uuid4().hex)
        writer.prepare()
        return writer

    def streamWriter(self, schema: StructType, overwrite: bool) -> FerryStreamWriter:  # noqa: N802
        # "overwrite" means nothing for a stream into a spool: whatever the output mode, each
        # micro-batch is new messages (complete mode re-sends the whole result, as asked).
        return self.stream_writer(plan_write(schema, self.options, overwrite=False),
                                  self.options.get("checkpointLocation"))
