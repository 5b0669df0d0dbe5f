"""The HTTP listener's connection protocol: uvicorn's httptools protocol, adapted.

Three changes to uvicorn's ``HttpToolsProtocol``, each measured or needed (docs/http.md):

- Corked writes (``_CorkedTransport``): a connection's writes of one loop iteration leave as
  one write.
- A deadline for a request's headers (uvicorn has none): a connection that never finishes
  its headers is closed.
- Direct publishes: ``POST /topics/{topic}`` and ``.../batch`` whose whole body came with the
  headers (nearly all of them) go to ``Publisher.direct`` without ASGI: no task, no scope,
  no receive/send messages, one write for the answer. For a small publish, uvicorn's ASGI
  plumbing cost more than the publish itself. Anything else (other routes, a body still
  coming, ``Expect: 100-continue``, an encoded or query-carrying path) takes uvicorn's ASGI
  path as before, and so does a publish whose body turns out to be incomplete.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from agent.ingest.http.publish import Reply

log = logging.getLogger(__name__)

# Publisher.direct(topic, batch, headers, body, reply).
DirectPublish = Callable[[str, bool, list[tuple[bytes, bytes]], bytes, Reply], None]

_TOPICS = b"/topics/"
_BATCH = b"/batch"
_CONNECTION_CLOSE = b"connection: close\r\n"


class _Flusher:
    """Flushes every corked connection that wrote in a loop iteration, with one callback."""

    __slots__ = ("loop", "_dirty")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._dirty: list[_CorkedTransport] = []

    def add(self, corked: _CorkedTransport) -> None:
        if not self._dirty:
            self.loop.call_soon(self._run)
        self._dirty.append(corked)

    def _run(self) -> None:
        dirty, self._dirty = self._dirty, []
        for corked in dirty:
            try:
                corked.flush()
            except Exception:  # noqa: BLE001 - one broken connection must not hold the rest
                log.debug("dropping the answer to a connection that failed", exc_info=True)


class _CorkedTransport:
    """Hands a connection's writes of one loop iteration to the socket as one write.

    uvicorn writes a response's status line and headers, then its body, as two writes; on
    loopback TCP each write is a packet the kernel delivers right away, which costs more than
    the publish handler itself (measured: ~30 us of ~75 us per small request). Collecting the
    writes and flushing them once, later in the same loop iteration, sends one packet. One
    ``_Flusher`` callback per iteration flushes all connections that wrote.
    """

    __slots__ = ("_transport", "_pending", "_flusher")

    def __init__(self, transport: asyncio.Transport, flusher: _Flusher) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._flusher = flusher

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._flusher.add(self)
        self._pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if pending:
            self._pending = []
            if self._transport.is_closing():
                return  # the peer went away (reset) before its answer left: nobody to tell
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def write_now(self, data: bytes) -> None:
        """Write at once: one write that is a whole answer needs no corking. Writes of this
        iteration still waiting go first (they answered earlier requests)."""
        if self._pending:
            self.write(data)
        else:
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _NoEvent:
    """Stands for uvicorn's per-request ``asyncio.Event``: a direct publish needs none."""

    __slots__ = ()

    def set(self) -> None:
        pass


