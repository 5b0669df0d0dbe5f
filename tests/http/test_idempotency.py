"""Idempotency-Key: a retry gets the first answer and stores nothing twice."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agent.buffer import keys
from agent.buffer.store import Store
from agent.ingest.http import idempotency as idem
from tests.http.harness import Served


def test_a_retry_gets_the_first_answer_and_stores_nothing(served: Served) -> None:
    first = served.client.post("/topics/t", content=b"v", headers={"Idempotency-Key": "k-1"})
    again = served.client.post("/topics/t", content=b"v", headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 202
    assert again.headers["Ferry-Message-Id"] == first.headers["Ferry-Message-Id"]
    assert again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert len(served.messages("t")) == 1
    assert served.counter("messages_accepted", source="http", topic="t") == 1


def test_a_batch_retry_gets_every_id_again(served: Served) -> None:
    headers = {"Idempotency-Key": "batch-9", "Content-Type": "application/x-ndjson"}
    first = served.client.post("/topics/t/batch", content=b"a\nb\nc\n", headers=headers)
    again = served.client.post("/topics/t/batch", content=b"a\nb\nc\n", headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json()["ids"] == first.json()["ids"]
    assert [keys.id_text(m.id) for m in served.messages("t")] == first.json()["ids"]


def test_a_key_reused_for_another_request_is_422(served: Served) -> None:
    h = {"Idempotency-Key": "same"}
    assert served.client.post("/topics/t", content=b"one", headers=h).status_code == 202
    r = served.client.post("/topics/t", content=b"two", headers=h)
    assert r.status_code == 422
    assert r.json()["error"] == "idempotency_key_reused"
    r = served.client.post("/topics/t", content=b"one", headers={**h, "Partition-Key": "p"})
    assert r.status_code == 422
    assert [m.record.value for m in served.messages("t")] == [b"one"]


def test_keys_belong_to_their_topic(served: Served) -> None:
    h = {"Idempotency-Key": "k"}
    a = served.client.post("/topics/a", content=b"v", headers=h)
    b = served.client.post("/topics/b", content=b"v", headers=h)
    assert a.headers["Ferry-Message-Id"] != b.headers["Ferry-Message-Id"]
    assert len(served.messages("a")) == len(served.messages("b")) == 1


def test_concurrent_requests_with_one_key_store_one_message(served: Served) -> None:
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def publish() -> None:
        with httpx.Client(base_url=served.url, timeout=30) as client:
            start.wait()
            r = client.post("/topics/c", content=b"v", headers={"Idempotency-Key": "race"})
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=publish) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in answers] == [202] * 16
    assert len({r.headers["Ferry-Message-Id"] for r in answers}) == 1
    assert len(served.messages("c")) == 1


def test_the_key_survives_a_restart(serve: Callable[..., Served]) -> None:
    served = serve()
    first = served.client.post("/topics/t", content=b"v", headers={"Idempotency-Key": "k"})
    served.stop()
    again_served = serve()
    again = again_served.client.post("/topics/t", content=b"v",
                                     headers={"Idempotency-Key": "k"})
    assert again.status_code == 202
    assert again.headers["Ferry-Message-Id"] == first.headers["Ferry-Message-Id"]
    assert len(again_served.messages("t")) == 1


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "caf\u00e9"])
def test_unusable_keys_are_400(served: Served, key: str) -> None:
    r = served.client.post("/topics/t", content=b"v",
                           headers=[(b"Idempotency-Key", key.encode("latin-1"))])
    assert r.status_code == 400
    assert "Idempotency-Key" in r.json()["message"]
    assert served.messages("t") == []


def test_window_zero_turns_keys_off(serve: Callable[..., Served]) -> None:
    served = serve(http={"idempotency_window_seconds": 0})
    for _ in range(2):
        served.client.post("/topics/t", content=b"v", headers={"Idempotency-Key": "k"})
    assert len(served.messages("t")) == 2


# -- expiry and pruning (the Idempotency class over a real Store, with a controlled clock) ---
class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _remember(store: Store, keeper: idem.Idempotency, state_key: bytes, ms: int) -> None:
    store.update_state(keeper.puts(state_key, idem.Entry(ms, "fp", [b"\0" * 12], False)))


def test_entries_expire_after_the_window_and_are_pruned(tmp_path: Path) -> None:
    clock = Clock(1_000_000.0)
    with Store(tmp_path, 64 * 1024 * 1024) as store:
        keeper = idem.Idempotency(store, 600, clock=clock)
        old, kept, reused = (idem.Idempotency.state_key("t", k) for k in (b"old", b"kept", b"re"))
        _remember(store, keeper, old, int(clock.now * 1000))
        _remember(store, keeper, reused, int(clock.now * 1000))
        clock.now += 500
        _remember(store, keeper, kept, int(clock.now * 1000))
        assert keeper.lookup(old) is not None
        clock.now += 200  # old/reused are 700 s old, kept 200 s
        assert keeper.lookup(old) is None
        assert keeper.lookup(kept) is not None
        _remember(store, keeper, reused, int(clock.now * 1000))  # a new request, same key
        assert keeper.prune() == 1
        assert store.get_state(old) is None
        assert keeper.lookup(reused) is not None
        assert keeper.lookup(kept) is not None
        clock.now += 1000
        assert keeper.prune() == 2
        assert store.state_items(idem.PREFIX) == []
        assert store.state_items(idem.INDEX) == []


def test_expired_keys_are_pruned_while_requests_come(served: Served,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The pruning of expired keys runs off the event loop, at most once per PRUNE_INTERVAL,
    triggered by publishing traffic (a refactoring once left it with no caller at all)."""
    idempotency = served.app.publisher.idempotency
    pruned = threading.Event()
    prune = idempotency.prune

    def watched() -> int:
        pruned.set()
        return prune()

    monkeypatch.setattr(idempotency, "prune", watched)
    r = served.client.post("/topics/t", content=b"v", headers={"Idempotency-Key": "k-prune"})
    assert r.status_code == 202
    assert pruned.wait(10), "no pruning ran"
