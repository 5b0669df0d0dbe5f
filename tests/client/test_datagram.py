"""The application-side client against a real bound AF_UNIX datagram socket."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import agent.client
from agent.client import (
    DEFAULT_SOCKET_PATH,
    FerryClient,
    FerryClientError,
    FerryUnavailable,
    MessageTooLarge,
)
from agent.config import SocketConfig
from agent.ingest.datagram import parse
from agent.records import Record

LIMIT = 10_000_000


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Not tmp_path: AF_UNIX paths are limited to 107 bytes and pytest's can be longer.
    with tempfile.TemporaryDirectory(prefix="ferry-client-") as directory:
        yield Path(directory)


def bind(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(5)  # a missing datagram fails the test instead of hanging it
    return server


@pytest.fixture
def server(socket_dir: Path) -> Iterator[socket.socket]:
    with bind(socket_dir / "ferry.sock") as sock:
        yield sock


def receive(server: socket.socket) -> Record:
    return parse(server.recv(1 << 24), LIMIT)


def test_any_partition_and_partition_key_messages_arrive(server: socket.socket) -> None:
    path = server.getsockname()
    with FerryClient(path) as client:
        client.send("clicks", b"hello", timestamp_ms=1234)
        client.send("clicks", b"world", key=b"user-9", partition_key=-7, timestamp_ms=5678)
    assert receive(server) == Record("clicks", b"hello", None, None, 1234, (), False)
    assert receive(server) == Record("clicks", b"world", b"user-9", -7, 5678, (), False)


def test_module_level_send(server: socket.socket) -> None:
    agent.client.send("t", b"v", key=b"k", socket_path=server.getsockname())
    agent.client.send("t", b"w", partition_key=3, socket_path=Path(server.getsockname()))
    first, second = receive(server), receive(server)
    assert (first.topic, first.value, first.key, first.partition_key) == ("t", b"v", b"k", None)
    assert (second.value, second.key, second.partition_key) == (b"w", None, 3)


def test_large_message_within_the_socket_limit_arrives(server: socket.socket) -> None:
    value = os.urandom(100_000)
    with FerryClient(server.getsockname()) as client:
        client.send("big", value)
    assert receive(server).value == value


def test_missing_socket_raises_a_clear_error(socket_dir: Path) -> None:
    missing = socket_dir / "nothing-here.sock"
    with pytest.raises(FerryUnavailable, match="does not exist") as info:
        FerryClient(missing)
    assert info.value.errno == errno.ENOENT
    assert str(missing) in str(info.value)
    with pytest.raises(FerryUnavailable, match="does not exist"):
        agent.client.send("t", b"v", socket_path=missing)


def test_socket_nobody_listens_on_raises_a_clear_error(socket_dir: Path) -> None:
    path = socket_dir / "stale.sock"
    bind(path).close()  # the file stays behind, as after a crash
    with pytest.raises(FerryUnavailable, match="not accepting") as info:
        FerryClient(path)
    assert info.value.errno == errno.ECONNREFUSED


def test_datagram_over_the_socket_limit_raises_message_too_large(server: socket.socket) -> None:
    with FerryClient(server.getsockname(), send_buffer_bytes=65536) as client:
        with pytest.raises(MessageTooLarge, match="larger than the socket accepts") as info:
            client.send("big", bytes(300_000))
        assert info.value.errno == errno.EMSGSIZE
        assert info.value.size > 300_000
        # Nothing was sent, and the client is still usable.
        client.send("small", b"ok")
    assert receive(server).topic == "small"


def test_illegal_topic_is_refused_before_sending(server: socket.socket) -> None:
    with FerryClient(server.getsockname()) as client, pytest.raises(ValueError, match="topic"):
        client.send("not a topic", b"v")
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.recv(1024)


def test_full_receive_queue_blocks_instead_of_dropping(server: socket.socket) -> None:
    # Nobody reads, so the queue fills; a send must then wait (here: until its timeout)
    # rather than fail fast or vanish. Everything that send() accepted must be received.
    sent = 0
    with FerryClient(server.getsockname(), timeout=0.2) as client:
        with pytest.raises(TimeoutError):
            for sent in range(10_000):  # bounded; the kernel queue fills long before
                client.send("q", str(sent).encode(), timestamp_ms=0)
        received = []
        server.setblocking(False)
        while True:
            try:
                received.append(receive(server).value)
            except BlockingIOError:
                break
        assert received == [str(i).encode() for i in range(sent)]
        assert sent > 0
        # With room in the queue again, sending works again.
        client.send("q", b"after", timestamp_ms=0)
    server.settimeout(5)
    assert receive(server).value == b"after"


def test_reconnects_when_ferry_restarts(socket_dir: Path) -> None:
    path = socket_dir / "ferry.sock"
    first = bind(path)
    with FerryClient(path) as client:
        client.send("t", b"one", timestamp_ms=0)
        assert receive(first).value == b"one"
        first.close()
        path.unlink()
        # Ferry is down: the sender hears of it instead of losing the message silently.
        with pytest.raises(FerryUnavailable, match="does not exist"):
            client.send("t", b"while down", timestamp_ms=0)
        second = bind(path)
        client.send("t", b"two", timestamp_ms=0)
        assert receive(second).value == b"two"
        # Restarted between two sends: the next send goes to the new socket.
        second.close()
        path.unlink()
        with bind(path) as third:
            client.send("t", b"three", timestamp_ms=0)
            assert receive(third).value == b"three"


def test_client_errors_are_oserrors() -> None:
    assert issubclass(FerryUnavailable, FerryClientError)
    assert issubclass(MessageTooLarge, FerryClientError)
    assert issubclass(FerryClientError, OSError)


def test_default_socket_path_matches_the_configuration_default() -> None:
    assert SocketConfig().path == DEFAULT_SOCKET_PATH
