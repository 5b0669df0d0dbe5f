"""A real SparkSession for the Spark tests, one per test run.

One JVM holds one SparkContext, and starting one costs many seconds on a small CI machine, so
every Spark test shares a single session. Its master is ``local[2,3]``: two cores, like
``local[2]``, but a failed task is retried up to 3 times as on a cluster (plain ``local[2]``
never retries), which the task-failure test needs. Any other test sees the same behaviour as
with ``local[2]`` unless a task fails.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Executors run Python workers; they must use this interpreter (the venv with pyarrow and
# ferry installed), not whatever "python3" is on PATH. Set before the JVM starts.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from pyspark.sql import SparkSession  # noqa: E402

import spark_writer  # noqa: E402

MASTER = "local[2,3]"


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """The session-wide SparkSession (2 cores, 3 attempts per task), ``ferry`` registered."""
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = (
        SparkSession.builder.master(MASTER)
        .appName("ferry-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.driver.memory", "1g")
        # The JIT's first tier only (C1): the tests' jobs are small and short, and C2 compiling
        # Spark's hot paths took ~45 s of the JVM's 105 s of CPU over tests/spark (60 s with
        # C1 alone) on a machine whose two cores the suite keeps busy.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    spark_writer.register(session)
    yield session
    session.stop()
    # py4j closes its connections from __del__ at interpreter exit and logs that at INFO,
    # by then to a stream pytest has closed ("--- Logging error ---" after the summary).
    logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    """An empty spool directory for one test."""
    directory = tmp_path / "spool"
    directory.mkdir()
    return directory


@pytest.fixture
def small_batches(spark: SparkSession) -> Iterator[None]:
    """250 Arrow rows per batch, so a writer whose input ends early (tests/spark/faults.py)
    has written some blocks of its partition by then."""
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "250")
    yield
    spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
