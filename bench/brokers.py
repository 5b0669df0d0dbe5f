"""The broker a benchmark runs against, of either kind, started in one place.

``--broker kafka`` (the default): a 3-node Apache Kafka cluster in KRaft mode from
``tests/apache_kafka.py``, replication factor 3 and ``min.insync.replicas`` 2, as operators
run it; every topic a benchmark makes has 3 replicas. ``--broker tansu``: one tansu process
with in-memory storage (``tests/kafka.py``), the broker the earlier figures come from.

Both are measured the same way: :meth:`BenchBroker.cpu_seconds` adds up the user and system
CPU time of every broker process (each node's JVM, or tansu) from ``/proc/<pid>/stat``, so
a benchmark can print the broker's CPU per message beside its own. On a 2-core machine three
JVMs compete with the agent and the load generator for the same cores: that figure says how
much of a rate the broker took.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.apache_kafka import KafkaCluster
from tests.kafka import Broker, create_topic

KINDS = ("kafka", "tansu")
DEFAULT = "kafka"


def add_broker_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker", choices=KINDS, default=DEFAULT,
        help="kafka: a 3-node Apache Kafka cluster (RF 3, min.insync.replicas 2; the "
             "default); tansu: one tansu broker (the earlier figures' broker)")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BenchBroker:
    """A running broker of either kind: where clients connect, how to make a topic, and the
    CPU its processes have used."""

    def __init__(self, kind: str, *, tansu: Broker | None = None,
                 cluster: KafkaCluster | None = None) -> None:
        self.kind = kind
        self._tansu = tansu
        self._cluster = cluster

    @property
    def bootstrap(self) -> str:
        if self._cluster is not None:
            return self._cluster.bootstrap
        assert self._tansu is not None
        return self._tansu.bootstrap

    @property
    def cluster(self) -> KafkaCluster | None:
        """The Apache Kafka cluster (``--broker kafka``), for benchmarks that need a node."""
        return self._cluster

    def pids(self) -> list[int]:
        if self._cluster is not None:
            return [n.pid for n in self._cluster.nodes if n.pid is not None and n.running]
        assert self._tansu is not None
        return [self._tansu.pid] if self._tansu.pid else []

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by every broker process together."""
        return sum(process_cpu_seconds(pid) for pid in self.pids())

    def create_topic(self, name: str, partitions: int) -> None:
        """Create ``name``; on Apache Kafka with 3 replicas, all leaders elected on return."""
        if self._cluster is not None:
            self._cluster.create_topic(name, partitions)
        else:
            assert self._tansu is not None
            create_topic(self._tansu.bootstrap, name, partitions)

    def describe(self) -> str:
        if self._cluster is not None:
            c = self._cluster
            return (f"broker: Apache Kafka (tests/apache_kafka.py), {c.size} nodes, "
                    f"RF {c.replication}, min.insync.replicas {c.min_insync}")
        return "broker: tansu, 1 process, in-memory storage"


@contextmanager
def start_broker(kind: str, root: Path) -> Iterator[BenchBroker]:
    """Start a broker of ``kind`` with its state under ``root``; stop it on exit."""
    if kind == "kafka":
        with KafkaCluster(root / "kafka", nodes=3) as cluster:
            yield BenchBroker(kind, cluster=cluster)
    elif kind == "tansu":
        with Broker(log_path=root / "tansu.log") as tansu:
            yield BenchBroker(kind, tansu=tansu)
    else:
        raise ValueError(f"unknown broker kind {kind!r}; one of {KINDS}")


class CpuMeter:
    """The broker's CPU over a stretch of a run: ``start()``, then ``per_message(n)``."""

    def __init__(self, broker: BenchBroker) -> None:
        self.broker = broker
        self._before: dict[int, float] = {}

    def start(self) -> None:
        self._before = {pid: process_cpu_seconds(pid) for pid in self.broker.pids()}

    def seconds(self) -> float:
        # Per PID: a node restarted meanwhile would otherwise count its new JVM's whole life.
        return sum(process_cpu_seconds(pid) - before for pid, before in self._before.items())

    def per_message_us(self, messages: float) -> float:
        return self.seconds() / max(messages, 1) * 1e6
