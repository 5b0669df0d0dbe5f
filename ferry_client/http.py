"""Publish messages to Ferry over HTTP: ``POST /topics/{topic}``, retried safely.

::

    from ferry_client import FerryHttp

    with FerryHttp("http://127.0.0.1:9090") as ferry:
        answer = ferry.publish("orders", b'{"id": 1}', content_type="application/json")
        answer.id, answer.delivered   # delivered: Kafka acknowledged it too (201)

An answer (201 or 202) means the message is committed to Ferry's disk buffer. Failures that
a later attempt can fix (no connection, a timeout, 503 while Ferry starts, stops or is full,
429 over a rate limit, 408) are retried with exponential back-off and jitter, waiting at
least what ``Retry-After`` asks, up to ``attempts`` tries. Every try of one publish carries
the same ``Idempotency-Key`` (a random one unless given), so a retry after an answer that was
lost stores nothing twice: Ferry replays the first answer. Other refusals (400, 404, 413,
415, 422) raise :class:`PublishRejected` at once; retrying cannot help them.

Standard library only (``http.client``), like the rest of this package: the back-off is a
dozen lines here rather than a dependency in every application that sends to Ferry.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from ferry_client.topic_names import illegal_topic, is_legal_topic

__all__ = ["FerryHttp", "PublishError", "PublishFailed", "PublishRejected", "Published",
           "publish"]

# Answers worth another try: not accepting work yet/any more/for now (503), over the rate
# limit (429), the body not received in time (408).
RETRYABLE_STATUSES = frozenset({408, 429, 503})
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# How a keep-alive connection the server has closed fails when used again.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


@dataclass(frozen=True)
class Published:
    """Ferry's answer to a publish: the message ``id``; ``delivered`` when Kafka acknowledged
    it too (201), else it is committed to Ferry's buffer (202); ``replayed`` when this was
    the answer to an earlier request with the same ``idempotency_key``."""

    id: str
    delivered: bool
    status: int
    replayed: bool
    idempotency_key: str | None
    attempts: int


class PublishError(Exception):
    """A publish that did not succeed; nothing is known to be stored."""


class PublishRejected(PublishError):
    """Ferry refused the message for a reason retrying cannot fix (``status`` and Ferry's
    ``error`` code, e.g. 413 ``too_large``; docs/http.md lists them)."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(f"Ferry refused the message: {status} {error}: {message}")
        self.status, self.error, self.message = status, error, message


class PublishFailed(PublishError):
    """Every attempt failed with something retryable (``last`` says what, last time). The
    message may still have been stored by an attempt whose answer was lost: publishing it
    again with the same ``idempotency_key`` is safe."""

    def __init__(self, attempts: int, last: str, idempotency_key: str | None) -> None:
        super().__init__(f"publish failed after {attempts} attempt(s); last: {last}")
        self.attempts, self.last, self.idempotency_key = attempts, last, idempotency_key


