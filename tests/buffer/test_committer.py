"""Group commit: many submitters, few durable transactions, exact per-group results and counters.

To make grouping deterministic, tests hold the writer thread inside a callback (``Gate``) while
submissions queue up, or queue them before ``start()``; nothing depends on timing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer import codec
from agent.buffer import committer as committer_module
from agent.buffer.committer import Callback, Committer, Result, ShuttingDown
from agent.buffer.store import BufferFull, BufferUnavailable, EncodedGroup, Store, StoredMessage
from agent.metrics import Registry
from agent.records import Record
from tests.buffer.helpers import WAIT, Gate
from tests.waiting import wait_until

MB = 1024 * 1024




class Results:
    """Collects callback results per submission, from the writer thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_name: dict[str, Result] = {}

    def callback(self, name: str) -> Callback:
        def record(result: Result) -> None:
            with self.lock:
                assert name not in self.by_name, f"{name} called back twice"
                self.by_name[name] = result

        return record

    def count(self) -> int:
        with self.lock:
            return len(self.by_name)


@pytest.fixture
def registry() -> Registry:
    return Registry()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "buffer", 64 * MB, initial_map_bytes=4 * MB) as s:
        yield s


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "small", MB) as s:
        yield s


def fail_first_append(monkeypatch: pytest.MonkeyPatch, store: Store, exc: Exception) -> None:
    """The store's next append raises ``exc``; the ones after it work."""
    real_append = store.append
    calls = 0

    def failing_once(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc
        return real_append(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "append", failing_once)


def committer_for(store: Store, registry: Registry) -> Iterator[Committer]:
    c = Committer(store, registry=registry)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def committer(store: Store, registry: Registry) -> Iterator[Committer]:
    yield from committer_for(store, registry)


@pytest.fixture
def small_committer(small_store: Store, registry: Registry) -> Iterator[Committer]:
    yield from committer_for(small_store, registry)


def stored_values(store: Store, topic: str) -> list[bytes]:
    return [m.record.value for m in store.read(topic, None, 1_000_000)
            if isinstance(m, StoredMessage)]


# -- group commit ------------------------------------------------------------------------------
def test_concurrent_submitters_are_committed_in_few_transactions(
    committer: Committer, store: Store, registry: Registry
) -> None:
    threads_n, per_thread = 8, 25
    gate = Gate()
    committer.start()
    committer.submit([Record("gate", b"g")], "socket", gate)
    assert gate.entered.wait(WAIT)
    # The writer is held in the gate's callback; everything below queues behind it.
    results = Results()
    start = threading.Barrier(threads_n)

    def submitter(t: int) -> None:
        start.wait(WAIT)
        for i in range(per_thread):
            records = [Record(f"topic{t % 2}", f"{t}:{i}:{j}".encode()) for j in range(i % 3 + 1)]
            committer.submit(records, "http" if t % 2 else "socket",
                             results.callback(f"{t}:{i}"))

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
        assert not th.is_alive()
    assert results.count() == 0  # nothing committed while the writer was held
    gate.release.set()
    wait_until(lambda: results.count() == threads_n * per_thread, timeout=WAIT,
               message="every callback")

    all_ids: list[bytes] = []
    for t in range(threads_n):
        previous_last = b""
        for i in range(per_thread):
            ids = results.by_name[f"{t}:{i}"]
            assert isinstance(ids, list)
            assert len(ids) == i % 3 + 1
            assert ids == sorted(ids) and ids[0] > previous_last  # each thread's order kept
            previous_last = ids[-1]
            all_ids += ids
    total = sum(i % 3 + 1 for i in range(per_thread)) * threads_n
    assert len(all_ids) == len(set(all_ids)) == total
    assert len(stored_values(store, "topic0")) + len(stored_values(store, "topic1")) == total

    view = registry.view()
    # One commit for the gate, one for everything that queued behind it.
    assert view.total("buffer_commits", writer="ingest") == 2
    assert view.histogram("buffer_commit_seconds", writer="ingest").count == 2
    per_source = total // 2  # even threads use socket/topic0, odd ones http/topic1
    assert view.total("messages_accepted", source="socket", topic="topic0") == per_source
    assert view.total("messages_accepted", source="http", topic="topic1") == per_source
    assert view.total("messages_accepted", source="socket", topic="gate") == 1
    assert view.total("messages_rejected") == 0


def test_a_batch_is_cut_at_max_batch_messages(store: Store, registry: Registry) -> None:
    committer = Committer(store, registry=registry, max_batch_messages=10)
    results = Results()
    for i in range(25):
        committer.submit([Record("t", b"%d" % i)], "socket",
                         results.callback(str(i)))
    committer.start()
    committer.close()
    assert results.count() == 25
    assert registry.view().total("buffer_commits") == 3  # 10 + 10 + 5
    assert stored_values(store, "t") == [b"%d" % i for i in range(25)]


def test_encoded_groups_commit_with_record_groups_and_are_counted_per_topic(
    small_committer: Committer, small_store: Store, registry: Registry
) -> None:
    results = Results()

    def group(topic: str, *vals: bytes) -> EncodedGroup:
        return EncodedGroup([(topic, [codec.encode(Record(topic, v), 0) for v in vals], 0)])

    small_committer.submit_encoded(group("a", b"1", b"2"), "socket", results.callback("enc"))
    small_committer.submit([Record("a", b"3")], "spool", results.callback("rec"))
    big = EncodedGroup([("a", [codec.encode(Record("a", b"x" * 400_000), 0)] * 3, 0)])
    small_committer.submit_encoded(big, "socket", results.callback("big"))
    small_committer.start()
    wait_until(lambda: results.count() == 3, timeout=WAIT, message="the callbacks")

    enc = results.by_name["enc"]
    assert isinstance(enc, list) and len(enc) == 2
    assert isinstance(results.by_name["big"], BufferFull)
    assert stored_values(small_store, "a") == [b"1", b"2", b"3"]
    view = registry.view()
    assert view.total("messages_accepted", source="socket", topic="a") == 2
    assert view.total("messages_accepted", source="spool", topic="a") == 1
    assert view.total("messages_rejected", source="socket", reason="buffer_full") == 3
    # ... with an example for the status page, as every reject reason has.
    [example] = view.samples[("rejected", "buffer_full")]
    assert example["source"] == "socket" and example["messages"] == 3
    assert "buffer full" in example["detail"]


def test_commit_waits_for_durability_and_returns_the_ids(
    committer: Committer, store: Store
) -> None:
    committer.start()
    ids = committer.commit([Record("t", b"1"), Record("t", b"2")], "socket", timeout=WAIT)
    assert isinstance(ids, list) and len(ids) == 2
    assert [m.id for m in store.read("t", None, 10)] == ids


# -- refusals ----------------------------------------------------------------------------------
def test_a_group_too_large_is_refused_while_a_smaller_later_one_succeeds(
    small_committer: Committer, small_store: Store, registry: Registry
) -> None:
    results = Results()
    big = [Record("big", b"x" * 400_000) for _ in range(3)]  # 1.2 MB > max_bytes of 1 MB
    small_committer.submit(big, "socket", results.callback("big"))
    small_committer.submit([Record("small", b"ok")], "socket",
                           results.callback("small"))
    small_committer.start()
    wait_until(lambda: results.count() == 2, timeout=WAIT, message="both callbacks")

    assert isinstance(results.by_name["big"], BufferFull)
    small_ids = results.by_name["small"]
    assert isinstance(small_ids, list) and len(small_ids) == 1
    assert stored_values(small_store, "big") == []
    assert stored_values(small_store, "small") == [b"ok"]
    assert small_committer.full

    view = registry.view()
    assert view.total("messages_rejected", source="socket", reason="buffer_full") == 3
    assert view.total("messages_accepted", source="socket", topic="small") == 1
    assert view.total("messages_accepted", topic="big") == 0
    assert view.total("buffer_full") == 1

    # A later commit that fits clears the flag.
    assert isinstance(small_committer.commit([Record("small", b"ok2")], "socket",
                                             timeout=WAIT), list)
    assert not small_committer.full
    assert registry.view().total("buffer_full") == 0


def test_a_spool_group_refused_for_space_is_deferred_not_rejected(
    small_committer: Committer, registry: Registry
) -> None:
    """The spool intake keeps a refused batch in its file and retries it (counted there as
    spool_batches_deferred): the committer must not count its records as rejected input."""
    small_committer.start()
    big = [Record("big", b"x" * 400_000) for _ in range(3)]
    assert isinstance(small_committer.commit(big, "spool", timeout=WAIT), BufferFull)
    assert isinstance(small_committer.commit(big, "socket", timeout=WAIT), BufferFull)
    view = registry.view()
    assert view.total("messages_rejected", source="spool") == 0
    assert view.total("messages_rejected", source="socket", reason="buffer_full") == 3


def test_a_refused_groups_state_is_not_committed(
    small_committer: Committer, small_store: Store
) -> None:
    # submit(): "The group is stored entirely or not at all" -- its state is part of it. A
    # spool intake recording "file a: 3 records ingested" with a refused group would skip
    # those records after a restart, losing them.
    results = Results()
    big = [Record("big", b"x" * 400_000) for _ in range(3)]
    small_committer.submit(big, "spool", results.callback("big"),
                           state_puts={b"spool:a": b"3"})
    small_committer.submit([Record("small", b"ok")], "spool",
                           results.callback("small"),
                           state_puts={b"spool:b": b"1"})
    small_committer.start()
    wait_until(lambda: results.count() == 2, timeout=WAIT, message="both callbacks")
    assert isinstance(results.by_name["big"], BufferFull)
    assert small_store.get_state(b"spool:b") == b"1"
    assert small_store.get_state(b"spool:a") is None


def test_state_changes_apply_in_submission_order(committer: Committer, store: Store) -> None:
    # One submission deletes a key, a later one in the same batch sets it again: the key is
    # set afterwards, as it would be had they committed one by one.
    store.update_state({b"idem:k": b"old"})
    results = Results()
    committer.submit([Record("t", b"1")], "http", results.callback("1"),
                     state_deletes=[b"idem:k"])
    committer.submit([Record("t", b"2")], "http", results.callback("2"),
                     state_puts={b"idem:k": b"new"})
    committer.start()
    wait_until(lambda: results.count() == 2, timeout=WAIT, message="both callbacks")
    assert store.get_state(b"idem:k") == b"new"


def test_a_group_the_map_cannot_take_is_refused_before_anything_is_written(
    tmp_path: Path, registry: Registry
) -> None:
    # 70 x 1 MB cannot fit the map even at its cap (1 MB + 64 MB headroom): the room check
    # (Capacity.fit_on_disk) refuses that group up front; the small one behind it is stored.
    with Store(tmp_path / "b", MB, initial_map_bytes=4 * MB) as s:
        s.max_bytes = 1 << 40  # let the groups past the max_bytes estimate, to the map's cap
        committer = Committer(s, registry=registry, max_pending_bytes=256 * MB)
        results = Results()
        committer.submit([Record("t", b"x" * MB) for _ in range(70)], "http",
                         results.callback("huge"))
        committer.submit([Record("t", b"small")], "socket", results.callback("small"))
        committer.start()
        committer.close()
        assert isinstance(results.by_name["huge"], BufferFull)
        assert isinstance(results.by_name["small"], list)
        assert stored_values(s, "t") == [b"small"]
        assert registry.view().total("messages_rejected", source="http",
                                     reason="buffer_full") == 70


def test_a_transaction_the_disk_cannot_take_refuses_every_group_in_it(
    tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 70 x 1 MB cannot fit the map even at its cap (1 MB + 64 MB headroom). Past the room
    # check (as if its estimate were wrong) append raises, the transaction is aborted, and
    # every group in it is refused -- none is half-stored.
    with Store(tmp_path / "b", MB, initial_map_bytes=4 * MB) as s:
        s.max_bytes = 1 << 40  # let the groups past the max_bytes estimate, to the map's cap
        monkeypatch.setattr(s.capacity, "fit_on_disk", lambda txn, need, room: (1 << 62, None))
        committer = Committer(s, registry=registry, max_pending_bytes=256 * MB)
        results = Results()
        committer.submit([Record("t", b"x" * MB) for _ in range(70)], "http",
                         results.callback("huge"))
        committer.submit([Record("t", b"small")], "socket",
                         results.callback("small"))
        committer.start()
        committer.close()
        assert isinstance(results.by_name["huge"], BufferFull)
        assert isinstance(results.by_name["small"], BufferFull)
        assert committer.full
        assert stored_values(s, "t") == []
        view = registry.view()
        assert view.total("messages_rejected", source="http", reason="buffer_full") == 70
        assert view.total("messages_rejected", source="socket", reason="buffer_full") == 1


def test_a_failing_callback_does_not_stop_the_writer(
    committer: Committer, store: Store
) -> None:
    def explode(result: Result) -> None:
        raise RuntimeError("callback bug")

    committer.start()
    committer.submit([Record("t", b"1")], "socket", explode)
    assert isinstance(committer.commit([Record("t", b"2")], "socket", timeout=WAIT), list)
    assert stored_values(store, "t") == [b"1", b"2"]


# -- back-pressure -----------------------------------------------------------------------------
def test_non_blocking_submit_is_refused_when_the_queue_is_over_its_limit(
    store: Store, registry: Registry
) -> None:
    committer = Committer(store, registry=registry, max_pending_bytes=1000)
    results = Results()
    assert committer.submit([Record("t", b"x" * 2000)], "http",
                            results.callback("first"))
    assert committer.submit([Record("t", b"y")], "http", block=False) is False
    committer.start()
    committer.close()
    assert isinstance(results.by_name["first"], list)
    assert stored_values(store, "t") == [b"x" * 2000]  # the refused one was not queued


def test_a_blocked_submitter_proceeds_once_the_queue_drains(
    store: Store, registry: Registry
) -> None:
    committer = Committer(store, registry=registry, max_pending_bytes=1000)
    committer.submit([Record("t", b"x" * 2000)], "http")
    done = threading.Event()

    def blocked() -> None:
        committer.submit([Record("t", b"after")], "http")
        done.set()

    th = threading.Thread(target=blocked)
    th.start()
    # Held back while the queue is over its limit. (A bounded look for something that must
    # not happen; it cannot fail spuriously, only miss a regression on a very slow machine.)
    assert not done.wait(0.2)
    committer.start()
    assert done.wait(WAIT)
    th.join(WAIT)
    committer.close()
    assert stored_values(store, "t") == [b"x" * 2000, b"after"]


# -- shutdown ----------------------------------------------------------------------------------
def test_close_commits_what_was_queued(store: Store, registry: Registry) -> None:
    committer = Committer(store, registry=registry)
    committer.start()
    gate = Gate()
    committer.submit([Record("t", b"gate")], "socket", gate)
    assert gate.entered.wait(WAIT)
    results = Results()
    for i in range(5):
        committer.submit([Record("t", b"%d" % i)], "socket",
                         results.callback(str(i)))
    closer = threading.Thread(target=committer.close)
    closer.start()

    def closing() -> bool:
        # An empty group is a harmless probe: queued before close() it stores nothing.
        try:
            committer.submit([], "socket")
        except ShuttingDown:
            return True
        return False

    wait_until(closing, timeout=WAIT, message="close() to refuse new submissions")
    gate.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert all(isinstance(results.by_name[str(i)], list) for i in range(5))
    assert stored_values(store, "t") == [b"gate", b"0", b"1", b"2", b"3", b"4"]


def test_submit_after_close_raises_shutting_down(committer: Committer, store: Store) -> None:
    committer.start()
    committer.close()
    with pytest.raises(ShuttingDown):
        committer.submit([Record("t", b"x")], "socket")
    with pytest.raises(ShuttingDown):
        committer.commit([Record("t", b"x")], "socket", timeout=WAIT)
    assert stored_values(store, "t") == []


def test_close_wakes_a_blocked_submitter_with_shutting_down(
    store: Store, registry: Registry
) -> None:
    committer = Committer(store, registry=registry, max_pending_bytes=1000)
    committer.submit([Record("t", b"x" * 2000)], "http")  # over the limit, never drained
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            committer.submit([Record("t", b"after")], "http")
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    th = threading.Thread(target=blocked)
    th.start()
    committer.close()  # never started: nothing drains the queue
    th.join(WAIT)
    assert not th.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ShuttingDown)


def test_an_unexpected_store_error_refuses_the_batch_and_the_writer_carries_on(
    committer: Committer, store: Store, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_first_append(monkeypatch, store, OSError("simulated I/O error"))
    results = Results()
    committer.submit([Record("t", b"1"), Record("t", b"2")], "http", results.callback("a"))
    committer.submit([Record("t", b"3")], "socket", results.callback("b"))
    committer.start()
    wait_until(lambda: results.count() == 2, timeout=WAIT, message="both callbacks")
    for name in ("a", "b"):
        refused = results.by_name[name]
        assert isinstance(refused, BufferUnavailable) and refused.reason == "disk_error"
        assert "simulated I/O error" in str(refused)
    view = registry.view()
    assert view.total("messages_rejected", source="http", reason="disk_error") == 2
    assert view.total("messages_rejected", source="socket", reason="disk_error") == 1
    assert isinstance(committer.commit([Record("t", b"4")], "socket", timeout=WAIT), list)
    assert stored_values(store, "t") == [b"4"]


# -- the writer thread's priority -------------------------------------------------------------
def test_the_writer_thread_alone_takes_the_nice_value_it_is_given(
    store: Store, registry: Registry
) -> None:
    # A higher nice value (lower priority) is always allowed, so this holds without privileges;
    # the packaged unit's -5 is checked under systemd in tests/packaging.
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    c = Committer(store, registry=registry, nice=before + 3)
    c.start()
    try:
        assert c.commit([Record("t", b"x")], "http", timeout=WAIT) != []
        assert c.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, c.native_id) == before + 3
        # Only that thread: the rest of the process keeps its priority.
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    finally:
        c.close()


def test_a_refused_nice_value_is_logged_and_the_writer_commits_as_usual(
    store: Store, registry: Registry, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(which: int, who: int, prio: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    c = Committer(store, registry=registry, nice=-5)
    with caplog.at_level(logging.INFO, logger="agent.buffer.committer"):
        c.start()
        try:
            ids = c.commit([Record("t", b"x")], "http", timeout=WAIT)
        finally:
            c.close()
    assert isinstance(ids, list) and len(ids) == 1
    assert [m.record.value for m in store.read("t", None, 10)
            if isinstance(m, StoredMessage)] == [b"x"]
    refused = [r.getMessage() for r in caplog.records if "nice value" in r.getMessage()]
    assert len(refused) == 1 and "-5" in refused[0] and "LimitNICE" in refused[0], refused


def test_full_clears_by_itself_after_a_refusal_the_buffer_size_cannot_undo(
    committer: Committer, store: Store, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The filesystem filled up (another program): the buffer is empty, so "room again" can
    # never mean "smaller than at the refusal". Readiness must not stay 503 for ever.
    fail_first_append(monkeypatch, store,
                      BufferUnavailable("disk_full", "no space left on the buffer's filesystem"))
    committer.start()
    refused = committer.commit([Record("t", b"1")], "http", timeout=WAIT)
    assert isinstance(refused, BufferUnavailable)
    assert committer.full and registry.view().total("buffer_full") == 1
    later = time.monotonic() + committer_module.FULL_RECHECK_SECONDS + 1
    with monkeypatch.context() as m:
        m.setattr(committer_module.time, "monotonic", lambda: later)
        assert not committer.full
    assert registry.view().total("buffer_full") == 0
    assert isinstance(committer.commit([Record("t", b"2")], "http", timeout=WAIT), list)


def test_full_for_lack_of_room_stays_until_the_buffer_shrinks(
    small_committer: Committer, small_store: Store, registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unlike a disk refusal, a max_bytes refusal is not given up on after a while: readiness
    # must not flap to "ready" while nothing has left the buffer.
    small_committer.start()
    for _ in range(100):  # bounded: ~10 fit in the 1 MiB buffer
        if not isinstance(small_committer.commit([Record("t", b"x" * 100_000)], "http",
                                                 timeout=WAIT), list):
            break
    assert small_committer.full
    later = time.monotonic() + committer_module.FULL_RECHECK_SECONDS + 1
    with monkeypatch.context() as m:
        m.setattr(committer_module.time, "monotonic", lambda: later)
        assert small_committer.full
    assert registry.view().total("buffer_full") == 1
