"""Error answers: one JSON shape for every 4xx and 5xx, everywhere on the listener:
``{"error": "<code>", "code": "<code>", "message": "<why>"}``. ``code`` is the field Hermes
clients read (with ``message``); ``error`` is Ferry's older name for it, kept for its own
clients."""

from __future__ import annotations

import json

from agent.ingest.http.ratelimit import retry_after_header

JSON_CONTENT_TYPE = b"application/json"


def error_body(error: str, message: str) -> bytes:
    return json.dumps({"error": error, "code": error, "message": message},
                      ensure_ascii=False).encode()


class Refusal(Exception):
    """A management call refused: its status, machine-readable error, message and any extra
    headers (auth.Refused, management.ApiError)."""

    def __init__(self, status: int, error: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.headers = headers or {}


class HttpError(Exception):
    """A refusal. ``reason`` is the messages_rejected label (None: counted elsewhere or not a
    message); ``close`` ends the connection after the answer (the body may still be coming);
    ``retry_after`` seconds go to Retry-After."""

    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        *,
        reason: str | None = None,
        retry_after: float | None = None,
        close: bool = False,
        count: int = 1,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.reason = reason
        self.retry_after = retry_after
        self.close = close
        self.count = count

    def headers(self, body: bytes) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", JSON_CONTENT_TYPE),
               (b"content-length", str(len(body)).encode())]
        if self.retry_after is not None:
            out.append((b"retry-after", retry_after_header(self.retry_after)))
        if self.close:
            out.append((b"connection", b"close"))
        return out

    def body(self) -> bytes:
        return error_body(self.error, self.message)
