"""tls_stream.py's handshake threads (``Handshakes``): each TLS handshake step runs off the
HTTP event loop, at most ``THREADS`` at once; the connections waiting for a thread keep their
deadline and the connection cap; the bytes and the FIN that come while a step runs follow it
in order.

``_step`` is wrapped to see which thread ran each step and to hold steps where a test wants
the handshake threads busy: the real step runs inside, on the real server, with real TLS
clients on loopback sockets.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from agent.ingest.http import tls_stream
from agent.ingest.http.protocol import HttpProtocol
from tests.certificates import CertificateAuthority
from tests.http import raw, streams
from tests.http.harness import Served
from tests.waiting import wait_until

WAIT = 30.0


class Steps:
    """Every handshake step: the thread that ran it; steps from ``hold_from`` on (in the
    order they began) wait for ``release()``."""

    def __init__(self, step: Callable[[ssl.SSLObject], tls_stream.Outcome]) -> None:
        self.step = step
        self.lock = threading.Lock()
        self.threads: list[str] = []
        self.running = 0
        self.most = 0  # steps running at once, at most
        self.hold_from: int | None = None
        self.gate = threading.Event()

    def hold(self, start: int = 0) -> None:
        self.hold_from = start

    def release(self) -> None:
        self.gate.set()

    def __call__(self, tls: ssl.SSLObject) -> tls_stream.Outcome:
        with self.lock:
            number = len(self.threads)
            self.threads.append(threading.current_thread().name)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if self.hold_from is not None and number >= self.hold_from:
                assert self.gate.wait(WAIT), "a held step never released"
            return self.step(tls)
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[Steps]:
    wrapped = Steps(tls_stream._step)  # noqa: SLF001 - the step itself, watched
    monkeypatch.setattr(tls_stream, "_step", wrapped)
    yield wrapped
    wrapped.release()  # a failed test must not leave a handshake thread waiting


@dataclass(frozen=True)
class Pki:
    settings: dict[str, object]
    client: ssl.SSLContext


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = CertificateAuthority(tmp_path_factory.mktemp("pki"))
    cert = ca.issue("server", server=True)
    return Pki({"tls_listen": "127.0.0.1:0", "tls_cert_file": str(cert.cert),
                "tls_key_file": str(cert.key)},
               ssl.create_default_context(cafile=str(ca.cert)))


def _handshakes(served: Served) -> tls_stream.Handshakes:
    return served.server._handshakes  # noqa: SLF001 - the server's handshake threads


class Hello:
    """A TLS client that goes a step at a time: its ClientHello is sent when it is made."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        with contextlib.suppress(ssl.SSLWantReadError):
            self.tls.do_handshake()
        self.sock.sendall(self.outgoing.read())

    def finish(self) -> None:
        """Read the server's flight and answer it: the client's side of the handshake is
        over, its Finished sent."""
        while True:
            data = self.sock.recv(65536)
            assert data, "the server closed during the handshake"
            self.incoming.write(data)
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                continue
        self.sock.sendall(self.outgoing.read())

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self.sock.sendall(self.outgoing.read())

    def read_until_closed(self) -> bytes:
        got = b""
        while True:
            try:
                data = self.tls.read(65536)
                if not data:  # the server's close_notify
                    return got
                got += data
                continue
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:  # the same, as some versions say it
                return got
            data = self.sock.recv(65536)
            if not data:
                return got
            self.incoming.write(data)

    def closed_by_server(self) -> bool:
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        try:
            return self.sock.recv(65536) == b""
        except ConnectionResetError:
            return True


def _exchange(wire: streams.TlsWire, request: bytes) -> int:
    """``request`` sent, its answer read; the answer's status."""
    wire.send(request)
    got = b""
    while not streams.split(got):
        chunk = wire.recv()
        assert chunk is not None, f"closed before an answer: {got!r}"
        got += chunk
    return raw.status(streams.split(got)[0])


