"""HTTPS (``http.tls_listen``): the same publish path over TLS, with optional client
certificates (mTLS), tried with curl as a client would, beside the plain listener, and
with a client on a raw socket where the test must end one side of the connection alone
(close_notify, a FIN: issue #37 N7).

Certificates are made per test by tests/certificates.py (openssl). Every case counts what
reached the buffer: a refused handshake stores nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest

from agent.buffer.committer import Committer
from agent.buffer.store import Store
from agent.config import FerryConfig
from agent.ingest.http import tls
from agent.ingest.http.server import HttpBindError, HttpServer
from agent.ingest.runtime import Runtime
from agent.metrics import Registry
from tests.certificates import CertificateAuthority, Issued
from tests.http import raw
from tests.http.harness import Served, make_config
from tests.waiting import wait_until

WAIT = 30.0


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "pki")


@pytest.fixture
def server_cert(ca: CertificateAuthority) -> Issued:
    return ca.issue("server", server=True)


def _tls(ca: CertificateAuthority, cert: Issued, mtls: bool = False) -> dict[str, object]:
    settings: dict[str, object] = {"tls_listen": "127.0.0.1:0", "tls_cert_file": str(cert.cert),
                                   "tls_key_file": str(cert.key)}
    if mtls:
        settings["tls_client_ca_file"] = str(ca.cert)
    return settings


def _curl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["curl", "-sS", "--max-time", "20", "-o", "-", "-w",
                           "\n%{http_code}", *args, url],
                          capture_output=True, text=True, timeout=60)


def _publish(served: Served, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    url = f"https://127.0.0.1:{served.server.tls_port}/topics/tls"
    return _curl(url, "-X", "POST", "--data-binary", body, *args)


def test_publishes_over_https_are_stored_and_answered_as_over_http(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    served = serve(http=_tls(ca, server_cert))
    done = _publish(served, "over tls", "--cacert", str(ca.cert))
    assert done.returncode == 0, done.stderr
    body, status = done.stdout.rsplit("\n", 1)
    assert status == "202"
    assert json.loads(body)["delivered"] is False
    # The plain listener still serves, the same buffer behind both.
    assert served.client.post("/topics/tls", content=b"over http").status_code == 202
    assert [m.record.value for m in served.messages("tls")] == [b"over tls", b"over http"]
    # The status page and the probes answer over HTTPS too.
    ready = _curl(f"https://127.0.0.1:{served.server.tls_port}/status/ready",
                  "--cacert", str(ca.cert))
    assert ready.stdout.rsplit("\n", 1)[1] == "200", ready.stderr


def _closed(served: Served) -> float:
    return served.counter("http_connections_closed", reason="tls_handshake")


def _said(caplog: pytest.LogCaptureFixture, what: str) -> bool:
    return any(r.levelno == logging.WARNING and "HTTPS: a TLS handshake from 127.0.0.1:" in
               r.getMessage() and what in r.getMessage() for r in caplog.records)


def test_a_client_that_does_not_trust_the_server_sends_nothing(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued,
    caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(http=_tls(ca, server_cert))
    done = _publish(served, "untrusted")  # the system's CAs do not know the test CA
    assert done.returncode != 0
    assert served.messages("tls") == []
    # The client's alert failed the handshake on Ferry's side too: counted, and said.
    wait_until(lambda: _closed(served) == 1 and _said(caplog, "UNKNOWN_CA"), timeout=WAIT,
               message="the failure counted and logged")


def test_mtls_refuses_a_client_without_a_certificate_and_serves_one_with_it(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued,
    caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(http=_tls(ca, server_cert, mtls=True))
    refused = _publish(served, "no client certificate", "--cacert", str(ca.cert))
    assert refused.returncode != 0
    wait_until(lambda: _closed(served) == 1
               and _said(caplog, "PEER_DID_NOT_RETURN_A_CERTIFICATE"), timeout=WAIT,
               message="the refusal counted and logged")
    stranger = CertificateAuthority(ca.dir.parent, "another-ca").issue("intruder",
                                                                       server=False)
    refused_too = _publish(served, "a stranger's certificate", "--cacert", str(ca.cert),
                           "--cert", str(stranger.cert), "--key", str(stranger.key))
    assert refused_too.returncode != 0
    wait_until(lambda: _closed(served) == 2 and _said(caplog, "CERTIFICATE_VERIFY_FAILED"),
               timeout=WAIT, message="the refusal counted and logged")
    client = ca.issue("client", server=False)
    done = _publish(served, "with a client certificate", "--cacert", str(ca.cert),
                    "--cert", str(client.cert), "--key", str(client.key))
    assert done.returncode == 0, done.stderr
    assert done.stdout.rsplit("\n", 1)[1] == "202"
    assert [m.record.value for m in served.messages("tls")] == [b"with a client certificate"]
    assert _closed(served) == 2


def test_plain_http_on_the_https_port_stores_nothing(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued,
    caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(http=_tls(ca, server_cert))
    done = _curl(f"http://127.0.0.1:{served.server.tls_port}/topics/tls", "-X", "POST",
                 "--data-binary", "in the clear")
    assert done.returncode != 0  # no answer at all: the handshake failed on the bytes
    assert done.stdout.rsplit("\n", 1)[-1] == "000"
    assert served.messages("tls") == []
    wait_until(lambda: _closed(served) == 1 and _said(caplog, "HTTP_REQUEST"), timeout=WAIT,
               message="the failure counted and logged")


def test_a_client_that_hangs_up_or_stalls_in_the_handshake_is_not_a_tls_failure(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    """A TCP check that connects and closes (a load balancer's), or a client that never
    says hello, ends no TLS handshake with an error: nothing to count or log."""
    served = serve(http={**_tls(ca, server_cert), "header_timeout_seconds": 0.5})
    port = served.server.tls_port
    socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        assert s.recv(1024) == b""  # closed at the deadline
    wait_until(lambda: not served.server.connections.open, timeout=WAIT,
               message="both connections gone")
    assert _closed(served) == 0
    # A real failure after them is counted: the count above had its chance to move.
    _curl(f"http://127.0.0.1:{port}/")
    wait_until(lambda: _closed(served) == 1, timeout=WAIT, message="the plain request counted")


def test_a_handshake_that_never_comes_is_closed_after_the_header_timeout(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    served = serve(http={**_tls(ca, server_cert), "header_timeout_seconds": 1.0})
    with socket.create_connection(("127.0.0.1", served.server.tls_port), timeout=WAIT) as s:
        started = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server, having sent nothing
        assert 0.5 < time.monotonic() - started < 10


def test_a_key_that_does_not_load_fails_the_start_and_names_the_file(
    tmp_path: Path, ca: CertificateAuthority, server_cert: Issued
) -> None:
    broken = tmp_path / "broken.key"
    broken.write_text("not a key\n")
    config = make_config(tmp_path, http={**_tls(ca, server_cert),
                                         "tls_key_file": str(broken)})
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        committer = Committer(store)
        try:
            server = HttpServer(Runtime(config, store, committer, Registry()), object())
            with pytest.raises(HttpBindError, match="broken.key"):
                server.start()
            assert server.port == 0  # nothing was bound
        finally:
            committer.close()


def test_tls_settings_must_come_together() -> None:
    with pytest.raises(pydantic.ValidationError, match="tls_listen needs tls_cert_file"):
        FerryConfig.model_validate({"http": {"tls_listen": "127.0.0.1:9443"}})
    with pytest.raises(pydantic.ValidationError, match="tls_listen is empty"):
        FerryConfig.model_validate({"http": {"tls_cert_file": "/etc/ferry/tls.pem"}})
    with pytest.raises(pydantic.ValidationError, match="tls_listen needs listen"):
        FerryConfig.model_validate({"http": {
            "listen": "", "tls_listen": "127.0.0.1:9443", "tls_cert_file": "/c.pem",
            "tls_key_file": "/c.key"}})


def test_handshakes_in_progress_count_against_the_connection_cap(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    served = serve(http={**_tls(ca, server_cert), "max_connections": 8})
    stalled = [socket.create_connection(("127.0.0.1", served.server.tls_port), timeout=WAIT)
               for _ in range(40)]  # connect, never say hello
    try:
        done = _publish(served, "past the stalled ones", "--cacert", str(ca.cert))
        assert done.returncode == 0, done.stderr
        assert done.stdout.rsplit("\n", 1)[1] == "202"
        assert [m.record.value for m in served.messages("tls")] == [b"past the stalled ones"]
        # Each stalled handshake was admitted under the cap, and the oldest were closed to
        # make room (long before their header deadline of 10 s), not left holding descriptors.
        assert len(served.server.connections.open) <= 8

        evicted: set[socket.socket] = set()
        deadline = time.monotonic() + 5
        while len(evicted) < 40 - 8 and time.monotonic() < deadline:
            waiting = [s for s in stalled if s not in evicted]
            readable, _, _ = select.select(waiting, [], [], 0.1)
            evicted.update(s for s in readable if s.recv(1) == b"")
        assert len(evicted) >= 40 - 8
    finally:
        for s in stalled:
            s.close()



def _publish_over_bio(port: int, ca: CertificateAuthority, body: bytes) -> bytes:
    """A publish by a client that sends its ClientHello the moment it connects and its
    request with the handshake's last flight, in one write: the server finds each waiting
    when it first reads, as a busy server does. The answer's head is returned."""
    context = ssl.create_default_context(cafile=str(ca.cert))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        s.sendall(hello)
        while True:
            data = s.recv(65536)
            assert data, "the server closed during the handshake"
            incoming.write(data)
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                if outgoing.pending:
                    s.sendall(outgoing.read())
        tls.write(b"POST /topics/tls HTTP/1.1\r\nHost: ferry\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        s.sendall(outgoing.read())  # the client's Finished and the request, in one write
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = s.recv(65536)
            assert data, f"closed before an answer: {answer!r}"
            incoming.write(data)
            with contextlib.suppress(ssl.SSLWantReadError):
                answer += tls.read(65536)
        return answer.partition(b"\r\n\r\n")[0]


def test_bytes_waiting_when_the_connection_is_accepted_reach_tls(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    """uvloop starts reading a connection as its protocol's connection_made() returns, even
    if it paused reading there; a ClientHello already waiting must reach the handshake, not
    the HTTP parser (which stalled it until the headers' deadline: 10 s, then closed)."""
    served = serve(http=_tls(ca, server_cert))
    sent = [b"m%d" % i for i in range(20)]
    for body in sent:
        head = _publish_over_bio(served.server.tls_port, ca, body)
        assert head.startswith(b"HTTP/1.1 202 "), head
    assert [m.record.value for m in served.messages("tls")] == sent


def _replace(path: Path, content: Path) -> None:
    """As certificate managers write: a new file renamed over the old one."""
    part = path.with_name(path.name + ".new")
    shutil.copyfile(content, part)
    os.replace(part, path)


def test_a_renewed_certificate_serves_new_connections_without_a_restart(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tls, "CHECK_SECONDS", 0.05)
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "server.pem", live / "server.key"
    shutil.copyfile(server_cert.cert, cert)
    shutil.copyfile(server_cert.key, key)
    served = serve(http={"tls_listen": "127.0.0.1:0", "tls_cert_file": str(cert),
                         "tls_key_file": str(key)})
    assert _publish(served, "before", "--cacert", str(ca.cert)).stdout.endswith("\n202")

    renewed_ca = CertificateAuthority(tmp_path / "pki", "renewed-ca")
    renewed = renewed_ca.issue("server", server=True)
    # Half a renewal (the new key, the old certificate) does not load: the old one serves.
    _replace(key, renewed.key)
    wait_until(lambda: any(r.levelno == logging.WARNING and "do not load" in r.getMessage()
                           for r in caplog.records), timeout=WAIT,
               message="the half renewal tried and refused")
    assert _publish(served, "meanwhile", "--cacert", str(ca.cert)).stdout.endswith("\n202")

    caplog.set_level(logging.INFO, logger="agent.ingest.http.tls")
    _replace(cert, renewed.cert)
    wait_until(lambda: any("new connections use the certificate" in r.getMessage()
                           for r in caplog.records), timeout=WAIT,
               message="the renewed certificate loaded")
    done = _publish(served, "after", "--cacert", str(renewed_ca.cert))
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n202")
    assert _publish(served, "old trust", "--cacert", str(ca.cert)).returncode != 0
    assert [m.record.value for m in served.messages("tls")] == [b"before", b"meanwhile",
                                                                 b"after"]


# -- half-close: the client's close_notify or FIN ends only its sending side (#37 N7) --------

class _Client:
    """A TLS client on a raw socket (``ssl.SSLObject`` over memory BIOs), so that either end
    of its sending side can be sent alone: ``close_notify`` (``unwrap()``) with the TCP
    connection left open, or a TCP FIN (``shutdown(SHUT_WR)``) without ``close_notify``."""

    def __init__(self, port: int, ca: CertificateAuthority,
                 version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3,
                 receive_buffer: int | None = None) -> None:
        context = ssl.create_default_context(cafile=str(ca.cert))
        context.minimum_version = context.maximum_version = version
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(WAIT)
        self.sock.connect(("127.0.0.1", port))
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(65536)
                assert data, "the server closed during the handshake"
                self.incoming.write(data)
        self._flush()
        assert self.tls.version() == version.name.replace("_", ".")

    def _flush(self) -> None:
        if self.outgoing.pending:
            self.sock.sendall(self.outgoing.read())

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def close_notify(self) -> None:
        with contextlib.suppress(ssl.SSLWantReadError):  # the server's not awaited
            self.tls.unwrap()
        self._flush()

    def read_until_closed(self) -> tuple[bytes, str]:
        """What the server sends until it ends, and how it ended: ``close_notify`` (sent
        after its answers) or ``eof`` (the TCP connection closed without one)."""
        got = b""
        while True:
            try:
                data = self.tls.read(65536)
            except ssl.SSLWantReadError:
                data = self.sock.recv(65536)
                if not data:
                    return got, "eof"
                self.incoming.write(data)
                continue
            except ssl.SSLZeroReturnError:
                return got, "close_notify"
            if not data:
                return got, "close_notify"
            got += data


def _gone(served: Served) -> None:
    wait_until(lambda: not served.server.connections.open, timeout=WAIT,
               message="the connection released")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2],
                         ids=lambda version: version.name)
def test_publishes_followed_by_close_notify_are_answered(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued,
    version: ssl.TLSVersion
) -> None:
    """A client's close_notify ends its sending side only (RFC 8446 §6.1), as a FIN does over
    plain HTTP: its whole requests are answered, then Ferry's own close_notify comes. The
    TLS transport of asyncio and uvloop closed at once: stored, never answered. TLS 1.2
    asks for the close at once instead (RFC 5246 §7.2.1); answered there too: a client that
    has gone drops the answers, one that still reads gets them."""
    served = serve(http=_tls(ca, server_cert))
    client = _Client(served.server.tls_port, ca, version)
    client.send(raw.publish("tls", b"first") + raw.publish("tls", b"second"))
    client.close_notify()
    answers, ended = client.read_until_closed()
    client.sock.close()
    assert [raw.status(a) for a in raw.split_answers(answers)] == [202, 202]
    assert ended == "close_notify"
    assert [m.record.value for m in served.messages("tls")] == [b"first", b"second"]
    _gone(served)


def test_a_publish_followed_by_a_fin_without_close_notify_is_answered(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    """A TCP FIN without close_notify may be a truncation, but each request received whole
    was authenticated record by record: it is answered, as over plain HTTP. One cut short
    is dropped (the test below)."""
    served = serve(http=_tls(ca, server_cert))
    client = _Client(served.server.tls_port, ca)
    client.send(raw.publish("tls", b"before the fin"))
    client.sock.shutdown(socket.SHUT_WR)
    answers, ended = client.read_until_closed()
    client.sock.close()
    assert [raw.status(a) for a in raw.split_answers(answers)] == [202]
    assert ended == "close_notify"
    assert [m.record.value for m in served.messages("tls")] == [b"before the fin"]
    _gone(served)


@pytest.mark.parametrize("how", ["close_notify", "fin"])
def test_an_end_of_sending_in_the_middle_of_a_body_stores_nothing(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued, how: str
) -> None:
    served = serve(http=_tls(ca, server_cert))
    client = _Client(served.server.tls_port, ca)
    client.send(raw.publish("tls", b"0123456789")[:-4])
    if how == "close_notify":
        client.close_notify()
    else:
        client.sock.shutdown(socket.SHUT_WR)
    assert client.read_until_closed() == (b"", "close_notify")
    client.sock.close()
    _gone(served)
    assert served.messages("tls") == []
    assert served.counter("http_requests", route="publish", status="499") == 1


def test_an_idle_client_s_close_notify_is_answered_with_the_server_s(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    served = serve(http=_tls(ca, server_cert))
    client = _Client(served.server.tls_port, ca)
    client.send(raw.publish("tls", b"one"))
    head = b""  # the answer, read on the open connection
    while b"\r\n\r\n" not in head:
        try:
            head += client.tls.read(65536)
        except ssl.SSLWantReadError:
            client.incoming.write(client.sock.recv(65536))
    assert raw.status(head) == 202
    client.close_notify()
    assert client.read_until_closed()[1] == "close_notify"
    client.sock.close()
    _gone(served)


def test_pipelined_and_large_requests_over_tls_are_read_whole(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    """Reading pauses under TLS as over TCP: 40 pipelined publishes (the queue holds 32
    before reading pauses) and a 900 KB body (parsed 16 KiB a loop step, reading paused
    between), all in one go with close_notify after them; every one is answered."""
    served = serve(http=_tls(ca, server_cert))
    client = _Client(served.server.tls_port, ca)
    big = bytes(range(256)) * (900_000 // 256)
    sent = [b"p%d" % i for i in range(40)] + [big, b"last"]
    client.send(b"".join(raw.publish("tls", body) for body in sent))
    client.close_notify()
    answers, ended = client.read_until_closed()
    client.sock.close()
    assert [raw.status(a) for a in raw.split_answers(answers)] == [202] * len(sent)
    assert ended == "close_notify"
    assert [m.record.value for m in served.messages("tls")] == sent
    _gone(served)


def test_a_tls_client_that_never_reads_its_answers_is_dropped(
    serve: Callable[..., Served], ca: CertificateAuthority, server_cert: Issued
) -> None:
    """The TCP transport's write flow control reaches the HTTP protocol through TLS: answers
    piled up unread pause its writing, and the write deadline drops the connection."""
    served = serve(http={**_tls(ca, server_cert), "write_timeout_seconds": 0.5})
    client = _Client(served.server.tls_port, ca, receive_buffer=4096)
    requests = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 16  # KiBs per answer

    def send() -> None:
        with contextlib.suppress(OSError):  # dropped by the server: what the test waits for
            for _ in range(2 * 1024 * 1024 // len(requests)):  # bounded: 2 MiB of requests
                client.send(requests)

    sender = threading.Thread(target=send, daemon=True)
    stalled: list[object] = []

    def dropped() -> bool:
        open_now = list(served.server.connections.open)
        stalled.extend(c for c in open_now if c.write_paused and not stalled)
        return not open_now

    try:
        sender.start()
        wait_until(dropped, timeout=WAIT,
                   message="the non-reading client dropped at the write deadline")
    finally:
        client.sock.close()
        sender.join(timeout=WAIT)
    assert stalled, "the server's writing never paused"
