"""Spark's own Kafka sink beside Ferry's writer, after a task that failed part way and was
retried: the same rows, the same broker, counted at a consumer.

Spark documents its Kafka sink as at-least-once: a retried task sends its whole partition
again, so the rows its failed attempt had already sent are in Kafka twice. Ferry's writer
publishes only the attempts Spark counted as successful, so the same failure costs nothing.
The connector is Spark's ``spark-sql-kafka-0-10`` (``dev/kafka/spark-kafka/pom.xml``), copied
by ``dev/kafka/fetch`` into ``.venv/kafka/spark-sql-kafka-<version>/libs`` and added to the
session's class path here with ``ADD JAR`` (the session is shared and already running).

The broker is the session's tansu broker, as for the other Spark tests: what is compared is
what each writer hands Kafka, which no broker semantics change (the agent's own exactly-once
promises are tested on Apache Kafka in tests/forwarder and tests/reliability). It keeps one
SparkSession in the suite: the Apache Kafka part would otherwise start a second one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import pandas_udf

from agent.config import load_config
from agent.daemon.agent import Agent
from agent.metrics import Registry
from spool import list_ready_files
from tests.agent_harness import write_config
from tests.kafka import Broker, create_topic, read_topic, unique_topic_name
from tests.spark.faults import expected, failing_once, value
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
ROWS, FAIL_AT = 6000, 5200  # partition 1 (rows 3000..5999) fails after part of its rows


@pytest.fixture(scope="module")
def kafka_connector(spark: SparkSession) -> None:
    """Spark's Kafka connector on the shared session's class path (driver and executors)."""
    jars = sorted((REPO / ".venv" / "kafka").glob("spark-sql-kafka-*/libs/*.jar"))
    if not any(p.name.startswith("spark-sql-kafka-0-10_") for p in jars):
        pytest.fail("Spark's Kafka connector is not in .venv/kafka/spark-sql-kafka-*/libs: "
                    "run dev/kafka/fetch (dev/bootstrap test does)")
    for jar in jars:
        spark.sql(f"ADD JAR '{jar}'")


def failing_once_after_sent(bootstrap: str, topic: str, marker: Path) -> DataFrame:
    """``ROWS`` rows in 2 partitions for Spark's sink; a pandas UDF upstream of it raises on
    the first attempt of the task holding ``FAIL_AT``, once that task's first row is in
    ``topic``: the attempt has sent part of its partition when it fails."""
    first_of_partition_1 = value(ROWS // 2)

    def sent() -> bool:
        return first_of_partition_1 in {m.value for m in read_topic(bootstrap, topic)}

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.attemptNumber() == 0 and (ids == FAIL_AT).any():
            wait_until(sent, timeout=60, message="the failing attempt's first rows in Kafka")
            marker.write_text(str(ctx.partitionId()))
            raise RuntimeError("injected failure on the first attempt")
        return ids.map(value)

    session = SparkSession.getActiveSession()
    assert session is not None
    return session.range(0, ROWS, numPartitions=2).select(value_of("id").alias("value"))


def counted(bootstrap: str, topic: str) -> tuple[int, int]:
    """(lost, duplicated) of the ``ROWS`` rows in ``topic``."""
    want = expected(range(ROWS))
    got = Counter(m.value or b"" for m in read_topic(bootstrap, topic, timeout=60))
    return sum((want - got).values()), sum((got - want).values())


def through_ferry(tmp_path: Path, bootstrap: str, topic: str,
                  job: Callable[[Path], None]) -> None:
    """Run ``job`` on a spool directory a real agent takes into Kafka; wait until it did."""
    config = load_config(write_config(tmp_path, bootstrap, http=False, spool=True,
                                      topics={"default": {"acks": "all"}}))
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        spool = Path(config.spool.dirs[0])
        job(spool)
        wait_until(lambda: not list_ready_files(spool), timeout=60, message="spool ingested")
        wait_until(lambda: agent.registry.view().total("messages_delivered") >= ROWS,
                   timeout=60, interval=0.2, message="every row delivered")
        wait_until(lambda: not agent.store.topic_stats(), timeout=60, message="buffer drained")
    finally:
        agent.stop()


# pytest-timeout counts the fixtures' set-up: when this test is the first to use them, that
# is starting the session's SparkSession, which took up to a minute on a loaded 2-core
# machine; the test itself takes 1-2 minutes there.
@pytest.mark.timeout(600)
def test_a_retried_task_duplicates_rows_with_sparks_kafka_sink_not_with_ferrys_writer(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, kafka_connector: None,
    small_batches: None,
) -> None:
    bootstrap = session_broker.bootstrap
    sink_topic, ferry_topic = unique_topic_name("spark-sink"), unique_topic_name("ferry")
    for topic in (sink_topic, ferry_topic):
        create_topic(bootstrap, topic, 4)

    marker = tmp_path / "sink-failed"
    failing_once_after_sent(bootstrap, sink_topic, marker).write.format("kafka").option(
        "kafka.bootstrap.servers", bootstrap).option("topic", sink_topic).save()
    assert marker.read_text() == "1"  # the first attempt of partition 1 failed part way
    sink_lost, sink_duplicated = counted(bootstrap, sink_topic)

    marker = tmp_path / "ferry-failed"

    def ferry_job(spool: Path) -> None:
        failing_once(ROWS, FAIL_AT, marker, spool).write.format("ferry").option(
            "topic", ferry_topic).mode("append").save(str(spool))

    through_ferry(tmp_path / "agent", bootstrap, ferry_topic, ferry_job)
    assert marker.read_text() == "1"
    ferry_lost, ferry_duplicated = counted(bootstrap, ferry_topic)

    print(f"retried task, {ROWS} rows: Spark's Kafka sink lost {sink_lost}, duplicated "
          f"{sink_duplicated}; Ferry's writer lost {ferry_lost}, duplicated {ferry_duplicated}")
    # At-least-once: nothing lost, and the failed attempt's rows sent again by the retry.
    assert sink_lost == 0 and sink_duplicated > 0
    assert (ferry_lost, ferry_duplicated) == (0, 0)
