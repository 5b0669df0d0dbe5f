"""Ferry's app served by hypercorn (h11 for HTTP/1.1) on the agent's own uvloop thread.

``HypercornStage`` is an agent stage like ``HttpServer`` and ``GranianStage``: its thread runs
a uvloop event loop and ``hypercorn.asyncio.serve`` on it, serving the ``FerryApp`` over ASGI
(publishes through ``Publisher.__call__``, everything else through Starlette) behind
``GzipFront`` (gzip_front.py). Hypercorn's settings stand in for Ferry's limits where it has
one: keep-alive timeout, h11's incomplete-event size (the header limit), the read timeout
(the header deadline; hypercorn applies it to every read); ``tls`` serves HTTPS instead of
plain HTTP on the same port.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from agent.ingest.http.app import create_app
from agent.ingest.runtime import Runtime
from http_candidates.gzip_front import GzipFront

log = logging.getLogger(__name__)


class HypercornStage:
    def __init__(self, runtime: Runtime, tls: tuple[str, str] | None = None) -> None:
        self.runtime = runtime
        self.app = create_app(runtime)
        self.tls = tls
        self.host, self.port = runtime.config.http.host, runtime.config.http.port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._serving = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        # The process-wide tuning HttpServer.start() makes (see granian_stage.py).
        from agent.ingest.gil import SWITCH_INTERVAL, lower_switch_interval
        from agent.ingest.http.server import GC_GEN0_THRESHOLD
        from agent.process.gc_tuning import freeze_startup_heap

        lower_switch_interval(SWITCH_INTERVAL)
        freeze_startup_heap(GC_GEN0_THRESHOLD)
        self._thread = threading.Thread(target=self._run, name="http-hypercorn", daemon=True)
        self._thread.start()
        if not self._serving.wait(30):
            raise RuntimeError(f"hypercorn did not start: {self._error!r}")

    def _run(self) -> None:
        import uvloop

        try:
            uvloop.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            log.exception("hypercorn stopped with an error")

    async def _serve(self) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        cfg = self.runtime.config.http
        config = Config()
        config.bind = [f"{self.host}:{self.port}"]
        config.backlog = 2048
        config.accesslog = None
        config.errorlog = None
        config.keep_alive_timeout = cfg.keep_alive_seconds
        config.read_timeout = int(cfg.header_timeout_seconds)
        config.h11_max_incomplete_size = cfg.max_header_bytes
        config.include_server_header = False
        if self.tls is not None:
            config.certfile, config.keyfile = self.tls
        serving = asyncio.ensure_future(serve(GzipFront(self.app), config,  # type: ignore[arg-type]
                                              shutdown_trigger=self._stopping.wait))
        while not await _accepts(self.host, self.port):
            if serving.done():
                serving.result()
            await asyncio.sleep(0.05)
        self._serving.set()
        await serving

    def stop(self, timeout: float | None = None) -> None:
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if loop is None or stopping is None or thread is None:
            return
        self.app.drain()
        loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout or 15.0)
        self.app.close()


async def _accepts(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    return True

