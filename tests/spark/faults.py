"""DataFrames whose tasks fail where real jobs fail: in Python upstream of the ``ferry`` writer,
and reading back what reached the spool.

PySpark ends a Python writer's input *normally* when a pandas UDF upstream raises, or when
Spark kills a task because another one failed, so the writer cannot tell a cut-short partition
from a whole one. These builders make both happen at a chosen row, once the writer has begun
its file; the tests that use them count what reached the spool (``test_spark_failures.py``)
or Kafka (``test_spark_to_kafka.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import col, pandas_udf

from spool import SpoolRecord, list_ready_files, open_spool_file, verify
from tests.waiting import wait_until


def read_all(spool_dir: Path) -> list[SpoolRecord]:
    """Every record of every ready file, each file verified first."""
    records: list[SpoolRecord] = []
    for path in list_ready_files(spool_dir):
        count = verify(path)
        file_records = [record for _, record in open_spool_file(path)]
        assert len(file_records) == count
        records.extend(file_records)
    return records


def value(i: int) -> bytes:
    """Row i's value: long enough that the rows before a failure fill the buffers between the
    UDF's Python worker, the JVM and the writer's worker (64 KiB), so the writer does get
    part of the partition before its input ends."""
    return f"v{i}-".encode().ljust(200, b"x")


def expected(rows: range) -> Counter[bytes]:
    return Counter(value(i) for i in rows)


def writing(spool_dir: Path, partition: int) -> Callable[[], bool]:
    """Whether the writer of ``partition`` has started its temporary file."""
    pattern = f".spark-*-{partition:05d}.ferry.*.tmp"
    return lambda: any(spool_dir.glob(pattern))


def _session() -> SparkSession:
    spark = SparkSession.getActiveSession()
    assert spark is not None
    return spark


def failing_once(rows: int, fail_at: int, marker: Path, spool_dir: Path) -> DataFrame:
    """``rows`` rows in 2 partitions; a pandas UDF upstream of the writer raises on the first
    attempt of the task that holds row ``fail_at``, when it reaches it and the writer has
    written part of the partition (the writer's worker starts later than the UDF's);
    ``marker`` then holds the partition."""

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.attemptNumber() == 0 and (ids == fail_at).any():
            wait_until(writing(spool_dir, ctx.partitionId()), timeout=60,
                       message="the writer writing")
            marker.write_text(str(ctx.partitionId()))
            raise RuntimeError("injected failure on the first attempt")
        return ids.map(value)

    return _session().range(0, rows, numPartitions=2).select(
        col("id").cast("string").alias("key"), value_of("id").alias("value")
    )


def killed_by_another_task(
    rows: int, spool_dir: Path, started: Path | None, released: Path | None = None
) -> DataFrame:
    """``rows`` rows in 2 partitions, for jobId "killed". With ``started``: partition 1
    begins its file (``started`` then exists) and waits until ``released`` exists (default:
    the abort marker the driver creates in publish mode "driver"; a path that never appears
    makes it wait until Spark kills it), while partition 0 fails, on every attempt, once
    partition 1 has started. Spark does not wait for the task it kills: it goes on after the
    job failed. Without ``started`` nothing fails."""
    wait_at = rows // 2 + rows // 4
    release = released or spool_dir / ".spark-killed-aborted"

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if started is not None and ctx.partitionId() == 1 and (ids == wait_at).any():
            wait_until(writing(spool_dir, 1), timeout=60, message="partition 1 writing")
            started.touch()
            wait_until(release.exists, timeout=60, message="the job failed")
        elif started is not None and ctx.partitionId() == 0:
            wait_until(started.exists, timeout=60, message="partition 1 started")
            raise RuntimeError("injected failure on every attempt")
        return ids.map(value)

    return _session().range(0, rows, numPartitions=2).select(value_of("id").alias("value"))


def no_running_tasks(spark: SparkSession, group: str) -> bool:
    """Whether Spark counts no task of the jobs of ``group`` as running (killed ones done)."""
    tracker = spark.sparkContext.statusTracker()
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info is not None else []:
            stage_info = tracker.getStageInfo(stage)
            if stage_info is not None and stage_info.numActiveTasks > 0:
                return False
    return True
