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

from agent.ingest.runtime import Runtime
from http_candidates.embedded import EmbeddedStage
from http_candidates.gzip_front import GzipFront


class HypercornStage(EmbeddedStage):
    NAME = "hypercorn"

    def __init__(self, runtime: Runtime, tls: tuple[str, str] | None = None) -> None:
        super().__init__(runtime, tls)
        self._stopping: asyncio.Event | None = None

    async def _serve(self) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

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
        await self._until_up(asyncio.ensure_future(
            serve(GzipFront(self.app), config,  # type: ignore[arg-type]
                  shutdown_trigger=self._stopping.wait)))

    def _end_serving(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
