"""DeliveryWatcher: which ids it looks up, and when it answers (pure logic, scripted states)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from agent.ack_signal import AckSender
from agent.ingest.http.delivery import CompletionBridge, DeliveryWatcher


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


def test_a_wait_wakes_on_the_forwarders_signal_not_on_a_timer(tmp_path: Path) -> None:
    """With a signal socket, the watcher looks ids up when the forwarder's AckSender says
    outcomes were recorded: once at the wait's start, then only on the signal (the fallback
    round is 30 s away), and the wait ends at once."""
    states = States({b"a": "buffered"})
    path = tmp_path / "acks.sock"
    watcher = DeliveryWatcher(states, interval=30.0, fallback=30.0, signal_path=path)
    sender = AckSender(path)

    async def main() -> tuple[bool, float, int]:
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(watcher.wait("t", [b"a"], 20.0))
        while not states.looked:  # the first round, right after the wait began
            await asyncio.sleep(0.001)
        looked_before = len(states.looked)
        states.states[b"a"] = "delivered"
        started = loop.time()
        sender.send()
        delivered = await waiting
        return delivered, loop.time() - started, looked_before

    delivered, took, looked_before = run(main())  # type: ignore[misc]
    assert delivered is True and took < 5.0
    assert looked_before == 1 and len(states.looked) == 2
    watcher.close()
    sender.close()
    assert not path.exists()


def test_a_signal_nobody_listens_to_is_dropped(tmp_path: Path) -> None:
    sender = AckSender(tmp_path / "nobody.sock")
    sender.send()  # no error: the forwarder must never fail for want of a listener
    sender.close()
