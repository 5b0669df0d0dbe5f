"""Issue #37 item 2: resource bounds of the HTTP front door on random streams, per seed.

Each seed draws a few connections of adversarial-but-plausible requests (tests/http/streams.py:
chunked bodies in chunks of 1 byte to 16 KiB with extensions, trailers naming request
headers, gzip bodies of several members, some empty, pipelining, bodies over the limit, a
management token only in a trailer, heads past the header and request-line limits or
malformed, slow senders, and a client that closes, resets at a random byte, stalls or stops
reading), played against the in-process server over plain TCP or over HTTPS (the same
bytes through tls_stream.py), one connection at a time, each held to its own bounds:

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
  costliest framing), per request and per connection; over TLS also per record and per TLS
  connection (its handshake's CPU is a handshake thread's, not the loop's);
- descriptors: the server's socket of the connection is released, whoever closes, within
  the connection's longest deadline (header, body, keep-alive, linger) plus the write
  deadline, plus slack for a loaded host;
- trailers never headers: answers as the headers and body call for (a head past the limits
  431 or 414, a malformed one 400, each closing the connection), stored messages with the
  key and Kafka headers the *headers* said (never a trailer's), nothing stored of a refused
  request, no topic created by a token in a trailer (401).

And all connections of a seed at once, half of them over TLS: the same bounds over all of
them together (the body budget's peak under the sum of their bounds, CPU under the sum of
theirs, every socket released within the deadline of the last client's last action).

The fixed seeds run every time; one more comes from ``FERRY_HTTP_SEED`` or the clock, and is
in the tests' ids and every failure message: ``FERRY_HTTP_SEED=<n> pytest
tests/http/test_resource_bounds.py -k random`` replays it (any seed, a fixed one too).
"""

from __future__ import annotations

import gc
import os
import resource
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.ingest.http import protocol
from agent.ingest.http.budget import BodyBudget
from agent.ingest.http.protocol import HttpProtocol, Request
from agent.ingest.http.server import HttpServer
from tests.certificates import CertificateAuthority
from tests.http import raw, streams
from tests.http.harness import Served, make_config, start
from tests.waiting import wait_until

# Each fixed seed runs one way, so that the file stays short (a few seconds a seed, most of
# it waiting for deadlines); the seed from the clock runs one at a time (over HTTP or HTTPS
# as it is even or odd) and all at once.
PLAIN_SEEDS = (1, 2)
TLS_SEEDS = (3, 5)
TOGETHER_SEEDS = (13, 21)
RANDOM_SEED = int(os.environ.get("FERRY_HTTP_SEED") or time.time_ns() % 1_000_000_007)
TOGETHER = 6  # connections of a seed played at once
PROFILE = streams.Profile()
LIMIT = max(PROFILE.batch_bytes, PROFILE.message_bytes)  # the largest body limit
HEADER_TIMEOUT = BODY_TIMEOUT = 1.5
KEEP_ALIVE = 0.3
WRITE_TIMEOUT = 0.5
POLL = 0.01  # seconds between looks at the sockets and the budget
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


def _replay(seed: int) -> str:
    return (f"(replay: FERRY_HTTP_SEED={seed} pytest tests/http/test_resource_bounds.py "
            "-k random)")


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


@dataclass(frozen=True)
class Pki:
    """The server's certificate, and a client context that trusts it."""

    cert: Path
    key: Path
    client: ssl.SSLContext


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = CertificateAuthority(tmp_path_factory.mktemp("pki"))
    issued = ca.issue("server", server=True)
    return Pki(issued.cert, issued.key, ssl.create_default_context(cafile=str(ca.cert)))


