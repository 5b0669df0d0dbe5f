"""Spool intake in the agent: files in, every record exactly once, bad files quarantined."""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import struct
import threading
import time
import zlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from agent.buffer.committer import Committer
from agent.buffer.store import Store, StoredMessage
from agent.config import BufferConfig, FerryConfig, SpoolConfig
from agent.daemon.agent import Agent
from agent.ingest.runtime import Runtime
from agent.ingest.spool_intake import SpoolIntake
from agent.metrics import Registry
from agent.signals.limits import Limit, LimitsPublisher
from agent.signals.limits import file_path as limits_file_path
from spool.format import (
    BLOCK_HEADER,
    FILE_HEADER,
    RECORD_HEADER,
    SpoolRecord,
    encode_file,
    encode_record,
)
from spool.writer import write_spool_file
from tests.agent_harness import AgentProcess, running_agent, write_config
from tests.ingest.harness import buffered, intake_only
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


def _drop_aged(path: Path, data: bytes) -> Path:
    """Put a file finished long ago where a running agent sees it: written and aged under a
    temporary name, then renamed into place (the agent may claim it the instant it appears,
    so it cannot be aged afterwards)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    _age(tmp)
    os.rename(tmp, path)
    return path


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
        jsonl = _drop_aged(spool / unique_topic / "people.jsonl",
                           b'{"value": "j-1", "key": "jk"}\n{"value": "j-2", "partition_key": 7}\n')
        txt = _drop_aged(spool / unique_topic / "lines.txt", b"t-1\nt-2\nt-3\n")
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
        # Aged: a fresh broken binary file may still be being written in place.
        _drop_aged(spool / "truncated.ferry", data[: len(data) - 7])
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        _drop_aged(spool / "corrupt.ferry", bytes(flipped))
        (spool / unique_topic).mkdir()
        _drop_aged(spool / unique_topic / "bad.jsonl", b'{"value": "fine"}\n{"value": \n')
        # Ignored, never read: a writer's temporary files.
        (spool / ".half-written.ferry.1234.tmp").write_bytes(data[:20])
        (spool / "still-writing.tmp").write_bytes(data[:20])
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
    assert sorted(m.value or b"" for m in got) == sorted(r.value for r in records)


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
        view = agent.registry.view
        wait_until(lambda: view().total("spool_batches_deferred", reason="buffer_full") > 1,
                   timeout=30, message="the buffer refuses a batch, twice")
        assert claimed(spool, "big.ferry").exists()  # the file waits on disk, claimed
        assert view().total("spool_intake_paused") == 1
        # Each retry is one more deferral; none is a rejection.
        assert view().total("messages_rejected", source="spool") == 0
        buffered = sum(s.messages for s in agent.store.topic_stats())
        assert 0 < buffered < n
        broker.start()
        got = consume_all(broker.bootstrap, unique_topic, n, timeout=90)
        assert len({m.value for m in got}) == n
        wait_until(lambda: not claimed(spool, "big.ferry").exists(), message="file finished")
        assert not (spool / "big.ferry").exists()


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


# -- the bulk path for binary files, without Kafka ----------------------------------------------
MB = 1024 * 1024


def claimed(spool: Path, name: str) -> Path:
    """Where the intake keeps a file it claimed (``spool/.ingesting/NAME``)."""
    return spool / ".ingesting" / name


def place(intake: SpoolIntake, name: str, records: list[SpoolRecord], block_bytes: int) -> Path:
    """A binary spool file of small blocks (so batches and resumes cross block boundaries)."""
    path = intake.dirs[0] / name
    tmp = path.with_name("." + name + ".tmp")
    tmp.write_bytes(encode_file(records, block_bytes=block_bytes))
    tmp.rename(path)
    return path


MIXED = [SpoolRecord("orders" if i % 7 < 4 else "clicks", b"value-%d" % i,
                     key=b"k%d" % i if i % 3 == 0 else None,
                     partition_key=i % 5 if i % 4 == 0 else None,
                     timestamp_ms=0 if i % 10 == 0 else 1_700_000_000_000 + i,
                     headers=(("trace", b"%d" % i),) if 300 <= i < 320 else ())
         for i in range(3000)]


def test_bulk_intake_buffers_exactly_what_the_record_path_would(tmp_path: Path) -> None:
    before_ms = int(time.time() * 1000)
    with intake_only(tmp_path) as intake:
        path = place(intake, "mixed.ferry", MIXED, block_bytes=2000)
        assert intake.scan_once() == 1
        after_ms = int(time.time() * 1000)
        store, view = intake.store, intake.registry.view()
        assert not path.exists()
        for topic in ("orders", "clicks"):
            want = [r for r in MIXED if r.topic == topic]
            got = buffered(store, topic)
            assert [m.record.value for m in got] == [r.value for r in want]  # FIFO per topic
            for m, r in zip(got, want, strict=True):
                assert m.generation == 0
                assert (m.record.key, m.record.partition_key, m.record.headers) == (
                    r.key, r.partition_key, r.headers)
                assert m.record.hash_key == (r.key is not None and r.partition_key is None)
                if r.timestamp_ms:
                    assert m.record.timestamp_ms == r.timestamp_ms
                else:  # no timestamp in the file: the time of intake
                    assert before_ms <= m.record.timestamp_ms <= after_ms
            assert view.total("messages_accepted", source="spool", topic=topic) == len(want)
        assert view.total("spool_files_ingested") == 1
        assert view.total("buffer_commits", writer="spool") >= 1
        assert store.state_items(b"spool:") == []  # progress forgotten once the file is gone
        assert len(store.state_items(b"spool-seen:")) == 1


def test_bulk_intake_resumes_mid_block_from_the_committed_progress(tmp_path: Path) -> None:
    records = [SpoolRecord("t", b"r-%d" % i) for i in range(1000)]
    with intake_only(tmp_path) as intake:
        path = place(intake, "resume.ferry", records, block_bytes=1500)
        st = path.stat()
        # What a crash leaves: the batches up to record 437 committed with their progress.
        intake.store.update_state(puts={b"spool:0:resume.ferry": json.dumps(
            {"identity": [st.st_ino, st.st_size, st.st_mtime_ns], "next": 437, "done": False,
             "count": 1000}).encode()})
        assert intake.scan_once() == 1
        assert [m.record.value for m in buffered(intake.store, "t")] == [
            r.value for r in records[437:]]


def test_bulk_batches_are_capped_in_bytes_and_commit_with_their_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Alternating topics: a batch boundary falls inside a block of both.
    records = [SpoolRecord("tu"[i % 2], b"%04d" % i + b"x" * 996) for i in range(1500)]
    calls: list[tuple[int, int, dict[str, Any]]] = []
    with intake_only(tmp_path, max_bytes=4 * MB) as intake:
        cap = 4 * MB // 8
        store = intake.store
        real = store.append_encoded

        def spy(runs: Any, **kw: Any) -> int:
            n = sum(len(values) for _, values, _ in runs)
            weight = sum(len(v) + 64 for _, values, _ in runs for v in values)
            doc = json.loads(kw["state_puts"][b"spool:0:big.ferry"])
            calls.append((n, weight, doc))
            return real(runs, **kw)

        monkeypatch.setattr(store, "append_encoded", spy)
        place(intake, "big.ferry", records, block_bytes=100_000)
        assert intake.scan_once() == 1
        for topic in "tu":
            assert [m.record.value for m in buffered(store, topic)] == [
                r.value for r in records if r.topic == topic]
    assert len(calls) >= 1500 * 1087 // cap
    assert all(weight < cap + 1100 for _, weight, _ in calls)
    ends = list(itertools.accumulate(n for n, _, _ in calls))
    assert [doc["next"] for _, _, doc in calls] == ends
    assert [doc["done"] for _, _, doc in calls] == [False] * (len(calls) - 1) + [True]


def test_a_topic_generation_bumped_before_intake_is_the_one_stored(tmp_path: Path) -> None:
    with intake_only(tmp_path) as intake:
        gen = intake.store.bump_generation("t")
        place(intake, "g.ferry", [SpoolRecord("t", b"v")], block_bytes=1 << 20)
        assert intake.scan_once() == 1
        assert [m.generation for m in buffered(intake.store, "t")] == [gen]


def _one_block_file(path: Path, body: bytes, count: int) -> None:
    """A binary spool file of one block holding ``body`` (``count`` records), made by hand so
    the records may be wrong while every checksum is right; aged, so intake takes it."""
    header = FILE_HEADER.pack(b"FERRYSPL", 1, 0)
    block = BLOCK_HEADER.pack(len(body), count, zlib.crc32(body))
    trailer = struct.pack("<I8sQI", 0, b"FERRYEND", count, zlib.crc32(header + block))
    path.write_bytes(header + block + body + trailer)
    _age(path)


def test_a_malformed_record_in_an_intact_block_is_quarantined_before_its_batch(
    tmp_path: Path,
) -> None:
    good = encode_record(SpoolRecord("t", b"fine"))
    body = good + RECORD_HEADER.pack(31, 8, 1, 0, 0, 0, 0, 2) + b"tvv"  # unknown flags
    with intake_only(tmp_path) as intake:
        _one_block_file(intake.dirs[0] / "buggy.ferry", body, 2)
        assert intake.scan_once() == 0
        reason = (intake.dirs[0] / "quarantine" / "buggy.ferry.reason").read_text()
        assert "unknown record flags" in reason
        assert intake.store.topic_stats() == []
        assert intake.registry.view().total("messages_accepted", source="spool") == 0


def test_a_first_record_with_an_empty_topic_is_quarantined_not_dropped(tmp_path: Path) -> None:
    # The bulk encoder once took the first record's empty topic for "same topic as before"
    # and lost the record; the file was then counted ingested and deleted.
    body = RECORD_HEADER.pack(31, 0, 0, 0, 0, 0, 0, 3) + b"vvv" + encode_record(
        SpoolRecord("t", b"fine"))
    with intake_only(tmp_path) as intake:
        _one_block_file(intake.dirs[0] / "notopic.ferry", body, 2)
        assert intake.scan_once() == 0
        assert (intake.dirs[0] / "quarantine" / "notopic.ferry").exists()
        assert intake.store.topic_stats() == []
        assert intake.registry.view().total("messages_accepted", source="spool") == 0


def test_stopping_mid_file_keeps_the_progress_and_a_new_intake_finishes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [SpoolRecord("t", b"s-%d" % i) for i in range(50_000)]  # three batches
    with intake_only(tmp_path) as intake:
        store = intake.store
        real = store.append_encoded

        def stop_after_first_batch(runs: Any, **kw: Any) -> int:
            stored = real(runs, **kw)
            intake._stop.set()  # noqa: SLF001 - what stop() does, without joining threads
            return stored

        monkeypatch.setattr(store, "append_encoded", stop_after_first_batch)
        path = place(intake, "long.ferry", records, block_bytes=1 << 20)
        assert intake.scan_once() == 0
        assert not path.exists() and claimed(intake.dirs[0], "long.ferry").exists()
        first = len(buffered(store, "t"))
        assert 0 < first < len(records)
        monkeypatch.setattr(store, "append_encoded", real)
        again = SpoolIntake(intake.runtime)
        try:
            assert again.scan_once() == 1
        finally:
            again.stop()
        assert [m.record.value for m in buffered(store, "t")] == [r.value for r in records]
        assert not claimed(intake.dirs[0], "long.ferry").exists()


def test_after_ingest_move_keeps_each_file_under_done_and_never_reads_it_again(
    tmp_path: Path,
) -> None:
    records = [SpoolRecord("t", b"bin-%d" % i) for i in range(50)]
    with intake_only(tmp_path, after_ingest="move") as intake:
        spool = intake.dirs[0]
        binary = place(intake, "batch.ferry", records, block_bytes=500)
        original = binary.read_bytes()
        (spool / "orders").mkdir()
        lines = spool / "orders" / "lines.txt"
        lines.write_text("a\nb\n")
        _age(lines)
        assert intake.scan_once() == 2
        # Moved, byte for byte, under done/ at the same relative path.
        assert not binary.exists() and not lines.exists()
        assert (spool / "done" / "batch.ferry").read_bytes() == original
        assert (spool / "done" / "orders" / "lines.txt").read_text() == "a\nb\n"
        assert [m.record.value for m in buffered(intake.store, "t")] == [r.value for r in records]
        assert [m.record.value for m in buffered(intake.store, "orders")] == [b"a", b"b"]
        # done/ is the agent's: a later scan ingests nothing from it.
        assert intake.scan_once() == 0
        assert len(buffered(intake.store, "t")) == 50
        assert intake.registry.view().total("spool_files_ingested") == 2


def test_a_quarantined_file_has_its_reason_written_beside_it(tmp_path: Path) -> None:
    with intake_only(tmp_path) as intake:
        spool = intake.dirs[0]
        bad = spool / "broken.ferry"
        bad.write_bytes(b"not a spool file at all")
        _age(bad)  # a fresh broken binary file may still be being written in place
        intake.scan_once()
        moved = spool / "quarantine" / "broken.ferry"
        assert moved.read_bytes() == b"not a spool file at all"
        reason = (spool / "quarantine" / "broken.ferry.reason").read_text()
        first, second = reason.splitlines()
        assert first.startswith("corrupt: ") and len(first) > len("corrupt: ")
        assert second.startswith("quarantined at ")
        assert intake.registry.view().total("spool_files_quarantined") == 1
        assert intake.store.topics() == []


def test_a_full_disk_pauses_the_intake_mid_file_and_it_resumes_when_space_returns(
    tmp_path: Path, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ENOSPC from LMDB (a real 12 MiB tmpfs) is a pause, like a full buffer: the file waits
    with its progress, nothing is lost or buffered twice, no restart is needed."""
    n = 4000
    records = [SpoolRecord("t", b"%05d" % i + b"x" * 1000) for i in range(n)]
    # max_bytes 8 MiB (room for the whole file): 1 MiB batches, so some commit before the
    # disk fills.
    caplog.set_level("INFO", logger="agent.ingest.spool_intake")
    # A 2 MiB reserve: the default 32 MiB would not fit on this 12 MiB filesystem at all.
    with intake_only(tmp_path, max_bytes=8 * MB, buffer_path=small_disk / "buffer",
                     reserve_bytes=2 * MB) as intake:
        filler = small_disk / "filler"
        free = os.statvfs(small_disk)
        # 6 MiB left: the 2 MiB reserve, and room for a batch or two (the buffer counts a
        # batch at twice its size, for half-full pages), not for the whole 4 MB file.
        filler.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 6 * MB))
        path = place(intake, "big.ferry", records, block_bytes=64 * 1024)
        scan = threading.Thread(target=intake.scan_once, daemon=True)
        scan.start()
        wait_until(lambda: intake.registry.view().total(
            "spool_batches_deferred", reason="disk_full") > 0,
            timeout=60, message="the full disk refuses a spool batch")
        # paused, the file waiting on disk (claimed)
        assert scan.is_alive() and claimed(intake.dirs[0], "big.ferry").exists()
        assert intake.registry.view().total("spool_intake_paused") == 1
        partial = len(buffered(intake.store, "t"))
        assert 0 < partial < n
        refusals = intake.registry.view().total("spool_batches_deferred")
        wait_until(lambda: intake.registry.view().total("spool_batches_deferred")
                   > refusals, timeout=30, message="the batch refused again")
        # Waiting records are not refused input: nothing was refused to anyone.
        assert intake.registry.view().total("messages_rejected", source="spool") == 0
        filler.unlink()
        scan.join(60)
        assert not scan.is_alive(), "the intake did not resume once space returned"
        # One line when the pause began and one when it ended, however many refusals.
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "agent.ingest.spool_intake"]
        assert sum("spool intake paused" in m for m in lines) == 1, lines
        assert sum("spool intake resumed" in m for m in lines) == 1, lines
        assert not path.exists() and not claimed(intake.dirs[0], "big.ferry").exists()
        got = buffered(intake.store, "t")
        assert [m.record.value for m in got] == [r.value for r in records]  # once, in order
        view = intake.registry.view()
        assert view.total("messages_accepted", source="spool") == n
        assert view.total("spool_files_ingested") == 1
        assert view.total("messages_rejected", source="spool") == 0
        assert view.total("spool_intake_paused") == 0


