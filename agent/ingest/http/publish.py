"""``POST /topics/{topic}`` and ``POST /topics/{topic}/batch``: the publish fast path.

Raw ASGI, no framework: per request it reads the headers once, reads the body (bounded in
size and time), checks and converts it for the topic, and hands the records to the group
committer without blocking the event loop. It answers once the commit is durable:

- 202 Accepted: on disk and fsynced in Ferry's buffer; the forwarder will deliver it.
- 201 Created: additionally acknowledged by Kafka within the topic's ``ack_timeout_ms``.

Both carry the message id in ``Ferry-Message-Id`` and ``Hermes-Message-Id``; a batch answers
with every id, in order, in its JSON body. Refusals are JSON errors (see errors.py) and are
counted as ``messages_rejected{source="http", reason}``. docs/http.md is the reference.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum, auto
from typing import Any, assert_never

from agent import reasons
from agent.buffer import keys
from agent.buffer.committer import Result, ShuttingDown
from agent.buffer.store import BufferFull, BufferUnavailable, InvalidGroup
from agent.config import TopicConfig
from agent.ingest import kafka_limits
from agent.ingest.http import idempotency as idem
from agent.ingest.http.codecs import (
    BodyError,
    Codecs,
    MediaTypeError,
    SchemaUnusable,
    TooManyMessages,
    TopicCodec,
    media_type,
)
from agent.ingest.http.counters import LocalCounters
from agent.ingest.http.deadlines import BodyDeadlines
from agent.ingest.http.delivery import (
    CompletionBridge,
    DeliveryWatcher,
    Locate,
    Wait,
    store_locate,
)
from agent.ingest.http.errors import JSON_CONTENT_TYPE, HttpError
from agent.ingest.http.ratelimit import RateLimiter
from agent.ingest.runtime import Phase, Runtime
from agent.records import Record, Source
from agent.signals.ack import socket_path as ack_socket_path
from agent.signals.limits import Limit
from agent.topics import TopicCatalog, valid_topic
from ferry_client.topic_names import illegal_topic

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# A body over this that must be parsed (a batch, or a single message of a json or avro
# topic) is converted on a thread of its own, not on the event loop: converting a 4 MiB
# batch held every other client for seconds (#37 N6). The thread gives the loop the GIL
# every switch interval (1 ms, gil.py) between the values it parses.
OFF_LOOP_BYTES = 64 * 1024

# Refusals of a request whose body is still coming keep the connection (httptools reads and
# drops the rest of a declared body) unless that body is bigger than this.
_DRAIN_LIMIT = 4 * 1024 * 1024
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
RETRY_STARTING = 1.0
RETRY_STOPPING = 5.0
RETRY_FULL = 5.0
RETRY_BUSY = 1.0

_SOURCE = (("source", Source.HTTP),)


class Publisher:
    """The publish handler. One per app; binds to the event loop that first calls it."""

    def __init__(
        self,
        runtime: Runtime,
        catalog: TopicCatalog,
        *,
        codecs: Codecs | None = None,
        limiter: RateLimiter | None = None,
        locate: Locate | None = None,
        poll_interval: float = 0.003,
    ) -> None:
        cfg = runtime.config.http
        self.runtime = runtime
        self.committer = runtime.committer
        self.catalog = catalog
        self.codecs = codecs or Codecs()
        self.limiter = limiter or RateLimiter()
        self.idempotency = idem.Idempotency(runtime.store, cfg.idempotency_window_seconds)
        self.body_timeout = cfg.body_timeout_seconds
        self.max_batch_bytes = cfg.max_batch_bytes
        self.max_batch_messages = cfg.max_batch_messages
        self._converter: concurrent.futures.ThreadPoolExecutor | None = None
        self.internal_topics = frozenset(cfg.internal_topics)
        # Allow-listed request headers -> Kafka header names (spelled as configured).
        self.allowlist = {n.lower().encode("latin-1"): n for n in cfg.header_allowlist}
        self.track = runtime.store.track
        self.locate = locate or store_locate(runtime.store)
        self.poll_interval = poll_interval
        # The forwarder signals recorded acknowledgements here (agent/signals/ack.py); a
        # test's own ``locate`` has no forwarder behind it: it is polled.
        self.signal_path = (ack_socket_path(runtime.config.buffer.path) if locate is None
                            else None)
        self.counters = LocalCounters(runtime.registry)
        self.deadlines = BodyDeadlines()
        # What a Kafka topic can never take is refused here (agent/ingest/kafka_limits.py).
        # Telling whether a message fits compressed is CPU work of milliseconds, for the
        # rare message over the limit uncompressed: on a thread of its own, one at a time.
        self.kafka_limits = runtime.limits
        self._sizing: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bridge: CompletionBridge | None = None
        self._watcher: DeliveryWatcher | None = None
        self._inflight: dict[bytes, asyncio.Future[None]] = {}
        # Requests of this loop iteration waiting to be handed to the writer together.
        self._queue: list[tuple[list[Record], _Derive | None, _Done]] = []
        # Publishes on callbacks, and on tasks (held here: the loop keeps only weak
        # references to tasks), not answered yet.
        self._pending = 0
        self._tasks: set[asyncio.Task[_Outcome]] = set()

    # -- loop binding ----------------------------------------------------------------------
    def _bind(self) -> tuple[CompletionBridge, DeliveryWatcher]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._bridge is None or self._watcher is None:
            if self._watcher is not None:
                self._watcher.close()
            if self._loop is not None:
                # Another loop: what was pending on the old one will never complete here.
                self._inflight = {}
                self._queue = []
                self._pending = 0
                self._tasks = set()
            self._loop = loop
            self._bridge = CompletionBridge(loop)
            self._watcher = DeliveryWatcher(self.locate, interval=self.poll_interval,
                                            active=lambda: self.runtime.accepting,
                                            signal_path=self.signal_path)
            self.counters.detach()
        return self._bridge, self._watcher

    @property
    def waiting_for_kafka(self) -> int:
        """Requests holding their answer for Kafka's acknowledgement right now."""
        return self._watcher.waiting if self._watcher is not None else 0

    def release_waits(self) -> None:
        """Answer requests waiting for Kafka now (202): shutdown should not wait for acks."""
        if self._watcher is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                self._loop.call_soon_threadsafe(self._watcher.release_all)

    def close(self) -> None:
        self.counters.flush()
        if self._sizing is not None:
            self._sizing.shutdown(wait=False, cancel_futures=True)
        if self._watcher is not None:
            self._watcher.close()
        if self._converter is not None:
            self._converter.shutdown(wait=False, cancel_futures=True)

    # -- the one entry ---------------------------------------------------------------------
    def publish(self, topic: str, batch: bool, headers: list[tuple[bytes, bytes]],
                body: bytes, reply: Reply) -> Cut | None:
        """Publish a request whose whole body is in hand, then ``reply()``: every publish
        comes in here, from the server's protocol (protocol.py, ``HttpProtocol``, on the
        event loop, without ASGI's per-request task, scope and messages: they cost more than
        the rest of the publish) and from ``__call__``, the ASGI adapter any other server
        uses. The request is answered, and its answer counted, exactly once: ``reply`` is
        called once the commit is durable (or Kafka acknowledged it), or at once for a
        refusal.

        Two strategies, chosen here, carry a publish that passed its checks:

        - **on callbacks** (``_on_callbacks``), the common case: converted (on the loop, or
          on the converter thread for a large body), handed to the writer with the rest of
          the loop iteration's, answered from the writer's result (``_committed``), or once
          Kafka acknowledged it (``_committed_wait``). No task, no future.
        - **as a task** (``_as_task``): the coroutine ``_store``, for what must wait in the
          middle: an Idempotency-Key (its replay, and the gate on the same key in flight)
          and a message over the Kafka topic's limit uncompressed (the sizing thread's
          verdict).

        A publish that will wait for Kafka (201) on callbacks returns its ``Cut``: the
        connection calls it when its client leaves or stops sending, and the publish is
        answered at once with what is known (202 once stored) instead of at the topic's
        ack_timeout_ms. Otherwise None.
        """
        if self._loop is None:
            self._bind()  # before any task is counted in in_flight
        try:
            request = self._check(topic, headers, batch)
            if len(body) > request.limit:
                raise _body_too_large(request.limit, topic, batch)
            if request.ikey is not None:
                self._as_task(request, body, None, reply)
                return None
            return self._on_callbacks(request, body, reply)
        except Exception as exc:  # noqa: BLE001 - refusals, and bugs (500, logged)
            status, out_headers, answer = self._refused(exc, topic)
            self.counters.add_key(_REQUESTS[batch][status])
            reply(status, out_headers, answer)
            return None

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send, topic: str,
                       batch: bool) -> None:
        """The ASGI adapter (app.py: any server but Ferry's own): read the body, publish it
        (``publish``), send the answer."""
        headers = scope["headers"]
        try:
            # What the headers refuse is answered before the body is read; ``publish``
            # checks them again (a cost for this adapter alone, off the protocol's path).
            limit = self._check(topic, headers, batch).limit
            body = await self._read_body(receive, limit, topic, batch)
        except _Disconnected:
            self.counters.add_key(_REQUESTS[batch][499])
            return
        except Exception as exc:  # noqa: BLE001 - refusals, and bugs (500, logged)
            status, out_headers, answer = self._refused(exc, topic)
            self.counters.add_key(_REQUESTS[batch][status])
        else:
            answered: asyncio.Future[tuple[int, Headers, bytes]] = (
                asyncio.get_running_loop().create_future())
            cut = self.publish(topic, batch, headers, body,
                               functools.partial(_answered, answered))
            try:
                status, out_headers, answer = await answered
            except asyncio.CancelledError:
                # The server gave up on the request (its client left): a wait for Kafka
                # ends now, answered to nobody, as the protocol's connection does.
                if cut is not None:
                    cut()
                raise
        await send({"type": "http.response.start", "status": status,
                    "headers": header_pairs(out_headers)})
        await send({"type": "http.response.body", "body": answer})

    # -- on callbacks ----------------------------------------------------------------------
    def _on_callbacks(self, request: _Request, body: bytes, reply: Reply) -> Cut | None:
        """The common strategy (``publish``): its ``Cut`` if it will wait for Kafka."""
        if self._waits_for_kafka(request.settings):
            request.cut = Cut()
        codec = self._codec(request)
        if self._off_loop(request, codec, body):
            assert self._loop is not None
            converted = self._loop.run_in_executor(self._converting(), self._convert,
                                                   request, codec, body)
            self._pending += 1
            converted.add_done_callback(functools.partial(self._converted, request, reply))
            return request.cut
        records = self._convert(request, codec, body)
        if request.oversize:
            self._as_task(request, b"", records, reply)
            return None
        self._hand(request, records, reply)
        return request.cut

    def _hand(self, request: _Request, records: list[Record], reply: Reply) -> None:
        """Rate-limit and queue a publish's records for the writer (on callbacks)."""
        self._rate_limit(request, len(records))
        # Waiting for Kafka (201) goes on callbacks too: a task per request cost more
        # CPU than the wait itself.
        done = (self._committed_wait if self._waits_for_kafka(request.settings)
                else self._committed)
        self._enqueue(records, None, functools.partial(done, request, len(records), reply))
        self._pending += 1

    def _as_task(self, request: _Request, body: bytes, records: list[Record] | None,
                 reply: Reply) -> None:
        """The strategy for what waits in the middle (``publish``): ``_store`` as a task of
        its own, answered by ``_stored``. ``records``: the body converted already (a message
        over the Kafka topic's limit uncompressed, whose verdict takes the sizing thread)."""
        task = asyncio.get_running_loop().create_task(self._store(request, body, records))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._stored, request, reply))

    def _converted(self, request: _Request, reply: Reply,
                   converted: asyncio.Future[list[Record]]) -> None:
        """On the loop: a body converted on the converter thread; hand it to the writer."""
        self._pending -= 1
        if converted.cancelled():
            return  # the loop is shutting down: the connection goes with it
        try:
            records = converted.result()
            if request.oversize:
                self._as_task(request, b"", records, reply)
                return
            self._hand(request, records, reply)
        except Exception as exc:  # noqa: BLE001 - refusals, and bugs (500, logged)
            status, out_headers, answer = self._refused(exc, request.topic)
            self.counters.add_key(_REQUESTS[request.batch][status])
            reply(status, out_headers, answer)

    def _converting(self) -> concurrent.futures.ThreadPoolExecutor:
        # One thread: conversions wait their turn rather than contend for the GIL with each
        # other and the loop; each is bounded by the body and message limits.
        if self._converter is None:
            self._converter = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="ferry-http-convert")
        return self._converter

    @staticmethod
    def _off_loop(request: _Request, codec: TopicCodec, body: bytes) -> bool:
        return len(body) > OFF_LOOP_BYTES and (request.batch or codec.content_type != "binary")

    def body_limit(self, topic: str, batch: bool) -> int:
        """The largest body a publish to ``topic`` may have (the server's protocol reads no
        more of it): ``http.max_batch_bytes`` for a batch, else the topic's
        ``max_message_bytes``."""
        settings = self.catalog.resolve(topic) if valid_topic(topic) else None
        return self._limit(settings or self.catalog.default, batch)

    def _limit(self, settings: TopicConfig, batch: bool) -> int:
        """The body limit rule, the one place it is written: ``body_limit`` for the
        protocol, the publish itself once its topic's settings are resolved."""
        return self.max_batch_bytes if batch else settings.max_message_bytes

    def too_large(self, topic: str, batch: bool, limit: int) -> HttpError:
        """The 413 of a publish whose body is over ``body_limit``."""
        return _body_too_large(limit, topic, batch)

    def refused_early(self, publish: bool, batch: bool, error: HttpError) -> None:
        """Count a refusal the server's protocol answered itself (a limit, bad HTTP)."""
        if publish:
            self._refused(error, "")
            self.counters.add_key(_REQUESTS[batch][error.status])
        else:
            self.counters.add("http_requests", (("route", "other"),
                                                ("status", str(error.status))))

    def gone(self, batch: bool) -> None:
        """A client left in the middle of a publish's body: counted as status 499."""
        self.counters.add_key(_REQUESTS[batch][499])

    @property
    def in_flight(self) -> int:
        """Publishes handed over and not answered yet. The server's graceful stop waits for
        its connections and its tasks; a publish whose client has gone has neither, so the
        server waits for this to reach 0 too (its answer is counted)."""
        return self._pending + len(self._tasks)

    def _committed(self, request: _Request, n: int, reply: Reply, result: Written) -> None:
        """On the loop: the writer's result for a publish on callbacks; answer it."""
        self._pending -= 1
        try:
            ids = _ids(result, n)
            status, headers, body = self._received(
                (*_response(ids, request.batch, False, False), n))
        except Exception as exc:  # noqa: BLE001 - refusals, and bugs (500, logged)
            status, headers, body = self._refused(exc, request.topic)
        self.counters.add_key(_REQUESTS[request.batch][status])
        reply(status, headers, body)

    def _committed_wait(self, request: _Request, n: int, reply: Reply, result: Written
                        ) -> None:
        """On the loop: stored; now wait for Kafka's acknowledgement (up to the topic's
        ack_timeout_ms), then answer 201 or 202."""
        try:
            ids = _ids(result, n)
        except Exception:  # noqa: BLE001 - a refusal: answered as any other
            self._committed(request, n, reply, result)
            return
        _, watcher = self._bind()
        cut = request.cut
        # Bounded by TopicConfig; none left if the client went away meanwhile.
        timeout_ms = 0 if cut is not None and cut.done else request.settings.ack_timeout_ms
        wait = watcher.watch_call(request.topic, ids, timeout_ms / 1000,
                                  functools.partial(self._acknowledged, request, ids, reply))
        if cut is not None and wait is not None:
            cut.watcher, cut.wait = watcher, wait

    def _acknowledged(self, request: _Request, ids: list[bytes], reply: Reply,
                      delivered: bool) -> None:
        """On the loop: Kafka acknowledged ``ids`` in time, or not; answer."""
        self._pending -= 1
        status, headers, body = self._received(
            (*_response(ids, request.batch, delivered, False), len(ids)))
        self.counters.add_key(_REQUESTS[request.batch][status])
        reply(status, headers, body)

    def _stored(self, request: _Request, reply: Reply, task: asyncio.Task[_Outcome]) -> None:
        """On the loop: a publish as a task (``_store``) is done; answer it."""
        self._tasks.discard(task)
        if task.cancelled():
            return  # the loop is shutting down: the connection goes with it
        exc = task.exception()
        if exc is None:
            status, headers, body = self._received(task.result())
        else:
            status, headers, body = self._refused(exc, request.topic)
        self.counters.add_key(_REQUESTS[request.batch][status])
        reply(status, headers, body)

    # -- the steps -------------------------------------------------------------------------
    def _received(self, outcome: _Outcome) -> tuple[int, Headers, bytes]:
        """Count a stored (or replayed) request's messages as received; its answer."""
        status, headers, body, n = outcome
        # Every message a client hands over is received, then accepted or rejected.
        self.counters.add_key(_RECEIVED, n)
        return status, headers, body

    def _refused(self, exc: BaseException, topic: str
                 ) -> tuple[int, Headers, bytes]:
        """Count a refusal (``HttpError``) or a bug (answered 500, logged); its answer."""
        if isinstance(exc, HttpError):
            body = exc.body()
            self.counters.add_key(_RECEIVED, exc.count)
            if exc.reason is not None:
                self.counters.add("messages_rejected", (*_SOURCE, ("reason", exc.reason)),
                                  exc.count)
                # A sample and a last-seen time for the page, as every source gives.
                self.runtime.registry.sample("rejected", exc.reason, {
                    "source": "http", "topic": topic, "status": exc.status,
                    "detail": exc.message, "messages": exc.count})
            return exc.status, exc.headers(body), body
        # A bug must still produce an answer, and a log line.
        log.error("publishing to %r failed", topic, exc_info=exc)
        err = HttpError(500, "internal_error",
                        "Ferry failed to handle this request; nothing was acknowledged. "
                        "The error is in Ferry's log.", close=True)
        body = err.body()
        return 500, err.headers(body), body

    def _check(self, topic: str, raw_headers: list[tuple[bytes, bytes]], batch: bool
               ) -> _Request:
        """What can be refused before the body: phase, topic, headers, declared length."""
        runtime = self.runtime
        if not runtime.accepting:
            raise _not_accepting(runtime.phase)
        if not valid_topic(topic):
            raise HttpError(400, reasons.INVALID_TOPIC, illegal_topic(topic),
                            reason=reasons.INVALID_TOPIC)
        if topic.startswith("__") and topic not in self.internal_topics and \
                self.catalog.entry(topic) is None:
            # Kafka's own (__consumer_offsets, __transaction_state) and other tools'
            # internal topics: a message there would be refused or, worse, taken.
            raise HttpError(400, reasons.INTERNAL_TOPIC,
                            f"{topic!r} is an internal topic name (it starts with '__'); "
                            "publishing to it needs it listed in http.internal_topics or "
                            "defined as a topic", reason=reasons.INTERNAL_TOPIC)
        settings = self.catalog.resolve(topic)
        if settings is None:
            raise HttpError(404, reasons.UNKNOWN_TOPIC,
                            f"topic {topic!r} is not defined here, and auto-creation of topics "
                            "is off (http.auto_create_topics)", reason=reasons.UNKNOWN_TOPIC)

        # -- headers (one pass) --
        request = _Request(topic, batch, settings)
        length: bytes | None = None
        kafka_headers: list[tuple[str, bytes]] = []
        allow = self.allowlist
        for name, value in raw_headers:
            field = _FIELDS.get(name)
            if field is None:
                if allow and name in allow:
                    kafka_headers.append((allow[name], value))
            elif field == _CTYPE:
                request.ctype = value
            elif field == _LENGTH:
                length = value
            elif field == _PKEY:
                request.pkey = value
            elif field == _FPK:
                request.fpk = value
            else:
                request.ikey = value
        if kafka_headers:
            request.kafka_headers = tuple(kafka_headers)

        limit = request.limit = self._limit(settings, batch)
        if length is not None and length.isdigit() and int(length) > limit:
            raise _body_too_large(limit, topic, batch, declared=int(length))
        if request.fpk is not None:
            request.partition_key = _partition_key(request.fpk)
        if request.pkey is not None and not request.pkey:
            raise HttpError(400, reasons.INVALID_HEADER, "Partition-Key is empty; leave it out for "
                            "no key", reason=reasons.INVALID_HEADER)
        if request.ikey is not None:
            try:
                idem.check_key(request.ikey)
            except idem.BadKey as exc:
                raise HttpError(400, reasons.INVALID_HEADER, str(exc),
                                reason=reasons.INVALID_HEADER) from None
        return request

    def _codec(self, request: _Request) -> TopicCodec:
        """The topic's codec (on the loop: the cache of codecs is not shared)."""
        try:
            return self.codecs.get(request.settings)
        except ValueError as exc:
            raise HttpError(500, "topic_misconfigured",
                            f"topic {request.topic!r} cannot take messages: {exc}") from None

    def _records(self, request: _Request, body: bytes) -> list[Record]:
        """The body, checked and converted for the topic, as records."""
        return self._convert(request, self._codec(request), body)

    async def _records_off_loop(self, request: _Request, body: bytes) -> list[Record]:
        codec = self._codec(request)
        if not self._off_loop(request, codec, body):
            return self._convert(request, codec, body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._converting(), self._convert, request, codec,
                                          body)

    def _convert(self, request: _Request, codec: TopicCodec, body: bytes) -> list[Record]:
        """The body, checked and converted with ``codec``, as records. Reads nothing of the
        publisher's mutable state: it may run on the converter thread."""
        topic, batch, settings = request.topic, request.batch, request.settings
        # A binary topic stores a single message's body as it came, whatever its type.
        media = (None if codec.content_type == "binary" and not batch
                 else media_type(request.ctype))
        try:
            values = (codec.batch(media, body, self.max_batch_messages) if batch
                      else [codec.single(media, body)])
        except TooManyMessages as exc:
            raise HttpError(413, reasons.TOO_LARGE, str(exc), reason=reasons.TOO_LARGE) from None
        except BodyError as exc:
            raise HttpError(400, reasons.INVALID_BODY, str(exc), reason=reasons.INVALID_BODY,
                            count=exc.count) from None
        except MediaTypeError as exc:
            raise HttpError(415, reasons.UNSUPPORTED_MEDIA_TYPE, str(exc),
                            reason=reasons.UNSUPPORTED_MEDIA_TYPE) from None
        except SchemaUnusable as exc:
            raise HttpError(500, "topic_misconfigured",
                            f"topic {topic!r} cannot take messages: {exc}") from None
        n = len(values)
        pkey = request.pkey
        ksize = len(pkey) if pkey else 0
        max_bytes = settings.max_message_bytes
        if values and max(map(len, values)) + ksize > max_bytes:
            i, v = next((i, v) for i, v in enumerate(values) if len(v) + ksize > max_bytes)
            where = f"message [{i}]" if batch else "the message"
            raise HttpError(413, reasons.TOO_LARGE,
                            f"{where} is {len(v) + ksize} bytes (key + value) stored, over "
                            f"max_message_bytes={max_bytes} of topic {topic!r}",
                            reason=reasons.TOO_LARGE, count=n)
        request.ts = ts = int(time.time() * 1000)
        headers = request.kafka_headers
        snapshot = self.kafka_limits.current()
        if values and snapshot.topics and (limit := snapshot.topics.get(topic)) is not None:
            self._over_kafka_limit(request, limit, snapshot.compression, values)
        partition_key = request.partition_key
        hash_key = pkey is not None
        if n == 1:
            return [Record(topic, values[0], pkey, partition_key, ts, headers, hash_key)]
        return [Record(topic, v, pkey, partition_key, ts, headers, hash_key) for v in values]

    def _over_kafka_limit(self, request: _Request, limit: Limit, compression: str,
                          values: list[bytes]) -> None:
        """Mark the messages over the Kafka topic's limit uncompressed (``request.oversize``)
        for ``_kafka_verdict``. The longest value first: usually it fits, and so do all."""
        key_len = len(request.pkey) if request.pkey is not None else None
        headers = request.kafka_headers
        if not kafka_limits.may_be_too_large(limit, key_len, max(map(len, values)), headers):
            return
        request.oversize = [i for i, v in enumerate(values)
                            if kafka_limits.may_be_too_large(limit, key_len, len(v), headers)]
        request.kafka_limit = (limit, compression)

    async def _kafka_verdict(self, request: _Request, values: list[bytes]) -> None:
        """413 when the Kafka topic can never take one of the ``request.oversize`` messages,
        even compressed; decided on the sizing thread, off the event loop."""
        assert request.kafka_limit is not None
        limit, compression = request.kafka_limit
        if self._sizing is None:
            self._sizing = ThreadPoolExecutor(1, thread_name_prefix="http-sizing")
        found = await asyncio.get_running_loop().run_in_executor(
            self._sizing, functools.partial(
                kafka_limits.first_too_large, request.topic, limit, compression,
                request.pkey, values, request.oversize, request.kafka_headers))
        if found is not None:
            i, why = found
            where = f"message [{i}]: " if request.batch else ""
            raise HttpError(413, reasons.TOO_LARGE_FOR_TOPIC, where + why,
                            reason=reasons.TOO_LARGE_FOR_TOPIC, count=len(values))

    def _rate_limit(self, request: _Request, n: int) -> None:
        settings = request.settings
        wait = self.limiter.acquire(request.topic, settings.rate_limit, n)
        if wait:
            raise HttpError(429, reasons.RATE_LIMITED,
                            f"topic {request.topic!r} takes at most {settings.rate_limit:g} "
                            "messages/s over HTTP", reason=reasons.RATE_LIMITED, retry_after=wait,
                            count=n)

    def _waits_for_kafka(self, settings: TopicConfig) -> bool:
        return self.track and settings.ack_timeout_ms > 0

    async def _store(self, request: _Request, body: bytes,
                     records: list[Record] | None = None) -> _Outcome:
        """Convert, store and answer: idempotency, the Kafka topic's limit, rate limit,
        commit, wait for Kafka. ``records``: the body converted already."""
        if records is None:
            records = await self._records_off_loop(request, body)
        n = len(records)
        topic, batch, settings = request.topic, request.batch, request.settings
        ikey = request.ikey
        state_key: bytes | None = None
        fingerprint = ""
        if ikey is not None and self.idempotency.enabled:
            state_key = self.idempotency.state_key(topic, ikey)
            fingerprint = idem.fingerprint([
                b"batch" if batch else b"single", request.ctype or b"", request.pkey or b"",
                request.fpk or b"",
                *(f"{k}={v!r}".encode() for k, v in request.kafka_headers), body])
            replay = await self._replay(topic, state_key, fingerprint, settings, batch, n)
            if replay is not None:
                return (*replay, 0)  # stored before: received (and counted) the first time
        if request.oversize:
            await self._kafka_verdict(request, [r.value for r in records])
        self._rate_limit(request, n)
        if state_key is None:
            ids = await self._commit(records)
            return (*await self._answer(topic, ids, settings, batch), n)
        assert self._loop is not None
        gate: asyncio.Future[None] = self._loop.create_future()
        self._inflight[state_key] = gate
        key, ts = state_key, request.ts

        def remember(ids: list[bytes]) -> dict[bytes, bytes]:
            # Runs in the commit that stores the messages: both or neither are on disk.
            return self.idempotency.puts(key, idem.Entry(ts, fingerprint, ids, batch))

        try:
            ids = await self._commit(records, remember)
        finally:
            if self._inflight.get(state_key) is gate:
                del self._inflight[state_key]
            gate.set_result(None)
        return (*await self._answer(topic, ids, settings, batch), n)

    async def _read_body(self, receive: Receive, limit: int, topic: str, batch: bool) -> bytes:
        # Ferry's own server reads the body itself; this serves the ASGI adapter, for any
        # other ASGI server (and tests that drive the app directly).
        return await self._read_rest(receive, [], limit, topic, batch)

    async def _read_rest(self, receive: Receive, parts: list[bytes], limit: int, topic: str,
                         batch: bool) -> bytes:
        size = sum(len(p) for p in parts)
        if size > limit:
            raise _body_too_large(limit, topic, batch)
        task = self.deadlines.begin(self.body_timeout)
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise _Disconnected()
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise _body_too_large(limit, topic, batch)
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
        except asyncio.CancelledError:
            if self.deadlines.expired(task):
                raise HttpError(408, reasons.REQUEST_TIMEOUT,
                                f"the body did not arrive within {self.body_timeout:g} s "
                                "(http.body_timeout_seconds)", reason=reasons.REQUEST_TIMEOUT,
                                close=True) from None
            raise
        finally:
            self.deadlines.end(task)
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    async def _commit(self, records: list[Record], derive: _Derive | None = None
                      ) -> list[bytes]:
        """Store ``records`` (all or nothing) and return their ids once durable."""
        loop = self._loop
        if loop is None or loop is not asyncio.get_running_loop():
            self._bind()
            loop = self._loop
            assert loop is not None
        future: asyncio.Future[Written] = loop.create_future()
        self._enqueue(records, derive, functools.partial(_set_result, future))
        return _ids(await future, len(records))

    def _enqueue(self, records: list[Record], derive: _Derive | None, done: _Done) -> None:
        """Queue ``records`` for this loop iteration's hand-over; ``done(result)`` on the loop
        once the writer is done with them.

        The first request of an iteration schedules the hand-over to the writer at the end
        of the iteration, so one iteration's requests cost one ``submit_groups()`` and come
        back in one loop wake-up (CompletionBridge)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._bind()
        queue = self._queue
        if not queue:
            loop.call_soon(self._hand_over)
        queue.append((records, derive, done))

    def _hand_over(self) -> None:
        """On the loop, end of an iteration: queue this iteration's requests for the writer."""
        queue, self._queue = self._queue, []
        dones = [done for _, _, done in queue]
        bridge = self._bridge
        assert bridge is not None
        try:
            queued = self.committer.submit_groups(
                [(records, derive) for records, derive, _ in queue], Source.HTTP,
                functools.partial(bridge.post, functools.partial(_resolve, dones)))
        except ShuttingDown:
            _resolve(dones, [NotHanded.CLOSING] * len(dones))
            return
        except Exception:  # noqa: BLE001 - a bug: answer 500 rather than leave them hanging
            log.exception("handing %d requests to the buffer writer failed", len(dones))
            _resolve(dones, [NotHanded.FAILED] * len(dones))
            return
        if not queued:
            _resolve(dones, [NotHanded.OVERLOADED] * len(dones))
        if self.idempotency.enabled and self.idempotency.prune_due():
            # Expired Idempotency-Keys leave the state database a minute's worth at a time,
            # off the loop (they are disk writes); at most once per PRUNE_INTERVAL.
            asyncio.get_running_loop().run_in_executor(None, self._prune)

    def _prune(self) -> None:
        try:
            removed = self.idempotency.prune()
            if removed:
                log.info("pruned %d expired idempotency keys", removed)
        except Exception:  # noqa: BLE001 - pruning is housekeeping; retried next interval
            log.exception("pruning idempotency keys failed")

    async def _replay(
        self, topic: str, state_key: bytes, fingerprint: str, settings: TopicConfig,
        batch: bool, n: int
    ) -> tuple[int, Headers, bytes] | None:
        self._bind()
        while (gate := self._inflight.get(state_key)) is not None:
            await asyncio.shield(gate)  # the same key is being stored right now: its answer
        entry = self.idempotency.lookup(state_key)
        if entry is None:
            return None
        if entry.fingerprint != fingerprint:
            raise HttpError(422, reasons.IDEMPOTENCY_KEY_REUSED,
                            "this Idempotency-Key was used for a different request (body or "
                            "headers differ) within the idempotency window",
                            reason=reasons.IDEMPOTENCY_KEY_REUSED,
                            count=n)
        return await self._answer(topic, entry.ids, settings, batch, replayed=True)

    async def _answer(self, topic: str, ids: list[bytes], settings: TopicConfig, batch: bool,
                      replayed: bool = False) -> tuple[int, Headers, bytes]:
        # At most MAX_ACK_TIMEOUT_MS: a bound of TopicConfig (agent/config.py).
        timeout_ms = settings.ack_timeout_ms
        if timeout_ms <= 0 or not self.track:
            return _response(ids, batch, False, replayed)
        _, watcher = self._bind()
        delivered = await watcher.wait(topic, ids, timeout_ms / 1000)
        return _response(ids, batch, delivered, replayed)


