"""protocol.py: every publish goes to ``Publisher.publish`` with its whole body, without ASGI,
however its bytes arrive; every odd case of the HTTP exchange (pipelining, Expect, close,
shutdown, clients that leave) is answered in order and correctly.

Requests are written on raw sockets, so what arrives together is under the test's control.
That no publish took the ASGI path is observed with a spy on its entry (``Publisher.__call__``).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.buffer import keys
from agent.ingest.http.protocol import Request
from agent.ingest.http.publish import Publisher
from tests.http import raw
from tests.http.harness import WAIT, Served, hold_writer, queued_messages
from tests.waiting import wait_until


@pytest.fixture
def asgi_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The topics of publishes that went through ASGI (``Publisher.__call__``)."""
    calls: list[str] = []
    original = Publisher.__call__

    async def spy(self: Publisher, scope: Any, receive: Any, send: Any, topic: str,
                  batch: bool) -> None:
        calls.append(topic)
        await original(self, scope, receive, send, topic, batch)

    monkeypatch.setattr(Publisher, "__call__", spy)
    yield calls


def _values(served: Served, topic: str) -> list[bytes]:
    return [m.record.value for m in served.messages(topic)]


def test_a_publish_that_came_whole_is_answered_without_asgi(
    served: Served, asgi_calls: list[str]
) -> None:
    batch_request = raw.publish("d", b"[1]", b"Content-Type: x").replace(b"/topics/d ",
                                                                       b"/topics/d/batch ")
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("d", b"one"))
        (single,) = raw.read_answers(sock, 1)
        sock.sendall(batch_request)
        (batch,) = raw.read_answers(sock, 1)
    assert single.startswith(b"HTTP/1.1 202 Accepted\r\n")
    assert b"\r\ndate: " in single
    assert b"\r\nferry-message-id: " in single and b"\r\nhermes-message-id: " in single
    assert batch.startswith(b"HTTP/1.1 415 ")  # refusals are answered directly too
    assert asgi_calls == []
    assert _values(served, "d") == [b"one"]
    assert served.counter("http_requests", route="publish", status="202") == 1
    assert served.counter("http_requests", route="batch", status="415") == 1
    assert served.counter("messages_received", source="http") == 2


def test_a_body_still_coming_is_stored_whole_once_it_is_in(
    served: Served, asgi_calls: list[str]
) -> None:
    request = raw.publish("late", b"0123456789")
    with raw.connect(served) as sock:
        sock.sendall(request[:-4])
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing is answered before the body is whole
        sock.settimeout(raw.TIMEOUT)
        sock.sendall(request[-4:])
        (answer,) = raw.read_answers(sock, 1)
    assert answer.startswith(b"HTTP/1.1 202 ")
    assert _values(served, "late") == [b"0123456789"]
    assert asgi_calls == []


def test_pipelined_requests_of_both_paths_are_answered_in_order(
    served: Served, asgi_calls: list[str]
) -> None:
    ping = b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n"
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("p", b"a") + ping + raw.publish("p", b"b")
                     + raw.publish("p", b"c"))
        answers = raw.read_answers(sock, 4)
        sock.sendall(raw.publish("p", b"d"))  # the connection still serves, directly
        (last,) = raw.read_answers(sock, 1)
    assert [a.split(b" ", 2)[1] for a in answers] == [b"202", b"200", b"202", b"202"]
    assert answers[1].endswith(b"pong")
    assert last.startswith(b"HTTP/1.1 202 ")
    assert _values(served, "p") == [b"a", b"b", b"c", b"d"]
    stored = [keys.id_text(m.id).encode() for m in served.messages("p")]
    published = [a.split(b"\r\nferry-message-id: ")[1].split(b"\r\n")[0]
                 for a in (answers[0], *answers[2:], last)]
    assert published == stored


