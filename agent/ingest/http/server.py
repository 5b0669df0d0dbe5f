"""``HttpServer``: Ferry's HTTP protocol (protocol.py) on uvloop, on its own thread and loop.

The daemon owns the process's signals, so the server installs none. The listening socket is
bound here, before the thread starts, so a taken port is a clear error from ``start()``
rather than a log line from another thread, and port 0 works: ``port`` tells the port the
kernel chose.

The GIL switch interval is lowered while HTTP is served (agent/ingest/gil.py), for the
writer thread's sake, and the startup heap is frozen out of garbage collections
(``GC_GEN0_THRESHOLD``), for the tail latency's.

The connection cap (``Connections``) is ``http.max_connections`` (0: unset), never more than
the process's descriptor limit allows after ``FD_RESERVE`` descriptors kept for everything
else (the buffer's LMDB files, the datagram socket, the spool intake, logs, the forwarder's
pipes): a flood of connections cannot starve those.

``stop()`` is graceful: readiness turns 503 and publishing refuses new work at once, the
listener closes, idle connections are closed, requests in progress finish (their commits
complete, so the buffer is consistent) and their connections close after their answer, then
the loop ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import ssl
import threading
from typing import Any

import uvloop

from agent.ingest.gil import SWITCH_INTERVAL, lower_switch_interval
from agent.ingest.http import tls as tls_files
from agent.ingest.http.asgi import AsgiRunner
from agent.ingest.http.budget import BodyBudget
from agent.ingest.http.protocol import Connections, DateHeader, HttpProtocol, Limits
from agent.ingest.http.tls import TlsConfigError, TlsFiles
from agent.ingest.http.tls_stream import ON_LOOP, Handshakes
from agent.ingest.runtime import Phase, Runtime
from agent.process.gc_tuning import freeze_startup_heap

log = logging.getLogger(__name__)

START_TIMEOUT = 15.0
BACKLOG = 2048
# Descriptors kept out of the connection cap for the rest of the agent: LMDB (data and lock
# files), the datagram socket, the spool intake's directory watches and open files, the
# forwarder's pipes, logs, Python's own. Measured use without HTTP connections is under 60.
FD_RESERVE = 256
# The cyclic garbage collector while HTTP is served. Requests in flight hold ~20 tracked
# objects each, so with tens of connections the young generation crosses CPython's default
# threshold (700) all the time: ~280 collections/s, each walking the live requests (~3 % of
# the CPU). Worse, every ~0.4 s a full collection walked everything the process had built
# at startup (modules, settings, the app): 12-15 ms with the GIL held, which was the
# publishes' p99. So the startup heap is frozen out of collections (gc.freeze, after one
# collect) and the young threshold raised. Measured (bench_http.py, 2 vCPUs): p99
# 12.6-13.4 ms -> 4.0-5.0 ms, 14,000-14,900 -> 15,100-16,400 req/s.
GC_GEN0_THRESHOLD = 10_000


def connection_cap(configured: int) -> int:
    """The connection cap: ``configured`` (0: none), within the descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        allowed = 1 << 20
    else:  # a small limit (tests, containers) keeps a quarter for the rest
        allowed = max(1, soft - min(FD_RESERVE, soft // 4))
    if configured and configured <= allowed:
        return configured
    if configured:
        log.warning("http.max_connections = %d is over what the descriptor limit (%d) "
                    "allows with %d kept for the rest of the agent; the cap is %d",
                    configured, soft, FD_RESERVE, allowed)
    return allowed


class HttpBindError(RuntimeError):
    """The listener cannot be opened (port taken, address not local, ...)."""


class HttpServer:
    """The HTTP listener of ``runtime.config.http.listen``, serving ``app`` (a ``FerryApp``:
    its ``publisher`` takes the publishes, the app itself every other route)."""

    def __init__(self, runtime: Runtime, app: Any, *, graceful_timeout: float = 10.0,
                 switch_interval: float | None = SWITCH_INTERVAL, tune_gc: bool = True
                 ) -> None:
        self.runtime = runtime
        self.switch_interval = switch_interval
        self.tune_gc = tune_gc
        self.app = app
        self.listen = runtime.config.http.listen
        self.graceful_timeout = graceful_timeout
        cfg = runtime.config.http
        self.limits = Limits(request_line=cfg.max_request_line_bytes,
                             header_bytes=cfg.max_header_bytes, headers=cfg.max_headers,
                             header_timeout=cfg.header_timeout_seconds,
                             body_timeout=cfg.body_timeout_seconds,
                             keep_alive=cfg.keep_alive_seconds,
                             write_timeout=cfg.write_timeout_seconds)
        registry = runtime.registry
        self.connections = Connections(
            connection_cap(cfg.max_connections),
            lambda reason: registry.inc("http_connections_closed", 1, reason=reason))
        # Request bodies held by all connections of both listeners together (budget.py).
        self.budget = BodyBudget(cfg.max_body_bytes_in_flight)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_timeout = graceful_timeout
        self._serving = threading.Event()
        self._sock: socket.socket | None = None
        self._tls_sock: socket.socket | None = None
        self._tls: TlsFiles | None = None
        # Where the TLS handshakes' steps run: threads with HTTPS (tls_stream.Handshakes).
        self._handshakes = ON_LOOP
        self._error: BaseException | None = None
        self.host = ""
        self.port = 0
        self.tls_port = 0  # the HTTPS listener's (http.tls_listen), once started

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind, start serving on a new thread, and return once requests are answered."""
        if self._thread is not None:
            raise RuntimeError("the HTTP server was already started")
        if not self.listen:
            raise HttpBindError("HTTP is disabled (http.listen is empty)")
        cfg = self.runtime.config.http
        if cfg.tls_listen:
            assert cfg.tls_cert_file is not None and cfg.tls_key_file is not None  # config
            try:
                self._tls = TlsFiles(cfg.tls_cert_file, cfg.tls_key_file,
                                     cfg.tls_client_ca_file)
            except TlsConfigError as exc:
                raise HttpBindError(f"HTTPS on {cfg.tls_listen}: {exc}") from None
        sock = _bind(cfg.host, cfg.port, self.listen)
        if cfg.tls_listen:
            try:
                self._tls_sock = _bind(cfg.tls_host, cfg.tls_port, cfg.tls_listen)
            except HttpBindError:
                sock.close()
                raise
            self.tls_port = int(self._tls_sock.getsockname()[1])
        lower_switch_interval(self.switch_interval)
        if self.tune_gc:
            _tune_gc()
        self._sock = sock
        address = sock.getsockname()
        self.host, self.port = str(address[0]), int(address[1])
        thread = self._thread = threading.Thread(
            target=self._run, args=(sock,), name="http-server", daemon=True)
        thread.start()
        while not self._serving.wait(0.05):
            if not thread.is_alive():
                raise HttpBindError(f"the HTTP server on {self.listen} failed to start: "
                                    f"{self._error!r}")
        log.info("HTTP listening on %s (at most %d connections)", self.url,
                 self.connections.cap)
        if self._tls_sock is not None:
            log.info("HTTPS listening on %s:%d (client certificates %s)", cfg.tls_host,
                     self.tls_port,
                     "required" if cfg.tls_client_ca_file is not None else "not asked for")

    def _run(self, sock: socket.socket) -> None:
        if self._tls_sock is not None:
            self._handshakes = Handshakes()
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self._serve(sock))
        except BaseException as exc:  # noqa: BLE001 - reported by start() / stop()
            self._error = exc
            if not self._serving.is_set():
                return
            log.exception("the HTTP server stopped with an error")
        finally:
            self._handshakes.close()

    async def _serve(self, sock: socket.socket) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        publisher = self.app.publisher
        asgi = AsgiRunner(self.app)
        limits, connections, date, budget, handshakes = (
            self.limits, self.connections, DateHeader(), self.budget, self._handshakes)

        def protocol(tls: ssl.SSLContext | None = None) -> HttpProtocol:
            return HttpProtocol(limits=limits, connections=connections, date=date,
                                publish=publisher.publish, body_limit=publisher.body_limit,
                                too_large=publisher.too_large, refused=publisher.refused_early,
                                gone=publisher.gone, asgi=asgi,
                                read_limit=publisher.max_batch_bytes, tls=tls,
                                handshakes=handshakes, budget=budget)

        servers = [await loop.create_server(protocol, sock=sock, backlog=BACKLOG)]
        watching: asyncio.Task[None] | None = None
        if self._tls_sock is not None and self._tls is not None:
            files = self._tls

            def secure() -> HttpProtocol:
                # Plain TCP, admitted under the cap like any connection; each starts TLS
                # itself (tls_stream.start_tls), so handshakes in progress are bounded too. The
                # context is read per connection: a renewed certificate serves new ones.
                return protocol(files.context)

            servers.append(await loop.create_server(secure, sock=self._tls_sock,
                                                    backlog=BACKLOG))
            watching = loop.create_task(_watch(files))
        self._serving.set()
        await self._stop.wait()
        if watching is not None:
            watching.cancel()
        # Graceful stop: no new connections, idle ones closed, the rest after their answer.
        connections.stopping = True
        for server in servers:
            server.close()
        connections.close_idle()
        deadline = loop.time() + self._stop_timeout
        while ((connections.open or publisher.in_flight or asgi.tasks)
               and loop.time() < deadline):
            connections.close_idle()
            await asyncio.sleep(0.01)
        if connections.open or publisher.in_flight:
            log.error("HTTP requests still running after %.0f s; closing them",
                      self._stop_timeout)
        for conn in list(connections.open):
            conn.close()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, finish requests in progress (up to ``timeout`` s), stop."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        timeout = self.graceful_timeout if timeout is None else timeout
        if self.runtime.phase is Phase.RUNNING:
            self.runtime.set_phase(Phase.STOPPING)
        _call(self.app, "drain")
        self._stop_timeout = timeout
        with contextlib.suppress(RuntimeError):  # the loop is closed: stopped before
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout + 5.0)
        if thread.is_alive():
            log.error("the HTTP server did not stop within %.0f s", timeout + 5.0)
        _call(self.app, "close")
        for sock in (self._sock, self._tls_sock):
            if sock is not None:
                sock.close()
        log.info("HTTP server stopped")


async def _watch(files: TlsFiles) -> None:
    """Look at the TLS files every ``tls.CHECK_SECONDS`` (three stat calls on the loop; a
    changed file is loaded there too, once per renewal)."""
    while True:
        await asyncio.sleep(tls_files.CHECK_SECONDS)
        try:
            files.refresh()
        except Exception:  # noqa: BLE001 - keep serving the context there is, keep looking
            log.exception("HTTPS: looking at the TLS files failed")


def _tune_gc() -> None:
    """Process-wide: see agent.process.gc_tuning and GC_GEN0_THRESHOLD."""
    freeze_startup_heap(GC_GEN0_THRESHOLD)


def _call(app: Any, name: str) -> None:
    hook = getattr(app, name, None)
    if callable(hook):
        hook()


def _bind(host: str, port: int, listen: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise HttpBindError(f"cannot listen on {listen}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Lets a restarted agent bind while old connections linger in TIME_WAIT; a port
        # another process listens on is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise HttpBindError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    return sock
