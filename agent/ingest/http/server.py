"""``HttpServer``: uvicorn (uvloop + httptools) on its own thread and event loop.

The daemon owns the process's signals, so uvicorn installs none (it never does off the main
thread). The listening socket is bound here, before the thread starts, so a taken port is a
clear error from ``start()`` rather than a log line from another thread, and port 0 works:
``port`` tells the port the kernel chose.

Responses leave in one write per connection and loop iteration (``_CorkedTransport``). The
GIL switch interval is lowered while HTTP is served (agent/ingest/gil.py), for the writer
thread's sake, and the startup heap is frozen out of garbage collections
(``GC_GEN0_THRESHOLD``), for the tail latency's.

``stop()`` is graceful: readiness turns 503 and publishing refuses new work at once, uvicorn
stops accepting connections, closes idle ones and lets requests in progress finish (their
commits complete, so the buffer is consistent), then the loop ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
from typing import Any

import uvicorn
import uvloop
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agent.gc_tuning import freeze_startup_heap
from agent.ingest.gil import SWITCH_INTERVAL, lower_switch_interval
from agent.runtime import Phase, Runtime

log = logging.getLogger(__name__)

START_TIMEOUT = 15.0
BACKLOG = 2048
# The cyclic garbage collector while HTTP is served. Requests in flight hold ~20 tracked
# objects each, so with tens of connections the young generation crosses CPython's default
# threshold (700) all the time: ~280 collections/s, each walking the live requests (~3 % of
# the CPU). Worse, every ~0.4 s a full collection walked everything the process had built
# at startup (modules, settings, the app): 12-15 ms with the GIL held, which was the
# publishes' p99. So the startup heap is frozen out of collections (gc.freeze, after one
# collect) and the young threshold raised. Measured (bench_http.py, 2 vCPUs): p99
# 12.6-13.4 ms -> 4.0-5.0 ms, 14,000-14,900 -> 15,100-16,400 req/s.
GC_GEN0_THRESHOLD = 10_000


class HttpBindError(RuntimeError):
    """The listener cannot be opened (port taken, address not local, ...)."""


class _Flusher:
    """Flushes every corked connection that wrote in a loop iteration, with one callback."""

    __slots__ = ("loop", "_dirty")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._dirty: list[_CorkedTransport] = []

    def add(self, corked: _CorkedTransport) -> None:
        if not self._dirty:
            self.loop.call_soon(self._run)
        self._dirty.append(corked)

    def _run(self) -> None:
        dirty, self._dirty = self._dirty, []
        for corked in dirty:
            try:
                corked.flush()
            except Exception:  # noqa: BLE001 - one broken connection must not hold the rest
                log.debug("dropping the answer to a connection that failed", exc_info=True)


class _CorkedTransport:
    """Hands a connection's writes of one loop iteration to the socket as one write.

    uvicorn writes a response's status line and headers, then its body, as two writes; on
    loopback TCP each write is a packet the kernel delivers right away, which costs more than
    the publish handler itself (measured: ~30 us of ~75 us per small request). Collecting the
    writes and flushing them once, later in the same loop iteration, sends one packet. One
    ``_Flusher`` callback per iteration flushes all connections that wrote.
    """

    __slots__ = ("_transport", "_pending", "_flusher")

    def __init__(self, transport: asyncio.Transport, flusher: _Flusher) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._flusher = flusher

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._flusher.add(self)
        self._pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if pending:
            self._pending = []
            if self._transport.is_closing():
                return  # the peer went away (reset) before its answer left: nobody to tell
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, corked, with a deadline for a request's headers.

    uvicorn times out a connection idle *after* a response (keep-alive) and a body that stops
    arriving, but not a connection that never sends a request or stops halfway through its
    headers: each such connection would hold a descriptor for good, and enough of them (a
    slow or broken client, a port scanner) starve the listener. The deadline runs from the
    connection's start, and from each response's end, to the end of the next request's
    headers.

    One timer per connection, not per request: a request only notes when the connection
    started waiting for headers (``_waiting_since``, None while a request is past its
    headers). When the timer fires it closes the connection if that wait is over the limit,
    and otherwise sleeps again for what is left of it.
    """

    header_timeout: float = 10.0  # set per server by ``_protocol_class``
    _flusher: _Flusher | None = None  # per server class: one server, one loop
    _header_deadline: asyncio.TimerHandle | None = None
    _waiting_since: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        flusher = type(self)._flusher
        if flusher is None or flusher.loop is not loop:
            flusher = type(self)._flusher = _Flusher(loop)
        corked = _CorkedTransport(transport, flusher)
        super().connection_made(corked)  # type: ignore[arg-type]
        self._wait_for_headers()

    def on_headers_complete(self) -> None:
        self._waiting_since = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # uvicorn starts the next pipelined request here, if one is waiting: its headers are
        # in, and it runs now, so there are no headers to wait for until it has answered.
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        super().connection_lost(exc)

    def _wait_for_headers(self) -> None:
        self._waiting_since = self.loop.time()
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout,
                                                         self._check_headers)

    def _check_headers(self) -> None:
        self._header_deadline = None
        since = self._waiting_since
        if since is None or self.transport.is_closing():
            return  # a request is past its headers; its response starts the next wait
        left = since + self.header_timeout - self.loop.time()
        if left > 0:
            self._header_deadline = self.loop.call_later(left, self._check_headers)
        else:
            self.transport.close()