def test_a_publish_behind_one_waiting_for_kafka_is_answered_after_it(
    serve: Callable[..., Served], asgi_calls: list[str]
) -> None:
    """The first publish waits for Kafka (no forwarder here: 202 at its ack_timeout_ms); the
    one pipelined behind it could be stored and answered at once, but answers go in order."""
    served = serve(topics={"default": {"ack_timeout_ms": 0},
                           "waits": {"ack_timeout_ms": 300}})
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("waits", b"first") + raw.publish("quick", b"second"))
        first, second = raw.read_answers(sock, 2)
    assert b'"delivered":false' in first and b"second" not in first
    assert second.startswith(b"HTTP/1.1 202 ")
    assert _values(served, "waits") == [b"first"] and _values(served, "quick") == [b"second"]
    assert asgi_calls == []


def test_expect_100_continue_is_answered(served: Served) -> None:
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("c", b"", b"Expect: 100-continue").replace(
            b"Content-Length: 0", b"Content-Length: 4"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"body")
        (answer,) = raw.read_answers(sock, 1)
    assert answer.startswith(b"HTTP/1.1 202 ")
    assert _values(served, "c") == [b"body"]


@pytest.mark.parametrize("request_bytes", [
    raw.publish("k", b"v", b"Connection: close"),
    raw.publish("k", b"v", version=b"1.0"),
], ids=["connection-close", "http-1.0"])
def test_a_client_that_asks_for_close_gets_its_answer_then_the_close(
    served: Served, asgi_calls: list[str], request_bytes: bytes
) -> None:
    with raw.connect(served) as sock:
        sock.sendall(request_bytes)
        answer = raw.read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 202 ")
    assert b"\r\nconnection: close\r\n" in answer
    assert asgi_calls == []
    assert _values(served, "k") == [b"v"]


@pytest.mark.parametrize(("path", "topic"), [
    (b"/topics/q?x=1", "q"),
    (b"/topics/t%2Dx", "t-x"),
], ids=["query", "percent-encoded"])
def test_other_spellings_of_a_publish_path_still_publish(
    served: Served, asgi_calls: list[str], path: bytes, topic: str
) -> None:
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("t", b"v").replace(b"/topics/t", path, 1))
        (answer,) = raw.read_answers(sock, 1)
    assert answer.startswith(b"HTTP/1.1 202 ")
    assert asgi_calls == []
    assert _values(served, topic) == [b"v"]


def test_stopping_answers_a_direct_publish_in_flight_then_closes(served: Served) -> None:
    gate = hold_writer(served)
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("s", b"in flight"))
        wait_until(lambda: queued_messages(served) == 1, timeout=WAIT,
                   message="the publish queued for the writer")
        stopper = threading.Thread(target=served.server.stop, args=(WAIT,))
        stopper.start()
        wait_until(lambda: not served.runtime.accepting, timeout=WAIT, message="stopping")
        gate.release.set()
        answer = raw.read_until_closed(sock)
        stopper.join(WAIT)
    assert not stopper.is_alive()
    # Answered, then closed (a server stopping keeps no connection alive).
    assert answer.startswith(b"HTTP/1.1 202 ") and answer.count(b"HTTP/1.1 ") == 1
    assert _values(served, "s") == [b"in flight"]


def test_a_client_gone_before_its_commit_leaves_the_server_serving(served: Served) -> None:
    gate = hold_writer(served)
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("g", b"orphan"))
        wait_until(lambda: queued_messages(served) == 1, timeout=WAIT,
                   message="the publish queued for the writer")
    gate.release.set()
    # Stored (it was handed over before the client left) and counted like any other.
    wait_until(lambda: _values(served, "g") == [b"orphan"], timeout=WAIT, message="stored")
    wait_until(lambda: served.counter("http_requests", route="publish", status="202") == 1,
               timeout=WAIT, message="counted")
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("g", b"next"))
        (answer,) = raw.read_answers(sock, 1)
    assert answer.startswith(b"HTTP/1.1 202 ")


