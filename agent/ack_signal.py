"""Kafka acknowledgements, signalled from the forwarder process to the HTTP stage.

A publish answered 201 waits until the forwarder recorded its message as delivered (the
buffer's tracking table). Instead of the HTTP stage polling that table every few
milliseconds, the forwarder sends an empty datagram to a UNIX socket in the buffer's
directory each time it has recorded outcomes (``AckSender.send``); the HTTP stage
(agent/ingest/http/delivery.py) listens there (``AckListener``) and looks up the ids it
waits for when one arrives. The datagram carries nothing: the tracking table stays the one
source of truth, and a lost datagram costs a fallback round, never an answer.

The sender never blocks and never fails the forwarder: no listener (HTTP disabled, the
agent starting), a full socket buffer (the listener already has a wake-up pending) or any
other error only drops the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_NAME = "acks.sock"


def socket_path(buffer_path: Path) -> Path:
    return buffer_path / SOCKET_NAME


class AckSender:
    """The forwarder's end: ``send()`` after each batch of outcomes is recorded."""

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
            pass  # nobody listening, or a wake-up already pending: nothing to do

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class AckListener:
    """The HTTP stage's end, on its event loop: calls ``wake()`` once per burst of signals."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop,
                 wake: Callable[[], None]) -> None:
        self.path = path
        self.loop = loop
        self.wake = wake
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a previous run's; the buffer's lock makes us its only user
            sock.bind(str(path))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:  # drain: many signals, one wake-up
            try:
                self._sock.recv(16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                log.exception("reading acknowledgement signals failed")
                break
        self.wake()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._sock.fileno())
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
