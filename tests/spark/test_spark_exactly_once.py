"""A Spark job into an exactly-once topic (issue 22): a task fails after writing part of its
output and is retried, and the agent is SIGKILLed while it delivers the rows in Kafka
transactions; a read_committed consumer then finds every row exactly once.

The spool writer's retry-safe names make the retried task's rows enter the buffer once
(docs/spool.md); ``delivery = "exactly_once"`` makes them leave it once, across the kill.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spool import list_ready_files
from tests.agent_harness import AgentProcess, write_config
from tests.kafka import Broker, create_topic, read_topic
from tests.reliability.harness import metric_total
from tests.spark.faults import expected, failing_once
from tests.waiting import wait_until


@pytest.mark.parametrize("publish", ["driver", "task"])
def test_a_failing_task_and_a_killed_agent_leave_each_row_once_in_kafka(
    tmp_path: Path, spark: SparkSession, session_broker: Broker, unique_topic: str,
    small_batches: None, publish: str,
) -> None:
    rows, fail_at = 6000, 5200  # partition 1 (3000..5999) dies after part of its rows
    create_topic(session_broker.bootstrap, unique_topic, 4)
    marker = tmp_path / "failed"
    config = write_config(
        tmp_path / "agent", session_broker.bootstrap, spool=True,
        topics={unique_topic: {"delivery": "exactly_once", "acks": "all"}},
        # Its own identity: other tests' agents share this host's machine-id and the broker.
        forwarder={"agent_id": f"spark-{uuid.uuid4().hex[:8]}",
                   "transaction_interval_ms": 20, "transaction_max_messages": 500})
    spool = tmp_path / "agent" / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    agent = AgentProcess(config).start()
    try:
        failing_once(rows, fail_at, marker, spool).write.format("ferry").option(
            "topic", unique_topic).option("publish", publish).mode("append").save(str(spool))
        assert marker.read_text() == "1"  # the first attempt did fail mid-partition
        # Kill the agent between transactions of the delivery (a commit done, more rows
        # still buffered or in the spool), then let a new one finish.
        wait_until(lambda: metric_total(agent.get_json("/status/counters"),
                                        "transactions_committed") > 0,
                   timeout=60, interval=0.01, message="a transaction committed")
        agent.kill()
        left = sum(agent.buffered().values()) + len(list_ready_files(spool))
        print(f"killed with {left} rows buffered or spool files waiting")
        agent = AgentProcess(config).start()
        wait_until(lambda: not list_ready_files(spool), timeout=120, message="spool ingested")
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=120, interval=0.2,
                   message="buffer drained")
    finally:
        agent.kill()
    got = Counter(m.value for m in read_topic(session_broker.bootstrap, unique_topic, 60,
                                              read_committed=True))
    want = expected(range(rows))
    lost, duplicated = sum((want - got).values()), sum((got - want).values())
    assert (lost, duplicated) == (0, 0)
