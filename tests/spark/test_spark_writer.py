"""The ``ferry`` Spark data source against a real local SparkSession.

Every check reads the spool files back with ``spool.reader``, the same code the agent uses.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark import TaskContext
from pyspark.errors import AnalysisException, PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import col, udf

from spark_writer import FerryBatchWriter, FerryCommitMessage, FerryDataSource
from spark_writer.datasource import (
    DEFAULT_MAX_MESSAGE_BYTES,
    encode_arrow,
    plan_write,
    write_partition,
)
from spool import SpoolRecord, list_ready_files, verify
from spool.format import Headers, encode_columns
from tests.spark.faults import read_all

ROWS = 100_000
BATCH_NAME = re.compile(r"spark-([0-9a-f]{32})-(\d{5})\.ferry")
STREAM_NAME = re.compile(r"spark-([0-9a-f-]{36})-(\d{10})-(\d{5})\.ferry")


def expected_record(i: int, half: int) -> SpoolRecord:
    """Row ``i`` of ``rich_frame`` as the spool should hold it, computed without Spark."""
    return SpoolRecord(
        topic="orders" if i % 2 else "clicks",
        value=f"value-{i:06d}-".encode() + b"x" * (i % 50),
        key=f"k{i % 1000}".encode() if i % 3 else None,
        partition_key=i % 11 - 5 if i % 5 == 0 else None,
        timestamp_ms=1_700_000_000_000 + i,
        headers=(("trace", f"t{i}".encode()), ("empty", b"")) if i % 7 == 0 and i < half else (),
    )


def rich_frame(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    """Every column the data source takes, with nulls and negative partition keys. Headers
    only in the lower half of the rows: batches with headers take the writer's row-by-row
    path, the others its vectorized one, and both must give the same records."""
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "if(id % 2 = 1, 'orders', 'clicks') AS topic",
        "cast(concat(format_string('value-%06d-', id), repeat('x', cast(id % 50 AS int)))"
        " AS binary) AS value",
        "if(id % 3 != 0, cast(concat('k', cast(id % 1000 AS string)) AS binary), null) AS key",
        "if(id % 5 = 0, cast(id % 11 - 5 AS int), null) AS partition_key",
        "1700000000000 + id AS timestamp",
        f"if(id % 7 = 0 AND id < {rows // 2}, array(named_struct('key', 'trace', 'value', "
        "cast(concat('t', cast(id AS string)) AS binary)), named_struct('key', 'empty', "
        "'value', X'')), null) AS headers",
    )


def by_value(records: list[SpoolRecord]) -> list[SpoolRecord]:
    return sorted(records, key=lambda r: r.value)


def random_columns(rows: int, seed: int) -> dict[str, pa.Array]:
    """Arrow columns as a Spark task receives them, with nulls in every optional column."""
    rng = random.Random(seed)

    def maybe(value: object) -> object:
        return None if rng.random() < 0.3 else value

    return {
        "topic": pa.array([rng.choice(["a", "b.c", "d-e_f"]) for _ in range(rows)]),
        "value": pa.array([rng.randbytes(rng.randrange(0, 300)) for _ in range(rows)]),
        "key": pa.array([maybe(rng.randbytes(rng.randrange(0, 20))) for _ in range(rows)]),
        "partition_key": pa.array(
            [maybe(rng.randrange(-(2**31), 2**31)) for _ in range(rows)], pa.int32()
        ),
        "timestamp": pa.array(
            [rng.randrange(0, 2**45) * 1000 for _ in range(rows)], pa.timestamp("us", tz="UTC")
        ),
        "headers": pa.array(
            [maybe([(rng.choice(["trace", "", "é" * rng.randrange(1, 4)]),
                     maybe(rng.randbytes(rng.randrange(0, 30))) or b"")
                    for _ in range(rng.choice([0, 0, 1, 1, 2, 5]))])
             for _ in range(rows)],
            pa.map_(pa.string(), pa.binary()),
        ),
    }


def as_struct_list(headers: pa.Array, value_type: pa.DataType) -> pa.Array:
    """A map<string, binary> headers column as array<struct<key, value>> (Spark's other
    form; field order value, key to show it is not relied on), values cast to value_type."""
    return pa.array(
        [None if row is None else [{"value": v if value_type == pa.binary() else v.decode(
            "utf-8", "replace"), "key": k} for k, v in row] for row in headers.to_pylist()],
        pa.list_(pa.struct([("value", value_type), ("key", pa.string())])),
    )


def headers_list(headers: pa.Array) -> list[Headers | None]:
    """A headers column as encode_columns takes it."""
    out: list[Headers | None] = []
    for row in headers.to_pylist():
        if row is None:
            out.append(None)
            continue
        pairs = [(p["key"], p["value"]) if isinstance(p, dict) else p for p in row]
        out.append(tuple((k, v.encode() if isinstance(v, str) else v) for k, v in pairs))
    return out


@pytest.mark.parametrize("block_bytes", [1, 1000, 1 << 20])
def test_the_vectorized_encoder_matches_the_record_encoder(block_bytes: int) -> None:
    """encode_arrow (the Spark fast path) makes exactly encode_columns' bytes and blocks,
    headers included (null and empty lists, map and array forms, string values)."""
    cols = random_columns(2000, seed=block_bytes)
    ms = [t // 1000 for t in cols["timestamp"].cast(pa.int64()).to_pylist()]
    headers = cols["headers"]
    for topic, key, pk, hdrs in [
        (cols["topic"], cols["key"], cols["partition_key"], headers),
        ("fixed", None, None, None),
        (cols["topic"].cast(pa.large_string()), cols["key"].cast(pa.large_binary()), None,
         as_struct_list(headers, pa.binary())),
        ("fixed", cols["key"], None, as_struct_list(headers, pa.string())),
        (cols["topic"].slice(7), cols["key"].slice(7), None, headers.slice(7)),
    ]:
        value = cols["value"].slice(2000 - len(hdrs)) if hdrs is not None else cols["value"]
        ts = cols["timestamp"].slice(2000 - len(value))
        fast = [
            (bytes(body), count)
            for body, count in encode_arrow(
                topic, value, key, pk, ts, hdrs, block_bytes=block_bytes
            )
        ]
        slow = list(
            encode_columns(
                topic if isinstance(topic, str) else topic.to_pylist(),
                value.to_pylist(),
                key.to_pylist() if key is not None else None,
                pk.to_pylist() if pk is not None else None,
                ms[2000 - len(value):],
                headers_list(hdrs) if hdrs is not None else None,
                block_bytes=block_bytes,
            )
        )
        assert fast == slow
        assert sum(count for _, count in fast) == len(value)


def test_without_a_timestamp_column_every_record_gets_timestamp_0() -> None:
    """So a retried task writes the same bytes (the agent stamps 0 with its ingest time)."""
    fast = [(bytes(body), count) for body, count in encode_arrow("t", pa.array([b"a", b"bc"]))]
    assert fast == list(encode_columns("t", [b"a", b"bc"], timestamps=0))


BAD_HEADERS = [
    ("null header value", pa.array([[("a", b"1")], [("b", None)]],
                                   pa.map_(pa.string(), pa.binary())),
     "row 1: header 'b' has a null value"),
    ("null header name", pa.array([None, [], [{"key": None, "value": b"1"}]],
                                  pa.list_(pa.struct([("key", pa.string()),
                                                      ("value", pa.binary())]))),
     "row 2: a header name is null"),
    ("null header", pa.array([[{"key": "a", "value": b"1"}], [None]],
                             pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
     "row 1: a header is null"),
    ("long header name", pa.array([None, [("n" * 65536, b"")]],
                                  pa.map_(pa.string(), pa.binary())),
     "row 1: header name of 65536 bytes is longer than 65535"),
    ("too many headers", pa.array([[], [{"key": "a", "value": b""}] * 65536],
                                  pa.list_(pa.struct([("key", pa.string()),
                                                      ("value", pa.binary())]))),
     "row 1: 65536 headers is more than 65535"),
]


@pytest.mark.parametrize(("headers", "message"), [case[1:] for case in BAD_HEADERS],
                         ids=[case[0] for case in BAD_HEADERS])
def test_headers_the_format_cannot_hold_name_their_row(headers: pa.Array, message: str) -> None:
    values = pa.array([b"v"] * len(headers))
    with pytest.raises(ValueError, match=re.escape(message)):
        list(encode_arrow("t", values, headers=headers))


def test_max_message_bytes_weighs_key_and_value() -> None:
    values = pa.array([b"x" * 10, b"x" * 10, b"x" * 11])
    keys = pa.array([None, b"k", None])
    assert sum(c for _, c in encode_arrow("t", values[:1], max_message_bytes=10)) == 1
    with pytest.raises(ValueError, match="row 1: key and value of 11 bytes are more than "
                                         "maxMessageBytes=10"):
        list(encode_arrow("t", values, keys, max_message_bytes=10))


def test_batch_write_puts_exactly_the_rows_in_the_spool(
    spark: SparkSession, spool_dir: Path
) -> None:
    spark.sparkContext.setJobGroup("ferry-100k", "100k rows")
    rich_frame(spark, ROWS, 4).write.format("ferry").mode("append").save(str(spool_dir))
    assert spark.sparkContext.statusTracker().getJobIdsForGroup("ferry-100k")

    files = list_ready_files(spool_dir)
    names = [BATCH_NAME.fullmatch(p.name) for p in files]
    assert all(names), [p.name for p in files]
    assert sorted(m.group(2) for m in names if m) == ["00000", "00001", "00002", "00003"]
    assert len({m.group(1) for m in names if m}) == 1  # one job id for the whole save()
    assert sorted(os.listdir(spool_dir)) == sorted(p.name for p in files)  # no temp files left

    records = read_all(spool_dir)
    assert len(records) == ROWS
    assert by_value(records) == by_value([expected_record(i, ROWS // 2) for i in range(ROWS)])


def test_fixed_topic_strings_timestamps_and_map_headers(
    spark: SparkSession, spool_dir: Path
) -> None:
    when = dt.datetime(2024, 2, 29, 12, 30, 45, 678_000, tzinfo=dt.UTC)
    df = spark.createDataFrame(
        [
            ("héllo", "k1", when, {"a": "b"}, 2**31 - 1),
            ("", None, when + dt.timedelta(milliseconds=1), None, -(2**31)),
            ("plain", "", when, {}, None),
        ],
        "value string, key string, timestamp timestamp, headers map<string,string>, "
        "partition_key long",
    )
    df.write.format("ferry").option("topic", "events.v1").mode("append").save(str(spool_dir))

    ms = int(when.timestamp() * 1000)
    assert by_value(read_all(spool_dir)) == by_value([
        SpoolRecord("events.v1", "héllo".encode(), b"k1", 2**31 - 1, ms, (("a", b"b"),)),
        SpoolRecord("events.v1", b"", None, -(2**31), ms + 1, ()),
        SpoolRecord("events.v1", b"plain", b"", None, ms, ()),
    ])


def test_rows_without_timestamp_get_timestamp_0(spark: SparkSession, spool_dir: Path) -> None:
    """The agent stamps these with its ingest time; the writer's clock would make a retried
    task's file differ from its first attempt's."""
    spark.range(3).selectExpr("'t' AS topic", "cast(id AS string) AS value").write.format(
        "ferry"
    ).mode("append").save(f"file://{spool_dir}")
    records = read_all(spool_dir)
    assert sorted(r.value for r in records) == [b"0", b"1", b"2"]
    assert all(r.timestamp_ms == 0 for r in records)


def test_the_same_partition_makes_the_same_file_every_time(
    spark: SparkSession, spool_dir: Path
) -> None:
    """What the agent's de-duplication of a re-published partition (publish mode "task")
    relies on: same rows in, byte-identical file out, whatever the attempt or the clock."""
    df = rich_frame(spark, 5000, 2).drop("timestamp")
    for job in ("first", "second"):
        df.write.format("ferry").option("jobId", job).mode("append").save(str(spool_dir))
    for part in ("00000", "00001"):
        first = (spool_dir / f"spark-first-{part}.ferry").read_bytes()
        assert first == (spool_dir / f"spark-second-{part}.ferry").read_bytes()
        assert verify(spool_dir / f"spark-first-{part}.ferry") == 2500


SchemaCase = tuple[str, Callable[[SparkSession], DataFrame], dict[str, str], str, str]

SCHEMA_CASES: list[SchemaCase] = [
    ("no value", lambda s: s.range(5).selectExpr("'t' AS topic"), {}, "append",
     'column "value" (binary or string) is missing'),
    ("typo", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value",
                                             "1 AS partitionKey"), {}, "append",
     "unknown column 'partitionKey'"),
    ("wrong type", lambda s: s.range(5).selectExpr("'t' AS topic", "id AS value"), {}, "append",
     "column 'value' is bigint; expected binary or string"),
    ("no topic", lambda s: s.range(5).selectExpr("'v' AS value"), {}, "append", "no topic"),
    ("two topics", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"),
     {"topic": "t"}, "append", 'both a "topic" column and .option("topic", ...)'),
    ("illegal topic", lambda s: s.range(5).selectExpr("'v' AS value"), {"topic": "no spaces"},
     "append", "'no spaces' is not a legal Kafka topic name"),
    ("headers type", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value",
                                                     "array('x') AS headers"), {}, "append",
     "column 'headers' is array<string>; expected array<struct<key:string,value:binary>>"),
    ("overwrite", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"), {},
     "overwrite", 'mode "overwrite" is not supported'),
    ("relative path", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"),
     {"path": "relative/spool"}, "append", "must be an absolute local directory"),
    ("bad job id", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"),
     {"jobId": "a/b"}, "append", 'option "jobId" \'a/b\' must be'),
    ("bad publish", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"),
     {"publish": "executor"}, "append", 'option "publish" \'executor\' must be "driver"'),
    ("max message bytes 0", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"),
     {"maxMessageBytes": "0"}, "append", 'option "maxMessageBytes" \'0\' must be a positive'),
    ("max message bytes text", lambda s: s.range(5).selectExpr("'t' AS topic", "'v' AS value"),
     {"maxMessageBytes": "1MB"}, "append", 'option "maxMessageBytes" \'1MB\' must be a'),
]


@pytest.mark.parametrize(
    ("build", "options", "mode", "message"),
    [case[1:] for case in SCHEMA_CASES],
    ids=[case[0] for case in SCHEMA_CASES],
)
def test_bad_schema_or_options_fail_before_any_task_runs(
    spark: SparkSession,
    spool_dir: Path,
    request: pytest.FixtureRequest,
    build: Callable[[SparkSession], DataFrame],
    options: dict[str, str],
    mode: str,
    message: str,
) -> None:
    group = f"ferry-schema-{request.node.callspec.id}"
    spark.sparkContext.setJobGroup(group, "schema check")
    writer = build(spark).write.format("ferry").mode(mode)
    for key, value in options.items():
        writer = writer.option(key, value)
    with pytest.raises(AnalysisException) as failure:
        if "path" in options:
            writer.save()
        else:
            writer.save(str(spool_dir))
    assert message in str(failure.value)
    assert "ferry data source: cannot write this DataFrame" in str(failure.value)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(group) == []
    assert os.listdir(spool_dir) == []


BAD_ROWS = [
    ("null value", "'t' AS topic", "if(id = 3, null, 'v') AS value", "", "value is null"),
    ("illegal topic", "if(id = 3, 'a b', 't') AS topic", "'v' AS value", "",
     "'a b' is not a legal Kafka topic name"),
    ("partition key range", "'t' AS topic", "'v' AS value",
     "if(id = 3, 4294967296, 1) AS partition_key",
     "partition_key 4294967296 is outside the signed 32-bit range"),
    ("null header value", "'t' AS topic", "'v' AS value",
     "map('h', if(id = 3, null, X'01')) AS headers", "header 'h' has a null value"),
]
ABORTED = re.compile(r"\.spark-[0-9a-f]{32}-aborted")


@pytest.mark.parametrize(
    ("topic", "value", "extra", "message"),
    [case[1:] for case in BAD_ROWS],
    ids=[case[0] for case in BAD_ROWS],
)
def test_a_bad_row_fails_the_task_and_leaves_no_file(
    spark: SparkSession, spool_dir: Path, topic: str, value: str, extra: str, message: str
) -> None:
    columns = [topic, value] + ([extra] if extra else [])
    df = spark.range(0, 10, numPartitions=1).selectExpr(*columns)
    with pytest.raises(PySparkException) as failure:
        df.write.format("ferry").mode("append").save(str(spool_dir))
    assert f"not written: row 3 of the partition: {message}" in str(failure.value)
    assert list_ready_files(spool_dir) == []
    # The temporary file was removed, too; the driver's abort left only its marker.
    assert all(ABORTED.fullmatch(name) for name in os.listdir(spool_dir))


def test_max_message_bytes_option_sets_the_limit(spark: SparkSession, spool_dir: Path) -> None:
    df = spark.range(0, 10, numPartitions=1).selectExpr(
        "'t' AS topic", "repeat('x', cast(id AS int) + 5) AS value", "'k' AS key"
    )
    with pytest.raises(PySparkException, match="row 5 of the partition: key and value of 11 "
                                               "bytes are more than maxMessageBytes=10"):
        df.write.format("ferry").option("maxMessageBytes", "10").mode("append").save(
            str(spool_dir)
        )
    assert list_ready_files(spool_dir) == []
    assert all(ABORTED.fullmatch(name) for name in os.listdir(spool_dir))
    df.write.format("ferry").option("maxMessageBytes", "15").mode("append").save(str(spool_dir))
    assert len(read_all(spool_dir)) == 10


def test_max_message_bytes_defaults_to_the_agents_default() -> None:
    """1000000, the agent's default [topics] max_message_bytes (agent.config, not imported by
    spark_writer: executors have no agent)."""
    from agent.config import TopicConfig

    assert TopicConfig().max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    values = pa.array([b"x" * 999_999, b"x" * 1_000_000])
    with pytest.raises(ValueError, match="row 1: key and value of 1000001 bytes"):
        list(encode_arrow("t", values, pa.array([b"k", b"k"]),
                          max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES))


def test_a_task_failing_mid_write_is_retried_without_duplicates(
    spark: SparkSession, spool_dir: Path, tmp_path: Path
) -> None:
    rows, fail_at = 20_000, 7_500  # partition 1 of 4 holds 5000..9999
    marker = tmp_path / "failed-once"

    @udf("binary")
    def value_of(i):  # type: ignore[no-untyped-def]  # (type hints would make Spark warn)
        ctx = TaskContext.get()
        assert ctx is not None
        if i == fail_at and ctx.attemptNumber() == 0:
            marker.write_text(str(ctx.partitionId()))
            raise RuntimeError("injected failure on the first attempt")
        return f"v{i}".encode()

    # Small Arrow batches, so the writer has written part of its file when the task dies.
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
    try:
        spark.range(0, rows, numPartitions=4).select(
            col("id").cast("string").alias("key"), value_of("id").alias("value")
        ).write.format("ferry").option("topic", "retried").mode("append").save(str(spool_dir))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")

    assert marker.read_text() == "1"  # the failure really happened, in partition 1
    files = list_ready_files(spool_dir)
    assert len(files) == 4
    records = read_all(spool_dir)
    assert Counter(r.value for r in records) == Counter(f"v{i}".encode() for i in range(rows))
    # The failed attempt's staged or temporary file was deleted by the driver's commit.
    assert sorted(os.listdir(spool_dir)) == sorted(p.name for p in files)


@pytest.mark.parametrize("publish", ["driver", "task"])
def test_a_task_failing_after_writing_its_file_is_replaced_by_its_retry(
    spark: SparkSession, spool_dir: Path, tmp_path: Path, publish: str
) -> None:
    """Mode "task": the first attempt published its file, the retry replaces it. Mode
    "driver": it only staged it, and the driver publishes the retry's and deletes it."""
    marker = tmp_path / "written-inode"

    class FailAfterPublish(FerryBatchWriter):
        def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
            message = super().write(iterator)
            ctx = TaskContext.get()
            assert ctx is not None and message.path is not None
            if ctx.partitionId() == 1 and ctx.attemptNumber() == 0:
                marker.write_text(str(os.stat(message.path).st_ino))
                raise RuntimeError("injected failure after the file was written")
            return message

    class FailAfterPublishSource(FerryDataSource):
        batch_writer = FailAfterPublish

        @classmethod
        def name(cls) -> str:
            return "ferry_fail_after_publish"

    spark.dataSource.register(FailAfterPublishSource)
    rows = 8_000
    spark.range(0, rows, numPartitions=2).selectExpr(
        "'published' AS topic", "cast(id AS string) AS value"
    ).write.format("ferry_fail_after_publish").option("publish", publish).mode("append").save(
        str(spool_dir)
    )

    files = list_ready_files(spool_dir)
    assert [BATCH_NAME.fullmatch(p.name).group(2) for p in files].count("00001") == 1  # type: ignore[union-attr]
    retried = next(p for p in files if p.name.endswith("-00001.ferry"))
    assert marker.exists()  # the first attempt wrote its file, then failed
    assert os.stat(retried).st_ino != int(marker.read_text())  # the retry's file is there
    records = read_all(spool_dir)
    assert Counter(r.value for r in records) == Counter(str(i).encode() for i in range(rows))
    assert sorted(os.listdir(spool_dir)) == sorted(p.name for p in files)


