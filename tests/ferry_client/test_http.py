"""ferry_client/http.py: publishing over HTTP to a real running agent, and the retry rules."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.daemon.agent import Agent
from ferry_client import FerryHttp, PublishFailed, PublishRejected, publish
from tests.agent_harness import running_agent
from tests.kafka import Broker, consume_all, create_topic, free_port


@pytest.fixture
def agent(tmp_path: Path, session_broker: Broker) -> Iterator[Agent]:
    with running_agent(tmp_path, session_broker.bootstrap, http=True,
                       topics={"default": {"max_message_bytes": 1000}}) as running:
        yield running


def url(agent: Agent) -> str:
    return f"http://{agent.config.http.listen}"


def test_published_messages_reach_kafka(
    agent: Agent, session_broker: Broker, unique_topic: str
) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 2)
    with FerryHttp(url(agent)) as ferry:
        first = ferry.publish(unique_topic, b"one", key="user-1")
        second = ferry.publish(unique_topic, b"two", partition_key=1)
    third = publish(url(agent), unique_topic, b"three")
    for answer in (first, second, third):
        assert answer.status in (201, 202) and answer.delivered == (answer.status == 201)
        assert len(answer.id) == 24 and answer.attempts == 1 and not answer.replayed
    assert len({first.id, second.id, third.id}) == 3
    got = consume_all(session_broker.bootstrap, unique_topic, 3, timeout=20)
    assert sorted((m.value, m.key) for m in got) == [
        (b"one", b"user-1"), (b"three", None), (b"two", None)]
    assert next(m.partition for m in got if m.value == b"two") == 1


def test_the_same_idempotency_key_stores_once(
    agent: Agent, session_broker: Broker, unique_topic: str
) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 1)
    with FerryHttp(url(agent)) as ferry:
        first = ferry.publish(unique_topic, b"once", idempotency_key="order-17")
        again = ferry.publish(unique_topic, b"once", idempotency_key="order-17")
        ferry.publish(unique_topic, b"marker")
    assert again.id == first.id and again.replayed and not first.replayed
    assert first.idempotency_key == "order-17"
    # One partition keeps order: a second copy of "once" would come before the marker.
    got = consume_all(session_broker.bootstrap, unique_topic, 2, timeout=20)
    assert [m.value for m in got] == [b"once", b"marker"]


def test_every_publish_carries_a_fresh_idempotency_key_by_default(
    agent: Agent, unique_topic: str
) -> None:
    with FerryHttp(url(agent)) as ferry:
        a, b = ferry.publish(unique_topic, b"same"), ferry.publish(unique_topic, b"same")
    assert a.idempotency_key and b.idempotency_key and a.idempotency_key != b.idempotency_key
    assert a.id != b.id  # two publishes of the same value are two messages
    with FerryHttp(url(agent), attempts=1) as once:
        assert once.publish(unique_topic, b"x").idempotency_key is None  # nothing to retry


def test_refusals_raise_at_once_with_ferrys_reason(agent: Agent, unique_topic: str) -> None:
    sleeps: list[float] = []
    with FerryHttp(url(agent), sleep=sleeps.append) as ferry:
        with pytest.raises(PublishRejected, match="413 too_large") as info:
            ferry.publish(unique_topic, b"x" * 2000)  # over max_message_bytes (1000)
        assert info.value.status == 413 and info.value.error == "too_large"
        with pytest.raises(PublishRejected, match="422 idempotency_key_reused"):
            ferry.publish(unique_topic, b"a", idempotency_key="k1")
            ferry.publish(unique_topic, b"b", idempotency_key="k1")
        # The connection is still good after a refusal.
        assert ferry.publish(unique_topic, b"fine").status in (201, 202)
    assert sleeps == []  # nothing was retried


def test_bad_arguments_are_refused_before_sending() -> None:
    with FerryHttp(f"http://127.0.0.1:{free_port()}", attempts=1) as ferry:
        with pytest.raises(ValueError, match="legal Kafka topic"):
            ferry.publish("t" * 250, b"v")
        with pytest.raises(ValueError, match="partition_key"):
            ferry.publish("t", b"v", partition_key=2**31)
        with pytest.raises(ValueError, match="value must be bytes"):
            ferry.publish("t", "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="idempotency_key"):
            ferry.publish("t", b"v", idempotency_key="has space")
        with pytest.raises(ValueError, match="key must not be empty"):
            ferry.publish("t", b"v", key="")
    with pytest.raises(ValueError, match="http://host:port"):
        FerryHttp("127.0.0.1:9090")
    with pytest.raises(ValueError, match="attempts"):
        FerryHttp("http://127.0.0.1:9090", attempts=0)


def test_nobody_listening_is_retried_then_fails_clearly() -> None:
    sleeps: list[float] = []
    ferry = FerryHttp(f"http://127.0.0.1:{free_port()}", attempts=4, backoff=0.5,
                      backoff_max=1.0, sleep=sleeps.append)
    with ferry, pytest.raises(PublishFailed, match="after 4 attempt.*ConnectionRefused") as info:
        ferry.publish("t", b"v", idempotency_key="retry-me")
    assert info.value.idempotency_key == "retry-me"  # safe to publish again with it
    assert len(sleeps) == 3  # between attempts, not after the last
    # Full jitter under an exponential cap: 0.5, 1.0, then capped at backoff_max.
    assert all(0 <= s <= cap for s, cap in zip(sleeps, (0.5, 1.0, 1.0), strict=True))


class _Busy(http.server.BaseHTTPRequestHandler):
    """503 with Retry-After for the first ``busy`` requests, then 202; records what came."""

    busy = 2
    seen: list[tuple[str, str | None, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, self.headers.get("Idempotency-Key"), body))
        if len(self.seen) <= self.busy:
            self._answer(503, {"error": "buffer_full", "message": "full"}, {"Retry-After": "2"})
        else:
            self._answer(202, {"id": "0" * 24, "delivered": False}, {})

    def _answer(self, status: int, body: dict[str, object], headers: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/json",
                            "Content-Length": str(len(data))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_busy_answers_are_retried_with_the_same_idempotency_key() -> None:
    # Ferry's 503s (starting, buffer full, overloaded) are hard to hold on cue in a real
    # agent; a stand-in server answers two of them, as docs/http.md describes, then 202.
    _Busy.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    sleeps: list[float] = []
    try:
        with FerryHttp(f"http://127.0.0.1:{server.server_address[1]}", backoff=0.01,
                       backoff_max=3.0, sleep=sleeps.append) as ferry:
            answer = ferry.publish("orders", b"v")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert answer.attempts == 3 and answer.status == 202
    assert [path for path, _, _ in _Busy.seen] == ["/topics/orders"] * 3
    keys = {key for _, key, _ in _Busy.seen}
    assert len(keys) == 1 and keys == {answer.idempotency_key}
    assert sleeps == [2.0, 2.0]  # Retry-After, above the tiny back-off and under its cap


class _ClosesIdle(http.server.BaseHTTPRequestHandler):
    """Keep-alive in name (HTTP/1.1, no "Connection: close"), but closes the connection after
    each answer, as Ferry does to a connection idle for http.keep_alive_seconds."""

    protocol_version = "HTTP/1.1"
    keys: list[str | None] = []
    closed = threading.Semaphore(0)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        self.keys.append(self.headers.get("Idempotency-Key"))
        data = json.dumps({"id": f"{len(self.keys):024d}", "delivered": False}).encode()
        self.send_response(202)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def finish(self) -> None:
        super().finish()
        self.closed.release()

    def log_message(self, *args: object) -> None:
        pass


def test_a_keep_alive_connection_the_server_closed_is_replaced_without_a_retry() -> None:
    _ClosesIdle.keys = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosesIdle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    sleeps: list[float] = []
    try:
        with FerryHttp(f"http://127.0.0.1:{server.server_address[1]}",
                       sleep=sleeps.append) as ferry:
            first = ferry.publish("orders", b"1")
            assert _ClosesIdle.closed.acquire(timeout=5)  # the server closed it after answering
            second = ferry.publish("orders", b"2")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert (first.attempts, second.attempts) == (1, 1) and sleeps == []
    # The closed connection took no request: the server saw two, each with its own key.
    assert _ClosesIdle.keys == [first.idempotency_key, second.idempotency_key]
    assert second.id == f"{2:024d}"
