"""An empty datagram value reaches Kafka as an empty value, never as a null one (a null value
is a tombstone: on a compacted topic it deletes the key). Bruce sent null here; Ferry does
not (docs/design.md, "Delivery rules"). Real agent, real tansu broker."""

from __future__ import annotations

from pathlib import Path

from ferry_client import FerryClient
from tests.agent_harness import running_agent
from tests.kafka import Broker, consume_all, create_topic


def test_an_empty_value_is_forwarded_as_empty_not_null(tmp_path: Path, broker: Broker) -> None:
    topic = "empty-values"
    create_topic(broker.bootstrap, topic, 1)
    with running_agent(tmp_path / "agent", broker.bootstrap) as agent:
        assert agent.config.socket.path is not None
        with FerryClient(agent.config.socket.path) as client:
            client.send(topic, b"", key=b"account-7")
            client.send(topic, b"after")
        got = consume_all(broker.bootstrap, topic, 2, timeout=20)
    assert [(m.key, m.value) for m in got] == [(b"account-7", b""), (None, b"after")]
