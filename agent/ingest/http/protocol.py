"""The HTTP listener's connection protocol: Ferry's own, over httptools' public parser.

One ``HttpProtocol`` per connection, an ``asyncio.Protocol`` feeding
``httptools.HttpRequestParser``. It owns every limit of the exchange (docs/http.md):

- the request line (414), the headers' bytes and count (431), the body (413, per route:
  the topic's ``max_message_bytes``, ``http.max_batch_bytes`` for a batch, 1 MiB for the
  rest). Header bytes are counted before they reach the parser, so a huge header costs
  nothing but the bytes read up to the limit;
- one deadline per connection, whatever it is waiting for: the next request's headers
  (``header_timeout_seconds``, from the connection's start or the last answer), its body
  (``body_timeout_seconds``, 408), or nothing after an answer (``keep_alive_seconds``).
  It applies after *every* answer, however early it came;
- the work of one step of the event loop: a read is parsed ``STEP_BYTES`` at a time, and
  after ``STEP_SECONDS`` the rest waits for the next step, so a body in 1-byte chunks (two
  parser callbacks a byte) costs its own client time, not everyone's;
- the trailer section of a chunked body, with its chunk framing: ``max_header_bytes`` plus
  ``CHUNK_FRAMING_BYTES`` a chunk (431);
- a write deadline: answers left unread above the transport's high-water mark for
  ``http.write_timeout_seconds`` drop the connection (a client that never reads holds
  nothing for ever);
- the connection cap of ``Connections``.

What is not HTTP/1.1 as Ferry speaks it is refused on the headers: a version other than 1.x
(505), an HTTP/1.1 request without exactly one ``Host`` (400), a ``Transfer-Encoding`` other
than ``chunked`` alone (501). ``Upgrade`` is ignored (RFC 9110 §7.8): the request is served
as plain HTTP/1.1, body included, and the connection closed after it. A client that shuts
its sending side after whole requests gets their answers, then the close; a publish waiting
for Kafka's acknowledgement then is answered at once with what is known (202), since a client
that closed looks the same.

Requests are answered one at a time and in order (pipelining): a request parsed while
another is being answered waits in the connection's queue. Any answer given before a
request's body was read whole (413, 431, 400 for bytes the parser refused, 408) closes the
connection after it, so nothing half-read is left behind; requests parsed before the bad
bytes are answered first (a publish stored before garbage gets its 2xx).

Publishes (``POST /topics/{topic}`` and ``.../batch``) go to ``Publisher.publish`` with their
whole body, without ASGI. Every other route goes to the ASGI app (Starlette: management,
status probes, /metrics) through ``asgi.py``, with the body already read.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import functools
import http
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

import httptools

from agent import reasons
from agent.ingest.http.budget import BodyBudget
from agent.ingest.http.errors import HttpError
from agent.ingest.http.gunzip import GzipBody, Spent
from agent.ingest.http.publish import Headers, Reply
from agent.ingest.http.routing import PREFIX, publish_target
from agent.ingest.http.tls_stream import ON_LOOP, Handshakes, start_tls
from agent.process.log_limit import LogLimit

log = logging.getLogger(__name__)

# Publisher.publish(topic, batch, headers, body, reply) -> a publish's Cut, if it waits for
# Kafka: called, it is answered at once with what is known (its client has gone).
DirectPublish = Callable[[str, bool, list[tuple[bytes, bytes]], bytes, Reply],
                         Callable[[], None] | None]
# The body limit of a publish: body_limit(topic, batch) -> bytes, and its 413.
BodyLimit = Callable[[str, bool], int]
TooLarge = Callable[[str, bool, int], HttpError]
# Runs a request on the ASGI app and calls back with the answer (asgi.py).
AsgiRun = Callable[["HttpProtocol", "Request", Reply], None]
# Counts a refusal the protocol answered itself: refused(publish, batch, error).
Refused = Callable[[bool, bool, HttpError], None]

OTHER_BODY_LIMIT = 1024 * 1024  # routes other than publishing: topic definitions at most
MAX_QUEUED = 32  # pipelined requests parsed ahead of their answer before reading pauses
# ... or body bytes parsed ahead: 32 pipelined 16 MiB batches would otherwise hold 512 MiB on
# one connection (issue #29 C). A connection holds at most this, the request being answered,
# the one being parsed and one read.
MAX_QUEUED_BYTES = 4 * 1024 * 1024
_TOPICS = PREFIX.encode()
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode())
                 for s in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# After a refusal, how long and how much of what the client still sends is read and dropped
# before the connection closes (HttpProtocol._linger).
LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024
# How long answers may wait, unread by the client, above the transport's high-water mark
# before the connection is dropped: a client that pipelines requests and never reads the
# answers would otherwise hold its connection, its queued requests and their answers for
# ever (issue #29 C). The default of http.write_timeout_seconds, which server.py passes.
WRITE_TIMEOUT = 10.0
# A declared Content-Length over this is checked against the publish's exact limit at once
# (413 before any of the body is read); under it the body is read and checked whole, which
# spares the topic lookup on the common small publish.
EXACT_LIMIT_FROM = 64 * 1024
# Bytes of a chunked body that are not the body (chunk sizes, extensions, CRLFs, trailers)
# allowed per chunk, on top of http.max_header_bytes for the trailer section (issue #29 E).
CHUNK_FRAMING_BYTES = 64
# Parsing is bounded per loop step (#37 N5): a read is fed to the parser a slice of
# STEP_BYTES at a time, and once a connection's reads have taken STEP_SECONDS in this step
# of the loop, the rest waits for the next one (reading paused meanwhile). A 256 KiB read
# of a body in 2-byte chunks is some 37,000 chunks, 110,000 parser callbacks: parsed at
# once, as the loop read each connection until its socket was empty, four such bodies kept
# another client waiting 4 to 20 s. A slice of 1-byte chunks takes 1-2 ms on the 2-vCPU dev
# VM, so a step takes at most about 4 ms.
STEP_BYTES = 16 * 1024
STEP_SECONDS = 0.002
# Targets up to this long are remembered by _topic_target (a legal topic name is at most 249
# characters; longer ones, which cannot publish, are not worth the memory).
_REMEMBERED_TARGET_BYTES = 512
# The only transfer coding Ferry reads (RFC 9112 §6.1: anything else is 501).
_CHUNKED = b"chunked"
# The request header fields the protocol itself reads (on_headers_complete), by name.
_LENGTH, _HOST, _ENCODING, _EXPECT, _CODING = range(5)
_FRAMING_FIELDS = {b"content-length": _LENGTH, b"host": _HOST,
                   b"content-encoding": _ENCODING, b"expect": _EXPECT,
                   b"transfer-encoding": _CODING}


class Limits:
    """The limits of one server (``http`` config section)."""

    __slots__ = ("request_line", "header_bytes", "headers", "header_timeout", "body_timeout",
                 "keep_alive", "write_timeout")

    def __init__(self, *, request_line: int, header_bytes: int, headers: int,
                 header_timeout: float, body_timeout: float, keep_alive: float,
                 write_timeout: float = WRITE_TIMEOUT) -> None:
        self.request_line = request_line
        self.header_bytes = header_bytes
        self.headers = headers
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.keep_alive = keep_alive
        self.write_timeout = write_timeout


# Why a connection was closed before it could send a request, the reason label of
# http_connections_closed (docs/status.md): closures an operator may have to act on (raise
# http.max_connections, fix a client's certificate). A deadline's close is not one of them.
TOO_MANY_CONNECTIONS = "too_many_connections"  # new, at the cap, every connection busy: 503
CLOSED_FOR_ROOM = "closed_for_room"  # the longest waiting, to admit a new one at the cap
TLS_HANDSHAKE = "tls_handshake"  # a TLS handshake that failed (a TLS error, not a hang-up)


def _not_counted(reason: str) -> None:
    pass


class Connections:
    """The open connections of one server, and its cap.

    At the cap, a new connection closes the one that has waited longest for a request: idle
    after an answer, never sending one, or still sending its headers or body (a slow or
    stalled client), or lingering after a refusal. Connections waiting for the client,
    however many, never lock new clients out. Only connections whose request is being
    answered are safe; when all are, the new one is answered 503 and closed. ``idle`` holds
    the waiting ones in the order they began to wait: the first has waited longest.
    ``closed`` counts each of these closures by reason (and a failed TLS handshake), and
    ``said`` logs them: at most a line a minute per kind (and per TLS error), so a flood of
    connections or a scanner on the TLS port cannot flood the log; the count has them all.
    """

    def __init__(self, cap: int, closed: Callable[[str], None] = _not_counted) -> None:
        self.cap = cap
        self.closed = closed
        self.said = LogLimit(log)
        self.open: set[HttpProtocol] = set()
        self.idle: dict[HttpProtocol, None] = {}
        self.stopping = False

    def admit(self, conn: HttpProtocol) -> bool:
        if len(self.open) >= self.cap:
            if not self.idle:
                self.closed(TOO_MANY_CONNECTIONS)
                self.said.warning(TOO_MANY_CONNECTIONS,
                                  "HTTP: refused a new connection (503): all %d connections "
                                  "(http.max_connections) are busy with requests", self.cap)
                return False
            oldest = next(iter(self.idle))
            self.closed(CLOSED_FOR_ROOM)
            self.said.log(logging.INFO, CLOSED_FOR_ROOM,
                          "HTTP: at the connection cap (%d, http.max_connections): closed "
                          "the connection that waited longest for a request to admit a new "
                          "one", self.cap)
            oldest.close()
        self.open.add(conn)
        return True

    def set_idle(self, conn: HttpProtocol) -> None:
        self.idle.pop(conn, None)
        self.idle[conn] = None

    def set_busy(self, conn: HttpProtocol) -> None:
        self.idle.pop(conn, None)

    def gone(self, conn: HttpProtocol) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def close_idle(self) -> None:
        for conn in list(self.idle):
            conn.close()


class Request:
    """One parsed request."""

    __slots__ = ("method", "url", "headers", "parts", "size", "limit", "keep_alive",
                 "version", "topic", "batch", "error", "encoding", "publish", "exact",
                 "framing", "held", "check_at", "cut")

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        # The body: its first read as it came, then one bytearray growing in place
        # (HttpProtocol.on_body). A list of the parser's pieces cost about 28 times the body
        # in 2-byte chunks (#37 N5).
        self.parts: list[bytes | bytearray] = []
        self.size = 0
        self.limit = OTHER_BODY_LIMIT
        # Above this size the body is checked against the limit (_over): the limit, or
        # EXACT_LIMIT_FROM for a publish whose own limit is not looked up yet.
        self.check_at = OTHER_BODY_LIMIT
        self.held = 0  # bytes of the body budget this request holds
        self.keep_alive = True
        self.version = "1.1"
        self.topic = ""
        self.batch = False
        self.publish = False
        self.exact = False  # limit is the publish's own (body_limit), not read_limit
        self.encoding: bytes | None = None
        # How the body is framed after an Upgrade request's headers (see _resume_body):
        # its Content-Length, b"chunked", or None for no body.
        self.framing: bytes | None = None
        # Answer this instead of running the request, then close (a limit, a parse error).
        self.error: HttpError | None = None
        # Ends a publish's wait for Kafka now (Publisher.publish's Cut): its client has gone.
        self.cut: Callable[[], None] | None = None

    @property
    def body(self) -> bytes:
        parts = self.parts
        if not parts:
            return b""
        first = parts[0]
        return first if type(first) is bytes else bytes(first)

    @classmethod
    def refusal(cls, error: HttpError, of: Request | None) -> Request:
        """A stand-in for ``of`` (the request being parsed, if any): answer ``error``."""
        request = cls()
        request.error = error
        request.keep_alive = False
        if of is not None:
            request.method, request.url = of.method, of.url
            request.topic, request.batch, request.publish = of.topic, of.batch, of.publish
        return request


class _BodyOnly:
    """The parser's target after an Upgrade request's headers (``_resume_body``): the parser
    is fed a stand-in head, of which nothing is wanted (httptools calls only the callbacks
    its target has), then the body, which goes to the connection as any body does."""

    __slots__ = ("on_body", "on_chunk_header", "on_message_complete")

    def __init__(self, conn: HttpProtocol) -> None:
        self.on_body = conn.on_body
        self.on_chunk_header = conn.on_chunk_header
        self.on_message_complete = conn.on_message_complete


class _Stop(Exception):
    """Raised from a parser callback: a request begins after one that closes the connection
    (``Connection: close``); it is neither run nor answered."""


class _Fatal(Exception):
    """Raised from a parser callback to stop parsing: the request is refused (``error``)."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.message)
        self.error = error