def _response(ids: list[bytes], batch: bool, delivered: bool, replayed: bool
              ) -> tuple[int, Headers, bytes]:
    """Status, headers (rendered: the answer to every publish) and body of a publish that
    stored (or had stored) ``ids``."""
    status = 201 if delivered else 202
    flag = b"true" if delivered else b"false"
    if batch:
        body = (b'{"ids":[' + _id_list(ids) + b'],"count":' + str(len(ids)).encode()
                + b',"delivered":' + flag + b"}")
        headers = _BATCH_HEADERS % len(body)
    else:
        mid = keys.id_text(ids[0]).encode()
        body = b'{"id":"' + mid + b'","delivered":' + flag + b"}"
        headers = _SINGLE_HEADERS % (len(body), mid, mid)
    if replayed:
        headers += b"idempotent-replayed: true\r\n"
    return status, headers, body


_BATCH_HEADERS = b"content-type: " + JSON_CONTENT_TYPE + b"\r\ncontent-length: %d\r\n"
_SINGLE_HEADERS = _BATCH_HEADERS + b"ferry-message-id: %s\r\nhermes-message-id: %s\r\n"


def header_pairs(headers: Headers) -> list[tuple[bytes, bytes]]:
    """``headers`` as (name, value) pairs (ASGI's form), rendered or not."""
    if not isinstance(headers, bytes):
        return headers
    pairs = []
    for line in headers.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b": ")
            pairs.append((name, value))
    return pairs


