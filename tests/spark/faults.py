"""DataFrames whose tasks fail where real jobs fail: in Python upstream of the ``ferry`` writer.

PySpark ends a Python writer's input *normally* when a pandas UDF upstream raises, or when
Spark kills a task because another one failed, so the writer cannot tell a cut-short partition
from a whole one. These builders make both happen at a chosen row; the tests that use them
count what reached the spool (``test_spark_failures.py``) or Kafka (``test_spark_to_kafka.py``).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pandas as pd
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import col, pandas_udf

from tests.waiting import wait_until


def value(i: int) -> bytes:
    """Row i's value: long enough that the rows before a failure fill the buffers between the
    UDF's Python worker, the JVM and the writer's worker (64 KiB), so the writer does get
    part of the partition before its input ends."""
    return f"v{i}-".encode().ljust(200, b"x")


def expected(rows: range) -> Counter[bytes]:
    return Counter(value(i) for i in rows)


def _session() -> SparkSession:
    spark = SparkSession.getActiveSession()
    assert spark is not None
    return spark


def failing_once(rows: int, fail_at: int, marker: Path, partitions: int = 2) -> DataFrame:
    """``rows`` rows; a pandas UDF upstream of the writer raises on the first attempt of the
    task that holds row ``fail_at``, when it reaches it (``marker`` then holds its
    partition)."""

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.attemptNumber() == 0 and (ids == fail_at).any():
            marker.write_text(str(ctx.partitionId()))
            raise RuntimeError("injected failure on the first attempt")
        return ids.map(value)

    return _session().range(0, rows, numPartitions=partitions).select(
        col("id").cast("string").alias("key"), value_of("id").alias("value")
    )


def killed_by_another_task(
    rows: int, spool_dir: Path, started: Path | None, released: Path | None = None
) -> DataFrame:
    """``rows`` rows in 2 partitions, to be written with jobId "killed". With ``started``:
    partition 1 starts writing its file (``started`` then exists) and waits until ``released``
    exists (default: the abort marker the driver creates in publish mode "driver"; a path
    that never appears makes it wait until Spark kills it), while partition 0 fails, on every
    attempt, once partition 1 has started. So partition 1 is killed, or finishes, after the
    job failed. Without ``started`` nothing fails."""
    half = rows // 2
    release = released or spool_dir / ".spark-killed-aborted"

    def writing() -> bool:
        return any(n.startswith((".spark-killed-00001.ferry.", ".spark-killed-00001.ferry"))
                   for n in os.listdir(spool_dir))

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if started is not None and ctx.partitionId() == 1 and (ids == half + half // 2).any():
            wait_until(writing, timeout=60, message="partition 1 writing its file")
            started.touch()
            wait_until(release.exists, timeout=60, message="the job failed")
        elif started is not None and ctx.partitionId() == 0:
            wait_until(started.exists, timeout=60, message="partition 1 started")
            raise RuntimeError("injected failure on every attempt")
        return ids.map(value)

    return _session().range(0, rows, numPartitions=2).select(value_of("id").alias("value"))
