"""Issue #37's audit cases against each candidate front door, with what each case costs.

    .venv/bin/python bench/bench_http_audit_servers.py
        [--candidates ferry,granian-rsgi,granian-asgi,hypercorn] [--cases N1a,N2,...]

Each case runs against a fresh server: the candidate serving a real Store and Committer
(no forwarder: a publish is 202 once fsynced) in a process of its own, with Ferry's default
HTTP settings where the server has an equivalent (bench/http_candidates/: header deadline,
keep-alive, header size; gzip bodies decoded with Ferry's own stepping decoder,
gzip_front.py), a management token, and
``X-Trace`` allow-listed as a Kafka header. The cases are sent from raw sockets in this
process; for each the server process's cost is read from /proc: CPU seconds (all its
threads, granian's Rust ones included), peak RSS growth (sampled every 20 ms), its sockets
above the idle count (peak, and when the case ended), and the worst wait of another client
pinging ``GET /status/ping`` on a kept-alive connection meanwhile (any status: the RSGI
adapter answers 404 there, from the same loop).

The cases and what passes (the issue's acceptance where it gives a figure):

- N1a 4 MiB of empty gzip members, then a member of two lines, as one ndjson batch: 2xx,
  both lines stored, the probe never waits 1 s;
- N1b 45,000 empty members (< 1 MB): answered within 2 s, the probe never waits 1 s;
- N2  60 connections that pipeline 2,000 pings and a ``Connection: close`` each and never
  read: every server socket released within 60 s of the last send (the write deadline,
  10 s, and the time to answer 120,000 pings), while the clients still hold theirs;
- N3a a chunked publish whose trailer carries Partition-Key, Content-Type, Idempotency-Key
  and X-Trace, twice: both 2xx and stored as the headers say (key ``mine``, no Kafka header,
  no replay);
- N3b ``POST /topics`` with the bearer token only in a trailer: 401 (n/a where the
  management API is not served);
- N4  100,000 one-byte chunks, then a trailer that never ends: refused or closed within
  1 MiB of trailer read (sent paced, a 64 KiB piece once the server has read the last);
- N5  four connections each sending a 4 MiB batch in 2-byte chunks: the server grows by
  less than 200 MiB;
- N6  a 4 MiB JSON array of 2.1 M messages: answered, the probe never waits 1 s, less than
  200 MiB of growth;
- N7a/N7b over HTTPS (the candidate serving TLS with a test CA's certificate): a publish,
  then close_notify (a) or a TCP FIN (b) from the client: 2xx answered.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import multiprocessing
import os
import select
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CANDIDATES = ("ferry", "granian-rsgi", "granian-asgi", "hypercorn")
TOKEN = "audit-token"
WAIT = 30.0
MIB = 1024 * 1024
WRITE_DEADLINE = 10.0  # Ferry's http.write_timeout_seconds default
# N2: how long the server may take to release its sockets after the last send: the write
# deadline, plus the time to answer 120,000 pipelined pings on a busy host.
N2_LIMIT = WRITE_DEADLINE + 50.0


# -- the server side (a process per candidate) ----------------------------------------------
def server_main(candidate: str, root: str, port: int, tls: tuple[str, str] | None,
                conn: Connection, sections: dict[str, Any] | None = None) -> None:
    """Serve ``candidate`` on ``port`` (HTTPS there when ``tls``); answer the parent's
    questions about the buffer until told to stop. ``sections``: config sections merged
    over these (bench_http_bounds.py's limits and deadlines)."""
    from agent.buffer.committer import Committer
    from agent.buffer.store import Store
    from agent.ingest.runtime import Phase, Runtime
    from agent.metrics import Registry
    from tests.http.harness import make_config
    from tests.kafka import free_port

    http: dict[str, Any] = {"listen": f"127.0.0.1:{port}", "management_token": TOKEN,
                            "header_allowlist": ["X-Trace"]}
    served = port
    if tls and candidate == "ferry":  # Ferry's HTTPS is a second listener beside the plain one
        served = free_port()
        http.update(listen=f"127.0.0.1:{free_port()}", tls_listen=f"127.0.0.1:{served}",
                    tls_cert_file=tls[0], tls_key_file=tls[1])
    extra = dict(sections or {})
    http.update(extra.pop("http", {}))
    cfg = make_config(Path(root), http=http, **extra)
    store = Store(cfg.buffer.path, cfg.buffer.max_bytes)
    registry = Registry()
    committer = Committer(store, registry=registry)
    committer.start()
    runtime = Runtime(cfg, store, committer, registry)
    stage: Any
    if candidate == "ferry":
        from agent.ingest.http.app import create_app
        from agent.ingest.http.server import HttpServer

        stage = HttpServer(runtime, create_app(runtime))
    elif candidate == "hypercorn":
        from http_candidates.hypercorn_stage import HypercornStage

        stage = HypercornStage(runtime, tls)
    else:
        from http_candidates.granian_stage import GranianStage

        stage = GranianStage(runtime, candidate.split("-", 1)[1], tls)
    stage.start()
    runtime.set_phase(Phase.RUNNING)
    conn.send(served)
    while (command := conn.recv()) != "stop":
        # A topic: (key, value, headers) of its messages; (topic, True): with the
        # partition key as well.
        topic, full = command if isinstance(command, tuple) else (command, False)
        out = store.read(topic, None, 100_000)
        conn.send([(m.record.key, m.record.value, list(m.record.headers or ()),
                    *((m.record.partition_key,) if full else ()))
                   for m in out if hasattr(m, "record")])
    stage.stop(5.0)
    committer.close()
    store.close()
    conn.send("stopped")


@dataclass
class Target:
    candidate: str
    port: int
    pid: int
    pipe: Connection
    tls: bool

    def stored(self, topic: str) -> list[tuple[bytes | None, bytes, list[Any]]]:
        self.pipe.send(topic)
        return self.pipe.recv()  # type: ignore[no-any-return]

    def stored_full(self, topic: str) -> list[tuple[bytes | None, bytes, list[Any],
                                                    int | None]]:
        """(key, value, headers, partition key) of ``topic``'s messages."""
        self.pipe.send((topic, True))
        return self.pipe.recv()  # type: ignore[no-any-return]

    def connect(self, timeout: float = WAIT) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def client(self) -> socket.socket:
        """A connection speaking the target's protocol: TLS to an HTTPS target."""
        sock = self.connect()
        if not self.tls:
            return sock
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx.wrap_socket(sock, server_hostname="localhost")


# -- what the server process costs ------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            continue
    return count


class Sampler:
    """Peak RSS and socket count of ``pid``, every 20 ms while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss = rss_mib(pid)
        self.socks = sockets(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.rss = max(self.rss, rss_mib(self.pid))
                self.socks = max(self.socks, sockets(self.pid))
            except OSError:
                return


class Probe:
    """Another client, pinging on a kept-alive connection: the longest wait for an answer."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.worst = 0.0
        self.pings = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        deadline = time.monotonic() + WAIT
        while self.pings == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT + 5)

    def _run(self) -> None:
        sock = self.target.client()
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    sock.sendall(b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n")
                    _read_answer(sock)
                except OSError:
                    self.worst = max(self.worst, time.monotonic() - began)
                    sock.close()
                    sock = self.target.client()
                    continue
                self.worst = max(self.worst, time.monotonic() - began)
                self.pings += 1
                self._stop.wait(0.005)
        finally:
            sock.close()


def _read_answer(sock: socket.socket) -> bytes:
    """One answer with a Content-Length (the probe's)."""
    data = b""
    while True:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].lower()
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            if len(data) >= head_end + 4 + length:
                return data
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk


