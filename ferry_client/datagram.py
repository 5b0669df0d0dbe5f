"""Send messages to a local Ferry over its UNIX datagram socket (Bruce's wire format).

::

    from ferry_client import FerryClient

    with FerryClient("/run/ferry/ferry.sock") as ferry:
        ferry.send("clicks", b'{"user": 42}')                           # AnyPartition
        ferry.send("clicks", b"...", key=b"user-42", partition_key=42)  # PartitionKey

A datagram gets no reply: Ferry counts and logs what it rejects, but the sender never hears
of it. So this client checks what it can before sending (topic name, field ranges, the
datagram size limit) and raises instead of sending something doomed.

When Ferry's receive queue is full, a send never drops the message silently. What it does
is the client's ``when_full`` choice: ``"block"`` (the default) waits for room, at most
``timeout`` seconds (None: as long as it takes), so a busy Ferry slows the sender down;
``"raise"`` raises :class:`QueueFull` at once. Either way :class:`QueueFull` means the
message was not sent, and the caller decides (retry, spill over HTTP, give up loudly).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path
from types import TracebackType
from typing import Literal

from ferry_client.wire import encode_any_partition, encode_partition_key

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "FerryClient",
    "FerryClientError",
    "FerryUnavailable",
    "MessageTooLarge",
    "QueueFull",
    "send",
]

# agent.config.SocketConfig.path's default; a test keeps the two equal.
DEFAULT_SOCKET_PATH = Path("/run/ferry/ferry.sock")

_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the terminating NUL

# What a failed connect means, by errno, for FerryUnavailable's message.
_UNAVAILABLE = {
    errno.ENOENT: "does not exist (is Ferry running, and is this its socket.path?)",
    errno.ENOTDIR: "does not exist (is Ferry running, and is this its socket.path?)",
    errno.ECONNREFUSED: "is not accepting messages (Ferry is stopped or restarting)",
    errno.EACCES: "is not writable by this user (see Ferry's socket.mode and the socket's group)",
}


class FerryClientError(OSError):
    """Base of the datagram client's errors; an OSError, so socket error handling sees it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class FerryUnavailable(FerryClientError):
    """No Ferry socket to send to: missing, not listening, or not writable for this user."""


class MessageTooLarge(FerryClientError):
    """The datagram is larger than the socket accepts (EMSGSIZE); nothing was sent."""

    def __init__(self, size: int, send_buffer_bytes: int) -> None:
        super().__init__(
            errno.EMSGSIZE,
            f"message datagram of {size} bytes is larger than the socket accepts "
            f"(send buffer {send_buffer_bytes} bytes); raise send_buffer_bytes "
            f"(capped by net.core.wmem_max) or send large messages over HTTP or a spool file",
        )
        self.size = size
        self.send_buffer_bytes = send_buffer_bytes


class QueueFull(FerryClientError, TimeoutError):
    """Ferry's receive queue stayed full (``when_full="raise"``, or the ``timeout`` ran out);
    the message was not sent. Also a :class:`TimeoutError`."""


class FerryClient:
    """A connection to Ferry's datagram socket at ``path``; use it as a context manager.

    ``when_full`` says what :meth:`send` does while Ferry's receive queue is full: ``"block"``
    waits for room, at most ``timeout`` seconds (None: no limit); ``"raise"`` raises
    :class:`QueueFull` at once. ``send_buffer_bytes`` sets SO_SNDBUF, which on Linux is also
    the largest datagram the socket can send (the kernel caps it at net.core.wmem_max).

    One client may be shared between threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_SOCKET_PATH,
        *,
        when_full: Literal["block", "raise"] = "block",
        timeout: float | None = None,
        send_buffer_bytes: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            raise ValueError(f"socket path {self.path!r} is longer than {_SUN_PATH_MAX} bytes")
        if when_full not in ("block", "raise"):
            raise ValueError(f"when_full must be 'block' or 'raise', not {when_full!r}")
        if when_full == "raise" and timeout is not None:
            raise ValueError("timeout applies to when_full='block' only")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, not {timeout!r}")
        self.when_full = when_full
        self._timeout = 0.0 if when_full == "raise" else timeout
        self._send_buffer_bytes = send_buffer_bytes
        self._lock = threading.Lock()
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if self._send_buffer_bytes is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
            sock.connect(self.path)
            sock.settimeout(self._timeout)  # after connect: a UNIX connect never waits
        except OSError as exc:
            sock.close()
            why = _UNAVAILABLE.get(exc.errno or 0)
            if why is None:
                raise
            raise FerryUnavailable(exc.errno or 0, f"Ferry socket {self.path} {why}") from exc
        return sock

    def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        partition_key: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """Send one message; returns once the kernel queued it on Ferry's socket.

        Without ``partition_key`` it is an AnyPartition message (Ferry spreads these across
        partitions round-robin); with it, a PartitionKey message (a signed 32-bit int choosing
        the partition; unrelated to the Kafka ``key``). ``timestamp_ms`` defaults to now.

        Raises :class:`ValueError` for an illegal topic name or out-of-range field,
        :class:`MessageTooLarge`, :class:`FerryUnavailable`, or :class:`QueueFull`; after
        any of them, nothing was sent.
        """
        if partition_key is None:
            datagram = encode_any_partition(topic, value, key, timestamp_ms)
        else:
            datagram = encode_partition_key(topic, partition_key, value, key, timestamp_ms)
        self.send_datagram(datagram)

    def send_datagram(self, datagram: bytes) -> None:
        """Send one already-encoded datagram (see :mod:`ferry_client.wire`)."""
        sock = self._sock
        try:
            self._send(sock, datagram)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOTCONN):
                raise
            # Ferry restarted: the socket we were connected to is gone and a new one may be at
            # the path. The failed send queued nothing, so sending once more cannot duplicate;
            # one reconnect, not a retry loop: a Ferry still down is the caller's to hear of.
            self._send(self._reconnect(sock), datagram)

    def _send(self, sock: socket.socket, datagram: bytes) -> None:
        try:
            sock.send(datagram)
        except (BlockingIOError, TimeoutError):
            if self.when_full == "raise":
                raise QueueFull(errno.EAGAIN, f"Ferry's socket {self.path} has a full receive "
                                "queue (when_full='raise'); the message was not sent") from None
            raise QueueFull(errno.ETIMEDOUT, f"Ferry's socket {self.path} stayed full for "
                            f"{self._timeout} s; the message was not sent") from None
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                limit = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                raise MessageTooLarge(len(datagram), limit) from None
            raise

    def _reconnect(self, stale: socket.socket) -> socket.socket:
        with self._lock:
            if self._sock is stale:  # another thread may have reconnected already
                fresh = self._connect()
                self._sock = fresh
                stale.close()
            return self._sock

    def close(self) -> None:
        """Close the socket; further sends raise OSError."""
        self._sock.close()

    def __enter__(self) -> FerryClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def send(
    topic: str,
    value: bytes,
    key: bytes | None = None,
    partition_key: int | None = None,
    timestamp_ms: int | None = None,
    *,
    socket_path: str | os.PathLike[str] = DEFAULT_SOCKET_PATH,
    when_full: Literal["block", "raise"] = "block",
    timeout: float | None = None,
) -> None:
    """Send one message on a fresh connection; see :meth:`FerryClient.send`.

    Convenient for scripts; a program that sends many messages should keep one
    :class:`FerryClient` open instead.
    """
    with FerryClient(socket_path, when_full=when_full, timeout=timeout) as ferry:
        ferry.send(topic, value, key, partition_key, timestamp_ms)