def test_job_id_option_makes_a_rerun_overwrite(spark: SparkSession, spool_dir: Path) -> None:
    df = spark.range(0, 1000, numPartitions=2).selectExpr(
        "'rerun' AS topic", "cast(id AS string) AS value"
    )
    for _ in range(2):
        df.write.format("ferry").option("jobId", "nightly-2024-02-29").mode("append").save(
            str(spool_dir)
        )
    assert sorted(p.name for p in list_ready_files(spool_dir)) == [
        "spark-nightly-2024-02-29-00000.ferry",
        "spark-nightly-2024-02-29-00001.ferry",
    ]
    assert sorted(int(r.value) for r in read_all(spool_dir)) == list(range(1000))


def _stream_files(spool_dir: Path) -> dict[int, tuple[Path, int]]:
    """{batch id: (file, inode)} of a streaming query's spool files (one partition each)."""
    out: dict[int, tuple[Path, int]] = {}
    for path in list_ready_files(spool_dir):
        match = STREAM_NAME.fullmatch(path.name)
        assert match, path.name
        batch = int(match.group(2))
        assert batch not in out, "one file per batch expected"
        out[batch] = (path, os.stat(path).st_ino)
    return out


def test_stream_writes_micro_batches_and_a_replayed_batch_overwrites(
    spark: SparkSession, spool_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in"
    source.mkdir()
    for f in range(3):
        lines = [json.dumps({"n": f * 100 + i, "text": f"line {f}-{i}"}) for i in range(50)]
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    checkpoint = tmp_path / "checkpoint"

    def run() -> str:
        stream = (
            spark.readStream.schema("n long, text string")
            .option("maxFilesPerTrigger", 1)
            .json(str(source))
            .selectExpr(
                "cast(n AS string) AS key", "text AS value", "cast(n AS int) AS partition_key"
            )
        )
        query = (
            stream.writeStream.format("ferry")
            .option("topic", "streamed")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start(str(spool_dir))
        )
        query.awaitTermination(120)
        assert query.exception() is None
        assert not query.isActive
        return str(query.id)

    query_id = run()
    first = _stream_files(spool_dir)
    assert sorted(first) == [0, 1, 2]  # three micro-batches, one file each
    assert all(query_id in path.name for path, _ in first.values())
    expected = sorted((f * 100 + i, f"line {f}-{i}") for f in range(3) for i in range(50))

    def contents() -> list[tuple[int, str]]:
        return sorted((int(r.key or b""), r.value.decode()) for r in read_all(spool_dir))

    assert contents() == expected

    # Make Spark replay batch 2, as after a crash between writing it and committing it.
    for name in ("2", ".2.crc"):  # the commit log entry and Hadoop's checksum of it
        (checkpoint / "commits" / name).unlink()
    assert run() == query_id
    second = _stream_files(spool_dir)
    assert sorted(second) == [0, 1, 2]
    assert second[0] == first[0] and second[1] == first[1]  # untouched
    assert second[2][0] == first[2][0] and second[2][1] != first[2][1]  # same name, rewritten
    assert contents() == expected  # and nothing doubled


def test_a_task_staging_after_the_abort_deletes_its_file(tmp_path: Path) -> None:
    """Spark does not wait for the tasks it kills before the driver's abort: a task that
    stages its file once the abort has begun (its marker exists) deletes the file itself."""
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([StructField("value", StringType())])
    writer = FerryBatchWriter(plan_write(schema, {"path": str(tmp_path), "topic": "t"}, False),
                              "job-1")
    batch = pa.record_batch([pa.array(["a", "b"])], names=["value"])

    def stage(batches: Iterator[pa.RecordBatch] | None = None) -> FerryCommitMessage:
        return write_partition(writer.plan, batches or iter([batch]), writer.file_name(0),
                               writer.group, writer.abort_marker)

    early = stage()  # staged before the abort: the abort's sweep deletes it
    assert early.staged and early.path is not None and os.path.exists(early.path)
    writer.abort([None])
    assert os.listdir(tmp_path) == [".spark-job-1-aborted"]
    with pytest.raises(RuntimeError, match="not written: the job was aborted"):
        stage()  # begun after it: the task deletes its temporary file itself
    assert os.listdir(tmp_path) == [".spark-job-1-aborted"]

    writer.prepare()
    assert os.listdir(tmp_path) == []

    def abort_begins_meanwhile() -> Iterator[pa.RecordBatch]:
        yield batch
        # The abort's marker appears while the task writes, and its sweep lists the
        # directory before the file is staged (here: never).
        Path(writer.abort_marker).touch()

    with pytest.raises(RuntimeError, match="not kept: the job was aborted"):
        stage(abort_begins_meanwhile())  # staged after it: the task deletes it itself
    assert os.listdir(tmp_path) == [".spark-job-1-aborted"]

    writer.prepare()  # a rerun with the same job id, on the driver before its tasks
    assert os.listdir(tmp_path) == []
    late = stage()
    writer.commit([late])
    assert os.listdir(tmp_path) == ["spark-job-1-00000.ferry"]
    assert [r.value for r in read_all(tmp_path)] == [b"a", b"b"]


def test_a_task_beginning_its_file_after_the_abort_deletes_it_before_reading_on(
    tmp_path: Path,
) -> None:
    """A task whose Python worker begins after the abort's sweep (Spark kills the tasks of a
    failed job, and their workers, 2 s later, without waiting) must not keep its temporary file
    while it writes: if its worker is killed meanwhile, nothing deletes the file. Once the
    file exists the task finds the abort marker, and deletes it before it reads on."""
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([StructField("value", StringType())])
    writer = FerryBatchWriter(plan_write(schema, {"path": str(tmp_path), "topic": "t"}, False),
                              "job-2")
    writer.abort([None])
    batch = pa.record_batch([pa.array(["a", "b"])], names=["value"])
    while_writing: list[list[str]] = []

    def batches() -> Iterator[pa.RecordBatch]:
        yield batch
        while_writing.append(sorted(os.listdir(tmp_path)))  # where a kill would find it
        yield batch

    with pytest.raises(RuntimeError, match="not written: the job was aborted"):
        write_partition(writer.plan, batches(), writer.file_name(0), writer.group,
                        writer.abort_marker)
    assert while_writing == []
    assert os.listdir(tmp_path) == [".spark-job-2-aborted"]
