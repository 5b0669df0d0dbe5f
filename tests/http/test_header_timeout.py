"""``http.header_timeout_seconds``: connections that never finish a request's headers are
closed, so they cannot hold descriptors for good; requests in progress are not affected.
``http.keep_alive_seconds``: after a response, a connection that sends nothing is closed
sooner. Both are kept by one timer per connection (protocol.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.http import raw
from tests.http.harness import Served


def _serve(serve: Callable[..., Served]) -> Served:
    return serve(http={"header_timeout_seconds": 0.3, "body_timeout_seconds": 1.0})


def test_a_connection_that_sends_nothing_is_closed(serve: Callable[..., Served]) -> None:
    served = _serve(serve)
    with raw.connect(served) as sock:
        assert raw.read_until_closed(sock) == b""


def test_a_request_whose_headers_never_finish_is_closed_unanswered(
    serve: Callable[..., Served],
) -> None:
    served = _serve(serve)
    with raw.connect(served) as sock:
        sock.sendall(b"POST /topics/t HTTP/1.1\r\nHost: x\r\n")
        assert raw.read_until_closed(sock) == b""
    assert served.store.topic_stats() == []


def test_an_idle_keep_alive_connection_is_closed_after_its_response(
    serve: Callable[..., Served],
) -> None:
    served = _serve(serve)
    with raw.connect(served) as sock:
        sock.sendall(b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
        answer = raw.read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 202 ")
    assert [m.record.value for m in served.messages("t")] == [b"ok"]


def test_a_slow_body_is_the_body_timeout_s_business_not_the_header_deadline(
    serve: Callable[..., Served],
) -> None:
    """Headers complete, body never comes: the answer is the documented 408, which only
    arrives after the header deadline has passed, so the deadline was cancelled in time."""
    served = _serve(serve)
    with raw.connect(served) as sock:
        sock.sendall(b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        answer = raw.read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"request_timeout" in answer
    assert served.store.topic_stats() == []


def test_pipelined_requests_are_all_answered(serve: Callable[..., Served]) -> None:
    served = _serve(serve)
    one = b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n"
    with raw.connect(served) as sock:
        sock.sendall(one + b"a" + one + b"b" + one + b"c")
        answer = raw.read_until_closed(sock)
    assert answer.count(b"HTTP/1.1 202 ") == 3
    assert [m.record.value for m in served.messages("t")] == [b"a", b"b", b"c"]


def test_a_pipelined_request_still_running_is_not_cut_off(serve: Callable[..., Served]) -> None:
    """The second of two pipelined publishes waits for Kafka longer than the header deadline
    (ack_timeout_ms, no forwarder here, so 202 after it): the deadline must not run while
    that request is in progress, or its answer is lost although its message is stored."""
    served = serve(http={"header_timeout_seconds": 0.3},
                   topics={"default": {"ack_timeout_ms": 800}})
    one = b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n"
    with raw.connect(served) as sock:
        sock.sendall(one + b"a" + one + b"b")
        answer = raw.read_until_closed(sock)
    assert answer.count(b"HTTP/1.1 202 ") == 2
    assert [m.record.value for m in served.messages("t")] == [b"a", b"b"]


def test_a_silent_keep_alive_connection_is_closed_at_the_keep_alive_timeout(
    serve: Callable[..., Served],
) -> None:
    # The header deadline is far away (60 s) and the read gives up after 10 s: only the
    # keep-alive timeout can close this connection in time.
    served = serve(http={"header_timeout_seconds": 60, "keep_alive_seconds": 0.3})
    with raw.connect(served) as sock:
        sock.sendall(b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
        answer = raw.read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 202 ") and answer.count(b"HTTP/1.1 ") == 1


def test_a_request_begun_after_a_response_is_not_cut_off_by_the_keep_alive_timeout(
    serve: Callable[..., Served],
) -> None:
    served = serve(http={"header_timeout_seconds": 60, "keep_alive_seconds": 0.3})
    one = b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n"
    with raw.connect(served) as sock:
        sock.sendall(one + b"a")
        (first,) = raw.read_answers(sock, 1)
        sock.sendall(one[:20])  # the next request begins...
        # ...and is finished well after the keep-alive timeout: the time passing is what is
        # under test here, not a wait for something to happen.
        time.sleep(1.0)
        sock.sendall(one[20:] + b"b")
        (second,) = raw.read_answers(sock, 1)
    assert first.startswith(b"HTTP/1.1 202 ") and second.startswith(b"HTTP/1.1 202 ")
    assert [m.record.value for m in served.messages("t")] == [b"a", b"b"]


@pytest.mark.parametrize("first", [
    b"POST /topics/bad!topic HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx",  # refused
    b"POST /topics/t HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx",  # stored
], ids=["behind-a-refusal", "behind-a-publish"])
def test_a_request_begun_before_the_answer_before_it_gets_the_header_deadline(
    serve: Callable[..., Served], first: bytes
) -> None:
    """The second request's first bytes come with the first request: when the first is
    answered, the connection is not idle, so the keep-alive timeout (0.3 s) must not close
    it while the rest of the second request's headers take 1 s to come."""
    served = serve(http={"header_timeout_seconds": 60, "keep_alive_seconds": 0.3})
    ping = b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n"
    with raw.connect(served) as sock:
        sock.sendall(first + ping[:20])
        time.sleep(1.0)  # a slow client: the time passing is what is under test
        sock.sendall(ping[20:])
        answers = raw.read_until_closed(sock)  # closed by the keep-alive timeout at the end
    assert answers.count(b"HTTP/1.1 ") == 2 and answers.endswith(b"pong")


def test_an_upload_answered_early_is_not_cut_off_by_the_deadlines(
    serve: Callable[..., Served],
) -> None:
    """A publish refused by its headers (bad topic name) is answered at once while its
    declared body is still being uploaded; the rest is read and dropped. Neither the header
    deadline nor the keep-alive timeout may close the connection during that upload."""
    served = serve(http={"header_timeout_seconds": 0.4, "keep_alive_seconds": 0.2})
    chunk = b"a" * 1000
    with raw.connect(served) as sock:
        sock.sendall(b"POST /topics/bad!topic HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     b"%d\r\n\r\n" % (len(chunk) * 9) + chunk)
        for _ in range(8):
            time.sleep(0.15)  # a slow upload, 1.2 s in all: longer than both limits
            sock.sendall(chunk)  # raises (EPIPE / reset) if the server closed
        answer = raw.read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1 ") == 1
