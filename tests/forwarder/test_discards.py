"""Discards by rule (TTL) into the discard log, `ferry replay`, and a disk that fills up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agent.buffer.store import Store, StoredMessage
from agent.config import load_config
from agent.daemon.agent import Agent
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.metrics import Registry
from agent.records import Record
from ferry_client import FerryClient
from tests.agent_harness import REPO_ROOT, write_config
from tests.kafka import Broker, consume_all, read_topic
from tests.waiting import wait_until


def test_ttl_expiry_goes_to_the_discard_log_and_replay_delivers_it(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    cfg_path = write_config(tmp_path, broker.bootstrap, http=False,
                            topics={unique_topic: {"ttl_seconds": 2}},
                            forwarder={"message_timeout_ms": 1000})
    config = load_config(cfg_path)
    broker.stop()  # undeliverable until the TTL runs out
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        assert config.socket.path is not None
        with FerryClient(config.socket.path) as client:
            for i in range(5):
                client.send(unique_topic, b"old-%d" % i, key=b"k%d" % i, partition_key=i)
        wait_until(lambda: agent.registry.view().total("messages_discarded", reason="ttl") == 5,
                   timeout=30, message="TTL discards counted")
        assert not agent.store.topic_stats()
        lines = [json.loads(x) for x in config.discard_log_path.read_text().splitlines()]
        assert {(d["reason"], d["topic"]) for d in lines} == {("ttl", unique_topic)}
        assert sorted(d["partition_key"] for d in lines) == [0, 1, 2, 3, 4]
        assert all(d["id"] and d["accepted_ms"] and d["discarded_ms"] for d in lines)
        view = agent.registry.view()
        assert ("discarded", "ttl") in view.samples

        broker.start()
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli.main", "replay", str(config.discard_log_path),
             "--config", str(cfg_path)], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=60)
        assert done.returncode == 0, done.stderr
        assert "replayed 5 messages" in done.stdout
        got = consume_all(broker.bootstrap, unique_topic, 5, timeout=30)
        assert sorted((m.value, m.key) for m in got) == [
            (b"old-%d" % i, b"k%d" % i) for i in range(5)]
        # The running agent counts what came back in, from another process, as it counts
        # any source (the status page's "replay" series).
        wait_until(lambda: agent.registry.view().total(
            "messages_accepted", source="replay", topic=unique_topic) == 5,
            timeout=10, message="the replayed messages counted")

        # The same file again puts nothing back and counts nothing; one more message,
        # replayed from another file, is the point at which to look: counted 6, not 11.
        again = subprocess.run(
            [sys.executable, "-m", "agent.cli.main", "replay", str(config.discard_log_path),
             "--config", str(cfg_path)], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=60)
        assert again.returncode == 0, again.stderr
        assert "replayed 0 messages" in again.stdout
        assert "5 already replayed before, skipped" in again.stdout
        one_more = tmp_path / "one-more.jsonl"
        DiscardLog(one_more).write([Discard("ttl", unique_topic, "00" * 12, 1, Record(
            unique_topic, b"new", key=b"k9", partition_key=0))])
        assert subprocess.run(
            [sys.executable, "-m", "agent.cli.main", "replay", str(one_more), "--config",
             str(cfg_path)], cwd=REPO_ROOT, capture_output=True, timeout=60).returncode == 0
        wait_until(lambda: agent.registry.view().total(
            "messages_accepted", source="replay", topic=unique_topic) >= 6,
            timeout=10, message="the last replayed message counted")
        assert agent.registry.view().total(
            "messages_accepted", source="replay", topic=unique_topic) == 6
        wait_until(lambda: len(consume_all(broker.bootstrap, unique_topic, 6, timeout=5)) == 6,
                   timeout=30, message="the last replayed message delivered")
        wait_until(lambda: not agent.store.topic_stats(), timeout=30,
                   message="the buffer drained")
        assert sorted(m.value for m in read_topic(broker.bootstrap, unique_topic)) == sorted(
            [b"old-%d" % i for i in range(5)] + [b"new"])
    finally:
        agent.stop()


def test_replay_refuses_a_file_that_is_not_a_discard_log(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path, "127.0.0.1:1", http=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reason": "ttl", "topic": "t", "value": "bm90IGJhc2U2NA=="}\nnot json\n')
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli.main", "replay", str(bad), "--config", str(cfg_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "bad.jsonl:2: not a discard-log line" in done.stderr
    assert "nothing was put back" in done.stderr
    assert not (tmp_path / "buffer" / "data.mdb").exists()


def test_full_disk_refuses_input_clearly_and_recovers_when_space_returns(
    tmp_path: Path, small_disk: Path, broker: Broker, unique_topic: str
) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 6 * 1024 * 1024)
    config = load_config(write_config(
        tmp_path, broker.bootstrap, http=False,
        buffer={"path": small_disk / "buffer", "max_bytes": 512 * 1024 * 1024,
                "reserve_bytes": 2 * 1024 * 1024}))
    broker.stop()  # nothing leaves the buffer: the disk must fill
    agent = Agent(config, registry=Registry())
    agent.start()
    sent = 0
    try:
        assert config.socket.path is not None
        value = b"x" * 900
        with FerryClient(config.socket.path) as client:
            def handled() -> bool:
                v = agent.registry.view()
                return v.total("messages_accepted") + v.total("messages_rejected") >= sent

            def refused() -> float:
                nonlocal sent
                for _ in range(200):
                    client.send(unique_topic, value)
                    sent += 1
                # Each round is stored or refused before the next: nothing may still wait in
                # the writer's queue when space returns, or it would fill the disk again
                # (the forwarder's deletes, which need a few free pages, would then fail).
                wait_until(handled, timeout=30, message="the round stored or refused")
                return agent.registry.view().total("messages_rejected", reason="disk_full")

            wait_until(refused, timeout=60, interval=0.01, message="disk_full refusals")
            # Still serving: once space returns, new messages are accepted again.
            filler.unlink()
            accepted_before = agent.registry.view().total("messages_accepted")

            def accepted_again() -> bool:
                client.send(unique_topic, b"after")
                return agent.registry.view().total("messages_accepted") > accepted_before

            wait_until(accepted_again, timeout=60, message="accepting again")
    finally:
        agent.stop()
    # The buffer is consistent: every message in it decodes, and it holds exactly what was
    # accepted. Refused datagrams were counted, never half-stored.
    view = agent.registry.view()
    accepted = int(view.total("messages_accepted"))
    refused = int(view.total("messages_rejected", reason="disk_full"))
    assert accepted + refused == sent + int(view.total("messages_received")) - sent
    store = Store(config.buffer.path, config.buffer.max_bytes)
    try:
        stored = store.read(unique_topic, None, 1_000_000)
        assert len(stored) == accepted == store.topic_stats()[0].messages
        assert all(isinstance(m, StoredMessage) for m in stored)
    finally:
        store.close()
    # And all of it reaches Kafka once Kafka is back.
    broker.start()
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        got = consume_all(broker.bootstrap, unique_topic, accepted, timeout=60)
        assert len(got) == accepted
        wait_until(lambda: not agent.store.topic_stats(), timeout=30, message="drained")
    finally:
        agent.stop()
    assert len(read_topic(broker.bootstrap, unique_topic)) == accepted
