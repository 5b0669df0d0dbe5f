"""Failed and killed task attempts, against a real local SparkSession (``local[2,3]``).

PySpark ends a Python writer's input *normally* when something upstream fails (a pandas UDF
here) or when Spark kills the task because another one failed: the writer cannot tell a
cut-short partition from a whole one. These tests make that happen and check what the spool
holds afterwards, read back with ``spool.reader`` (what the agent would ingest):

- publish mode "driver": only the attempts Spark counted as successful are published, a failed
  job publishes nothing, and no staged or temporary file is left behind;
- publish mode "task": a failed attempt may publish a cut-short file, and its retry publishes
  the whole partition under the same name, starting with the same bytes (what the agent's
  prefix de-duplication relies on).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from pyspark import TaskContext
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import WriterCommitMessage
from pyspark.sql.functions import col, expr, lit, pandas_udf, raise_error, when
from pyspark.sql.streaming import StreamingQuery, StreamingQueryException

from spark_writer import FerryBatchWriter, FerryCommitMessage, FerryDataSource
from spool import list_ready_files, open_spool_file, verify
from spool.format import TRAILER
from tests.spark.faults import (
    expected,
    failing_once,
    killed_by_another_task,
    no_running_tasks,
    read_all,
    value,
    writing,
)
from tests.waiting import wait_until


def values(spool_dir: Path) -> Counter[bytes]:
    return Counter(r.value for r in read_all(spool_dir))


def not_ready(spool_dir: Path) -> list[str]:
    """What the spool directory holds besides ready files: staged and temporary leftovers."""
    ready = {p.name for p in list_ready_files(spool_dir)}
    return sorted(set(os.listdir(spool_dir)) - ready)


class KeepFirstAttempt(FerryBatchWriter):
    """Keeps a hard link to the file each first attempt staged (mode "driver") or published
    (mode "task"), under its final name in the spool directory's sibling "attempt0"."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
        message = super().write(iterator)
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.attemptNumber() == 0 and message.path is not None:
            keep = Path(self.plan.spool_dir).parent / "attempt0"
            os.link(message.path, keep / message.name)
        return message


class KeepFirstAttemptSource(FerryDataSource):
    batch_writer = KeepFirstAttempt

    @classmethod
    def name(cls) -> str:
        return "ferry_keep_first_attempt"


def test_driver_mode_publishes_only_the_successful_attempts(
    spark: SparkSession, spool_dir: Path, tmp_path: Path, small_batches: None
) -> None:
    rows, fail_at = 4000, 3300  # partition 1 holds 2000..3999: it dies part-way
    marker = tmp_path / "failed"
    (tmp_path / "attempt0").mkdir()
    spark.dataSource.register(KeepFirstAttemptSource)
    failing_once(rows, fail_at, marker, spool_dir).write.format("ferry_keep_first_attempt").option(
        "topic", "t"
    ).mode("append").save(str(spool_dir))
    assert marker.read_text() == "1"  # the failure did happen
    # The failed attempt's writer saw its input end normally and staged part of partition 1:
    cut = next((tmp_path / "attempt0").glob("*-00001.ferry"))
    assert 0 < verify(cut) < rows // 2
    files = list_ready_files(spool_dir)
    assert sorted(p.name[-11:] for p in files) == ["00000.ferry", "00001.ferry"]
    assert os.stat(cut).st_nlink == 1  # ...but the driver deleted it, and published the retry's
    assert values(spool_dir) == expected(range(rows))  # every row, once
    assert not_ready(spool_dir) == []  # no staged or temporary file left