class _Direct:
    """A publish answered without ASGI (``Publisher.direct``).

    It stands where uvicorn keeps a request's cycle (``self.cycle``), with the attributes
    uvicorn's own code reads and writes there, so its handling of pipelining (a request that
    arrives while this one is being answered waits in uvicorn's queue), of a lost connection
    and of a graceful shutdown (``keep_alive`` turned off: the connection closes after the
    answer) applies unchanged.
    """

    __slots__ = ("topic", "batch", "previous", "parts", "keep_alive", "response_complete",
                 "disconnected")
    message_event = _NoEvent()

    def __init__(self, topic: str, batch: bool, previous: Any, keep_alive: bool) -> None:
        self.topic = topic
        self.batch = batch
        self.previous = previous  # uvicorn's cycle before this one (done, or None)
        # The body so far; None once handed to the publisher.
        self.parts: list[bytes] | None = []
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False

    @classmethod
    def ignored(cls) -> _Direct:
        """A request that is neither run nor answered."""
        cycle = cls("", False, None, False)
        cycle.parts = None
        cycle.response_complete = True
        return cycle


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, corked, with a header deadline and direct publishes.

    uvicorn times out a connection idle *after* a response (keep-alive) and a body that stops
    arriving, but not a connection that never sends a request or stops halfway through its
    headers: each such connection would hold a descriptor for good, and enough of them (a
    slow or broken client, a port scanner) starve the listener. The deadline runs from the
    connection's start, and from each response's end, to the end of the next request's
    headers. After a response, a connection that sends nothing at all is closed sooner, at
    uvicorn's keep-alive timeout (``timeout_keep_alive``), as uvicorn would.

    One timer per connection for both, not one per request (uvicorn arms and cancels a
    keep-alive timer per request: measurable at tens of thousands of requests a second): a
    request only notes when the connection started waiting for headers (``_waiting_since``,
    None while a request is past its headers) and whether nothing came since a response
    (``_quiet``). When the timer fires it closes the connection if that wait is over its
    limit, and otherwise sleeps again for what is left of it.
    """

    header_timeout: float = 10.0  # set per server by ``protocol_class``
    publish_direct: DirectPublish | None = None  # likewise; None: every request via ASGI
    _flusher: _Flusher | None = None  # per server class: one server, one loop
    _header_deadline: asyncio.TimerHandle | None = None
    _waiting_since: float | None = None
    _quiet = False  # nothing received since the last response
    # What the parser is in the middle of: None (between requests), "headers" or "body".
    _reading: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        flusher = type(self)._flusher
        if flusher is None or flusher.loop is not loop:
            flusher = type(self)._flusher = _Flusher(loop)
        corked = _CorkedTransport(transport, flusher)
        super().connection_made(corked)  # type: ignore[arg-type]
        self._wait_for_headers()

    def on_message_begin(self) -> None:
        # uvicorn's, but the ASGI scope is built only for a request that goes the ASGI way
        # (``_asgi_scope``): a direct publish never reads it.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None  # type: ignore[assignment]
        self._reading = "headers"

    def _asgi_scope(self) -> None:
        """Build this request's ASGI scope (uvicorn's ``on_message_begin``), keeping what the
        parser has told so far."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def on_headers_complete(self) -> None:
        self._waiting_since = None
        self._reading = "body"
        if self.transport.is_closing():
            # An answer given within this read closed the connection, and the parser goes
            # on through what was pipelined behind it: nobody could be told what became of
            # this request, so it is not run, whichever way it would have gone.
            self.cycle = _Direct.ignored()  # type: ignore[assignment]
            return
        direct = self._direct()
        if direct is None:
            self._asgi_scope()
            super().on_headers_complete()
        else:
            self.cycle = direct  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        cycle: Any = self.cycle
        if type(cycle) is _Direct:
            if cycle.parts is not None:
                cycle.parts.append(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading = None
        cycle: Any = self.cycle
        if type(cycle) is not _Direct:
            super().on_message_complete()
            if cycle is not None and cycle.response_complete and not self.pipeline:
                # Answered before its body was all in (a refusal): the wait for the next
                # request starts now, not at that answer (on_response_complete).
                self._wait_for_headers(after_response=True)
            return
        parts = cycle.parts
        if parts is None:
            return
        cycle.parts = None
        cycle.previous = None  # or every direct publish of a connection stays referenced
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        publish = self.publish_direct
        assert publish is not None
        publish(cycle.topic, cycle.batch, self.headers, body,
                functools.partial(self._reply, cycle))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._reading is not None:
            # Part of a request is in (perhaps after an answer given within this read, which
            # started a keep-alive wait): the connection is not idle.
            self._quiet = False
        cycle: Any = self.cycle
        if (type(cycle) is _Direct and cycle.parts is not None
                and not self.transport.is_closing()):
            self._to_asgi(cycle)

    def _direct(self) -> _Direct | None:
        """A ``_Direct`` for this request if it is a publish that may go without ASGI."""
        if (self.publish_direct is None or self.expect_100_continue or self.pipeline
                or self.flow.write_paused):
            return None  # the last: the client is not reading; uvicorn's send() waits
        previous = self.cycle
        if previous is not None and not previous.response_complete:
            return None  # a request before it is still being answered: keep the order
        url = self.url
        parser = self.parser
        if (not url.startswith(_TOPICS) or parser.get_method() != b"POST"
                or not url.isascii() or b"?" in url or b"%" in url or b"#" in url
                or parser.should_upgrade()):
            return None
        rest = url[len(_TOPICS):]
        slash = rest.find(b"/")
        if slash < 0 and rest:
            topic, batch = rest, False
        elif slash > 0 and rest[slash:] == _BATCH:
            topic, batch = rest[:slash], True
        else:
            return None  # not a publish path: the app's router answers it
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        return _Direct(topic.decode("ascii"), batch, previous, keep_alive)

    def _to_asgi(self, cycle: _Direct) -> None:
        """The body is still coming: the request goes uvicorn's way after all, as if it had
        always gone (its body deadline applies there)."""
        parts = cycle.parts or []
        self.cycle = cycle.previous
        self._asgi_scope()
        super().on_headers_complete()
        for part in parts:
            super().on_body(part)

    def _reply(self, cycle: _Direct, status: int, headers: list[tuple[bytes, bytes]],
               body: bytes) -> None:
        """Send a direct publish's answer (one write), as uvicorn would send an ASGI one."""
        cycle.response_complete = True
        transport = self.transport
        if cycle.disconnected or transport.is_closing():
            return  # stored or not, nobody is there to hear it
        keep_alive = cycle.keep_alive
        said_close = False
        out = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:  # Date
            out += (name, b": ", value, b"\r\n")
        for name, value in headers:
            if name == b"connection":  # the publisher only ever says "close"
                keep_alive, said_close = False, True
            out += (name, b": ", value, b"\r\n")
        if not keep_alive and not said_close:
            out.append(_CONNECTION_CLOSE)
        out += (b"\r\n", body)
        transport.write_now(b"".join(out))  # type: ignore[attr-defined]
        if not keep_alive:
            transport.close()
        self.on_response_complete()

    def on_response_complete(self) -> None:  # after an ASGI answer, or ``_reply``
        # uvicorn's, but for its per-response keep-alive timer (see the class's docstring).
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            # The next pipelined request starts now: its headers are in, so there are no
            # headers to wait for until it has answered.
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._reading is None:
            self._wait_for_headers(after_response=True)
        elif self._reading == "headers":
            # The next request has begun (pipelined): its headers get the header deadline
            # from now, not the keep-alive timeout.
            self._wait_for_headers()
        # else: the body of the request just answered is still coming; its end starts the
        # wait (on_message_complete), so the deadline never runs during an upload.

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        super().connection_lost(exc)

    def _wait_for_headers(self, after_response: bool = False) -> None:
        now = self.loop.time()
        self._waiting_since = now
        self._quiet = after_response
        deadline = self._header_deadline
        if deadline is not None:
            if not after_response or deadline.when() <= now + self._limit():
                return  # the timer comes in time and checks the wait as it is then
            deadline.cancel()
        self._header_deadline = self.loop.call_later(self._limit(), self._check_headers)

    def _limit(self) -> float:
        """How long the current wait may last."""
        if self._quiet:
            return min(self.header_timeout, self.timeout_keep_alive)
        return self.header_timeout

    def _check_headers(self) -> None:
        self._header_deadline = None
        since = self._waiting_since
        if since is None or self.transport.is_closing():
            return  # a request is past its headers; its response starts the next wait
        left = since + self._limit() - self.loop.time()
        if left > 0:
            self._header_deadline = self.loop.call_later(left, self._check_headers)
        else:
            self.transport.close()


def protocol_class(header_timeout: float, publish_direct: DirectPublish | None
                   ) -> type[HttpProtocol]:
    """The protocol of one server: its header deadline, and where direct publishes go."""
    return type("HttpProtocol", (HttpProtocol,), {
        "header_timeout": header_timeout,
        "publish_direct": None if publish_direct is None else staticmethod(publish_direct),
    })
