"""Ferry's HTTP stage for tests: a real Store, Committer and HttpServer on port 0.

``start(config)`` starts it as the daemon does (``create_app`` + ``HttpServer``) and returns
a ``Served`` with an httpx client; requests are real HTTP over loopback. The fixtures in
conftest.py build on it. ``hold_writer(served)`` holds the buffer writer inside a commit
callback (a ``Gate``) until the test releases it, so that requests queue up
deterministically; ``queued_messages(served)`` counts those waiting for the writer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.buffer.committer import Committer
from agent.buffer.store import Store, StoredMessage
from agent.config import FerryConfig
from agent.ingest.http.app import FerryApp, create_app
from agent.ingest.http.server import HttpServer
from agent.ingest.runtime import Phase, Runtime
from agent.metrics import Registry
from agent.records import Record
from tests.buffer.helpers import WAIT, Gate


@dataclass
class Served:
    runtime: Runtime
    app: FerryApp
    server: HttpServer
    client: httpx.Client
    registry: Registry
    stopped: bool = field(default=False)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def store(self) -> Store:
        return self.runtime.store

    @property
    def committer(self) -> Committer:
        return self.runtime.committer

    def messages(self, topic: str) -> list[StoredMessage]:
        out = self.store.read(topic, None, 100_000)
        assert all(isinstance(m, StoredMessage) for m in out)
        return [m for m in out if isinstance(m, StoredMessage)]

    def counter(self, name: str, **labels: str) -> float:
        self.app.publisher.counters.flush()
        return self.registry.view().total(name, **labels)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.client.close()
        self.server.stop(5.0)
        self.committer.close()
        self.store.close()


def make_config(root: Path, **sections: Any) -> FerryConfig:
    data: dict[str, Any] = {
        "buffer": {"path": str(root / "buffer")},
        "socket": {"path": ""},
        "http": {"listen": "127.0.0.1:0"},
        # No forwarder runs in these tests: answers are 202 without waiting, unless a test
        # asks for an ack_timeout_ms.
        "topics": {"default": {"ack_timeout_ms": 0}},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(name), dict):
            data[name] = {**data[name], **value}
        else:
            data[name] = value
    return FerryConfig.model_validate(data)


def start(config: FerryConfig, *, running: bool = True,
          prepare: Callable[[HttpServer], None] | None = None) -> Served:
    """``prepare`` is called with the server before it starts (e.g. to swap its budget)."""
    store = Store(config.buffer.path, config.buffer.max_bytes,
                  track=config.status.track_messages, track_seconds=config.status.track_seconds)
    registry = Registry()
    committer = Committer(store, registry=registry)
    committer.start()
    runtime = Runtime(config, store, committer, registry)
    app = create_app(runtime)
    server = HttpServer(runtime, app)
    if prepare is not None:
        prepare(server)
    server.start()
    if running:
        runtime.set_phase(Phase.RUNNING)
    client = httpx.Client(base_url=server.url, timeout=30.0)
    return Served(runtime, app, server, client, registry)


# -- the buffer writer held, so that requests queue up deterministically --------------------



def hold_writer(served: Served) -> Gate:
    gate = Gate()
    served.committer.submit([Record("gate", b"g")], "socket", gate)
    assert gate.entered.wait(WAIT)
    return gate


def queued_messages(served: Served) -> int:
    with served.committer._cond:  # noqa: SLF001 - how many records wait for the writer
        return sum(len(s.records) for s in served.committer._pending)  # noqa: SLF001
