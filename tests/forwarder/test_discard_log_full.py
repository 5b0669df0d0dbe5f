"""The discard log when it cannot take more: at buffer.discard_log_max_bytes, on a full
filesystem, after a crash in the middle of a line. It never holds a broken line, its
messages wait in the buffer rather than being lost, and deliveries go on meanwhile
(issue 23)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from agent.config import TopicConfig
from agent.forwarder import reading
from agent.forwarder.discard_log import Discard, DiscardLog, DiscardLogFull, read_discards
from agent.records import Record
from tests.forwarder.fakes import Acking, FakeCluster, Setup, run_until


def discard(value: bytes) -> Discard:
    return Discard("ttl", "t", "00" * 12, 1, Record("t", value))


def test_at_its_size_limit_the_log_refuses_whole_writes(tmp_path: Path) -> None:
    log = DiscardLog(tmp_path / "d.jsonl", max_bytes=2000)
    written = 0
    with pytest.raises(DiscardLogFull, match="discard_log_max_bytes = 2000"):
        for i in range(100):
            log.write([discard(b"%03d" % i + b"x" * 100)])
            written += 1
    assert 0 < written < 100
    size = log.path.stat().st_size
    assert size <= 2000
    with pytest.raises(DiscardLogFull):
        log.write([discard(b"more")])
    assert log.path.stat().st_size == size  # nothing of a refused write
    assert len(list(read_discards(log.path))) == written
    # Moved away by an operator (after `ferry replay`): room again.
    log.path.rename(tmp_path / "d.jsonl.1")
    log.write([discard(b"after")])
    assert [r.value for _, r in read_discards(log.path)] == [b"after"]


def test_a_line_cut_short_by_a_crash_is_cut_off_before_the_next_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "d.jsonl"
    DiscardLog(path).write([discard(b"first")])
    with path.open("ab") as f:
        f.write(b'{"reason":"ttl","topic":"t","value":"aGFsZiB3cml0')  # the process died
    caplog.set_level(logging.WARNING)
    DiscardLog(path).write([discard(b"second")])  # the restarted forwarder
    assert [r.value for _, r in read_discards(path)] == [b"first", b"second"]
    assert "cut a partial last line" in caplog.text


def test_a_real_full_filesystem_leaves_no_fragment(small_disk: Path) -> None:
    log = DiscardLog(small_disk / "d.jsonl")
    log.write([discard(b"first")])
    filler = small_disk / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (1024 * 1024, 4096):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    big = [discard(os.urandom(3000)) for _ in range(20)]  # ~80 KB: more than any slack
    with pytest.raises(OSError) as refused:
        log.write(big)
    assert refused.value.errno == errno.ENOSPC
    assert [r.value for _, r in read_discards(log.path)] == [b"first"]
    filler.unlink()
    log.write(big)
    assert len(list(read_discards(log.path))) == 21


def test_deliveries_go_on_while_the_discard_log_refuses_and_discards_wait_in_the_buffer(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    fwd = setup.forwarder({"local": Acking()},
                          lambda t: TopicConfig(max_message_bytes=10 if t == "big" else 1000))
    fwd.leaving.discard_log = DiscardLog(setup.discards, max_bytes=1)  # refuses every line
    setup.store.append([[Record("big", b"x" * 100) for _ in range(300)]])  # too large
    setup.store.append([[Record("ok", b"y") for _ in range(3000)]])
    run_until(fwd, lambda: {s.topic for s in setup.store.topic_stats()} == {"big"},
              "every deliverable message delivered and removed")
    stats = {s.topic: s.messages for s in setup.store.topic_stats()}
    assert stats == {"big": 300}, "the discards wait in the buffer, not lost"
    assert fwd.registry.view().total("messages_delivered", topic="ok") == 3000
    assert not setup.discards.exists() or setup.discards.stat().st_size == 0
    # Logged when it started failing, not per attempt.
    for _ in range(3000):
        fwd.step()
    failing = [r for r in caplog.records if "writing the discard log failed" in r.getMessage()]
    assert len(failing) == 1, caplog.text
    # Room in the log again (an operator moved it): the discards leave, logged once each.
    fwd.leaving.discard_log = DiscardLog(setup.discards)
    run_until(fwd, lambda: not setup.store.topic_stats(), "the discards to leave")
    assert setup.discard_reasons() == ["too_large"] * 300
    assert "writing the discard log works again" in caplog.text


def test_held_discards_are_bounded(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the log refuses, no more than MAX_HELD_DISCARDS wait in memory: reading stops
    (the rest stays in the buffer) until they can leave."""
    monkeypatch.setattr(reading, "MAX_HELD_DISCARDS", 500)
    fwd = setup.forwarder({"local": FakeCluster()}, lambda t: TopicConfig(max_message_bytes=10))
    fwd.leaving.discard_log = DiscardLog(setup.discards, max_bytes=1)
    setup.store.append([[Record("big", b"x" * 100) for _ in range(5000)]])
    for _ in range(2000):
        fwd.step()
        assert len(fwd.leaving.discards()) < 500 + 2000  # at most one read past the bound
    assert setup.store.topic_stats()[0].messages == 5000
    fwd.leaving.discard_log = DiscardLog(setup.discards)
    run_until(fwd, lambda: not setup.store.topic_stats(), "the discards to leave")
    assert len(setup.discard_reasons()) == 5000
