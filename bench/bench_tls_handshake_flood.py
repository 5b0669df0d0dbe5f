"""Issue #37: what a flood of TLS handshakes costs the other clients of the HTTP loop.

    .venv/bin/python bench/bench_tls_handshake_flood.py [--rounds 4] [--seconds 8]
        [--flooders 2] [--modes loop,threads] [--probe publish|ping]

Ferry's HTTP stage as the tests start it (``tests/http/harness.py``: a real buffer and group
committer, ``HttpServer`` with its plain and HTTPS listeners, every setting at its default
but the 202-only topic, ``ack_timeout_ms`` 0, since no forwarder runs) in a process of its
own. Two probes publish 200 bytes every 10 ms, one request in flight each, over kept-alive
connections: one over plain HTTP, one over HTTPS whose handshake was done before
(``--probe ping``: ``GET /status/ping`` instead, which stores nothing, so no fsync hides
what the loop does). Each
round has a quiet phase (the probes alone) and a flood phase: a process of ``--flooders``
threads opens TLS connections to the HTTPS port as fast as the server takes them, one
handshake each (no request; the client checks no certificate, so that its own CPU is
small), then closes. Every loop is bounded by ``--seconds``.

Modes (a fresh server each round, the order alternating from round to round):

- ``loop``: each handshake step on the event loop (``tls_stream.THREADS = 0``: the layer
  before issue #37's item 1);
- ``threads``: the default, steps in the handshake threads (``tls_stream.THREADS``).

Printed per round and mode: handshakes/s, the loop thread's and the process's CPU per
handshake (flood phase less quiet phase, over the handshakes), and each probe's latency
(p50, p99, max) quiet and flooded. Loopback only; the flood and the probes run on the same
host as the server, so on a small host they compete with it for the cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("loop", "threads")
SIZE = 200
INTERVAL = 0.010


def server_main(root: str, cert: str, key: str, mode: str, conn: Connection) -> None:
    from agent.ingest.http import tls_stream
    from tests.http.harness import make_config, start

    if mode == "loop":
        tls_stream.THREADS = 0
    config = make_config(Path(root), http={"tls_listen": "127.0.0.1:0",
                                           "tls_cert_file": cert, "tls_key_file": key})
    served = start(config)
    thread = served.server._thread  # noqa: SLF001 - its CPU clock is what is measured
    assert thread is not None
    conn.send((served.server.port, served.server.tls_port, thread.native_id,
               getattr(tls_stream, "THREADS", 0)))
    conn.recv()
    served.stop()
    conn.send("stopped")


def thread_cpu(pid: int, tid: int) -> float:
    return _cpu(Path(f"/proc/{pid}/task/{tid}/stat"))


def process_cpu(pid: int) -> float:
    return _cpu(Path(f"/proc/{pid}/stat"))


def _cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood_main(port: int, flooders: int, seconds: float, conn: Connection) -> None:
    """``flooders`` threads, each a handshake after another until ``seconds`` passed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    done = [0] * flooders
    failed = [0] * flooders
    deadline = time.monotonic() + seconds

    def flood(n: int) -> None:
        for _ in range(1_000_000):
            if time.monotonic() >= deadline:
                return
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, \
                        context.wrap_socket(sock, server_hostname="127.0.0.1"):
                    done[n] += 1
            except OSError:
                failed[n] += 1

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(flooders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send((sum(done), sum(failed)))


class Probe(threading.Thread):
    """A publish every ``INTERVAL`` over one kept-alive connection; latencies in seconds."""

    def __init__(self, port: int, secure: bool, seconds: float, path: str) -> None:
        super().__init__()
        self.port, self.secure, self.seconds = port, secure, seconds
        self.latencies: list[float] = []
        self.request = (b"POST /topics/probe HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                        % SIZE + b"v" * SIZE) if path == "publish" else \
            b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n"
        sock: socket.socket = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if secure:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self._roundtrip()  # the handshake and a first answer, before measuring

    def _roundtrip(self) -> None:
        self.sock.sendall(self.request)
        data = b""
        for _ in range(10_000):
            head = data.find(b"\r\n\r\n")
            if head >= 0:
                length = int(data[:head].lower().split(b"content-length:")[1]
                             .split(b"\r\n")[0])
                if len(data) >= head + 4 + length:
                    assert data.startswith(b"HTTP/1.1 20"), data[:100]
                    return
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the probe's connection"
            data += chunk

    def run(self) -> None:
        start = time.monotonic()
        deadline = start + self.seconds
        at = start
        while at < deadline:
            sent = time.perf_counter()
            self._roundtrip()
            self.latencies.append(time.perf_counter() - sent)
            at += INTERVAL
            time.sleep(max(0.0, at - time.monotonic()))

    def summary(self) -> tuple[float, float, float]:
        ordered = sorted(self.latencies)
        return (statistics.median(ordered) * 1e3,
                ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
                ordered[-1] * 1e3)


def one_round(ctx: multiprocessing.context.SpawnContext, tmp: Path, cert: str, key: str,
              mode: str, args: argparse.Namespace, n: int) -> dict[str, float]:
    parent, child = ctx.Pipe()
    root = tmp / f"round{n}-{mode}"
    root.mkdir()
    server = ctx.Process(target=server_main, args=(str(root), cert, key, mode, child))
    server.start()
    port, tls_port, tid, threads = parent.recv()
    pid = server.pid
    assert pid is not None
    out: dict[str, float] = {"threads": threads}
    try:
        phases = {}
        for phase in ("quiet", "flood"):
            probes = [Probe(port, False, args.seconds, args.probe),
                      Probe(tls_port, True, args.seconds, args.probe)]
            flood_pipe = flooder = None
            if phase == "flood":
                flood_pipe, flood_child = ctx.Pipe()
                flooder = ctx.Process(target=flood_main,
                                      args=(tls_port, args.flooders, args.seconds, flood_child))
            loop_before, proc_before = thread_cpu(pid, tid), process_cpu(pid)
            if flooder is not None:
                flooder.start()
            for probe in probes:
                probe.start()
            for probe in probes:
                probe.join(args.seconds + 60)
            handshakes = failed = 0
            if flooder is not None and flood_pipe is not None:
                handshakes, failed = flood_pipe.recv()
                flooder.join(30)
            phases[phase] = (thread_cpu(pid, tid) - loop_before,
                             process_cpu(pid) - proc_before, handshakes, failed)
            for name, probe in zip(("plain", "https"), probes, strict=True):
                p50, p99, worst = probe.summary()
                out[f"{phase} {name} p50"], out[f"{phase} {name} p99"] = p50, p99
                out[f"{phase} {name} max"] = worst
                probe.sock.close()
        loop_q, proc_q, _, _ = phases["quiet"]
        loop_f, proc_f, handshakes, failed = phases["flood"]
        out["handshakes/s"] = handshakes / args.seconds
        out["failed"] = failed
        out["loop us/handshake"] = (loop_f - loop_q) / max(1, handshakes) * 1e6
        out["process us/handshake"] = (proc_f - proc_q) / max(1, handshakes) * 1e6
    finally:
        parent.send("stop")
        parent.recv()
        server.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--flooders", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--probe", choices=("publish", "ping"), default="publish")
    args = ap.parse_args()
    modes = args.modes.split(",")
    from tests.certificates import CertificateAuthority

    ctx = multiprocessing.get_context("spawn")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cert = CertificateAuthority(tmp / "pki").issue("server", server=True)
        for n in range(args.rounds):
            for mode in modes if n % 2 == 0 else modes[::-1]:
                got = one_round(ctx, tmp, str(cert.cert), str(cert.key), mode, args, n)
                results[mode].append(got)
                print(f"round {n + 1} {mode:7} " + ", ".join(
                    f"{k} {v:.3g}" for k, v in got.items()), flush=True)
    print()
    for mode, runs in results.items():
        print(f"{mode:7} median of {len(runs)}: " + ", ".join(
            f"{k} {statistics.median(r[k] for r in runs):.3g}" for k in runs[0]))


if __name__ == "__main__":
    main()
