"""What the Apache Kafka forwarder tests share: publishing numbered messages over HTTP and
keeping those Ferry acknowledged, counting them back at a real consumer (lost, duplicated),
and reading the agent's verdicts (``/status/all``, ``ferry status``, its log, its discard
log).

A message counts as *acknowledged* once Ferry answered 201 or 202: it is then in the fsynced
buffer, and the promise is that it reaches Kafka. Datagrams carry no answer, so these tests
publish over HTTP, where the answer is the acknowledgement.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ferry_client import FerryHttp
from tests.agent_harness import REPO_ROOT, AgentProcess
from tests.kafka import read_topic
from tests.reliability.checker import wait_transactions_settled
from tests.waiting import wait_until


def publish(agent: AgentProcess, topic: str, prefix: str, count: int, *,
            partition_keys: int | None = None) -> list[bytes]:
    """Publish ``prefix-000000`` ... over HTTP, one request each; return those answered 2xx.

    ``partition_keys``: give message i the Bruce partition key ``i % partition_keys``.
    Any refusal raises (FerryHttp retries transient ones with the same idempotency key), so
    what is returned is exactly what Ferry acknowledged."""
    acknowledged = []
    with FerryHttp(agent.http_url, timeout=30.0, attempts=3) as client:
        for i in range(count):
            value = f"{prefix}-{i:06d}".encode()
            pk = None if partition_keys is None else i % partition_keys
            client.publish(topic, value, partition_key=pk)
            acknowledged.append(value)
    return acknowledged


@dataclass(frozen=True)
class Tally:
    """Acknowledged messages against what consumers read: lost ones (acknowledged, read
    nowhere) and duplicated ones (read more than once, all clusters together)."""

    acknowledged: int
    read: int
    lost: list[bytes]
    duplicated: dict[bytes, int]

    def __str__(self) -> str:
        return (f"acknowledged {self.acknowledged}, read {self.read}, lost {len(self.lost)}, "
                f"duplicated {len(self.duplicated)}")


def tally(acknowledged: Iterable[bytes], *reads: Iterable[bytes | None]) -> Tally:
    ack = list(acknowledged)
    seen: Counter[bytes] = Counter()
    for values in reads:
        seen.update(v for v in values if v is not None)
    lost = [v for v in ack if v not in seen]
    duplicated = {v: n for v, n in seen.items() if n > 1}
    return Tally(len(ack), sum(seen.values()), lost, duplicated)


def values(bootstrap: str, topic: str, timeout: float = 60.0, **extra: Any) -> list[bytes | None]:
    """Every value ``topic`` holds now, read by a real consumer (PLAINTEXT listener)."""
    return [m.value for m in read_topic(bootstrap, topic, timeout=timeout, **extra)]


def committed(bootstrap: str, topic: str) -> list[bytes | None]:
    wait_transactions_settled(bootstrap, topic)
    return [m.value for m in read_topic(bootstrap, topic, 120, read_committed=True)]


# -- the agent's verdicts --------------------------------------------------------------------


def status(agent: AgentProcess) -> dict[str, Any]:
    doc: dict[str, Any] = agent.get_json("/status/all")
    return doc


def cluster_row(doc: dict[str, Any], name: str) -> dict[str, Any]:
    for row in doc["clusters"]:
        if row["name"] == name:
            return dict(row)
    raise AssertionError(f"no cluster {name!r} in {[r['name'] for r in doc['clusters']]}")


def topic_row(doc: dict[str, Any], topic: str) -> dict[str, Any] | None:
    for row in doc["topics"]:
        if row["topic"] == topic:
            return dict(row)
    return None


def health_messages(doc: dict[str, Any]) -> list[str]:
    return [p["message"] for p in doc["health"]["problems"]]


def ferry_status(agent: AgentProcess) -> tuple[int, str]:
    """``ferry status`` against the agent: its Nagios exit code and what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli.main", "status", "--url", agent.http_url],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    return done.returncode, done.stdout + done.stderr


def log_lines(agent: AgentProcess, containing: str) -> list[str]:
    try:
        text = agent.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if containing in line]


def logged_discards(agent: AgentProcess) -> list[dict[str, object]]:
    path = agent.config.discard_log_path
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def until_drained(agent: AgentProcess, timeout: float) -> None:
    """Until the agent's buffer is empty; if it is not in time, the failure says what is
    left, the delivery failures and the log's tail (agent_harness.wait_drained does not)."""
    try:
        wait_until(lambda: agent.buffered() == {}, timeout=timeout, interval=0.5,
                   message="the buffer drained")
    except AssertionError:
        failures = [m for m in agent.get_json("/status/counters")["metrics"]
                    if m["name"] == "delivery_failures"]
        raise AssertionError(f"not drained: {agent.buffered()}; failures: {failures}; "
                             f"{agent.log_tail(30)}") from None


class Stream:
    """Publishes ``prefix-000000`` ... over HTTP from a thread until :meth:`stop`, at most
    ``limit`` messages and ``seconds`` long (a bounded load loop): the traffic a failure
    lands in the middle of. ``acknowledged`` grows as Ferry answers."""

    def __init__(self, agent: AgentProcess, topic: str, prefix: str, *, limit: int = 20000,
                 seconds: float = 120.0, partition_keys: int | None = None) -> None:
        self.agent, self.topic, self.prefix = agent, topic, prefix
        self.limit, self.seconds, self.partition_keys = limit, seconds, partition_keys
        self.acknowledged: list[bytes] = []
        self.ids: dict[bytes, str] = {}  # value -> Ferry's message id (GET /messages/{id})
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stream-{prefix}", daemon=True)

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        try:
            with FerryHttp(self.agent.http_url, timeout=30.0, attempts=3) as client:
                for i in range(self.limit):
                    if self._stop.is_set() or time.monotonic() > deadline:
                        return
                    value = f"{self.prefix}-{i:06d}".encode()
                    pk = None if self.partition_keys is None else i % self.partition_keys
                    self.ids[value] = client.publish(self.topic, value, partition_key=pk).id
                    self.acknowledged.append(value)
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop(), in the test
            self.error = exc

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` more messages than now are acknowledged."""
        target = len(self.acknowledged) + count
        wait_until(lambda: len(self.acknowledged) >= target or self.error is not None,
                   timeout=timeout, message=f"{target} messages acknowledged")
        if self.error is not None:
            raise AssertionError(f"publishing failed: {self.error!r}") from self.error

    def stop(self) -> list[bytes]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the publishing thread did not stop"
        if self.error is not None:
            raise AssertionError(f"publishing failed: {self.error!r}") from self.error
        return self.acknowledged
