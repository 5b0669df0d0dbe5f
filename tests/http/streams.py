"""Adversarial-but-plausible HTTP/1.1 request streams from a seed (issue #37 item 2).

``streams(seed, profile)`` draws, with ``random.Random(seed)`` alone, a few connections'
worth of requests: publishes and batches with a Content-Length or chunked (chunks of 1 byte
to 16 KiB, chunk extensions, trailers of random size and count whose names include request
headers: Partition-Key, Content-Type, Idempotency-Key, Authorization...), gzip bodies of
several members (empty ones included), bodies under and over the body limit, a management
request whose token is only in a trailer, pipelined pings; and how the client ends: it reads
its answers and closes or lets the server close, shuts its sending side (FIN) or resets
(RST) at a random byte, or stops reading. The same seed gives the same bytes.

``streams(..., extras=True)`` draws more, from a second generator of the same seed (so the
streams above stay byte for byte what they were): requests past the header limits (a header
line or a header block over ``header_bytes``, more fields than ``headers``, a target over
``request_line``: 431 or 414 and closed; a header line without a colon: 400 and closed),
slow senders (the bytes in 8 to 40 writes with pauses of 4-15 ms, under a second in all)
and clients that stall (stop sending in the middle and wait for the server to close).

``play(stream, host, port)`` sends one stream over a raw loopback socket and returns what
came back (``tls=context``: the same bytes over TLS, the client on memory BIOs; its FIN is
a ``close_notify`` on connections 0, 1, 4, 5, ... and a TCP FIN without one on 2, 3, 6, 7,
..., so that either comes over TLS whether all or every other connection of a seed is);
``judge(...)`` checks what the server answered and stored against what the request
*headers* said (a trailer never changes it). Shared by the test
(tests/http/test_resource_bounds.py, Ferry in process) and the bench
(bench/bench_http_bounds.py, the candidate servers in processes of their own).
"""

from __future__ import annotations

import contextlib
import gzip
import random
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN = "bounds-token"
TRACE = "X-Trace"  # the allow-listed Kafka header the servers are configured with
# Trailer field names: request headers that must never be taken from a trailer, and some not.
TRAILER_NAMES = (b"Partition-Key", b"Ferry-Partition-Key", b"Content-Type",
                 b"Content-Encoding", b"Idempotency-Key", b"Authorization", b"X-Trace",
                 b"Host", b"X-Checksum", b"Expires")
ENDINGS = ("read-close", "read-idle", "fin", "rst", "unread")
STALL = "stall"  # an ending of the extras: stop sending at the cut, wait for the server
MAX_CHUNK = 16 * 1024
TLS_RECORD = 16 * 1024  # the most plaintext a TLS record holds
PING = b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass(frozen=True)
class Profile:
    """The server's limits the streams are drawn against (its config says the same)."""

    message_bytes: int = 16 * 1024  # topics.default.max_message_bytes
    batch_bytes: int = 256 * 1024  # http.max_batch_bytes
    header_bytes: int = 32 * 1024  # http.max_header_bytes
    headers: int = 100  # http.max_headers
    request_line: int = 8 * 1024  # http.max_request_line_bytes

    def limit(self, batch: bool) -> int:
        return self.batch_bytes if batch else self.message_bytes


@dataclass
class Sent:
    """One request as sent, and what the server must do with it."""

    data: bytes
    kind: str  # publish, batch, manage, ping, openapi
    topic: str = ""
    values: list[bytes] = field(default_factory=list)  # stored if accepted, in order
    key: bytes | None = None  # Partition-Key as the headers say
    trace: bytes | None = None  # X-Trace as the headers say
    expect: int = 200  # the status the headers and body call for
    closes: bool = False  # the server closes after it (a refusal before the body is read)
    decoded: int = 0  # bytes the server decodes (a gzip body's decoded size)
    trailers: list[bytes] = field(default_factory=list)  # trailer field names sent
    what: str = ""


