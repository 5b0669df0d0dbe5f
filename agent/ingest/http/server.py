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
from collections.abc import Callable
from typing import Any

import uvicorn
import uvloop
from starlette.types import ASGIApp

from agent.gc_tuning import freeze_startup_heap
from agent.ingest.gil import SWITCH_INTERVAL, lower_switch_interval
from agent.ingest.http.protocol import protocol_class
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


class _Server(uvicorn.Server):
    """uvicorn's server, telling us once it is serving, and waiting at shutdown for the
    app's own work in progress (``in_flight``: direct publishes, see protocol.py) as it
    waits for connections and its tasks (within ``timeout_graceful_shutdown``)."""

    def __init__(self, config: uvicorn.Config, in_flight: Callable[[], int]) -> None:
        super().__init__(config)
        self.serving = threading.Event()
        self.in_flight = in_flight

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.serving.set()

    async def _wait_tasks_to_complete(self) -> None:
        await super()._wait_tasks_to_complete()
        while self.in_flight() and not self.force_exit:
            await asyncio.sleep(0.01)


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
            http=protocol_class(cfg.header_timeout_seconds,
                                getattr(self.app, "publish_direct", None)),
            ws="none",
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=cfg.keep_alive_seconds,  # type: ignore[arg-type]
            backlog=BACKLOG,
            timeout_graceful_shutdown=math.ceil(self.graceful_timeout),
        )
        in_flight = getattr(self.app, "in_flight", None)
        server = self._server = _Server(config, in_flight if callable(in_flight) else _none)
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


def _none() -> int:
    return 0


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
