"""The buffer's key layout: space per message does not depend on topic names, and a buffer
written by the previous layout (``topic NUL id`` in one tree) is moved over at open, killed
or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb

from agent.buffer import codec, keys
from agent.buffer.store import Corrupt, Store
from agent.records import Record
from tests.agent_harness import REPO_ROOT
from tests.waiting import wait_until

MAX = 1 << 30
N = 30_000


def bytes_per_message(path: Path, topic: str, other: str) -> float:
    """Space of N 200-byte messages of ``topic`` while one message of ``other`` is buffered."""
    value = b"v" * 200
    with Store(path, MAX) as store:
        store.append([[Record(other, b"x")]])
        for _ in range(N // 500):
            store.append([[Record(topic, value) for _ in range(500)]])
        return store.used_bytes() / N


def test_space_per_message_is_the_same_whether_its_topic_sorts_first_or_last(
        tmp_path: Path) -> None:
    first = bytes_per_message(tmp_path / "first", "aaa", "zzz")
    last = bytes_per_message(tmp_path / "last", "zzz", "aaa")
    assert abs(first - last) <= 0.1 * last, (first, last)
    assert first <= 300 and last <= 300, (first, last)


def legacy_buffer(path: Path, per_topic: int, topics: tuple[str, ...]) -> dict[str, list[bytes]]:
    """A buffer as layout 1 wrote it: ``messages`` keyed ``topic NUL id``, ids from
    ``meta/last_id``, exact per-topic counts. Returns the values per topic in FIFO order."""
    path.mkdir(parents=True)
    env = lmdb.open(str(path), map_size=MAX, max_dbs=8)
    messages = env.open_db(b"messages")
    meta = env.open_db(b"meta")
    env.open_db(b"state")
    env.open_db(b"tracking")
    sent: dict[str, list[bytes]] = {t: [] for t in topics}
    seq = 0
    with env.begin(write=True) as txn:
        for i in range(per_topic):
            for topic in topics:  # interleaved, as a real mix of sources writes them
                value = f"{topic}-{i}".encode()
                mid = keys.make_id(1_700_000_000_000, seq)
                seq += 1
                txn.put(keys.message_key(topic, mid),
                        codec.encode(Record(topic, value, key=b"k"), 0), db=messages)
                sent[topic].append(value)
        txn.put(b"last_id", keys.make_id(1_700_000_000_000, seq - 1), db=meta)
        for topic in topics:
            size = sum(len(keys.message_key(topic, b"x" * 12)) +
                       len(codec.encode(Record(topic, v, key=b"k"), 0)) for v in sent[topic])
            txn.put(b"n:" + topic.encode(), (per_topic).to_bytes(8, "big") +
                    size.to_bytes(8, "big"), db=meta)
    env.close()
    return sent


def read_all(store: Store, topic: str) -> list[bytes]:
    out: list[bytes] = []
    after = None
    while batch := store.read(topic, after, 1000):
        assert not [m for m in batch if isinstance(m, Corrupt)]
        out += [m.record.value for m in batch if not isinstance(m, Corrupt)]
        after = batch[-1].id
    return out


def old_tree_entries(path: Path) -> int | None:
    """Messages still in the layout-1 tree (None once it is gone), read without the store."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=True)
    try:
        try:
            db = env.open_db(b"messages", create=False)
        except lmdb.NotFoundError:
            return None
        with env.begin() as txn:
            return int(txn.stat(db)["entries"])
    finally:
        env.close()


def test_a_layout_1_buffer_is_moved_over_at_open(tmp_path: Path) -> None:
    path = tmp_path / "buffer"
    sent = legacy_buffer(path, 3000, ("b", "a", "c.d"))
    with Store(path, MAX) as store:
        stats = {s.topic: s.messages for s in store.topic_stats()}
        assert stats == {"a": 3000, "b": 3000, "c.d": 3000}
        for topic, values in sent.items():
            assert read_all(store, topic) == values
        new = store.append([[Record("a", b"after")]])[0]
        assert isinstance(new, list)
        assert read_all(store, "a")[-1] == b"after"
        # Ids go on from the old counter: the new message sorts after every old one.
        assert new[0] > keys.make_id(1_700_000_000_000, 9000)
    assert old_tree_entries(path) is None


def test_a_migration_killed_midway_goes_on_at_the_next_open(tmp_path: Path) -> None:
    """kill -9 while moving, in small batches (one fsynced transaction each): the next open
    finishes, and every message is there exactly once, in order."""
    path = tmp_path / "buffer"
    sent = legacy_buffer(path, 10_000, ("x", "y"))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import agent.buffer.migration as m
        import agent.buffer.store as s
        m.MIGRATE_BATCH = 10
        s.Store(__import__("pathlib").Path({str(path)!r}), {MAX})
        """)], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        wait_until(lambda: (old_tree_entries(path) or 0) < 20_000 - 100 or
                   child.poll() is not None, timeout=60, interval=0.005,
                   message="the migration under way")
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
    left = old_tree_entries(path)
    assert left is not None and 0 < left < 20_000, f"killed too late to test: {left}"
    with Store(path, MAX) as store:
        assert {s.topic: s.messages for s in store.topic_stats()} == {"x": 10_000, "y": 10_000}
        for topic, values in sent.items():
            assert read_all(store, topic) == values
    assert old_tree_entries(path) is None