@dataclass
class Stream:
    seed: int
    index: int
    topic: str
    requests: list[Sent]
    ending: str
    cut: int | None  # bytes sent before a FIN, RST or stall; None: everything
    pieces: list[int]  # sizes of the client's writes
    pause: float = 0.0  # seconds between the writes (a slow sender)

    @property
    def data(self) -> bytes:
        return b"".join(r.data for r in self.requests)

    @property
    def sent_bytes(self) -> int:
        size = len(self.data)
        return size if self.cut is None else min(size, self.cut)

    def whole(self) -> list[Sent]:
        """The requests sent whole (before the cut)."""
        out, at = [], 0
        for request in self.requests:
            at += len(request.data)
            if self.cut is not None and at > self.cut:
                break
            out.append(request)
        return out

    def describe(self) -> str:
        kinds = ", ".join(r.what for r in self.requests)
        cut = "" if self.cut is None else f" at byte {self.cut} of {len(self.data)}"
        slow = (f"; slow: {len(self.pieces)} writes {self.pause * 1000:.0f} ms apart"
                if self.pause else "")
        return f"connection {self.index} ({kinds}; {self.ending}{cut}{slow})"


# -- drawing -----------------------------------------------------------------------------------
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789"
_PRINTABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


def _token(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size).translate(_PRINTABLE)


def _chunked_body(rng: random.Random, body: bytes, trailer: bytes,
                  tiny: bool = False) -> bytes:
    """``body`` in chunks of random sizes (mostly small, up to 16 KiB), some with
    extensions, then the last chunk and ``trailer``. ``tiny``: chunks of 1 to 4 bytes, the
    parser's worst case (two callbacks a chunk)."""
    out = []
    at = 0
    tiny = tiny or rng.random() < 0.3
    while at < len(body):
        size = rng.randint(1, 4) if tiny else min(MAX_CHUNK, int(rng.expovariate(1 / 2048)) + 1)
        piece = body[at:at + size]
        at += len(piece)
        ext = b""
        if rng.random() < 0.1:
            ext = b";" + _token(rng, rng.randint(1, 8)) + (
                b"=" + _token(rng, rng.randint(1, 16)) if rng.random() < 0.7 else b"")
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), ext, piece))
    return b"".join(out) + b"0\r\n" + trailer + b"\r\n"


