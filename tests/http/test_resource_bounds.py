"""Issue #37 item 2: resource bounds of the HTTP front door on random streams, per seed.

Each seed draws a few connections of adversarial-but-plausible requests (tests/http/streams.py:
chunked bodies in chunks of 1 byte to 16 KiB with extensions, trailers naming request
headers, gzip bodies of several members, some empty, pipelining, bodies over the limit, a
management token only in a trailer, and a client that closes, resets at a random byte or
stops reading). They are played one connection at a time against the in-process server,
and for each:

- memory: the body bytes the server holds at once (its body budget, budget.py, which counts
  every body byte read, queued or decoded, on the loop's own thread: exact, and blind to
  what else a loaded host or this process does, where RSS is neither) peak under
  ``MAX_QUEUED_BYTES`` plus four times the body limit (the queue, the body being answered
  and its gzip decoding, the one being parsed), and are all given back once the connection
  goes; after the seed no request's body is left in memory, and the process's peak RSS grew
  by less than a constant plus a multiple of the limit;
- CPU linear in bytes: the server loop thread's CPU time (its own clock, not wall time, so
  load on the host does not count) stays under a generous factor times a baseline measured
  on small inputs at the module's start: per wire byte of a body in 1-byte chunks (the
  costliest framing), per request and per connection;
- descriptors: the server's socket of the connection is released, whoever closes, within
  the connection's longest deadline (header, body, keep-alive, linger) plus the write
  deadline, plus slack for a loaded host;
- trailers never headers: answers as the headers and body call for, stored messages with
  the key and Kafka headers the *headers* said (never a trailer's), no topic created by a
  token in a trailer (401).

The fixed seeds run every time; one more comes from ``FERRY_HTTP_SEED`` or the clock, and is
in the test's id and every failure message: ``FERRY_HTTP_SEED=<n> pytest
tests/http/test_resource_bounds.py -k random`` replays it (any seed, a fixed one too).
"""

from __future__ import annotations

import gc
import os
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.ingest.http import protocol
from agent.ingest.http.budget import BodyBudget
from agent.ingest.http.protocol import HttpProtocol, Request
from agent.ingest.http.server import HttpServer
from tests.http import raw, streams
from tests.http.harness import Served, make_config, start
from tests.waiting import wait_until

FIXED_SEEDS = (1, 2, 3, 5, 8, 13, 21)
RANDOM_SEED = int(os.environ.get("FERRY_HTTP_SEED") or time.time_ns() % 1_000_000_007)
PROFILE = streams.Profile()
LIMIT = max(PROFILE.batch_bytes, PROFILE.message_bytes)  # the largest body limit
HEADER_TIMEOUT = BODY_TIMEOUT = 2.0
KEEP_ALIVE = 0.5
WRITE_TIMEOUT = 1.0
# The longest a server socket may outlive the client's last action: the connection's
# longest deadline, then the write deadline for what it could not send; plus slack.
SLACK = 10.0
RELEASE = max(HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, protocol.LINGER_SECONDS) \
    + WRITE_TIMEOUT + SLACK
# Memory: what one connection may hold of bodies (protocol.py's queue bound, the body being
# answered with its decoded copy, the one being parsed), and the process's RSS growth.
HELD = protocol.MAX_QUEUED_BYTES + 4 * LIMIT
RSS_GROWTH = 64 * 1024 * 1024 + 16 * LIMIT
# CPU: the bound is this factor times the baseline, plus a floor for a GC pause or two.
CPU_FACTOR = 5.0
CPU_FLOOR = 0.1


class PeakBudget(BodyBudget):
    """The server's body budget, keeping its peak."""

    __slots__ = ("peak",)

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.peak = 0

    def take(self, size: int) -> bool:
        if not super().take(size):
            return False
        if self.held > self.peak:
            self.peak = self.held
        return True


def _serve(root: Path) -> tuple[Served, PeakBudget]:
    config = make_config(
        root,
        http={"management_token": streams.TOKEN, "header_allowlist": [streams.TRACE],
              "max_batch_bytes": PROFILE.batch_bytes,
              "max_header_bytes": PROFILE.header_bytes, "max_headers": PROFILE.headers,
              "header_timeout_seconds": HEADER_TIMEOUT, "body_timeout_seconds": BODY_TIMEOUT,
              "keep_alive_seconds": KEEP_ALIVE, "write_timeout_seconds": WRITE_TIMEOUT},
        topics={"default": {"ack_timeout_ms": 0, "max_message_bytes": PROFILE.message_bytes}})
    budgets: list[PeakBudget] = []

    def prepare(server: HttpServer) -> None:
        budgets.append(PeakBudget(server.budget.limit))
        server.budget = budgets[0]

    return start(config, prepare=prepare), budgets[0]


def _loop_cpu(served: Served) -> Callable[[], float]:
    """The CPU seconds of the server's event-loop thread so far."""
    thread = served.server._thread  # noqa: SLF001 - its CPU clock is what is measured
    assert thread is not None and thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime(clock)


def _connection(served: Served, peer: tuple[str, int]) -> HttpProtocol | None:
    for conn in list(served.server.connections.open):
        if conn.transport is not None and conn.transport.get_extra_info("peername") == peer:
            return conn
    return None


def _small_send_buffer(served: Served) -> Callable[[socket.socket], None]:
    """For a client that stops reading: the server's side of it sends into a small kernel
    buffer, so its answers back up and the write deadline is what frees it."""
    def connected(sock: socket.socket) -> None:
        conn = wait_until(lambda: _connection(served, sock.getsockname()), timeout=10.0,
                          message="the server's side of the connection")
        assert conn is not None and conn.transport is not None
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                           socket.SO_SNDBUF, 4096)
    return connected


