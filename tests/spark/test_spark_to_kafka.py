"""Spark -> spool files -> the agent -> Kafka: exactly the rows written, once each."""

from __future__ import annotations

import collections
import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
from pyspark import TaskContext
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.functions import pandas_udf

from agent.config import load_config
from agent.daemon.agent import Agent
from agent.metrics import Registry
from spool import list_ready_files
from tests.agent_harness import write_config
from tests.kafka import Broker, create_topic, read_topic
from tests.spark.faults import (
    expected,
    failing_once,
    killed_by_another_task,
    value,
)
from tests.waiting import wait_until

ROWS = 100_000


def test_spark_rows_reach_kafka_exactly_once_through_the_agent(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, unique_topic: str
) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 4)
    config = load_config(write_config(tmp_path, session_broker.bootstrap, http=False,
                                      spool=True))
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        df = (spark.range(ROWS, numPartitions=4)
              .select(F.lit(unique_topic).alias("topic"),
                      F.concat(F.lit("row-"), F.col("id").cast("string"))
                      .cast("binary").alias("value"),
                      (F.col("id") % 1000).cast("int").alias("partition_key")))
        df.write.format("ferry").mode("append").save(str(config.spool.dirs[0]))
        wait_until(lambda: agent.registry.view().total("messages_delivered") >= ROWS,
                   timeout=120, interval=0.2, message="every row delivered")
        wait_until(lambda: not agent.store.topic_stats(), message="buffer drained")
    finally:
        agent.stop()
    got = read_topic(session_broker.bootstrap, unique_topic, timeout=60)
    values = collections.Counter(m.value for m in got)
    assert len(values) == ROWS and max(values.values()) == 1
    assert set(values) == {b"row-%d" % i for i in range(ROWS)}
    # Bruce placement of the partition_key column: key mod 4.
    assert all(m.partition == (int(m.value[4:]) % 1000) % 4 for m in got[:2000])  # type: ignore[index]


# -- failures where Spark jobs really fail, counted at a Kafka consumer -----------------------
# Every test below runs a real agent on the job's spool directory and a real broker, and counts
# each row in Kafka: lost and duplicated. Both publish modes: "driver" (a directory the driver
# sees: only successful attempts are published) and "task" (per-node directories, simulated
# here by one directory: each task publishes, the agent takes a re-published name by content).


@contextmanager
def agent_on_spool(root: Path, bootstrap: str) -> Iterator[tuple[Agent, Path]]:
    config = load_config(write_config(root, bootstrap, http=False, spool=True))
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        yield agent, Path(config.spool.dirs[0])
    finally:
        agent.stop()


def lost_and_duplicated(
    agent: Agent, spool: Path, bootstrap: str, topic: str, want: Counter[bytes]
) -> tuple[int, int, Counter[bytes]]:
    """Once the spool and the buffer are empty: rows of ``want`` missing from ``topic``, and
    rows found there more often than wanted; with what was found."""
    wait_until(lambda: not list_ready_files(spool), timeout=120, message="spool ingested")
    wait_until(lambda: agent.registry.view().total("messages_delivered") >= want.total(),
               timeout=120, interval=0.2, message="every row delivered")
    wait_until(lambda: not agent.store.topic_stats(), timeout=60, message="buffer drained")
    got = Counter(m.value for m in read_topic(bootstrap, topic, timeout=60))
    lost = sum((want - got).values())
    duplicated = sum((got - want).values())
    return lost, duplicated, got


@pytest.mark.parametrize("publish", ["driver", "task"])
def test_a_task_failing_upstream_of_the_writer_then_retried_delivers_each_row_once(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, unique_topic: str,
    small_batches: None, publish: str,
) -> None:
    rows, fail_at = 6000, 5200  # partition 1 (3000..5999) dies after part of its rows
    marker = tmp_path / "failed"
    with agent_on_spool(tmp_path, session_broker.bootstrap) as (agent, spool):
        failing_once(rows, fail_at, marker, spool).write.format("ferry").option(
            "topic", unique_topic).option("publish", publish).mode("append").save(str(spool))
        assert marker.read_text() == "1"  # the first attempt did fail mid-partition
        lost, duplicated, _ = lost_and_duplicated(agent, spool, session_broker.bootstrap,
                                                  unique_topic, expected(range(rows)))
        view = agent.registry.view()
    assert (lost, duplicated) == (0, 0)
    assert view.total("spool_files_diverged") == 0