class _DeafObserver:
    """A watchdog observer that never reports anything: inotify missed every event."""

    daemon = True

    def schedule(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


def test_the_periodic_rescan_finds_files_no_event_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agent.ingest.spool_intake as spool_intake

    monkeypatch.setattr(spool_intake, "Observer", _DeafObserver)
    config = FerryConfig(buffer=BufferConfig(path=tmp_path / "buffer", max_bytes=256 * MB),
                         spool=SpoolConfig(dirs=[tmp_path / "spool"],
                                           scan_interval_seconds=0.2))
    registry = Registry()
    store = Store(config.buffer.path, config.buffer.max_bytes, track=False)
    committer = Committer(store, registry=registry)
    committer.start()
    (tmp_path / "spool").mkdir()
    first = write_spool_file(tmp_path / "spool", "first.ferry", [SpoolRecord("t", b"first")])
    intake = SpoolIntake(Runtime(config, store, committer, registry))
    intake.start()
    try:
        # The scan at start takes the first file; once it is gone, only a later, timed
        # scan can find the next one (the observer hears nothing).
        wait_until(lambda: not first.exists(), timeout=20, message="the scan at start")
        late = write_spool_file(tmp_path / "spool", "late.ferry",
                                [SpoolRecord("t", b"found by the rescan")])
        wait_until(lambda: not late.exists(), timeout=20,
                   message="the file found without any file-system event")
        # Gone from its name once claimed, a moment before its batch is committed.
        wait_until(lambda: registry.view().total("spool_files_ingested") == 2,
                   message="the file ingested")
        assert [m.record.value for m in buffered(store, "t")] == [
            b"first", b"found by the rescan"]
    finally:
        intake.stop()
        committer.close()
        store.close()


def test_a_large_binary_file_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """The intake's reading streams block by block: a 40 MB file is read and encoded with
    far less memory than its size (the bound here is 10 MiB)."""
    import tracemalloc

    from spool.reader import BinarySpoolReader, open_spool_file

    # Written by the streaming writer from a generator, so the test itself stays small.
    path = write_spool_file(tmp_path, "big.ferry",
                            (SpoolRecord("t", b"%08d" % i + b"v" * 192) for i in range(200_000)))
    assert path.stat().st_size > 40 * 10**6
    tracemalloc.start()
    try:
        reader = open_spool_file(path)
        assert isinstance(reader, BinarySpoolReader)
        try:
            reader.verify()
            blocks = 0
            for _block in reader.iter_blocks(0, verify_first=False):
                blocks += 1  # each block dropped before the next is read
        finally:
            reader.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert blocks > 20  # the writer's ~1 MB blocks
    assert peak < 10 * MB, f"peak {peak / MB:.1f} MiB while reading a 40 MB file"


# -- files that once stopped the intake or lost records (found in review) ----------------------
def _hand_made(intake: SpoolIntake, topic: str, name: str | bytes, text: str) -> Path:
    folder = intake.dirs[0] / topic
    folder.mkdir(exist_ok=True)
    path = folder / (os.fsdecode(name) if isinstance(name, bytes) else name)
    path.write_text(text)
    _age(path)
    return path


def test_a_record_the_buffer_cannot_store_quarantines_its_file_and_the_rest_goes_on(
    tmp_path: Path,
) -> None:
    # A header name with a lone surrogate passes the reader but cannot be encoded: once,
    # the intake took the refusal for a full buffer and retried it for ever.
    with intake_only(tmp_path) as intake:
        bad = _hand_made(intake, "t", "a.jsonl", '{"value": "x", "headers": {"\\ud800": "v"}}\n')
        good = _hand_made(intake, "t", "b.txt", "fine\n")
        done: list[int] = []
        scan = threading.Thread(target=lambda: done.append(intake.scan_once()), daemon=True)
        scan.start()
        scan.join(30)
        assert done == [1], "the scan did not come back"
        assert not bad.exists() and not good.exists()
        assert (intake.dirs[0] / "quarantine" / "t" / "a.jsonl").exists()
        assert [m.record.value for m in buffered(intake.store, "t")] == [b"fine"]
        view = intake.registry.view()
        assert view.total("spool_files_quarantined", reason="unencodable") == 1
        # Under one word everywhere (agent/reasons.py), each with a sample for the page;
        # the one record counted once, not once per attempt.
        assert view.total("messages_rejected", source="spool", reason="unencodable") == 1
        assert all(r["source"] == "spool" for r in view.samples[("rejected", "unencodable")])
        (quarantined,) = view.samples[("quarantined", "unencodable")]
        assert quarantined["source"] == "spool"
        assert quarantined["file"].endswith("a.jsonl")


def test_a_file_name_that_is_not_utf8_is_ingested_and_stops_nothing(tmp_path: Path) -> None:
    with intake_only(tmp_path) as intake:
        latin1 = _hand_made(intake, "t", b"caf\xe9.txt", "from latin-1\n")
        later = place(intake, "later.ferry", [SpoolRecord("t", b"binary")], block_bytes=1000)
        assert intake.scan_once() == 2
        assert not latin1.exists() and not later.exists()
        assert sorted(m.record.value for m in buffered(intake.store, "t")) == [
            b"binary", b"from latin-1"]
        # The housekeeping reads such keys back too (it once decoded them as UTF-8).
        present = _hand_made(intake, "t", b"na\xefve.txt", "kept\n")
        intake.store.update_state({b"spool:0:t/" + b"gone-\xff.txt": b"{}"})
        intake._cleanup()  # noqa: SLF001 - what the intake thread runs every 10 minutes
        assert intake.store.state_items(b"spool:") == []
        assert present.exists()


def test_files_in_the_wrong_place_are_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with intake_only(tmp_path) as intake:
        root = intake.dirs[0]
        (root / "x.txt").write_text("no topic\n")
        (root / "t").mkdir()
        (root / "t" / "data.csv").write_text("a,b\n")
        with caplog.at_level("WARNING", logger="agent.ingest.spool_intake"):
            intake.scan_once()
            intake.scan_once()
        assert intake.registry.view().total("spool_files_unrecognized") == 2
        warned = [r.getMessage() for r in caplog.records if "not where Ferry reads" in
                  r.getMessage()]
        assert len(warned) == 2
        assert (root / "x.txt").exists() and (root / "t" / "data.csv").exists()


def test_a_file_the_agent_cannot_claim_is_reported_once_and_read_once_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file in a directory the agent may not write (a topic directory made with umask 022)
    cannot be claimed, so it is not read at all (it could not be removed afterwards): logged
    once at ERROR, counted, the other files go on; read once the permissions are fixed."""
    with intake_only(tmp_path) as intake:
        stuck = _hand_made(intake, "t", "x.txt", "once\n")
        rename = os.rename

        def refuse(src: Any, dst: Any) -> None:
            if Path(src) == stuck:
                raise PermissionError(13, "Permission denied", str(src))
            rename(src, dst)

        monkeypatch.setattr(os, "rename", refuse)
        with caplog.at_level("ERROR", logger="agent.ingest.spool_intake"):
            assert intake.scan_once() == 0
            later = place(intake, "later.ferry", [SpoolRecord("t", b"later")], block_bytes=1000)
            assert intake.scan_once() == 1  # the stuck file again (refused), then the new one
        assert stuck.exists() and not later.exists()
        assert [m.record.value for m in buffered(intake.store, "t")] == [b"later"]
        assert intake.registry.view().total("spool_files_failed", reason="unremovable") == 1
        errors = [r for r in caplog.records if "cannot be claimed" in r.getMessage()]
        assert len(errors) == 1
        monkeypatch.setattr(os, "rename", rename)  # someone fixes the permissions
        assert intake.scan_once() == 1
        assert not stuck.exists()
        assert sorted(m.record.value for m in buffered(intake.store, "t")) == [b"later", b"once"]


def test_a_second_bad_file_of_the_same_name_does_not_replace_the_first_in_quarantine(
    tmp_path: Path,
) -> None:
    with intake_only(tmp_path) as intake:
        quarantine = intake.dirs[0] / "quarantine" / "t"
        for day in (1, 2):
            _hand_made(intake, "t", "daily.jsonl", f'{{"value": "day {day}"}}\n{{not json\n')
            intake.scan_once()
        kept = sorted(p.name for p in quarantine.iterdir())
        assert kept == ["daily.jsonl", "daily.jsonl.1", "daily.jsonl.1.reason",
                        "daily.jsonl.reason"]
        assert "day 1" in (quarantine / "daily.jsonl").read_text()
        assert "day 2" in (quarantine / "daily.jsonl.1").read_text()


def test_a_hand_made_file_rewritten_while_read_is_quarantined_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spool import reader as spool_reader

    with intake_only(tmp_path) as intake:
        path = _hand_made(intake, "t", "x.txt", "a\nb\nc\nd\ne\n")
        verify = spool_reader._LinesReader.verify

        def then_rewritten(self: Any, *, deep: bool = False) -> int:
            count = verify(self, deep=deep)
            # A writer truncating and rewriting in place the file it still has open (the
            # agent claimed it meanwhile: same inode, now under .ingesting/).
            self.path.write_text("a\n")
            return count

        monkeypatch.setattr(spool_reader._LinesReader, "verify", then_rewritten)
        assert intake.scan_once() == 0
        assert not path.exists()
        reason = (intake.dirs[0] / "quarantine" / "t" / "x.txt.reason").read_text()
        assert "changed while being read" in reason


# -- what the intake keeps does not grow with the files that pass -----------------------------
def _counting_scans(intake: SpoolIntake) -> list[float]:
    """The times (monotonic) at which the intake's thread began a scan, from now on."""
    scans: list[float] = []
    scan_once = intake.scan_once

    def counted() -> int:
        scans.append(time.monotonic())
        return scan_once()

    intake.scan_once = counted  # type: ignore[method-assign]
    return scans


def test_a_burst_of_settling_hand_made_files_starts_no_thread_per_file(tmp_path: Path) -> None:
    """Hand-made files are left alone while they may still be being written (changed less
    than SETTLE_SECONDS ago) and looked at again once they settle. 1,000 of them dropped at
    once into a running intake keep its thread count where it was over several scans (a
    timer thread per file per scan once started a thousand threads a scan), and every one
    is ingested once settled."""
    n = 1000
    with intake_only(tmp_path, scan_interval_seconds=0.2) as intake:
        scans = _counting_scans(intake)
        intake.start()
        wait_until(lambda: scans, message="the scan at start")
        baseline = threading.active_count()
        # Written out of the intake's sight (a hidden directory), all marked changed now,
        # then shown at once: all fresh together, whatever the pace of the writes.
        hidden = intake.dirs[0] / ".t"
        hidden.mkdir()
        files = [hidden / f"f{i:04d}.txt" for i in range(n)]
        for i, path in enumerate(files):
            path.write_text(f"line {i}\n")
        for path in files:
            os.utime(path)
        folder = intake.dirs[0] / "t"
        burst_at = time.monotonic()
        os.rename(hidden, folder)
        peak = baseline

        def all_ingested() -> bool:
            nonlocal peak
            peak = max(peak, threading.active_count())
            return intake.registry.view().total("spool_files_ingested") == n

        wait_until(all_ingested, timeout=120, interval=0.02, message="all files ingested")
        assert peak <= baseline + 3, f"{peak} threads at the peak, {baseline} before the burst"
        # The scans that found the files fresh (every 0.2 s, and on file events) and the
        # ones that took them.
        settling_scans = sum(1 for t in scans if t >= burst_at)
        assert settling_scans >= 3, f"only {settling_scans} scans since the burst began"
        assert not any(folder.iterdir())
        values = sorted(m.record.value for m in buffered(intake.store, "t"))
        assert values == sorted(b"line %d" % i for i in range(n))


def test_a_settling_file_is_read_once_settled_not_at_the_next_periodic_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intake's own wait ends when a file left to settle is due: with no file-system
    event to wake it and a minute between periodic scans, a fresh hand-made file is read
    within seconds, and not before SETTLE_SECONDS since its last change."""
    import agent.ingest.spool_intake as spool_intake

    monkeypatch.setattr(spool_intake, "Observer", _DeafObserver)
    with intake_only(tmp_path, scan_interval_seconds=60) as intake:
        scans = _counting_scans(intake)
        intake.start()
        wait_until(lambda: scans, message="the scan at start")
        path = intake.dirs[0] / "t" / "fresh.txt"
        path.parent.mkdir()
        path.write_text("fresh\n")
        changed = path.stat().st_mtime
        intake.wake()  # one scan finds it fresh; only the settle deadline brings the next
        wait_until(lambda: not path.exists(), timeout=20, interval=0.01,
                   message="the settled file claimed before the next periodic scan")
        assert time.time() - changed >= spool_intake.SETTLE_SECONDS
        wait_until(lambda: intake.registry.view().total("spool_files_ingested") == 1,
                   message="the file ingested")
        assert [m.record.value for m in buffered(intake.store, "t")] == [b"fresh"]
        assert len(scans) <= 4  # a scan at start, the woken one, the one at the deadline


def test_failures_of_files_that_are_gone_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What the intake remembers of failed files (to count and log each once) is bounded by
    the files present: 2,000 files that could not be claimed, then removed by their owner,
    leave nothing behind. A failing file that stays is still logged once, and a new file
    made under a gone one's name is counted and logged as the new file it is."""
    n = 2000
    with intake_only(tmp_path) as intake:
        folder = intake.dirs[0] / "t"
        gone = [_hand_made(intake, "t", f"f{i:04d}.txt", f"line {i}\n") for i in range(n)]
        stays = _hand_made(intake, "t", "stays.txt", "stays\n")
        rename = os.rename

        def refuse(src: Any, dst: Any) -> None:
            if Path(src).parent == folder:  # a topic directory the agent may not write
                raise PermissionError(13, "Permission denied", str(src))
            rename(src, dst)

        monkeypatch.setattr(os, "rename", refuse)
        with caplog.at_level("ERROR", logger="agent.ingest.spool_intake"):
            assert intake.scan_once() == 0
            assert len(intake._reported) == n + 1  # noqa: SLF001 - the growth at stake
            for path in gone:
                path.unlink()
            assert intake.scan_once() == 0
            assert intake._reported == {(stays, "unremovable")}  # noqa: SLF001
            again = _hand_made(intake, "t", "f0000.txt", "a new file, refused too\n")
            for _ in range(3):
                assert intake.scan_once() == 0
        logged = collections.Counter(r.args[0] for r in caplog.records  # type: ignore[index]
                                     if "cannot be claimed" in r.getMessage())
        assert logged[stays] == 1
        assert logged[again] == 2  # the first file of that name, then the new one
        assert len(logged) == n + 1
        failed = intake.registry.view().total("spool_files_failed", reason="unremovable")
        assert failed == n + 2
        assert stays.exists() and again.exists()


# -- what a Kafka topic can never take -----------------------------------------------------
# The forwarder publishes each topic's limits (agent/signals/limits.py); written here before
# the first scan, as the forwarder would. "small" takes batches of at most LIMIT bytes and
# timestamps at most a minute ahead; "other" has no limits known, and takes everything.
LIMIT = 10_000
FITS = 9_928  # with compression "none": exactly LIMIT bytes as a batch of one (61 + 11)
HOUR = 3_600_000


def _limits(intake: SpoolIntake, compression: str = "none") -> None:
    LimitsPublisher(limits_file_path(intake.runtime.config.buffer.path), compression).publish(
        {"small": Limit(LIMIT, None, 60_000)})


def _refused(intake: SpoolIntake, reason: str) -> float:
    return intake.registry.view().total("messages_rejected", source="spool", reason=reason)


def test_hand_made_records_a_topic_can_never_take_are_counted_and_the_rest_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = int(time.time() * 1000)
    lines = [
        ({"value": "first"}, True),
        ({"value": "x" * FITS}, True),  # at the limit: never refused
        ({"value": "y" * (FITS + 1)}, False),  # one byte over
        ({"value": "z" * 2000, "headers": {"h": "v" * 9000}}, False),  # its header counts
        ({"value": "future", "timestamp": now + 2 * HOUR}, False),  # the topic takes 60 s
        ({"value": "past", "timestamp": now - 2 * HOUR}, True),  # no before.max.ms
        ({"value": "no time", "timestamp": 0}, True),  # stamped at intake
        ({"value": "last"}, True),
    ]
    with intake_only(tmp_path) as intake:
        _limits(intake)
        path = _hand_made(intake, "small", "mixed.jsonl",
                          "".join(json.dumps(doc) + "\n" for doc, _ in lines))
        other = _hand_made(intake, "other", "big.txt", "o" * 20_000 + "\n")  # no limits
        with caplog.at_level(logging.WARNING, logger="agent.ingest.spool_intake"):
            assert intake.scan_once() == 2
        assert not path.exists() and not other.exists()
        assert not (intake.dirs[0] / "quarantine").exists()
        assert [m.record.value for m in buffered(intake.store, "small")] == [
            doc["value"].encode() for doc, ok in lines if ok]
        assert [len(m.record.value) for m in buffered(intake.store, "other")] == [20_000]
        assert _refused(intake, "too_large_for_topic") == 2
        assert _refused(intake, "timestamp_out_of_range") == 1
        view = intake.registry.view()
        assert view.total("spool_files_ingested") == 2
        assert view.total("spool_files_quarantined") == 0
        (sample, *_) = view.samples[("rejected", "too_large_for_topic")]
        assert sample["source"] == "spool" and sample["topic"] == "small"
        assert sample["file"].endswith("mixed.jsonl") and sample["record"] == 2
        assert "max.message.bytes=10000" in sample["detail"]
        logged = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
        assert any("mixed.jsonl" in m and "'small'" in m and "timestamp_out_of_range" in m
                   for m in logged), logged


def _bulk_records(now: int) -> list[tuple[SpoolRecord, bool]]:
    """Records for a binary file, each with whether it is stored: refused ones in the middle
    of blocks, in blocks the bulk encoder takes and in blocks it declines (headers)."""
    out: list[tuple[SpoolRecord, bool]] = []
    for i in range(40):
        out.append((SpoolRecord("small", b"s-%d" % i, timestamp_ms=now), True))
        out.append((SpoolRecord("other", b"o-%d" % i), True))
        if i == 5:
            out.append((SpoolRecord("small", b"x" * FITS), True))  # at the limit
            out.append((SpoolRecord("small", b"y" * (FITS + 1)), False))
            out.append((SpoolRecord("other", b"o" * 20_000), True))  # no limits
        if i == 11:
            out.append((SpoolRecord("small", b"k" * (FITS - 1), key=b"kk"), False))
        if i == 17:
            out.append((SpoolRecord("small", b"future", timestamp_ms=now + 2 * HOUR), False))
            out.append((SpoolRecord("other", b"future", timestamp_ms=now + 2 * HOUR), True))
            out.append((SpoolRecord("small", b"old", timestamp_ms=now - 2 * HOUR), True))
        if i == 23:
            out.append((SpoolRecord("small", b"h" * 9_000, headers=(("h", b"v" * 1000),)),
                        False))
            out.append((SpoolRecord("small", b"with a header", headers=(("h", b"v"),)),
                        True))
    return out


@pytest.mark.parametrize("block_bytes", [1 << 20, 30_000, 300])
def test_binary_records_a_topic_can_never_take_are_counted_and_the_rest_stored(
    tmp_path: Path, block_bytes: int
) -> None:
    now = int(time.time() * 1000)
    records = _bulk_records(now)
    with intake_only(tmp_path) as intake:
        _limits(intake)
        path = place(intake, "mixed.ferry", [r for r, _ in records], block_bytes=block_bytes)
        assert intake.scan_once() == 1
        assert not path.exists() and not (intake.dirs[0] / "quarantine").exists()
        for topic in ("small", "other"):
            assert [m.record.value for m in buffered(intake.store, topic)] == [
                r.value for r, ok in records if ok and r.topic == topic]
        assert _refused(intake, "too_large_for_topic") == 3
        assert _refused(intake, "timestamp_out_of_range") == 1
        view = intake.registry.view()
        assert view.total("messages_accepted", source="spool") == sum(
            ok for _, ok in records)
        assert view.total("spool_files_ingested") == 1
        # Finished as a whole file: its progress done, its content remembered.
        assert intake.store.state_items(b"spool:") == []
        assert len(intake.store.state_items(b"spool-seen:")) == 1
        samples = view.samples[("rejected", "timestamp_out_of_range")]
        assert [(s["file"].endswith("mixed.ferry"), s["topic"]) for s in samples] == [
            (True, "small")]


def test_refused_binary_records_across_batch_cuts_keep_the_progress_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Alternating topics, byte-capped batches: blocks are cut between batches, and refused
    # records fall before, inside and after the cuts; the file's last records are refused.
    # Every 37th record is over the limit: refused on "small", stored on "other".
    records = [(SpoolRecord("small" if i % 2 else "other",
                            b"%04d" % i + b"r" * (LIMIT + 500 if i % 37 == 1 else 996)),
                not (i % 37 == 1 and i % 2)) for i in range(1500)]
    records += [(SpoolRecord("small", b"z" * LIMIT), False) for _ in range(3)]
    docs: list[dict[str, Any]] = []
    with intake_only(tmp_path, max_bytes=4 * MB) as intake:
        _limits(intake, "lz4")
        store = intake.store
        real = store.append_encoded

        def spy(runs: Any, **kw: Any) -> int:
            docs.append(json.loads(kw["state_puts"][b"spool:0:cut.ferry"]))
            return real(runs, **kw)

        monkeypatch.setattr(store, "append_encoded", spy)
        # Incompressible: lz4 cannot bring the refused ones under the limit either.
        records = [(r._replace(value=r.value[:4] + os.urandom(len(r.value) - 4)), ok)
                   for r, ok in records]
        place(intake, "cut.ferry", [r for r, _ in records], block_bytes=100_000)
        assert intake.scan_once() == 1
        for topic in ("small", "other"):
            assert [m.record.value for m in buffered(store, topic)] == [
                r.value for r, ok in records if ok and r.topic == topic]
        assert _refused(intake, "too_large_for_topic") == sum(not ok for _, ok in records)
    nexts = [doc["next"] for doc in docs]
    assert len(docs) > 3 and nexts == sorted(set(nexts))
    assert nexts[-1] == len(records) and docs[-1]["done"]


@pytest.mark.parametrize("kind", ["ferry", "txt"])
def test_a_file_whose_every_record_is_refused_is_finished_not_quarantined(
    tmp_path: Path, kind: str
) -> None:
    with intake_only(tmp_path) as intake:
        _limits(intake)
        if kind == "ferry":
            path = place(intake, "all.ferry", [SpoolRecord("small", b"a" * 12_000)] * 2,
                         block_bytes=1 << 20)
        else:
            path = _hand_made(intake, "small", "all.txt", ("a" * 12_000 + "\n") * 2)
        assert intake.scan_once() == 1
        assert not path.exists() and not (intake.dirs[0] / "quarantine").exists()
        assert intake.store.topic_stats() == []
        assert _refused(intake, "too_large_for_topic") == 2
        assert intake.store.state_items(b"spool:") == []
        assert len(intake.store.state_items(b"spool-seen:")) == (kind == "ferry")
        # The same name again (a retried task) is known: nothing counted a second time.
        if kind == "ferry":
            place(intake, "all.ferry", [SpoolRecord("small", b"a" * 12_000)] * 2,
                  block_bytes=1 << 20)
            assert intake.scan_once() == 1
            assert _refused(intake, "too_large_for_topic") == 2


def test_a_resumed_file_counts_each_refused_record_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 50,000 records in blocks of more than a batch: three batches; the intake stops after
    # the first, a new one finishes. The last record is refused too.
    records = [SpoolRecord("small", b"y" * 11_000 if i % 5000 == 7 or i == 49_999
                           else b"s-%d" % i) for i in range(50_000)]
    with intake_only(tmp_path, max_bytes=512 * MB) as intake:
        _limits(intake)
        store = intake.store
        real = store.append_encoded

        def stop_after_first_batch(runs: Any, **kw: Any) -> int:
            stored = real(runs, **kw)
            intake._stop.set()  # noqa: SLF001 - what stop() does, without joining threads
            return stored

        monkeypatch.setattr(store, "append_encoded", stop_after_first_batch)
        place(intake, "long.ferry", records, block_bytes=1 << 20)
        assert intake.scan_once() == 0
        first = _refused(intake, "too_large_for_topic")
        assert 0 < first < 11
        monkeypatch.setattr(store, "append_encoded", real)
        again = SpoolIntake(intake.runtime)
        try:
            assert again.scan_once() == 1
        finally:
            again.stop()
        assert _refused(intake, "too_large_for_topic") == 11
        assert [m.record.value for m in buffered(store, "small")] == [
            r.value for r in records if len(r.value) < LIMIT]
        assert len(store.state_items(b"spool-seen:")) == 1  # its progress reached "done"


# -- a file replaced while the agent ingests it ----------------------------------------------
# A writer that rewrites a name (os.replace, as a retried Spark task or a script does) at each
# stage of the agent's work on the file. The agent reads and removes only the file it claimed,
# so the replacement is a new file, read in its turn; nothing is removed unread.
STAGES = ("before_claim", "after_verify", "mid_read", "after_last_commit", "during_unlink")


def _versions(kind: str) -> tuple[list[bytes], list[bytes]]:
    """The first and the second content written under one name. Binary files are what a
    retried task writes (its first, failed attempt published a prefix of the rows); the
    hand-made ones are two different files."""
    if kind == "ferry":
        rows = [b"row-%06d" % i for i in range(45_000)]  # three batches of 20,000
        return rows[:25_000], rows
    first = [b"old-%06d" % i for i in range(45_000)]
    return first, [b"new-%06d" % i for i in range(30_000)]


def _write_version(folder: Path, name: str, values: list[bytes], kind: str) -> None:
    tmp = folder / f".{name}.tmp"
    if kind == "ferry":
        tmp.write_bytes(encode_file([SpoolRecord("t", v, timestamp_ms=1) for v in values],
                                    block_bytes=64 * 1024))
    elif kind == "jsonl":
        tmp.write_text("".join(json.dumps({"value": v.decode()}) + "\n" for v in values))
    else:
        tmp.write_bytes(b"".join(v + b"\n" for v in values))
    _age(tmp)
    os.replace(tmp, folder / name)


@pytest.mark.parametrize("kind", ["ferry", "jsonl", "txt"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_file_replaced_at_any_stage_of_its_intake_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, stage: str
) -> None:
    first, second = _versions(kind)
    name = f"data.{kind}"
    with intake_only(tmp_path) as intake:
        folder = intake.dirs[0] / "t"
        folder.mkdir()
        _write_version(folder, name, first, kind)
        replaced = threading.Event()

        def replace() -> None:
            if not replaced.is_set():
                replaced.set()
                _write_version(folder, name, second, kind)

        if stage == "before_claim":
            real_claim = SpoolIntake._claim

            def claim(self: SpoolIntake, root: Path, path: Path) -> Path | None:
                replace()
                return real_claim(self, root, path)

            monkeypatch.setattr(SpoolIntake, "_claim", claim)
        elif stage == "after_verify":
            from spool import reader as spool_reader

            for cls, method in ((spool_reader.BinarySpoolReader, "fingerprint"),
                                (spool_reader._LinesReader, "verify")):
                real = getattr(cls, method)

                def checked(self: Any, *a: Any, _real: Any = real, **kw: Any) -> Any:
                    result = _real(self, *a, **kw)
                    replace()
                    return result

                monkeypatch.setattr(cls, method, checked)
        elif stage == "mid_read":
            from agent.ingest.spool_progress import Progress

            real_puts = Progress.puts

            def puts(self: Any, next_index: int) -> dict[bytes, bytes]:
                if 0 < next_index < self.count:
                    replace()  # between the file's first batch and its last
                return real_puts(self, next_index)

            monkeypatch.setattr(Progress, "puts", puts)
        elif stage == "after_last_commit":
            real_finish = SpoolIntake._finish

            def finish(self: SpoolIntake, root: Path, path: Path, key: bytes | None) -> bool:
                replace()
                return real_finish(self, root, path, key)

            monkeypatch.setattr(SpoolIntake, "_finish", finish)
        else:
            real_unlink = Path.unlink

            def unlink(self: Path, missing_ok: bool = False) -> None:
                if self.name == name:
                    replace()
                real_unlink(self, missing_ok)

            monkeypatch.setattr(Path, "unlink", unlink)

        intake.scan_once()
        assert replaced.is_set(), "the replacement was not made at its stage"
        while intake.scan_once():  # the replacement, in its turn
            pass
        assert not (folder / name).exists()
        assert not claimed(intake.dirs[0], f"t/{name}").exists()
        got = collections.Counter(m.record.value for m in buffered(intake.store, "t"))
        view = intake.registry.view()
    if kind == "ferry":
        # The second file extends the first: every row once, whenever it was replaced.
        assert got == collections.Counter(second)
        if stage != "before_claim":
            assert view.total("spool_files_extended") == 1
            assert view.total("spool_records_skipped", reason="extension") == len(first)
    elif stage == "before_claim":
        # Replaced before the agent took it: the writer's own replace discarded the first
        # file, which the agent never had; the second is ingested whole.
        assert got == collections.Counter(second)
    else:
        assert got == collections.Counter(first + second)
    assert view.total("spool_files_diverged") == 0
    assert view.total("spool_files_quarantined") == 0


def test_retried_tasks_republishing_files_while_the_agent_reads_them_reach_kafka_once(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    """What a Spark job with failing tasks does to a spool directory (per-node agents, the
    writer's publish="task" mode): each partition's first attempt publishes a prefix of its
    rows (its input ended early because Python upstream of the writer raised), and its retry
    replaces the name with the whole partition, here the moment the agent has claimed the
    prefix and is reading it. Every row reaches Kafka exactly once."""
    names, rows_per_file = 5, 30_000
    expected: list[bytes] = []
    with spool_agent(tmp_path, session_broker.bootstrap) as agent:
        spool = _spool(agent)
        for f in range(names):
            rows = [b"p%d-row-%06d" % (f, i) for i in range(rows_per_file)]
            expected += rows
            cut = rows_per_file // (f + 2)
            name = f"spark-job-{f:05d}.ferry"
            write_spool_file(spool, name, [SpoolRecord(unique_topic, v) for v in rows[:cut]],
                             replace=True)
            agent.stages[-1].wake()  # type: ignore[attr-defined]
            wait_until(lambda name=name: not (spool / name).exists(), timeout=30,
                       interval=0.001, message="the agent claims the failed attempt's file")
            write_spool_file(spool, name, [SpoolRecord(unique_topic, v) for v in rows],
                             replace=True)
        agent.stages[-1].wake()  # type: ignore[attr-defined]
        got = consume_all(session_broker.bootstrap, unique_topic, len(expected), timeout=120)
        wait_until(lambda: not agent.store.topic_stats(), message="buffer drained")
        wait_until(lambda: not any(spool.rglob("*.ferry")), message="files removed")
        view = agent.registry.view()
    got = read_topic(session_broker.bootstrap, unique_topic, timeout=60)
    counts = collections.Counter(m.value for m in got)
    lost = set(expected) - set(counts)
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    assert (len(lost), duplicated) == (0, 0), f"lost {len(lost)}, duplicated {duplicated}"
    assert len(got) == len(expected)
    assert view.total("spool_files_extended") + view.total("spool_files_duplicate") == names
    assert view.total("spool_files_diverged") == 0