def test_a_long_keep_alive_connection_does_not_keep_its_past_requests(served: Served) -> None:
    def alive() -> int:
        return sum(type(o) is Request for o in gc.get_objects())

    with raw.connect(served) as sock:
        for i in range(30):
            sock.sendall(raw.publish("kept", b"%d" % i))
            raw.read_answers(sock, 1)
        # Answered requests are not kept by their connection.
        assert alive() <= 1
    assert len(_values(served, "kept")) == 30


def test_a_refusal_answered_at_once_does_not_time_out_the_request_behind_it(
    serve: Callable[..., Served],
) -> None:
    """The first request is refused while its read is parsed; the one pipelined behind it
    waits 1 s for Kafka (no forwarder: 202 then), past the 0.3 s keep-alive timeout, which
    must not close the connection under it."""
    served = serve(http={"keep_alive_seconds": 0.3},
                   topics={"default": {"ack_timeout_ms": 0}, "waits": {"ack_timeout_ms": 1000}})
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("bad!topic", b"x") + raw.publish("waits", b"kept"))
        refused, stored = raw.read_answers(sock, 2)
    assert refused.startswith(b"HTTP/1.1 400 ") and stored.startswith(b"HTTP/1.1 202 ")
    assert _values(served, "waits") == [b"kept"]


def test_no_request_behind_an_answer_that_closed_the_connection_is_run(
    serve: Callable[..., Served],
) -> None:
    """A chunked body over the limit is refused (413) and the connection closed while the
    read is still parsed; what was pipelined behind it, of either path (a publish that would
    go direct, a probe, a publish with a query), is neither run nor answered."""
    served = serve(topics={"default": {"ack_timeout_ms": 0, "max_message_bytes": 8}})
    chunked = (b"POST /topics/z HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"10\r\n0123456789abcdef\r\n0\r\n\r\n")
    ping = b"GET /status/ping HTTP/1.1\r\nHost: x\r\n\r\n"
    behind = (raw.publish("z", b"behind") + ping
              + raw.publish("q", b"v").replace(b"/topics/q", b"/topics/q?a"))
    with raw.connect(served) as sock:
        sock.sendall(chunked + behind)
        answer = raw.read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 413 ") and answer.count(b"HTTP/1.1 ") == 1
    assert b"\r\nconnection: close\r\n" in answer
    # Hand-overs to the writer keep their order: once a later publish is answered, one
    # handed over before it would be stored too.
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("later", b"x"))
        assert raw.read_answers(sock, 1)[0].startswith(b"HTTP/1.1 202 ")
    assert _values(served, "z") == [] and _values(served, "q") == []
    assert served.counter("http_requests", route="/status/ping") == 0
    assert served.counter("http_requests", status="499") == 0


@pytest.mark.parametrize("headers", [(), (b"Idempotency-Key: k-1",)],
                         ids=["on-callbacks", "as-a-task"])
def test_stopping_waits_for_a_direct_publish_whose_client_has_gone(
    served: Served, headers: tuple[bytes, ...]
) -> None:
    # The server is fresh: this is the first publish it sees (the publisher binds to the
    # loop with it), with the writer held so that its commit cannot come back in time.
    gate = hold_writer(served)
    with raw.connect(served) as sock:
        sock.sendall(raw.publish("gone", b"stored", *headers))
        wait_until(lambda: queued_messages(served) == 1, timeout=WAIT,
                   message="the publish queued for the writer")
    stopper = threading.Thread(target=served.server.stop, args=(WAIT,))
    stopper.start()
    stopper.join(1.0)
    assert stopper.is_alive(), "the server stopped with a publish still being stored"
    gate.release.set()
    stopper.join(WAIT)
    assert not stopper.is_alive()
    # Stored, and counted as received and answered, like a publish whose client stayed.
    assert _values(served, "gone") == [b"stored"]
    assert served.counter("http_requests", route="publish", status="202") == 1
    assert served.counter("messages_received", source="http") == 1
