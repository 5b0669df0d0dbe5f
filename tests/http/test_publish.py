"""POST /topics/{topic} and /batch over real HTTP into a real buffer: every answer it gives."""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import fastavro
import httpx
import pytest

from agent.buffer import keys
from agent.buffer.store import Outcome
from agent.ingest.http.errors import JSON_CONTENT_TYPE
from agent.ingest.http.publish import _id_list, _response, header_pairs
from agent.ingest.runtime import Phase
from tests.http.harness import Served
from tests.waiting import wait_until

AVRO_SCHEMA = {
    "type": "record", "name": "Order", "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "item", "type": "string"},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "tag", "type": "bytes", "default": ""},
    ],
}


def _error(response: httpx.Response) -> dict[str, str]:
    doc = response.json()
    # One shape (errors.py): Hermes clients read "code" and "message".
    assert set(doc) == {"error", "code", "message"} and doc["code"] == doc["error"], doc
    assert response.headers["content-type"] == "application/json"
    return dict(doc)


# -- accepted ---------------------------------------------------------------------------------
def test_publish_answers_202_once_the_message_is_in_the_buffer(served: Served) -> None:
    r = served.client.post("/topics/orders", content=b"hello")
    assert r.status_code == 202
    mid = r.headers["Ferry-Message-Id"]
    assert r.headers["Hermes-Message-Id"] == mid
    assert r.json() == {"id": mid, "delivered": False}
    [stored] = served.messages("orders")
    assert stored.id == keys.parse_id_text(mid)
    assert stored.record.value == b"hello"
    assert stored.record.key is None and stored.record.partition_key is None
    assert served.store.locate(stored.id) == {"state": "buffered", "topic": "orders"}
    assert served.counter("messages_accepted", source="http", topic="orders") == 1
    assert served.counter("http_requests", route="publish", status="202") == 1


def test_partition_headers_and_allow_listed_headers_reach_the_record(
        serve: Callable[..., Served]) -> None:
    served = serve(http={"header_allowlist": ["Trace-Id", "X-Source"]})
    r = served.client.post("/topics/t", content=b"v", headers={
        "Partition-Key": "customer-7", "Ferry-Partition-Key": "-12",
        "trace-id": "abc", "X-Other": "dropped"})
    assert r.status_code == 202
    [m] = served.messages("t")
    assert m.record.key == b"customer-7"
    assert m.record.hash_key is True
    assert m.record.partition_key == -12
    assert m.record.headers == (("Trace-Id", b"abc"),)


@pytest.mark.parametrize("value", ["abc", "2147483648", "-2147483649", "1.5", ""])
def test_bad_ferry_partition_key_is_400(served: Served, value: str) -> None:
    r = served.client.post("/topics/t", content=b"v", headers={"Ferry-Partition-Key": value})
    assert r.status_code == 400
    err = _error(r)
    assert err["error"] == "invalid_header" and "Ferry-Partition-Key" in err["message"]
    assert served.messages("t") == []


def test_empty_partition_key_is_400(served: Served) -> None:
    r = served.client.post("/topics/t", content=b"v", headers={"Partition-Key": ""})
    assert r.status_code == 400
    assert "Partition-Key" in _error(r)["message"]


def test_empty_body_is_a_message_on_a_binary_topic(served: Served) -> None:
    assert served.client.post("/topics/t", content=b"").status_code == 202
    assert [m.record.value for m in served.messages("t")] == [b""]


