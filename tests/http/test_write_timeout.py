"""``http.write_timeout_seconds``: how long answers may wait unread before the connection of
a client that never reads them is dropped (issue #29 C, made a setting)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pydantic
import pytest

from agent.config import FerryConfig
from tests.http.harness import Served
from tests.waiting import wait_until

# The default is 10 s; a connection closed well within this of its answers stalling was
# closed by the short setting, not the default. Generous for a loaded 2-core host.
WINDOW = 6.0


def _stalled(served: Served) -> bool:
    return any(c.write_paused for c in list(served.server.connections.open))


def test_a_short_write_timeout_drops_a_non_reading_client_sooner(
    serve: Callable[..., Served],
) -> None:
    served = serve(http={"write_timeout_seconds": 0.5})
    assert served.server.limits.write_timeout == 0.5
    # Pipelined requests with answers of KiBs each, never read: the answers pile up above
    # the transport's high-water mark and writing pauses. Bounded: 8 MiB of requests.
    requests = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 16
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((served.server.host, served.server.port))
    sock.settimeout(30.0)

    def send() -> None:
        try:
            for _ in range(8 * 1024 * 1024 // len(requests)):
                sock.sendall(requests)
        except OSError:
            pass  # dropped by the server: what the test waits for

    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        stalled_at: list[float] = []

        def closed_or_stalled() -> bool:
            if _stalled(served) and not stalled_at:
                stalled_at.append(time.monotonic())
            return bool(stalled_at) or (sender.is_alive() is False)

        wait_until(closed_or_stalled, timeout=30.0,
                   message="the server's answers stalled behind a client that reads none")
        assert stalled_at, "the sender ended before the server's writing paused"
        wait_until(lambda: not served.server.connections.open, timeout=WINDOW,
                   message=f"the non-reading client dropped within {WINDOW} s of the "
                   "stall with write_timeout_seconds = 0.5 (the default is 10)")
        closed_after = time.monotonic() - stalled_at[0]
        assert closed_after < WINDOW
    finally:
        sock.close()
        sender.join(timeout=30.0)


def test_the_write_timeout_defaults_to_ten_seconds_and_must_be_positive() -> None:
    base = {"buffer": {"path": "/tmp/unused"}}
    assert FerryConfig.model_validate(base).http.write_timeout_seconds == 10.0
    for bad in (0, -1):
        with pytest.raises(pydantic.ValidationError):
            FerryConfig.model_validate({**base, "http": {"write_timeout_seconds": bad}})