def _serve(root: Path, pki: Pki) -> tuple[Served, PeakBudget]:
    config = make_config(
        root,
        http={"management_token": streams.TOKEN, "header_allowlist": [streams.TRACE],
              "max_batch_bytes": PROFILE.batch_bytes,
              "max_header_bytes": PROFILE.header_bytes, "max_headers": PROFILE.headers,
              "max_request_line_bytes": PROFILE.request_line,
              "header_timeout_seconds": HEADER_TIMEOUT, "body_timeout_seconds": BODY_TIMEOUT,
              "keep_alive_seconds": KEEP_ALIVE, "write_timeout_seconds": WRITE_TIMEOUT,
              "tls_listen": "127.0.0.1:0", "tls_cert_file": str(pki.cert),
              "tls_key_file": str(pki.key)},
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


def _descriptors(served: Served) -> int:
    """The server's sockets of connections, on either listener."""
    return (raw.server_descriptors(served.server.port)
            + raw.server_descriptors(served.server.tls_port))


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
    """CPU seconds of the loop thread per wire byte, per request and per connection, and
    over TLS per record and per connection, measured on small inputs (the least of a few
    tries: a quiet moment's figure)."""

    def __init__(self, per_byte: float, per_request: float, per_connection: float,
                 per_record: float, per_tls_connection: float) -> None:
        self.per_byte = per_byte
        self.per_request = per_request
        self.per_connection = per_connection
        self.per_record = per_record
        self.per_tls_connection = per_tls_connection

    def bound(self, size: int, requests: int, records: int = 0, tls: bool = False) -> float:
        connection = self.per_tls_connection if tls else self.per_connection
        return CPU_FACTOR * (self.per_byte * size + self.per_request * requests
                             + self.per_record * records + connection) + CPU_FLOOR

    def __repr__(self) -> str:
        return (f"{self.per_byte * 1e9:.0f} ns/byte, {self.per_request * 1e6:.0f} µs/request, "
                f"{self.per_connection * 1e6:.0f} µs/connection, "
                f"{self.per_record * 1e6:.1f} µs/TLS record, "
                f"{self.per_tls_connection * 1e6:.0f} µs/TLS connection")


def _measure(served: Served, cpu: Callable[[], float], data: bytes, answers: int,
             tls: ssl.SSLContext | None = None, record: int = streams.TLS_RECORD) -> float:
    before = cpu()
    if tls is None:
        with raw.connect(served) as sock:
            sock.sendall(data)
            if answers:
                raw.read_answers(sock, answers)
    else:
        with socket.create_connection(("127.0.0.1", served.server.tls_port),
                                      timeout=raw.TIMEOUT) as sock:
            wire = streams.TlsWire(sock, tls, close_notify=True)
            if data:
                wire.send(data, record)
            got = b""
            while len(streams.split(got)) < answers:
                chunk = wire.recv()
                assert chunk is not None, f"closed after {streams.split(got)}"
                got += chunk
    wait_until(lambda: _descriptors(served) == 0, timeout=30.0, interval=POLL,
               message="the baseline's connection released")
    return cpu() - before


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory, pki: Pki
            ) -> Iterator[tuple[Served, PeakBudget]]:
    """One server for the module: each seed's connections have topics of their own."""
    served, budget = _serve(tmp_path_factory.mktemp("bounds"), pki)
    yield served, budget
    served.stop()


@pytest.fixture(scope="module")
def baseline(bounded: tuple[Served, PeakBudget], pki: Pki) -> Baseline:
    """Per byte: a body of 2,048 one-byte chunks less a one-byte publish, over the bytes
    between them (small enough that a cost per byte that grows with the body barely shows
    in it); per request: 20 pings and 20 small publishes pipelined; per connection: one
    opened and closed. Over TLS, per record: a 2,048-byte publish in 1-byte records less
    the same in one record, over the records between them; per connection: one opened,
    its handshake done, and closed. The least of five tries each."""
    served = bounded[0]
    cpu = _loop_cpu(served)
    chunked = (b"POST /topics/base HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
               b"\r\n\r\n" + b"1\r\nx\r\n" * 2048 + b"0\r\n\r\n")
    small = raw.publish("base", b"x")
    pings = streams.PING * 20
    publishes = raw.publish("base", b"v") * 20
    body = raw.publish("base", b"r" * 2048)
    _measure(served, cpu, pings + publishes, 40)  # warm up
    _measure(served, cpu, body, 1, pki.client)
    per_byte, per_request, per_connection, per_record, per_tls = [], [], [], [], []
    for _ in range(5):
        per_connection.append(_measure(served, cpu, b"", 0))
        per_request.append(_measure(served, cpu, pings + publishes, 40) / 40)
        one = _measure(served, cpu, small, 1)
        per_byte.append((_measure(served, cpu, chunked, 1) - one)
                        / (len(chunked) - len(small)))
        per_tls.append(_measure(served, cpu, b"", 0, pki.client))
        whole = _measure(served, cpu, body, 1, pki.client)
        per_record.append((_measure(served, cpu, body, 1, pki.client, 1) - whole)
                          / (len(body) - 1))
    return Baseline(max(min(per_byte), 1e-9), min(per_request), min(per_connection),
                    max(min(per_record), 1e-9), min(per_tls))


