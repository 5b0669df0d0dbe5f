"""Spark -> spool files -> the agent -> Kafka: exactly the rows written, once each."""

from __future__ import annotations

import collections
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from agent.config import load_config
from agent.daemon import Agent
from agent.metrics import Registry
from tests.agent_harness import write_config
from tests.kafka import Broker, create_topic, read_topic
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
