"""Spark's own Kafka sink beside Ferry's writer: the same rows to the same cluster.

    .venv/bin/python bench/bench_spark_kafka_sink.py [--rows 200000] [--fault-rows 6000]
                                                     [--broker kafka|tansu] [--repeat 1]

Two ways for a Spark job to put rows into Kafka:

- **Spark's Kafka sink** (``df.write.format("kafka")``, ``spark-sql-kafka-0-10``, the jars
  ``dev/kafka/fetch`` copies into ``.venv/kafka/spark-sql-kafka-<version>/libs``): each task
  sends its rows with a Kafka producer (the client's defaults: ``acks=all``, idempotent),
  and the job ends once they are acknowledged.
- **Ferry's writer** (``df.write.format("ferry")``, ``spark_writer/``): each task writes a
  spool file, the driver publishes the successful attempts' files, and a Ferry agent on that
  directory (in this process, as ``tests/spark`` runs it; its topic at ``acks = "all"``)
  sends them to Kafka.

Printed for each, ``--repeat`` times: the job's time (``save()`` to its return), and for
Ferry also the time until every row is in Kafka (the agent works while the job runs: both
share the machine's cores with the broker). Then the faults, each on a fresh topic with
``--fault-rows`` rows in 2 partitions, counted at a plain consumer (``tests.kafka.read_topic``;
Spark's sink is not transactional, so read_committed would see the same):

- *retried task*: a pandas UDF upstream of the writer raises on the first attempt of the task
  holding row 5/6 of the rows, after the writer has had part of the partition; Spark retries
  the task (``local[2,3]``: up to 3 attempts).
- *killed task*: the same, but the UDF's Python worker is SIGKILLed (``os.kill``, no clean-up
  of any kind), as the kernel's OOM killer or a lost executor ends one; Spark retries it.

Each prints lost (rows missing in Kafka) and duplicated (rows there more than once).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Executors run Python workers with this interpreter (pyarrow, ferry). Before the JVM starts.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
# ...and import this repository's modules (tests.kafka in a UDF below) as this process does.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).resolve().parent.parent)] + os.environ.get("PYTHONPATH", "").split(
        os.pathsep)).rstrip(os.pathsep)

import hostspeed  # noqa: E402  (bench/, the script's own directory)
import pandas as pd  # noqa: E402
from brokers import BenchBroker, CpuMeter, add_broker_option, start_broker  # noqa: E402
from pyspark import TaskContext  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.functions import pandas_udf  # noqa: E402

import spark_writer  # noqa: E402
from agent.config import load_config  # noqa: E402
from agent.daemon.agent import Agent  # noqa: E402
from agent.metrics import Registry  # noqa: E402
from spool import list_ready_files  # noqa: E402
from tests.agent_harness import write_config  # noqa: E402
from tests.kafka import read_topic  # noqa: E402
from tests.spark.faults import writing  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PARTITIONS = 8


def connector_jars() -> list[Path]:
    """Spark's Kafka connector and its dependencies, as dev/kafka/fetch left them."""
    found = sorted((REPO / ".venv" / "kafka").glob("spark-sql-kafka-*/libs/*.jar"))
    if not any(p.name.startswith("spark-sql-kafka-0-10_") for p in found):
        sys.exit("Spark's Kafka connector is not in .venv/kafka/spark-sql-kafka-*/libs: "
                 "run dev/kafka/fetch")
    return found


def session(jars: list[Path]) -> SparkSession:
    spark = (
        SparkSession.builder.master("local[2,3]")  # 2 cores, a failed task tried 3 times
        .appName("ferry-bench-spark-kafka-sink")
        .config("spark.jars", ",".join(str(p) for p in jars))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        # Small Arrow batches: a task that fails at a row has handed the writer some of its
        # partition's rows by then (tests/spark/conftest.py's small_batches does the same).
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "250")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark_writer.register(spark)
    return spark


def value(i: int) -> bytes:
    """Row i's value: 200 bytes, its id first, so each row is told apart at the consumer."""
    return f"v{i}-".encode().ljust(200, b"x")


