"""Between the writer thread, the event loop and Kafka: commit results in, acks observed.

``CompletionBridge`` carries the committer's callbacks (run on the writer thread) to the
event loop. One group commit completes many requests at once; the bridge wakes the loop once
for all the callbacks that arrive before the loop gets to them, not once per callback.

``DeliveryWatcher`` answers "did Kafka acknowledge these ids within the topic's
ack_timeout_ms?", which decides 201 over 202. The forwarder runs in another process: it
sends the ids a cluster acknowledged in datagrams as their delivery reports come, and the ids
it discarded once they are in the discard log (agent/signals/ack.py); it removes them from
the buffer, writing their outcomes to the buffer's tracking table, in batched commits. The
watcher settles the waits those ids complete right there, on the event loop: a dictionary
lookup per id, no thread hop, no LMDB read. An id acknowledged
before its request began to wait (the loop was busy when the datagram came) is found in a
short memory of recent acknowledgements.

The tracking table stays the truth and its lookup the fallback, on one worker thread: at
once when a datagram was lost (a gap in their sequence, a malformed one, or the first wait,
when what came before the listener was bound is unknown), and every ``fallback`` seconds for
the waits older than that (a lost last datagram). Without a listener (none can be bound) it
looks every ``interval`` seconds. It never blocks the event loop and never holds up a request
for longer than the request asked to wait.

A lookup costs microseconds and hundreds of requests may wait at once, so a lookup round
does not look up every id: ids of a topic increase with acceptance and the forwarder delivers
a topic's messages in that order, give or take the interleaving of partitions, so per topic
it checks from the oldest waiting id and stops at the first one still buffered. Every
``full_every``-th round it checks them all, so a message delivered out of order waits at most
that many rounds longer (still within its timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.buffer.store import Store
from agent.signals.ack import DELIVERED, AckListener, Acks

log = logging.getLogger(__name__)

# What became of one id: "delivered", "discarded", "buffered", or None (not known yet).
Locate = Callable[[bytes], str | None]


def _answer(on_done: Callable[[bool], None], value: bool) -> None:
    try:
        on_done(value)
    except Exception:  # noqa: BLE001 - one bad answer must not keep the others waiting
        log.exception("answering a request that waited for Kafka failed")


class CompletionBridge:
    """Run callables on the event loop from another thread, one loop wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._ready: list[tuple[Callable[[Any], None], Any]] = []
        self._scheduled = False

    def post(self, fn: Callable[[Any], None], arg: Any) -> None:
        """From any thread: run ``fn(arg)`` on the loop soon."""
        with self._lock:
            self._ready.append((fn, arg))
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
            self._scheduled = False
        for fn, arg in ready:
            try:
                fn(arg)
            except Exception:  # noqa: BLE001 - one bad callback must not strand the others
                log.exception("a completion callback failed")


def store_locate(store: Store) -> Locate:
    """A ``Locate`` over ``Store.locate`` (the tracking table, else the buffer)."""

    def locate(message_id: bytes) -> str | None:
        found = store.locate(message_id)
        return str(found.get("state")) if found else None

    return locate