# -- batches ----------------------------------------------------------------------------------
def test_ndjson_batch_is_one_commit_with_every_id_in_order(served: Served) -> None:
    commits = served.counter("buffer_commits")
    body = b"".join(b'{"n": %d}\n' % i for i in range(500))
    r = served.client.post("/topics/b/batch", content=body,
                           headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 202
    doc = r.json()
    assert doc["count"] == 500 and doc["delivered"] is False
    stored = served.messages("b")
    assert [keys.id_text(m.id) for m in stored] == doc["ids"]
    assert [m.record.value for m in stored] == [b'{"n": %d}' % i for i in range(500)]
    assert served.counter("buffer_commits") == commits + 1


def test_json_array_batch(served: Served) -> None:
    r = served.client.post("/topics/b/batch", json=["text", {"a": 1}, [1, 2], None])
    assert r.status_code == 202
    assert [m.record.value for m in served.messages("b")] == [
        b"text", b'{"a":1}', b"[1,2]", b"null"]


def test_batch_with_one_bad_message_stores_nothing(serve: Callable[..., Served]) -> None:
    served = serve(topics={"j": {"content_type": "json", "ack_timeout_ms": 0}})
    r = served.client.post("/topics/j/batch", content=b'{"ok": 1}\n{"ok": 2}\nnot json\n',
                           headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 400
    assert "line 3" in _error(r)["message"]
    assert served.messages("j") == []
    assert served.counter("messages_rejected", source="http", reason="invalid_body") == 3


def test_batch_with_one_oversized_message_is_413_and_stores_nothing(
        serve: Callable[..., Served]) -> None:
    served = serve(topics={"s": {"max_message_bytes": 10, "ack_timeout_ms": 0}})
    r = served.client.post("/topics/s/batch", json=["short", "this one is too long", "ok"])
    assert r.status_code == 413
    assert "message [1]" in _error(r)["message"]
    assert served.messages("s") == []


@pytest.mark.parametrize(("body", "ctype", "why"), [
    (b"", "application/x-ndjson", "no messages"),
    (b"[]", "application/json", "no messages"),
    (b'{"a": 1}', "application/json", "array"),
    (b"[1, 2", "application/json", "not valid JSON"),
])
def test_bad_batches_are_400(served: Served, body: bytes, ctype: str, why: str) -> None:
    r = served.client.post("/topics/b/batch", content=body, headers={"Content-Type": ctype})
    assert r.status_code == 400
    assert why in _error(r)["message"]


def test_batch_needs_a_batch_content_type(served: Served) -> None:
    r = served.client.post("/topics/b/batch", content=b"a\nb",
                           headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert "NDJSON" in _error(r)["message"]


def test_batch_over_max_batch_bytes_is_413(serve: Callable[..., Served]) -> None:
    served = serve(http={"max_batch_bytes": 1024})
    r = served.client.post("/topics/b/batch", content=b"x\n" * 600,
                           headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 413
    assert "http.max_batch_bytes" in _error(r)["message"]


# -- content types ----------------------------------------------------------------------------
@pytest.fixture
def typed(serve: Callable[..., Served]) -> Served:
    return serve(topics={
        "j": {"content_type": "json", "ack_timeout_ms": 0},
        "js": {"content_type": "json", "ack_timeout_ms": 0, "schema": json.dumps({
            "type": "object", "required": ["id"],
            "properties": {"id": {"type": "integer"}}})},
        "a": {"content_type": "avro", "ack_timeout_ms": 0, "schema": json.dumps(AVRO_SCHEMA)},
    })


def test_json_topic_stores_valid_json_as_sent(typed: Served) -> None:
    body = b'{ "x" : [1, 2] }'
    assert typed.client.post("/topics/j", content=body,
                             headers={"Content-Type": "application/json"}).status_code == 202
    assert typed.client.post("/topics/j", content=b"3").status_code == 202  # no Content-Type
    assert [m.record.value for m in typed.messages("j")] == [body, b"3"]


@pytest.mark.parametrize("body", [b"{nope", b"", b"NaN", b'{"a": Infinity}', b"\xff\xfe"])
def test_json_topic_refuses_what_is_not_json(typed: Served, body: bytes) -> None:
    r = typed.client.post("/topics/j", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = _error(r)
    assert err["error"] == "invalid_body" and "JSON" in err["message"]
    assert typed.messages("j") == []


DEEP = b"[" * 5000  # nested past Python's recursion limit


@pytest.mark.parametrize(("path", "body", "ctype"), [
    ("/topics/j", DEEP, "application/json"),
    ("/topics/j/batch", DEEP, "application/json"),
    ("/topics/j/batch", b"1\n" + DEEP, "application/x-ndjson"),
    ("/topics/a", DEEP, "application/json"),
    # JSON escapes can spell a lone surrogate, which has no UTF-8 form to store.
    ("/topics/j/batch", b'["\\ud800"]', "application/json"),
    ("/topics/bin/batch", b'["ok", "\\udfff"]', "application/json"),
    ("/topics/a", b'{"id": 1, "item": "\\ud800"}', "application/json"),
    ("/topics/a/batch", b'{"id": 1, "item": "\\ud800"}', "application/x-ndjson"),
], ids=["deep-single", "deep-array", "deep-ndjson", "deep-avro", "surrogate-json-array",
        "surrogate-binary-array", "surrogate-avro", "surrogate-avro-ndjson"])
def test_bodies_that_parse_badly_are_400_not_500(typed: Served, path: str, body: bytes,
                                                   ctype: str) -> None:
    r = typed.client.post(path, content=body, headers={"Content-Type": ctype})
    assert r.status_code == 400, r.text
    assert _error(r)["error"] == "invalid_body"
    topic = path.split("/")[2]
    assert typed.messages(topic) == []
    assert typed.counter("messages_rejected", source="http", reason="invalid_body") >= 1


def test_json_topic_refuses_other_media_types(typed: Served) -> None:
    r = typed.client.post("/topics/j", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert _error(r)["error"] == "unsupported_media_type"
    assert typed.counter("messages_rejected", source="http",
                         reason="unsupported_media_type") == 1


def test_json_schema_topic_says_where_the_body_is_wrong(typed: Served) -> None:
    assert typed.client.post("/topics/js", json={"id": 1}).status_code == 202
    r = typed.client.post("/topics/js", json={"id": "one"})
    assert r.status_code == 400
    assert "['id']" in _error(r)["message"]


def _avro(value: bytes, schema: Any) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(value), schema, None)


def test_avro_topic_converts_json_to_avro_binary(typed: Served) -> None:
    r = typed.client.post("/topics/a", json={"id": 7, "item": "book", "note": "gift"})
    assert r.status_code == 202
    [m] = typed.messages("a")
    decoded = fastavro.schemaless_reader(io.BytesIO(m.record.value),
                                         fastavro.parse_schema(AVRO_SCHEMA), None)
    assert decoded == {"id": 7, "item": "book", "note": "gift", "tag": b""}


def test_avro_topic_takes_valid_avro_binary_as_is(typed: Served) -> None:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(AVRO_SCHEMA),
                               {"id": 1, "item": "x", "note": None, "tag": b"\x00\xff"})
    r = typed.client.post("/topics/a", content=out.getvalue(),
                          headers={"Content-Type": "avro/binary"})
    assert r.status_code == 202
    assert [m.record.value for m in typed.messages("a")] == [out.getvalue()]


@pytest.mark.parametrize(("body", "ctype", "why"), [
    ({"id": "seven", "item": "x"}, "application/json", "body.id: expected an integer"),
    ({"item": "x"}, "application/json", "missing"),
    ({"id": 1, "item": "x", "colour": "red"}, "application/json", "colour"),
    (b"\x02", "avro/binary", "not Avro binary"),
    (b"\x02\x02x\x00\x00junk", "avro/binary", "more bytes"),
])
def test_avro_topic_refuses_what_does_not_fit_the_schema(
        typed: Served, body: object, ctype: str, why: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = typed.client.post("/topics/a", content=content, headers={"Content-Type": ctype})
    assert r.status_code == 400
    assert why in _error(r)["message"]
    assert typed.messages("a") == []


def test_avro_topic_refuses_other_media_types(typed: Served) -> None:
    r = typed.client.post("/topics/a", content=b"x", headers={"Content-Type": "text/csv"})
    assert r.status_code == 415


def test_avro_batch_converts_every_message(typed: Served) -> None:
    r = typed.client.post("/topics/a/batch",
                          json=[{"id": i, "item": f"i{i}"} for i in range(3)])
    assert r.status_code == 202
    schema = fastavro.parse_schema(AVRO_SCHEMA)
    values = [_avro(m.record.value, schema)["id"] for m in typed.messages("a")]
    assert values == [0, 1, 2]


# -- topics -----------------------------------------------------------------------------------
def test_unknown_topic_is_404_when_auto_create_is_off(serve: Callable[..., Served]) -> None:
    served = serve(http={"auto_create_topics": False},
                   topics={"known": {"ack_timeout_ms": 0}})
    r = served.client.post("/topics/other", content=b"v")
    assert r.status_code == 404
    assert _error(r)["error"] == "unknown_topic"
    assert served.client.post("/topics/known", content=b"v").status_code == 202
    assert served.counter("messages_rejected", source="http", reason="unknown_topic") == 1


@pytest.mark.parametrize("topic", ["bad%20name", "a" * 250, "%2E%2E", "sp%C3%A4ter"])
def test_illegal_topic_name_is_400(served: Served, topic: str) -> None:
    r = served.client.post(f"/topics/{topic}", content=b"v")
    assert r.status_code == 400
    assert _error(r)["error"] == "invalid_topic"
    # The answer's code is the counted reason, with a sample and its time for the page.
    assert served.counter("messages_rejected", source="http", reason="invalid_topic") == 1
    (sample,) = served.registry.view().samples[("rejected", "invalid_topic")]
    assert sample["source"] == "http" and sample["status"] == 400
    assert "legal Kafka topic name" in sample["detail"] and sample["time"] > 0


# -- limits -----------------------------------------------------------------------------------
def test_body_over_max_message_bytes_is_413(serve: Callable[..., Served]) -> None:
    served = serve(topics={"s": {"max_message_bytes": 100, "ack_timeout_ms": 0}})
    r = served.client.post("/topics/s", content=b"x" * 101)
    assert r.status_code == 413
    assert "max_message_bytes" in _error(r)["message"]
    # The connection is still good for the next request (the rest of the body was skipped).
    assert served.client.post("/topics/s", content=b"x" * 100).status_code == 202
    # The key counts against the limit too.
    r = served.client.post("/topics/s", content=b"x" * 95, headers={"Partition-Key": "123456"})
    assert r.status_code == 413
    assert served.counter("messages_rejected", source="http", reason="too_large") == 2


def test_chunked_body_over_the_limit_is_413(serve: Callable[..., Served]) -> None:
    served = serve(topics={"s": {"max_message_bytes": 100, "ack_timeout_ms": 0}})

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b"x" * 50

    r = served.client.post("/topics/s", content=chunks())
    assert r.status_code == 413
    assert served.messages("s") == []


def test_slow_body_is_408(serve: Callable[..., Served]) -> None:
    served = serve(http={"body_timeout_seconds": 0.3})
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=10) as sock:
        sock.sendall(b"POST /topics/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                     b"only part of it")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in answer.lower()
    assert b"http.body_timeout_seconds" in answer
    assert served.messages("slow") == []
    assert served.counter("messages_rejected", source="http", reason="request_timeout") == 1


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_rate_limit_is_429_with_retry_after(serve: Callable[..., Served]) -> None:
    served = serve(topics={"r": {"rate_limit": 1, "ack_timeout_ms": 0}})
    assert served.client.post("/topics/r", content=b"1").status_code == 202
    r = served.client.post("/topics/r", content=b"2")
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert _error(r)["error"] == "rate_limited"
    assert [m.record.value for m in served.messages("r")] == [b"1"]
    # Other topics have their own budget.
    assert served.client.post("/topics/other", content=b"3").status_code == 202


# -- unavailable ------------------------------------------------------------------------------
def test_starting_and_stopping_are_503_with_retry_after(serve: Callable[..., Served]) -> None:
    served = serve(running=False)
    r = served.client.post("/topics/t", content=b"v")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert _error(r)["error"] == "starting"
    ready = served.client.get("/status/ready")
    assert ready.status_code == 503 and ready.json()["reason"] == "starting"
    served.runtime.set_phase(Phase.RUNNING)
    assert served.client.get("/status/ready").status_code == 200
    served.runtime.set_phase(Phase.STOPPING)
    r = served.client.post("/topics/t/batch", json=["a"])
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert _error(r)["error"] == "shutting_down"
    assert served.client.get("/status/ready").status_code == 503
    assert served.messages("t") == []
    assert served.counter("messages_rejected", source="http", reason="shutting_down") == 1


def test_full_buffer_is_503_with_retry_after(serve: Callable[..., Served]) -> None:
    served = serve(buffer={"max_bytes": 1024 * 1024})
    big = b"x" * 600_000
    assert served.client.post("/topics/f", content=big).status_code == 202
    r = served.client.post("/topics/f", content=big)
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    assert _error(r)["error"] == "buffer_full"
    assert len(served.messages("f")) == 1
    ready = served.client.get("/status/ready")
    assert ready.status_code == 503 and ready.json()["reason"] == "buffer_full"
    assert "Retry-After" in ready.headers
    assert served.counter("messages_rejected", source="http", reason="buffer_full") == 1
    # Small messages still fit: Ferry refuses what does not fit, not everything.
    assert served.client.post("/topics/f", content=b"small").status_code == 202


# -- 201 vs 202 -------------------------------------------------------------------------------
def _deliver_when_buffered(served: Served, topic: str, state: str = "delivered") -> None:
    """Do what the forwarder does once Kafka acknowledged: remove the message, with its
    outcome, from the buffer (a real Store operation; the Kafka tests use the real one)."""
    [m] = wait_until(lambda: served.messages(topic), message="message buffered")
    if state == "delivered":
        outcome = Outcome(m.key, m.stored_bytes, topic, state, cluster="local", partition=0,
                          offset=0)
    else:
        outcome = Outcome(m.key, m.stored_bytes, topic, state, reason="ttl")
    served.store.remove([outcome])


def test_201_when_delivered_within_ack_timeout(serve: Callable[..., Served]) -> None:
    served = serve(topics={"w": {"ack_timeout_ms": 20_000}})
    forwarder = threading.Thread(target=_deliver_when_buffered, args=(served, "w"))
    forwarder.start()
    r = served.client.post("/topics/w", content=b"v")
    forwarder.join()
    assert r.status_code == 201
    assert r.json()["delivered"] is True
    assert r.headers["Ferry-Message-Id"] == r.headers["Hermes-Message-Id"]


def test_202_after_ack_timeout_when_not_delivered(serve: Callable[..., Served]) -> None:
    served = serve(topics={"w": {"ack_timeout_ms": 50}})
    r = served.client.post("/topics/w", content=b"v")
    assert r.status_code == 202 and r.json()["delivered"] is False
    assert len(served.messages("w")) == 1


def test_202_at_once_when_the_message_was_discarded(serve: Callable[..., Served]) -> None:
    served = serve(topics={"w": {"ack_timeout_ms": 60_000}})
    forwarder = threading.Thread(target=_deliver_when_buffered, args=(served, "w", "discarded"))
    forwarder.start()
    r = served.client.post("/topics/w", content=b"v", timeout=30)
    forwarder.join()
    assert r.status_code == 202


def test_waiting_for_kafka_does_not_hold_up_other_requests(
        serve: Callable[..., Served]) -> None:
    served = serve(topics={"slow": {"ack_timeout_ms": 60_000}})
    result: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: result.append(
        httpx.post(served.url + "/topics/slow", content=b"v", timeout=120)))
    waiting.start()
    wait_until(lambda: served.app.publisher.waiting_for_kafka == 1, message="request waiting")
    for _ in range(20):
        assert served.client.post("/topics/fast", content=b"v").status_code == 202
    assert waiting.is_alive()
    _deliver_when_buffered(served, "slow")
    waiting.join(30)
    assert result[0].status_code == 201


def test_graceful_stop_answers_waiting_requests_and_refuses_new_ones(
        serve: Callable[..., Served]) -> None:
    served = serve(topics={"slow": {"ack_timeout_ms": 60_000}})
    result: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: result.append(
        httpx.post(served.url + "/topics/slow", content=b"v", timeout=120)))
    waiting.start()
    wait_until(lambda: served.app.publisher.waiting_for_kafka == 1, message="request waiting")
    served.server.stop(10.0)
    waiting.join(30)
    # Stored and fsynced before the answer: 202, not an error, although Kafka never acked.
    assert result[0].status_code == 202
    assert len(served.messages("slow")) == 1
    assert served.runtime.phase is Phase.STOPPING
    with pytest.raises(httpx.ConnectError):
        httpx.post(served.url + "/topics/slow", content=b"late", timeout=5)


def test_a_client_that_disconnects_mid_body_stores_nothing(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=10) as sock:
        sock.sendall(b"POST /topics/gone HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
    wait_until(lambda: served.counter("http_requests", route="publish", status="499") == 1,
               message="disconnect noticed")
    assert served.messages("gone") == []
    assert served.client.post("/topics/gone", content=b"v").status_code == 202


def test_unmatched_paths_and_methods_are_json_errors(served: Served) -> None:
    r = served.client.post("/topics/a/b/c", content=b"v")
    assert r.status_code == 404 and _error(r)["error"] == "not_found"
    r = served.client.patch("/topics/a", content=b"v")
    assert r.status_code == 405 and _error(r)["error"] == "method_not_allowed"


def test_status_probes(served: Served) -> None:
    assert served.client.get("/status/ping").text == "pong"
    # No forwarder in this harness: no cluster has a state yet.
    assert served.client.get("/status/health").json() == {"status": "ok", "phase": "running",
                                                          "clusters": {}}
    assert served.client.get("/status/ready").json() == {"ready": True, "reason": "ready",
                                                         "clusters": {}}


def test_every_message_received_is_accepted_or_rejected(serve: Callable[..., Served]) -> None:
    served = serve(topics={"j": {"content_type": "json", "ack_timeout_ms": 0,
                                 "max_message_bytes": 50}})
    c = served.client
    c.post("/topics/j", content=b"{}")
    c.post("/topics/j/batch", json=[1, 2, 3])
    c.post("/topics/j", content=b"{bad")
    c.post("/topics/j/batch", content=b"1\n2\nx\n",
           headers={"Content-Type": "application/x-ndjson"})
    c.post("/topics/j", content=b"1" * 51)
    c.post("/topics/j", content=b"{}", headers={"Content-Type": "text/plain"})
    c.post("/topics/%2E", content=b"{}")
    c.post("/topics/j", content=b"{}", headers={"Idempotency-Key": "k"})
    c.post("/topics/j", content=b"{}", headers={"Idempotency-Key": "k"})  # replay: not again
    received = served.counter("messages_received", source="http")
    accepted = served.counter("messages_accepted", source="http")
    rejected = served.counter("messages_rejected", source="http")
    assert (received, accepted, rejected) == (12, 5, 7)


@pytest.mark.parametrize("ids", [
    [], [bytes(range(12))], [bytes(range(i, i + 12)) for i in range(50)],
    [b"\x01\x02", bytes(range(12))],  # not the usual id length: still each id's hex
])
def test_a_batch_answer_lists_each_id_as_its_hex_text(ids: list[bytes]) -> None:
    assert json.loads(b"[" + _id_list(ids) + b"]") == [keys.id_text(i) for i in ids]


def test_a_publish_answer_is_rendered_once_and_reads_back_as_the_same_headers() -> None:
    status, headers, body = _response([bytes(12)], False, False, True)
    assert status == 202 and isinstance(headers, bytes)
    mid = b"0" * 24
    assert body == b'{"id":"' + mid + b'","delivered":false}'
    # What the ASGI path sends (header_pairs) is what the server writes for a direct publish.
    assert header_pairs(headers) == [
        (b"content-type", JSON_CONTENT_TYPE), (b"content-length", b"%d" % len(body)),
        (b"ferry-message-id", mid), (b"hermes-message-id", mid),
        (b"idempotent-replayed", b"true")]
    status, headers, body = _response([bytes(12), b"\x01" * 12], True, True, False)
    assert status == 201
    assert header_pairs(headers) == [(b"content-type", JSON_CONTENT_TYPE),
                                     (b"content-length", b"%d" % len(body))]
    pairs = [(b"retry-after", b"1")]
    assert header_pairs(pairs) is pairs