def test_task_mode_retry_republishes_the_whole_partition_starting_with_the_same_bytes(
    spark: SparkSession, spool_dir: Path, tmp_path: Path, small_batches: None
) -> None:
    rows, fail_at = 4000, 3300
    marker = tmp_path / "failed"
    (tmp_path / "attempt0").mkdir()
    spark.dataSource.register(KeepFirstAttemptSource)
    failing_once(rows, fail_at, marker, spool_dir).write.format("ferry_keep_first_attempt").option(
        "topic", "t"
    ).option("publish", "task").mode("append").save(str(spool_dir))
    assert marker.read_text() == "1"

    files = {p.name: p for p in list_ready_files(spool_dir)}
    assert len(files) == 2 and not_ready(spool_dir) == []
    assert values(spool_dir) == expected(range(rows))  # the final file is the retry's, whole
    first = {p.name: p.read_bytes() for p in (tmp_path / "attempt0").iterdir()}
    [cut_name] = [name for name in first if name.endswith("-00001.ferry")]
    cut, whole = first[cut_name], files[cut_name].read_bytes()
    # The first attempt did publish a cut-short, but complete-looking, file...
    cut_records = [r for _, r in open_spool_file(tmp_path / "attempt0" / cut_name)]
    assert 0 < len(cut_records) < rows // 2
    # ...whose blocks are the retry's first blocks, byte for byte: only the trailer differs.
    assert whole.startswith(cut[: -TRAILER.size])
    assert len(whole) > len(cut)
    # The partition that did not fail is the same file as its first attempt's.
    [(ok_name, ok_bytes)] = [(n, b) for n, b in first.items() if n != cut_name]
    assert files[ok_name].read_bytes() == ok_bytes


def test_driver_mode_a_failed_job_publishes_nothing_and_a_rerun_everything_once(
    spark: SparkSession, spool_dir: Path, tmp_path: Path, small_batches: None
) -> None:
    rows = 6000
    started = tmp_path / "partition-1-started"
    spark.sparkContext.setJobGroup("ferry-killed", "a job that fails")
    with pytest.raises(PySparkException, match="injected failure on every attempt"):
        killed_by_another_task(rows, spool_dir, started).write.format("ferry").option(
            "topic", "t"
        ).option("jobId", "killed").mode("append").save(str(spool_dir))
    assert started.exists()  # partition 1 was writing when the job failed
    # Spark does not wait for the task it kills before the abort; wait until it is gone.
    # The abort deleted the temporary file it was writing (so its rename fails); a file it
    # staged after the abort it would delete itself (test_spark_writer.py:
    # test_a_task_staging_after_the_abort_deletes_its_file).
    wait_until(lambda: no_running_tasks(spark, "ferry-killed"), timeout=30,
               message="the killed task gone")
    assert list_ready_files(spool_dir) == []
    wait_until(lambda: not_ready(spool_dir) == [".spark-killed-aborted"], timeout=10,
               message="no staged or temporary file left")
    assert list_ready_files(spool_dir) == []

    killed_by_another_task(rows, spool_dir, None).write.format("ferry").option(
        "topic", "t"
    ).option("jobId", "killed").mode("append").save(str(spool_dir))
    assert sorted(p.name for p in list_ready_files(spool_dir)) == [
        "spark-killed-00000.ferry", "spark-killed-00001.ferry"
    ]
    assert values(spool_dir) == expected(range(rows))
    assert not_ready(spool_dir) == []  # the rerun removed the abort marker


