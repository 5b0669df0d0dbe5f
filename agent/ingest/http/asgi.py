"""Runs a request that is not a publish on the ASGI app (Starlette: management, status
probes, /metrics), for ``HttpProtocol``.

These routes see a few requests a second, so convenience wins over microseconds: the body
was read whole by the protocol (bounded by its limit), and the answer is collected whole and
written in one piece with its Content-Length. Nothing these routes answer streams.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from agent.ingest.http.errors import HttpError
from agent.ingest.http.publish import Reply

if TYPE_CHECKING:
    from agent.ingest.http.protocol import HttpProtocol, Request

log = logging.getLogger(__name__)

ASGIApp = Any  # (scope, receive, send) -> awaitable


class AsgiRunner:
    """``run(conn, request, reply)``: the request on ``app``, its answer to ``reply``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.tasks: set[asyncio.Task[None]] = set()

    def __call__(self, conn: HttpProtocol, request: Request, reply: Reply) -> None:
        task = asyncio.get_running_loop().create_task(self._run(conn, request, reply))
        self.tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self.tasks.discard)

    async def _run(self, conn: HttpProtocol, request: Request, reply: Reply) -> None:
        client, server = conn.addresses()
        raw_path, _, query = request.url.partition(b"?")
        raw_path = raw_path.partition(b"#")[0]
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.version,
            "server": server,
            "client": client,
            "scheme": "http",
            "method": request.method.decode("ascii", "replace"),
            "root_path": "",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "headers": request.headers,
            "state": {},
        }
        body_sent = False
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        parts: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await conn.disconnected()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(bytes(n).lower(), bytes(v)) for n, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                parts.append(bytes(message.get("body", b"")))

        try:
            await self.app(scope, receive, send)
        except Exception:  # noqa: BLE001 - a bug: answered 500 and logged
            log.exception("%s %s failed", scope["method"], scope["path"])
            if status == 0:
                error = HttpError(500, "internal_error", "Ferry failed to handle this "
                                  "request; the error is in Ferry's log.", close=True)
                body = error.body()
                reply(500, error.headers(body), body)
                return
        if status == 0:
            error = HttpError(500, "internal_error", "the request was not answered; the "
                              "error is in Ferry's log.", close=True)
            log.error("%s %s: the app gave no answer", scope["method"], scope["path"])
            body = error.body()
            reply(500, error.headers(body), body)
            return
        body = b"".join(parts)
        if not any(name == b"content-length" for name, _ in headers):
            headers.append((b"content-length", str(len(body)).encode()))
        reply(status, headers, body)
