"""What the Apache Kafka forwarder tests share: publishing numbered messages over HTTP and
keeping those Ferry acknowledged, counting them back at a real consumer (lost, duplicated),
and reading the agent's verdicts (``/status/all``, ``ferry status``, its log).

A message counts as *acknowledged* once Ferry answered 201 or 202: it is then in the fsynced
buffer, and the promise is that it reaches Kafka. Datagrams carry no answer, so these tests
publish over HTTP, where the answer is the acknowledgement.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ferry_client import FerryHttp
from tests.agent_harness import REPO_ROOT, AgentProcess
from tests.kafka import read_topic


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
        [sys.executable, "-m", "agent.cli", "status", "--url", agent.http_url],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    return done.returncode, done.stdout + done.stderr


def log_lines(agent: AgentProcess, containing: str) -> list[str]:
    try:
        text = agent.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if containing in line]