# -- HTTP on raw sockets ----------------------------------------------------------------------
def post(path: bytes, body: bytes, *headers: bytes) -> bytes:
    head = b"\r\n".join([b"POST " + path + b" HTTP/1.1", b"Host: x", *headers,
                         b"Content-Length: %d" % len(body)])
    return head + b"\r\n\r\n" + body


def chunked(path: bytes, body: bytes, trailer: bytes, *headers: bytes) -> bytes:
    head = b"\r\n".join([b"POST " + path + b" HTTP/1.1", b"Host: x",
                         b"Transfer-Encoding: chunked", *headers])
    return (head + b"\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n" + trailer
            + b"\r\n")


def exchange(target: Target, request: bytes) -> tuple[int | None, bytes, float]:
    """Send ``request``, read one answer (or until closed): (status, answer, seconds)."""
    began = time.monotonic()
    with target.connect() as sock:
        sock.sendall(request)
        try:
            answer = _read_answer(sock)
        except (ConnectionError, TimeoutError, IndexError, ValueError) as exc:
            return None, f"<{type(exc).__name__}>".encode(), time.monotonic() - began
    return _status(answer), answer, time.monotonic() - began


def _status(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1."):
        return None
    return int(answer.split(b" ", 2)[1])


def send_until_answered(target: Target, head: bytes, piece: bytes,
                        most: int) -> tuple[int | None, int, bytes]:
    """Send ``head`` then ``piece`` after ``piece`` until the server answers or closes, or
    ``most`` bytes went: (bytes of the pieces the server had read when it answered, or
    None; bytes sent; the answer). Paced: each piece goes once the server has read the one
    before (nothing left in either side's socket queue), so the count is what the server
    read, not what the kernel buffered for it; a server that reads nothing for 30 s ends
    the case."""
    sent = 0
    after: int | None = None
    with socket.socket() as sock:
        sock.settimeout(WAIT)
        sock.connect(("127.0.0.1", target.port))
        mine = sock.getsockname()[1]
        answer = b""
        try:
            for data in (head, *(piece for _ in range(most // len(piece)))):
                sock.sendall(data)
                sent += len(data) if data is piece else 0
                deadline = time.monotonic() + WAIT
                while (not select.select([sock], [], [], 0.002)[0]
                       and _queued(mine, target.port) > 0):
                    if time.monotonic() > deadline:
                        return None, sent, b"<stopped reading>"
                if select.select([sock], [], [], 0)[0]:
                    after = sent
                    break
            answer = sock.recv(65536)
        except (ConnectionError, TimeoutError) as exc:
            after = sent if after is None and not isinstance(exc, TimeoutError) else after
            answer = f"<{type(exc).__name__}>".encode()
    return after, sent, answer


def _queued(client: int, server: int) -> int:
    """Bytes on their way from port ``client`` to port ``server``: the client's send queue
    and the server's receive queue (/proc/net/tcp)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
        tx, rx = (int(x, 16) for x in fields[4].split(":"))
        if (local, remote) == (client, server):
            total += tx
        elif (local, remote) == (server, client):
            total += rx
    return total


# -- the cases ---------------------------------------------------------------------------------
Verdict = tuple[bool | None, str]  # passed (None: not applicable), what happened


def n1a_members(target: Target, probe: Probe) -> Verdict:
    empty = gzip.compress(b"")
    body = empty * (4 * MIB // len(empty)) + gzip.compress(b"one\ntwo\n")
    status, answer, took = exchange(target, post(
        b"/topics/n1a/batch", body, b"Content-Encoding: gzip",
        b"Content-Type: application/x-ndjson"))
    stored = [v for _, v, _ in target.stored("n1a")]
    ok = status is not None and status < 300 and stored == [b"one", b"two"]
    return ok and probe.worst < 1.0, f"{status} in {took:.2f} s, stored {stored!r}"


def n1b_members(target: Target, probe: Probe) -> Verdict:
    status, answer, took = exchange(target, post(
        b"/topics/n1b", gzip.compress(b"") * 45_000, b"Content-Encoding: gzip"))
    return (status is not None and took < 2.0 and probe.worst < 1.0,
            f"{status} in {took:.2f} s")


def n2_unread(target: Target, probe: Probe, idle: int) -> Verdict:
    clients: list[socket.socket] = []
    pings = b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n" * 2000
    close = b"GET /status/ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    try:
        for _ in range(60):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(1.0)
            try:
                sock.connect(("127.0.0.1", target.port))
                clients.append(sock)
                sock.sendall(pings + close)
            except (TimeoutError, ConnectionError):
                pass  # the server stopped reading (or refused): what it holds is measured
        began = time.monotonic()
        limit = N2_LIMIT
        peak = sockets(target.pid) - idle
        while time.monotonic() - began < limit and sockets(target.pid) > idle:
            time.sleep(0.2)
        left = sockets(target.pid) - idle
        waited = time.monotonic() - began
    finally:
        for sock in clients:
            sock.close()
    if left > 0:
        return False, f"{left} server sockets still held after {waited:.0f} s (peak {peak})"
    return True, f"all released {waited:.1f} s after the last send (peak {peak})"


def n3a_trailer_headers(target: Target, probe: Probe) -> Verdict:
    trailer = (b"Partition-Key: stolen\r\nContent-Type: text/evil\r\nIdempotency-Key: k1\r\n"
               b"X-Trace: injected\r\n")
    statuses = []
    for _ in range(2):
        status, answer, _ = exchange(target, chunked(b"/topics/n3a", b"value", trailer,
                                                     b"Partition-Key: mine"))
        statuses.append(f"{status}{' replayed' if b'replayed' in answer.lower() else ''}")
    stored = target.stored("n3a")
    ok = (all(s.isdigit() and int(s) < 300 for s in statuses)
          and [v for _, v, _ in stored] == [b"value", b"value"]
          and {k for k, _, _ in stored} == {b"mine"} and not any(h for _, _, h in stored))
    return ok, (f"{', '.join(statuses)}; stored keys {sorted({k for k, _, _ in stored})!r}, "
                f"headers {[h for _, _, h in stored if h]!r}")


def n3b_trailer_token(target: Target, probe: Probe) -> Verdict:
    body = json.dumps({"name": "by-trailer"}).encode()
    status, answer, _ = exchange(target, chunked(
        b"/topics", body, b"Authorization: Bearer " + TOKEN.encode() + b"\r\n",
        b"Content-Type: application/json"))
    if status == 404 and target.candidate == "granian-rsgi":
        return None, "404: no management API on the RSGI adapter"
    return status == 401, f"{status}"


def n4_trailer_size(target: Target, probe: Probe) -> Verdict:
    head = (b"POST /topics/n4 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"1\r\nx\r\n" * 100_000 + b"0\r\nX-Trailer: ")
    after, sent, answer = send_until_answered(target, head, b"a" * 65536, 64 * MIB)
    first = answer.split(b"\r\n")[0].decode("latin-1") or "closed"
    if after is None:
        return False, f"no answer after {sent // 1024} KiB of trailer read {first}"
    return after <= MIB, f"{first} after {after // 1024} KiB of trailer read"


def n5_tiny_chunks(target: Target, probe: Probe) -> Verdict:
    statuses: list[str] = []
    piece = b"2\r\nab\r\n" * 8192

    def one() -> None:
        try:
            with target.connect(timeout=120) as sock:
                sock.sendall(b"POST /topics/n5/batch HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(4 * MIB // 2 // 8192):
                    sock.sendall(piece)
                sock.sendall(b"0\r\n\r\n")
                statuses.append(str(_status(_read_answer(sock))))
        except (OSError, IndexError, ValueError) as exc:
            statuses.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return None, ", ".join(statuses)  # judged on the RSS growth by the caller


def n6_tiny_json(target: Target, probe: Probe) -> Verdict:
    body = b"[" + b",".join([b"1"] * 2_100_000) + b"]"
    status, _, took = exchange(target, post(b"/topics/n6/batch", body,
                                            b"Content-Type: application/json"))
    return (status is not None and probe.worst < 1.0, f"{status} in {took:.2f} s")


def _tls_publish(target: Target, how: str) -> tuple[int | None, str]:
    """A publish over TLS, then close_notify or a FIN; the status answered, if any."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with target.connect(timeout=10.0) as sock:
        def flush() -> None:
            if data := outgoing.read():
                sock.sendall(data)

        def pump() -> bool:
            data = sock.recv(65536)
            if not data:
                incoming.write_eof()
                return False
            incoming.write(data)
            return True

        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                flush()
                if not pump():
                    return None, "closed in the handshake"
        flush()
        tls.write(post(b"/topics/n7" + how.encode(), b"x"))
        flush()
        if how == "control":  # neither: the answer to a publish on an open connection
            pass
        elif how == "close_notify":
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.unwrap()
            flush()
        else:
            sock.shutdown(socket.SHUT_WR)
        got = b""
        ended = "closed"
        try:
            while not _whole(got):
                try:
                    data = tls.read(65536)
                except ssl.SSLWantReadError:
                    if not pump():
                        break
                    continue
                if not data:
                    break
                got += data
        except ssl.SSLZeroReturnError:
            ended = "close_notify"
        except (ssl.SSLError, OSError) as exc:
            ended = type(exc).__name__
    return _status(got), ended


def _whole(data: bytes) -> bool:
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return False
    head = data[:head_end].lower()
    length = int(head.split(b"content-length:")[1].split(b"\r\n")[0]) \
        if b"content-length:" in head else 0
    return len(data) >= head_end + 4 + length


def n7a_close_notify(target: Target, probe: Probe) -> Verdict:
    status, ended = _tls_publish(target, "close_notify")
    stored = len(target.stored("n7close_notify"))
    return (status is not None and status < 300,
            f"{status or 'no answer'} ({ended}), {stored} stored")


def n7b_fin(target: Target, probe: Probe) -> Verdict:
    status, ended = _tls_publish(target, "fin")
    stored = len(target.stored("n7fin"))
    return (status is not None and status < 300,
            f"{status or 'no answer'} ({ended}), {stored} stored")


CASES: dict[str, tuple[str, Callable[..., Verdict]]] = {
    "N1a": ("4 MiB of empty gzip members, batch", n1a_members),
    "N1b": ("45,000 empty gzip members", n1b_members),
    "N2": ("60 conns never read, Connection: close", n2_unread),
    "N3a": ("trailer Partition-Key/Idem.-Key/X-Trace", n3a_trailer_headers),
    "N3b": ("management token only in a trailer", n3b_trailer_token),
    "N4": ("100,000 chunks, then endless trailer", n4_trailer_size),
    "N5": ("4 conns x 4 MiB in 2-byte chunks", n5_tiny_chunks),
    "N6": ("4 MiB JSON array, 2.1 M messages", n6_tiny_json),
    "N7a": ("HTTPS publish, then close_notify", n7a_close_notify),
    "N7b": ("HTTPS publish, then FIN", n7b_fin),
}
GROWTH_MIB = 200.0  # the issue's bound for N5, and N6's


# -- the run -----------------------------------------------------------------------------------
def start(ctx: Any, candidate: str, root: Path, tls: tuple[str, str] | None,
          sections: dict[str, Any] | None = None) -> Target:
    from tests.kafka import free_port

    parent, child = ctx.Pipe()
    port = free_port()
    proc = ctx.Process(target=server_main,
                       args=(candidate, str(root), port, tls, child, sections),
                       name=f"audit-{candidate}")
    proc.start()
    served = parent.recv()
    return Target(candidate, served, proc.pid, parent, tls is not None)


def stop(target: Target) -> None:
    try:
        target.pipe.send("stop")
        target.pipe.recv()
    except (OSError, EOFError):
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{target.pid}").exists():
        time.sleep(0.1)
    if Path(f"/proc/{target.pid}").exists():
        os.kill(target.pid, 9)


def run_case(target: Target, name: str) -> dict[str, Any]:
    description, run = CASES[name]
    with Probe(target) as probe:  # back once the server has answered the probe
        idle = sockets(target.pid)
        cpu0 = cpu_seconds(target.pid)
        with Sampler(target.pid) as sampler:
            rss0 = sampler.rss
            began = time.monotonic()
            passed, note = run(target, probe, idle) if name == "N2" else run(target, probe)
            wall = time.monotonic() - began
        after = sockets(target.pid) - idle
    growth = sampler.rss - rss0
    if name in ("N5", "N6"):
        within = growth < GROWTH_MIB
        passed = within if passed is None and name == "N5" else (passed and within)
        note += f"; +{growth:.0f} MiB"
    return {"case": name, "what": description, "passed": passed, "note": note,
            "wall_s": round(wall, 2), "cpu_s": round(cpu_seconds(target.pid) - cpu0, 2),
            "rss_mib": round(growth, 1), "probe_worst_ms": round(probe.worst * 1000, 1),
            "probe_pings": probe.pings, "sockets_peak": sampler.socks - idle,
            "sockets_after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dir", type=Path, default=None, help="where the buffers live")
    args = ap.parse_args()
    candidates = args.candidates.split(",")
    names = args.cases.split(",")
    if unknown := (set(candidates) - set(CANDIDATES)) | (set(names) - set(CASES)):
        sys.exit(f"unknown: {sorted(unknown)}")
    from tests.certificates import CertificateAuthority

    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cert = CertificateAuthority(Path(tmp) / "pki").issue("server", server=True)
        files = (str(cert.cert), str(cert.key))
        for candidate in candidates:
            for name in names:  # a fresh server each: what a case leaves behind stays there
                tls = name.startswith("N7")
                root = Path(tmp) / f"{candidate}-{name}"
                root.mkdir()
                target = start(ctx, candidate, root, files if tls else None)
                try:
                    row = {"server": candidate, **run_case(target, name)}
                finally:
                    stop(target)
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, candidates, names)


def report(rows: list[dict[str, Any]], candidates: list[str], names: list[str]) -> None:
    def mark(passed: bool | None) -> str:
        return "n/a" if passed is None else ("pass" if passed else "FAIL")

    for candidate in candidates:
        print(f"\n== {candidate}")
        print(f"{'case':4} {'':42} {'result':6} {'CPU s':>6} {'+RSS MiB':>8} "
              f"{'probe ms':>9} {'socks':>9}  what happened")
        for r in rows:
            if r["server"] == candidate:
                print(f"{r['case']:4} {r['what']:42} {mark(r['passed']):6} {r['cpu_s']:6.2f} "
                      f"{r['rss_mib']:8.0f} {r['probe_worst_ms']:9.1f} "
                      f"{r['sockets_peak']:>4}/{r['sockets_after']:<4}  {r['note']}")
    print(f"\n{'case':5}" + "".join(f"{c:>14}" for c in candidates))
    for name in names:
        cells = []
        for candidate in candidates:
            found = [r for r in rows if r["server"] == candidate and r["case"] == name]
            cells.append(mark(found[0]["passed"]) if found else "-")
        print(f"{name:5}" + "".join(f"{c:>14}" for c in cells))
    print(f"{'pass':5}" + "".join(
        f"{sum(1 for r in rows if r['server'] == c and r['passed']):>14}" for c in candidates))


if __name__ == "__main__":
    main()
