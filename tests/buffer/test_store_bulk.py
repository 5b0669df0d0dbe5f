"""Store.append_encoded: pre-encoded runs, read back exactly as append() would store them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer import codec, keys
from agent.buffer.store import BufferFull, EncodedGroup, Store
from agent.records import Record
from tests.buffer.helpers import FakeClock, read_all, stats, values

MB = 1024 * 1024


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "buffer", 64 * MB, initial_map_bytes=MB) as s:
        yield s


def rec(topic: str, value: bytes, **kw: object) -> Record:
    return Record(topic, value, timestamp_ms=1000, **kw)  # type: ignore[arg-type]


def run(records: list[Record], generation: int = 0) -> tuple[str, list[bytes], int]:
    return records[0].topic, [codec.encode(r, generation) for r in records], generation


def test_reads_back_the_records_in_order_with_counts_like_append(tmp_path: Path) -> None:
    a = [rec("a", b"a%d" % i, key=b"k" if i % 2 else None, partition_key=i if i % 3 else None)
         for i in range(50)]
    b = [rec("b", b"b%d" % i, headers=(("h", b"%d" % i),)) for i in range(5)]
    with Store(tmp_path / "one", 64 * MB) as bulk, Store(tmp_path / "two", 64 * MB) as plain:
        assert bulk.append_encoded([run(a[:20]), run(b), run(a[20:])]) == 55
        plain.append([a[:20] + b + a[20:]])
        for topic in ("a", "b"):
            got = [(m.record, m.generation, m.stored_bytes) for m in read_all(bulk, topic)]
            want = [(m.record, m.generation, m.stored_bytes) for m in read_all(plain, topic)]
            assert got == want
        assert stats(bulk) == stats(plain) == {"a": (50, stats(plain)["a"][1]),
                                               "b": (5, stats(plain)["b"][1])}


def test_ids_increase_across_append_and_append_encoded(store: Store) -> None:
    store.append([[rec("t", b"1")]])
    store.append_encoded([run([rec("t", b"2"), rec("t", b"3")]), run([rec("u", b"x")])])
    store.append([[rec("t", b"4")]])
    store.append_encoded([run([rec("t", b"5")])])
    assert values(store, "t") == [b"1", b"2", b"3", b"4", b"5"]
    ids = sorted([m.id for m in read_all(store, "t")] + [m.id for m in read_all(store, "u")])
    assert len(set(ids)) == 6
    assert [m.id for m in read_all(store, "t")] == sorted(m.id for m in read_all(store, "t"))
    u = read_all(store, "u")[0].id
    t = [m.id for m in read_all(store, "t")]
    assert t[2] < u < t[3]  # one id sequence, in run order


def test_ids_keep_increasing_when_the_clock_steps_back(store: Store, clock: FakeClock) -> None:
    store.append_encoded([run([rec("t", b"1"), rec("t", b"2")])])
    clock.now -= 60
    store.append_encoded([run([rec("t", b"3")])])
    ids = [m.id for m in read_all(store, "t")]
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert keys.id_timestamp_ms(ids[2]) == keys.id_timestamp_ms(ids[0])


def test_state_commits_in_the_same_transaction(store: Store) -> None:
    store.update_state(puts={b"old": b"1"})
    store.append_encoded([run([rec("t", b"v")])], state_puts={b"spool:f": b"next=1"},
                         state_deletes=[b"old"])
    assert store.get_state(b"spool:f") == b"next=1"
    assert store.get_state(b"old") is None


def test_state_alone_and_empty_runs_store_no_message(store: Store) -> None:
    assert store.append_encoded([("t", [], 0)], state_puts={b"k": b"v"}) == 0
    assert store.get_state(b"k") == b"v"
    assert store.topic_stats() == []


def test_what_does_not_fit_is_refused_whole_with_its_state(tmp_path: Path) -> None:
    with Store(tmp_path / "b", MB, initial_map_bytes=MB) as s:
        s.append_encoded([run([rec("t", b"before")])])
        big = [rec("t", b"x" * 1000) for _ in range(2000)]  # ~2 MB into a 1 MB buffer
        with pytest.raises(BufferFull):
            s.append_encoded([run(big[:10]), run(big[10:])], state_puts={b"progress": b"2000"})
        assert s.get_state(b"progress") is None
        assert values(s, "t") == [b"before"]
        assert stats(s)["t"][0] == 1
        assert s.append_encoded([run(big[:10])], state_puts={b"progress": b"10"}) == 10
        assert s.get_state(b"progress") == b"10"


def test_a_run_encoded_under_an_old_generation_is_stored_under_the_current_one(
    store: Store,
) -> None:
    old = store.generation("t")
    new = store.bump_generation("t")
    store.append_encoded([run([rec("t", b"v", key=b"k")], old), run([rec("u", b"w")], 0)])
    (m,) = read_all(store, "t")
    assert (m.generation, m.record.value, m.record.key) == (new, b"v", b"k")
    assert read_all(store, "u")[0].generation == 0


@pytest.mark.parametrize("through", ["append_encoded", "append"])
def test_the_sequence_wraps_into_the_next_millisecond(
    store: Store, clock: FakeClock, through: str
) -> None:
    """Both ways of storing pre-encoded runs (the spool's bulk path, the socket's
    EncodedGroup) allocate ids with the same rule, wrap included."""
    store.append_encoded([run([rec("t", b"0")])])
    ms = int(clock.now * 1000)
    # Put the id counter just below the end of the sequence range.
    env = store._env  # noqa: SLF001 - set up an edge the clock cannot
    with env.txn(write=True) as txn:
        txn.put(b"last_id", keys.ID.pack(ms, 0xFFFFFFFE), db=env.meta)
    later = run([rec("t", b"%d" % i) for i in range(1, 5)])
    if through == "append":
        (given,) = store.append([EncodedGroup([later])])
    else:
        store.append_encoded([later])
    ids = [keys.ID.unpack(m.id) for m in read_all(store, "t")]
    assert ids[1:] == [(ms, 0xFFFFFFFF), (ms + 1, 0), (ms + 1, 1), (ms + 1, 2)]
    if through == "append":
        assert given == [m.id for m in read_all(store, "t")[1:]]
    assert values(store, "t") == [b"%d" % i for i in range(5)]


def test_runs_of_alternating_topics_keep_each_topics_order(store: Store) -> None:
    a = [rec("a", b"a%d" % i) for i in range(6)]
    b = [rec("b", b"b%d" % i) for i in range(6)]
    runs = [run(a[0:1]), run(b[0:2]), run(a[1:4]), run(b[2:3]), run(a[4:6]), run(b[3:6])]
    assert store.append_encoded(runs) == 12
    assert values(store, "a") == [r.value for r in a]
    assert values(store, "b") == [r.value for r in b]
    assert {t: n for t, (n, _) in stats(store).items()} == {"a": 6, "b": 6}


@pytest.mark.parametrize("through", ["append", "append_encoded"])
def test_values_on_overflow_pages_count_whole_pages_against_max_bytes(
    tmp_path: Path, through: str
) -> None:
    # A 2,100-byte value does not fit in half a 4 KiB page: LMDB gives it a whole overflow
    # page. Counted as ~2,150 bytes, one commit of them once took 1.87x max_bytes.
    with Store(tmp_path / "b", 8 * MB, initial_map_bytes=MB) as s:
        values = [b"v" * 2100] * 3800
        if through == "append":
            [result] = s.append([[Record("t", v) for v in values]])
            assert isinstance(result, BufferFull)
        else:
            with pytest.raises(BufferFull):
                s.append_encoded([("t", [codec.encode(Record("t", v), 0) for v in values], 0)])
        assert s.used_bytes() == 0
        # What does fit is taken, and stays within the limit.
        fits = values[:1500]
        if through == "append":
            [ids] = s.append([[Record("t", v) for v in fits]])
            assert isinstance(ids, list) and len(ids) == 1500
        else:
            assert s.append_encoded(
                [("t", [codec.encode(Record("t", v), 0) for v in fits], 0)]) == 1500
        assert s.used_bytes() <= s.max_bytes
