"""Ferry's publish logic served by granian's embedded server (``granian.server.embed``).

``GranianStage`` is an agent stage like ``HttpServer`` (``start()``/``stop()``): its own thread
runs a uvloop event loop, and granian's embedded ``Server`` serves on it, so the
``Publisher`` binds to that loop exactly as it does under Ferry's protocol. Two interfaces:

- ``rsgi``: ``RsgiPublish``, a thin RSGI adapter: a ``POST /topics/{topic}[/batch]`` reads
  its whole body (``await proto()``) and goes to ``Publisher.publish``, whose reply callback
  writes the answer with ``proto.response_bytes``; any other route is 404 here (the
  benchmark publishes only); a gzip body is decoded first (gzip_front.py).
- ``asgi``: the ``FerryApp`` itself (publishing through ``Publisher.__call__``, everything
  else through Starlette) behind ``GzipFront``, on granian's ASGI interface without lifespan.

``tls`` (certificate and key files) serves HTTPS instead of plain HTTP on the same port.

Granian's HTTP/1 settings stand in for Ferry's limits where it has one (header read
timeout, buffer size); the benchmark does not need the rest.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from agent.ingest.http.app import FerryApp
from agent.ingest.http.errors import HttpError
from agent.ingest.http.publish import Headers, header_pairs
from agent.ingest.runtime import Runtime
from http_candidates.embedded import EmbeddedStage
from http_candidates.gzip_front import GZIP, GzipFront, decode

log = logging.getLogger(__name__)

_PREFIX = "/topics/"
_NOT_FOUND = b'{"error":"not_found","code":"not_found","message":"publishes only here"}'


class RsgiPublish:
    """RSGI app: publishes go to ``Publisher.publish`` with their whole body."""

    def __init__(self, app: FerryApp) -> None:
        self.publisher = app.publisher

    async def __call__(self, scope: Any, proto: Any) -> None:
        if scope.proto != "http":
            return
        target = _publish_target(scope.method, scope.path)
        if target is None:
            proto.response_bytes(404, [("content-type", "application/json")], _NOT_FOUND)
            return
        topic, batch = target
        body = await proto()
        headers = [(k.encode("latin-1"), v.encode("latin-1"))
                   for k, v in scope.headers.items()]
        encoding = scope.headers.get("content-encoding")
        if encoding is not None and encoding.lower().encode() in GZIP:
            try:
                body = await decode(body, self.publisher.body_limit(topic, batch))
            except HttpError as exc:
                answer = exc.body()
                proto.response_bytes(exc.status, [("content-type", "application/json")],
                                     answer)
                return
            headers = [(k, v) for k, v in headers
                       if k not in (b"content-encoding", b"content-length")]
        answered: asyncio.Future[tuple[int, Headers, bytes]] = (
            asyncio.get_running_loop().create_future())

        def reply(status: int, out: Headers, answer: bytes) -> None:
            if not answered.done():
                answered.set_result((status, out, answer))

        self.publisher.publish(topic, batch, headers, body, reply)
        status, out, answer = await answered
        proto.response_bytes(status, [(k.decode("latin-1"), v.decode("latin-1"))
                                      for k, v in header_pairs(out)
                                      if k.lower() != b"content-length"], answer)


def _publish_target(method: str, path: str) -> tuple[str, bool] | None:
    if method != "POST" or not path.startswith(_PREFIX):
        return None
    rest = path[len(_PREFIX):]
    slash = rest.find("/")
    if slash < 0:
        return (rest, False) if rest else None
    if slash > 0 and rest[slash:] == "/batch":
        return rest[:slash], True
    return None


class GranianStage(EmbeddedStage):
    """The agent's HTTP stage on granian: ``interface`` is ``"rsgi"`` or ``"asgi"``."""

    NAME = "granian"

    def __init__(self, runtime: Runtime, interface: str = "rsgi",
                 tls: tuple[str, str] | None = None) -> None:
        super().__init__(runtime, tls)
        self.interface = interface
        self._server: Any = None

    async def _serve(self) -> None:
        from granian.constants import Interfaces, SSLProtocols
        from granian.http import HTTP1Settings
        from granian.server.embed import Server

        target: Any = (RsgiPublish(self.app) if self.interface == "rsgi"
                       else GzipFront(self.app))
        interface = Interfaces.RSGI if self.interface == "rsgi" else Interfaces.ASGINL
        cfg = self.runtime.config.http
        self._server = Server(
            target, address=self.host, port=self.port, interface=interface,
            backlog=2048, log_enabled=False, websockets=False,
            http1_settings=HTTP1Settings(
                header_read_timeout=int(cfg.header_timeout_seconds * 1000),
                max_buffer_size=cfg.max_header_bytes + 4096),
            **({"ssl_cert": Path(self.tls[0]), "ssl_key": Path(self.tls[1]),
                "ssl_protocol_min": SSLProtocols.tls12} if self.tls else {}))
        # serve() binds before it awaits anything long: wait until the port answers.
        await self._until_up(asyncio.ensure_future(self._server.serve()))

    def _end_serving(self) -> None:
        if self._server is not None:
            self._server.stop()
