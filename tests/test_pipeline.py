"""The core pipeline end to end: datagram socket -> LMDB buffer -> forwarder -> real Kafka."""

from __future__ import annotations

import collections
import socket
import struct
from pathlib import Path

from ferry_client import FerryClient, wire
from tests.agent_harness import (
    AgentProcess,
    now_ms,
    running_agent,
    wait_buffered,
    wait_drained,
    write_config,
)
from tests.kafka import Broker, consume_all, create_topic, read_topic
from tests.waiting import wait_until


def test_both_message_types_reach_the_right_partition_intact(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 4)
    ts = now_ms() - 12345
    with running_agent(tmp_path, session_broker.bootstrap) as agent:
        assert agent.config.socket.path is not None
        with FerryClient(agent.config.socket.path) as client:
            for i in range(8):
                client.send(unique_topic, b"any-%d" % i, key=b"k%d" % i, timestamp_ms=ts + i)
            for pk in (0, 1, 2, 3, 6, 7, -1, 2**31 - 1):
                client.send(unique_topic, b"pk-%d" % pk, key=b"key-%d" % pk, partition_key=pk,
                            timestamp_ms=ts)
        got = consume_all(session_broker.bootstrap, unique_topic, 16, timeout=20)
    assert len(got) == 16, got
    anys = [m for m in got if m.value and m.value.startswith(b"any-")]
    pks = [m for m in got if m.value and m.value.startswith(b"pk-")]
    # Key, value and the client's timestamp arrive intact.
    for m in anys:
        i = int(m.value[4:])  # type: ignore[index]
        assert m.key == b"k%d" % i
        assert m.timestamp_ms == ts + i
    # AnyPartition: round-robin, so 8 messages over 4 partitions is 2 each.
    assert collections.Counter(m.partition for m in anys) == {0: 2, 1: 2, 2: 2, 3: 2}
    # PartitionKey: key mod 4 into [0, 1, 2, 3] (Bruce: unsigned-style mod, -1 % 4 == 3).
    for m in pks:
        pk = int(m.value[3:])  # type: ignore[index]
        assert m.partition == pk % 4, (pk, m.partition)
        assert m.key == b"key-%d" % pk
        assert m.timestamp_ms == ts


def _malformed_variants(topic: str) -> list[tuple[str, bytes]]:
    good = wire.encode_any_partition(topic, b"value", key=b"key", timestamp_ms=1)
    good_pk = wire.encode_partition_key(topic, 5, b"value", timestamp_ms=1)
    wrong_size = struct.pack(">i", len(good) + 3) + good[4:]
    flags = good[:8] + struct.pack(">h", 1) + good[10:]
    api_key = good[:4] + struct.pack(">h", 258) + good[6:]
    version = good[:6] + struct.pack(">h", 1) + good[8:]
    zero_topic = wire.encode_any_partition(topic, b"v")
    zero_topic = zero_topic[:10] + struct.pack(">h", 0) + zero_topic[12 + len(topic):]
    zero_topic = struct.pack(">i", len(zero_topic)) + zero_topic[4:]
    trailing = good + b"x"
    trailing = struct.pack(">i", len(trailing)) + trailing[4:]
    bad_topic = wire.encode_any_partition("a" * len(topic), b"v").replace(
        b"a" * len(topic), b"b d" + b"a" * (len(topic) - 3))
    return [
        ("malformed", b""),
        ("malformed", b"\x00\x00"),
        ("malformed", wrong_size),
        ("malformed", flags),
        ("malformed", good[:-2]),  # truncated
        ("malformed", trailing),
        ("malformed", zero_topic),
        ("malformed", good_pk[:14]),
        ("unsupported_api_key", api_key),
        ("unsupported_version", version),
        ("invalid_topic", bad_topic),
        ("too_large", wire.encode_any_partition(topic, b"x" * 2000)),
    ]


