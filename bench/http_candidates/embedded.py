"""What every candidate HTTP stage shares: an agent stage (``start()``/``stop()``) whose own
thread runs a uvloop event loop with the candidate server on it, so the ``Publisher`` binds to
that loop exactly as it does under Ferry's protocol.

A subclass names itself (``NAME``), serves in ``_serve()`` (calling ``_until_up`` once its
server task exists) and ends that serving in ``_end_serving()``, on the loop.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from typing import Any

from agent.ingest.http.app import create_app
from agent.ingest.runtime import Runtime

log = logging.getLogger(__name__)


class EmbeddedStage(abc.ABC):
    NAME = "candidate"

    def __init__(self, runtime: Runtime, tls: tuple[str, str] | None = None) -> None:
        self.runtime = runtime
        self.tls = tls
        self.app = create_app(runtime)
        self.host, self.port = runtime.config.http.host, runtime.config.http.port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        # The same process-wide tuning HttpServer.start() makes, so the comparison is of
        # the servers alone: the GIL switch interval lowered for the writer thread's sake,
        # the startup heap frozen out of garbage collections (agent/ingest/http/server.py).
        from agent.ingest.gil import SWITCH_INTERVAL, lower_switch_interval
        from agent.ingest.http.server import GC_GEN0_THRESHOLD
        from agent.process.gc_tuning import freeze_startup_heap

        lower_switch_interval(SWITCH_INTERVAL)
        freeze_startup_heap(GC_GEN0_THRESHOLD)
        self._thread = threading.Thread(target=self._run, name=f"http-{self.NAME}",
                                        daemon=True)
        self._thread.start()
        if not self._serving.wait(30):
            raise RuntimeError(f"{self.NAME} did not start: {self._error!r}")

    def _run(self) -> None:
        import uvloop

        try:
            uvloop.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            log.exception("%s stopped with an error", self.NAME)

    @abc.abstractmethod
    async def _serve(self) -> None:
        """Run the candidate server on this loop until ``_end_serving``."""

    async def _until_up(self, serving: asyncio.Future[Any]) -> None:
        """Wait until the port answers (or the server failed), then serve until it ends."""
        self._loop = asyncio.get_running_loop()
        while not await _accepts(self.host, self.port):
            if serving.done():
                serving.result()
            await asyncio.sleep(0.05)
        self._serving.set()
        await serving

    @abc.abstractmethod
    def _end_serving(self) -> None:
        """Make ``_serve`` return (called on the loop)."""

    def stop(self, timeout: float | None = None) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self.app.drain()
        loop.call_soon_threadsafe(self._end_serving)
        thread.join(timeout or 15.0)
        self.app.close()


async def _accepts(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    return True