class StagedElsewhere(FerryBatchWriter):
    """Moves each staged file out of the spool directory, as if it were on another node's
    disk: what the driver finds when the spool directory is per node."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
        message = super().write(iterator)
        if message.path is not None:
            other_node = Path(self.plan.spool_dir).parent / "other-node"
            shutil.move(message.path, other_node / os.path.basename(message.path))
        return message


class StagedElsewhereSource(FerryDataSource):
    batch_writer = StagedElsewhere

    @classmethod
    def name(cls) -> str:
        return "ferry_staged_elsewhere"


def test_driver_mode_publishes_nothing_if_the_driver_cannot_see_a_staged_file(
    spark: SparkSession, spool_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "other-node").mkdir()
    spark.dataSource.register(StagedElsewhereSource)
    df = spark.range(0, 100, numPartitions=2).selectExpr("cast(id AS string) AS value")
    with pytest.raises(Exception, match=r'2 of 2 staged spool files are not visible on the '
                       r'driver(.|\n)*\.option\("publish", "task"\)'):
        df.write.format("ferry_staged_elsewhere").option("topic", "t").mode("append").save(
            str(spool_dir)
        )
    assert list_ready_files(spool_dir) == []
    assert len(list((tmp_path / "other-node").iterdir())) == 2  # the driver could not see them


def test_stream_a_failed_micro_batch_leaves_nothing_and_one_failing_once_each_row_once(
    spark: SparkSession, spool_dir: Path, tmp_path: Path, small_batches: None
) -> None:
    """Run 1: micro-batch 1 fails on every attempt, so the query fails; its abort (which
    learns the query id from the checkpoint: no task reported) deletes the attempts' staged
    files. Run 2, from the checkpoint: micro-batch 1 is replayed and fails once, on its first
    attempt. In the end each row is in the spool once, and nothing else is."""
    source = tmp_path / "in"
    source.mkdir()
    per_file = 1500
    for f in range(3):
        lines = [json.dumps({"n": f * per_file + i}) for i in range(per_file)]
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    failures = tmp_path / "failures"
    failures.mkdir()
    fail_at = per_file + per_file * 3 // 4  # late in micro-batch 1

    def run(always: bool) -> StreamingQuery:
        @pandas_udf("binary")  # type: ignore[call-overload]
        def value_of(ids: pd.Series) -> pd.Series:
            ctx = TaskContext.get()
            assert ctx is not None
            if (always or ctx.attemptNumber() == 0) and (ids == fail_at).any():
                wait_until(writing(spool_dir, 0), timeout=60, message="the writer writing")
                (failures / f"{always}-{ctx.attemptNumber()}").touch()
                raise RuntimeError("injected failure")
            return ids.map(value)

        query = (
            spark.readStream.schema("n long")
            .option("maxFilesPerTrigger", 1)
            .json(str(source))
            .select(value_of(col("n")).alias("value"))
            .writeStream.format("ferry")
            .option("topic", "streamed")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start(str(spool_dir))
        )
        with contextlib.suppress(StreamingQueryException):
            query.awaitTermination(120)
        assert not query.isActive
        return query

    failed = run(always=True)
    assert "injected failure" in str(failed.exception())
    assert sorted(os.listdir(failures)) == ["True-0", "True-1", "True-2"]
    assert values(spool_dir) == expected(range(per_file))  # micro-batch 0 only
    assert not_ready(spool_dir) == []  # the three attempts' staged files were deleted

    replayed = run(always=False)
    assert replayed.exception() is None
    assert replayed.id == failed.id
    assert "False-0" in os.listdir(failures)  # the replayed micro-batch failed once
    names = [p.name for p in list_ready_files(spool_dir)]
    assert len(names) == 3 and all(
        re.fullmatch(rf"spark-{failed.id}-\d{{10}}-00000\.ferry", n) for n in names
    )
    assert values(spool_dir) == expected(range(3 * per_file))
    assert not_ready(spool_dir) == []


# A job whose partition 1 fails on every attempt in the JVM (raise_error in the projection that
# feeds the writer), not in Python; each row's value is faults.value(id).
JVM_FAILURE = "injected JVM failure"


def jvm_failing(spark: SparkSession, rows: int, fail_at: int | None) -> DataFrame:
    value_column = expr("cast(rpad(concat('v', cast(id AS string), '-'), 200, 'x') AS binary)")
    if fail_at is not None:
        value_column = when(col("id") == fail_at, raise_error(lit(JVM_FAILURE))).otherwise(
            value_column
        )
    return spark.range(0, rows, numPartitions=2).select(value_column.alias("value"))


class LateWriter(FerryBatchWriter):
    """Partition 0 of job "late" begins only once the driver's abort has swept the spool
    directory (a Python worker that forks and imports slowly on a busy host: its input, already
    in the socket, reaches it after the abort), and is still writing its partition when Spark
    kills its worker (the task of a failed job is killed, and its Python worker
    ``spark.python.task.killTimeout``, 2 s, later). In the spool directory's parent it leaves
    ``late-pid`` (its process), ``late-batches`` (a line per batch it read) and, however
    write() ends short of being killed, ``late-ended``; the driver's abort leaves
    ``late-swept`` once it has returned."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FerryCommitMessage:
        ctx = TaskContext.get()
        assert ctx is not None
        if self.job_id != "late" or ctx.partitionId() != 0:
            return super().write(iterator)
        state = Path(self.plan.spool_dir).parent
        (state / "late-pid").write_text(str(os.getpid()))

        def slow() -> Iterator[pa.RecordBatch]:
            for batch in iterator:
                with (state / "late-batches").open("a") as f:
                    f.write(f"{batch.num_rows}\n")
                yield batch
                # The writer has its first batch (and so its file) and wants the next one:
                # it is still at it when Spark kills this worker.
                wait_until(lambda: False, timeout=60, message="Spark killing this worker")

        try:
            wait_until((state / "late-swept").exists, timeout=60, message="the driver's abort")
            return super().write(slow())
        finally:
            (state / "late-ended").touch()

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        super().abort(messages)
        (Path(self.plan.spool_dir).parent / f"{self.job_id}-swept").touch()


