"""HTTP publishing through the whole agent (``ferry run``) into a real tansu broker.

201 vs 202 against the real broker, Avro conversion read back from Kafka, kill -9 right
after a 202, idempotent retries, partition choice, headers, and topic deletion discarding
what is still buffered.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fastavro
import httpx
import pytest

from tests.agent_harness import AgentProcess, wait_buffered, wait_drained, write_config
from tests.kafka import Broker, consume_all, create_topic, read_topic
from tests.waiting import wait_until

SCHEMA = {
    "type": "record", "name": "Reading", "namespace": "ferry.test",
    "fields": [
        {"name": "sensor", "type": "string"},
        {"name": "value", "type": "double"},
        {"name": "unit", "type": ["null", "string"], "default": None},
        {"name": "raw", "type": "bytes", "default": ""},
    ],
}


# Topic management needs a token (agent/ingest/http/auth.py); the agent takes it from the
# environment, the clients send it.
TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def _management_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_HTTP__MANAGEMENT_TOKEN", TOKEN)


def _config(tmp_path: Path, broker: Broker, topics: dict[str, dict[str, Any]] | None = None,
            **kw: Any) -> Path:
    return write_config(tmp_path, broker.bootstrap, topics=topics, **kw)


def test_201_when_kafka_acknowledges_in_time_202_when_it_cannot(
        tmp_path: Path, broker: Broker, unique_topic: str) -> None:
    create_topic(broker.bootstrap, unique_topic, 2)
    config = _config(tmp_path, broker, {unique_topic: {"ack_timeout_ms": 10_000}})
    with AgentProcess(config) as agent, httpx.Client(base_url=agent.http_url,
                                                    timeout=30, headers=AUTH) as client:
        r = client.post(f"/topics/{unique_topic}", content=b"acked")
        assert r.status_code == 201, r.text
        assert r.json() == {"id": r.headers["Ferry-Message-Id"], "delivered": True}
        assert r.headers["Hermes-Message-Id"] == r.headers["Ferry-Message-Id"]
        [got] = consume_all(broker.bootstrap, unique_topic, 1, timeout=30)
        assert got.value == b"acked"

        broker.stop()
        r = client.put(f"/topics/{unique_topic}-down", json={"ack_timeout_ms": 300})
        assert r.status_code == 201
        r = client.post(f"/topics/{unique_topic}-down", content=b"buffered")
        assert r.status_code == 202, r.text
        assert r.json()["delivered"] is False
        broker.start()  # memory storage: starts empty; the buffer still holds the message
        got_later = consume_all(broker.bootstrap, f"{unique_topic}-down", 1, timeout=60)
        assert [m.value for m in got_later] == [b"buffered"]


def test_kill_9_right_after_a_202_then_restart_delivers_it(
        tmp_path: Path, broker: Broker, unique_topic: str) -> None:
    config = _config(tmp_path, broker, {unique_topic: {"ack_timeout_ms": 0}})
    broker.stop()  # nothing leaves the buffer before the crash
    with AgentProcess(config) as agent:
        r = httpx.post(f"{agent.http_url}/topics/{unique_topic}", content=b"survivor",
                       headers={"Partition-Key": "k1"}, timeout=30)
        assert r.status_code == 202
        agent.kill()  # at once: the 202 alone promised it is on disk
    broker.start()
    with AgentProcess(config) as agent:
        [got] = consume_all(broker.bootstrap, unique_topic, 1, timeout=60)
        assert (got.key, got.value) == (b"k1", b"survivor")
        wait_drained(agent)
        tracked = agent.get_json(f"/messages/{r.headers['Ferry-Message-Id']}")
        assert tracked["state"] == "delivered"


def test_avro_json_is_converted_and_round_trips_through_kafka(
        tmp_path: Path, session_broker: Broker, unique_topic: str) -> None:
    config = _config(tmp_path, session_broker)
    with AgentProcess(config) as agent, httpx.Client(base_url=agent.http_url,
                                                    timeout=30, headers=AUTH) as client:
        r = client.post("/topics", json={"name": unique_topic, "content_type": "avro",
                                         "schema": SCHEMA, "ack_timeout_ms": 10_000})
        assert r.status_code == 201, r.text
        sent = [{"sensor": "t1", "value": 21.5, "unit": "C"},
                {"sensor": "t2", "value": -3.0, "raw": "\u0000\u00ff"}]
        assert client.post(f"/topics/{unique_topic}", json=sent[0]).status_code in (201, 202)
        r = client.post(f"/topics/{unique_topic}/batch", json=[sent[1]])
        assert r.status_code in (201, 202)
        got = consume_all(session_broker.bootstrap, unique_topic, 2, timeout=60)
    parsed = fastavro.parse_schema(SCHEMA)
    decoded: list[Any] = sorted(
        (fastavro.schemaless_reader(io.BytesIO(m.value or b""), parsed, None) for m in got),
        key=lambda d: str(d["sensor"]))
    assert decoded == [
        {"sensor": "t1", "value": 21.5, "unit": "C", "raw": b""},
        {"sensor": "t2", "value": -3.0, "unit": None, "raw": b"\x00\xff"},
    ]


def test_idempotent_retry_reaches_kafka_once(
        tmp_path: Path, session_broker: Broker, unique_topic: str) -> None:
    config = _config(tmp_path, session_broker, {unique_topic: {"ack_timeout_ms": 10_000}})
    with AgentProcess(config) as agent, httpx.Client(base_url=agent.http_url,
                                                    timeout=30, headers=AUTH) as client:
        answers = [client.post(f"/topics/{unique_topic}", content=b"once",
                               headers={"Idempotency-Key": "order-42"}) for _ in range(3)]
        assert len({a.headers["Ferry-Message-Id"] for a in answers}) == 1
        assert answers[0].status_code == 201
        assert all(a.headers.get("Idempotent-Replayed") == "true" for a in answers[1:])
        wait_drained(agent)
    assert [m.value for m in read_topic(session_broker.bootstrap, unique_topic)] == [b"once"]


def test_partition_key_headers_and_batches_reach_kafka(
        tmp_path: Path, session_broker: Broker, unique_topic: str) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 4)
    config = _config(tmp_path, session_broker, {unique_topic: {"ack_timeout_ms": 10_000}})
    text = config.read_text()
    config.write_text(text.replace("[http]\n", '[http]\nheader_allowlist = ["Trace-Id"]\n', 1))
    with AgentProcess(config) as agent, httpx.Client(base_url=agent.http_url,
                                                    timeout=30, headers=AUTH) as client:
        body = b"".join(b"m-%d\n" % i for i in range(1000))
        r = client.post(f"/topics/{unique_topic}/batch", content=body, headers={
            "Content-Type": "application/x-ndjson", "Ferry-Partition-Key": "6",
            "Trace-Id": "t-1", "Partition-Key": "user-9"})
        assert r.status_code == 201, r.text
        assert r.json()["count"] == 1000
        got = consume_all(session_broker.bootstrap, unique_topic, 1000, timeout=60)
    assert {m.partition for m in got} == {6 % 4}  # Bruce: key mod partition count
    assert [m.value for m in got] == [b"m-%d" % i for i in range(1000)]  # order kept
    assert {(m.key, m.headers) for m in got} == {(b"user-9", (("Trace-Id", b"t-1"),))}


def test_deleting_a_topic_discards_what_is_buffered(
        tmp_path: Path, broker: Broker, unique_topic: str) -> None:
    config = _config(tmp_path, broker)
    broker.stop()
    with AgentProcess(config) as agent, httpx.Client(base_url=agent.http_url,
                                                    timeout=30, headers=AUTH) as client:
        assert client.post("/topics", json={"name": unique_topic,
                                            "ack_timeout_ms": 0}).status_code == 201
        assert client.post(f"/topics/{unique_topic}", content=b"old").status_code == 202
        wait_buffered(agent, unique_topic, 1)
        assert client.delete(f"/topics/{unique_topic}").json()["generation"] == 1
        broker.start()
        wait_drained(agent)
        wait_until(lambda: _discarded(agent, unique_topic) == 1,
                   message="generation discard counted")
    assert read_topic(broker.bootstrap, unique_topic) == []


def _discarded(agent: AgentProcess, topic: str) -> float:
    metrics = httpx.get(agent.http_url + "/metrics", timeout=10).text
    for line in metrics.splitlines():
        if (line.startswith("ferry_messages_discarded_total{") and f'topic="{topic}"' in line
                and 'reason="generation"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