def _trailer(rng: random.Random, profile: Profile) -> tuple[bytes, list[bytes]]:
    """Trailer fields of random count and size, within the header limits."""
    count = rng.choice((0, 0, 1, 2, 3, 5, rng.randint(6, 40)))
    budget = profile.header_bytes // 2
    fields, names = [], []
    for _ in range(min(count, profile.headers // 2)):
        name = rng.choice(TRAILER_NAMES) if rng.random() < 0.8 else b"X-" + _token(rng, 6)
        if name == b"Authorization":
            value = b"Bearer " + TOKEN.encode()
        elif name == b"Ferry-Partition-Key":
            value = b"%d" % rng.randint(0, 7)
        elif name == b"Content-Type":
            value = rng.choice((b"application/json", b"text/evil", b"application/x-ndjson"))
        elif name == b"Content-Encoding":
            value = b"gzip"
        else:
            value = b"t-" + _token(rng, rng.choice((4, 16, 200, rng.randint(1, 2000))))
        line = name + b": " + value + b"\r\n"
        if len(line) > budget:
            break
        budget -= len(line)
        fields.append(line)
        names.append(name)
    return b"".join(fields), names


def _gzip_members(rng: random.Random, body: bytes) -> bytes:
    """``body`` gzipped as several members, some of them empty."""
    members = rng.randint(1, 6)
    cuts = sorted(rng.randint(0, len(body)) for _ in range(members - 1))
    out, at = [], 0
    for cut in [*cuts, len(body)]:
        out.append(gzip.compress(body[at:cut], mtime=0))
        at = cut
        for _ in range(rng.choice((0, 0, 1, rng.randint(2, 200)))):
            out.append(gzip.compress(b"", mtime=0))
    return b"".join(out)


def _publish(rng: random.Random, profile: Profile, topic: str, marker: bytes,
             over: bool, long: bool = False) -> Sent:
    """A publish or a batch; ``over`` its body limit; ``long``: a batch of most of its
    limit in chunks of 1 to 4 bytes (where a cost per byte that grows shows)."""
    batch = long or rng.random() < 0.5
    limit = profile.limit(batch)
    # Values of a batch: ndjson lines of printable tokens, each marked with its request.
    if batch:
        count = rng.randint(1, 40)
        size = (limit + rng.randint(1, limit // 2)) if over else rng.randint(count * 16, limit)
        if long:
            count, size = limit // 2048, limit - limit // 8
        each = max(1, min(size // count, profile.message_bytes - 64) - len(marker) - 8)
        values = [marker + b"m%d-" % i + _token(rng, each if long else rng.randint(1, each))
                  for i in range(count)]
        if over:
            values.append(marker + b"pad-" + b"p" * limit)
        body = b"\n".join(values)
        if len(body) > limit and not over:
            values = values[:1]
            body = values[0]
    else:
        if over:
            body = marker + b"-" + rng.randbytes(64) + b"o" * limit
        else:
            body = marker + b"-" + rng.randbytes(
                rng.randint(0, min(limit - len(marker) - 64, rng.choice((16, 512, limit)))))
        values = [body]
    headers = [b"Host: x"]
    key = trace = None
    if rng.random() < 0.6:
        key = b"k-" + _token(rng, rng.randint(1, 20))
        headers.append(b"Partition-Key: " + key)
    if rng.random() < 0.5:
        trace = b"tr-" + _token(rng, 8)
        headers.append(TRACE.encode() + b": " + trace)
    if rng.random() < 0.4:
        headers.append(b"Idempotency-Key: i-" + _token(rng, 16))
    if batch:
        headers.append(b"Content-Type: application/x-ndjson")
    elif rng.random() < 0.5:
        headers.append(b"Content-Type: application/octet-stream")
    decoded = 0
    gz = not over and not long and rng.random() < 0.25
    wire = body
    if gz:
        wire = _gzip_members(rng, body)
        decoded = len(body)
        headers.append(b"Content-Encoding: gzip")
    chunked = long or rng.random() < 0.6
    names: list[bytes] = []
    if chunked:
        trailer, names = _trailer(rng, profile)
        headers.append(b"Transfer-Encoding: chunked")
        payload = _chunked_body(rng, wire, trailer, tiny=long)
    else:
        headers.append(b"Content-Length: %d" % len(wire))
        payload = wire
    rng.shuffle(headers)
    path = b"/topics/" + topic.encode() + (b"/batch" if batch else b"")
    data = b"POST " + path + b" HTTP/1.1\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + payload
    what = (f"{'batch' if batch else 'publish'} {len(body)} B{' in tiny chunks' if long else ''}"
            f"{' gzip' if gz else ''}{' chunked' if chunked else ''}"
            f"{' over' if over else ''}{f' +{len(names)} trailers' if names else ''}")
    return Sent(data, "batch" if batch else "publish", topic, [] if over else values, key,
                trace, 413 if over else 202, closes=over, decoded=decoded, trailers=names,
                what=what)


def _manage(rng: random.Random, profile: Profile, name: str) -> Sent:
    """``POST /topics`` with the management token only in a trailer: 401."""
    body = b'{"name": "' + name.encode() + b'"}'
    trailer, names = _trailer(rng, profile)
    trailer = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n" + trailer
    data = (b"POST /topics HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + _chunked_body(rng, body, trailer))
    return Sent(data, "manage", name, expect=401, trailers=[b"Authorization", *names],
                what="manage (token in trailer)")


def _oversized(rng: random.Random, profile: Profile, topic: str) -> Sent:
    """A publish whose head is past a limit, or malformed: refused before its body, and the
    connection closed (protocol.py: 431 for the header bytes and fields, 414 for the target,
    400 for what the parser refuses)."""
    head = [b"Host: x", b"Content-Length: 5"]
    target = b"/topics/" + topic.encode()
    kind = rng.choice(("line", "block", "fields", "target", "malformed"))
    expect = 431
    if kind == "line":  # one header line longer than all the header bytes allowed
        head.append(b"X-Big: " + _token(rng, profile.header_bytes + rng.randint(1, 8192)))
    elif kind == "block":  # lines each within reason, over the limit together
        left = profile.header_bytes + rng.randint(1, 4096)
        for n in range(profile.headers - len(head)):
            if left <= 0:
                break
            size = min(left, rng.randint(512, 4096))
            head.append(b"X-Part-%d: " % n + _token(rng, size))
            left -= size
    elif kind == "fields":  # more fields than allowed, each small
        head += [b"X-F%d: %d" % (n, n) for n in range(profile.headers + rng.randint(1, 40))]
    elif kind == "target":
        target += b"?q=" + _token(rng, profile.request_line + rng.randint(1, 4096))
        expect = 414
    else:  # a header line without a colon, within the limits
        head.append(b"X-No-Colon-" + _token(rng, rng.randint(1, 64)))
        expect = 400
    rng.shuffle(head)
    data = b"POST " + target + b" HTTP/1.1\r\n" + b"\r\n".join(head) + b"\r\n\r\nvalue"
    return Sent(data, "oversized", topic, expect=expect, closes=True,
                what=f"oversized head ({kind}, {len(data)} B)")


def _extras(seed: int, stream: Stream, profile: Profile) -> None:
    """The extras of ``stream`` (see the module's docstring), from their own generator: a
    head past the limits, a slow sender, a stall."""
    rng = random.Random(seed * 1_000_003 + 7919 * stream.index + 1)
    requests = stream.requests
    if rng.random() < 0.3 and not requests[-1].closes and stream.ending != "unread":
        requests.append(_oversized(rng, profile, stream.topic))
        if stream.cut is None:
            stream.pieces.append(len(requests[-1].data))
    size = len(stream.data)
    if rng.random() < 0.1:
        stream.ending, stream.cut = STALL, rng.randint(0, size)
    if rng.random() < 0.25:
        cuts = sorted({rng.randint(1, size) for _ in range(rng.randint(7, 39))} | {size})
        stream.pieces = [b - a for a, b in zip([0, *cuts], cuts, strict=False) if b > a]
        stream.pause = rng.uniform(0.004, 0.015)
    if sum(stream.pieces) < size:
        stream.pieces.append(size - sum(stream.pieces))


def streams(seed: int, profile: Profile = Profile(), connections: int = 4,
            extras: bool = False, prefix: str = "b") -> list[Stream]:
    """The connections of ``seed``: the same seed, the same bytes (``extras``: see the
    module's docstring; ``prefix`` starts the topics' names, so that several plays of a
    seed on one server keep apart)."""
    rng = random.Random(seed)
    out = []
    for index in range(connections):
        topic = f"{prefix}{seed % 100_000}c{index}"
        ending = rng.choice(ENDINGS)
        requests: list[Sent] = []
        for r in range(rng.randint(1, 6)):
            pick = rng.random()
            marker = b"s%dc%dr%d" % (seed, index, r)
            if pick < 0.08:
                requests.append(_publish(rng, profile, topic, marker, over=False, long=True))
            elif pick < 0.7:
                requests.append(_publish(rng, profile, topic, marker, over=False))
            elif pick < 0.8:
                requests.append(_manage(rng, profile, f"{topic}-m{r}"))
            else:
                requests.append(Sent(PING, "ping", what="ping"))
        if rng.random() < 0.25:  # a body over its limit ends the connection
            requests.append(_publish(rng, profile, topic, b"s%dc%dover" % (seed, index),
                                     over=True))
        if ending == "unread" and rng.random() < 0.5:
            # Answers of some 18 KB each that the client never reads.
            requests += [Sent(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n", "openapi",
                              what="openapi")] * rng.randint(4, 24)
        data_size = sum(len(r.data) for r in requests)
        cut = rng.randint(0, data_size) if ending in ("fin", "rst") else None
        pieces: list[int] = []
        left = data_size
        while left > 0 and len(pieces) < 10_000:
            size = min(left, rng.choice((1, 7, 100, 1460, 16384, 65536, data_size)))
            pieces.append(size)
            left -= size
        if left > 0:
            pieces.append(left)
        stream = Stream(seed, index, topic, requests, ending, cut, pieces)
        if extras:
            _extras(seed, stream, profile)
        out.append(stream)
    return out


# -- playing ------------------------------------------------------------------------------------
@dataclass
class Played:
    answers: list[bytes]
    sent: int  # bytes sent before the client stopped (a cut, or the server closed)
    ended: float  # monotonic time of the client's last action
    sock: socket.socket | None  # still open (an unread ending): the caller closes it
    error: str = ""
    records: int = 0  # TLS records sent (0 over plain TCP)


class _Plain:
    """The client's end over TCP."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.records = 0

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def poll(self) -> bytes | None:
        """What came so far, without waiting; None once the server closed."""
        if not select.select([self.sock], [], [], 0)[0]:
            return b""
        return self.sock.recv(65536) or None

    def recv(self) -> bytes | None:
        """Some bytes, waiting for them; None once the server closed."""
        return self.sock.recv(65536) or None

    def fin(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)


class TlsWire(_Plain):
    """The client's end over TLS, on memory BIOs (``ssl.SSLSocket`` cannot end its sending
    side alone): each ``send`` is one write of the stream, in records of up to 16 KiB."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, close_notify: bool) -> None:
        super().__init__(sock)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        self.close_notify = close_notify
        self.closed = False
        for _ in range(100):
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("closed during the TLS handshake") from None
                self.incoming.write(data)
        self._flush()

    def _flush(self) -> None:
        if self.outgoing.pending:
            self.sock.sendall(self.outgoing.read())

    def send(self, data: bytes, record: int = TLS_RECORD) -> None:
        """``data`` in records of up to ``record`` bytes, in one write to the socket."""
        for at in range(0, len(data), record):
            self.tls.write(data[at:at + record])
        self.records += -(-len(data) // min(record, TLS_RECORD))
        self._flush()

    def _plain(self) -> bytes:
        out = []
        while not self.closed:
            try:
                data = self.tls.read(65536)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLError):  # close_notify, or an abort
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            out.append(data)
        return b"".join(out)

    def poll(self) -> bytes | None:
        got = []
        while not self.closed and select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
                break
            self.incoming.write(data)
            got.append(self._plain())
        out = b"".join(got)
        return None if self.closed and not out else out

    def recv(self) -> bytes | None:
        for _ in range(100_000):
            out = self._plain()
            if out or self.closed:
                return out or None
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
                return None
            self.incoming.write(data)
        return None

    def fin(self) -> None:
        if self.close_notify:
            with contextlib.suppress(ssl.SSLWantReadError):  # the server's not awaited
                self.tls.unwrap()
            self._flush()
        else:  # a TCP FIN without close_notify
            self.sock.shutdown(socket.SHUT_WR)


def play(stream: Stream, host: str, port: int, timeout: float = 30.0,
         connected: Callable[[socket.socket], None] | None = None,
         tls: ssl.SSLContext | None = None) -> Played:
    """Send ``stream`` over a new connection (``tls``: over TLS, the handshake first) and end
    it as drawn."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if stream.ending == "unread":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(timeout)
    sock.connect((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    wire = _Plain(sock) if tls is None else TlsWire(sock, tls, stream.index // 2 % 2 == 0)
    if connected is not None:
        connected(sock)
    data = stream.data
    limit = len(data) if stream.cut is None else stream.cut
    sent = 0
    error = ""
    received = b""
    closed = False
    try:
        for size in stream.pieces:
            if sent >= limit:
                break
            if sent and stream.pause:
                time.sleep(stream.pause)  # a slow sender's pace: how this client sends
            piece = data[sent:min(limit, sent + size)]
            wire.send(piece)
            sent += len(piece)
            if stream.ending != "unread":
                chunk = wire.poll()  # answered early (a refusal), or closed
                if chunk is None:
                    closed = True
                    break
                received += chunk
    except (ConnectionError, TimeoutError) as exc:
        error = type(exc).__name__
    if stream.ending == "rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        return Played([], sent, time.monotonic(), None, error, wire.records)
    if stream.ending == "unread":
        return Played([], sent, time.monotonic(), sock, error, wire.records)
    stalled = time.monotonic()
    wanted = _expected_answers(stream)
    try:
        if stream.ending == "fin" and not error and not closed:
            wire.fin()
        if stream.ending in ("fin", "read-idle", STALL):
            received += _until_closed(wire, closed)  # the server closes
        else:
            received = _read_n(wire, received, wanted, closed)
    except (ConnectionError, TimeoutError) as exc:
        error = error or type(exc).__name__
    ended = stalled if stream.ending == STALL else time.monotonic()
    sock.close()
    return Played(split(received), sent, ended, None, error, wire.records)


def _expected_answers(stream: Stream) -> int:
    n = 0
    for request in stream.whole():
        n += 1
        if request.closes:
            break
    return n


def _until_closed(wire: _Plain, closed: bool) -> bytes:
    out = []
    for _ in range(100_000):
        if closed:
            break
        chunk = wire.recv()
        if chunk is None:
            break
        out.append(chunk)
    return b"".join(out)


def _read_n(wire: _Plain, data: bytes, n: int, closed: bool) -> bytes:
    for _ in range(100_000):
        if len(split(data)) >= n or closed:
            return data
        chunk = wire.recv()
        if chunk is None:
            return data
        data += chunk
    return data


def split(data: bytes) -> list[bytes]:
    """The whole answers in ``data`` (each with a Content-Length, or none: no body)."""
    answers = []
    for _ in range(100_000):
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            break
        head = data[:head_end].lower()
        length = 0
        if b"content-length:" in head:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        end = head_end + 4 + length
        if len(data) < end:
            break
        answer, data = data[:end], data[end:]
        if not answer.startswith(b"HTTP/1.1 100 "):
            answers.append(answer)
    return answers


def status(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1."):
        return None
    return int(answer.split(b" ", 2)[1])


# -- judging -----------------------------------------------------------------------------------
Stored = list[tuple[bytes | None, bytes, list[tuple[str, bytes]], int | None]]


@dataclass
class Verdict:
    """What ``judge`` found: ``trailers``, a trailer acting as a header (a stored key, Kafka
    header or partition key, an idempotent replay, or a topic created, that the headers did
    not call for); ``answers``, answers other than the headers and bodies call for (a wrong
    status, answers missing, or a message stored unlike its request or not at all)."""

    trailers: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    def all(self) -> list[str]:
        return [*self.trailers, *self.answers]


def judge(stream: Stream, played: Played, stored: Stored,
          exists: Callable[[str], bool]) -> Verdict:
    """What the server did against what the headers say: statuses of the answers read, the
    stored messages (key, Kafka headers, no partition from a trailer, nothing from a refused
    request, everything of an accepted one), management by a token in a trailer refused.
    ``stored`` is the stream's topic: (key, value, headers, partition key) in order."""
    trailers: list[str] = []
    answers: list[str] = []
    sent = stream.whole()
    for request, answer in zip(sent, played.answers, strict=False):
        got = status(answer)
        if got != request.expect and not (request.expect == 202 and got in (200, 201)):
            wrong = trailers if request.kind == "manage" and got is not None and got < 300 \
                else answers
            wrong.append(f"{request.what}: answered {got}, expected {request.expect}: "
                         f"{answer[:200]!r}")
        if request.kind != "ping" and b"idempotent-replayed" in answer.lower():
            trailers.append(f"{request.what}: answered as a replay")
    if (stream.ending in ("read-close", "read-idle")
            and len(played.answers) < _expected_answers(stream)):
        answers.append(f"{len(played.answers)} answers of {_expected_answers(stream)} "
                       f"({played.error or 'closed'})")
    by_marker: dict[bytes, Sent] = {}
    for request in stream.requests:
        for value in request.values:
            by_marker[value] = request
    for key, value, headers, partition in stored:
        owner = by_marker.get(value)
        if owner is None:
            answers.append(f"stored a value no request sent as such: {value[:60]!r}")
            continue
        if key != owner.key:
            trailers.append(f"{owner.what}: stored with key {key!r:.80}, its header said "
                            f"{owner.key!r}")
        want = [(TRACE, owner.trace)] if owner.trace is not None else []
        if [(n.lower(), v) for n, v in headers] != [(n.lower(), v) for n, v in want]:
            trailers.append(f"{owner.what}: stored with Kafka headers {headers!r:.120}, its "
                            f"headers said {want!r}")
        if partition is not None:
            trailers.append(f"{owner.what}: stored with partition key {partition} "
                            "(a trailer)")
    values = [v for _, v, _, _ in stored]
    for request, answer in zip(sent, played.answers, strict=False):
        got = status(answer)
        mine = [v for v in values if by_marker.get(v) is request]
        if got is not None and got < 300 and request.values and mine != request.values:
            answers.append(f"{request.what}: answered {got} but not stored as sent")
        if got is not None and got >= 300 and mine:
            answers.append(f"{request.what}: answered {got} but {len(mine)} of its "
                           "messages stored")
    for request in stream.requests:
        if request.kind == "manage" and exists(request.topic):
            trailers.append(f"topic {request.topic!r} created by a token in a trailer")
    return Verdict(sorted(set(trailers), key=trailers.index)[:20],
                   sorted(set(answers), key=answers.index)[:20])
