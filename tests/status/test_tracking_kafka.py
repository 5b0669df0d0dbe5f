"""Message tracking against the real agent and a real broker: ``GET /messages/{id}`` reports
the partition and offset a consumer sees, and ``ferry status`` follows the outage."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.buffer.store import Store, StoredMessage
from ferry_client import FerryClient
from status import cli
from status.schema import validator
from tests.agent_harness import AgentProcess, wait_buffered, write_config
from tests.kafka import Broker, consume_all, free_port, unique_topic_name
from tests.waiting import wait_until

COUNT = 6


def track(agent: AgentProcess, message_id: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{agent.http_url}/messages/{message_id}", timeout=5) as r:
            doc: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        doc = json.loads(exc.read())
        assert not list(validator("error").iter_errors(doc)), doc
        return doc
    assert not list(validator("message").iter_errors(doc)), doc
    return doc


def buffered_ids(agent: AgentProcess, topic: str) -> dict[bytes, str]:
    """Message id (hex) by value, read from the agent's LMDB buffer while it runs."""
    with Store(agent.config.buffer.path, agent.config.buffer.max_bytes) as store:
        return {m.record.value: m.id.hex() for m in store.read(topic, None, 1000)
                if isinstance(m, StoredMessage)}


def status_code(agent: AgentProcess) -> int:
    return cli.status_command(agent.http_url, 5.0, out=io.StringIO())


def test_tracking_returns_the_partition_and_offset_a_consumer_sees(tmp_path: Path) -> None:
    # Kafka is down when the messages arrive, so they wait in the buffer where the test can
    # learn their ids (a datagram gets no reply); then Kafka comes up and takes them.
    broker = Broker(free_port(), log_path=tmp_path / "tansu.log")
    config = write_config(tmp_path / "agent", broker.bootstrap,
                          forwarder={"retry_backoff_max_ms": 500})
    topic = unique_topic_name("tracking")
    values = [b"track-%d" % i for i in range(COUNT)]
    with AgentProcess(config) as agent:
        with FerryClient(agent.socket_path) as client:
            for i, value in enumerate(values):
                client.send(topic, value, key=b"k%d" % i, partition_key=i)
        wait_buffered(agent, topic, COUNT)
        ids = buffered_ids(agent, topic)
        assert sorted(ids) == sorted(values)
        for mid in ids.values():
            assert track(agent, mid) == {"id": mid, "state": "buffered", "topic": topic,
                                         "accepted_ms": int(mid[:16], 16)}
        # The outage is what `ferry status` reports as CRITICAL (every cluster down).
        wait_until(lambda: status_code(agent) == cli.CRITICAL, timeout=30,
                   message=f"ferry status CRITICAL while Kafka is down\n{agent.log_tail()}")

        with broker:
            wait_until(lambda: all(track(agent, mid)["state"] == "delivered"
                                   for mid in ids.values()),
                       timeout=60, interval=0.2,
                       message=f"every message delivered\n{agent.log_tail()}")
            consumed = consume_all(broker.bootstrap, topic, COUNT, timeout=20)
            assert len(consumed) == COUNT, consumed
            for m in consumed:
                assert m.value is not None
                doc = track(agent, ids[m.value])
                assert (doc["topic"], doc["cluster"], doc["partition"], doc["offset"]) == (
                    topic, "local", m.partition, m.offset), (doc, m)
            wait_until(lambda: status_code(agent) == cli.OK, timeout=30,
                       message="ferry status OK once Kafka is back")

        # An id that never existed is a clean 404; a malformed one a 400.
        unknown = track(agent, "0" * 24)
        assert (unknown["error"], unknown["state"]) == ("not_found", "unknown")
        assert track(agent, "not-an-id")["error"] == "malformed_id"