# An answer's headers: (name, value) pairs, or already rendered as "name: value\r\n" lines
# (a stored publish's, never ``connection``: rendering them once is a tenth of the answer).
Headers = list[tuple[bytes, bytes]] | bytes
_Derive = Callable[[list[bytes]], dict[bytes, bytes]]


class NotHanded(Enum):
    """Why a publish's records never reached the writer: its queue was full, it is closed,
    or the hand-over itself failed (a bug; answered 500)."""

    OVERLOADED = auto()
    CLOSING = auto()
    FAILED = auto()


# What a publish learns of its records: the writer's ``Result`` (their ids, or the buffer's
# refusal), or why they never reached the writer. ``_ids`` matches every case.
Written = Result | NotHanded
# Called on the loop with that, once known.
_Done = Callable[[Written], None]
# An answer (status, headers, body), and how many messages it counts as received.
_Outcome = tuple[int, Headers, bytes, int]
# How a publish's answer is sent: reply(status, headers, body).
Reply = Callable[[int, Headers, bytes], None]


def _resolve(dones: Sequence[_Done], results: Sequence[Written]) -> None:
    """On the loop: answer the requests of one hand-over."""
    for done, result in zip(dones, results, strict=True):
        try:
            done(result)
        except Exception:  # noqa: BLE001 - one failed answer must not strand the others
            log.exception("answering a publish failed")


