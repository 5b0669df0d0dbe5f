"""New messages in the buffer, signalled from the ingest process's writer to the forwarder.

The forwarder finds new messages by reading the buffer. When it has nothing in flight it
used to sleep 2 ms between reads, so a message committed into an idle agent waited for that
sleep to end: a millisecond on average, on the path of every 201 (a publish waiting for
Kafka's acknowledgement). Now the writer sends an empty datagram to ``<buffer>/commits.sock``
after each commit that stored messages (``CommitSender.send``), and an idle forwarder waits
on that socket (``CommitListener.wait``) rather than sleeping, so it reads at once.

The datagram only wakes: the buffer stays the one source of what to send. A lost one (no
forwarder listening, its socket buffer full because it is busy and not waiting) costs
nothing but the old bounded wait. The sender never blocks and never fails the writer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_NAME = "commits.sock"


def socket_path(buffer_path: Path) -> Path:
    return buffer_path / SOCKET_NAME


class CommitSender:
    """The writer's end: ``send()`` after a commit that stored messages."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._sock: socket.socket | None = None

    def send(self) -> None:
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(b"", self.path)
        except OSError:
            pass  # no forwarder listening, or a wake-up is pending already

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class CommitListener:
    """The forwarder's end: ``wait()`` instead of sleeping while it is idle."""

    def __init__(self, path: Path) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a previous forwarder's; the buffer's lock makes us its user
            sock.bind(str(path))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def wait(self, timeout: float) -> bool:
        """Up to ``timeout`` seconds for a commit; True if one was signalled (all signals
        pending are consumed: one read of the buffer covers them)."""
        woken = self._drain()
        if woken:
            return True
        readable, _, _ = select.select([self._sock], [], [], timeout)
        return bool(readable) and self._drain()

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                self._sock.recv(16)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError:
                return got
            got = True

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def listen(path: Path) -> CommitListener | None:
    """A listener at ``path``, or None (logged) when none can be bound: the forwarder then
    sleeps its bounded waits as it did without one."""
    try:
        return CommitListener(path)
    except OSError as exc:
        log.warning("cannot listen for commit signals at %s (%s); new messages are found "
                    "by reading the buffer between short waits", path, exc)
        return None
