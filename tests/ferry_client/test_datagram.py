"""ferry_client/datagram.py: the application-side client against a real bound AF_UNIX socket."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ferry_client.datagram
from agent.config import SocketConfig
from agent.ingest.datagram import parse
from agent.records import Record
from ferry_client import (
    DEFAULT_SOCKET_PATH,
    FerryClient,
    FerryClientError,
    FerryUnavailable,
    MessageTooLarge,
    QueueFull,
)

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
    ferry_client.datagram.send("t", b"v", key=b"k", socket_path=server.getsockname())
    ferry_client.datagram.send("t", b"w", partition_key=3, socket_path=Path(server.getsockname()))
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
        ferry_client.datagram.send("t", b"v", socket_path=missing)


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


def fill_queue(client: FerryClient) -> int:
    """Send numbered messages until the client raises QueueFull; how many were sent."""
    sent = 0
    with pytest.raises(QueueFull) as info:
        for sent in range(10_000):  # bounded; the kernel queue fills long before
            client.send("q", str(sent).encode(), timestamp_ms=0)
    assert isinstance(info.value, TimeoutError)  # what a bounded wait raises anywhere
    assert "not sent" in str(info.value)
    assert sent > 0
    return sent


def drain(server: socket.socket) -> list[bytes]:
    received = []
    server.setblocking(False)
    while True:
        try:
            received.append(receive(server).value)
        except BlockingIOError:
            break
    server.settimeout(5)
    return received


@pytest.mark.parametrize("options", [{"timeout": 0.2}, {"when_full": "raise"}],
                         ids=["block-with-timeout", "raise"])
def test_full_receive_queue_never_drops_a_message_silently(
    server: socket.socket, options: dict[str, Any]
) -> None:
    # Nobody reads, so the queue fills. A send then waits (here: until its timeout) or
    # raises at once, as chosen; it never vanishes. Everything send() accepted is received,
    # and the message QueueFull refused is not.
    with FerryClient(server.getsockname(), **options) as client:
        sent = fill_queue(client)
        assert drain(server) == [str(i).encode() for i in range(sent)]
        # With room in the queue again, sending works again.
        client.send("q", b"after", timestamp_ms=0)
    assert receive(server).value == b"after"


def test_blocking_send_waits_for_room(server: socket.socket) -> None:
    # when_full="block" with no timeout: a send into a full queue completes once the reader
    # makes room, rather than failing.
    with FerryClient(server.getsockname(), timeout=0.2) as probe:
        sent = fill_queue(probe)
    done = threading.Event()
    with FerryClient(server.getsockname()) as client:
        def blocked_send() -> None:
            client.send("q", b"waited", timestamp_ms=0)
            done.set()

        sender = threading.Thread(target=blocked_send, daemon=True)
        sender.start()
        assert not done.wait(0.3), "send into a full queue returned before there was room"
        received = [receive(server).value for _ in range(sent)]  # make room
        assert received == [str(i).encode() for i in range(sent)]
        assert done.wait(5), "blocked send did not complete once there was room"
        sender.join(5)
    assert receive(server).value == b"waited"


def test_bad_client_options_are_refused(server: socket.socket) -> None:
    path = server.getsockname()
    with pytest.raises(ValueError, match="when_full"):
        FerryClient(path, when_full="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout applies"):
        FerryClient(path, when_full="raise", timeout=1.0)
    with pytest.raises(ValueError, match="timeout"):
        FerryClient(path, timeout=-1)
    with pytest.raises(ValueError, match="longer than 107"):
        FerryClient("/" + "x" * 200)


def test_bad_messages_raise_clear_errors_and_send_nothing(server: socket.socket) -> None:
    with FerryClient(server.getsockname()) as client:
        with pytest.raises(ValueError, match="legal Kafka topic"):
            client.send("t" * 250, b"v")  # topic too long
        with pytest.raises(ValueError, match="partition_key"):
            client.send("t", b"v", partition_key=2**31)
        with pytest.raises(ValueError, match="partition_key"):
            client.send("t", b"v", partition_key="7")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="value must be bytes"):
            client.send("t", "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timestamp_ms"):
            client.send("t", b"v", timestamp_ms=-(2**63) - 1)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.recv(1024)


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
    assert issubclass(QueueFull, FerryClientError)
    assert issubclass(QueueFull, TimeoutError)
    assert issubclass(FerryClientError, OSError)


def test_default_socket_path_matches_the_configuration_default() -> None:
    assert SocketConfig().path == DEFAULT_SOCKET_PATH
