"""The ``ferry`` Spark data source: DataFrames and streams into Ferry spool files.

Each Spark task writes its partition to one binary spool file (temporary name, fsync,
atomic rename; see ``spool.writer``) named after what it writes, not after the attempt:

    batch:  spark-<job id>-<partition>.ferry               (job id: random per save(), or
                                                            .option("jobId", ...))
    stream: spark-<query id>-<batch id>-<partition>.ferry  (query id survives restarts)

so a retried task, a speculative duplicate or a replayed micro-batch rewrites the same name
instead of adding a second copy, and the agent, which de-duplicates by file name, ingests a
name once. Nothing happens on the driver at commit: the files are on the executors' disks
(one agent per node) or already visible in a shared directory. See ``docs/spool.md``.
"""

from __future__ import annotations

import os
import re
import socket
import time
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
    MAX_RECORD_BYTES,
    RECORD_HEADER,
    Headers,
    check_topic,
    encode_columns,
)
from spool.writer import SpoolWriter

NAME = "ferry"
COLUMNS = ("topic", "value", "key", "partition_key", "timestamp", "headers")
# Local properties Spark's micro-batch engine sets on every task of a batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")
_ROW_RE = re.compile(r"row (\d+): (.*)", re.DOTALL)
# A block body: encode_columns makes bytes, encode_arrow zero-copy slices of one buffer.
Body = bytes | memoryview

_STRINGISH = (BinaryType, StringType)
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


class FerrySchemaError(ValueError):
    """The DataFrame or the options do not fit the ferry data source; raised on the driver
    before any task runs."""


@dataclass(frozen=True)
class FerryCommitMessage(WriterCommitMessage):
    """What one task wrote: the file (None for an empty partition), its host and row count."""

    path: str | None
    host: str
    rows: int


@dataclass(frozen=True)
class WritePlan:
    """Everything a task needs, checked on the driver and shipped (pickled) to the tasks."""

    spool_dir: str
    topic: str | None  # the fixed topic, or None to read the "topic" column
    columns: frozenset[str]


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
    for name, dt in fields.items():
        if name in _EXPECTED:
            want, ok = _EXPECTED[name]
            if not ok(dt):
                problems.append(f"column {name!r} is {dt.simpleString()}; expected {want}")
    if problems:
        raise FerrySchemaError(
            "ferry data source: cannot write this DataFrame:\n  - " + "\n  - ".join(problems)
        )
    assert path is not None
    return WritePlan(spool_dir=path, topic=topic, columns=frozenset(fields))


def _binary_list(column: pa.Array) -> list[bytes | None]:
    if pa.types.is_string(column.type):
        column = column.cast(pa.binary())
    elif pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    result: list[bytes | None] = column.to_pylist()
    return result


def _timestamps_ms(column: pa.Array) -> pa.Array:
    """A timestamp column (or a long column of ms) as int64 ms since the epoch."""
    if pa.types.is_timestamp(column.type):
        column = pc.cast(column, pa.timestamp("ms", tz=column.type.tz), safe=False)
    return column.cast(pa.int64())


def _headers_list(column: pa.Array) -> list[Headers | None]:
    out: list[Headers | None] = []
    for row, item in enumerate(column.to_pylist()):
        if not item:
            out.append(None)
            continue
        headers: list[tuple[str, bytes]] = []
        for pair in item:
            # array<struct<key, value>> arrives as dicts, map<string, ...> as (key, value)
            name, value = (pair["key"], pair["value"]) if isinstance(pair, dict) else pair
            if name is None:
                raise ValueError(f"row {row}: a header name is null")
            if value is None:
                raise ValueError(f"row {row}: header {name!r} has a null value")
            headers.append((name, value.encode("utf-8") if isinstance(value, str) else value))
        out.append(tuple(headers))
    return out