def _live_bodies() -> int:
    return sum(obj.size for obj in gc.get_objects() if type(obj) is Request and obj.parts)


def _stored(served: Served, stream: streams.Stream) -> streams.Stored:
    return [(m.record.key, m.record.value, [(n, bytes(v)) for n, v in m.record.headers or ()],
             m.record.partition_key) for m in served.messages(stream.topic)]


def _judge(served: Served, stream: streams.Stream, played: streams.Played, where: str) -> None:
    verdict = streams.judge(stream, played, _stored(served, stream), lambda name: served.client.get(
        f"/topics/{name}").status_code != 404)
    assert not verdict.all(), f"{where}:\n" + "\n".join(verdict.all())


def _afterwards(seed: int, rss_before: int) -> None:
    """After a seed: no request's body left in memory, the process's RSS within bounds."""
    gc.collect()
    left = _live_bodies()
    assert left == 0, f"{left} body bytes still in memory after seed {seed} {_replay(seed)}"
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert growth < RSS_GROWTH, (
        f"the process's peak RSS grew by {growth} bytes, over {RSS_GROWTH} {_replay(seed)}")


def _cases() -> list[tuple[int, bool]]:
    return [*((s, False) for s in PLAIN_SEEDS), *((s, True) for s in TLS_SEEDS),
            (RANDOM_SEED, RANDOM_SEED % 2 == 1)]


def _case_id(case: tuple[int, bool]) -> str:
    seed, tls = case
    name = f"seed={seed}" if case[0] != RANDOM_SEED else f"random:FERRY_HTTP_SEED={seed}"
    return f"{name}-{'https' if tls else 'http'}"


@pytest.mark.parametrize("case", _cases(), ids=[_case_id(c) for c in _cases()])
def test_every_connection_of_a_seed_stays_within_its_bounds(
    case: tuple[int, bool], baseline: Baseline, pki: Pki,
    bounded: tuple[Served, PeakBudget]
) -> None:
    seed, tls = case
    print(f"FERRY_HTTP_SEED={seed} over {'HTTPS' if tls else 'HTTP'}; "
          f"CPU baseline {baseline!r}")
    served, budget = bounded
    cpu = _loop_cpu(served)
    port = served.server.tls_port if tls else served.server.port
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for stream in streams.streams(seed, PROFILE, extras=True, prefix="s" if tls else "p"):
        where = f"seed {seed}, {stream.describe()}{' over TLS' if tls else ''} " \
                f"{_replay(seed)}"
        budget.peak = budget.held
        cpu_before = cpu()
        began = time.monotonic()
        connected = _small_send_buffer(served) if stream.ending == "unread" else None
        played = streams.play(stream, served.server.host, port, connected=connected,
                              tls=pki.client if tls else None)
        try:
            wait_until(lambda: _descriptors(served) == 0, timeout=RELEASE, interval=POLL,
                       message=f"the server's socket released within {RELEASE:g} s of "
                       f"the client's last action: {where}")
        finally:
            if played.sock is not None:
                played.sock.close()
        released = time.monotonic() - played.ended
        wait_until(lambda: budget.held == 0, timeout=10.0, interval=POLL,
                   message=f"the body budget given back ({budget.held} held): {where}")
        spent = cpu() - cpu_before
        size = played.sent + sum(r.decoded for r in stream.whole())
        requests = len(stream.requests)
        allowed = baseline.bound(size, requests, played.records, tls)
        print(f"  {stream.describe()}: {size} B, held at most {budget.peak} B, "
              f"CPU {spent * 1000:.1f} ms ({spent / allowed:.0%} of its bound), "
              f"released {released:.2f} s after; {time.monotonic() - began:.2f} s in all")
        assert budget.peak <= HELD, (
            f"{budget.peak} body bytes held at once, over {HELD}: {where}")
        assert spent <= allowed, (
            f"{spent:.3f} s of CPU for {size} bytes, {requests} requests and "
            f"{played.records} TLS records, over {allowed:.3f} s ({CPU_FACTOR:g} × "
            f"baseline {baseline!r}): {where}")
        _judge(served, stream, played, where)
    _afterwards(seed, rss_before)