def _protocol_class(header_timeout: float) -> type[_Protocol]:
    return type("_Protocol", (_Protocol,), {"header_timeout": header_timeout})


class _Server(uvicorn.Server):
    """uvicorn's server, telling us once it is serving."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.serving = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.serving.set()


class HttpServer:
    """The HTTP listener of ``runtime.config.http.listen``, serving ``app``."""

    def __init__(self, runtime: Runtime, app: ASGIApp, *, graceful_timeout: float = 10.0,
                 switch_interval: float | None = SWITCH_INTERVAL, tune_gc: bool = True
                 ) -> None:
        self.runtime = runtime
        self.switch_interval = switch_interval
        self.tune_gc = tune_gc
        self.app = app
        self.listen = runtime.config.http.listen
        self.graceful_timeout = graceful_timeout
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None
        self.host = ""
        self.port = 0

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
        sock = _bind(cfg.host, cfg.port, self.listen)
        lower_switch_interval(self.switch_interval)
        if self.tune_gc:
            _tune_gc()
        self._sock = sock
        address = sock.getsockname()
        self.host, self.port = str(address[0]), int(address[1])
        config = uvicorn.Config(
            self.app,
            http=_protocol_class(cfg.header_timeout_seconds),
            ws="none",
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,
            log_config=None,
            access_log=False,
            server_header=False,
            backlog=BACKLOG,
            timeout_graceful_shutdown=math.ceil(self.graceful_timeout),
        )
        server = self._server = _Server(config)
        thread = self._thread = threading.Thread(
            target=self._run, args=(server, sock), name="http-server", daemon=True)
        thread.start()
        while not server.serving.wait(0.05):
            if not thread.is_alive():
                raise HttpBindError(f"the HTTP server on {self.listen} failed to start: "
                                    f"{self._error!r}")
        log.info("HTTP listening on %s", self.url)

    def _run(self, server: _Server, sock: socket.socket) -> None:
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by start() / stop()
            self._error = exc
            if not server.serving.is_set():
                return
            log.exception("the HTTP server stopped with an error")

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, finish requests in progress (up to ``timeout`` s), stop."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        timeout = self.graceful_timeout if timeout is None else timeout
        if self.runtime.phase is Phase.RUNNING:
            self.runtime.set_phase(Phase.STOPPING)
        _call(self.app, "drain")
        server.config.timeout_graceful_shutdown = max(1, math.ceil(timeout))
        server.should_exit = True
        thread.join(timeout + 2.0)
        if thread.is_alive():
            log.error("HTTP requests still running after %.0f s; closing them", timeout)
            server.force_exit = True
            thread.join(5.0)
        _call(self.app, "close")
        if self._sock is not None:
            self._sock.close()
        log.info("HTTP server stopped")


def _tune_gc() -> None:
    """Process-wide: see agent.gc_tuning and GC_GEN0_THRESHOLD."""
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