def write_partition(
    plan: WritePlan, batches: Iterator[pa.RecordBatch], file_name: str
) -> FerryCommitMessage:
    """Write one task's rows to ``plan.spool_dir/file_name``; no file for no rows."""
    host = socket.gethostname()
    if not os.path.isdir(plan.spool_dir):
        raise FileNotFoundError(
            f"ferry: spool directory {plan.spool_dir} does not exist on {host} (run the Ferry "
            "agent on every Spark node, or point the path at a shared spool directory)"
        )
    writer: SpoolWriter | None = None
    rows = 0
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if writer is None:
                writer = SpoolWriter(plan.spool_dir, file_name, replace=True)
            try:
                for body, count in _encode_batch(plan, batch):
                    writer.write_block(body, count)
            except ValueError as exc:
                raise ValueError(f"ferry: {file_name} not written: {_renumber(exc, rows)}") from exc
            rows += batch.num_rows
        path = str(writer.commit()) if writer is not None else None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return FerryCommitMessage(path=path, host=host, rows=rows)


def _renumber(exc: ValueError, earlier_rows: int) -> str:
    """The encoders count rows per Arrow batch; the user wants the row of the partition."""
    match = _ROW_RE.match(str(exc))
    if match is None:
        return str(exc)
    return f"row {earlier_rows + int(match.group(1))} of the partition: {match.group(2)}"


def _encode_batch(plan: WritePlan, batch: pa.RecordBatch) -> Iterator[tuple[Body, int]]:
    """The batch as block bodies: vectorized unless some row has headers (rare in bulk)."""
    names = batch.schema.names

    def col(name: str) -> pa.Array | None:
        return batch.column(names.index(name)) if name in plan.columns else None

    headers_col = col("headers")
    if headers_col is not None and _has_entries(headers_col):
        return _encode_rows(plan, col, headers_col)
    return encode_arrow(
        plan.topic if plan.topic is not None else col("topic"),
        col("value"),  # plan_write made sure it exists
        col("key"),
        col("partition_key"),
        col("timestamp"),
    )


def _has_entries(column: pa.Array) -> bool:
    offsets = column.offsets  # list and map arrays: how many elements each row has
    return bool(len(offsets) and offsets[-1].as_py() != offsets[0].as_py())


