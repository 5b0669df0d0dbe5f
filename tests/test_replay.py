"""`ferry replay` puts each discarded message back once, however often it is run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.buffer import keys
from agent.buffer.store import Store, StoredMessage
from agent.cli import replay as replay_module
from agent.cli.main import main
from agent.cli.replay import COUNT, INDEX, PREFIX, REMEMBER_DAYS, _ReplayLock, limit, prune
from agent.cli.replay import replay as run_replay
from agent.config import FerryConfig, load_config
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.records import REPLAYED, Record
from tests.agent_harness import REPO_ROOT, write_config
from tests.waiting import wait_until

TOPIC = "orders"
DAY_MS = 86_400_000


def discard(value: bytes, seq: int, *, topic: str = TOPIC, reason: str = "ttl") -> Discard:
    """A discard as the forwarder writes it: the message's buffer id is its identity."""
    accepted = 1_700_000_000_000 + seq // 100
    return Discard(reason=reason, topic=topic, message_id=keys.id_text(keys.make_id(accepted, seq)),
                   accepted_ms=accepted, record=Record(topic, value, key=b"k", timestamp_ms=seq),
                   attempts=2, detail="expired")


def discard_log(path: Path, values: list[bytes]) -> Path:
    DiscardLog(path).write([discard(v, i) for i, v in enumerate(values)])
    return path


def replay(cfg: Path, file: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["replay", str(file), "--config", str(cfg)])
    out = capsys.readouterr()
    return code, out.out + out.err


def replay_at(config: FerryConfig, file: Path, now: float) -> int:
    """``ferry replay`` as run at ``now`` (seconds): the days it remembers by."""
    return run_replay(config, file, clock=lambda: now)


def buffered(cfg: Path, topic: str = TOPIC) -> list[bytes]:
    config = load_config(cfg)
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        got = store.read(topic, None, 1_000_000)
    assert all(isinstance(m, StoredMessage) for m in got)
    return [m.record.value for m in got if isinstance(m, StoredMessage)]


def replayed_total(cfg: Path, topic: str = TOPIC) -> int:
    """What the daemon reports as messages_accepted{source="replay"} for ``topic``."""
    config = load_config(cfg)
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        return int(store.get_state(REPLAYED + topic.encode()) or b"0")


def test_a_second_run_of_the_same_file_puts_nothing_back_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    values = [b"m%d" % i for i in range(7)]
    log = discard_log(tmp_path / "d.jsonl", values)

    assert replay(cfg, log, capsys) == (0, f"replayed 7 messages from {log} (7 lines)\n")
    code, out = replay(cfg, log, capsys)
    assert code == 0
    assert out == f"replayed 0 messages from {log} (7 lines; 7 already replayed before, skipped)\n"
    assert buffered(cfg) == values
    assert replayed_total(cfg) == 7  # skipped lines are not counted as accepted


def test_a_grown_file_puts_back_only_its_new_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The live discard log is replayed, then more is discarded to it and it is replayed again.
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(b"a", 1), discard(b"b", 2)])
    assert replay(cfg, log.path, capsys)[0] == 0
    log.write([discard(b"c", 3)])
    assert replay(cfg, log.path, capsys) == (
        0, f"replayed 1 messages from {log.path} (3 lines; 2 already replayed before, skipped)\n")
    assert buffered(cfg) == [b"a", b"b", b"c"]
    assert replayed_total(cfg) == 3


