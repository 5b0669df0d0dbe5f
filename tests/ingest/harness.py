"""Ferry's ingest stages for tests, on a real buffer and committer and no agent: the socket
server (``Running``; the ``start_running`` fixture in conftest.py starts them) and the spool
intake (``intake_only``), with ``buffered`` to read back what a topic holds."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from agent.buffer.committer import Committer
from agent.buffer.store import Store, StoredMessage
from agent.config import BufferConfig, FerryConfig, SocketConfig, SpoolConfig, TopicConfig
from agent.ingest.runtime import Runtime
from agent.ingest.socket_server import SocketServer
from agent.ingest.spool_intake import SpoolIntake
from agent.metrics import Registry
from agent.topics import TopicCatalog

MB = 1024 * 1024


class Running:
    def __init__(self, tmp_path: Path, *, default_max_bytes: int | None = None,
                 catalog: bool = False) -> None:
        # A short directory: AF_UNIX paths are limited to ~108 bytes.
        topics = {} if default_max_bytes is None else {
            "default": TopicConfig(max_message_bytes=default_max_bytes)}
        self.config = FerryConfig(buffer=BufferConfig(path=tmp_path / "buffer"),
                                  socket=SocketConfig(path=tmp_path / "s.sock"),
                                  **({"topics": topics} if topics else {}))
        self.store = Store(tmp_path / "buffer", 64 * MB, initial_map_bytes=MB)
        self.registry = Registry()
        self.committer = Committer(self.store, registry=self.registry)
        # As the daemon wires it when catalog is set: topics defined over HTTP count too.
        self.catalog = TopicCatalog(self.config, self.store) if catalog else None
        self.server = SocketServer(
            self.config, self.committer, self.registry,
            topic_settings=self.catalog.settings if self.catalog is not None else None)
        self.sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(self, datagram: bytes) -> None:
        self.sender.sendto(datagram, str(self.config.socket.path))

    def counter(self, name: str, **labels: str) -> float:
        return self.registry.view().total(name, **labels)

    def stored(self, topic: str) -> list[StoredMessage]:
        return [m for m in self.store.read(topic, None, 10_000) if isinstance(m, StoredMessage)]


@contextmanager
def intake_only(root: Path, max_bytes: int = 256 * MB,
                after_ingest: Literal["delete", "move"] = "delete",
                buffer_path: Path | None = None,
                reserve_bytes: int = 32 * MB,
                scan_interval_seconds: float = 5.0) -> Iterator[SpoolIntake]:
    """A SpoolIntake on a real buffer and committer, its scans driven by the test (or by
    its own thread, once the test starts it)."""
    config = FerryConfig(buffer=BufferConfig(path=buffer_path or root / "buffer",
                                             max_bytes=max_bytes, reserve_bytes=reserve_bytes),
                         spool=SpoolConfig(dirs=[root / "spool"], after_ingest=after_ingest,
                                           scan_interval_seconds=scan_interval_seconds))
    (root / "spool").mkdir()
    registry = Registry()
    store = Store(config.buffer.path, config.buffer.max_bytes, track=False,
                  reserve_bytes=config.buffer.reserve_bytes)
    committer = Committer(store, registry=registry)
    committer.start()
    intake = SpoolIntake(Runtime(config, store, committer, registry))
    try:
        yield intake
    finally:
        intake.stop()
        committer.close()
        store.close()


def buffered(store: Store, topic: str) -> list[StoredMessage]:
    out = [m for m in store.read(topic, None, 10_000_000) if isinstance(m, StoredMessage)]
    assert len(out) == len(store.read(topic, None, 10_000_000))
    return out