def _set_result(future: asyncio.Future[Written], result: Written) -> None:
    if not future.done():
        future.set_result(result)


def _answered(future: asyncio.Future[tuple[int, Headers, bytes]], status: int,
              headers: Headers, body: bytes) -> None:
    """The ASGI adapter's ``reply``: the answer to its task (gone if it was cancelled)."""
    if not future.done():
        future.set_result((status, headers, body))


def _ids(result: Written, n: int) -> list[bytes]:
    """The ids of a stored group, from the writer's ``result``; a refusal raises HttpError."""
    match result:
        case list():
            return result
        case InvalidGroup():
            # Counted by the committer (reason unencodable). The checks above should make
            # this impossible; if a record still cannot be encoded, it is the client's input.
            raise HttpError(400, result.reason, f"the message cannot be stored: {result}",
                            count=n)
        case BufferFull():
            # Counted by the committer (messages_rejected reason buffer_full, or disk_full
            # when the filesystem is what is full: store.DiskFull).
            raise HttpError(503, result.reason,
                            f"Ferry's buffer is full; nothing was stored: {result}",
                            retry_after=RETRY_FULL, count=n)
        case BufferUnavailable():
            raise HttpError(503, result.reason,
                            "Ferry's buffer cannot store messages; nothing was stored: "
                            f"{result}", retry_after=RETRY_FULL, count=n)
        case NotHanded.OVERLOADED:
            raise HttpError(503, reasons.OVERLOADED,
                            "Ferry's buffer writer is behind; nothing was stored. Retry later.",
                            reason=reasons.OVERLOADED, retry_after=RETRY_BUSY, count=n)
        case NotHanded.CLOSING:
            raise _not_accepting(Phase.STOPPING, count=n)
        case NotHanded.FAILED:
            raise RuntimeError("handing the request to the buffer writer failed")
        case _:
            assert_never(result)


