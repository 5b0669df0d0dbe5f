"""Between the writer thread, the event loop and Kafka: commit results in, acks observed.

``CompletionBridge`` carries the committer's callbacks (run on the writer thread) to the
event loop. One group commit completes many requests at once; the bridge wakes the loop once
for all the callbacks that arrive before the loop gets to them, not once per callback.

``DeliveryWatcher`` answers "did Kafka acknowledge these ids within the topic's
ack_timeout_ms?", which decides 201 over 202. The forwarder runs in another process and
removes a message from the buffer once a cluster acknowledged it, writing its outcome to the
buffer's tracking table, then signals it (agent/ack_signal.py: an empty datagram). The
watcher wakes on that signal and looks the outcomes up for the ids being waited on, all
requests together, on one worker thread; without a signal (none can be bound, or one was
lost) it looks every ``fallback`` seconds. It never blocks the event loop and never holds up
a request for longer than the request asked to wait.

Looking an id up costs microseconds, and at 20,000 requests/s hundreds are waiting at any
time, so the watcher does not look up every id on every round. Ids of a topic increase with
acceptance and the forwarder delivers a topic's messages in that order, give or take the
interleaving of partitions: per topic it checks from the oldest waiting id and stops at the
first one still buffered. Every ``full_every``-th round it checks them all, so a message
delivered out of order waits at most that many rounds longer (still within its timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.ack_signal import AckListener
from agent.buffer.store import Store

log = logging.getLogger(__name__)

# What became of one id: "delivered", "discarded", "buffered", or None (not known yet).
Locate = Callable[[bytes], str | None]


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


class _Wait:
    __slots__ = ("topic", "remaining", "future")

    def __init__(self, topic: str, ids: Sequence[bytes], future: asyncio.Future[bool]) -> None:
        self.topic = topic
        self.remaining = set(ids)
        self.future = future


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
    ) -> None:
        self.locate = locate
        self.interval = interval
        self.full_every = full_every
        self.active = active
        self.signal_path = signal_path
        self.fallback = fallback
        self._listener: AckListener | None = None
        self._signalled: asyncio.Event | None = None
        self._round = 0
        self._waits: set[_Wait] = set()
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ferry-ack-watch")

    async def wait(self, topic: str, ids: Sequence[bytes], timeout: float) -> bool:
        """True once every id (all of ``topic``) was delivered; False at ``timeout``, on a
        discard or at shutdown."""
        return await self.watch(topic, ids, timeout)

    def watch(self, topic: str, ids: Sequence[bytes], timeout: float) -> asyncio.Future[bool]:
        """``wait`` as a future, for callers on callbacks (cancelling it ends the wait)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        if not ids or timeout <= 0:
            future.set_result(False)
            return future
        wait = _Wait(topic, ids, future)
        self._waits.add(wait)
        timer = loop.call_later(timeout, _settle, future, False)

        def done(_: asyncio.Future[bool]) -> None:
            timer.cancel()
            self._waits.discard(wait)

        future.add_done_callback(done)
        if self._task is None or self._task.done():
            if self.signal_path is not None and self._listener is None:
                self._listen(loop)
            if self._signalled is not None:
                # A first round at once: what was acknowledged before the wait began has
                # been signalled already.
                self._signalled.set()
            self._task = loop.create_task(self._poll())
        return future

    @property
    def waiting(self) -> int:
        return len(self._waits)

    def release_all(self) -> None:
        """Answer every wait with "not delivered" now (shutdown: 202 rather than wait)."""
        for wait in list(self._waits):
            _settle(wait.future, False)

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.signal_path is not None
        signalled = self._signalled = asyncio.Event()
        try:
            self._listener = AckListener(self.signal_path, loop, signalled.set)
        except OSError as exc:
            log.warning("cannot listen for acknowledgement signals at %s (%s); looking up "
                        "acknowledgements every %g s instead", self.signal_path, exc,
                        self.interval)
            self.signal_path = None
            self._signalled = None

    async def _next_round(self) -> None:
        """Until the forwarder signals outcomes (or ``fallback`` s); without a signal
        listener, ``interval`` s."""
        signalled = self._signalled
        if signalled is None:
            await asyncio.sleep(self.interval)
            return
        if not signalled.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signalled.wait(), self.fallback)
        signalled.clear()

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waits:
            await self._next_round()
            if not self.active():
                self.release_all()
                continue
            waits = [w for w in self._waits if not w.future.done()]
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
                if w.future.done():
                    continue
                for message_id in list(w.remaining):
                    s = state.get(message_id)
                    if s == "delivered":
                        w.remaining.discard(message_id)
                    elif s is not None and s != "buffered":
                        _settle(w.future, False)  # discarded: it will never be acknowledged
                        break
                if not w.remaining:
                    _settle(w.future, True)

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
        self.release_all()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._executor.shutdown(wait=False, cancel_futures=True)