class DateHeader:
    """The ``date`` header, formatted once a second rather than per answer."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._value


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection (see the module's docstring)."""

    def __init__(self, *, limits: Limits, connections: Connections, date: DateHeader,
                 publish: DirectPublish, body_limit: BodyLimit, too_large: TooLarge,
                 refused: Refused, gone: Callable[[bool], None], asgi: AsgiRun,
                 read_limit: int, tls: ssl.SSLContext | None = None,
                 handshakes: Handshakes = ON_LOOP,
                 budget: BodyBudget | None = None) -> None:
        self.limits = limits
        # Shared by every connection of the server (budget.py); one of its own otherwise.
        self.budget = budget if budget is not None else BodyBudget(1 << 62)
        self.connections = connections
        self.date = date
        self.publish = publish
        self.body_limit = body_limit
        self.read_limit = read_limit
        # HTTPS: TLS is started on the admitted TCP connection (tls_stream.start_tls), so a
        # handshake counts against the cap and has the headers' deadline, as a slow client.
        self.tls = tls
        self.handshakes = handshakes  # where its steps run (tls_stream.Handshakes)
        self.too_large = too_large
        self.refused = refused
        self.gone = gone
        self.asgi = asgi
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.tcp: asyncio.Transport | None = None  # the TCP transport under TLS's, if any
        self.request: Request | None = None  # being parsed
        self.current: Request | None = None  # being answered
        self.queue: collections.deque[Request] = collections.deque()
        self.queued_bytes = 0  # body bytes of the requests in the queue
        self.parsing: str | None = None  # None (between requests), "headers" or "body"
        self.stopped = False  # no more parsing: a refusal, a close, the peer gone
        self.closed = False
        self.write_paused = False
        self.read_paused = False
        self.lingering = False
        self.lingered = 0
        self.lost: asyncio.Future[None] | None = None
        # The deadline: when the current wait began, and whether it follows an answer.
        self.since = self.loop.time()
        self.after_answer = False
        self.timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0  # header bytes read while the headers were incomplete
        self.head_parsed = 0  # header bytes the parser handed over
        self.tail = b""
        # Bytes read and not parsed yet, left for the next step of the loop (_take), and the
        # step's end; ``turn`` starts the next step. ``holding``: reading is paused for them.
        self.rest: bytes | None = None
        self.step_end = 0.0
        self.turn: asyncio.Handle | None = None
        self.holding = False
        self.held_since = 0.0  # loop time when the bytes held now were first held back
        self.eof_held = False  # the client's EOF came while bytes were held back
        self.eof = False  # the client shut its sending side: answer what came, then close
        self.write_timer: asyncio.TimerHandle | None = None
        self.chunks = 0  # chunks of the body being parsed
        self.overhead = 0  # bytes of it that were not body (chunk framing, trailers)
        # The trailer section (#37 N3, N4): a chunk whose size line was read and none of its
        # data may be the last one, followed by trailer fields. Bytes read in that state
        # (chunks > 0 and not chunk_data) are counted against http.max_header_bytes alone,
        # however many chunks came before. The parser calls back twice a chunk (its size
        # line, its data) and nothing more: a body in 2-byte chunks is a call a byte.
        self.chunk_data = False
        self.trailer = 0
        self.trailer_fields = 0
        # Closed with answers still unwritten (#37 N2): counted against the cap and aborted
        # after the write deadline, since a client that never reads would keep it for ever.
        self.draining: asyncio.TimerHandle | None = None

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        transport = self.transport = self.tcp = cast(asyncio.Transport, transport)
        if self.connections.stopping or not self.connections.admit(self):
            err = HttpError(503, TOO_MANY_CONNECTIONS,
                            "Ferry serves as many connections as it can right now; retry "
                            "later", retry_after=1.0, close=True)
            self.closed = self.stopped = True
            body = err.body()
            if self.tls is None:  # a TLS client would read plain bytes as garbage
                transport.write(self._head(503, err.headers(body), False)[0] + body)
            transport.close()
            return
        self.connections.set_idle(self)
        self._arm()
        if self.tls is not None:
            # Nothing is parsed until the handshake is done: the TLS protocol reads the
            # connection from here on and hands this one only what it decrypts.
            self.stopped = True
            start_tls(self.loop, transport, self, self.tls, self.limits.header_timeout,
                      functools.partial(self._tls_started, transport), self.handshakes)

    def _tls_started(self, plain: asyncio.Transport, secure: asyncio.Transport | None,
                     error: BaseException | None) -> None:
        """The handshake is over: requests are read and answered through ``secure``. A
        failed one (or one on a connection closed meanwhile) ends the connection; one that
        failed on a TLS error is counted and logged (a client without the certificate mTLS
        asks for, plain HTTP on this port), a client that hung up is not."""
        if secure is None or self.closed:
            # Counted also when the connection is gone already: a client that does not
            # trust the certificate sends its alert, then often a reset, which may end the
            # connection before the handshake step that reads the alert is over.
            if isinstance(error, ssl.SSLError):
                self.connections.closed(TLS_HANDSHAKE)
                what = error.reason or type(error).__name__
                self.connections.said.warning(f"{TLS_HANDSHAKE}:{what}",
                                              "HTTPS: a TLS handshake from %s failed: %s",
                                              _peer(plain), error)
            self.close()
            plain.abort()
            return
        self.transport = secure
        self.stopped = False

    def connection_lost(self, exc: Exception | None) -> None:
        request = self.request
        if request is not None and request.publish and not self.closed:
            self.gone(request.batch)  # left in the middle of a publish's body: nothing stored
        self.closed = self.stopped = True
        self.connections.gone(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.draining is not None:
            self.draining.cancel()
            self.draining = None
        self._stop_write_timer()
        if self.turn is not None:
            self.turn.cancel()
            self.turn = None
        self.rest = None
        # What is being parsed or queued is never answered: its budget is free now. The
        # request being answered gives its own back when its answer comes (_answer).
        if request is not None:
            self._drop(request)
        for queued in self.queue:
            self._drop(queued)
        # A publish waiting for Kafka's acknowledgement is answered now, to nobody: its wait
        # and its body's budget are not held until the topic's ack_timeout_ms.
        current = self.current
        if current is not None and current.cut is not None:
            current.cut()
        # The protocol and its parser reference each other, so this object lives until the
        # cyclic collector runs: drop what it holds now, or an abandoned 16 MiB body stays
        # in memory until then (issue #29 D). Nothing queued can be answered any more.
        self.request = None
        self.queue.clear()
        self.queued_bytes = 0
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def close(self) -> None:
        """Close once what was written is out. A client that does not read would keep that
        for ever (a closing transport waits for its buffer to drain) and, left out of the
        cap, 994 of them took every descriptor (#37 N2): such a connection stays counted,
        is the first to go for room, and is aborted after ``write_timeout``."""
        if self.closed:
            if self.draining is not None:
                self._abort()  # asked again (for room, at the stop): go now
            return
        self.closed = self.stopped = True
        transport = self.transport
        if transport is None:
            self.connections.gone(self)
            return
        if self._unwritten():
            self.connections.set_idle(self)
            self.draining = self.loop.call_later(self.limits.write_timeout, self._abort)
        else:
            self.connections.gone(self)
        transport.close()

    def _unwritten(self) -> int:
        size = 0
        for transport in (self.transport, self.tcp):
            if transport is not None and not transport.is_closing():
                size += transport.get_write_buffer_size()
        return size

    def _abort(self) -> None:
        self.draining = None
        self.closed = self.stopped = True
        self.connections.gone(self)
        for transport in (self.transport, self.tcp):
            if transport is not None:
                transport.abort()

    def _drop(self, request: Request) -> None:
        """``request`` is answered or abandoned: its body's bytes leave the budget."""
        if request.held:
            self.budget.give(request.held)
            request.held = 0

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.write_timer is None and not self.closed:
            self.write_timer = self.loop.call_later(self.limits.write_timeout,
                                                    self._write_expired)

    def resume_writing(self) -> None:
        self.write_paused = False
        self._stop_write_timer()
        self._next()

    def _stop_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _write_expired(self) -> None:
        """The client has not read its answers for ``write_timeout``: drop the connection
        and what it holds. Aborted, not closed: a close would wait for the writes to go
        out, which is what the client does not let happen."""
        self.write_timer = None
        if self.write_paused:
            log.debug("HTTP: closing a connection whose client reads no answers")
            self._abort()

    def addresses(self) -> tuple[Any, Any]:
        """The client's and the server's address (looked up only for the ASGI routes: a
        flood of connections should cost as little as possible each)."""
        transport = self.transport
        assert transport is not None
        return transport.get_extra_info("peername"), transport.get_extra_info("sockname")

    def disconnected(self) -> asyncio.Future[None]:
        """Done once the peer is gone (the ASGI app's ``http.disconnect``)."""
        if self.lost is None:
            self.lost = self.loop.create_future()
            if self.closed:
                self.lost.set_result(None)
        return self.lost

    # -- reading ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.stopped:
            if self.lingering:
                self.lingered += len(data)
                if self.lingered > LINGER_BYTES:
                    self.close()
            return
        if self.rest is not None:
            # A transport that hands over bytes after pause_reading(): after the held ones.
            self.rest += data
            return
        if self.turn is None and len(data) <= STEP_BYTES:
            self._read(data)  # the common case, _take's first branch without its call
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Parse ``data`` within the loop step's time; hold back what is left (#37 N5).

        A small read first in its step is parsed at once (the common case: no clock, no
        callback). Otherwise the step's end is set (shared by the reads of this step: the
        loop reads a connection until its socket is empty, up to 32 reads) and ``data`` is
        fed a slice at a time until it is all parsed or the step is over. A new step parses
        at least one slice, however late the clock: a thread preempted between setting the
        step's end and parsing would otherwise hold everything back, step after step.
        """
        fresh = self.turn is None
        if fresh:
            if len(data) <= STEP_BYTES:
                self._read(data)
                return
            self.step_end = time.perf_counter() + STEP_SECONDS
            self.turn = self.loop.call_soon(self._next_step)
        size = len(data)
        at = 0
        while at < size:
            if self.read_paused or (not fresh and time.perf_counter() >= self.step_end):
                self._hold(data[at:] if at else data)
                return
            fresh = False
            self._read(data if size <= STEP_BYTES else data[at:at + STEP_BYTES])
            at += STEP_BYTES
            if self.stopped:
                return  # refused, or after a Connection: close: the rest is never parsed

    def _hold(self, rest: bytes) -> None:
        self.rest = rest
        if not self.holding:
            self.holding = True
            self.held_since = self.loop.time()
            if not self.read_paused and self.transport is not None:
                self.transport.pause_reading()

    def _next_step(self) -> None:
        """A new step of the loop: parse what was held back, within the step's time."""
        self.turn = None
        rest = self.rest
        if rest is None or self.closed:
            return
        if self.read_paused and not self.stopped:
            return  # the queue is full: _next goes on once it has room
        self.rest = None
        if not self.stopped:
            self._take(rest)
        if self.rest is not None:
            return  # still more: the step that _take scheduled goes on
        self.holding = False
        if self.parsing == "body":
            self.since += self._held_for()  # the body's deadline skips the time held
        if self.eof_held:
            self.eof_held = False
            if self.eof_received() is None and not self.closed:
                self.close()
            return
        if not self.read_paused and not self.closed and self.transport is not None:
            self.transport.resume_reading()

    def _read(self, data: bytes) -> None:
        """Parse one read's worth, and check what only a whole read tells."""
        if self.parsing == "headers" and not self._head_fits(data):
            return
        request = self.request
        in_body = self.parsing == "body"
        size = request.size if request is not None else 0
        chunks = self.chunks
        self._feed(data)
        if (in_body and request is not None and request is self.request
                and self.parsing == "body" and self.chunks):
            # The whole read was inside one chunked body: what is not body is framing or
            # trailers, which the parser gathers without a limit (issue #29 E).
            body = request.size - size
            overhead = len(data) - body
            self.overhead += overhead
            if body:
                self.trailer = 0  # data came for a chunk: what was counted was not a trailer
            if not self.chunk_data:
                # After a chunk's size line and none of its data: the trailer section, if
                # that chunk was the last. Counted alone (framing allowed only for the
                # chunks of this read), so its limit does not grow with the chunks (#37 N4).
                self.trailer += max(0, overhead - CHUNK_FRAMING_BYTES * (self.chunks - chunks))
            limit = self.limits.header_bytes
            if (self.overhead > limit + CHUNK_FRAMING_BYTES * self.chunks
                    or self.trailer > limit):
                self._refuse(HttpError(431, reasons.HEADERS_TOO_LARGE,
                                       "the chunked body's framing and trailers are over "
                                       f"{self.limits.header_bytes} bytes "
                                       "(http.max_header_bytes)",
                                       reason=reasons.HEADERS_TOO_LARGE, close=True))
        if self.parsing == "headers":
            self.tail = data[-3:]
        self._next()

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._resume_body(data[exc.args[0]:] if exc.args else b"")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Stop):
                self.request = None
                self.parsing = None
            elif isinstance(cause, _Fatal):
                self._refuse(cause.error)
            else:
                self._refuse(HttpError(400, reasons.INVALID_HTTP,
                                       f"the request is not valid HTTP/1.1: {exc}",
                                       reason=reasons.INVALID_HTTP, close=True))

    def _resume_body(self, rest: bytes) -> None:
        """The parser stopped at the end of an Upgrade request's headers, as if everything
        after them were another protocol. Ferry upgrades to nothing: the request is served
        as plain HTTP/1.1 with its body (RFC 9110 §7.8 lets a server ignore Upgrade). A new
        parser takes over, fed a stand-in head with the same framing, so it reads the body
        that follows; the connection closes after the answer."""
        request = self.request
        if request is None or request.framing is None:
            # No body: the request is whole and queued; what follows is not HTTP/1.1.
            self.stopped = True
            self.request = None
            self.parsing = None
            if self.queue:
                self.queue[-1].keep_alive = False
            return
        framing = (b"Transfer-Encoding: chunked" if request.framing == _CHUNKED
                   else b"Content-Length: " + request.framing)
        request.framing = None
        self.parser = httptools.HttpRequestParser(_BodyOnly(self))
        self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        if rest:
            self._feed(rest)

    def _head_fits(self, data: bytes) -> bool:
        """Headers are still coming: count the bytes of them in ``data``, before the parser
        concatenates them, and refuse past the limit."""
        end = (self.tail + data).find(b"\r\n\r\n")
        self.head_bytes += len(data) if end < 0 else end
        if self.head_bytes > self.limits.header_bytes:
            self._refuse(_headers_too_large(self.limits))
            self._next()
            return False
        return True

    def _refuse(self, error: HttpError) -> None:
        """Stop parsing; answer ``error`` after the requests parsed before, then close."""
        self.stopped = True
        self.parsing = None
        if self.request is not None:
            self._drop(self.request)
        self.queue.append(Request.refusal(error, self.request))
        self.request = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.stopped:
            raise _Stop()
        self.request = Request()
        self.parsing = "headers"
        self.head_bytes = self.head_parsed = 0

    def on_url(self, url: bytes) -> None:
        request = self.request
        assert request is not None
        request.url += url
        if len(request.url) > self.limits.request_line:
            raise _Fatal(HttpError(414, reasons.URI_TOO_LONG,
                                   f"the request target is over {self.limits.request_line} "
                                   "bytes (http.max_request_line_bytes)",
                                   reason=reasons.URI_TOO_LONG, close=True))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.parsing == "body":
            # A trailer field, after the last chunk. It never becomes a request header: a
            # trailer overrode Partition-Key and Content-Type, and carried a management
            # token (#37 N3). RFC 9110 §6.5.1 lets a recipient discard trailers; Ferry reads
            # none, and counts them against the header limits (their bytes: data_received).
            self.trailer_fields += 1
            if self.trailer_fields > self.limits.headers:
                raise _Fatal(HttpError(431, reasons.HEADERS_TOO_LARGE,
                                       f"more than {self.limits.headers} trailer fields "
                                       "(http.max_headers)", reason=reasons.HEADERS_TOO_LARGE,
                                       close=True))
            return
        request = self.request
        assert request is not None
        headers = request.headers
        headers.append((name.lower(), value))
        # Headers that arrived in one read never pass _head_fits: counted here as well.
        parsed = self.head_parsed = self.head_parsed + len(name) + len(value) + 4
        limits = self.limits
        if len(headers) > limits.headers or parsed > limits.header_bytes:
            if len(headers) > limits.headers:
                raise _Fatal(HttpError(431, reasons.HEADERS_TOO_LARGE,
                                       f"more than {limits.headers} header fields "
                                       "(http.max_headers)", reason=reasons.HEADERS_TOO_LARGE,
                                       close=True))
            raise _Fatal(_headers_too_large(limits))

    def on_headers_complete(self) -> None:
        request = self.request
        assert request is not None
        parser = self.parser
        request.method = parser.get_method()
        request.keep_alive = parser.should_keep_alive()
        self.parsing = "body"
        self.since = self.loop.time()  # the body's deadline runs from here
        self.after_answer = False
        self.chunks = self.overhead = self.trailer = self.trailer_fields = 0
        self.chunk_data = False
        length = None
        coding = None
        expect = False
        hosts = 0
        for name, value in request.headers:
            field = _FRAMING_FIELDS.get(name)
            if field is None:
                continue
            if field == _LENGTH:
                length = value.strip()
            elif field == _HOST:
                hosts += 1
            elif field == _ENCODING:
                request.encoding = value.strip().lower()
            elif field == _EXPECT:
                expect = value.strip().lower() == b"100-continue"
            else:
                coding = value if coding is None else coding + b"," + value
        version = parser.get_http_version()
        if not version.startswith("1."):
            raise _Fatal(HttpError(505, "http_version_not_supported",
                                   f"HTTP/{version} is not spoken here: send HTTP/1.1",
                                   reason=reasons.INVALID_HTTP, close=True))
        if hosts > 1 or (hosts == 0 and version != "1.0"):
            # RFC 9112 §3.2: exactly one Host in HTTP/1.1, never two in any version.
            raise _Fatal(HttpError(400, reasons.INVALID_HTTP,
                                   "an HTTP/1.1 request needs exactly one Host header "
                                   f"(it has {hosts})", reason=reasons.INVALID_HTTP, close=True))
        if coding is not None and coding.strip().lower() != _CHUNKED:
            # Only "chunked", alone: anything else (identity, gzip, chunked twice) would be
            # read one way here and another way by a proxy in front (RFC 9112 §6.1).
            raise _Fatal(HttpError(501, "unsupported_transfer_encoding",
                                   "Transfer-Encoding "
                                   f"{coding.decode('latin-1')!r} is not supported: send "
                                   "chunked or a Content-Length",
                                   reason=reasons.INVALID_HTTP, close=True))
        if request.url[:1] != b"/" and request.url[:4].lower() == b"http":
            request.url = _origin_form(request.url)
        self._route(request)
        if not request.publish:
            request.version = version  # for the ASGI scope
        if parser.should_upgrade():
            # The parser will stop here as if the body were another protocol; remember how
            # it is framed to read it as HTTP/1.1 (_resume_body), then close.
            request.keep_alive = False
            if coding is not None:
                request.framing = _CHUNKED
            elif length is not None and length.isdigit() and int(length) > 0:
                request.framing = length
        if length is not None and length.isdigit():
            declared = int(length)
            if declared > EXACT_LIMIT_FROM and request.publish and not request.exact:
                request.limit = self.body_limit(request.topic, request.batch)
                request.exact = True
            if self._over(request, declared):
                raise _Fatal(self._too_large(request))
        request.check_at = (request.limit if request.exact or not request.publish
                            else min(request.limit, EXACT_LIMIT_FROM))
        self._arm()  # the body's deadline may come before the headers' one
        if expect and self.current is None and not self.queue and self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_chunk_header(self) -> None:
        self.chunks += 1
        self.chunk_data = False

    def on_body(self, body: bytes) -> None:
        # Called for every chunk's data: kept to the few steps each byte must take.
        request = self.request
        assert request is not None
        size = len(body)
        request.size += size
        if request.size > request.check_at:
            # A publish's own limit is looked up once its body passes EXACT_LIMIT_FROM,
            # not at the batch limit: a topic limited to 1,000 bytes read 15 MiB of a
            # chunked body before its 413 (#37 N5).
            if self._over(request, request.size):
                raise _Fatal(self._too_large(request))
            request.check_at = request.limit
        if not self.budget.take(size):
            raise _Fatal(self.budget.spent())
        request.held += size
        self.chunk_data = True
        parts = request.parts
        if not parts:
            parts.append(body)
            return
        first = parts[0]
        if type(first) is bytes:
            parts[0] = first = bytearray(first)
        first += body

    def on_message_complete(self) -> None:
        request = self.request
        assert request is not None
        if request.framing is not None:
            return  # the end of an Upgrade request's headers: its body follows
        self.request = None
        self.parsing = None
        self.tail = b""
        self.queue.append(request)
        self.queued_bytes += request.size
        if not request.keep_alive:
            self.stopped = True  # nothing after this one is read
        elif ((len(self.queue) >= MAX_QUEUED or self.queued_bytes >= MAX_QUEUED_BYTES)
              and not self.read_paused and self.transport):
            self.read_paused = True
            self.transport.pause_reading()

    def _route(self, request: Request) -> None:
        """Which handler, and so which body limit."""
        url = request.url
        if not url.startswith(_TOPICS):
            return
        # Clients publish to a few targets over and over: the common ones are remembered.
        target = (_topic_target(url) if len(url) <= _REMEMBERED_TARGET_BYTES
                  else _topic_target.__wrapped__(url))
        if request.method != b"POST" or target is None:
            return
        request.topic, request.batch = target
        request.publish = True
        # Read up to the batch limit; the topic's own limit is looked up only for a body
        # over it (rare), and Publisher.publish checks it exactly in any case.
        request.limit = self.read_limit

    def _over(self, request: Request, size: int) -> bool:
        """Is ``size`` over the request's body limit (the publish's exact one, looked up
        when ``size`` is over EXACT_LIMIT_FROM)?"""
        if request.publish and not request.exact and size > EXACT_LIMIT_FROM:
            request.limit = self.body_limit(request.topic, request.batch)
            request.exact = True
        return size > request.limit

    def _too_large(self, request: Request) -> HttpError:
        if request.publish:
            return self.too_large(request.topic, request.batch, request.limit)
        return HttpError(413, reasons.TOO_LARGE,
                         f"the body is over the limit of {request.limit} bytes", close=True)

    # -- answering -------------------------------------------------------------------------
    def _next(self) -> None:
        """Start the next parsed request, if none is being answered."""
        while self.current is None and self.queue and not self.write_paused and not self.closed:
            request = self.current = self.queue.popleft()
            self.queued_bytes -= request.size
            self.connections.set_busy(self)
            if (self.read_paused and len(self.queue) < MAX_QUEUED // 2
                    and self.queued_bytes < MAX_QUEUED_BYTES // 2 and self.transport):
                self.read_paused = False
                if not self.holding:
                    self.transport.resume_reading()
                elif self.turn is None:  # bytes held back wait for this: parse them next
                    self.turn = self.loop.call_soon(self._next_step)
            if request.error is not None:
                self._refused(request, request.error)
                return
            if request.encoding is not None and request.encoding != b"identity":
                try:
                    self._over(request, 1 << 62)  # the exact limit, for the decoded size
                    job = _decoder(request, self._take_for(request))
                except HttpError as exc:
                    self._refused(request, exc)
                    continue
                self._decode(request, job)
                return
            self._run(request)

    def _run(self, request: Request) -> None:
        reply = functools.partial(self._answer, request)
        if request.publish:
            cut = self.publish(request.topic, request.batch, request.headers, request.body,
                               reply)
            if cut is not None:
                if self.eof:
                    cut()  # after the client's EOF: answer what is known, without waiting
                else:
                    request.cut = cut
        else:
            self.asgi(self, request, reply)

    def _take_for(self, request: Request) -> Callable[[int], bool]:
        budget = self.budget

        def take(size: int) -> bool:
            if not budget.take(size):
                return False
            request.held += size
            return True

        return take

    def _decode(self, request: Request, job: GzipBody) -> None:
        """Decode ``request``'s gzip body one step (a few milliseconds) per loop iteration,
        so a body made to be slow to decode never holds the loop (#37 N1); then run it."""
        if request is not self.current or self.closed:
            self._drop(request)  # the connection went away meanwhile
            return
        try:
            body = job.run()
        except Spent:
            self._refused(request, self.budget.spent())
            return
        except HttpError as exc:
            self._refused(request, exc)
            return
        if body is None:
            self.loop.call_soon(self._decode, request, job)
            return
        # The decoded body replaces the encoded one, whose bytes leave the budget.
        self.budget.give(request.size)
        request.held -= request.size
        request.parts = [body]
        request.size = len(body)
        request.encoding = None
        request.headers = [(n, v) for n, v in request.headers
                           if n not in (b"content-encoding", b"content-length")]
        request.headers.append((b"content-length", str(len(body)).encode()))
        self._run(request)

    def _refused(self, request: Request, error: HttpError) -> None:
        self.refused(request.publish, request.batch, error)
        body = error.body()
        self._answer(request, error.status, error.headers(body), body)

    def _answer(self, request: Request, status: int, headers: Headers,
                body: bytes) -> None:
        """Write ``request``'s answer (one write); then the next request, or the wait."""
        self._drop(request)
        if request is not self.current:
            return  # not ours any more (the connection went away under it)
        self.current = None
        if self.closed:
            return  # stored or not, nobody is there to hear it
        head, keep_alive = self._head(status, headers,
                                      request.keep_alive and not self.connections.stopping)
        if request.method == b"HEAD":
            body = b""
        transport = self.transport
        assert transport is not None
        transport.write(head + body)
        if not keep_alive:
            # Linger only while the client may still send: after its EOF nothing more comes,
            # and waiting LINGER_SECONDS for it would hold the connection for nothing.
            if request.error is not None and not self.eof and transport.can_write_eof():
                self._linger()
            else:
                self.close()
            return
        if self.queue:
            self._next()
            return
        if self.eof:
            self.close()  # the client sends nothing more: its last answer is out
            return
        # The wait for the next request starts now.
        self.since = self.loop.time()
        self.after_answer = self.parsing is None
        self.connections.set_idle(self)
        self._arm()

    def _head(self, status: int, headers: Headers, keep_alive: bool) -> tuple[bytes, bool]:
        """The status line and headers of an answer, and whether the connection stays open
        after it: not if ``keep_alive`` is False (then it says ``connection: close``) or if
        ``headers`` say ``connection`` (only ever "close": errors.py; rendered headers never
        do)."""
        out = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status,
               self.date.get()]
        said_close = False
        if isinstance(headers, bytes):
            out.append(headers)
        else:
            for name, value in headers:
                if name == b"connection":
                    said_close = True
                out += (name, b": ", value, b"\r\n")
        if not keep_alive and not said_close:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        return b"".join(out), keep_alive and not said_close

    def _linger(self) -> None:
        """Close after a refusal while the client may still be sending (a body or headers
        over the limit): closing at once with unread bytes makes the kernel reset the
        connection, and the client would lose the answer with it. So the write side is
        shut, what still comes is read and dropped, and the connection closes at the
        client's end of sending, after ``LINGER_BYTES`` or after ``LINGER_SECONDS``."""
        transport = self.transport
        assert transport is not None
        self.lingering = True
        self.connections.set_idle(self)
        transport.write_eof()
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(LINGER_SECONDS, self.close)

    def eof_received(self) -> bool | None:
        """The client shut its sending side (``shutdown(SHUT_WR)``) and may still read. The
        requests it sent whole are answered, then the connection closes; one cut short can
        never finish, so it is dropped (a publish's counted as gone, status 499)."""
        if self.lingering:
            self.close()
            return None
        if self.holding:
            self.eof_held = True  # after the bytes held back (_next_step)
            return True
        if self.current is None and not self.queue:
            return None  # nothing to answer: the transport closes itself
        request = self.request
        if request is not None:
            if request.publish:
                self.gone(request.batch)
            self._drop(request)
            self.request = None
        self.parsing = None
        self.stopped = self.eof = True
        # A publish waiting for Kafka's acknowledgement (201) is answered now with what is
        # known (202, stored): the client may have closed rather than shut its sending side,
        # which looks the same from here, and would otherwise hold its connection, busy and
        # so under the connection cap, for up to the topic's ack_timeout_ms (issue #37).
        current = self.current
        if current is not None and current.cut is not None:
            current.cut()
        return True  # keep the transport open for the answers; _answer closes after them

    # -- the deadline ----------------------------------------------------------------------
    def _deadline(self) -> float | None:
        """When the current wait is over; None while a request is being answered."""
        if self.current is not None or self.queue or self.closed:
            return None
        limits = self.limits
        if self.parsing == "body":
            # The body's deadline is the client's: time its bytes wait for the server
            # (held back, _take) does not count, or on a starved host bodies parsed side by
            # side would all be refused 408 though every byte had come.
            return self.since + limits.body_timeout + (self._held_for() if self.holding
                                                       else 0.0)
        if self.after_answer and self.parsing is None:
            return self.since + min(limits.keep_alive, limits.header_timeout)
        return self.since + limits.header_timeout

    def _held_for(self) -> float:
        """How long the bytes held back have waited for the server, since the body (of
        the request now being read) began, if it began while they waited."""
        return max(0.0, self.loop.time() - max(self.held_since, self.since))

    def _arm(self) -> None:
        """One timer per connection: set it no later than the current deadline. Most waits
        end before it fires; then it sleeps again for what is left of the new one."""
        deadline = self._deadline()
        if deadline is None:
            return
        timer = self.timer
        if timer is not None:
            if timer.when() <= deadline:
                return
            timer.cancel()
        self.timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        deadline = self._deadline()
        if deadline is None:
            return  # a request is being answered; its answer starts the next wait
        if self.loop.time() < deadline:
            self.timer = self.loop.call_at(deadline, self._expire)
        elif self.parsing == "body":
            self._refuse(HttpError(408, reasons.REQUEST_TIMEOUT,
                                   f"the body did not arrive within "
                                   f"{self.limits.body_timeout:g} s "
                                   "(http.body_timeout_seconds)", reason=reasons.REQUEST_TIMEOUT,
                                   close=True))
            self._next()
        else:
            self.close()  # headers that never finished, or a keep-alive with nothing after


