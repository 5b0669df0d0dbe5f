"""DeliveryWatcher: which ids it looks up, and when it answers (pure logic, scripted states)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path

import pytest

from agent.ingest.http.delivery import CompletionBridge, DeliveryWatcher
from agent.signals.ack import DELIVERED, DISCARDED, MAX_IDS, Acks, AckSender, decode, encode


class States:
    def __init__(self, states: dict[bytes, str]) -> None:
        self.states = states
        self.looked: list[bytes] = []

    def __call__(self, message_id: bytes) -> str | None:
        self.looked.append(message_id)
        return self.states.get(message_id)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_delivered_ids_answer_true_and_undelivered_time_out() -> None:
    states = States({b"a": "delivered", b"b": "buffered"})
    watcher = DeliveryWatcher(states, interval=0.001)

    async def main() -> tuple[bool, bool]:
        done = await asyncio.gather(watcher.wait("t", [b"a"], 5.0),
                                    watcher.wait("u", [b"b"], 0.05))
        return done[0], done[1]

    assert run(main()) == (True, False)
    watcher.close()


def test_a_discard_answers_false_at_once() -> None:
    watcher = DeliveryWatcher(States({b"a": "discarded"}), interval=0.001)
    assert run(watcher.wait("t", [b"a"], 30.0)) is False
    watcher.close()


def test_per_topic_lookups_stop_at_the_oldest_still_buffered_id() -> None:
    # 'a' (older) is stuck; 'b' was delivered out of order: only full rounds look past 'a'.
    states = States({b"a": "buffered", b"b": "delivered"})
    watcher = DeliveryWatcher(states, interval=0.001, full_every=5)

    async def main() -> tuple[bool, bool]:
        stuck = asyncio.ensure_future(watcher.wait("t", [b"a"], 0.2))
        late = await watcher.wait("t", [b"b"], 5.0)
        return late, await stuck

    assert run(main()) == (True, False)
    rounds = states.looked.count(b"a")
    assert states.looked.count(b"b") <= rounds // 5 + 1
    watcher.close()


def test_release_all_answers_every_wait_now() -> None:
    watcher = DeliveryWatcher(States({}), interval=0.001, active=lambda: False)
    assert run(watcher.wait("t", [b"a"], 30.0)) is False
    watcher.close()


def test_no_wait_without_a_timeout_or_ids() -> None:
    watcher = DeliveryWatcher(States({b"a": "delivered"}))
    assert run(watcher.wait("t", [b"a"], 0)) is False
    assert run(watcher.wait("t", [], 1.0)) is False
    watcher.close()


def test_the_bridge_runs_other_threads_posts_on_the_loop_in_order() -> None:
    # What the writer thread does with a hand-over's results: post them to the loop. Every
    # post runs on the loop thread, in posting order, and one that raises does not stop the
    # others behind it.
    async def main() -> tuple[list[int], set[int]]:
        loop = asyncio.get_running_loop()
        bridge = CompletionBridge(loop)
        ran: list[int] = []
        threads: set[int] = set()
        done = loop.create_future()

        def note(i: int) -> None:
            threads.add(threading.get_ident())
            if i == 3:
                raise ValueError("a bad callback")
            ran.append(i)
            if i == 99:
                done.set_result(None)

        def writer() -> None:
            for i in range(100):
                bridge.post(note, i)

        thread = threading.Thread(target=writer)
        thread.start()
        await asyncio.wait_for(done, 30)
        thread.join()
        return ran, threads

    ran, threads = asyncio.run(main())
    assert ran == [i for i in range(100) if i != 3]
    assert threads == {threading.get_ident()}


def _ids(*names: bytes) -> list[bytes]:
    """Message ids (12 bytes) of these short names."""
    return [n.rjust(12, b"\0") for n in names]


def test_a_wait_is_settled_by_the_forwarders_datagram_without_a_lookup(tmp_path: Path) -> None:
    """With a signal socket, the first wait looks its ids up once (what came before the
    listener was bound is unknown); after that the datagrams alone settle waits: the
    fallback round is 30 s away and the tracking table still says "buffered"."""
    a, b = _ids(b"a", b"b")
    states = States({a: "buffered", b: "buffered"})
    path = tmp_path / "acks.sock"
    watcher = DeliveryWatcher(states, interval=30.0, fallback=30.0, signal_path=path)
    sender = AckSender(path)

    async def main() -> tuple[bool, bool, float, int]:
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(watcher.wait("t", [a], 20.0))
        while not states.looked:  # the first round, right after the wait began
            await asyncio.sleep(0.001)
        looked_before = len(states.looked)
        second = asyncio.ensure_future(watcher.wait("t", [b], 20.0))
        await asyncio.sleep(0)
        started = loop.time()
        sender.send([b"t\0" + b, b"t\0" + a])  # buffer keys, as the forwarder has them
        return await first, await second, loop.time() - started, looked_before

    first, second, took, looked_before = asyncio.run(main())
    assert first is True and second is True and took < 5.0
    assert looked_before == 1 and len(states.looked) == 1
    watcher.close()
    sender.close()
    assert not path.exists()


def test_an_id_acknowledged_before_its_wait_began_is_remembered(tmp_path: Path) -> None:
    a, b = _ids(b"a", b"b")
    states = States({a: "buffered", b: "buffered"})
    path = tmp_path / "acks.sock"
    watcher = DeliveryWatcher(states, interval=30.0, fallback=30.0, signal_path=path)
    sender = AckSender(path)

    async def main() -> tuple[bool, bool]:
        first = watcher.watch("t", [a], 20.0)  # binds the listener
        sender.send([b])  # b is acknowledged before anyone waits for it
        sender.send([a])
        delivered_a = await first
        return delivered_a, await watcher.wait("t", [b], 20.0)

    assert run(main()) == (True, True)
    assert b not in states.looked
    watcher.close()
    sender.close()


def test_two_waits_on_one_id_are_both_settled_and_a_timed_out_one_forgotten(
        tmp_path: Path) -> None:
    # An idempotent replay waits on the ids of the request it replays, maybe while that
    # request still waits: one datagram answers both. A wait that timed out leaves nothing
    # behind to be settled later.
    a, b = _ids(b"a", b"b")
    path = tmp_path / "acks.sock"
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0, signal_path=path)
    sender = AckSender(path)

    async def main() -> tuple[bool, bool, bool, int]:
        first = watcher.watch("t", [a], 20.0)
        replay = watcher.watch("t", [a], 20.0)
        late = await watcher.wait("t", [b], 0.01)
        sender.send([a])
        answers = await first, await replay
        await asyncio.sleep(0)  # the futures' done callbacks
        return *answers, late, watcher.waiting

    assert run(main()) == (True, True, False, 0)
    assert watcher._by_id == {}
    watcher.close()
    sender.close()


def test_a_discard_datagram_answers_false_at_once(tmp_path: Path) -> None:
    a, b = _ids(b"a", b"b")
    path = tmp_path / "acks.sock"
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0, signal_path=path)
    sender = AckSender(path)

    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(watcher.wait("t", [a, b], 20.0))
        await asyncio.sleep(0)
        started = loop.time()
        sender.send([a], discarded=[b])
        return await waiting, loop.time() - started

    delivered, took = asyncio.run(main())
    assert delivered is False and took < 5.0
    watcher.close()
    sender.close()


def test_a_lost_datagram_is_noticed_by_the_next_and_looked_up(tmp_path: Path) -> None:
    """The listener's socket buffer is full (its loop was busy), so the datagram that
    acknowledged ``a`` is dropped by the kernel. The next datagram that arrives shows the
    gap in the sequence numbers, and the tracking table is looked up at once (the fallback
    round is 30 s away)."""
    a, c = _ids(b"a", b"c")
    states = States({a: "buffered"})
    path = tmp_path / "acks.sock"
    watcher = DeliveryWatcher(states, interval=30.0, fallback=30.0, signal_path=path)
    sender = AckSender(path)
    filler = [n.to_bytes(12, "big") for n in range(1000, 1000 + 4000)]

    async def main() -> bool:
        waiting = asyncio.ensure_future(watcher.wait("t", [a], 20.0))
        while not states.looked:
            await asyncio.sleep(0.001)
        # Without yielding to the loop: fill the listener's receive buffer.
        for _ in range(10_000):
            if sender.send(filler):
                break
        else:
            raise AssertionError("the listener's receive buffer never filled")
        states.states[a] = "delivered"
        assert sender.send([a]) == 1  # dropped by the kernel: the buffer is full
        # Once the loop has drained the filler, a datagram gets through and shows the gap.
        for _ in range(10_000):
            await asyncio.sleep(0.001)
            if not sender.send([c]):
                break
        return await waiting

    assert run(main()) is True
    assert states.looked.count(a) >= 2
    watcher.close()
    sender.close()


def test_without_any_datagram_old_waits_are_looked_up_every_fallback(tmp_path: Path) -> None:
    # A sender that does not signal (the exactly-once topics' transactions): the waits
    # older than ``fallback`` are looked up every ``fallback`` seconds.
    a = _ids(b"a")[0]
    states = States({a: "buffered"})
    watcher = DeliveryWatcher(states, interval=30.0, fallback=0.01,
                              signal_path=tmp_path / "acks.sock")

    async def main() -> bool:
        waiting = asyncio.ensure_future(watcher.wait("t", [a], 20.0))
        while not states.looked:
            await asyncio.sleep(0.001)
        states.states[a] = "delivered"
        return await waiting

    assert run(main()) is True
    watcher.close()


def test_malformed_datagrams_are_ignored() -> None:
    assert decode(b"") is None
    assert decode(b"D" + bytes(8) + bytes(11)) is None  # not a whole id
    assert decode(b"Q" + bytes(8) + bytes(12)) is None  # no such state
    acks = decode(encode(DELIVERED, 7, _ids(b"a", b"b")))
    assert acks is not None and (acks.seq, acks.ids) == (7, _ids(b"a", b"b"))


def test_a_large_flush_is_chunked_under_the_datagram_size(tmp_path: Path) -> None:
    path = tmp_path / "acks.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(10)
    sender = AckSender(path)
    ids = [n.to_bytes(12, "big") for n in range(MAX_IDS * 2 + 5)]
    sender.send(ids)
    got = [decode(listener.recv(1 << 20)) for _ in range(3)]
    assert [a.seq for a in got if a] == [0, 1, 2]
    assert [i for a in got if a for i in a.ids] == ids
    sender.close()
    listener.close()


def test_a_signal_nobody_listens_to_is_dropped(tmp_path: Path) -> None:
    sender = AckSender(tmp_path / "nobody.sock")
    sender.send([b"t\0" + bytes(12)])  # no error: the forwarder never fails for want of one
    sender.close()


def test_a_callback_wait_is_answered_inside_the_datagrams_own_callback(tmp_path: Path) -> None:
    # watch_call (the 201 path) answers while the datagram is being handled: no future, no
    # further loop iteration between Kafka's acknowledgement reaching the loop and the 201.
    a, b = _ids(b"a", b"b")
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0,
                              signal_path=tmp_path / "acks.sock")
    answers: list[tuple[str, bool]] = []

    async def main() -> list[tuple[str, bool]]:
        watcher.watch_call("t", [a, b], 20.0, lambda ok: answers.append(("ab", ok)))
        watcher._acks(Acks(DELIVERED, 0, [a]))
        assert answers == []  # b is still out
        watcher._acks(Acks(DELIVERED, 1, [b]))
        seen = list(answers)  # before any await: answered in that very call
        return seen

    assert run(main()) == [("ab", True)]
    assert watcher.waiting == 0 and watcher._by_id == {}
    watcher.close()


def test_a_discard_of_every_id_of_a_wait_answers_it_once(tmp_path: Path) -> None:
    # Ending a wait unlists its other ids; the same datagram then names them too.
    a, b = _ids(b"a", b"b")
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0,
                              signal_path=tmp_path / "acks.sock")
    answers: list[bool] = []

    async def main() -> None:
        watcher.watch_call("t", [a, b], 20.0, answers.append)
        watcher.watch_call("t", [b], 20.0, answers.append)
        watcher._acks(Acks(DISCARDED, 0, [a, b]))

    run(main())
    assert answers == [False, False]
    assert watcher.waiting == 0 and watcher._by_id == {}
    watcher.close()


def test_an_answer_that_fails_does_not_keep_the_others_waiting(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, = _ids(b"a")
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0,
                              signal_path=tmp_path / "acks.sock")
    answers: list[bool] = []

    def broken(ok: bool) -> None:
        raise RuntimeError("the connection's reply failed")

    async def main() -> None:
        watcher.watch_call("t", [a], 20.0, broken)
        watcher.watch_call("t", [a], 20.0, answers.append)
        watcher._acks(Acks(DELIVERED, 0, [a]))

    with caplog.at_level(logging.ERROR, logger="agent.ingest.http.delivery"):
        run(main())
    assert answers == [True]
    assert "answering a request that waited for Kafka failed" in caplog.text
    watcher.close()


def test_a_callback_wait_times_out_with_false_and_leaves_nothing_behind() -> None:
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0)
    answers: list[bool] = []

    async def main() -> None:
        done = asyncio.Event()

        def on_done(ok: bool) -> None:
            answers.append(ok)
            done.set()

        watcher.watch_call("t", [b"a" * 12], 0.01, on_done)
        await asyncio.wait_for(done.wait(), 5.0)

    run(main())
    assert answers == [False]
    assert watcher.waiting == 0 and watcher._by_id == {}
    watcher.close()


def test_a_cancelled_future_wait_is_forgotten() -> None:
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0)

    async def main() -> int:
        future = watcher.watch("t", [b"a" * 12], 20.0)
        future.cancel()
        await asyncio.sleep(0)  # its done callback
        return watcher.waiting

    assert run(main()) == 0
    assert watcher._by_id == {}
    watcher.close()


def test_close_after_the_loop_ended_forgets_the_waits_without_answering() -> None:
    # The HTTP server closes the watcher after its loop's thread ended: answering then
    # would write to closed transports from the wrong thread.
    watcher = DeliveryWatcher(States({}), interval=30.0, fallback=30.0)
    answers: list[bool] = []

    async def main() -> None:
        watcher.watch_call("t", [b"a" * 12], 20.0, answers.append)

    run(main())
    assert watcher.waiting == 1
    watcher.close()
    assert answers == [] and watcher.waiting == 0 and watcher._by_id == {}