def _publish_over_tls(served: Served, context: ssl.SSLContext, body: bytes) -> int:
    """A publish over a new HTTPS connection; its answer's status."""
    with socket.create_connection(("127.0.0.1", served.server.tls_port), timeout=WAIT) as sock:
        return _exchange(streams.TlsWire(sock, context, close_notify=True),
                         raw.publish("tls", body))


@pytest.mark.parametrize("threads", [1, 0])
def test_handshake_steps_run_in_the_handshake_threads_or_on_the_loop_with_none(
    serve: Callable[..., Served], pki: Pki, steps: Steps, monkeypatch: pytest.MonkeyPatch,
    threads: int
) -> None:
    monkeypatch.setattr(tls_stream, "THREADS", threads)
    served = serve(http=pki.settings)
    assert _publish_over_tls(served, pki.client, b"one") == 202
    assert _publish_over_tls(served, pki.client, b"two") == 202
    assert [m.record.value for m in served.messages("tls")] == [b"one", b"two"]
    assert len(steps.threads) >= 4  # two a handshake at least (TLS 1.3)
    if threads:
        assert all(name.startswith("tls-handshake") for name in steps.threads), steps.threads
    else:
        assert set(steps.threads) == {"http-server"}, steps.threads


def test_handshakes_beyond_the_threads_wait_their_turn_while_the_loop_serves_everyone(
    serve: Callable[..., Served], pki: Pki, steps: Steps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One handshake thread, its step held: five more handshakes wait on the loop (nothing
    more is handed to the executor, no thread is added), and meanwhile a plain publish and
    one over an HTTPS connection made before are answered. Released, every waiting
    handshake runs in turn and its publish is answered."""
    monkeypatch.setattr(tls_stream, "THREADS", 1)
    served = serve(http=pki.settings)
    with socket.create_connection(("127.0.0.1", served.server.tls_port),
                                  timeout=WAIT) as established_sock:
        established = streams.TlsWire(established_sock, pki.client, close_notify=True)
        assert _exchange(established, raw.publish("tls", b"before")) == 202  # handshake over
        steps.hold(len(steps.threads))
        flood = [Hello(served.server.tls_port, pki.client) for _ in range(6)]
        try:
            wait_until(lambda: steps.running == 1 and _handshakes(served).waiting == 5,
                       timeout=WAIT, message="one step running, five handshakes waiting")
            assert served.client.post("/topics/tls", content=b"plain").status_code == 202
            assert _exchange(established, raw.publish("tls", b"established")) == 202
            assert steps.most == 1 and steps.running == 1
            assert _handshakes(served).waiting == 5
            assert sum(t.name.startswith("tls-handshake") for t in threading.enumerate()) == 1
            steps.release()
            for n, client in enumerate(flood):
                client.finish()
                client.send(raw.publish("tls", b"flood %d" % n)
                            + b"GET /status/ping HTTP/1.1\r\nHost: x\r\nConnection: close"
                              b"\r\n\r\n")
            for client in flood:
                answers = raw.split_answers(client.read_until_closed())
                assert [raw.status(a) for a in answers] == [202, 200]
        finally:
            for client in flood:
                client.sock.close()
    assert steps.most == 1
    assert _handshakes(served).waiting == 0
    assert sorted(m.record.value for m in served.messages("tls")) == sorted(
        [b"before", b"plain", b"established", *(b"flood %d" % n for n in range(6))])


def test_a_handshake_waiting_for_a_thread_is_closed_at_its_deadline_and_forgotten(
    serve: Callable[..., Served], pki: Pki, steps: Steps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header deadline closes a handshake whether its step runs or waits for a thread:
    the waiting one leaves the queue and never runs, the running one's outcome is dropped
    when it comes, and the next client is served."""
    monkeypatch.setattr(tls_stream, "THREADS", 1)
    served = serve(http={**pki.settings, "header_timeout_seconds": 0.5})
    steps.hold()
    running, waiting = (Hello(served.server.tls_port, pki.client) for _ in range(2))
    try:
        wait_until(lambda: steps.running == 1 and _handshakes(served).waiting == 1,
                   timeout=WAIT, message="one step running, one handshake waiting")
        wait_until(lambda: running.closed_by_server() and waiting.closed_by_server(),
                   timeout=WAIT, message="both closed at the header deadline")
        assert _handshakes(served).waiting == 0
        wait_until(lambda: not served.server.connections.open, timeout=WAIT,
                   message="both connections gone")
        steps.release()
        wait_until(lambda: steps.running == 0, timeout=WAIT, message="the held step over")
        assert len(steps.threads) == 1, "the closed waiting handshake was stepped"
    finally:
        running.sock.close()
        waiting.sock.close()
    assert _publish_over_tls(served, pki.client, b"next") == 202
    assert [m.record.value for m in served.messages("tls")] == [b"next"]


def test_a_request_and_a_fin_that_come_during_the_last_step_are_answered_after_it(
    serve: Callable[..., Served], pki: Pki, steps: Steps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's Finished starts the handshake's last step in a thread; its request and
    its FIN (no close_notify) come while that step runs. They wait for it, go to the TLS
    layer in order, and the request is answered before the close, as when the step ran on
    the loop (the FIN then came after the handshake's end)."""
    monkeypatch.setattr(tls_stream, "THREADS", 1)
    served = serve(http=pki.settings)
    client = Hello(served.server.tls_port, pki.client)
    try:
        wait_until(lambda: len(steps.threads) == 1 and steps.running == 0, timeout=WAIT,
                   message="the ClientHello's step over")
        steps.hold(1)
        client.finish()
        wait_until(lambda: steps.running == 1, timeout=WAIT,
                   message="the client's Finished in a held step")
        client.send(raw.publish("tls", b"during the step"))
        client.sock.shutdown(socket.SHUT_WR)
        conn: HttpProtocol = next(iter(served.server.connections.open))
        assert conn.tcp is not None
        stream = conn.tcp.get_protocol()
        assert isinstance(stream, tls_stream.TlsStream)
        wait_until(lambda: stream._early and stream._tcp_eof,  # noqa: SLF001
                   timeout=WAIT, message="the request and the FIN held for the step")
        steps.release()
        answers = raw.split_answers(client.read_until_closed())
    finally:
        client.sock.close()
    assert [raw.status(a) for a in answers] == [202]
    assert [m.record.value for m in served.messages("tls")] == [b"during the step"]


@pytest.mark.parametrize("how", ["rst", "fin"])
def test_a_client_gone_during_a_step_is_not_served(
    serve: Callable[..., Served], pki: Pki, steps: Steps, monkeypatch: pytest.MonkeyPatch,
    how: str
) -> None:
    """A client that hangs up while its handshake's first step runs. A reset ends the
    connection at once, the step's outcome dropped when it comes; a FIN is held for the
    step (a request sent with the handshake's last flight is answered, the test above), and
    ends the unfinished handshake as soon as the step is over, not at the deadline (20 s
    here). Neither is counted as a TLS failure."""
    monkeypatch.setattr(tls_stream, "THREADS", 1)
    served = serve(http={**pki.settings, "header_timeout_seconds": 20.0})
    steps.hold()
    client = Hello(served.server.tls_port, pki.client)
    wait_until(lambda: steps.running == 1, timeout=WAIT, message="the step held")
    if how == "rst":
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sock.close()
        wait_until(lambda: not served.server.connections.open, timeout=5.0,
                   message="the connection gone while its step runs")
        steps.release()
    else:
        client.sock.shutdown(socket.SHUT_WR)
        conn: HttpProtocol = next(iter(served.server.connections.open))
        assert conn.tcp is not None
        stream = conn.tcp.get_protocol()
        assert isinstance(stream, tls_stream.TlsStream)
        wait_until(lambda: stream._tcp_eof, timeout=WAIT,  # noqa: SLF001
                   message="the FIN held for the step")
        steps.release()
        wait_until(lambda: not served.server.connections.open, timeout=5.0,
                   message="the connection gone once its step is over")
        client.sock.close()
    wait_until(lambda: steps.running == 0, timeout=WAIT, message="the held step over")
    assert _publish_over_tls(served, pki.client, b"after") == 202
    assert served.counter("http_connections_closed", reason="tls_handshake") == 0