def test_a_run_stopped_by_a_full_buffer_resumes_without_doubling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False, buffer={"max_bytes": 1024 * 1024})
    config = load_config(cfg)
    # Another topic takes most of the buffer: room for the first batch of the file, not all.
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        store.append([[Record("filler", b"f" * 500) for _ in range(750)]])
    values = [b"%06d" % i + b"v" * 20 for i in range(12_000)]
    log = discard_log(tmp_path / "d.jsonl", values)

    code, out = replay(cfg, log, capsys)
    assert code == 1
    assert "buffer" in out and "run it again once there is room" in out
    first = buffered(cfg)
    assert 0 < len(first) < len(values)  # stopped half-way: the case to resume
    assert first == values[:len(first)]

    assert main(["buffer", "--config", str(cfg), "purge", "filler", "--yes"]) == 0
    capsys.readouterr()
    code, out = replay(cfg, log, capsys)
    assert code == 0, out
    assert out == (f"replayed {len(values) - len(first)} messages from {log} (12000 lines; "
                   f"{len(first)} already replayed before, skipped)\n")
    assert buffered(cfg) == values  # every message once, in the file's order
    assert replayed_total(cfg) == len(values)


def test_two_different_discards_alike_are_both_put_back_and_one_discarded_twice_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = DiscardLog(tmp_path / "d.jsonl")
    # Two messages with the same content and timestamp, but two buffer ids: both were sent.
    twin_a = discard(b"same", 5)
    twin_b = Discard(twin_a.reason, TOPIC, keys.id_text(keys.make_id(1_700_000_000_000, 6)),
                     twin_a.accepted_ms, twin_a.record, attempts=2)
    # One message discarded, then (after a crash before its delete) discarded again: another
    # reason, attempt count and time on its second line, the same id and content.
    once = discard(b"once", 7)
    again = Discard("max_attempts", TOPIC, once.message_id, once.accepted_ms, once.record,
                    attempts=9, detail="gave up")
    log.write([twin_a, twin_b, once])
    log.write([again])

    code, out = replay(cfg, log.path, capsys)
    assert code == 0
    assert out == (f"replayed 3 messages from {log.path} (4 lines; 1 repeating an earlier line "
                   "of the file (one message discarded twice), put back once)\n")
    assert buffered(cfg) == [b"same", b"same", b"once"]
    assert replayed_total(cfg) == 3


def test_the_same_message_in_another_file_is_not_put_back_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An operator splits the log by topic and replays the part, then the whole.
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(b"a", 1), discard(b"x", 2, topic="other"), discard(b"b", 3)])
    part = tmp_path / "orders.jsonl"
    part.write_text("".join(line + "\n" for line in log.path.read_text().splitlines()
                            if json.loads(line)["topic"] == TOPIC))
    assert replay(cfg, part, capsys)[0] == 0
    assert replay(cfg, log.path, capsys) == (
        0, f"replayed 1 messages from {log.path} (3 lines; 2 already replayed before, skipped)\n")
    assert buffered(cfg) == [b"a", b"b"]
    assert buffered(cfg, "other") == [b"x"]


def test_a_rewritten_line_is_still_the_message_already_put_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tool that rewrites the JSON without changing what it says (jq, another serialiser):
    # keys in another order, other spacing. The message must not go back a second time.
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = DiscardLog(tmp_path / "d.jsonl")
    log.write([discard(b"a", 1), discard(b"b", 2)])
    assert replay(cfg, log.path, capsys)[0] == 0
    rewritten = tmp_path / "rewritten.jsonl"
    rewritten.write_text("".join(
        json.dumps(dict(reversed(list(json.loads(line).items()))), indent=None,
                   separators=(", ", " : ")) + "\n"
        for line in log.path.read_text().splitlines()))
    assert rewritten.read_text() != log.path.read_text()
    assert replay(cfg, rewritten, capsys) == (
        0, f"replayed 0 messages from {rewritten} (2 lines; 2 already replayed before, "
           "skipped)\n")
    assert buffered(cfg) == [b"a", b"b"]


