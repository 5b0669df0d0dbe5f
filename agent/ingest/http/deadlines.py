"""Body deadlines without a timer per request.

``asyncio.timeout()`` schedules and cancels a timer for every request, which costs more than
everything else the publish path does with a small body. Instead, a request notes its
deadline in a dict while it reads its body, and one sweeper task, alive only while some
request is reading, cancels the readers that are late. A late reader is always suspended in
its ``receive()`` (the only await of the read), so the cancellation surfaces there and
``expired()`` turns it into a 408. The sweeper outlives the readers by ``idle_exit`` seconds,
so steady traffic does not create a task per request.

Deadlines are therefore up to ``sweep_interval`` late: fine for a timeout measured in seconds.
"""

from __future__ import annotations

import asyncio
import time


class BodyDeadlines:
    def __init__(self, sweep_interval: float = 0.1, idle_exit: float = 5.0) -> None:
        self.sweep_interval = sweep_interval
        self.idle_exit = idle_exit
        self._last_begin = 0.0
        self._reading: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def begin(self, timeout: float) -> asyncio.Task[object]:
        """The current task starts reading; it must call ``end()`` when done, in finally."""
        task = asyncio.current_task()
        assert task is not None
        now = self._last_begin = time.monotonic()
        self._reading[task] = now + timeout
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return task

    def end(self, task: asyncio.Task[object]) -> None:
        self._reading.pop(task, None)

    def expired(self, task: asyncio.Task[object]) -> bool:
        """After a CancelledError while reading: was it our deadline (then it is consumed)?"""
        if task in self._expired:
            self._expired.discard(task)
            task.uncancel()
            return True
        return False

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            now = time.monotonic()
            if not self._reading and now - self._last_begin > self.idle_exit:
                return
            for task, deadline in list(self._reading.items()):
                if now >= deadline and task not in self._expired:
                    self._expired.add(task)
                    self._reading.pop(task, None)
                    task.cancel()
