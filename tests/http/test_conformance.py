"""The HTTP front door against the audit of issue #29: raw-socket reproductions of its
defects A-F and of the items still open from earlier audits.

Each test sends exactly the bytes the audit sent and asserts the behaviour the issue asks
for; where the defect is about what is stored, what the buffer holds is counted. Bounds on
resources are asserted on a measurable quantity (a connection closed, bytes still held,
bytes sent before the answer), never on elapsed time.
"""

from __future__ import annotations

import gc
import gzip
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from agent.ingest.http.protocol import Request
from tests.http import raw
from tests.http.harness import Served, hold_writer
from tests.waiting import wait_until

WAIT = 30.0
TOKEN = "conformance-token"


def _values(served: Served, topic: str) -> list[bytes]:
    return [m.record.value for m in served.messages(topic)]


def _exchange(served: Served, request: bytes) -> bytes:
    """Send ``request`` whole and read everything until the server closes."""
    with raw.connect(served) as sock:
        sock.sendall(request)
        return raw.read_until_closed(sock)


def _later_publish_is_stored(served: Served) -> None:
    """Hand-overs to the writer keep their order: once a later publish is answered, one
    handed over before it would be stored too, so an empty topic means nothing came."""
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("marker", b"m"))
        assert raw.status(raw.read_answers(sock, 1)[0]) == 202


# -- A: Upgrade on a publish -----------------------------------------------------------------

# What `curl --http2 --data-binary hello http://.../topics/t` sends: an h2c upgrade offer.
_H2C = (b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
        b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "body-later"])
def test_a_publish_offering_an_upgrade_stores_its_body(served: Served, split: bool) -> None:
    """A: the parser ended an Upgrade request at its headers; the publish was answered 2xx
    with an empty message stored. It is served as plain HTTP/1.1 (never 101), body whole."""
    request = raw.publish("up", b"hello", *_H2C)
    head, body = request.split(b"\r\n\r\n", 1)
    with raw.connect(served) as sock:
        if split:
            sock.sendall(head + b"\r\n\r\n")
            sock.sendall(body)
        else:
            sock.sendall(request)
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 202, answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1
    assert _values(served, "up") == [b"hello"]


def test_a_chunked_publish_offering_an_upgrade_stores_its_body(served: Served) -> None:
    request = (b"POST /topics/upc HTTP/1.1\r\nHost: x\r\n" + b"\r\n".join(_H2C)
               + b"\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n")
    answer = _exchange(served, request)
    assert raw.status(answer) == 202, answer[:200]
    assert _values(served, "upc") == [b"hello"]


def test_an_upgrade_publish_keeps_the_body_limit(serve: Callable[..., Served]) -> None:
    """The body read after an Upgrade request's headers is held to the same limit."""
    served = serve(topics={"default": {"ack_timeout_ms": 0, "max_message_bytes": 100}})
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("upbig", b"x" * 101, *_H2C))
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 413, answer[:200]
    _later_publish_is_stored(served)
    assert _values(served, "upbig") == []


def test_an_upgrade_without_a_body_is_answered_as_plain_http(served: Served) -> None:
    answer = _exchange(served, b"GET /status/ping HTTP/1.1\r\nHost: x\r\n"
                       + b"\r\n".join(_H2C) + b"\r\n\r\n")
    assert raw.status(answer) == 200 and answer.endswith(b"pong")


# -- B: a publish followed by FIN ------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 3])
def test_publishes_followed_by_a_half_close_are_answered(served: Served, count: int) -> None:
    """B: a complete publish then shutdown(SHUT_WR) was stored and never answered."""
    with raw.connect(served) as sock:
        sock.sendall(b"".join(raw.publish("fin", b"%d" % i) for i in range(count)))
        sock.shutdown(socket.SHUT_WR)
        answers = raw.split_answers(raw.read_until_closed(sock))
    assert [raw.status(a) for a in answers] == [202] * count
    assert _values(served, "fin") == [b"%d" % i for i in range(count)]


def test_a_half_close_in_the_middle_of_a_body_stores_nothing(served: Served) -> None:
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("cut", b"0123456789")[:-4])
        sock.shutdown(socket.SHUT_WR)
        assert raw.read_until_closed(sock) == b""
    _later_publish_is_stored(served)
    assert _values(served, "cut") == []
    assert served.counter("http_requests", route="publish", status="499") == 1


# -- C: a client that never reads its answers ------------------------------------------------

