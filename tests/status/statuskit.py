"""Helpers for the status tests: a real agent core in this process, served over real HTTP.

``StatusAgent`` is the daemon's ``Agent`` (real LMDB buffer, real group-commit writer, real
registry) without its sources or forwarder process. ``Activity`` makes things happen to it the
way the other components do: messages are committed through the real writer (which counts
``messages_accepted``), and leave the buffer through ``Store.remove`` with the same outcome,
counters and samples the forwarder records. ``serve`` runs a Starlette app on uvicorn in a
thread, on a port the OS picks.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from agent.buffer import keys
from agent.buffer.store import Outcome, StoredMessage
from agent.config import (
    BufferConfig,
    FerryConfig,
    HttpConfig,
    KafkaClusterConfig,
    KafkaConfig,
    SocketConfig,
    SpoolConfig,
)
from agent.daemon.agent import Agent
from agent.ingest.runtime import Phase
from agent.metrics import Registry
from agent.records import Record
from status.routes import StatusService
from tests.waiting import wait_until


def make_agent(root: Path, *, remote: bool = False, max_bytes: int = 64 * 1024 * 1024) -> Agent:
    """The agent's core (buffer, writer, registry, runtime), running, with no sources."""
    config = FerryConfig(
        buffer=BufferConfig(path=root / "buffer", max_bytes=max_bytes),
        socket=SocketConfig(path=None),
        http=HttpConfig(listen=""),
        spool=SpoolConfig(dirs=[]),
        kafka=KafkaConfig(
            local=KafkaClusterConfig(bootstrap_servers="127.0.0.1:1"),
            remote=KafkaClusterConfig(bootstrap_servers="127.0.0.1:2") if remote else None,
        ),
    )
    agent = Agent(config, registry=Registry())
    agent.committer.start()
    agent.runtime.set_phase(Phase.RUNNING)
    return agent


def close_agent(agent: Agent) -> None:
    agent.committer.close()
    agent.store.close()


class Activity:
    """Drive an agent's buffer and registry as sources and the forwarder would."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.registry = agent.registry
        self.store = agent.store
        self._offsets: dict[tuple[str, int], int] = {}

    def refresh(self) -> None:
        """What the daemon's monitor thread does every second: buffer gauges from LMDB."""
        self.agent.refresh_gauges()

    def accept(self, topic: str, n: int, source: str = "socket", size: int = 100) -> list[bytes]:
        """Commit ``n`` messages through the real writer; returns their ids."""
        self.registry.inc("messages_received", n, source=source)
        records = [Record(topic, b"v" * size) for _ in range(n)]
        result = self.agent.committer.commit(records, source, timeout=10)
        assert isinstance(result, list), result
        self.refresh()
        return result

    def _take(self, topic: str, n: int) -> list[StoredMessage]:
        taken = [m for m in self.store.read(topic, None, n) if isinstance(m, StoredMessage)]
        assert len(taken) == n, f"only {len(taken)} of {n} messages of {topic} buffered"
        return taken

    def deliver(
        self, topic: str, n: int, cluster: str = "local", partition: int = 0,
        latency: float = 0.004,
    ) -> list[tuple[bytes, int]]:
        """The oldest ``n`` messages of ``topic`` acknowledged by ``cluster``: (id, offset)."""
        done: list[tuple[bytes, int]] = []
        outcomes = []
        for m in self._take(topic, n):
            offset = self._offsets.get((topic, partition), 0)
            self._offsets[(topic, partition)] = offset + 1
            outcomes.append(Outcome(m.key, m.stored_bytes, topic=topic, state="delivered",
                                    cluster=cluster, partition=partition, offset=offset))
            done.append((m.id, offset))
        assert all(self.store.remove(outcomes))
        self.registry.inc("messages_delivered", n, topic=topic, cluster=cluster)
        for _ in range(n):
            self.registry.observe("produce_latency_seconds", latency, cluster=cluster)
        self.cluster(cluster, up=True)
        self.refresh()
        return done

    def discard(self, topic: str, n: int, reason: str = "ttl", detail: str = "") -> list[bytes]:
        ids = []
        outcomes = []
        for m in self._take(topic, n):
            outcomes.append(Outcome(m.key, m.stored_bytes, topic=topic, state="discarded",
                                    reason=reason))
            ids.append(m.id)
        assert all(self.store.remove(outcomes))
        for mid in ids:
            self.registry.inc("messages_discarded", topic=topic, reason=reason)
            self.registry.sample("discarded", reason, {
                "topic": topic, "id": keys.id_text(mid),
                "detail": detail or f"older than ttl_seconds; {reason}"})
        self.refresh()
        return ids

    def reject(self, source: str, reason: str, n: int = 1, detail: str = "bad input") -> None:
        self.registry.inc("messages_received", n, source=source)
        self.registry.inc("messages_rejected", n, source=source, reason=reason)
        for _ in range(n):
            self.registry.sample("rejected", reason, {"source": source, "detail": detail})

    def fail(self, topic: str, cluster: str, error: str, detail: str) -> None:
        self.registry.inc("delivery_failures", topic=topic, cluster=cluster, error=error)
        self.registry.sample("error", error, {"topic": topic, "cluster": cluster,
                                              "detail": detail})

    def cluster(self, name: str, *, up: bool, brokers: int = 3, in_flight: int = 0) -> None:
        self.registry.set("cluster_up", 1.0 if up else 0.0, cluster=name)
        self.registry.set("cluster_brokers_up", float(brokers if up else 0), cluster=name)
        self.registry.set("messages_in_flight", float(in_flight), cluster=name)


@dataclass
class StatusServer:
    """The status routes of an agent, served: what most status tests start from."""

    url: str
    agent: Agent
    service: StatusService
    activity: Activity


@contextmanager
def serve(routes: list[BaseRoute]) -> Iterator[str]:
    """Serve ``routes`` with Starlette on uvicorn in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(Starlette(routes=routes), log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="uvicorn-status-test", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout=10,
                   message="uvicorn started")
        assert thread.is_alive(), "uvicorn exited during startup"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
