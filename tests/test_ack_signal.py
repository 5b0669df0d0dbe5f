"""What the forwarder signals to the HTTP stage (agent/signals/ack.py), as pure logic: a fake
producer acknowledges (tests/forwarder/fakes.py); the buffer and the socket are
real. Acknowledged ids are signalled when their delivery reports come, even while the
buffer's delete keeps failing; discarded ids once the discard is recorded."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.buffer.store import BufferUnavailable
from agent.config import TopicConfig
from agent.records import Record
from agent.signals.ack import DELIVERED, DISCARDED, Acks, decode, socket_path
from tests.forwarder.fakes import Acking, FakeCluster, Setup, run_until


@pytest.fixture
def listener(setup: Setup) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(socket_path(setup.config.buffer.path)))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[Acks]:
    got: list[Acks] = []
    while True:
        try:
            acks = decode(sock.recv(1 << 20))
        except BlockingIOError:
            return got
        assert acks is not None
        got.append(acks)


def test_acknowledged_ids_are_signalled_before_the_delete_commits(
    setup: Setup, listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    fwd = setup.forwarder({"local": Acking()}, lambda t: TopicConfig())
    ids = setup.store.append([[Record("t", b"m%d" % i) for i in range(5)]])[0]
    assert isinstance(ids, list)
    removals: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        removals.append(1)
        raise BufferUnavailable("disk_error", "mdb_txn_commit: Input/output error")

    remove_many = setup.store.remove_many
    monkeypatch.setattr(setup.store, "remove_many", failing)
    got: list[Acks] = []
    deadline = time.monotonic() + 10
    while sum(len(a.ids) for a in got) < 5 and time.monotonic() < deadline:
        fwd.step()
        got += received(listener)
    assert [i for a in got for i in a.ids] == ids
    assert {a.state for a in got} == {DELIVERED}
    assert [a.seq for a in got] == list(range(len(got)))
    # Signalled as Kafka acknowledged them: the buffer still holds them (its delete fails).
    assert all(setup.store.locate(i) == {"state": "buffered", "topic": "t"} for i in ids)
    monkeypatch.setattr(setup.store, "remove_many", remove_many)
    run_until(fwd, lambda: not setup.store.topic_stats(), "the buffer drained")
    assert all((setup.store.locate(i) or {}).get("state") == "delivered" for i in ids)
    assert received(listener) == []  # nothing signalled twice


def test_discarded_ids_are_signalled_once_the_discard_is_recorded(
    setup: Setup, listener: socket.socket
) -> None:
    fwd = setup.forwarder({"local": FakeCluster()}, lambda t: TopicConfig(max_message_bytes=10))
    ids = setup.store.append([[Record("t", b"x" * 100)]])[0]  # too large: discarded
    assert isinstance(ids, list)
    run_until(fwd, lambda: not setup.store.topic_stats(), "the discard left the buffer")
    got = received(listener)
    assert [(a.state, a.ids) for a in got] == [(DISCARDED, ids)]
    assert setup.discard_ids() == [ids[0].hex()]
