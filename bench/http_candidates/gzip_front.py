"""``Content-Encoding: gzip`` for the candidate servers, as a switch would have to bring it.

Ferry decodes a gzip publish in its own protocol (``HttpProtocol._decode``), not in the
``Publisher``: an ASGI or RSGI server hands the app the encoded bytes, and the app would
store them as they are. So the candidates get the same decoder (``GzipBody``: linear in the
body, a few milliseconds a step, the loop free in between), here:

- ``decode(body, limit)``: the decoded body, stepping on the running loop;
- ``GzipFront``: an ASGI wrapper that reads a gzip publish whole, decodes it, and hands the
  app the decoded body with the encoding header removed.

What Ferry's protocol adds and this does not: the global body budget (a 503 when the bodies
in flight are over ``http.max_body_bytes_in_flight``) and counting the refusal by route.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent import reasons
from agent.ingest.http.errors import HttpError
from agent.ingest.http.gunzip import GzipBody
from agent.ingest.http.routing import publish_target

GZIP = (b"gzip", b"x-gzip")


async def decode(body: bytes, limit: int) -> bytes:
    job = GzipBody(body, limit, lambda n: True)
    while (out := job.run()) is None:
        await asyncio.sleep(0)
    return out


class GzipFront:
    """ASGI: a publish whose Content-Encoding is gzip reaches ``app`` decoded."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.publisher = app.publisher

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        target = publish_target(scope["path"])
        encoding = next((v.lower() for k, v in scope["headers"] if k == b"content-encoding"),
                        None)
        if target is None or encoding is None:
            await self.app(scope, receive, send)
            return
        topic, batch = target
        limit = self.publisher.body_limit(topic, batch)
        try:
            if encoding not in GZIP:
                raise HttpError(415, reasons.UNSUPPORTED_CONTENT_ENCODING,
                                f"Content-Encoding {encoding!r} is not supported")
            parts: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return
                size += len(message.get("body", b""))
                if size > max(limit, 1024) * 4:
                    # Ferry bounds the encoded body by the body budget; four times the
                    # decoded limit stands in for it here.
                    raise HttpError(413, reasons.TOO_LARGE, "the encoded body is too large")
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            body = await decode(b"".join(parts), limit)
        except HttpError as exc:
            answer = exc.body()
            await send({"type": "http.response.start", "status": exc.status,
                        "headers": exc.headers(answer)})
            await send({"type": "http.response.body", "body": answer})
            return
        headers = [(k, v) for k, v in scope["headers"]
                   if k not in (b"content-encoding", b"content-length")]
        headers.append((b"content-length", b"%d" % len(body)))
        sent = False

        async def decoded() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, decoded, send)