@pytest.mark.parametrize("publish", ["driver", "task"])
def test_a_failed_job_rerun_with_the_same_job_id_delivers_each_row_once(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, unique_topic: str,
    small_batches: None, publish: str,
) -> None:
    """Partition 0 fails on every attempt, so the job fails and Spark kills partition 1
    mid-write; then the job is re-run with the same jobId and succeeds."""
    rows = 6000
    started = tmp_path / "partition-1-started"
    with agent_on_spool(tmp_path, session_broker.bootstrap) as (agent, spool):
        # Mode "task" has no abort marker: partition 1 waits until Spark kills it.
        released = None if publish == "driver" else tmp_path / "never"

        def write(df: DataFrame) -> None:
            df.write.format("ferry").option("topic", unique_topic).option(
                "jobId", "killed").option("publish", publish).mode("append").save(str(spool))

        with pytest.raises(PySparkException, match="injected failure on every attempt"):
            write(killed_by_another_task(rows, spool, started, released))
        assert started.exists()  # partition 1 was writing when the job failed
        # Spark does not wait for the task it kills: let it end (publish, stage or drop its
        # file) before the re-run, as an operator re-running a failed job does.
        wait_until(lambda: not [n for n in os.listdir(spool) if n.endswith(".tmp")],
                   timeout=60, message="the killed task's writer ended")
        write(killed_by_another_task(rows, spool, None))
        lost, duplicated, _ = lost_and_duplicated(agent, spool, session_broker.bootstrap,
                                                  unique_topic, expected(range(rows)))
        view = agent.registry.view()
    assert (lost, duplicated) == (0, 0)
    assert view.total("spool_files_diverged") == 0


def test_a_rerun_that_partitions_rows_differently_loses_nothing_and_says_so(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, unique_topic: str,
) -> None:
    """A re-run with the same jobId whose rows fall into partitions differently (a
    nondeterministic plan): the names come again with other content. Nothing is lost; the
    agent ingests those files whole and counts them, so the duplicates are reported."""
    rows = 3000
    with agent_on_spool(tmp_path, session_broker.bootstrap) as (agent, spool):
        for partitions in (2, 3):
            spark.range(0, rows, numPartitions=partitions).select(
                F.col("id").cast("string").cast("binary").alias("value")
            ).write.format("ferry").option("topic", unique_topic).option(
                "jobId", "nondeterministic").mode("append").save(str(spool))
            wait_until(lambda: not list_ready_files(spool), timeout=60,
                       message="the run's files ingested")
        want = Counter(b"%d" % i for i in range(rows))
        wait_until(lambda: agent.registry.view().total("spool_files_ingested")
                   + agent.registry.view().total("spool_files_duplicate") >= 5,
                   timeout=60, message="all five files handled")
        delivered_at_least = want.total()
        lost, duplicated, got = lost_and_duplicated(agent, spool, session_broker.bootstrap,
                                                    unique_topic, want)
        view = agent.registry.view()
    assert lost == 0 and delivered_at_least <= got.total()
    # Files 00000 and 00001 came again with other rows: ingested whole, counted and logged as
    # diverged. File 00002 is a new name, so nothing can tell that its rows were in the first
    # run's 00001: a nondeterministic re-run is at-least-once, every row of it delivered again.
    assert view.total("spool_files_diverged") == 2
    assert duplicated == rows
    print(f"nondeterministic re-run: lost {lost}, duplicated {duplicated} (reported: "
          f"{view.total('spool_files_diverged'):.0f} diverged files)")


@pytest.mark.parametrize("publish", ["driver", "task"])
def test_a_stream_whose_udf_fails_once_delivers_each_row_once(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, unique_topic: str,
    small_batches: None, publish: str,
) -> None:
    source = tmp_path / "in"
    source.mkdir()
    per_file = 1500
    for f in range(3):
        lines = [json.dumps({"n": f * per_file + i}) for i in range(per_file)]
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    marker = tmp_path / "failed"
    fail_at = per_file + per_file * 3 // 4  # late in micro-batch 1

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.attemptNumber() == 0 and (ids == fail_at).any():
            marker.touch()
            raise RuntimeError("injected failure on the first attempt")
        return ids.map(value)

    with agent_on_spool(tmp_path, session_broker.bootstrap) as (agent, spool):
        query = (
            spark.readStream.schema("n long").option("maxFilesPerTrigger", 1)
            .json(str(source)).select(value_of(F.col("n")).alias("value"))
            .writeStream.format("ferry").option("topic", unique_topic)
            .option("publish", publish).option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True).start(str(spool))
        )
        query.awaitTermination(120)
        assert query.exception() is None and not query.isActive
        assert marker.exists()
        lost, duplicated, _ = lost_and_duplicated(agent, spool, session_broker.bootstrap,
                                                  unique_topic, expected(range(3 * per_file)))
    assert (lost, duplicated) == (0, 0)
