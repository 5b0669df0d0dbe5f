"""The HTTPS listener's TLS layer: the TCP connection's protocol and ``HttpProtocol``'s
transport, over the standard library's ``ssl.SSLObject`` (OpenSSL on memory BIOs).

Why not ``loop.start_tls()``: asyncio's and uvloop's TLS protocol, on a client's
``close_notify``, passes ``eof_received()`` on and then shuts the connection down itself, and
on a TCP EOF it shuts it down too: the answers to requests sent before, still being made,
were dropped unwritten (issue #37, N7). TLS 1.3 makes ``close_notify`` end only its sender's
direction (RFC 8446 §6.1), as a TCP FIN ends one; the answers may still be sent. Here:

- The server's handshake runs on the connection as accepted: ``start_tls`` puts the stream
  in front of the TCP transport before ``connection_made()`` returns, so a ClientHello
  already waiting reaches it. ``done(stream, None)`` once it is over, ``done(None, error)``
  if it failed (an ``ssl.SSLError`` for a TLS error, an ``OSError`` for a client that hung
  up or took longer than ``handshake_timeout``); a failed one is aborted.
- Its CPU is not the loop's: each step (``SSLObject.do_handshake()``, OpenSSL's key
  exchange and signature, some 0.5 ms) runs in one of a few handshake threads
  (``Handshakes``), CPython's ``_ssl`` releasing the GIL around ``SSL_do_handshake``, so
  another core does the crypto while the loop serves everyone else. While a step runs, the
  loop touches neither the ``SSLObject`` nor its BIOs: bytes that come meanwhile wait in a
  list (up to ``_EARLY`` and one read; then the TCP transport pauses) and go in after it, in
  order. The deadline and the connection cap are the TCP connection's, on the loop, as
  before: a handshake closed for room, timed out or hung up is forgotten, and a step
  already running for it finishes unread. With every thread busy, a handshake waits its
  turn (first come, first served): never more than the open connections, each within its
  deadline. ``Handshakes(0)`` runs each step on the loop.
- What decrypts goes to the protocol's ``data_received()`` a record at a time, only while it
  reads: after its ``pause_reading()`` the rest waits as ciphertext (the TCP transport
  paused too, so at most one read of it).
- The client's ``close_notify``, or its TCP EOF without one, is the protocol's
  ``eof_received()``, as a FIN is over plain TCP; the write side stays open until the
  protocol closes. An EOF without ``close_notify`` may be a truncation, but every request
  received whole was authenticated record by record, and one cut short is dropped by the
  protocol, as over plain TCP: answering the whole ones tells an attacker who cut the
  connection nothing, and loses a client nothing.
- ``close()`` sends ``close_notify`` after what was written, then closes the TCP transport
  once its buffer is out; ``abort()`` drops it at once.
- Every ``write()`` is encrypted and handed to the TCP transport at once: its buffer is the
  only one, so its write flow control (``pause_writing()``, the buffer size and limits) is
  the protocol's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# done(stream, None) after a handshake, done(None, why) for one that failed.
Done = Callable[[asyncio.Transport | None, BaseException | None], None]
# A TLS record holds at most 16 KiB of plaintext, and one read returns at most one record.
_RECORD = 16 * 1024
# get_extra_info() names a TLS transport answers itself (asyncio's); the rest are TCP's.
_TLS_INFO: dict[str, Callable[[ssl.SSLObject], Any]] = {
    "ssl_object": lambda tls: tls,
    "sslcontext": lambda tls: tls.context,
    "peercert": lambda tls: tls.getpeercert(),
    "cipher": lambda tls: tls.cipher(),
    "compression": lambda tls: tls.compression(),
}


# Bytes a client may send while its handshake step runs before its TCP transport pauses
# (a ClientHello is some 500 bytes, the client's last flight with a request a few KiB).
_EARLY = 64 * 1024
# What a handshake step came to: over, more bytes wanted, or the TLS error that ended it.
_OVER = None
_WANT_READ = "want read"
Outcome = BaseException | str | None


def _threads() -> int:
    """One handshake thread less than the cores this process may run on (the loop keeps
    one), between 1 and 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) - 1))