class Cut:
    """Cuts short a publish's wait for Kafka: called (by the connection, protocol.py)
    when its client has left or stopped sending, it answers the publish at once with what is
    known, 202 once stored, rather than at the topic's ack_timeout_ms. A client that closed
    while its 201 was awaited held its connection, busy and so under the connection cap,
    for up to a minute (issue #37). Called before the wait began, the wait never begins."""

    __slots__ = ("done", "watcher", "wait")

    def __init__(self) -> None:
        self.done = False
        self.watcher: DeliveryWatcher | None = None
        self.wait: Wait | None = None

    def __call__(self) -> None:
        self.done = True
        if self.watcher is not None and self.wait is not None:
            self.watcher.cut(self.wait)
            self.wait = None


class _Request:
    """What ``_check`` learnt from a publish request's path and headers."""

    __slots__ = ("topic", "batch", "settings", "limit", "ctype", "pkey", "fpk", "ikey",
                 "partition_key", "kafka_headers", "ts", "oversize", "kafka_limit", "cut")

    def __init__(self, topic: str, batch: bool, settings: TopicConfig) -> None:
        self.topic = topic
        self.batch = batch
        self.settings = settings
        self.limit = 0
        self.ctype: bytes | None = None
        self.pkey: bytes | None = None
        self.fpk: bytes | None = None
        self.ikey: bytes | None = None
        self.partition_key: int | None = None
        self.kafka_headers: tuple[tuple[str, bytes], ...] = ()
        self.ts = 0
        # Messages (indices) over the Kafka topic's limit uncompressed, and that limit with
        # the producer's compression: _kafka_verdict decides them.
        self.oversize: list[int] = []
        self.kafka_limit: tuple[Limit, str] | None = None
        self.cut: Cut | None = None  # a publish on callbacks that will wait for Kafka