@pytest.mark.parametrize("seed", [*TOGETHER_SEEDS, RANDOM_SEED],
                         ids=[*(f"seed={s}" for s in TOGETHER_SEEDS),
                              f"random:FERRY_HTTP_SEED={RANDOM_SEED}"])
def test_the_connections_of_a_seed_at_once_stay_within_their_bounds_together(
    seed: int, baseline: Baseline, pki: Pki, bounded: tuple[Served, PeakBudget]
) -> None:
    """All connections of the seed at once, the odd ones over TLS: the body budget's peak
    under the sum of what each may hold, the loop's CPU under the sum of their bounds,
    every socket released within the deadline of the last client's last action."""
    print(f"FERRY_HTTP_SEED={seed}, {TOGETHER} connections at once; CPU baseline "
          f"{baseline!r}")
    served, budget = bounded
    cpu = _loop_cpu(served)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    drawn = streams.streams(seed, PROFILE, TOGETHER, extras=True, prefix="t")
    played: dict[int, streams.Played] = {}
    failed: list[BaseException] = []

    def client(stream: streams.Stream) -> None:
        tls = stream.index % 2 == 1
        try:
            played[stream.index] = streams.play(
                stream, served.server.host,
                served.server.tls_port if tls else served.server.port,
                connected=_small_send_buffer(served) if stream.ending == "unread" else None,
                tls=pki.client if tls else None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failed.append(exc)

    budget.peak = budget.held
    cpu_before = cpu()
    clients = [threading.Thread(target=client, args=(s,), daemon=True) for s in drawn]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(60.0)
    where = f"seed {seed}, {TOGETHER} connections at once {_replay(seed)}"
    try:
        assert not any(t.is_alive() for t in clients), f"a client still playing: {where}"
        assert not failed, f"a client failed: {failed[0]!r}: {where}"
        last = max(p.ended for p in played.values())
        wait_until(lambda: _descriptors(served) == 0, interval=POLL,
                   timeout=max(0.1, last + RELEASE - time.monotonic()),
                   message=f"every server socket released within {RELEASE:g} s of the "
                   f"last client's last action: {where}")
    finally:
        for p in played.values():
            if p.sock is not None:
                p.sock.close()
    wait_until(lambda: budget.held == 0, timeout=10.0, interval=POLL,
               message=f"the body budget given back ({budget.held} held): {where}")
    spent = cpu() - cpu_before
    allowed = sum(baseline.bound(played[s.index].sent + sum(r.decoded for r in s.whole()),
                                 len(s.requests), played[s.index].records,
                                 s.index % 2 == 1) for s in drawn)
    print(f"  held at most {budget.peak} B, CPU {spent * 1000:.1f} ms "
          f"({spent / allowed:.0%} of the bound)")
    for stream in drawn:
        print(f"  {stream.describe()}")
    assert budget.peak <= TOGETHER * HELD, (
        f"{budget.peak} body bytes held at once, over {TOGETHER} × {HELD}: {where}")
    assert spent <= allowed, (
        f"{spent:.3f} s of CPU, over {allowed:.3f} s ({CPU_FACTOR:g} × baseline "
        f"{baseline!r}, summed over the connections): {where}")
    for stream in drawn:
        _judge(served, stream, played[stream.index], f"{where}, {stream.describe()}")
    _afterwards(seed, rss_before)
