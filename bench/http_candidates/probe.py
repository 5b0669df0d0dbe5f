"""Issue #29's audit cases, sent on raw sockets to each candidate front door: what it answers
and what the buffer holds afterwards.

    .venv/bin/python bench/http_candidates/probe.py
        [--candidates ferry,granian-rsgi,granian-asgi,hypercorn]

Each candidate serves a real Store and Committer (no forwarder: every publish is 202 once
fsynced) with a 3 s header deadline. The cases are those of tests/http/test_conformance.py;
the tests hold Ferry's protocol to them, this prints how another server behaves before any
code is moved onto it. A case's "expected" is what the issue asks for.
"""

from __future__ import annotations

import argparse
import gzip
import select
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

H2C = (b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
       b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")
SLOW = 15.0  # seconds a case waits for an answer before it counts as none


def publish(topic: str, body: bytes, *headers: bytes, version: bytes = b"1.1",
            host: bool = True) -> bytes:
    lines = [b"POST /topics/" + topic.encode() + b" HTTP/" + version,
             *([b"Host: x"] if host else []), b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class Target:
    """One candidate serving a fresh buffer."""

    def __init__(self, candidate: str) -> None:
        from agent.buffer.committer import Committer
        from agent.buffer.store import Store
        from agent.ingest.runtime import Phase, Runtime
        from agent.metrics import Registry
        from tests.http.harness import make_config
        from tests.kafka import free_port

        self.root = tempfile.TemporaryDirectory()
        self.port = free_port()
        cfg = make_config(Path(self.root.name), http={"listen": f"127.0.0.1:{self.port}",
                                                      "header_timeout_seconds": 3.0})
        self.store = Store(cfg.buffer.path, cfg.buffer.max_bytes)
        registry = Registry()
        self.committer = Committer(self.store, registry=registry)
        self.committer.start()
        runtime = Runtime(cfg, self.store, self.committer, registry)
        self.stage: Any
        if candidate == "ferry":
            from agent.ingest.http.app import create_app
            from agent.ingest.http.server import HttpServer

            self.stage = HttpServer(runtime, create_app(runtime))
        elif candidate == "hypercorn":
            from http_candidates.hypercorn_stage import HypercornStage

            self.stage = HypercornStage(runtime)
        else:
            from http_candidates.granian_stage import GranianStage

            self.stage = GranianStage(runtime, candidate.split("-", 1)[1])
        self.stage.start()
        runtime.set_phase(Phase.RUNNING)

    def stored(self, topic: str) -> list[bytes]:
        return [m.record.value for m in self.store.read(topic, None, 1000)
                if hasattr(m, "record")]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=SLOW)

    def close(self) -> None:
        self.stage.stop(5.0)
        self.committer.close()
        self.store.close()
        self.root.cleanup()


def exchange(target: Target, request: bytes, *, half_close: bool = False) -> str:
    """Send ``request``; the status lines of what comes back before the close or SLOW s."""
    with target.connect() as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<no close within %d s>" % SLOW
        except ConnectionError as exc:
            out += f"<{type(exc).__name__}>".encode()
    statuses = [line.split(b" ", 1)[1].decode() for line in out.split(b"\r\n")
                if line.startswith(b"HTTP/1.1 ")]
    tail = out[out.rfind(b"<"):].decode() if out.endswith(b">") else ""
    return (", ".join(statuses) or "no answer") + (f" {tail}" if tail else "")


def trailer(target: Target) -> str:
    """A chunked publish whose trailer section never ends: bytes sent before an answer."""
    head = (b"POST /topics/trailer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Trailer: ")
    sent = 0
    with target.connect() as sock:
        sock.sendall(head)
        try:
            while sent < 16 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
                if select.select([sock], [], [], 0.01)[0]:
                    break
            first = sock.recv(200).split(b"\r\n")[0].decode() or "closed"
        except (TimeoutError, ConnectionError) as exc:
            first = type(exc).__name__
    return f"{first} after {sent // 1024} KiB of trailer"


def never_reads(target: Target) -> str:
    """Pipelined requests whose answers are never read: is the connection ever closed?
    Probes, not publishes: answering them costs no commit, so the answers pile up at once
    and what is left to see is whether the server ever gives up on the client."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", target.port))
    sock.settimeout(2.0)
    sent = 0
    try:
        for _ in range(2000):
            sock.sendall(b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
            sent += 50
    except (TimeoutError, ConnectionError):
        pass
    began = time.monotonic()
    while time.monotonic() - began < 60 and _server_side_open(target.port):
        time.sleep(0.5)
    held = _server_side_open(target.port)
    sock.close()
    waited = time.monotonic() - began
    return (f"still open after {waited:.0f} s" if held else f"closed after {waited:.0f} s") \
        + f" ({sent} requests sent before the server stopped reading)"


def _server_side_open(port: int) -> int:
    """Established connections whose local port is ``port`` (the server's side)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            count += 1
    return count


def cases() -> list[tuple[str, str, str, Callable[[Target], str]]]:
    """(case, expected, topic whose stored values are shown, run)."""
    def send(request: bytes, **kw: Any) -> Callable[[Target], str]:
        return lambda t: exchange(t, request, **kw)

    return [
        ("A Upgrade: h2c on a publish", "2xx, body stored (never 101)", "up",
         send(publish("up", b"hello", *H2C))),
        ("B publish then FIN", "2xx, stored", "fin",
         send(publish("fin", b"x"), half_close=True)),
        ("C client never reads answers", "closed by a write deadline (10 s)", "",
         never_reads),
        ("E endless trailer section", "431 within the header limit", "trailer", trailer),
        ("F gzip(a) + gzip(b)", "2xx, 'ab' stored", "gz",
         send(publish("gz", gzip.compress(b"a") + gzip.compress(b"b"),
                      b"Content-Encoding: gzip"))),
        ("no Host (HTTP/1.1)", "400, nothing stored", "h0",
         send(publish("h0", b"x", host=False))),
        ("two Host headers", "400, nothing stored", "h2",
         send(publish("h2", b"x", b"Host: y"))),
        ("TE: identity, chunked", "refused, nothing stored", "te",
         send(b"POST /topics/te HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity, chunked"
              b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")),
        ("HTTP/2.0 request line", "refused, nothing stored", "v2",
         send(publish("v2", b"x", version=b"2.0"))),
        ("Content-Length 1000001, no body", "413 at once", "",
         send(b"POST /topics/cl HTTP/1.1\r\nHost: x\r\nContent-Length: 1000001\r\n\r\n")),
        ("64 KiB header", "431", "",
         send(b"GET /status/ping HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 65536 + b"\r\n\r\n")),
        ("headers that never end", "closed at the header deadline (3 s)", "",
         send(b"GET /status/ping HTTP/1.1\r\nHost: x\r\n")),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", default="ferry,granian-rsgi,granian-asgi,hypercorn")
    args = ap.parse_args()
    for candidate in args.candidates.split(","):
        target = Target(candidate)
        try:
            print(f"\n== {candidate}")
            print(f"{'case':34} {'expected':38} {'seconds':>7}  answer; stored")
            for name, expected, topic, run in cases():
                began = time.monotonic()
                answer = run(target)
                took = time.monotonic() - began
                stored = f"; stored {target.stored(topic)!r}" if topic else ""
                print(f"{name:34} {expected:38} {took:7.1f}  {answer}{stored}", flush=True)
        finally:
            target.close()


if __name__ == "__main__":
    main()
