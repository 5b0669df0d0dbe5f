"""The limits of the HTTP exchange (protocol.py), attacked on raw sockets: early answers close
their connection, headers and request lines have a size, the connection cap makes room, bad
bytes after a good request do not take its answer away, and every refusal is one JSON shape.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import socket
from collections.abc import Callable

import pytest

from tests.http import raw
from tests.http.harness import Served
from tests.waiting import wait_until


def _error(answer: bytes) -> dict[str, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"\r\ncontent-type: application/json" in head.lower(), head
    doc = json.loads(body)
    assert doc["code"] == doc["error"] and doc["message"], doc
    return dict(doc)


def _values(served: Served, topic: str) -> list[bytes]:
    return [m.record.value for m in served.messages(topic)]


def test_an_answer_before_the_body_arrived_closes_the_connection(
    serve: Callable[..., Served],
) -> None:
    """A probe declaring a body it never sends is answered 408 at the body deadline, then
    closed: it does not hold its descriptor for ever."""
    served = serve(http={"body_timeout_seconds": 0.5, "keep_alive_seconds": 30,
                         "header_timeout_seconds": 30})
    with raw.connect(served) as sock:
        sock.sendall(b"GET /status/ping HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 408 and _error(answer)["code"] == "request_timeout"
    assert b"\r\nconnection: close\r\n" in answer


@pytest.mark.parametrize("request_bytes", [
    raw.publish("t", b"", b"Authorization: x").replace(b"Content-Length: 0",
                                                       b"Content-Length: 99999999"),
    b"GET /status/ping HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n",
], ids=["publish", "probe"])
def test_a_declared_body_over_the_limit_is_413_and_closed(
    served: Served, request_bytes: bytes
) -> None:
    with raw.connect(served) as sock:
        sock.sendall(request_bytes)
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 413 and _error(answer)["code"] == "too_large"
    assert answer.count(b"HTTP/1.1 ") == 1


@pytest.mark.parametrize("header", [
    b"X-Big: " + b"a" * (1024 * 1024),
    b"\r\n".join(b"X-%d: v" % i for i in range(5000)),
], ids=["one-1MiB-header", "5000-header-lines"])
def test_headers_over_the_limit_are_431_and_closed(served: Served, header: bytes) -> None:
    with raw.connect(served) as sock:
        # Refused before it was all sent, perhaps: the answer is there all the same.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(raw.publish("h", b"v", header))
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 431 and _error(answer)["code"] == "headers_too_large"
    assert served.messages("h") == []


def test_a_huge_header_trickled_in_costs_no_more_than_the_limit(served: Served) -> None:
    """64 KiB pieces of one header: refused once the limit (32 KiB) is passed, without the
    parser ever holding more; the server answers another client at once meanwhile."""
    with raw.connect(served) as sock, raw.connect(served) as other:
        sock.sendall(b"POST /topics/h HTTP/1.1\r\nHost: x\r\nX-Big: ")
        refused = False
        for _ in range(64):
            try:
                sock.sendall(b"a" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                refused = True
                break
        answer = raw.read_until_closed(sock)
        other.sendall(raw.publish("h", b"fine"))
        (fine,) = raw.read_answers(other, 1)
    assert refused or answer
    assert raw.status(answer) == 431
    assert raw.status(fine) == 202 and _values(served, "h") == [b"fine"]


def test_a_request_line_over_the_limit_is_414(served: Served) -> None:
    with raw.connect(served) as sock:
        sock.sendall(b"GET /status/" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 414 and _error(answer)["code"] == "uri_too_long"


def test_garbage_after_a_valid_publish_leaves_it_its_2xx(served: Served) -> None:
    """The publish parsed before the bad bytes is stored and answered 202; the garbage gets
    the 400 after it, and the connection closes. A client sees the truth about both."""
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("g", b"stored") + b"\x00\x01 NOT HTTP\r\n\r\n")
        answer = raw.read_until_closed(sock)
    first, second = raw.split_answers(answer)
    assert raw.status(first) == 202
    assert raw.status(second) == 400 and _error(second)["code"] == "invalid_http"
    assert _values(served, "g") == [b"stored"]


def test_parser_errors_are_json(served: Served) -> None:
    with raw.connect(served) as sock:
        sock.sendall(b"BLAH\r\n\r\n")
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 400 and _error(answer)["code"] == "invalid_http"


def test_the_cap_closes_the_connection_idle_longest_to_serve_a_new_one(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.ingest.http.protocol")
    served = serve(http={"max_connections": 20})
    idle = [raw.connect(served) for _ in range(20)]
    try:
        wait_until(lambda: len(served.server.connections.open) == 20, timeout=10,
                   message="20 connections accepted")
        with raw.connect(served) as sock:
            sock.sendall(raw.publish("cap", b"new"))
            (answer,) = raw.read_answers(sock, 1)
        assert raw.status(answer) == 202
        assert raw.read_until_closed(idle[0]) == b""  # evicted
        # Counted, and said once, for the operator who may want a higher cap.
        assert served.counter("http_connections_closed", reason="closed_for_room") == 1
        assert served.counter("http_connections_closed", reason="too_many_connections") == 0
        assert any("closed the connection that waited longest" in r.getMessage()
                   and "(20, http.max_connections)" in r.getMessage() for r in caplog.records)
    finally:
        for s in idle:
            s.close()


def test_at_the_cap_a_stalled_request_makes_room_too(serve: Callable[..., Served]) -> None:
    """Connections in the middle of a request that stopped coming (slowloris) are not safe
    from the cap either: the one that has waited longest goes."""
    served = serve(http={"max_connections": 5})
    stalled = [raw.connect(served) for _ in range(5)]
    try:
        for s in stalled:
            s.sendall(b"POST /topics/t HTTP/1.1\r\n")
        wait_until(lambda: len(served.server.connections.open) == 5, timeout=10,
                   message="5 connections accepted")
        with raw.connect(served) as sock:
            sock.sendall(raw.publish("cap", b"new"))
            (answer,) = raw.read_answers(sock, 1)
        assert raw.status(answer) == 202
    finally:
        for s in stalled:
            s.close()


def test_at_the_cap_with_every_request_being_answered_a_new_connection_gets_503(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    """Each of the 5 connections holds a publish waiting for Kafka (none runs here: 202 at
    ack_timeout_ms): nothing may be closed, so the sixth is told, in JSON, and closed."""
    served = serve(http={"max_connections": 5},
                   topics={"default": {"ack_timeout_ms": 3000}})
    busy = [raw.connect(served) for _ in range(5)]
    try:
        for s in busy:
            s.sendall(raw.publish("waits", b"v"))
        wait_until(lambda: len(served.server.connections.open) == 5
                   and not served.server.connections.idle, timeout=10,
                   message="5 connections accepted, each with a request being answered")
        with raw.connect(served) as sock:
            answer = raw.read_until_closed(sock)
        assert raw.status(answer) == 503 and _error(answer)["code"] == "too_many_connections"
        assert all(raw.status(raw.read_answers(s, 1)[0]) == 202 for s in busy)
        assert served.counter("http_connections_closed", reason="too_many_connections") == 1
        assert served.counter("http_connections_closed", reason="closed_for_room") == 0
        assert any(r.levelno == logging.WARNING and "refused a new connection (503)" in
                   r.getMessage() for r in caplog.records)
    finally:
        for s in busy:
            s.close()


def test_gzip_bodies_are_decoded_and_other_codings_refused(served: Served) -> None:
    body = gzip.compress(b"unzipped value")
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("z", body, b"Content-Encoding: gzip"))
        (ok,) = raw.read_answers(sock, 1)
        sock.sendall(raw.publish("z", b"x", b"Content-Encoding: br"))
        (refused,) = raw.read_answers(sock, 1)
    assert raw.status(ok) == 202
    assert raw.status(refused) == 415 and _error(refused)["code"] == "unsupported_content_encoding"
    assert _values(served, "z") == [b"unzipped value"]


def test_a_gzip_body_decoding_past_the_limit_is_413(serve: Callable[..., Served]) -> None:
    served = serve(topics={"default": {"ack_timeout_ms": 0, "max_message_bytes": 100_000}})
    bomb = gzip.compress(b"\0" * 10_000_000)
    assert len(bomb) < 100_000
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("bomb", bomb, b"Content-Encoding: gzip"))
        (answer,) = raw.read_answers(sock, 1)
    assert raw.status(answer) == 413
    assert served.messages("bomb") == []


@pytest.mark.parametrize("body", [
    '{"a": 1}'.encode("utf-16"),
    '{"a": 1}'.encode("utf-16-le"),
    b"\xef\xbb\xbf" + b'{"a": 1}',
], ids=["utf-16-bom", "utf-16-le", "utf-8-bom"])
def test_json_topics_take_utf8_only(serve: Callable[..., Served], body: bytes) -> None:
    served = serve(topics={"default": {"ack_timeout_ms": 0, "content_type": "json"}})
    r = served.client.post("/topics/j", content=body,
                           headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_body", r.text
    assert served.messages("j") == []


@pytest.mark.parametrize("path", [b"/topics/x%2Fbatch", b"/topics/x%2fy"])
def test_encoded_slashes_in_a_topic_are_refused(served: Served, path: bytes) -> None:
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("x", b"[1]").replace(b"/topics/x", path, 1))
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 400 and _error(answer)["code"] == "invalid_topic"
    assert served.store.topic_stats() == []


def test_internal_topics_are_refused_unless_configured(serve: Callable[..., Served]) -> None:
    served = serve(http={"internal_topics": ["__allowed"]})
    r = served.client.post("/topics/__consumer_offsets", content=b"v")
    assert r.status_code == 400 and r.json()["code"] == "internal_topic"
    assert served.client.post("/topics/__allowed", content=b"v").status_code == 202
    assert served.messages("__consumer_offsets") == []


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("PATCH", "/topics/a", {"POST", "GET", "HEAD", "PUT", "DELETE"}),
    ("GET", "/topics/a/batch", {"POST"}),
])
def test_405_names_post_in_allow(served: Served, method: str, path: str,
                                 allowed: set[str]) -> None:
    r = served.client.request(method, path)
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed


def test_an_internal_error_of_a_route_is_json_500(served: Served) -> None:
    def boom() -> None:
        raise RuntimeError("bug")

    served.app.runtime.ready = boom  # type: ignore[method-assign]
    r = served.client.get("/status/ready")
    assert r.status_code == 500 and r.json()["code"] == "internal_error"


def test_the_keep_alive_timeout_follows_an_error_answer_too(
    serve: Callable[..., Served],
) -> None:
    """An error that keeps the connection (404) starts the keep-alive wait like any answer."""
    served = serve(http={"keep_alive_seconds": 0.3})
    with socket.create_connection((served.server.host, served.server.port),
                                  timeout=30) as sock:
        sock.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = raw.read_until_closed(sock)
    assert raw.status(answer) == 404
