"""Kafka acknowledgements, signalled from the forwarder process to the HTTP stage.

A publish answered 201 waits until the forwarder recorded its message as delivered (the
buffer's tracking table). Rather than have the HTTP stage look that table up, the forwarder
sends, each time it has recorded outcomes, datagrams to a UNIX socket in the buffer's
directory (``AckSender.send``) that say which ids left the buffer and how: the HTTP stage
(agent/ingest/http/delivery.py) listens there (``AckListener``) and settles the waiting
requests on its event loop directly, with no lookup and no thread hop.

A datagram is ``state (1 byte) | sequence (8 bytes, big-endian) | ids (12 bytes each)``,
at most ``MAX_IDS`` ids, so a large flush is several datagrams. ``state`` is ``D``
(delivered: a cluster acknowledged them) or ``X`` (discarded by a rule). The sequence
counts the sender's datagrams: a gap tells the listener that one was lost (a full socket
buffer drops it, the sender never blocks) so it falls back to looking the ids up in the
tracking table, which stays the one source of truth. A restarted forwarder starts again at
0, which is a gap too.

The sender never blocks and never fails the forwarder: no listener (HTTP disabled, the
agent starting), a full socket buffer or any other error only drops the datagram.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_NAME = "acks.sock"
ID_LEN = 12  # agent/buffer/keys.py: the last ID_LEN bytes of a message's key are its id
DELIVERED = ord("D")
DISCARDED = ord("X")
_HEADER = struct.Struct(">BQ")
# 4,000 ids are 48 KB: under the default UNIX datagram limit (net.core.wmem_default,
# usually 208 KB) with room to spare, and few datagrams per flush.
MAX_IDS = 4000
_MAX_DATAGRAM = _HEADER.size + MAX_IDS * ID_LEN


def socket_path(buffer_path: Path) -> Path:
    return buffer_path / SOCKET_NAME


@dataclass(frozen=True, slots=True)
class Acks:
    """One datagram, parsed: ``ids`` (12 bytes each) left the buffer in ``state``."""

    state: int  # DELIVERED or DISCARDED
    seq: int
    ids: list[bytes]


def encode(state: int, seq: int, ids: list[bytes]) -> bytes:
    return _HEADER.pack(state, seq) + b"".join(ids)


def decode(datagram: bytes) -> Acks | None:
    """The datagram's content, or None when it is not one (it is then ignored)."""
    body = len(datagram) - _HEADER.size
    if body < 0 or body % ID_LEN:
        return None
    state, seq = _HEADER.unpack_from(datagram)
    if state not in (DELIVERED, DISCARDED):
        return None
    return Acks(state, seq, [datagram[i:i + ID_LEN]
                             for i in range(_HEADER.size, len(datagram), ID_LEN)])


class AckSender:
    """The forwarder's end: ``send()`` after each batch of outcomes is recorded."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._sock: socket.socket | None = None
        self._seq = 0
        # The forwarder's loop and its exactly-once thread share one sender: one sequence,
        # so the listener sees a gap only where a datagram was really lost.
        self._lock = threading.Lock()

    def send(self, delivered: Iterable[bytes], discarded: Iterable[bytes] = ()) -> int:
        """Signal that the messages of these buffer keys (``topic NUL id``) or ids left the
        buffer, acknowledged by a cluster (``delivered``) or discarded by a rule. Returns
        how many datagrams were dropped (nobody listening, or the listener is behind)."""
        dropped = 0
        for state, keys in ((DELIVERED, delivered), (DISCARDED, discarded)):
            ids = [k[-ID_LEN:] for k in keys]
            for start in range(0, len(ids), MAX_IDS):
                with self._lock:
                    dropped += not self._send(encode(state, self._seq,
                                                     ids[start:start + MAX_IDS]))
                    self._seq += 1  # also when the send failed: the gap tells the listener
        return dropped

    def _send(self, datagram: bytes) -> bool:
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(datagram, self.path)
        except OSError:
            return False  # the listener falls back to lookups
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class AckListener:
    """The HTTP stage's end, on its event loop: ``on_acks`` for each datagram received and
    ``on_gap`` when one or more were lost before it."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop,
                 on_acks: Callable[[Acks], None], on_gap: Callable[[], None]) -> None:
        self.path = path
        self.loop = loop
        self.on_acks = on_acks
        self.on_gap = on_gap
        self._next_seq: int | None = None  # None: nothing received yet
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a previous run's; the buffer's lock makes us its only user
            sock.bind(str(path))
            sock.setblocking(False)
            # Room for bursts while the loop is busy: a lost datagram costs a lookup round.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                datagram = self._sock.recv(_MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.exception("reading acknowledgement signals failed")
                self.on_gap()
                return
            acks = decode(datagram)
            if acks is None:
                log.warning("ignored a malformed acknowledgement datagram (%d bytes) at %s",
                            len(datagram), self.path)
                self.on_gap()  # whatever it meant to say, the tracking table knows
                continue
            if self._next_seq is not None and acks.seq != self._next_seq:
                self.on_gap()
            self._next_seq = acks.seq + 1
            try:
                self.on_acks(acks)
            except Exception:  # noqa: BLE001 - a bug here must not stop the listener
                log.exception("handling acknowledgement signals failed")
                self.on_gap()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._sock.fileno())
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