def test_a_client_that_never_reads_its_answers_is_closed(served: Served) -> None:
    """C: pipelined requests whose answers are never read held the connection, its queue
    and its answers with no deadline. The write deadline (10 s by default) closes it."""
    big = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 16  # KiBs per answer
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((served.server.host, served.server.port))
        sock.settimeout(1.0)
        # Send until the server has stopped reading for 3 s in a row: its queue is full
        # behind answers it cannot write. Bounded: 64 MiB of requests at most.
        stalls = sent = 0
        while stalls < 3 and sent < 64 * 1024 * 1024:
            try:
                sent += sock.send(big)
                stalls = 0
            except TimeoutError:
                stalls += 1
        assert stalls == 3, "the server read every request without its answers blocking"
        wait_until(lambda: not served.server.connections.open, timeout=WAIT,
                   message="the connection that reads no answers is closed")
    finally:
        sock.close()
    # And the server still serves.
    with raw.connect(served) as other:
        other.sendall(raw.publish("after", b"x"))
        assert raw.status(raw.read_answers(other, 1)[0]) == 202


def test_pipelined_bodies_held_ahead_of_their_answers_are_bounded(
    serve: Callable[..., Served],
) -> None:
    """C: a client pipelining big publishes behind one that cannot be answered yet (its
    commit is held) made the server read and hold them all: up to 32 bodies of 16 MiB. It
    stops reading once 4 MiB of bodies wait (MAX_QUEUED_BYTES), and serves them all later."""
    served = serve(topics={"default": {"ack_timeout_ms": 0, "max_message_bytes": 2 << 20}})
    count, size = 24, 1 << 20
    payload = b"".join(raw.publish("piped", b"%02d" % i + b"x" * (size - 2))
                       for i in range(count))
    gate = hold_writer(served)
    sock = raw.connect(served)
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    try:
        sender.start()
        wait_until(lambda: any(c.read_paused for c in list(served.server.connections.open)),
                   timeout=WAIT, message="the server stopped reading the pipelined bodies")
        held = _body_bytes_held()
        assert held <= 8 * size, f"{held} bytes of pipelined bodies held by one connection"
        gate.release.set()
        answers = raw.read_answers(sock, count)
        sender.join(WAIT)
    finally:
        gate.release.set()
        sock.close()
    assert [raw.status(a) for a in answers] == [202] * count
    assert [v[:2] for v in _values(served, "piped")] == [b"%02d" % i for i in range(count)]


# -- D: abandoned bodies are released with their connection ----------------------------------

@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees memory during the test: what a closed connection
    still holds is then visible, whenever the collector would have run."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _body_bytes_held() -> int:
    return sum(sum(len(p) for p in o.parts) for o in gc.get_objects() if type(o) is Request)


def test_abandoned_bodies_are_released_when_their_connections_close(
    served: Served, no_cyclic_gc: None
) -> None:
    """D: a connection closed mid-body kept its request (and the body read so far) until
    the cyclic collector ran: 400 abandoned 4 MiB bodies held 1.5 GB."""
    conns, size = 12, 2 * 1024 * 1024
    head = (b"POST /topics/abandoned/batch HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % (size + 1))
    socks = [raw.connect(served) for _ in range(conns)]
    try:
        for sock in socks:
            sock.sendall(head + b"x" * size)  # one byte short: the body never completes
        wait_until(lambda: _body_bytes_held() >= conns * size, timeout=WAIT,
                   message="the server read every body")
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: not served.server.connections.open, timeout=WAIT,
               message="the connections closed")
    held = _body_bytes_held()
    assert held < size, f"{held} bytes of abandoned bodies still held"
    assert _values(served, "abandoned") == []


# -- E: the trailer section is bounded like the headers --------------------------------------

def test_an_endless_trailer_section_is_refused_within_the_header_limit(served: Served) -> None:
    """E: trailers escaped max_header_bytes; a 64 MiB trailer was refused only once whole,
    after seconds of CPU. It is refused once it is over the limit (32 KiB by default): the
    431 arrives long before the client has sent 16 MiB of it."""
    head = (b"POST /topics/trail HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Trailer: ")
    try:
        answered_after, sent, answer = raw.send_until_answered(served, head, b"a" * 65536,
                                                               16 * 1024 * 1024, WAIT)
    except ConnectionResetError:
        pytest.fail("reset without an answer to one endless trailer")
    assert answered_after is not None, f"no answer after {sent} bytes of one trailer"
    assert raw.status(answer) == 431, answer[:200]
    assert _values(served, "trail") == []


