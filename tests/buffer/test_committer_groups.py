"""``Committer.submit_groups()``: many independent groups handed over at once, one callback.

The HTTP event loop hands over each loop iteration's requests this way. Each group must still
be stored entirely or not at all on its own, the callback must come once with every result in
order (also when the groups span commits), and a full queue or a closed writer must refuse the
whole hand-over without queueing any of it. Tests queue before ``start()`` so that grouping
does not depend on timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer.committer import Committer, ShuttingDown
from agent.buffer.store import BufferFull, Store, StoredMessage
from agent.metrics import Registry
from agent.records import Record
from tests.buffer.helpers import Calls
from tests.waiting import wait_until

MB = 1024 * 1024
WAIT = 30.0


@pytest.fixture
def registry() -> Registry:
    return Registry()


@contextlib.contextmanager
def _committer(store: Store, registry: Registry, *, max_pending_bytes: int = 64 * MB,
               max_batch_messages: int = 20000) -> Iterator[Committer]:
    c = Committer(store, registry=registry, max_pending_bytes=max_pending_bytes,
                  max_batch_messages=max_batch_messages)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "buffer", 64 * MB, initial_map_bytes=4 * MB) as s:
        yield s


@pytest.fixture
def committer(store: Store, registry: Registry) -> Iterator[Committer]:
    with _committer(store, registry) as c:
        yield c


def _values(store: Store, topic: str) -> list[bytes]:
    return [m.record.value for m in store.read(topic, None, 1_000_000)
            if isinstance(m, StoredMessage)]


def test_groups_get_their_own_ids_in_order_and_one_callback(
    committer: Committer, store: Store, registry: Registry
) -> None:
    calls = Calls()
    groups = [([Record("t", f"{g}:{i}".encode()) for i in range(g + 1)], None)
              for g in range(5)]
    assert committer.submit_groups(groups, "http", calls)
    committer.start()
    wait_until(lambda: calls.count() == 1, timeout=WAIT, message="the callback")
    (results,) = calls.calls
    assert [len(r) for r in results if isinstance(r, list)] == [1, 2, 3, 4, 5]
    flat = [i for r in results if isinstance(r, list) for i in r]
    assert flat == sorted(flat) and len(set(flat)) == 15
    assert _values(store, "t") == [f"{g}:{i}".encode() for g in range(5) for i in range(g + 1)]
    assert registry.view().total("buffer_commits") == 1
    assert registry.view().total("messages_accepted", source="http", topic="t") == 15


def test_a_group_that_does_not_fit_is_refused_alone(
    tmp_path: Path, registry: Registry
) -> None:
    with Store(tmp_path / "small", MB) as small, _committer(small, registry) as committer:
        calls = Calls()
        big = [Record("big", b"x" * 400_000) for _ in range(3)]
        assert committer.submit_groups(
            [([Record("a", b"1")], None), (big, None), ([Record("b", b"2")], None)],
            "http", calls)
        committer.start()
        wait_until(lambda: calls.count() == 1, timeout=WAIT, message="the callback")
        first, refused, last = calls.calls[0]
        assert isinstance(first, list) and isinstance(last, list)
        assert isinstance(refused, BufferFull)
        assert _values(small, "a") == [b"1"] and _values(small, "b") == [b"2"]
        assert _values(small, "big") == []
        assert registry.view().total("messages_rejected", source="http",
                                     reason="buffer_full") == 3


def test_groups_spanning_several_commits_still_call_back_once(
    store: Store, registry: Registry
) -> None:
    with _committer(store, registry, max_batch_messages=2) as committer:
        calls = Calls()
        groups = [([Record("t", b"%d" % g)], None) for g in range(7)]
        assert committer.submit_groups(groups, "http", calls)
        committer.start()
        wait_until(lambda: _values(store, "t") == [b"%d" % g for g in range(7)],
                   timeout=WAIT, message="every group stored")
        wait_until(lambda: calls.count() == 1, timeout=WAIT, message="the callback")
        assert registry.view().total("buffer_commits") == 4  # 2 + 2 + 2 + 1
        assert all(isinstance(r, list) and len(r) == 1 for r in calls.calls[0])


def test_state_derived_from_ids_commits_with_its_group(
    committer: Committer, store: Store
) -> None:
    calls = Calls()

    def derive(ids: list[bytes]) -> dict[bytes, bytes]:
        return {b"idem:k": b"".join(ids)}

    assert committer.submit_groups([([Record("t", b"1"), Record("t", b"2")], derive)],
                                   "http", calls)
    committer.start()
    wait_until(lambda: calls.count() == 1, timeout=WAIT, message="the callback")
    ids = calls.calls[0][0]
    assert isinstance(ids, list)
    assert store.get_state(b"idem:k") == b"".join(ids)


def test_a_full_queue_refuses_the_whole_hand_over(
    store: Store, registry: Registry
) -> None:
    with _committer(store, registry, max_pending_bytes=100) as committer:
        committer.submit([Record("t", b"x" * 200)], "socket")  # not started: stays queued
        calls = Calls()
        assert not committer.submit_groups([([Record("t", b"a")], None),
                                            ([Record("t", b"b")], None)], "http", calls)
        committer.start()
        wait_until(lambda: _values(store, "t") == [b"x" * 200], timeout=WAIT,
                   message="the queued record")
        assert calls.count() == 0


def test_after_close_a_hand_over_raises_shutting_down(committer: Committer) -> None:
    committer.start()
    committer.close()
    with pytest.raises(ShuttingDown):
        committer.submit_groups([([Record("t", b"a")], None)], "http", Calls())


def test_a_hand_over_needs_a_group(committer: Committer) -> None:
    with pytest.raises(ValueError, match="at least one group"):
        committer.submit_groups([], "http", Calls())