def rows_df(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    return spark.range(0, rows, numPartitions=partitions).select(
        F.concat(F.lit("v"), F.col("id").cast("string"), F.lit("-"))
        .cast("binary").alias("prefix")
    ).select(F.rpad(F.col("prefix"), 200, b"x").alias("value"))


def in_kafka(bootstrap: str, topic: str, row: int) -> Callable[[int], bool]:
    """Whether row ``row`` is in ``topic`` already: Spark's sink has sent part of it."""
    return lambda _partition: value(row) in {
        m.value for m in read_topic(bootstrap, topic, timeout=30)}


def faulty_df(spark: SparkSession, rows: int, fail_at: int, marker: Path,
              how: str, written: Callable[[int], bool]) -> DataFrame:
    """``rows`` rows in 2 partitions; a pandas UDF upstream of the writer fails the first
    attempt of the task holding row ``fail_at`` when it gets there and ``written(partition)``
    says the writer has written part of the partition: ``how`` "raise" (an exception) or
    "kill" (SIGKILL of the UDF's own Python worker). ``marker`` then holds the partition."""

    @pandas_udf("binary")  # type: ignore[call-overload]
    def value_of(ids: pd.Series) -> pd.Series:
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.attemptNumber() == 0 and (ids == fail_at).any():
            wait_until(lambda: written(ctx.partitionId()), timeout=60,
                       message="the writer writing the partition")
            marker.write_text(str(ctx.partitionId()))
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure on the first attempt")
        return ids.map(value)

    return spark.range(0, rows, numPartitions=2).select(value_of("id").alias("value"))


def ferry_writing(spool: Path) -> Callable[[int], bool]:
    """Whether Ferry's writer has begun the partition's spool file (tests/spark/faults.py)."""
    return lambda partition: writing(spool, partition)()


def to_kafka(df: DataFrame, bootstrap: str, topic: str) -> None:
    df.write.format("kafka").option("kafka.bootstrap.servers", bootstrap).option(
        "topic", topic).save()


def to_ferry(df: DataFrame, spool: Path, topic: str) -> None:
    df.write.format("ferry").option("topic", topic).mode("append").save(str(spool))


class FerryAgent:
    """A Ferry agent (ingest + forwarder processes) taking a spool directory into Kafka."""

    def __init__(self, root: Path, bootstrap: str) -> None:
        self.config = load_config(write_config(root, bootstrap, http=False, spool=True,
                                               topics={"default": {"acks": "all"}}))
        self.spool = Path(self.config.spool.dirs[0])
        self.agent = Agent(self.config, registry=Registry())

    def __enter__(self) -> FerryAgent:
        self.agent.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.agent.stop()

    def delivered(self) -> float:
        return self.agent.registry.view().total("messages_delivered")

    def wait_delivered(self, count: float, timeout: float) -> None:
        wait_until(lambda: not list_ready_files(self.spool), timeout=timeout,
                   message="spool ingested")
        wait_until(lambda: self.delivered() >= count, timeout=timeout, interval=0.05,
                   message=f"{count:.0f} rows delivered")
        wait_until(lambda: not self.agent.store.topic_stats(), timeout=timeout,
                   message="buffer drained")


def lost_and_duplicated(bootstrap: str, topic: str, want: Counter[bytes]) -> tuple[int, int]:
    got = Counter(m.value or b"" for m in read_topic(bootstrap, topic, timeout=120))
    return sum((want - got).values()), sum((got - want).values())


def timed(action: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def throughput(spark: SparkSession, broker: BenchBroker, root: Path, rows: int,
               round_no: int) -> None:
    want = Counter(value(i) for i in range(rows))
    meter = CpuMeter(broker)
    # Spark's Kafka sink.
    topic = f"sink-rate-{round_no}"
    broker.create_topic(topic, PARTITIONS)
    df = rows_df(spark, rows, 2)
    meter.start()
    took = timed(lambda: to_kafka(df, broker.bootstrap, topic))
    broker_us = meter.per_message_us(rows)
    lost, dup = lost_and_duplicated(broker.bootstrap, topic, want)
    print(f"round {round_no}: Spark's Kafka sink: job {took:.2f} s = {rows / took:,.0f} rows/s "
          f"(in Kafka when the job ends); broker CPU {broker_us:.1f} us per row; "
          f"lost {lost}, duplicated {dup}", flush=True)
    # Ferry's writer, and the agent delivering its files.
    topic = f"ferry-rate-{round_no}"
    broker.create_topic(topic, PARTITIONS)
    with FerryAgent(root / f"agent-rate-{round_no}", broker.bootstrap) as ferry:
        meter.start()
        t0 = time.perf_counter()
        job = timed(lambda: to_ferry(df, ferry.spool, topic))
        ferry.wait_delivered(rows, timeout=600)
        end = time.perf_counter() - t0
        broker_us = meter.per_message_us(rows)
    lost, dup = lost_and_duplicated(broker.bootstrap, topic, want)
    print(f"round {round_no}: Ferry's writer: job {job:.2f} s = {rows / job:,.0f} rows/s "
          f"(spool files published); every row in Kafka after {end:.2f} s = "
          f"{rows / end:,.0f} rows/s; broker CPU {broker_us:.1f} us per row; "
          f"lost {lost}, duplicated {dup}", flush=True)


def fault(spark: SparkSession, broker: BenchBroker, root: Path, rows: int, how: str) -> None:
    fail_at = rows // 2 + rows * 2 // 6  # late in partition 1 (rows//2 .. rows-1)
    want = Counter(value(i) for i in range(rows))
    label = {"raise": "retried task (UDF raised on attempt 0)",
             "kill": "killed task (UDF's Python worker SIGKILLed on attempt 0)"}[how]
    topic = f"sink-{how}"
    broker.create_topic(topic, PARTITIONS)
    marker = root / f"sink-{how}.failed"
    # Row rows//2 is partition 1's first: in Kafka means the task was part way.
    to_kafka(faulty_df(spark, rows, fail_at, marker, how,
                       in_kafka(broker.bootstrap, topic, rows // 2)), broker.bootstrap, topic)
    lost, dup = lost_and_duplicated(broker.bootstrap, topic, want)
    print(f"{label}: Spark's Kafka sink: failed partition {marker.read_text()}; "
          f"{rows} rows: lost {lost}, duplicated {dup}", flush=True)
    topic = f"ferry-{how}"
    broker.create_topic(topic, PARTITIONS)
    marker = root / f"ferry-{how}.failed"
    with FerryAgent(root / f"agent-{how}", broker.bootstrap) as ferry:
        to_ferry(faulty_df(spark, rows, fail_at, marker, how, ferry_writing(ferry.spool)),
                 ferry.spool, topic)
        ferry.wait_delivered(rows, timeout=300)
        diverged = ferry.agent.registry.view().total("spool_files_diverged")
    lost, dup = lost_and_duplicated(broker.bootstrap, topic, want)
    print(f"{label}: Ferry's writer: failed partition {marker.read_text()}; {rows} rows: "
          f"lost {lost}, duplicated {dup} (diverged spool files: {diverged:.0f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the timed jobs")
    ap.add_argument("--fault-rows", type=int, default=6000, help="rows of each fault's job")
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds (each: both ways)")
    ap.add_argument("--no-faults", action="store_true")
    add_broker_option(ap)
    args = ap.parse_args()
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    jars = connector_jars()
    with tempfile.TemporaryDirectory() as tmp, start_broker(args.broker, Path(tmp)) as broker:
        print(broker.describe())
        print(f"machine: {os.cpu_count()} cores; Spark local[2,3]; connector: "
              f"{', '.join(p.name for p in jars)}; {args.rows} rows x 200 B in 2 partitions, "
              f"topics of {PARTITIONS} partitions", flush=True)
        spark = session(jars)
        try:
            # One small write each way first, so the first timed job does not pay for loading
            # the connector's classes and starting Python workers.
            broker.create_topic("warm-up", 1)
            to_kafka(rows_df(spark, 100, 2), broker.bootstrap, "warm-up")
            with FerryAgent(Path(tmp) / "agent-warm", broker.bootstrap) as ferry:
                to_ferry(rows_df(spark, 100, 2), ferry.spool, "warm-up")
                ferry.wait_delivered(100, timeout=120)
            for r in range(1, args.repeat + 1):
                throughput(spark, broker, Path(tmp), args.rows, r)
            if not args.no_faults:
                for how in ("raise", "kill"):
                    fault(spark, broker, Path(tmp), args.fault_rows, how)
        finally:
            spark.stop()


if __name__ == "__main__":
    main()