class FerryHttp:
    """A keep-alive connection to Ferry's HTTP listener at ``base_url``
    (``http://host:port``). Not thread-safe: one per thread.

    ``timeout`` bounds each attempt's connect and each read; ``attempts`` (>= 1) bounds the
    tries of one publish; between tries it sleeps ``backoff * 2**n`` seconds with full jitter,
    capped at ``backoff_max``, but at least a ``Retry-After`` the answer gave (also capped).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        attempts: int = 5,
        backoff: float = 0.1,
        backoff_max: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url {base_url!r} must look like http://host:port")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, not {attempts}")
        if timeout <= 0 or backoff < 0 or backoff_max < 0:
            raise ValueError("timeout must be > 0, backoff and backoff_max >= 0")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout, self.attempts = timeout, attempts
        self.backoff, self.backoff_max = backoff, backoff_max
        self._sleep = sleep
        self._conn: http.client.HTTPConnection | None = None

    def publish(
        self,
        topic: str,
        value: bytes,
        *,
        key: str | None = None,
        partition_key: int | None = None,
        content_type: str | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Published:
        """Publish one message to ``topic``; returns once Ferry committed it to disk.

        ``key`` becomes the Kafka record key (``Partition-Key``); ``partition_key`` a 32-bit
        Bruce-style partition key (``Ferry-Partition-Key``). ``idempotency_key`` defaults to a
        random one when more than one attempt is allowed. ``headers`` go as they are
        (allow-listed ones become Kafka headers). Raises :class:`ValueError` for a bad
        argument, :class:`PublishRejected` or :class:`PublishFailed`.
        """
        if not is_legal_topic(topic):
            raise ValueError(illegal_topic(topic))
        if not isinstance(value, bytes | bytearray | memoryview):
            raise ValueError(f"value must be bytes, not {type(value).__name__}")
        send: dict[str, str] = dict(headers or {})
        if key is not None:
            if not key:
                raise ValueError("key must not be empty (omit it for no key)")
            send["Partition-Key"] = key
        if partition_key is not None:
            if (not isinstance(partition_key, int) or isinstance(partition_key, bool)
                    or not _INT32_MIN <= partition_key <= _INT32_MAX):
                raise ValueError(f"partition_key {partition_key!r} is not a signed 32-bit "
                                 "integer")
            send["Ferry-Partition-Key"] = str(partition_key)
        if content_type is not None:
            send["Content-Type"] = content_type
        if idempotency_key is None and self.attempts > 1:
            idempotency_key = uuid.uuid4().hex
        if idempotency_key is not None:
            if not 1 <= len(idempotency_key) <= 255 or not all(
                    "!" <= c <= "~" for c in idempotency_key):
                raise ValueError("idempotency_key must be 1-255 visible ASCII characters")
            send["Idempotency-Key"] = idempotency_key
        return self._post(f"{self._prefix}/topics/{topic}", bytes(value), send,
                          idempotency_key)

    def _post(self, path: str, body: bytes, headers: dict[str, str],
              idempotency_key: str | None) -> Published:
        last = ""
        for attempt in range(1, self.attempts + 1):
            retry_after: float | None = None
            try:
                resend: tuple[type[Exception], ...] = (
                    _STALE if self._conn is not None and idempotency_key is not None else ())
                try:
                    status, answer, reply_headers = self._request(path, body, headers)
                except resend:
                    # Ferry closes idle keep-alive connections (http.keep_alive_seconds); the
                    # first request on one it just closed fails so. Again at once on a fresh
                    # connection, not counted as an attempt: the key makes it safe.
                    self.close()
                    status, answer, reply_headers = self._request(path, body, headers)
            except (OSError, http.client.HTTPException) as exc:
                self.close()  # the connection's state is unknown: start afresh
                last = f"{type(exc).__name__}: {exc}"
            else:
                if status in (200, 201, 202):
                    return Published(
                        id=str(answer.get("id", reply_headers.get("ferry-message-id", ""))),
                        delivered=status == 201,
                        status=status,
                        replayed=reply_headers.get("idempotent-replayed") == "true",
                        idempotency_key=idempotency_key,
                        attempts=attempt,
                    )
                error = str(answer.get("error", "")) or http.client.responses.get(status, "")
                message = str(answer.get("message", ""))
                if status not in RETRYABLE_STATUSES:
                    raise PublishRejected(status, error, message)
                last = f"{status} {error}: {message}"
                retry_after = _seconds(reply_headers.get("retry-after"))
            if attempt < self.attempts:
                delay = random.uniform(0, min(self.backoff_max, self.backoff * 2 ** (attempt - 1)))
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.backoff_max))
                self._sleep(delay)
        raise PublishFailed(self.attempts, last, idempotency_key)

    def _request(self, path: str, body: bytes, headers: dict[str, str]
                 ) -> tuple[int, dict[str, object], dict[str, str]]:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
        self._conn.request("POST", path, body=body, headers=headers)
        response = self._conn.getresponse()
        raw = response.read()
        reply_headers = {k.lower(): v for k, v in response.getheaders()}
        if response.will_close:
            self.close()
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        return response.status, answer, reply_headers

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> FerryHttp:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def publish(
    base_url: str,
    topic: str,
    value: bytes,
    *,
    key: str | None = None,
    partition_key: int | None = None,
    content_type: str | None = None,
    idempotency_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
    attempts: int = 5,
) -> Published:
    """Publish one message on a fresh connection; see :meth:`FerryHttp.publish`.

    Convenient for scripts; a program that publishes many messages should keep one
    :class:`FerryHttp` open instead.
    """
    with FerryHttp(base_url, timeout=timeout, attempts=attempts) as ferry:
        return ferry.publish(topic, value, key=key, partition_key=partition_key,
                             content_type=content_type, idempotency_key=idempotency_key,
                             headers=headers)


def _seconds(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        return None  # an HTTP date: Ferry never sends one
    return seconds if seconds >= 0 else None
