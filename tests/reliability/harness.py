"""The agent process as the reliability suite drives it: launched without waiting (so it can be
killed while starting), with resource limits, and measured through /proc.

Builds on :class:`tests.agent_harness.AgentProcess` (one process group per agent; ``kill()``
SIGKILLs the whole group).
"""

from __future__ import annotations

import collections
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from tests.agent_harness import REPO_ROOT, AgentProcess
from tests.kafka import topic_partitions
from tests.waiting import wait_until


class Agent(AgentProcess):
    """``ferry run`` in its own process group, with optional limits and /proc measurements.

    ``nofile``: RLIMIT_NOFILE (soft and hard) for the agent and its children.
    """

    def __init__(self, config_path: Path, *, nofile: int | None = None,
                 log_path: Path | None = None) -> None:
        super().__init__(config_path, log_path)
        self.nofile = nofile

    def launch(self) -> Self:
        """Start the process and return at once (``wait_ready`` waits)."""
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli.main", "run", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
            start_new_session=True, preexec_fn=self._limits(),
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> Self:
        wait_until(self._ready, timeout=timeout, message=f"agent ready (log {self.log_path})")
        return self

    def start(self, timeout: float = 30.0) -> Self:
        return self.launch().wait_ready(timeout)

    def _limits(self) -> Callable[[], None] | None:
        nofile = self.nofile
        if nofile is None:
            return None

        def limit() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        return limit

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of the agent's process group (ingest, forwarder, helpers)."""
        if self.proc is None:
            return []
        return process_group(self.proc.pid)

    def usage(self) -> Usage:
        """Memory and open file descriptors of every process of the agent, now."""
        per: dict[int, ProcUsage] = {}
        for pid in self.pids():
            sample = proc_usage(pid)
            if sample is not None:
                per[pid] = sample
        return Usage(time.time(), per)

    def counters(self) -> dict[str, Any]:
        doc: dict[str, Any] = self.get_json("/status/counters")
        return doc


@dataclass(frozen=True)
class ProcUsage:
    role: str  # ingest, forwarder or helper (multiprocessing's resource tracker)
    rss_kib: int  # VmRSS: everything resident, LMDB's mapped file pages included
    anon_kib: int  # RssAnon: the heap and other private memory, where a leak would show
    fds: int


@dataclass(frozen=True)
class Usage:
    time: float
    per_pid: dict[int, ProcUsage]

    def role(self, role: str) -> ProcUsage | None:
        found = [u for u in self.per_pid.values() if u.role == role]
        return found[0] if len(found) == 1 else None

    @property
    def rss_kib(self) -> int:
        return sum(u.rss_kib for u in self.per_pid.values())

    @property
    def fds(self) -> int:
        return sum(u.fds for u in self.per_pid.values())


def process_group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces and parentheses): state ppid pgrp.
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return sorted(out)


def proc_usage(pid: int) -> ProcUsage | None:
    """Memory and open fds of ``pid``, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:
        return None  # exiting
    if b"agent.cli.main" in cmdline:
        role = "ingest"
    elif b"resource_tracker" in cmdline:
        role = "helper"
    else:
        role = "forwarder"
    return ProcUsage(role, int(fields["VmRSS"].split()[0]),
                     int(fields.get("RssAnon", "0 kB").split()[0]), fds)


def metric_total(counters: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of a counter's series in a /status/counters document whose labels match."""
    total = 0.0
    for metric in counters.get("metrics", []):
        if metric["name"] != name:
            continue
        for series in metric["series"]:
            if all(series["labels"].get(k) == v for k, v in labels.items()):
                total += float(series.get("value", 0))
    return total


def read_values(bootstrap: str, topic: str, timeout: float = 900.0, *,
                read_committed: bool = False) -> collections.Counter[bytes]:
    """How many times each value is in ``topic`` now: ``tests.kafka.read_topic`` without a
    ConsumedMessage per record, for the millions of records of a long run.

    tansu's memory storage serves a Fetch in time that grows with the partition's size, and
    returns one record batch per partition per Fetch: a partition of 30,000 one-record batches
    reads at under 100 records/s. Long runs therefore keep HTTP (one request, one batch)
    to tens of thousands of messages; the timeout is generous for the rest."""
    counts: collections.Counter[bytes] = collections.Counter()
    partitions = topic_partitions(bootstrap, topic, timeout=10)
    if not partitions:
        return counts
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"ferry-reliability-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "enable.partition.eof": True, "fetch.wait.max.ms": 20, "log_level": 0,
        "isolation.level": "read_committed" if read_committed else "read_uncommitted"})
    deadline = time.monotonic() + timeout
    pending = set(partitions)
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        while pending:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(pending)} not read to the end "
                                   f"in {timeout} s ({sum(counts.values())} records so far)")
            for message in consumer.consume(10_000, 0.2):
                error = message.error()
                if error is None:
                    counts[message.value() or b""] += 1
                    pending.add(int(message.partition() or 0))
                elif error.code() == KafkaError._PARTITION_EOF:
                    pending.discard(int(message.partition() or 0))
                elif error.fatal():
                    raise KafkaException(error)
    finally:
        consumer.close()
    return counts