def _encode_rows(
    plan: WritePlan, col: Callable[[str], pa.Array | None], headers_col: pa.Array
) -> Iterator[tuple[Body, int]]:
    """Row by row through spool.format.encode_columns: the path for rows with headers."""
    topics: str | Sequence[str | None]
    if plan.topic is not None:
        topics = plan.topic
    else:
        topic_col = col("topic")
        assert topic_col is not None
        topics = topic_col.to_pylist()
    value_col = col("value")
    assert value_col is not None
    key_col = col("key")
    pk_col = col("partition_key")
    ts_col = col("timestamp")
    return encode_columns(
        topics,
        _binary_list(value_col),
        _binary_list(key_col) if key_col is not None else None,
        pk_col.to_pylist() if pk_col is not None else None,
        _timestamps_ms(ts_col).to_pylist() if ts_col is not None else _now_ms(),
        _headers_list(headers_col),
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


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


def _as_large_binary(column: pa.Array) -> pa.Array:
    if pa.types.is_large_binary(column.type):
        return column
    return column.cast(pa.large_binary())


def _first_row(mask: Any) -> int:
    return int(np.flatnonzero(mask)[0])


def encode_arrow(
    topic: str | pa.Array,
    value: pa.Array,
    key: pa.Array | None = None,
    partition_key: pa.Array | None = None,
    timestamp: pa.Array | None = None,
    *,
    block_bytes: int = BLOCK_TARGET_BYTES,
) -> Iterator[tuple[Body, int]]:
    """Records without headers from Arrow columns, as ``(block body, count)``.

    The same bytes as ``spool.format.encode_columns`` but vectorized: numpy builds every
    record's fixed part at once, and one Arrow ``take`` interleaves fixed parts, topics, keys
    and values into a single buffer that blocks are zero-copy slices of. This is what keeps
    the Spark writer near ``df.write.json`` speed. ValueError names the 0-based row.
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
        topics = pa.Array.from_buffers(
            pa.large_binary(),
            n,
            [None, pa.py_buffer(np.arange(n + 1, dtype=np.int64) * len(tb)),
             pa.py_buffer(tb * n)],
        )
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
    else:
        record["timestamp"] = _now_ms()
    lengths = RECORD_HEADER.size + topic_lengths + key_lengths + value_lengths
    too_big = lengths > MAX_RECORD_BYTES
    if too_big.any():
        row = _first_row(too_big)
        raise ValueError(f"row {row}: record of {int(lengths[row])} bytes is larger than "
                         f"{MAX_RECORD_BYTES}")
    record["length"] = lengths
    record["flags"] = flags
    record["topic_length"] = topic_lengths
    record["value_length"] = value_lengths
    fixed = pa.Array.from_buffers(
        pa.large_binary(),
        n,
        [None, pa.py_buffer(np.arange(n + 1, dtype=np.int64) * RECORD_HEADER.size),
         pa.py_buffer(record)],
    )
    pieces.insert(0, fixed)
    # Row i is pieces[0][i], pieces[1][i], ...: take them in that order from one array.
    k = len(pieces)
    order = (np.arange(n, dtype=np.int64)[:, None] + np.arange(k, dtype=np.int64) * n).ravel()
    interleaved = pa.concat_arrays(pieces).take(pa.array(order))
    data = interleaved.buffers()[2]
    base = interleaved.offset  # take returns an unsliced array, but be exact
    offsets = np.frombuffer(interleaved.buffers()[1], dtype=np.int64)[base : base + k * n + 1]
    ends = np.cumsum(lengths)
    assert int(offsets[-1] - offsets[0]) == int(ends[-1]), "interleaving lost bytes"
    return _blocks(data, int(offsets[0]), ends, block_bytes)


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


class FerryBatchWriter(DataSourceArrowWriter):
    """Batch writes: one file per partition, named by (job id, partition)."""

    def __init__(self, plan: WritePlan, job_id: str) -> None:
        self.plan = plan
        self.job_id = job_id

    def file_name(self, partition: int) -> str:
        return f"spark-{self.job_id}-{partition:05d}.ferry"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
        return write_partition(self.plan, iterator, self.file_name(_task().partitionId()))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to do: each task published its own file."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing can be undone: finished tasks' files may already be ingested. Rerun with
        the same ``jobId`` option so finished partitions are rewritten, not duplicated."""


class FerryStreamWriter(DataSourceStreamArrowWriter):
    """Streaming writes: one file per (query, micro-batch, partition)."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    @staticmethod
    def file_name(query_id: str, batch_id: int, partition: int) -> str:
        return f"spark-{query_id}-{batch_id:010d}-{partition:05d}.ferry"

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
        return write_partition(self.plan, iterator, name)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: each task published its own file."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing can be undone; Spark replays the batch under the same file names."""


class FerryDataSource(DataSource):
    """``df.write.format("ferry")`` / ``df.writeStream.format("ferry")``.

    Options: ``path`` (the spool directory; ``save(path)`` sets it), ``topic`` (one topic for
    every row, instead of a ``topic`` column), ``jobId`` (batch only: names the files, so a
    rerun of a failed job with the same id rewrites instead of duplicating).
    """

    batch_writer: type[FerryBatchWriter] = FerryBatchWriter
    stream_writer: type[FerryStreamWriter] = FerryStreamWriter

    @classmethod
    def name(cls) -> str:
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> FerryBatchWriter:
        plan = plan_write(schema, self.options, overwrite)
        return self.batch_writer(plan, self.options.get("jobId") or uuid.uuid4().hex)

    def streamWriter(self, schema: StructType, overwrite: bool) -> FerryStreamWriter:  # noqa: N802
        # "overwrite" means nothing for a stream into a spool: whatever the output mode, each
        # micro-batch is new messages (complete mode re-sends the whole result, as asked).
        return self.stream_writer(plan_write(schema, self.options, overwrite=False))