def test_a_bad_line_still_refuses_the_whole_file_and_remembers_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    good = discard_log(tmp_path / "d.jsonl", [b"a", b"b"])
    assert replay(cfg, good, capsys)[0] == 0
    lines = good.read_text()
    grown = tmp_path / "grown.jsonl"
    DiscardLog(grown).write([discard(b"c", 10)])
    new_line = grown.read_text()
    grown.write_text(lines + new_line + "not json\n")

    code, out = replay(cfg, grown, capsys)
    assert code == 1
    assert "grown.jsonl:4: not a discard-log line" in out and "nothing was put back" in out
    assert buffered(cfg) == [b"a", b"b"]

    grown.write_text(lines + new_line)  # the bad line fixed
    assert replay(cfg, grown, capsys) == (
        0, f"replayed 1 messages from {grown} (3 lines; 2 already replayed before, skipped)\n")
    assert buffered(cfg) == [b"a", b"b", b"c"]
    assert replayed_total(cfg) == 3


def test_a_line_without_an_id_is_known_by_its_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Hand-made lines: no id, no timestamp (the record's timestamp becomes "now" on each read,
    # which must not make the line look new).
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = tmp_path / "hand.jsonl"
    log.write_text('{"topic": "orders", "value": "YQ=="}\n{"topic": "orders", "value": "Yg=="}\n')
    assert replay(cfg, log, capsys)[0] == 0
    assert replay(cfg, log, capsys) == (
        0, f"replayed 0 messages from {log} (2 lines; 2 already replayed before, skipped)\n")
    assert buffered(cfg) == [b"a", b"b"]


def test_a_replay_killed_half_way_then_run_again_puts_back_each_message_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What is remembered commits with the messages it names: wherever the process dies, the
    # second run finds exactly what the first stored.
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    values = [b"%06d" % i for i in range(25_000)]
    log = discard_log(tmp_path / "d.jsonl", values)
    config = load_config(cfg)
    config.buffer.path.mkdir(parents=True)
    Store(config.buffer.path, config.buffer.max_bytes).close()

    proc = subprocess.Popen([sys.executable, "-m", "agent.cli.main", "replay", str(log),
                             "--config", str(cfg)], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Store(config.buffer.path, config.buffer.max_bytes) as store:
            wait_until(lambda: store.get_state(REPLAYED + TOPIC.encode()) is not None
                       or proc.poll() is not None, timeout=60,
                       message="the first batch committed")
        proc.kill()
    finally:
        proc.wait(timeout=30)
    first = buffered(cfg)
    assert first == values[:len(first)] and first

    code, out = replay(cfg, log, capsys)
    assert code == 0, out
    assert f"replayed {len(values) - len(first)} messages" in out
    assert buffered(cfg) == values
    assert replayed_total(cfg) == len(values)


def test_what_is_remembered_is_forgotten_after_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    config = load_config(cfg)
    log = discard_log(tmp_path / "d.jsonl", [b"a", b"b", b"c"])
    start = 1_800_000_000.0  # seconds

    def run(days: int) -> str:
        assert replay_at(config, log, start + days * DAY_MS / 1000) == 0
        return capsys.readouterr().out

    assert run(0).startswith("replayed 3 messages")
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        assert len(store.state_items(PREFIX)) == 3 and len(store.state_items(INDEX)) == 3
    # Remembered for REMEMBER_DAYS whole days after the day it was put back, ...
    assert "3 already replayed before" in run(REMEMBER_DAYS)
    # ... then forgotten by the next run: the file is new again (hence the advice to move a
    # replayed file away), and only what that run put back is remembered.
    assert run(REMEMBER_DAYS + 1).startswith("replayed 3 messages")
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        assert len(store.state_items(PREFIX)) == 3 and len(store.state_items(INDEX)) == 3
        assert len(store.state_items(COUNT)) == 1
    assert buffered(cfg) == [b"a", b"b", b"c"] * 2


def test_past_the_limit_the_oldest_days_are_forgotten_first_never_today(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    config = load_config(cfg)
    start = 1_800_000_000.0
    files = []
    for day in range(3):  # three lines put back on each of three days
        files.append(DiscardLog(tmp_path / f"d{day}.jsonl"))
        files[-1].write([discard(b"%d-%d" % (day, i), 10 * day + i) for i in range(3)])
        assert replay_at(config, files[-1].path, start + day * DAY_MS / 1000) == 0
    capsys.readouterr()
    today_ms = int(start * 1000) + 2 * DAY_MS
    with Store(config.buffer.path, config.buffer.max_bytes) as store:
        assert limit(store) >= 10_000
        assert prune(store, today_ms, keep=9) == 0
        assert prune(store, today_ms, keep=4) == 6  # day 0 leaves 6 > 4, so day 1 goes too
        assert prune(store, today_ms, keep=0) == 0  # today's lines stay: a resume needs them
        assert len(store.state_items(PREFIX)) == 3 and len(store.state_items(INDEX)) == 3
    for day, expected in ((0, "replayed 3 messages"), (2, "replayed 0 messages")):
        assert replay_at(config, files[day].path, today_ms / 1000) == 0
        assert capsys.readouterr().out.startswith(expected)


def test_two_replays_at_once_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = discard_log(tmp_path / "d.jsonl", [b"a"])
    config = load_config(cfg)
    config.buffer.path.mkdir(parents=True)
    with _ReplayLock(config.buffer.path / "replay.lock"):
        code, out = replay(cfg, log, capsys)
    assert code == 1
    assert "another `ferry replay` is running" in out and "run it again once it is done" in out
    assert buffered(cfg) == []
    assert replay(cfg, log, capsys)[0] == 0
    assert buffered(cfg) == [b"a"]


def _appending_after_the_check(monkeypatch: pytest.MonkeyPatch, log: Path,
                               text: bytes) -> None:
    """Append ``text`` to ``log`` once the run has checked the file, before it puts back
    (``prune`` runs in between), as the forwarder appends to the live log."""
    prune_first = replay_module.prune

    def appending(store: Store, now_ms: int, **kwargs: int | None) -> int:
        with log.open("ab") as f:
            f.write(text)
        return prune_first(store, now_ms, **kwargs)

    monkeypatch.setattr(replay_module, "prune", appending)


def test_lines_appended_after_the_check_wait_for_the_next_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = discard_log(tmp_path / "d.jsonl", [b"a", b"b"])
    late = tmp_path / "late.jsonl"
    DiscardLog(late).write([discard(b"c", 10)])
    with monkeypatch.context() as m:
        _appending_after_the_check(m, log, late.read_bytes())
        assert replay(cfg, log, capsys) == (0, f"replayed 2 messages from {log} (2 lines)\n")
    assert buffered(cfg) == [b"a", b"b"]  # only what was checked
    assert replay(cfg, log, capsys) == (
        0, f"replayed 1 messages from {log} (3 lines; 2 already replayed before, skipped)\n")
    assert buffered(cfg) == [b"a", b"b", b"c"]


def test_a_bad_line_appended_after_the_check_is_not_read_by_that_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = discard_log(tmp_path / "d.jsonl", [b"a", b"b"])
    with monkeypatch.context() as m:
        _appending_after_the_check(m, log, b"not json\n")
        assert replay(cfg, log, capsys) == (0, f"replayed 2 messages from {log} (2 lines)\n")
    assert buffered(cfg) == [b"a", b"b"]
    code, out = replay(cfg, log, capsys)  # the next run checks it: refused, as any bad line
    assert code == 1 and "d.jsonl:3: not a discard-log line" in out
    assert buffered(cfg) == [b"a", b"b"]


def test_a_file_cut_short_after_the_check_stops_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    log = discard_log(tmp_path / "d.jsonl", [b"a", b"b"])
    prune_first = replay_module.prune

    def truncating(store: Store, now_ms: int, **kwargs: int | None) -> int:
        os.truncate(log, 0)
        return prune_first(store, now_ms, **kwargs)

    monkeypatch.setattr(replay_module, "prune", truncating)
    code, out = replay(cfg, log, capsys)
    assert code == 1 and "was cut short while being replayed" in out
    assert buffered(cfg) == []