def test_chunked_bodies_of_many_small_chunks_are_still_read(served: Served) -> None:
    """The trailer bound counts framing per chunk: many tiny chunks are not refused."""
    chunks = b"".join(b"1\r\n%c\r\n" % (97 + i % 26) for i in range(20_000))
    answer = _exchange(served, b"POST /topics/tiny HTTP/1.1\r\nHost: x\r\nConnection: close"
                       b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    assert raw.status(answer) == 202, answer[:200]
    assert len(_values(served, "tiny")[0]) == 20_000


# -- F: multi-member gzip --------------------------------------------------------------------

def test_a_multi_member_gzip_body_is_stored_whole(served: Served) -> None:
    """F: gzip(a) + gzip(b) was answered 201/202 with only a stored."""
    body = gzip.compress(b"first half, ") + gzip.compress(b"second half")
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("gz", body, b"Content-Encoding: gzip"))
        answer = raw.read_answers(sock, 1)[0]
    assert raw.status(answer) == 202, answer[:200]
    assert _values(served, "gz") == [b"first half, second half"]


@pytest.mark.parametrize("tail", [b"garbage", gzip.compress(b"cut short")[:-3]],
                         ids=["garbage", "truncated-member"])
def test_bytes_after_a_gzip_member_that_are_not_one_are_refused(
    served: Served, tail: bytes
) -> None:
    body = gzip.compress(b"kept?") + tail
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("gzbad", body, b"Content-Encoding: gzip"))
        answer = raw.read_answers(sock, 1)[0]
    assert raw.status(answer) == 400, answer[:200]
    _later_publish_is_stored(served)
    assert _values(served, "gzbad") == []


def test_a_multi_member_gzip_over_the_limit_is_refused(serve: Callable[..., Served]) -> None:
    served = serve(topics={"default": {"ack_timeout_ms": 0, "max_message_bytes": 1000}})
    body = gzip.compress(b"a" * 600) + gzip.compress(b"b" * 600)
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("gzbig", body, b"Content-Encoding: gzip"))
        answer = raw.read_answers(sock, 1)[0]
    assert raw.status(answer) == 413, answer[:200]
    assert _values(served, "gzbig") == []


# -- still open from earlier audits ----------------------------------------------------------

@pytest.mark.parametrize("hosts", [(), (b"Host: a", b"Host: b")], ids=["none", "two"])
def test_an_http11_request_without_exactly_one_host_is_refused(
    served: Served, hosts: tuple[bytes, ...]
) -> None:
    """RFC 9112 §3.2: 400 for an HTTP/1.1 request with no Host or with two."""
    request = b"\r\n".join([b"POST /topics/host HTTP/1.1", *hosts, b"Content-Length: 1"])
    answer = _exchange(served, request + b"\r\n\r\nx")
    assert raw.status(answer) == 400, answer[:200]
    _later_publish_is_stored(served)
    assert _values(served, "host") == []


def test_an_http10_request_without_host_is_served(served: Served) -> None:
    answer = _exchange(served, b"POST /topics/h10 HTTP/1.0\r\nContent-Length: 1\r\n\r\nx")
    assert raw.status(answer) == 202, answer[:200]
    assert _values(served, "h10") == [b"x"]


@pytest.mark.parametrize("coding", [b"identity, chunked", b"chunked, chunked", b"gzip"])
def test_a_transfer_coding_other_than_chunked_is_refused(served: Served, coding: bytes) -> None:
    answer = _exchange(served, b"POST /topics/te HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                       + coding + b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert raw.status(answer) in (400, 501), answer[:200]
    _later_publish_is_stored(served)
    assert _values(served, "te") == []


def test_an_http2_request_line_over_http11_is_refused(served: Served) -> None:
    answer = _exchange(served, b"POST /topics/h2 HTTP/2.0\r\nHost: x\r\nContent-Length: 1"
                       b"\r\n\r\nx")
    assert raw.status(answer) == 505, answer[:200]
    _later_publish_is_stored(served)
    assert _values(served, "h2") == []


@pytest.mark.parametrize("length", [b"1000001", b" 999999999 "],
                         ids=["over-the-topic-limit", "with-spaces"])
def test_a_declared_oversized_body_is_refused_before_it_is_sent(
    serve: Callable[..., Served], length: bytes
) -> None:
    """Not 408 once the body deadline passes: 413 on the headers alone."""
    served = serve(http={"body_timeout_seconds": 3.0})
    with raw.connect(served) as sock:
        sock.sendall(b"POST /topics/big HTTP/1.1\r\nHost: x\r\nContent-Length:" + length
                     + b"\r\n\r\n")
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 413, answer[:200]


def test_deleting_an_illegal_topic_name_is_a_bad_request(serve: Callable[..., Served]) -> None:
    served = serve(http={"management_token": TOKEN})
    answer = _exchange(served, b"DELETE /topics/bad!name HTTP/1.1\r\nHost: x\r\n"
                       b"Authorization: Bearer " + TOKEN.encode()
                       + b"\r\nConnection: close\r\n\r\n")
    assert raw.status(answer) == 400, answer[:200]
    assert b'"invalid_topic"' in answer
