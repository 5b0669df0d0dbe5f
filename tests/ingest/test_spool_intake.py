"""Spool intake in the agent: files in, every record exactly once, bad files quarantined."""

from __future__ import annotations

import collections
import os
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from agent.buffer.store import Store, StoredMessage
from agent.daemon import Agent
from spool.format import SpoolRecord
from spool.writer import write_spool_file
from tests.agent_harness import AgentProcess, running_agent, write_config
from tests.kafka import Broker, consume_all, read_topic
from tests.waiting import wait_until


def spool_agent(root: Path, bootstrap: str, **kw: Any) -> AbstractContextManager[Agent]:
    return running_agent(root, bootstrap, spool=True, **kw)


def _spool(agent: Agent) -> Path:
    return Path(agent.config.spool.dirs[0])


def _age(path: Path, seconds: float = 60) -> None:
    """Make a file look finished long ago (hand-made files are left alone while fresh)."""
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_binary_and_hand_made_files_reach_kafka(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    with spool_agent(tmp_path, session_broker.bootstrap) as agent:
        spool = _spool(agent)
        write_spool_file(spool, "batch-1.ferry", [
            SpoolRecord(unique_topic, b"bin-%d" % i, key=b"k%d" % i if i % 2 else None,
                        partition_key=i if i % 3 == 0 else None, timestamp_ms=1_000 + i,
                        headers=(("h", b"v"),))
            for i in range(300)])
        (spool / unique_topic).mkdir()
        jsonl = spool / unique_topic / "people.jsonl"
        jsonl.write_text('{"value": "j-1", "key": "jk"}\n{"value": "j-2", "partition_key": 7}\n')
        txt = spool / unique_topic / "lines.txt"
        txt.write_text("t-1\nt-2\nt-3\n")
        _age(jsonl)
        _age(txt)
        agent.stages[-1].wake()  # type: ignore[attr-defined]
        got = consume_all(session_broker.bootstrap, unique_topic, 305, timeout=30)
        wait_until(lambda: not any(spool.rglob("*.ferry")) and not jsonl.exists()
                   and not txt.exists(), message="ingested files removed")
    values = collections.Counter(m.value for m in got)
    assert len(got) == 305 and max(values.values()) == 1
    assert {b"j-1", b"j-2", b"t-1", b"t-2", b"t-3"} <= set(values)
    by_value = {m.value: m for m in got}
    assert by_value[b"bin-5"].key == b"k5"
    assert by_value[b"bin-5"].timestamp_ms == 1_005
    assert by_value[b"bin-5"].headers == (("h", b"v"),)
    assert by_value[b"j-1"].key == b"jk"
    assert by_value[b"j-2"].partition == 7 % 4  # auto-created: 4 partitions
    assert agent.registry.view().total("spool_files_ingested") == 3
    assert agent.registry.view().total("messages_accepted", source="spool") == 305


def test_corrupt_and_truncated_files_are_quarantined_and_never_partly_ingested(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    with spool_agent(tmp_path, session_broker.bootstrap) as agent:
        spool = _spool(agent)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        good = write_spool_file(elsewhere, "good.ferry",
                                [SpoolRecord(unique_topic, b"good-%d" % i) for i in range(50)])
        data = good.read_bytes()
        truncated = spool / "truncated.ferry"
        truncated.write_bytes(data[: len(data) - 7])
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        corrupt = spool / "corrupt.ferry"
        corrupt.write_bytes(bytes(flipped))
        (spool / unique_topic).mkdir()
        bad_json = spool / unique_topic / "bad.jsonl"
        bad_json.write_text('{"value": "fine"}\n{"value": \n')
        # Ignored, never read: a writer's temporary files.
        (spool / ".half-written.ferry.1234.tmp").write_bytes(data[:20])
        (spool / "still-writing.tmp").write_bytes(data[:20])
        for f in (truncated, corrupt, bad_json):
            _age(f)
        agent.stages[-1].wake()  # type: ignore[attr-defined]
        quarantine = spool / "quarantine"
        wait_until(lambda: len(list(quarantine.rglob("*.reason"))) == 3, timeout=20,
                   message="three files quarantined")
        reasons = {p.name: p.read_text() for p in quarantine.rglob("*.reason")}
        assert set(reasons) == {"truncated.ferry.reason", "corrupt.ferry.reason",
                                "bad.jsonl.reason"}
        assert all(r.startswith("corrupt: ") for r in reasons.values())
        assert (quarantine / "truncated.ferry").exists()
        assert (spool / ".half-written.ferry.1234.tmp").exists()
        assert (spool / "still-writing.tmp").exists()
        view = agent.registry.view()
        assert view.total("spool_files_quarantined", reason="corrupt") == 3
        assert view.total("messages_accepted", source="spool") == 0
        assert agent.store.topic_stats() == []


def test_a_retried_spark_file_is_not_ingested_twice(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    records = [SpoolRecord(unique_topic, b"once-%d" % i) for i in range(20)]
    with spool_agent(tmp_path, session_broker.bootstrap) as agent:
        spool = _spool(agent)
        write_spool_file(spool, "job-7-part-00001.ferry", records, replace=True)
        agent.stages[-1].wake()  # type: ignore[attr-defined]
        wait_until(lambda: agent.registry.view().total("spool_files_ingested") == 1,
                   message="first copy ingested")
        # The task is retried after the agent took its file: same name, same content.
        write_spool_file(spool, "job-7-part-00001.ferry", records, replace=True)
        agent.stages[-1].wake()  # type: ignore[attr-defined]
        wait_until(lambda: agent.registry.view().total("spool_files_duplicate") == 1,
                   message="second copy recognised")
        assert not (spool / "job-7-part-00001.ferry").exists()
        consume_all(session_broker.bootstrap, unique_topic, 20, timeout=20)
        wait_until(lambda: not agent.store.topic_stats(), message="drained")
    got = read_topic(session_broker.bootstrap, unique_topic)
    assert sorted(m.value for m in got) == sorted(r.value for r in records)


def test_intake_pauses_while_the_buffer_is_full_and_resumes(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    broker.stop()  # nothing drains: the buffer fills
    n = 4000
    with spool_agent(tmp_path, broker.bootstrap, buffer={"max_bytes": 1024 * 1024}) as agent:
        spool = _spool(agent)
        write_spool_file(spool, "big.ferry",
                         [SpoolRecord(unique_topic, b"x" * 1000 + b"%d" % i) for i in range(n)])
        agent.stages[-1].wake()  # type: ignore[attr-defined]
        wait_until(lambda: agent.registry.view().total("messages_rejected",
                                                       reason="buffer_full") > 0,
                   timeout=30, message="the buffer refuses a batch")
        assert (spool / "big.ferry").exists()  # the file waits on disk
        buffered = sum(s.messages for s in agent.store.topic_stats())
        assert 0 < buffered < n
        broker.start()
        got = consume_all(broker.bootstrap, unique_topic, n, timeout=90)
        assert len({m.value for m in got}) == n
        wait_until(lambda: not (spool / "big.ferry").exists(), message="file finished")


def test_kill_9_mid_file_then_restart_buffers_each_record_exactly_once(
    tmp_path: Path, broker: Broker, unique_topic: str
) -> None:
    n = 200_000
    broker.stop()  # keep everything in the buffer, where it can be counted
    config = write_config(tmp_path, broker.bootstrap, http=False, spool=True)
    spool = tmp_path / "spool"
    spool.mkdir()
    agent = AgentProcess(config)
    agent.start()
    try:
        write_spool_file(spool, "large.ferry",
                         [SpoolRecord(unique_topic, b"r-%d" % i) for i in range(n)])
        wait_until(lambda: agent.buffered().get(unique_topic, 0) > 0, timeout=60,
                   interval=0.01, message="ingest started")
        agent.kill()
    finally:
        agent.kill()
    partial = _buffered_values(tmp_path, unique_topic)
    assert 0 < len(partial) < n, "the kill should land mid-file"
    with AgentProcess(config) as agent:
        wait_until(lambda: agent.buffered().get(unique_topic, 0) == n, timeout=120,
                   message="the rest ingested after restart")
        wait_until(lambda: not (spool / "large.ferry").exists(), message="file removed")
        agent.terminate()
    values = _buffered_values(tmp_path, unique_topic)
    assert len(values) == n == len(set(values))
    assert set(values) == {b"r-%d" % i for i in range(n)}


def _buffered_values(root: Path, topic: str) -> list[bytes]:
    store = Store(root / "buffer", 256 * 1024 * 1024)
    try:
        return [m.record.value for m in store.read(topic, None, 10_000_000)
                if isinstance(m, StoredMessage)]
    finally:
        store.close()