def test_bad_datagrams_are_counted_by_reason_and_the_daemon_keeps_serving(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    variants = _malformed_variants(unique_topic)
    topics = {unique_topic: {"max_message_bytes": 1000}}
    with running_agent(tmp_path, session_broker.bootstrap, topics=topics) as agent:
        assert agent.config.socket.path is not None
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        raw.connect(str(agent.config.socket.path))
        for _, data in variants:
            raw.send(data)
        raw.close()
        with FerryClient(agent.config.socket.path) as client:
            client.send(unique_topic, b"still served")
        expected = collections.Counter(reason for reason, _ in variants)

        def counted() -> dict[str, float]:
            return agent.registry.view().by("messages_rejected", "reason", source="socket")

        wait_until(lambda: counted() == expected, timeout=10, message="rejects counted")
        got = consume_all(session_broker.bootstrap, unique_topic, 1, timeout=20)
        assert [m.value for m in got] == [b"still served"]
        view = agent.registry.view()
        assert view.total("messages_accepted", source="socket") == 1
        assert view.total("messages_received", source="socket") == len(variants) + 1
        # People can see examples of what was rejected, per reason.
        assert ("rejected", "unsupported_version") in view.samples
    assert read_topic(session_broker.bootstrap, unique_topic) == got


def test_messages_are_accepted_during_a_broker_outage_and_delivered_after(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    n = 500
    with running_agent(tmp_path, broker.bootstrap) as agent:
        assert agent.config.socket.path is not None
        with FerryClient(agent.config.socket.path) as client:
            client.send(unique_topic, b"before")
            assert len(consume_all(broker.bootstrap, unique_topic, 1, timeout=20)) == 1
            broker.stop()
            for i in range(n):
                client.send(unique_topic, b"during-%d" % i)
        wait_until(lambda: agent.registry.view().total("messages_accepted") == n + 1,
                   message="accepted while Kafka is down")
        assert agent.store.topic_stats()[0].messages == n
        broker.start()  # memory storage: the topic comes back empty
        got = consume_all(broker.bootstrap, unique_topic, n, timeout=60)
        values = {m.value for m in got}
        assert values == {b"during-%d" % i for i in range(n)}
        wait_until(lambda: not agent.store.topic_stats(), message="buffer drained")


def test_kill_9_after_commit_then_restart_delivers_everything(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    n = 2000
    config = write_config(tmp_path, broker.bootstrap, http=False)
    broker.stop()  # nothing can leave the buffer before the crash
    with AgentProcess(config) as agent:
        with FerryClient(agent.socket_path) as client:
            for i in range(n):
                client.send(unique_topic, b"m-%d" % i, partition_key=i)
        wait_buffered(agent, unique_topic, n)
        agent.kill()
    broker.start()
    with AgentProcess(config) as agent:
        got = consume_all(broker.bootstrap, unique_topic, n, timeout=60)
        assert {m.value for m in got} == {b"m-%d" % i for i in range(n)}
        wait_drained(agent)
    assert len(read_topic(broker.bootstrap, unique_topic)) == n


def test_kill_9_while_delivering_loses_nothing(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    """Duplicates are allowed only for messages in flight at the crash; loss never."""
    n = 20000
    # The first agent delivers slowly (200 in flight, each send held 20 ms), so that the
    # kill lands mid-delivery: at full speed the whole backlog can leave between two looks
    # at the buffer, and the crash would then test nothing. The second agent, on the same
    # buffer, delivers at full speed.
    in_flight = 200
    slow = write_config(tmp_path / "slow", broker.bootstrap, http=False,
                        buffer={"path": tmp_path / "buffer"},
                        forwarder={"max_in_flight_messages": in_flight, "linger_ms": 20})
    config = write_config(tmp_path, broker.bootstrap, http=False)
    broker.stop()  # hold everything in the buffer until all n are acknowledged (committed)
    with AgentProcess(slow) as agent:
        with FerryClient(agent.socket_path) as client:
            for i in range(n):
                client.send(unique_topic, b"m-%d" % i)
        wait_buffered(agent, unique_topic, n)
        broker.start()
        # The agent may create it first (a metadata request naming a topic creates it).
        create_topic(broker.bootstrap, unique_topic, 4, exist_ok=True)
        # Kill once delivery has started (0 left: it has finished; the check below says so).
        wait_until(lambda: agent.buffered().get(unique_topic, 0) < n, timeout=60,
                   interval=0.01, message="delivery started")
        agent.kill()
    left = agent.buffered().get(unique_topic, 0)  # read from the buffer, the agent dead
    assert 0 < left < n, f"the kill did not land mid-delivery ({left} of {n} left)"
    with AgentProcess(config) as agent:
        wait_drained(agent, timeout=60)
    got = read_topic(broker.bootstrap, unique_topic)
    values = collections.Counter(m.value for m in got)
    missing = {b"m-%d" % i for i in range(n)} - set(values)
    assert not missing, f"{len(missing)} acknowledged messages lost"
    duplicates = sum(c - 1 for c in values.values())
    # Only what was in flight at the crash can be sent twice.
    assert duplicates <= in_flight
