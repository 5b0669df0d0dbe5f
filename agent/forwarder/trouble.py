"""A step of the forwarder that fails again and again, logged when it starts failing and when
it works again, with counts: not at every attempt (the issue saw 23 lines a second)."""

from __future__ import annotations

import logging
import time

from agent.metrics import Registry

log = logging.getLogger("agent.forwarder.forwarder")


class Trouble:
    """One such step: a delete on a full disk, a discard log that refuses lines."""

    def __init__(self, what: str, registry: Registry, sample: str) -> None:
        self.what = what
        self.registry = registry
        self.sample = sample
        self.since = 0.0  # 0: working
        self.attempts = 0

    def failed(self, exc: BaseException, waiting: int, then: str) -> None:
        self.attempts += 1
        if self.since:
            return
        self.since = time.monotonic()
        log.error("%s failed: %s; %d messages wait in the buffer, %s (logged again once "
                  "it works)", self.what, exc, waiting, then)
        self.registry.sample("error", self.sample, {"detail": f"{self.what}: {exc}",
                                                    "messages": waiting})

    def worked(self, done: int) -> None:
        if not self.since:
            return
        log.warning("%s works again after %d failed attempts over %.1f s (%d messages now)",
                    self.what, self.attempts, time.monotonic() - self.since, done)
        self.since = 0.0
        self.attempts = 0
