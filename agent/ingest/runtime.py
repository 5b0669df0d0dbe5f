"""What the ingest process's components share: config, buffer, writer, metrics, lifecycle."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from agent.buffer.committer import Committer
from agent.buffer.store import Store
from agent.config import FerryConfig
from agent.metrics import REGISTRY, Registry
from agent.signals.limits import LimitsView
from agent.signals.limits import file_path as limits_file_path


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"


@dataclass
class Runtime:
    config: FerryConfig
    store: Store
    committer: Committer
    registry: Registry = REGISTRY
    started_at: float = field(default_factory=time.time)
    _phase: Phase = Phase.STARTING
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # The Kafka topics' limits the forwarder learnt: every source refuses what a topic can
    # never take (agent/ingest/kafka_limits.py). One view, one look at the file a second.
    limits: LimitsView = field(init=False)

    def __post_init__(self) -> None:
        self.limits = LimitsView(limits_file_path(self.config.buffer.path))

    @property
    def phase(self) -> Phase:
        return self._phase

    def set_phase(self, phase: Phase) -> None:
        with self._lock:
            self._phase = phase

    @property
    def accepting(self) -> bool:
        return self._phase is Phase.RUNNING

    def ready(self) -> tuple[bool, str]:
        """Ready to take new messages? (False while starting, stopping or full), and why."""
        if self._phase is not Phase.RUNNING:
            return False, self._phase.value
        if self.committer.full:
            return False, self.committer.full_reason
        return True, "ready"
