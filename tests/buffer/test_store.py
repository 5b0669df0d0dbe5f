"""The LMDB write-ahead buffer: FIFO per topic, exact counts, durability, capacity, processes."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.buffer import codec, keys
from agent.buffer.store import (
    BufferFull,
    Corrupt,
    DeliveredRun,
    EncodedGroup,
    Outcome,
    StateChange,
    Store,
    StoredMessage,
    TopicStats,
)
from agent.records import Record
from tests.buffer.helpers import FakeClock, read_all, stats, values

MB = 1024 * 1024


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "buffer", 64 * MB, initial_map_bytes=MB) as s:
        yield s


def ids_of(result: Sequence[list[bytes] | BufferFull]) -> list[bytes]:
    out: list[bytes] = []
    for group in result:
        assert isinstance(group, list), group
        out.extend(group)
    return out


def delivered(m: StoredMessage, partition: int = 0, offset: int = 0) -> Outcome:
    return Outcome(m.key, m.stored_bytes, m.topic, "delivered", cluster="local",
                   partition=partition, offset=offset)


def discarded(m: StoredMessage, reason: str = "ttl") -> Outcome:
    return Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=reason)


# -- FIFO and ids ------------------------------------------------------------------------------
def test_fifo_per_topic_across_interleaved_topics(store: Store) -> None:
    store.append([[Record("a", b"a1"), Record("b", b"b1"), Record("a", b"a2")]])
    store.append([[Record("b", b"b2")], [Record("c", b"c1"), Record("a", b"a3")]])
    store.append([[Record("b", b"b3")]])
    assert values(store, "a") == [b"a1", b"a2", b"a3"]
    assert values(store, "b") == [b"b1", b"b2", b"b3"]
    assert values(store, "c") == [b"c1"]
    assert values(store, "d") == []
    assert sorted(store.topics()) == ["a", "b", "c"]


def test_a_topic_that_prefixes_another_is_its_own_fifo(store: Store) -> None:
    store.append([[Record("ab", b"long"), Record("a", b"short"), Record("a.b", b"dotted")]])
    assert values(store, "a") == [b"short"]
    assert values(store, "ab") == [b"long"]
    assert values(store, "a.b") == [b"dotted"]


def test_read_pages_after_an_id_with_a_limit(store: Store) -> None:
    store.append([[Record("t", str(i).encode()) for i in range(10)]])
    store.append([[Record("u", b"other")]])
    pages: list[list[bytes]] = []
    after = None
    while page := store.read("t", after, 4):
        pages.append([m.record.value for m in page if isinstance(m, StoredMessage)])
        after = page[-1].id
    assert pages == [[b"0", b"1", b"2", b"3"], [b"4", b"5", b"6", b"7"], [b"8", b"9"]]


def test_message_ids_and_keys(store: Store) -> None:
    (ids,) = store.append([[Record("t", b"v")]])
    assert isinstance(ids, list)
    (m,) = read_all(store, "t")
    assert m.id == ids[0]
    assert len(m.id) == keys.ID_LEN
    assert m.key == keys.message_key("t", m.id)
    assert keys.split_key(m.key) == ("t", m.id)
    assert m.topic == "t"
    assert m.accepted_ms == keys.id_timestamp_ms(m.id)


def test_ids_strictly_increase_across_calls_and_topics(store: Store) -> None:
    seen: list[bytes] = []
    for i in range(30):
        seen += ids_of(store.append([[Record(f"t{i % 3}", b"x")] * (i % 4 + 1)]))
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)


def test_ids_keep_increasing_after_close_and_reopen(tmp_path: Path) -> None:
    with Store(tmp_path / "b", 64 * MB) as first:
        before = ids_of(first.append([[Record("t", b"1"), Record("t", b"2")]]))
    with Store(tmp_path / "b", 64 * MB) as second:
        after = ids_of(second.append([[Record("t", b"3")]]))
        assert values(second, "t") == [b"1", b"2", b"3"]
    assert max(before) < min(after)


def test_ids_keep_increasing_when_the_clock_steps_back(store: Store, clock: FakeClock) -> None:
    first = ids_of(store.append([[Record("t", b"1"), Record("t", b"2")]]))
    clock.now -= 3600  # NTP stepped the clock back an hour
    second = ids_of(store.append([[Record("t", b"3")]]))
    clock.now -= 1
    third = ids_of(store.append([[Record("t", b"4")]]))
    assert first + second + third == sorted(first + second + third)
    assert len(set(first + second + third)) == 4
    assert values(store, "t") == [b"1", b"2", b"3", b"4"]


def test_ids_carry_the_acceptance_time(store: Store, clock: FakeClock) -> None:
    (ids,) = store.append([[Record("t", b"v")]])
    assert isinstance(ids, list)
    assert keys.id_timestamp_ms(ids[0]) == 1_700_000_000_000


# -- persistence -------------------------------------------------------------------------------
def test_everything_reads_back_intact_after_reopen(tmp_path: Path) -> None:
    written = [
        Record("t", b"no key", key=None, partition_key=None, timestamp_ms=1),
        Record("t", b"empty key", key=b"", partition_key=0, timestamp_ms=2),
        Record("t", b"", key=b"k", partition_key=-7, timestamp_ms=1_700_000_000_123,
               headers=(("a", b"1"), ("a", b""), ("ü", b"\x00\xff")), hash_key=True),
        Record("u", b"\x00" * 5000, key=b"\xff" * 100, partition_key=2**31 - 1,
               timestamp_ms=-5),
    ]
    with Store(tmp_path / "b", 64 * MB) as s:
        ids_of(s.append([written[:2], written[2:]]))
    with Store(tmp_path / "b", 64 * MB) as s:
        back = [m.record for m in read_all(s, "t") + read_all(s, "u")]
    assert back == written
    assert back[0].key is None and back[1].key == b""
    assert back[0].partition_key is None and back[1].partition_key == 0


def test_counts_and_state_survive_reopen(tmp_path: Path) -> None:
    with Store(tmp_path / "b", 64 * MB) as s:
        s.append([[Record("t", b"1"), Record("t", b"22")]], state_puts={b"k": b"v"})
        s.bump_generation("t")
        before = s.topic_stats()
    with Store(tmp_path / "b", 64 * MB) as s:
        assert s.topic_stats() == before
        assert s.get_state(b"k") == b"v"
        assert s.generation("t") == 1


# -- remove and counts -------------------------------------------------------------------------
def test_remove_returns_false_for_keys_already_removed(store: Store) -> None:
    store.append([[Record("t", b"1"), Record("t", b"2"), Record("t", b"3")]])
    m1, m2, m3 = read_all(store, "t")
    assert store.remove([delivered(m1)]) == [True]
    # A second cluster's acknowledgement of m1 arrives with m2's.
    assert store.remove([delivered(m1), delivered(m2)]) == [False, True]
    assert store.remove([discarded(m2), discarded(m1)]) == [False, False]
    assert values(store, "t") == [b"3"]
    assert stats(store) == {"t": (1, m3.stored_bytes)}


def test_duplicate_outcomes_in_one_call_count_once(store: Store) -> None:
    store.append([[Record("t", b"1"), Record("t", b"2")]])
    m1, m2 = read_all(store, "t")
    assert store.remove([delivered(m1), delivered(m1)]) == [True, False]
    assert stats(store) == {"t": (1, m2.stored_bytes)}


def test_counts_stay_exact_through_appends_and_removes(store: Store) -> None:
    store.append([[Record("a", b"x" * n) for n in range(1, 8)], [Record("b", b"yy")]])
    msgs = read_all(store, "a")
    assert stats(store)["a"] == (7, sum(m.stored_bytes for m in msgs))
    store.remove([delivered(m) for m in msgs[:3]] + [delivered(msgs[0])])
    rest = read_all(store, "a")
    assert stats(store)["a"] == (4, sum(m.stored_bytes for m in rest))
    store.remove([delivered(m) for m in rest])
    assert "a" not in stats(store)
    assert store.topics() == ["b"]


def test_remove_of_nothing_is_harmless(store: Store) -> None:
    store.append([[Record("t", b"1")]])
    assert store.remove([]) == []
    assert stats(store)["t"][0] == 1


def run_of(msgs: Sequence[StoredMessage], cluster: str = "local",
           first_offset: int = 100) -> DeliveredRun:
    return DeliveredRun(msgs[0].topic, cluster, [m.id for m in msgs],
                        [m.stored_bytes for m in msgs], [1] * len(msgs),
                        list(range(first_offset, first_offset + len(msgs))))


def test_remove_many_takes_outcomes_and_delivered_runs_in_one_go(store: Store) -> None:
    store.append([[Record("a", b"%d" % i) for i in range(6)], [Record("b", b"x" * 9)]])
    a = read_all(store, "a")
    (b1,) = read_all(store, "b")
    # a[0] left earlier (say the other cluster acknowledged it first).
    assert store.remove([delivered(a[0])]) == [True]
    removed, runs = store.remove_many(
        [discarded(b1, reason="ttl")],
        [run_of(a[:3], "remote"), run_of(a[3:5])])
    assert removed == [True]
    assert runs == [[False, True, True], [True, True]]
    # Counts drop by exactly what was removed; a[0] is not taken off twice.
    assert stats(store) == {"a": (1, a[5].stored_bytes)}
    # Each message removed here is tracked with its own cluster, partition and offset.
    got = store.locate(a[2].id)
    assert got is not None
    assert {k: v for k, v in got.items() if k != "at_ms"} == {
        "state": "delivered", "topic": "a", "cluster": "remote", "partition": 1, "offset": 102}
    got = store.locate(a[4].id)
    assert got is not None and (got["cluster"], got["offset"]) == ("local", 101)
    got = store.locate(a[0].id)  # tracked by the earlier remove, not overwritten here
    assert got is not None and (got["cluster"], got["offset"]) == ("local", 0)
    got = store.locate(b1.id)
    assert got is not None and (got["state"], got["reason"]) == ("discarded", "ttl")


def test_remove_many_of_runs_whose_messages_are_all_gone_changes_nothing(
    store: Store,
) -> None:
    store.append([[Record("a", b"1"), Record("a", b"2")]])
    a1, a2 = read_all(store, "a")
    assert store.remove_many([], [run_of([a1])]) == ([], [[True]])
    assert store.remove_many([], [run_of([a1], "remote")]) == ([], [[False]])
    assert stats(store) == {"a": (1, a2.stored_bytes)}
    got = store.locate(a1.id)
    assert got is not None and got["cluster"] == "local"


# -- topic_stats -------------------------------------------------------------------------------
def test_topic_stats_counts_bytes_and_oldest(store: Store, clock: FakeClock) -> None:
    store.append([[Record("a", b"1"), Record("b", b"22")]])
    clock.now += 5
    store.append([[Record("a", b"333")]])
    a1, a2 = read_all(store, "a")
    (b1,) = read_all(store, "b")
    assert sorted(store.topic_stats(), key=lambda s: s.topic) == [
        TopicStats("a", 2, a1.stored_bytes + a2.stored_bytes, 1_700_000_000_000),
        TopicStats("b", 1, b1.stored_bytes, 1_700_000_000_000),
    ]
    # stored_bytes is what the buffer holds: key (topic NUL id) plus the encoded value.
    assert a2.stored_bytes > a1.stored_bytes > len(a1.key)
    store.remove([delivered(a1)])
    (a_stats,) = [s for s in store.topic_stats() if s.topic == "a"]
    assert a_stats == TopicStats("a", 1, a2.stored_bytes, 1_700_000_005_000)


def test_empty_store_has_no_topics(store: Store) -> None:
    assert store.topics() == []
    assert store.topic_stats() == []
    assert store.read("t", None, 10) == []


# -- state -------------------------------------------------------------------------------------
def test_state_commits_with_the_messages(store: Store) -> None:
    store.update_state({b"spool:a": b"0", b"spool:old": b"9"})
    store.append([[Record("t", b"1")]], state_puts={b"spool:a": b"1"},
                 state_deletes=[b"spool:old"])
    assert store.get_state(b"spool:a") == b"1"
    assert store.get_state(b"spool:old") is None
    assert store.state_items(b"spool:") == [(b"spool:a", b"1")]


def test_state_items_lists_one_prefix_in_order(store: Store) -> None:
    store.update_state({b"idem:b": b"2", b"idem:a": b"1", b"idem": b"no", b"idex:": b"no"})
    assert store.state_items(b"idem:") == [(b"idem:a", b"1"), (b"idem:b", b"2")]
    assert store.state_items(b"zzz") == []


def test_call_state_applies_only_if_every_group_is_stored(tmp_path: Path) -> None:
    with Store(tmp_path / "b", MB) as s:
        result = s.append([[Record("t", b"x" * (2 * MB))], [Record("t", b"small")]],
                          state_puts={b"progress": b"2"})
        assert isinstance(result[0], BufferFull)
        assert isinstance(result[1], list)
        assert s.get_state(b"progress") is None
        assert values(s, "t") == [b"small"]
        ids_of(s.append([[Record("t", b"fits")]], state_puts={b"progress": b"3"}))
        assert s.get_state(b"progress") == b"3"


def test_group_state_applies_only_with_its_group_in_group_order(tmp_path: Path) -> None:
    # A spool intake's "file a: 3 records ingested" must not commit when those records were
    # refused: after a restart they would be skipped, never stored.
    with Store(tmp_path / "b", MB) as s:
        s.update_state({b"idem:k": b"old", b"spool:gone": b"1"})
        result = s.append(
            [
                [Record("t", b"1")],
                [Record("t", b"x" * 400_000) for _ in range(3)],  # 1.2 MB: refused
                [Record("t", b"3")],
                [Record("t", b"4")],
            ],
            states=[
                StateChange(deletes=[b"idem:k"]),
                StateChange(puts={b"spool:a": b"3"}, deletes=[b"spool:gone"]),
                StateChange(puts={b"idem:k": b"new"}),  # after group 0's delete: wins
                None,
            ],
        )
        assert [isinstance(r, list) for r in result] == [True, False, True, True]
        assert values(s, "t") == [b"1", b"3", b"4"]
        assert s.get_state(b"idem:k") == b"new"
        assert s.get_state(b"spool:a") is None  # its group was refused
        assert s.get_state(b"spool:gone") == b"1"


def test_a_transaction_too_big_for_the_map_keeps_nothing(tmp_path: Path) -> None:
    # Without the max_bytes check, 70 MB cannot fit in a map capped at 1 MB + 64 MB headroom:
    # the whole transaction is refused, state included.
    with Store(tmp_path / "b", MB, initial_map_bytes=4 * MB) as s:
        s.append([[Record("t", b"before")]])
        huge = [Record("t", b"x" * MB) for _ in range(70)]
        with pytest.raises(BufferFull):
            s.append([huge], state_puts={b"progress": b"70"}, enforce_limit=False)
        assert s.map_size() == s.map_cap
        assert s.get_state(b"progress") is None
        assert values(s, "t") == [b"before"]
        assert stats(s)["t"][0] == 1
        # The store still works afterwards.
        ids_of(s.append([[Record("t", b"after")]]))
        assert values(s, "t") == [b"before", b"after"]


# -- capacity ----------------------------------------------------------------------------------
def test_fill_until_full_then_removing_makes_room(tmp_path: Path) -> None:
    with Store(tmp_path / "b", MB, initial_map_bytes=256 * 1024) as s:
        value = b"v" * 10_000
        accepted = 0
        for _ in range(1000):  # bounded: ~100 fit
            result = s.append([[Record("t", value)]])
            if isinstance(result[0], BufferFull):
                break
            accepted += 1
        else:
            pytest.fail("never reported BufferFull")
        assert 50 < accepted < 120
        assert "buffer full" in str(result[0])
        # Less room is left than one more takes: 3 overflow pages (12,288 bytes) each.
        assert MB - 3 * 4096 - 100 <= s.used_bytes() <= MB
        # Refused appends stored nothing.
        assert stats(s)["t"][0] == accepted
        assert isinstance(s.append([[Record("t", value)]])[0], BufferFull)
        # The forwarder delivers a few; there is room again.
        oldest = s.read("t", None, 5)
        assert s.remove([delivered(m) for m in oldest if isinstance(m, StoredMessage)]) == [
            True] * 5
        assert isinstance(s.append([[Record("t", value)]])[0], list)
        assert stats(s)["t"][0] == accepted - 5 + 1


def test_a_group_is_all_or_nothing_and_does_not_block_smaller_ones(tmp_path: Path) -> None:
    with Store(tmp_path / "b", MB) as s:
        big = [Record("t", b"b" * 300_000) for _ in range(4)]  # 1.2 MB together
        result = s.append([[Record("t", b"first")], big, [Record("t", b"last")]])
        assert isinstance(result[0], list) and isinstance(result[2], list)
        assert isinstance(result[1], BufferFull)
        assert values(s, "t") == [b"first", b"last"]


def test_enforce_limit_false_ignores_max_bytes(tmp_path: Path) -> None:
    with Store(tmp_path / "b", MB) as s:
        result = s.append([[Record("t", b"x" * (2 * MB))]], enforce_limit=False)
        assert isinstance(result[0], list)
        assert s.used_bytes() > MB


def test_map_grows_from_a_small_start_up_to_the_cap(tmp_path: Path) -> None:
    with Store(tmp_path / "b", 16 * MB, initial_map_bytes=64 * 1024) as s:
        assert s.map_size() == 64 * 1024
        for i in range(40):
            ids_of(s.append([[Record("t", bytes([i]) * 100_000)]]))
        grown = s.map_size()
        assert 4 * MB <= grown <= s.map_cap
        assert s.map_cap == 16 * MB + 64 * MB
        assert len(read_all(s, "t")) == 40
    # Reopening with the same small start adopts the grown map and keeps everything.
    with Store(tmp_path / "b", 16 * MB, initial_map_bytes=64 * 1024) as s:
        # (The file itself is larger: allocated ahead of the map's use, agent/buffer/space.py.)
        assert s.map_size() >= grown
        assert [m.record.value[:1] for m in read_all(s, "t")] == [bytes([i]) for i in range(40)]
        ids_of(s.append([[Record("t", b"more" * 10_000)]]))


# -- locate ------------------------------------------------------------------------------------
def test_locate_buffered_delivered_discarded_and_unknown(store: Store) -> None:
    store.append([[Record("a", b"1"), Record("a", b"2"), Record("b", b"3")]])
    a1, a2 = read_all(store, "a")
    (b1,) = read_all(store, "b")
    assert store.locate(a1.id) == {"state": "buffered", "topic": "a"}
    assert store.locate(b1.id) == {"state": "buffered", "topic": "b"}
    store.remove([delivered(a1, partition=2, offset=41), discarded(b1, reason="max_attempts")])
    got = store.locate(a1.id)
    assert got is not None
    assert {k: v for k, v in got.items() if k != "at_ms"} == {
        "state": "delivered", "topic": "a", "cluster": "local", "partition": 2, "offset": 41}
    got = store.locate(b1.id)
    assert got is not None
    assert {k: v for k, v in got.items() if k != "at_ms"} == {
        "state": "discarded", "topic": "b", "reason": "max_attempts"}
    assert store.locate(a2.id) == {"state": "buffered", "topic": "a"}
    assert store.locate(keys.make_id(1, 1)) is None


def test_locate_reports_when_it_left(store: Store, clock: FakeClock) -> None:
    store.append([[Record("a", b"1")]])
    (m,) = read_all(store, "a")
    clock.now += 2
    store.remove([delivered(m)])
    got = store.locate(m.id)
    assert got is not None and got["at_ms"] == 1_700_000_002_000


def test_without_tracking_a_removed_message_is_unknown(tmp_path: Path) -> None:
    with Store(tmp_path / "b", 64 * MB, track=False) as s:
        s.append([[Record("a", b"1")]])
        (m,) = read_all(s, "a")
        assert s.locate(m.id) == {"state": "buffered", "topic": "a"}
        s.remove([delivered(m)])
        assert s.locate(m.id) is None


def test_tracking_forgets_outcomes_older_than_track_seconds(
    tmp_path: Path, clock: FakeClock
) -> None:
    with Store(tmp_path / "b", 64 * MB, track_seconds=60) as s:
        s.append([[Record("a", b"old")]])
        clock.now += 30
        s.append([[Record("a", b"new")]])
        old, new = read_all(s, "a")
        s.remove([delivered(old)])
        assert s.locate(old.id) is not None  # accepted 30 s ago: kept
        clock.now += 40  # "old" was accepted 70 s ago, "new" 40 s ago
        s.remove([delivered(new)])
        assert s.locate(old.id) is None
        assert s.locate(new.id) is not None


def test_tracking_keeps_the_newest_outcomes_within_its_cap(tmp_path: Path) -> None:
    with Store(tmp_path / "b", 64 * MB) as s:
        s.max_tracking = 50
        s.append([[Record("a", str(i).encode()) for i in range(80)]])
        msgs = read_all(s, "a")
        s.remove_many([], [run_of(msgs[:60])])  # 60 tracked: the oldest 10 forgotten
        assert [s.locate(m.id) is None for m in msgs[8:12]] == [True, True, False, False]
        s.remove_many([], [run_of(msgs[60:])])  # 70 tracked: the oldest 20 forgotten
        assert [s.locate(m.id) is None for m in msgs] == [True] * 30 + [False] * 50
        last = s.locate(msgs[-1].id)
        assert last is not None and (last["state"], last["offset"]) == ("delivered", 119)


# -- purge -------------------------------------------------------------------------------------
def test_purge_deletes_one_topic_and_tracks_why(store: Store) -> None:
    store.append([[Record("a", b"1"), Record("b", b"2"), Record("a", b"3")]])
    a1, _ = read_all(store, "a")
    assert store.purge("a") == 2
    assert values(store, "a") == []
    assert values(store, "b") == [b"2"]
    assert store.topics() == ["b"]
    got = store.locate(a1.id)
    assert got is not None and got["state"] == "discarded" and got["reason"] == "purged"
    assert store.purge("a") == 0
    assert store.purge("never-seen") == 0


def test_purge_goes_past_its_batch_size(store: Store) -> None:
    store.append([[Record("a", b"%d" % i) for i in range(5003)]])
    assert store.purge("a") == 5003
    assert store.topic_stats() == []


# -- generations -------------------------------------------------------------------------------
def test_bump_generation_marks_later_messages_only(tmp_path: Path) -> None:
    with Store(tmp_path / "b", 64 * MB) as s:
        assert s.generation("t") == 0
        assert s.generations() == {}
        s.append([[Record("t", b"gen0")]])
        assert s.bump_generation("t") == 1
        s.append([[Record("t", b"gen1"), Record("u", b"u0")]])
        assert s.bump_generation("t") == 2
        assert s.bump_generation("u") == 1
        assert [(m.record.value, m.generation) for m in read_all(s, "t")] == [
            (b"gen0", 0), (b"gen1", 1)]
        assert [m.generation for m in read_all(s, "u")] == [0]
    with Store(tmp_path / "b", 64 * MB) as s:
        assert s.generations() == {"t": 2, "u": 1}
        s.append([[Record("t", b"gen2")]])
        assert read_all(s, "t")[-1].generation == 2


# -- several processes -------------------------------------------------------------------------
def _child_reads_and_removes(path: str, conn: Connection) -> None:
    with Store(Path(path), 64 * MB, initial_map_bytes=64 * 1024) as s:
        msgs = read_all(s, "t")
        conn.send([m.record.value for m in msgs])
        removed = s.remove([delivered(m) for m in msgs[:2]])
        conn.send(removed)


def _child_appends_until_the_map_grows(path: str, conn: Connection) -> None:
    with Store(Path(path), 64 * MB, initial_map_bytes=64 * 1024) as s:
        for i in range(30):
            ids_of(s.append([[Record("t", b"c%02d" % i + b"x" * 100_000)]]))
        conn.send(s.map_size())


def _run_child(target: Callable[[str, Connection], None], path: Path) -> list[object]:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(str(path), child_end))
    proc.start()
    child_end.close()
    received: list[object] = []
    try:
        while parent_end.poll(60):
            try:
                received.append(parent_end.recv())
            except EOFError:
                break
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"
    return received


def test_a_second_process_sees_appends_and_the_first_sees_its_removes(tmp_path: Path) -> None:
    path = tmp_path / "b"
    with Store(path, 64 * MB, initial_map_bytes=64 * 1024) as s:
        s.append([[Record("t", b"1"), Record("t", b"2"), Record("t", b"3")]])
        first, second, third = read_all(s, "t")
        seen, removed = _run_child(_child_reads_and_removes, path)
        assert seen == [b"1", b"2", b"3"]
        assert removed == [True, True]
        assert values(s, "t") == [b"3"]
        assert stats(s) == {"t": (1, third.stored_bytes)}
        # The child's outcomes are tracked in the shared environment; our removes of the same
        # messages find them gone.
        for m in (first, second):
            got = s.locate(m.id)
            assert got is not None and got["state"] == "delivered" and got["cluster"] == "local"
        assert s.remove([delivered(first), delivered(third)]) == [False, True]
        assert s.topic_stats() == []


def test_a_map_grown_by_another_process_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "b"
    with Store(path, 64 * MB, initial_map_bytes=64 * 1024) as s:
        s.append([[Record("t", b"parent-first")]])
        assert s.map_size() == 64 * 1024
        (child_map,) = _run_child(_child_appends_until_the_map_grows, path)
        assert isinstance(child_map, int) and child_map >= 2 * MB
        got = values(s, "t")  # our map is smaller than the file now
        assert len(got) == 31
        assert got[0] == b"parent-first"
        assert [v[:3] for v in got[1:]] == [b"c%02d" % i for i in range(30)]
        ids_of(s.append([[Record("t", b"parent-last")]]))
        assert values(s, "t")[-1] == b"parent-last"
        assert s.map_size() >= child_map


def _child_reads_and_hangs(path: str, conn: Connection) -> None:
    # A forwarder killed (SIGKILL) in the middle of Store.read: its read transaction's
    # reader slot outlives it.
    s = Store(Path(path), MB, initial_map_bytes=MB)
    txn = s._env.lmdb.begin()  # noqa: SLF001 - the open read transaction is the point
    conn.send(txn.id())
    time.sleep(600)  # killed long before; bounded in case the test dies first


@pytest.mark.parametrize("checked_after_the_crash", [True, False],
                         ids=["as-the-daemon-does", "only-when-the-map-is-full"])
def test_a_reader_slot_left_by_a_killed_process_does_not_fill_the_map(
    tmp_path: Path, checked_after_the_crash: bool
) -> None:
    path = tmp_path / "b"
    with Store(path, MB, initial_map_bytes=MB) as s:
        ctx = multiprocessing.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_child_reads_and_hangs, args=(str(path), child_end))
        proc.start()
        try:
            assert parent_end.poll(60), "the child did not open its read transaction"
            parent_end.recv()
        finally:
            proc.kill()
            proc.join(60)
        if checked_after_the_crash:  # the daemon does this when its forwarder died
            assert s.reader_check() == 1
        # Cycles of append-then-deliver that stay far below max_bytes (1 MiB): with the dead
        # reader pinning its snapshot no freed page could be reused, and the map (max_bytes
        # plus 64 MiB of headroom) filled after ~150 cycles: BufferFull for good.
        batch = [Record("t", b"x" * 500)] * 500
        for cycle in range(400):
            ids_of(s.append([batch]))
            s.remove([delivered(m) for m in read_all(s, "t")])
            assert s.used_bytes() < s.max_bytes, cycle
        assert s.topic_stats() == []
        if checked_after_the_crash:
            assert s.map_size() < 16 * MB, s.map_size()  # pages were reused all along


def test_state_derived_from_ids_commits_with_its_group_only(tmp_path: Path) -> None:
    # Idempotency keys store the answer (which holds the ids) in the messages' transaction.
    with Store(tmp_path / "buffer", MB, initial_map_bytes=MB) as store:
        def answer(name: bytes) -> StateChange:
            return StateChange(derive=lambda ids: {b"idem:" + name: b",".join(ids)})

        results = store.append(
            [[Record("t", b"ok")], [Record("t", b"x" * (2 * MB))], [Record("t", b"ok2")]],
            states=[answer(b"a"), answer(b"b"), answer(b"c")])
        assert isinstance(results[1], BufferFull)
        ids_a, ids_c = results[0], results[2]
        assert isinstance(ids_a, list) and isinstance(ids_c, list)
        assert store.get_state(b"idem:a") == ids_a[0]
        assert store.get_state(b"idem:b") is None
        assert store.get_state(b"idem:c") == ids_c[0]


# -- pre-encoded groups (the datagram socket's path) -------------------------------------------
def encoded(topic: str, *vals: bytes, generation: int = 0) -> tuple[str, list[bytes], int]:
    return topic, [codec.encode(Record(topic, v, timestamp_ms=5), generation) for v in vals], \
        generation


def test_encoded_groups_mix_with_record_groups_in_one_fifo(store: Store) -> None:
    result = store.append([
        [Record("a", b"a1")],
        EncodedGroup([encoded("a", b"a2", b"a3"), encoded("b", b"b1")]),
        [Record("b", b"b2"), Record("a", b"a4")],
    ])
    all_ids = ids_of(result)
    assert len(set(all_ids)) == 6
    # Ids are given a topic at a time: each topic's in the order its messages came.
    assert [m.id for m in read_all(store, "a")] == sorted([*result[0], *result[1][:2],
                                                           result[2][1]])
    assert values(store, "a") == [b"a1", b"a2", b"a3", b"a4"]
    assert values(store, "b") == [b"b1", b"b2"]
    # Each group's ids are the ids its messages were stored under, in run order.
    assert result[1] == [m.id for m in read_all(store, "a")[1:3]] + [read_all(store, "b")[0].id]
    assert stats(store)["b"] == (2, sum(m.stored_bytes for m in read_all(store, "b")))
    assert read_all(store, "b")[0].record.timestamp_ms == 5


def test_an_encoded_group_under_a_stale_generation_is_stored_under_the_current_one(
    store: Store,
) -> None:
    store.bump_generation("t")
    store.bump_generation("t")
    store.append([EncodedGroup([encoded("t", b"x", b"y", generation=0)])])
    assert [(m.record.value, m.generation) for m in read_all(store, "t")] == [(b"x", 2), (b"y", 2)]


def test_an_encoded_group_is_all_or_nothing_and_does_not_block_smaller_ones(
    tmp_path: Path,
) -> None:
    with Store(tmp_path / "b", MB) as s:
        # 1.2 MB together, over max_bytes, though each run alone would fit.
        half = [b"b" * 300_000] * 2
        big = EncodedGroup([encoded("t", *half), encoded("u", *half)])
        result = s.append([EncodedGroup([encoded("t", b"first")]), big, [Record("t", b"last")]])
        assert isinstance(result[0], list) and isinstance(result[2], list)
        assert isinstance(result[1], BufferFull)
        assert values(s, "t") == [b"first", b"last"]
        assert values(s, "u") == []
        assert {t: n for t, (n, _) in stats(s).items()} == {"t": 2}


def test_encoded_group_state_change_applies_with_it(store: Store) -> None:
    change = StateChange({b"k": b"v"}, (), lambda ids: {b"ids": b"".join(ids)})
    (ids,) = store.append([EncodedGroup([encoded("t", b"1", b"2")])], states=[change])
    assert isinstance(ids, list)
    assert store.get_state(b"k") == b"v"
    assert store.get_state(b"ids") == b"".join(ids)


# -- reading what is stored, corrupt values included -------------------------------------------
def overwrite(store: Store, key: bytes, value: bytes) -> None:
    """Damage a stored value in place (what a bad disk or a foreign writer could do)."""
    # Records are stored by id, the last 12 bytes of a message's handle.
    with store._env.lmdb.begin(write=True, db=store._env.records) as txn:  # noqa: SLF001
        assert txn.replace(key[-12:], value) is not None


@st.composite
def cut_values(draw: st.DrawFn) -> bytes:
    """A valid stored value cut short or with its key length changed: the values that pass the
    header's version and header-count checks but are still corrupt, or still valid."""
    key = draw(st.none() | st.binary(max_size=10))
    value = codec.encode(Record("t", draw(st.binary(max_size=20)), key=key), 0)
    if draw(st.booleans()):
        return value[:draw(st.integers(0, len(value)))]
    klen_at = codec.HEADER.size - 6  # u32 key length, then u16 header count
    return value[:klen_at] + draw(st.integers(0, 40)).to_bytes(4, "big") + value[klen_at + 4:]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=60) | cut_values(), min_size=1, max_size=4))