class _Disconnected(Exception):
    """The client went away before its body arrived; there is nobody to answer."""


_INTEGER = re.compile(rb"[+-]?[0-9]{1,12}")
# The request header fields a publish reads (besides http.header_allowlist), by name.
_CTYPE, _LENGTH, _PKEY, _FPK, _IKEY = range(5)
_FIELDS = {b"content-type": _CTYPE, b"content-length": _LENGTH, b"partition-key": _PKEY,
           b"ferry-partition-key": _FPK, b"idempotency-key": _IKEY}
# Counter keys of the publish path, built once (LocalCounters.add_key).
_RECEIVED = ("messages_received", _SOURCE)
_REQUESTS = {batch: {code: ("http_requests", (("route", "batch" if batch else "publish"),
                                              ("status", str(code))))
                     for code in range(100, 600)}
             for batch in (False, True)}


def _limit_name(topic: str, batch: bool) -> str:
    return "http.max_batch_bytes" if batch else f"max_message_bytes of topic {topic!r}"


def _id_list(ids: list[bytes]) -> bytes:
    """The JSON strings of ``ids`` (``keys.id_text``), comma-separated: ``"a","b"``.

    A batch answers with up to tens of thousands of ids; hexing them all at once, with a
    separator after every id, is C work instead of a Python step per id."""
    if not ids:
        return b""
    if set(map(len, ids)) != {keys.ID_LEN}:  # not all of the usual length: one at a time
        return b",".join(b'"' + keys.id_text(i).encode() + b'"' for i in ids)
    return b'"' + b"".join(ids).hex(",", keys.ID_LEN).replace(",", '","').encode() + b'"'


