"""Exactly-once topics in the running agent (issue 22): configuration rules, the management
API, delivery to a read_committed reader, ``GET /messages/{id}``, status and metrics."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.config import ConfigError, TopicConfig, load_config
from agent.forwarder.progress import Progress, agent_identity, tag
from agent.signals import ack as ack_signal
from ferry_client import FerryClient
from status.schema import validator
from tests.agent_harness import AgentProcess, write_config
from tests.kafka import Broker, read_topic
from tests.waiting import wait_until


def test_exactly_once_needs_acks_all() -> None:
    assert TopicConfig(delivery="exactly_once", acks="all").delivery == "exactly_once"
    assert TopicConfig().delivery == "at_least_once"
    assert TopicConfig().acks == "leader"  # unchanged default


@pytest.mark.parametrize(("settings", "why"), [
    ({"delivery": "exactly_once", "acks": "leader"}, 'needs acks = "all"'),
    ({"delivery": "exactly_once"}, 'needs acks = "all"'),
    ({"delivery": "exactly_once", "acks": "all", "fallback_to_remote": True},
     "cannot be combined with fallback_to_remote"),
    ({"delivery": "twice"}, "delivery"),
])
def test_config_refuses_what_contradicts_exactly_once(tmp_path: Path, settings: dict[str, Any],
                                                      why: str) -> None:
    for section in ("orders", "default"):
        path = write_config(tmp_path, "127.0.0.1:9", topics={section: settings})
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert why in str(info.value)


def test_agent_identity_defaults(tmp_path: Path) -> None:
    mid = tmp_path / "machine-id"
    mid.write_text("0123456789abcdef0123456789abcdef\n")
    assert agent_identity("", mid) == "0123456789abcdef0123456789abcdef"
    assert agent_identity("web-7", mid) == "web-7"
    mid.write_text("")  # an image prepared for cloning: systemd fills it at first boot
    assert agent_identity("", mid)  # the host name then
    assert agent_identity("", tmp_path / "missing")


def test_progress_records_round_trip() -> None:
    p = Progress(bytes(12), {0: 5}).advanced(b"\x01" * 12, {0: 9, 3: 0})
    assert Progress.decode(p.encode()) == Progress(b"\x01" * 12, {0: 10, 3: 1})
    assert tag("a", b"\x00" * 12) == b"a:" + b"0" * 24


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_http_messages_reach_kafka_once_and_say_committed_in_transaction(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    config = write_config(tmp_path / "agent", broker.bootstrap,
                          topics={unique_topic: {"delivery": "exactly_once", "acks": "all"}},
                          forwarder={"agent_id": "eo-e2e", "transaction_interval_ms": 20})
    values = [b"eo-%03d" % i for i in range(200)]
    ids: list[str] = []
    with AgentProcess(config) as agent, httpx.Client(base_url=agent.http_url) as http:
        for i in range(0, len(values), 20):
            r = http.post(f"/topics/{unique_topic}/batch",
                          content=b"\n".join(values[i:i + 20]),
                          headers={"content-type": "application/x-ndjson"})
            assert r.status_code in (201, 202), r.text
            ids += r.json()["ids"]
        wait_until(lambda: agent.buffered().get(unique_topic, 0) == 0, timeout=30,
                   message="exactly-once topic drained")
        doc = _get(f"{agent.http_url}/messages/{ids[0]}")
        assert not list(validator("message").iter_errors(doc)), doc
        assert doc["state"] == "delivered" and doc["note"] == "committed in transaction"
        # The forwarder process's numbers reach the status page a few times a second.
        wait_until(lambda: _get(f"{agent.http_url}/status/transactions")["committed"] > 0,
                   timeout=10, message="committed transactions on the status page")
        txn = _get(f"{agent.http_url}/status/transactions")
        assert not list(validator("transactions").iter_errors(txn)), txn
        assert txn["fenced"] is False and txn["aborted"] == 0
        assert [p["topic"] for p in txn["progress"]] == [unique_topic]
        assert txn["latency"]["count"] > 0
        metrics = http.get("/metrics").text
        assert "transactions_committed" in metrics
    records = read_topic(broker.bootstrap, unique_topic, 30, read_committed=True)
    assert Counter(r.value for r in records) == Counter(values)
    assert {r.header("ferry-id").split(b":")[0] for r in records} == {b"eo-e2e"}


def test_management_api_defines_exactly_once_topics(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Topic management is closed without a token (agent/ingest/http/auth.py): the agent
    # takes it from its environment, the client sends it.
    monkeypatch.setenv("FERRY_HTTP__MANAGEMENT_TOKEN", "eo-token")
    config = write_config(tmp_path / "agent", broker.bootstrap)
    with (AgentProcess(config) as agent,
          httpx.Client(base_url=agent.http_url,
                       headers={"Authorization": "Bearer eo-token"}) as http):
        r = http.post("/topics", json={"name": "eo-api", "delivery": "exactly_once",
                                       "acks": "all"})
        assert r.status_code == 201, r.text
        assert r.json()["delivery"] == "exactly_once"
        r = http.post("/topics", json={"name": "eo-bad", "delivery": "exactly_once",
                                       "acks": "leader"})
        assert r.status_code == 400
        assert 'needs acks = "all"' in r.json()["message"]
        r = http.put("/topics/eo-api", json={"acks": "leader"})
        assert r.status_code == 400, r.text
        r = http.post("/topics/eo-api", content=b"via the api")
        assert r.status_code in (201, 202)
        wait_until(lambda: agent.buffered().get("eo-api", 0) == 0, timeout=30,
                   message="API-defined exactly-once topic drained")
    records = read_topic(broker.bootstrap, "eo-api", 30, read_committed=True)
    assert [r.value for r in records] == [b"via the api"]
    assert records[0].header("ferry-id")  # sent by the transactional path


def test_committed_transactions_are_signalled_to_the_http_stage(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    """A 201 waiting for an exactly-once message is answered when its transaction commits:
    the exactly-once thread signals the committed ids on acks.sock as the forwarder's loop
    does for other topics, on the same sequence, so the HTTP stage sees no false gap. The
    agent has no HTTP listener here, so the test holds the socket and reads what comes."""
    root = tmp_path / "agent"
    config = write_config(root, broker.bootstrap, http=False,
                          topics={unique_topic: {"delivery": "exactly_once", "acks": "all"}},
                          forwarder={"agent_id": "eo-signal", "transaction_interval_ms": 20})
    (root / "buffer").mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(ack_signal.socket_path(root / "buffer")))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    listener.settimeout(0)
    values = [b"signal-%03d" % i for i in range(300)]
    signalled: list[ack_signal.Acks] = []

    def read_datagrams() -> int:
        while True:
            try:
                got = ack_signal.decode(listener.recv(1 << 20))
            except BlockingIOError:
                break
            assert got is not None, "a malformed acknowledgement datagram"
            signalled.append(got)
        return sum(len(a.ids) for a in signalled)

    try:
        with AgentProcess(config) as agent:
            with FerryClient(agent.socket_path) as client:
                for v in values:
                    client.send(unique_topic, v)
            wait_until(lambda: read_datagrams() >= len(values), timeout=30,
                       message="every committed message signalled")
    finally:
        listener.close()
    delivered = [i for a in signalled if a.state == ack_signal.DELIVERED for i in a.ids]
    assert len(delivered) == len(set(delivered)) == len(values)
    assert [a.seq for a in signalled] == list(range(len(signalled)))  # no gap, no repeat
    # They are the ids of exactly the messages the transactions committed.
    records = read_topic(broker.bootstrap, unique_topic, 30, read_committed=True)
    assert sorted(r.value for r in records) == values
    committed = {r.header("ferry-id") for r in records}
    assert {b"eo-signal:" + i.hex().encode() for i in delivered} == committed


def test_only_a_sendable_keyed_message_waits_for_a_partition_out_of_reach(
    tmp_path: Path,
) -> None:
    """A partial failure, broker 2 out of reach (partitions 1 and 3): a PartitionKey message
    for partition 1 holds its topic; one the eligibility rule discards (too large) does not,
    so it is discarded with its reason instead of waiting; one for a reachable partition goes.
    No broker: the sender is built on an address nothing answers and never sends."""
    from agent.buffer.store import Store
    from agent.forwarder.partitioner import TopicLayout
    from agent.forwarder.plain import plain_values
    from agent.metrics import Registry
    from agent.records import Record
    from tests.forwarder.zombie import exactly_once_sender

    config = load_config(write_config(
        tmp_path, "127.0.0.1:9", http=False,
        topics={"t": {"delivery": "exactly_once", "acks": "all", "max_message_bytes": 100}},
        forwarder={"agent_id": "reach-unit"}))
    layout = TopicLayout((0, 1, 2, 3), (0, 1, 2, 3), leaders=(1, 2, 1, 2))
    layout.route_around(frozenset({2}))
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        store.append([[Record("t", b"cut", partition_key=1),
                       Record("t", b"x" * 200, partition_key=1),  # over max_message_bytes
                       Record("t", b"reached", partition_key=2)]])
        sender = exactly_once_sender(config, store, Registry())
        settings = config.topic("t")
        gen = store.generation("t")
        values = store.read_values("t", None, 10)
        waits = [sender._waits_for_reach("t", layout, settings, gen, mid, v, flags, pk, key)
                 for mid, v, flags, _, pk, key, _ in plain_values(
                     values, gen, False, settings.max_message_bytes)]
        assert waits == [1, None, None]
        assert sender.held()["t"]["error"] == "BROKER_OUT_OF_REACH"
        assert "partition 1" in str(sender.held()["t"]["detail"])