def test_read_turns_each_stored_value_into_what_decode_says(
    store: Store, damaged: list[bytes]
) -> None:
    """read() decodes the common case itself: it must agree with codec.decode on any bytes,
    a message for a message and Corrupt for a value decode refuses, in FIFO order."""
    store.purge("t")
    good = [Record("t", b"v%d" % i, key=b"k" if i % 2 else None,
                   partition_key=i if i % 3 else None, timestamp_ms=i,
                   headers=(("h", b"x"),) if i == 4 else ()) for i in range(2 * len(damaged) + 1)]
    store.append([good])
    stored = read_all(store, "t")
    for i, value in enumerate(damaged):
        overwrite(store, stored[2 * i + 1].key, value)
    got = store.read("t", None, 1000)
    assert [m.key for m in got] == [m.key for m in stored]
    for i, m in enumerate(got):
        if i % 2 == 1 and i < 2 * len(damaged):
            raw = damaged[i // 2]
            try:
                expected, generation = codec.decode("t", raw)
            except codec.CorruptRecord as exc:
                assert isinstance(m, Corrupt) and m.raw == raw and m.error == str(exc)
                continue
            assert isinstance(m, StoredMessage)
            assert (m.record, m.generation) == (expected, generation)
        else:
            assert isinstance(m, StoredMessage) and m.record == good[i]


def test_read_stops_at_the_topics_end_and_after_the_given_id(store: Store) -> None:
    store.append([[Record("t", b"1"), Record("t", b"2"), Record("t0", b"x"), Record("u", b"y")]])
    first, second = read_all(store, "t")
    assert [m.record.value for m in store.read("t", None, 10)] == [b"1", b"2"]
    assert [m.id for m in store.read("t", first.id, 10)] == [second.id]
    assert store.read("t", second.id, 10) == []
    assert store.read("u", read_all(store, "u")[0].id, 10) == []  # the last key of all
