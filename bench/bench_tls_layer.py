"""Issue #37 N7: the TLS layer alone, Ferry's own (``tls_stream.py``) against the uvloop TLS
protocol it replaced, CPU per request.

    .venv/bin/python bench/bench_tls_layer.py [--rounds 4] [--connections 50] [--seconds 5]
                                              [--handshakes] [--layers uvloop,ferry]

Two server processes on uvloop, the same do-nothing protocol (a canned 202 for each 200-byte
POST) behind each layer: ``uvloop`` (``create_server(ssl=...)``: uvloop's ``SSLProtocol``,
the class ``loop.start_tls()`` put in front of Ferry's connections before) and ``ferry``
(``tls_stream.start_tls`` from ``connection_made()``, as ``HttpProtocol`` does, each
handshake step on the loop) and ``ferry-threads`` (the same, its steps in the handshake
threads, ``tls_stream.Handshakes()``, as the HTTPS listener runs them; named in
``--layers``). wrk (one thread, TLS, keep-alive) loads each in turn, the order alternating
from round to round; printed per run and as medians: the server process's CPU per request,
its event loop's (the main thread's), and requests/s. With no HTTP parsing, buffer or writer
behind it, the difference is the layers' own. ``--handshakes``: each answer says
``connection: close`` and the server closes after it, so every request is a new connection
and a full TLS handshake (the certificate is tests/certificates.py's EC P-256), and the CPU
per request is mostly the handshake's: on the event loop, or with ``ferry-threads`` mostly
in the handshake threads.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CANNED = b"HTTP/1.1 202 Accepted\r\ncontent-length: 2\r\n\r\n{}"
CLOSING = b"HTTP/1.1 202 Accepted\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
SIZE = 200
LAYERS = ("uvloop", "ferry", "ferry-threads")
_LUA = f'wrk.method = "POST"\nwrk.body = string.rep("v", {SIZE})\n'


def server_main(layer: str, cert: str, key: str, conn: Connection, closing: bool) -> None:
    import uvloop

    from agent.ingest.http.tls_stream import ON_LOOP, Handshakes, start_tls

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])
    handshakes = Handshakes() if layer == "ferry-threads" else ON_LOOP

    class Canned(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
            self.out: Any = transport
            self.pending = b""
            if layer != "uvloop":
                start_tls(asyncio.get_running_loop(), cast(asyncio.Transport, transport), self,
                          context, 10.0, self.started, handshakes)

        def started(self, secure: asyncio.Transport | None, _: BaseException | None) -> None:
            if secure is not None:
                self.out = secure

        def data_received(self, data: bytes) -> None:
            pending = self.pending + data
            while (head := pending.find(b"\r\n\r\n")) >= 0 and len(pending) >= head + 4 + SIZE:
                pending = pending[head + 4 + SIZE:]
                if closing:
                    self.out.write(CLOSING)
                    self.out.close()
                    return
                self.out.write(CANNED)
            self.pending = pending

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Canned, "127.0.0.1", 0, backlog=2048,
                                          ssl=context if layer == "uvloop" else None)
        conn.send(server.sockets[0].getsockname()[1])
        await loop.run_in_executor(None, conn.recv)
        server.close()

    uvloop.run(serve())


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """The process's CPU seconds, or its thread ``tid``'s."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--handshakes", action="store_true",
                    help="a new connection (a TLS handshake) for every request")
    ap.add_argument("--layers", default="uvloop,ferry",
                    help=f"some of {','.join(LAYERS)}")
    args = ap.parse_args()
    layers = args.layers.split(",")
    from tests.certificates import CertificateAuthority

    ctx = multiprocessing.get_context("spawn")
    figures: dict[str, list[tuple[float, float, float]]] = {layer: [] for layer in layers}
    with tempfile.TemporaryDirectory() as tmp:
        cert = CertificateAuthority(Path(tmp) / "pki").issue("server", server=True)
        script = Path(tmp) / "publish.lua"
        script.write_text(_LUA)
        servers = {}
        for layer in layers:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=server_main,
                               args=(layer, str(cert.cert), str(cert.key), child,
                                     args.handshakes))
            proc.start()
            servers[layer] = (proc, parent, parent.recv())
        try:
            for n in range(args.rounds):
                for layer in layers if n % 2 == 0 else layers[::-1]:
                    proc, _, port = servers[layer]
                    pid = proc.pid
                    assert pid is not None
                    before, loop_before = cpu_seconds(pid), cpu_seconds(pid, pid)
                    out = subprocess.run(
                        ["wrk", "-t1", f"-c{args.connections}", f"-d{args.seconds:g}s",
                         "-s", str(script), f"https://127.0.0.1:{port}/"],
                        capture_output=True, text=True, check=True,
                        timeout=args.seconds + 60).stdout
                    used = cpu_seconds(pid) - before
                    loop_used = cpu_seconds(pid, pid) - loop_before
                    requests = int(next(line for line in out.splitlines()
                                        if "requests in" in line).split()[0])
                    per_request, rate = used / requests * 1e6, requests / args.seconds
                    on_loop = loop_used / requests * 1e6
                    figures[layer].append((per_request, on_loop, rate))
                    print(f"round {n + 1} {layer:13} {per_request:6.1f} us/request "
                          f"({on_loop:6.1f} on the loop) {rate:8.0f} requests/s", flush=True)
        finally:
            for proc, pipe, _ in servers.values():
                pipe.send("stop")
                proc.join(10)
    print()
    for layer, runs in figures.items():
        print(f"{layer:13} median {statistics.median(c for c, _, _ in runs):6.1f} us/request "
              f"({statistics.median(o for _, o, _ in runs):6.1f} on the loop) "
              f"{statistics.median(r for _, _, r in runs):8.0f} requests/s "
              f"({args.connections} connections, {len(runs)} runs"
              f"{', a handshake each' if args.handshakes else ''})")


if __name__ == "__main__":
    main()