class Baseline:
    """CPU seconds of the loop thread per wire byte, per request and per connection,
    measured on small inputs (the least of a few tries: a quiet moment's figure)."""

    def __init__(self, per_byte: float, per_request: float, per_connection: float) -> None:
        self.per_byte = per_byte
        self.per_request = per_request
        self.per_connection = per_connection

    def bound(self, size: int, requests: int) -> float:
        return CPU_FACTOR * (self.per_byte * size + self.per_request * requests
                             + self.per_connection) + CPU_FLOOR

    def __repr__(self) -> str:
        return (f"{self.per_byte * 1e9:.0f} ns/byte, {self.per_request * 1e6:.0f} µs/request, "
                f"{self.per_connection * 1e6:.0f} µs/connection")


def _measure(served: Served, cpu: Callable[[], float], data: bytes, answers: int) -> float:
    before = cpu()
    port = served.server.port
    with raw.connect(served) as sock:
        sock.sendall(data)
        if answers:
            raw.read_answers(sock, answers)
    wait_until(lambda: raw.server_descriptors(port) == 0, timeout=30.0,
               message="the baseline's connection released")
    return cpu() - before


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """Per byte: a body of 2,048 one-byte chunks less a one-byte publish, over the bytes
    between them (small enough that a cost per byte that grows with the body barely shows
    in it); per request: 20 pings and 20 small publishes pipelined; per connection: one
    opened and closed. The least of five tries each."""
    served, _ = _serve(tmp_path_factory.mktemp("baseline"))
    try:
        cpu = _loop_cpu(served)
        chunked = (b"POST /topics/base HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                   b"\r\n\r\n" + b"1\r\nx\r\n" * 2048 + b"0\r\n\r\n")
        small = raw.publish("base", b"x")
        pings = streams.PING * 20
        publishes = raw.publish("base", b"v") * 20
        _measure(served, cpu, pings + publishes, 40)  # warm up
        per_byte, per_request, per_connection = [], [], []
        for _ in range(5):
            per_connection.append(_measure(served, cpu, b"", 0))
            per_request.append(_measure(served, cpu, pings + publishes, 40) / 40)
            one = _measure(served, cpu, small, 1)
            per_byte.append((_measure(served, cpu, chunked, 1) - one)
                            / (len(chunked) - len(small)))
        return Baseline(max(min(per_byte), 1e-9), min(per_request), min(per_connection))
    finally:
        served.stop()


def _live_bodies() -> int:
    return sum(obj.size for obj in gc.get_objects() if type(obj) is Request and obj.parts)


@pytest.mark.parametrize("seed", [*FIXED_SEEDS, RANDOM_SEED],
                         ids=[*(f"seed={s}" for s in FIXED_SEEDS),
                              f"random:FERRY_HTTP_SEED={RANDOM_SEED}"])
def test_every_connection_of_a_seed_stays_within_its_bounds(
    seed: int, baseline: Baseline, tmp_path: Path
) -> None:
    replay = (f"(replay: FERRY_HTTP_SEED={seed} pytest tests/http/test_resource_bounds.py "
              "-k random)")
    print(f"FERRY_HTTP_SEED={seed}; CPU baseline {baseline!r}")
    served, budget = _serve(tmp_path)
    try:
        cpu = _loop_cpu(served)
        port = served.server.port
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for stream in streams.streams(seed, PROFILE):
            where = f"seed {seed}, {stream.describe()} {replay}"
            budget.peak = budget.held
            cpu_before = cpu()
            connected = _small_send_buffer(served) if stream.ending == "unread" else None
            played = streams.play(stream, served.server.host, port, connected=connected)
            try:
                wait_until(lambda: raw.server_descriptors(port) == 0, timeout=RELEASE,
                           message=f"the server's socket released within {RELEASE:g} s of "
                           f"the client's last action: {where}")
            finally:
                if played.sock is not None:
                    played.sock.close()
            released = time.monotonic() - played.ended
            wait_until(lambda: budget.held == 0, timeout=10.0,
                       message=f"the body budget given back ({budget.held} held): {where}")
            spent = cpu() - cpu_before
            size = played.sent + sum(r.decoded for r in stream.whole())
            requests = len(stream.requests)
            allowed = baseline.bound(size, requests)
            print(f"  {stream.describe()}: {size} B, held at most {budget.peak} B, "
                  f"CPU {spent * 1000:.1f} ms ({spent / allowed:.0%} of its bound), "
                  f"released {released:.2f} s after")
            assert budget.peak <= HELD, (
                f"{budget.peak} body bytes held at once, over {HELD}: {where}")
            assert spent <= allowed, (
                f"{spent:.3f} s of CPU for {size} bytes and {requests} requests, over "
                f"{allowed:.3f} s ({CPU_FACTOR:g} × baseline {baseline!r}): {where}")
            stored = [(m.record.key, m.record.value,
                       [(n, bytes(v)) for n, v in m.record.headers or ()],
                       m.record.partition_key)
                      for m in served.messages(stream.topic)]
            verdict = streams.judge(stream, played, stored, lambda name: served.client.get(
                f"/topics/{name}").status_code != 404)
            assert not verdict.all(), f"{where}:\n" + "\n".join(verdict.all())
        gc.collect()
        left = _live_bodies()
        assert left == 0, f"{left} body bytes still in memory after seed {seed} {replay}"
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        assert growth < RSS_GROWTH, (
            f"the process's peak RSS grew by {growth} bytes, over {RSS_GROWTH} {replay}")
    finally:
        served.stop()
