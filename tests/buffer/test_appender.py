"""agent/buffer/appender.py: the one append path, whichever way a group comes in."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.buffer import codec, keys
from agent.buffer.store import EncodedGroup, Store, StoredMessage
from agent.records import Record

MAX = 64 * 1024 * 1024


def run_entries(store: Store, topic: str) -> int:
    env = store._env  # noqa: SLF001 - the index's shape is the point
    with env.txn(write=False) as txn, txn.cursor(env.runs) as cur:
        return int(cur.count()) if cur.set_key(topic.encode()) else 0


def test_a_groups_ids_come_back_in_the_order_of_its_records(tmp_path: Path) -> None:
    """Ids are given a topic at a time, yet each group's ids are in its records' order, and
    each topic gets one run per transaction however the groups interleave topics."""
    with Store(tmp_path / "b", MAX) as store:
        groups = [[Record("a", b"a1"), Record("b", b"b1"), Record("a", b"a2")],
                  [Record("b", b"b2"), Record("a", b"a3")]]
        results = store.append(groups)
        assert all(isinstance(r, list) for r in results)
        for group, ids in zip(groups, results, strict=True):
            assert isinstance(ids, list)
            got = [store.locate(i) for i in ids]
            assert [g and g["topic"] for g in got] == [r.topic for r in group]
        read = [m for t in ("a", "b") for m in store.read(t, None, 10)]
        assert all(isinstance(m, StoredMessage) for m in read)
        by_id = {m.id: m.record.value for m in read if isinstance(m, StoredMessage)}
        flat = [i for ids in results if isinstance(ids, list) for i in ids]
        assert [by_id[i] for i in flat] == [b"a1", b"b1", b"a2", b"b2", b"a3"]
        assert run_entries(store, "a") == run_entries(store, "b") == 1


@pytest.mark.parametrize("through", ["append", "append_encoded"])
def test_encoded_runs_land_the_same_way_through_either_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through: str
) -> None:
    monkeypatch.setattr("agent.buffer.clock.now_ms", lambda: 1_700_000_000_000)
    with Store(tmp_path / "b", MAX) as store:
        store.bump_generation("t")  # values encoded under 0 are rewritten under 1
        runs = [("t", [codec.encode(Record("t", b"%d" % i), 0) for i in range(3)], 0),
                ("u", [codec.encode(Record("u", b"u"), 0)], 0),
                ("t", [codec.encode(Record("t", b"3"), 1)], 1)]
        if through == "append":
            [ids] = store.append([EncodedGroup(runs)])
            assert isinstance(ids, list)
            assert len(ids) == 5
        else:
            assert store.append_encoded(runs) == 5
        t = [m for m in store.read("t", None, 10) if isinstance(m, StoredMessage)]
        assert [(m.id, m.record.value, m.generation) for m in t] == [
            (keys.make_id(1_700_000_000_000, i), b"%d" % i, 1) for i in range(4)]
        assert [m.id for m in store.read("u", None, 10)] == [keys.make_id(1_700_000_000_000, 4)]
        assert run_entries(store, "t") == 1