# Handshake threads of a server (``Handshakes``); 0 runs the steps on the event loop.
THREADS = _threads()


def _step(tls: ssl.SSLObject) -> Outcome:
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        return _WANT_READ
    except ssl.SSLError as exc:
        return exc
    return _OVER


class Handshakes:
    """Where a server's handshake steps run: ``threads`` threads, or the loop (0).

    Bounded: at most ``threads`` steps run at once, each of a connection the loop handed
    over, and none queues in the executor; the connections waiting for a thread wait here,
    on the loop, one entry each, in the order they came, and leave when they close. Made
    and used on the server's loop; ``close()`` when it stops."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads = THREADS if threads is None else threads
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="tls-handshake")
                      if threads else None)
        self._busy = 0
        self._waiting: collections.OrderedDict[TlsStream, None] = collections.OrderedDict()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def run(self, stream: TlsStream) -> None:
        """One step of ``stream``'s handshake; ``stream._stepped(outcome)`` on the loop once
        it ran (at once with no threads)."""
        if self._pool is None:
            stream._stepped(_step(stream._tls))  # noqa: SLF001 - the stream's own step
        elif self._busy < self.threads:
            self._start(stream)
        else:
            self._waiting[stream] = None

    def forget(self, stream: TlsStream) -> bool:
        """``stream`` closed: it no longer waits for a thread. True when it was waiting (so
        no step of it runs now)."""
        return self._waiting.pop(stream, False) is None

    def close(self) -> None:
        self._waiting.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _start(self, stream: TlsStream) -> None:
        assert self._pool is not None
        self._busy += 1
        self._pool.submit(self._work, stream)

    def _work(self, stream: TlsStream) -> None:
        """In a handshake thread: the step, then its outcome back to the loop."""
        try:
            outcome = _step(stream._tls)  # noqa: SLF001 - the loop does not touch it meanwhile
        except Exception as exc:  # noqa: BLE001 - not OpenSSL's: ends the handshake too
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
            stream._loop.call_soon_threadsafe(self._finished, stream, outcome)  # noqa: SLF001

    def _finished(self, stream: TlsStream, outcome: Outcome) -> None:
        self._busy -= 1
        if self._waiting:
            self._start(self._waiting.popitem(last=False)[0])
        stream._stepped(outcome)  # noqa: SLF001 - the stream's own step


# Steps on the loop: for a caller that passes no Handshakes (tests, benches).
ON_LOOP = Handshakes(0)


def start_tls(loop: asyncio.AbstractEventLoop, tcp: asyncio.Transport,
              protocol: asyncio.Protocol, context: ssl.SSLContext, handshake_timeout: float,
              done: Done, handshakes: Handshakes = ON_LOOP) -> TlsStream:
    """Start server-side TLS on ``tcp`` before returning. Called from ``connection_made()``:
    uvloop starts reading a new connection when it returns, whatever was paused there."""
    stream = TlsStream(loop, tcp, protocol, context, handshake_timeout, done, handshakes)
    tcp.set_protocol(stream)
    return stream


class TlsStream(asyncio.Protocol, asyncio.Transport):
    """One TLS connection: ``tcp``'s protocol, and ``protocol``'s transport once the
    handshake is over (see the module's docstring)."""

    __slots__ = ("_loop", "_tcp", "_app", "_in", "_out", "_tls", "_done", "_timer",
                 "_reading", "_tcp_eof", "_ended", "_closing", "_resumed", "_handshakes",
                 "_stepping", "_early", "_early_bytes", "_stepped_once")

    def __init__(self, loop: asyncio.AbstractEventLoop, tcp: asyncio.Transport,
                 protocol: asyncio.Protocol, context: ssl.SSLContext,
                 handshake_timeout: float, done: Done,
                 handshakes: Handshakes = ON_LOOP) -> None:
        super().__init__()
        self._loop = loop
        self._tcp = tcp
        self._app = protocol
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=True)
        self._done: Done | None = done  # None once the handshake is over, either way
        self._timer = loop.call_later(handshake_timeout, self._too_slow)
        self._reading = True  # the protocol takes bytes (not paused)
        self._tcp_eof = False  # the client's TCP EOF came
        self._ended = False  # the client's end of sending was passed on: nothing more read
        self._closing = False  # closed or aborted by the protocol (or a TLS error)
        self._resumed: asyncio.Handle | None = None
        self._handshakes = handshakes
        self._stepping = False  # a handshake step runs or waits for a thread
        self._stepped_once = False  # the first step (the server's flight, its crypto) ran
        self._early: list[bytes] = []  # bytes that came meanwhile, for the BIO after it
        self._early_bytes = 0

    # -- the TCP transport's protocol ------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._ended or self._closing:
            return  # after the client's close_notify, or once closing: never read
        if self._stepping:  # the BIO is the handshake thread's until the step is over
            self._early.append(data)
            self._early_bytes += len(data)
            if self._early_bytes > _EARLY:
                self._tcp.pause_reading()
            return
        self._in.write(data)
        if self._done is not None:
            self._stepping = True
            self._handshakes.run(self)
        elif self._reading:
            self._read()

    def eof_received(self) -> bool:
        if self._tcp_eof:
            return True
        self._tcp_eof = True
        if self._done is not None:
            if not self._stepping:  # else after the step: it may end the handshake
                self._failed(ConnectionResetError("the client closed during the TLS "
                                                  "handshake"))
        elif self._reading and not self._ended and not self._closing:
            self._read()  # what is left decrypted first, then the end
        return True  # the write side stays open: closed by close() or abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._timer.cancel()
        if self._resumed is not None:
            self._resumed.cancel()
            self._resumed = None
        if self._done is not None:
            if not self._stepping:
                self._failed(exc or ConnectionResetError("closed during the TLS handshake"))
            elif self._handshakes.forget(self):  # its step had not begun
                # Past the first step, what waits is the client's answer to the server's
                # flight (an alert, its Finished): cheap, so taken here for its verdict. A
                # first step (the key exchange) is not run on the loop for a client gone.
                self._failed(self._last_word(None, pending=True) if self._stepped_once
                             else ConnectionResetError("closed during the TLS handshake"))
            # else a step runs in a thread: _stepped gives the verdict when it is over
        self._app.connection_lost(exc)

    def pause_writing(self) -> None:
        self._app.pause_writing()

    def resume_writing(self) -> None:
        self._app.resume_writing()

    # -- the handshake and reading ---------------------------------------------------------
    def _stepped(self, outcome: Outcome) -> None:
        """A handshake step ran (``Handshakes``): its flight out, then the bytes that came
        meanwhile in, then the next step, or the handshake's end."""
        self._stepping = False
        self._stepped_once = True
        if self._done is None:
            return  # failed meanwhile (timed out, hung up): aborted
        if self._tcp.is_closing():  # closed meanwhile (for room, at the stop, a reset)
            self._failed(self._last_word(outcome, pending=False))
            return
        self._flush()  # the server's flight, the alert that says why, TLS 1.3's tickets
        if isinstance(outcome, BaseException):
            self._failed(outcome)
            return
        if self._early:
            for data in self._early:
                self._in.write(data)
            paused, self._early, self._early_bytes = self._early_bytes > _EARLY, [], 0
            if paused and not self._tcp_eof:
                self._tcp.resume_reading()
            if outcome == _WANT_READ:
                self._stepping = True
                self._handshakes.run(self)
                return
        if outcome == _WANT_READ:
            if self._tcp_eof:  # came during the step, and the handshake is not over
                self._failed(ConnectionResetError("the client closed during the TLS "
                                                  "handshake"))
            return
        self._timer.cancel()
        done, self._done = self._done, None
        assert done is not None
        done(self, None)
        if self._reading and not self.is_closing():
            self._read()  # a request sent with the handshake's last flight

    def _last_word(self, outcome: Outcome, *, pending: bool) -> BaseException:
        """Why a handshake whose connection went during a step failed: the step's own TLS
        error, else the client's last bytes (the alert that says why: a client that does
        not trust the certificate sends one, then often a reset, which may come before the
        step is over), taken in one more step here, else the connection's loss.
        ``pending``: bytes in the BIO wait for a step that never ran."""
        if isinstance(outcome, BaseException):
            return outcome
        if self._early or pending:
            for data in self._early:
                self._in.write(data)
            self._early.clear()
            self._early_bytes = 0
            last = _step(self._tls)
            if isinstance(last, BaseException):
                return last
        return ConnectionResetError("closed during the TLS handshake")

    def _failed(self, exc: BaseException) -> None:
        self._timer.cancel()
        self._handshakes.forget(self)
        self._early.clear()
        done, self._done = self._done, None
        if done is not None:
            done(None, exc)
        self._closing = True
        self._tcp.abort()

    def _too_slow(self) -> None:
        if self._done is not None:
            self._failed(TimeoutError("the TLS handshake took too long"))

    def _read(self) -> None:
        """Hand the protocol what decrypts while it reads, then the client's end of sending
        if it came: its close_notify, or its TCP EOF once nothing more decrypts."""
        tls, incoming, app = self._tls, self._in, self._app
        while self._reading and not self._closing:
            try:
                data = tls.read(_RECORD)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                data = b""
            except ssl.SSLError:  # a record that does not decrypt, an alert: nothing to save
                self._flush()
                self.abort()
                return
            if not data:  # the client's close_notify
                self._end()
                return
            app.data_received(data)
            if not incoming.pending and not tls.pending():
                break  # all read (spares the SSLWantReadError of one more read)
        if self._out.pending:
            self._flush()  # what reading made OpenSSL send (a KeyUpdate's answer)
        if self._tcp_eof and self._reading and not self._closing:
            self._end()  # a TCP EOF without close_notify: the same to the protocol

    def _end(self) -> None:
        """The client sends nothing more and may still read (RFC 8446 §6.1): as a FIN over
        TCP, the protocol keeps the connection for its answers if its eof_received says
        so, and closes it after them."""
        self._ended = True
        if not self._app.eof_received():
            self.close()

    def _resume(self) -> None:
        self._resumed = None
        if self._reading and not self._ended and not self._closing:
            self._read()

    def _flush(self) -> None:
        if self._out.pending:
            self._tcp.write(self._out.read())

    # -- the protocol's transport ----------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return  # after close() or abort(), as a closed transport: nothing goes out
        self._tls.write(data)
        self._tcp.write(self._out.read())

    def close(self) -> None:
        """Written answers first, then close_notify, then the TCP transport's close (once
        its buffer is out). The client's close_notify is not waited for."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(ssl.SSLError):  # SSLWantReadError: theirs not come yet
            self._tls.unwrap()
        self._flush()
        self._tcp.close()

    def abort(self) -> None:
        self._closing = True
        self._tcp.abort()

    def is_closing(self) -> bool:
        return self._closing or self._tcp.is_closing()

    def can_write_eof(self) -> bool:
        return False  # TLS ends a side with close_notify, which close() sends

    def write_eof(self) -> None:
        raise NotImplementedError("TLS ends the write side with close(): close_notify")

    def get_write_buffer_size(self) -> int:
        return self._tcp.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._tcp.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None
                                ) -> None:
        self._tcp.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._reading = False
        if not self._tcp_eof:
            self._tcp.pause_reading()

    def resume_reading(self) -> None:
        if self._reading:
            return
        self._reading = True
        if not self._tcp_eof:
            self._tcp.resume_reading()  # never after its EOF: libuv leaves that undefined
        if self._resumed is None:
            # Not from inside the call: the protocol resumes from its own callbacks, and
            # would be handed bytes in the middle of them.
            self._resumed = self._loop.call_soon(self._resume)

    def is_reading(self) -> bool:
        return self._reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        tls_info = _TLS_INFO.get(name)
        if tls_info is not None:
            return tls_info(self._tls)
        return self._tcp.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self._app = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._app
