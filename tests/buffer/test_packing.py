"""Packs: ``submit_groups()`` stores single-message groups as one encoded group (packing.py).

What must hold as before: every group gets its own ids, in hand-over order, stored byte for
byte as ``append`` would; a message that cannot be encoded is refused alone. What packing
changes, on purpose: a pack is stored or refused whole, it holds at most
``max_batch_messages``, and a topic's generation moved on before the commit re-encodes it.
Tests queue before ``start()`` so that grouping does not depend on timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer.committer import Committer
from agent.buffer.packing import Pack
from agent.buffer.refusals import BufferFull, InvalidGroup
from agent.buffer.store import Store, StoredMessage
from agent.metrics import Registry
from agent.records import Record
from tests.buffer.helpers import Calls
from tests.waiting import wait_until

MB = 1024 * 1024
WAIT = 30.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "buffer", 64 * MB, initial_map_bytes=4 * MB) as s:
        yield s


def _stored(store: Store, topic: str) -> list[StoredMessage]:
    return [m for m in store.read(topic, None, 1_000_000) if isinstance(m, StoredMessage)]


def _run(committer: Committer, groups: list[tuple[list[Record], None]], calls: Calls) -> None:
    assert committer.submit_groups(groups, "http", calls)
    committer.start()
    wait_until(lambda: calls.count() == 1, timeout=WAIT, message="the callback")


def test_packed_groups_get_one_id_each_in_order_in_one_commit(store: Store) -> None:
    registry = Registry()
    committer = Committer(store, registry=registry)
    calls = Calls()
    records = [Record("a" if i % 3 else "b", b"%d" % i, key=b"k%d" % i if i % 2 else None,
                      partition_key=i if i % 4 == 0 else None, timestamp_ms=1_700_000_000_000 + i,
                      headers=(("h", b"%d" % i),) if i % 5 == 0 else (), hash_key=i % 2 == 1)
               for i in range(30)]
    try:
        _run(committer, [([r], None) for r in records], calls)
    finally:
        committer.close()
    (results,) = calls.calls
    assert all(isinstance(r, list) and len(r) == 1 for r in results)
    ids = [r[0] for r in results if isinstance(r, list)]
    assert len(set(ids)) == 30
    stored = {m.id: m.record for t in ("a", "b") for m in _stored(store, t)}
    # Each group's id names its own message, every field as it was handed over.
    assert [stored[i] for i in ids] == records
    assert registry.view().total("buffer_commits") == 1
    assert registry.view().total("messages_accepted", source="http") == 30


def test_a_pack_the_buffer_cannot_take_is_split_and_what_fits_is_stored(
    tmp_path: Path
) -> None:
    registry = Registry()
    with Store(tmp_path / "small", MB) as small:
        committer = Committer(small, registry=registry)
        calls = Calls()
        # Each fits alone; together they do not.
        groups = [([Record("t", b"%d" % i + b"x" * 300_000)], None) for i in range(5)]
        try:
            _run(committer, groups, calls)
        finally:
            committer.close()
        results = calls.calls[0]
        stored = [r for r in results if isinstance(r, list)]
        refused = [r for r in results if isinstance(r, BufferFull)]
        assert stored and refused and len(stored) + len(refused) == 5
        # The first ones in hand-over order fit, as separate groups would have.
        assert all(isinstance(r, list) for r in results[:len(stored)])
        assert [m.record.value[:1] for m in _stored(small, "t")] == [
            b"%d" % i for i in range(len(stored))]
        # Only the messages finally refused count as rejected; the split pack does not.
        assert registry.view().total("messages_rejected", source="http",
                                     reason="buffer_full") == len(refused)
        assert registry.view().total("messages_accepted", source="http") == len(stored)


def test_an_unencodable_message_is_refused_alone(store: Store) -> None:
    registry = Registry()
    committer = Committer(store, registry=registry)
    calls = Calls()
    bad = Record("t", b"bad", timestamp_ms=2**70)  # past the i64 timestamp field
    groups = [([Record("t", b"1")], None), ([bad], None), ([Record("t", b"2")], None)]
    try:
        _run(committer, groups, calls)
    finally:
        committer.close()
    first, refused, last = calls.calls[0]
    assert isinstance(first, list) and isinstance(last, list)
    assert isinstance(refused, InvalidGroup)
    assert [m.record.value for m in _stored(store, "t")] == [b"1", b"2"]
    assert registry.view().total("messages_rejected", source="http", reason="unencodable") == 1


def test_a_pack_holds_at_most_max_batch_messages(store: Store) -> None:
    registry = Registry()
    committer = Committer(store, registry=registry, max_batch_messages=4)
    calls = Calls()
    try:
        _run(committer, [([Record("t", b"%d" % i)], None) for i in range(10)], calls)
    finally:
        committer.close()
    assert registry.view().total("buffer_commits") == 3  # 4 + 4 + 2
    assert [m.record.value for m in _stored(store, "t")] == [b"%d" % i for i in range(10)]


def test_a_topic_recreated_before_the_commit_gets_its_new_generation(store: Store) -> None:
    committer = Committer(store, registry=Registry())
    calls = Calls()
    try:
        # Encoded under generation 0 (read when handed over), bumped before the commit.
        assert committer.submit_groups([([Record("t", b"1")], None)], "http", calls)
        generation = store.bump_generation("t")
        committer.start()
        wait_until(lambda: calls.count() == 1, timeout=WAIT, message="the callback")
    finally:
        committer.close()
    (message,) = _stored(store, "t")
    assert message.generation == generation == 1


def test_a_pack_gives_each_group_its_share_of_the_result() -> None:
    pack = Pack()
    for index in (0, 2, 5):
        assert pack.add(index, Record("t", b"v"), 0)
    given: dict[int, object] = {}
    pack.fan_out(given.__setitem__, [b"i0", b"i1", b"i2"])
    assert given == {0: [b"i0"], 2: [b"i1"], 5: [b"i2"]}
    refusal = BufferFull("full")
    pack.fan_out(given.__setitem__, refusal)
    assert given == {0: refusal, 2: refusal, 5: refusal}


def test_a_split_pack_keeps_each_message_with_its_group() -> None:
    pack = Pack()
    assert pack.add(1, Record("a", b"1"), 0)
    assert pack.add(3, Record("b", b"2"), 2)
    assert pack.add(4, Record("b", b"3"), 2)
    split = pack.split()
    assert [index for index, _ in split] == [1, 3, 4]
    assert [[(t, len(v), g) for t, v, g in group.runs] for _, group in split] == [
        [("a", 1, 0)], [("b", 1, 2)], [("b", 1, 2)]]