class LateWriterSource(FerryDataSource):
    batch_writer = LateWriter

    @classmethod
    def name(cls) -> str:
        return "ferry_late_writer"


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts: it runs no more code)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_driver_mode_a_job_failing_in_the_jvm_leaves_no_temporary_file_of_a_late_task(
    spark: SparkSession, spool_dir: Path, tmp_path: Path, small_batches: None
) -> None:
    """The second job of the session fails in the JVM (raise_error in partition 1) while the
    Python writer of partition 0 has not begun yet; it begins after the driver's abort, with
    rows to write, and would still be writing when Spark kills its worker (which left its
    0-byte temporary file behind). No temporary file of the failed job may be left."""
    rows = 4000
    spark.dataSource.register(LateWriterSource)

    def save(df: DataFrame, job_id: str) -> None:
        df.write.format("ferry_late_writer").option("topic", "t").option(
            "jobId", job_id
        ).mode("append").save(str(spool_dir))

    save(jvm_failing(spark, rows, None), "first")  # the session's earlier, successful job
    assert values(spool_dir) == expected(range(rows))
    first = sorted(p.name for p in list_ready_files(spool_dir))
    assert not_ready(spool_dir) == []

    spark.sparkContext.setJobGroup("ferry-late", "a job that fails in the JVM")
    with pytest.raises(PySparkException, match=JVM_FAILURE):
        save(jvm_failing(spark, rows, fail_at=rows // 2 + 100), "late")
    # The late writer runs after the exception reached us: wait until it has ended, by
    # returning or raising (late-ended) or by being killed (its process gone), and until
    # Spark counts no task of the job as running.
    pid = int(wait_until((tmp_path / "late-pid").read_text, timeout=60,
                         message="partition 0's writer started", ignore=(FileNotFoundError,)))
    wait_until(lambda: (tmp_path / "late-ended").exists() or process_gone(pid), timeout=60,
               message="the late writer done")
    wait_until(lambda: no_running_tasks(spark, "ferry-late"), timeout=30,
               message="no task of the failed job running")
    # It did get rows after the abort: the case this test is about happened.
    assert (tmp_path / "late-batches").read_text().split()[0] == "250"
    assert not_ready(spool_dir) == [".spark-late-aborted"]
    assert sorted(p.name for p in list_ready_files(spool_dir)) == first