def _body_too_large(limit: int, topic: str, batch: bool,
                    declared: int | None = None) -> HttpError:
    """The 413 of a body over its limit: read past it (the connection closes), or declared
    over it by Content-Length (closed only when the rest is too long to drain)."""
    if declared is None:
        return HttpError(413, reasons.TOO_LARGE, f"the body is over the limit of {limit} bytes "
                         f"({_limit_name(topic, batch)})", reason=reasons.TOO_LARGE, close=True)
    return HttpError(413, reasons.TOO_LARGE,
                     f"the body of {declared} bytes is over the limit of {limit} "
                     f"({_limit_name(topic, batch)})",
                     reason=reasons.TOO_LARGE, close=declared > _DRAIN_LIMIT)


def _partition_key(raw: bytes) -> int:
    text = raw.strip()
    value = int(text) if _INTEGER.fullmatch(text) else None
    if value is None or not _INT32_MIN <= value <= _INT32_MAX:
        raise HttpError(400, reasons.INVALID_HEADER,
                        f"Ferry-Partition-Key must be a 32-bit signed integer "
                        f"({_INT32_MIN}..{_INT32_MAX}), not {raw[:40]!r}",
                        reason=reasons.INVALID_HEADER)
    return value


def _not_accepting(phase: Phase, count: int = 1) -> HttpError:
    if phase is Phase.STARTING:
        return HttpError(503, reasons.STARTING, "Ferry is starting; retry in a moment.",
                         reason=reasons.STARTING, retry_after=RETRY_STARTING, count=count)
    return HttpError(503, reasons.SHUTTING_DOWN,
                     "Ferry is shutting down and takes no new messages; retry against another "
                     "instance or after the restart.", reason=reasons.SHUTTING_DOWN,
                     retry_after=RETRY_STOPPING, count=count)