def _peer(transport: asyncio.BaseTransport) -> str:
    """The client's address for a log line: ``host:port``, ``[v6 host]:port``."""
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or len(peer) < 2:
        return "an unknown address"
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _headers_too_large(limits: Limits) -> HttpError:
    return HttpError(431, reasons.HEADERS_TOO_LARGE,
                     f"the request's headers are over {limits.header_bytes} bytes "
                     "(http.max_header_bytes)", reason=reasons.HEADERS_TOO_LARGE, close=True)


def _origin_form(url: bytes) -> bytes:
    """The path and query of an absolute-form target (``http://host/topics/t?q``), which a
    server must accept (RFC 9112 §3.2.2): routed like ``/topics/t?q``, not 404. Found by the
    differential fuzzing against h11 (tests/http/test_differential.py)."""
    scheme, sep, rest = url.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return url
    slash = rest.find(b"/")
    query = rest.find(b"?")
    if slash < 0 or 0 <= query < slash:
        return b"/" + rest[query:] if query >= 0 else b"/"
    return rest[slash:]


@functools.lru_cache(maxsize=1024)
def _topic_target(url: bytes) -> tuple[str, bool] | None:
    """``(topic, batch)`` of a POST to ``url`` (a target under ``/topics/``), the topic
    percent-decoded; None when ``url`` does not publish. An encoded slash is refused (400)
    whatever the method."""
    path = url.split(b"?", 1)[0].split(b"#", 1)[0]
    rest = path[len(_TOPICS):]
    if b"%" in rest and b"%2f" in rest.lower():
        raise _Fatal(HttpError(400, reasons.INVALID_TOPIC,
                               "a topic name cannot hold a slash, encoded (%2F) or not",
                               reason=reasons.INVALID_TOPIC, close=True))
    target = publish_target(path.decode("latin-1"))
    if target is None:
        return None
    raw, batch = target
    return (_unquote(raw.encode("latin-1")) if "%" in raw else raw), batch


def _unquote(raw: bytes) -> str:
    from urllib.parse import unquote_to_bytes

    return unquote_to_bytes(raw).decode("utf-8", "replace")


def _decoder(request: Request, take: Callable[[int], bool]) -> GzipBody:
    """The decoder of a gzip body, up to the request's limit; any other coding is 415."""
    encoding = request.encoding
    if encoding not in (b"gzip", b"x-gzip"):
        raise HttpError(415, reasons.UNSUPPORTED_CONTENT_ENCODING,
                        f"Content-Encoding {(encoding or b'').decode('latin-1')!r} is not "
                        "supported; send the body as is, or gzip it",
                        reason=reasons.UNSUPPORTED_CONTENT_ENCODING)
    if request.publish and not request.exact:
        raise AssertionError("the exact limit is set before decoding")
    return GzipBody(request.body, request.limit, take)