class Wait:
    """One request's wait for Kafka's acknowledgement of its ids (``watch_call``); handed
    back so that its connection can cut it short (``cut``)."""

    __slots__ = ("topic", "remaining", "on_done", "since", "timer", "ended")

    def __init__(self, topic: str, ids: set[bytes], on_done: Callable[[bool], None],
                 since: float) -> None:
        self.topic = topic
        self.remaining = ids
        self.on_done = on_done
        self.since = since
        self.timer: asyncio.TimerHandle | None = None
        self.ended = False


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class DeliveryWatcher:
    """Wait, without blocking the loop, until Kafka acknowledged messages (or time is up)."""

    def __init__(
        self,
        locate: Locate,
        *,
        interval: float = 0.003,
        full_every: int = 5,
        active: Callable[[], bool] = lambda: True,
        signal_path: Path | None = None,
        fallback: float = 0.02,
        remember: float = 0.5,
    ) -> None:
        self.locate = locate
        self.interval = interval
        self.full_every = full_every
        self.active = active
        self.signal_path = signal_path
        self.fallback = fallback
        self.remember = remember
        self._listener: AckListener | None = None
        # Set when the datagrams cannot be trusted to be complete: look everything up now.
        self._gap: asyncio.Event | None = None
        self._round = 0
        self._waits: set[Wait] = set()
        self._by_id: dict[bytes, list[Wait]] = {}
        # Ids signalled in the last ``remember`` to 2 x ``remember`` seconds, two
        # generations (a set each: adding a datagram's ids is one C call).
        self._delivered: set[bytes] = set()
        self._delivered_before: set[bytes] = set()
        self._discarded: set[bytes] = set()
        self._discarded_before: set[bytes] = set()
        self._rotate_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ferry-ack-watch")

    async def wait(self, topic: str, ids: Sequence[bytes], timeout: float) -> bool:
        """True once every id (all of ``topic``) was delivered; False at ``timeout``, on a
        discard or at shutdown."""
        return await self.watch(topic, ids, timeout)

    def watch(self, topic: str, ids: Sequence[bytes], timeout: float) -> asyncio.Future[bool]:
        """``wait`` as a future (cancelling it ends the wait)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        wait = self.watch_call(topic, ids, timeout, functools.partial(_settle, future))
        if wait is not None:
            future.add_done_callback(functools.partial(self._future_done, wait))
        return future

    def watch_call(self, topic: str, ids: Sequence[bytes], timeout: float,
                   on_done: Callable[[bool], None]) -> Wait | None:
        """``wait`` for callers on callbacks: ``on_done(delivered)`` is called once, on the
        loop, as soon as the answer is known (at once if it already is, and then None is
        returned). No future and no extra loop iteration: a 201 is written in the same
        callback that read the forwarder's datagram."""
        if not ids or timeout <= 0:
            on_done(False)
            return None
        loop = asyncio.get_running_loop()
        if self.signal_path is not None and self._listener is None:
            self._listen(loop)
        remaining = set(ids)
        if not (remaining.isdisjoint(self._discarded)
                and remaining.isdisjoint(self._discarded_before)):
            on_done(False)  # discarded: it will never be acknowledged
            return None
        remaining -= self._delivered
        remaining -= self._delivered_before
        if not remaining:
            on_done(True)  # acknowledged before the request got to wait
            return None
        wait = Wait(topic, remaining, on_done, loop.time())
        wait.timer = loop.call_later(timeout, self._finish, wait, False)
        self._waits.add(wait)
        by_id = self._by_id
        for message_id in remaining:
            waits = by_id.get(message_id)
            if waits is None:
                by_id[message_id] = [wait]
            else:
                waits.append(wait)  # an idempotent replay waiting on the same id
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._poll())
        return wait

    def _future_done(self, wait: Wait, future: asyncio.Future[bool]) -> None:
        if future.cancelled():
            self._end(wait)  # the caller gave up: forget the wait, answer nobody

    def _end(self, wait: Wait) -> bool:
        """Forget ``wait`` (its timer, its ids); False if it had ended already."""
        if wait.ended:
            return False
        wait.ended = True
        if wait.timer is not None:
            wait.timer.cancel()
        self._waits.discard(wait)
        for message_id in wait.remaining:
            self._unlist(message_id, wait)
        return True

    def cut(self, wait: Wait) -> None:
        """End ``wait`` now, answered "not delivered" (its client has gone)."""
        self._finish(wait, False)

    def _finish(self, wait: Wait, value: bool) -> None:
        if self._end(wait):
            _answer(wait.on_done, value)

    @property
    def waiting(self) -> int:
        return len(self._waits)

    def release_all(self) -> None:
        """Answer every wait with "not delivered" now (shutdown: 202 rather than wait)."""
        for wait in list(self._waits):
            self._finish(wait, False)

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.signal_path is not None
        self._gap = asyncio.Event()
        try:
            self._listener = AckListener(self.signal_path, loop, self._acks, self._gap.set)
        except OSError as exc:
            log.warning("cannot listen for acknowledgement signals at %s (%s); looking up "
                        "acknowledgements every %g s instead", self.signal_path, exc,
                        self.interval)
            self.signal_path = None
            self._gap = None
            return
        # What was acknowledged before the listener was bound was signalled to nobody.
        self._gap.set()

    def _acks(self, acks: Acks) -> None:
        """On the loop: the forwarder says ``acks.ids`` left the buffer."""
        now = asyncio.get_running_loop().time()
        if now >= self._rotate_at:
            self._rotate_at = now + self.remember
            self._delivered_before, self._delivered = self._delivered, set()
            self._discarded_before, self._discarded = self._discarded, set()
        ids = acks.ids
        delivered = acks.state == DELIVERED
        (self._delivered if delivered else self._discarded).update(ids)
        by_id = self._by_id
        if not by_id:
            return
        # The waits are ended first and answered after: an answer may run other code of
        # the loop's (the next request of a pipelining client), never in the middle of this.
        answers: list[tuple[Callable[[bool], None], bool]] = []
        for message_id in by_id.keys() & ids:
            # pop with a default: ending a wait unlists its other ids, which may empty them.
            for wait in by_id.pop(message_id, ()):
                if wait.ended:
                    continue
                if delivered:
                    wait.remaining.discard(message_id)
                    if not wait.remaining and self._end(wait):
                        answers.append((wait.on_done, True))
                elif self._end(wait):
                    # Discarded: it will never be acknowledged.
                    answers.append((wait.on_done, False))
        for on_done, value in answers:
            _answer(on_done, value)

    async def _next_round(self) -> bool:
        """Until a lookup round is due; True when it must look at every wait (a datagram
        may have been lost), False for only the waits older than ``fallback``."""
        gap = self._gap
        if gap is None:
            await asyncio.sleep(self.interval)
            return True
        if not gap.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gap.wait(), self.fallback)
        lost = gap.is_set()
        gap.clear()
        return lost

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waits:
            every = await self._next_round()
            if not self.active():
                self.release_all()
                continue
            older = loop.time() - self.fallback
            waits = [w for w in self._waits if every or w.since <= older]
            by_topic: dict[str, set[bytes]] = {}
            for w in waits:
                by_topic.setdefault(w.topic, set()).update(w.remaining)
            if not by_topic:
                continue
            self._round += 1
            full = self._round % self.full_every == 0
            try:
                state = await loop.run_in_executor(self._executor, self._look, by_topic, full)
            except Exception:  # noqa: BLE001 - e.g. the buffer closing under us
                log.exception("checking Kafka acknowledgements failed; answering 202")
                self.release_all()
                continue
            for w in waits:
                if w.ended:
                    continue  # answered while the lookup ran
                for message_id in list(w.remaining):
                    s = state.get(message_id)
                    if s == "delivered":
                        w.remaining.discard(message_id)
                        self._unlist(message_id, w)
                    elif s is not None and s != "buffered":
                        self._finish(w, False)  # discarded: it will never be acknowledged
                        break
                if not w.remaining:
                    self._finish(w, True)

    def _unlist(self, message_id: bytes, wait: Wait) -> None:
        waits = self._by_id.get(message_id)
        if waits is not None:
            with contextlib.suppress(ValueError):
                waits.remove(wait)
            if not waits:
                del self._by_id[message_id]

    def _look(self, by_topic: dict[str, set[bytes]], full: bool) -> dict[bytes, str | None]:
        """On the worker thread: the state of the ids worth looking at this round."""
        state: dict[bytes, str | None] = {}
        for ids in by_topic.values():
            for message_id in sorted(ids):
                s = state[message_id] = self.locate(message_id)
                if not full and s in (None, "buffered"):
                    break  # the rest of this topic is (almost certainly) still waiting too
        return state

    def close(self) -> None:
        """Forget every wait without answering it. Called once the event loop has stopped
        (the HTTP server's thread has ended) or been replaced: the waits' connections went
        with it, and an answer now would write to a closed transport from another thread.
        Shutdown answers them while the loop still runs, with ``release_all``."""
        for wait in list(self._waits):
            self._end(wait)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._executor.shutdown(wait=False, cancel_futures=True)
