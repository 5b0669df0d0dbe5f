"""publish.py from the ASGI side: the publisher's adapter for any ASGI server but Ferry's own
reads the body and hands it to the one publish entry, so its answers and counts are those of
a publish through Ferry's protocol. Driven in-process (httpx's ASGI transport, and raw ASGI
messages for a client that leaves), on a real buffer and writer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from agent.buffer import keys
from agent.buffer.committer import Committer
from agent.buffer.store import Store, StoredMessage
from agent.ingest.http.app import FerryApp, create_app
from agent.ingest.runtime import Phase, Runtime
from agent.metrics import Registry
from tests.http.harness import make_config

Request = tuple[str, dict[str, str], bytes]


@contextmanager
def _app(tmp_path: Path) -> Iterator[tuple[FerryApp, Store, Registry]]:
    config = make_config(tmp_path, topics={"default": {"ack_timeout_ms": 0,
                                                       "max_message_bytes": 1000}})
    store = Store(config.buffer.path, config.buffer.max_bytes, track=False)
    registry = Registry()
    committer = Committer(store, registry=registry)
    committer.start()
    runtime = Runtime(config, store, committer, registry)
    app = create_app(runtime)
    runtime.set_phase(Phase.RUNNING)
    try:
        yield app, store, registry
    finally:
        app.close()
        committer.close()
        store.close()


def _post(app: FerryApp, requests: list[Request]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ferry") as client:
            return [await client.post(path, headers=headers, content=body)
                    for path, headers, body in requests]
    return asyncio.run(run())


def _count(app: FerryApp, registry: Registry, name: str, **labels: str) -> float:
    app.publisher.counters.flush()
    return registry.view().total(name, **labels)


def _values(store: Store, topic: str) -> list[bytes]:
    return [m.record.value for m in store.read(topic, None, 1000)
            if isinstance(m, StoredMessage)]


def test_a_publish_and_a_batch_are_stored_answered_and_counted_once(tmp_path: Path) -> None:
    with _app(tmp_path) as (app, store, registry):
        single, batch = _post(app, [
            ("/topics/t", {}, b"one"),
            ("/topics/t/batch", {"content-type": "application/x-ndjson"}, b'"a"\n"b"\n')])
        assert single.status_code == 202 and batch.status_code == 202
        assert single.json()["delivered"] is False
        assert len(batch.json()["ids"]) == 2
        assert [m.id for m in store.read("t", None, 10) if isinstance(m, StoredMessage)] == [
            keys.parse_id_text(i) for i in [single.json()["id"], *batch.json()["ids"]]]
        # A binary topic (the default) stores each line of the batch as it came.
        assert _values(store, "t") == [b"one", b'"a"', b'"b"']
        assert _count(app, registry, "http_requests", route="publish", status="202") == 1
        assert _count(app, registry, "http_requests", route="batch", status="202") == 1
        assert _count(app, registry, "messages_received", source="http") == 3
        assert app.publisher.in_flight == 0


def test_what_the_headers_refuse_is_answered_and_counted_once(tmp_path: Path) -> None:
    with _app(tmp_path) as (app, store, registry):
        [large, bad_key] = _post(app, [
            ("/topics/t", {}, b"x" * 5000),
            ("/topics/t", {"ferry-partition-key": "many"}, b"v")])
        assert large.status_code == 413 and large.json()["error"] == "too_large"
        assert bad_key.status_code == 400 and bad_key.json()["error"] == "invalid_header"
        assert _values(store, "t") == []
        assert _count(app, registry, "http_requests", route="publish", status="413") == 1
        assert _count(app, registry, "http_requests", route="publish", status="400") == 1
        assert _count(app, registry, "messages_rejected", source="http",
                      reason="too_large") == 1


def test_an_idempotent_retry_gets_the_first_answer_and_stores_nothing_twice(
    tmp_path: Path
) -> None:
    with _app(tmp_path) as (app, store, registry):
        key = {"idempotency-key": "k-1"}
        first, again = _post(app, [("/topics/t", key, b"v"), ("/topics/t", key, b"v")])
        assert first.status_code == again.status_code == 202
        assert again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        assert _values(store, "t") == [b"v"]
        assert _count(app, registry, "http_requests", route="publish", status="202") == 2


def test_a_client_that_leaves_before_its_body_is_counted_as_gone(tmp_path: Path) -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/topics/t",
             "raw_path": b"/topics/t", "headers": [(b"content-length", b"3")],
             "query_string": b""}
    with _app(tmp_path) as (app, store, registry):
        asyncio.run(app(scope, receive, send))
        assert sent == [] and _values(store, "t") == []
        assert _count(app, registry, "http_requests", route="publish", status="499") == 1
