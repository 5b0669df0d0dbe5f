"""What the rooms of the forwarder's loop share, and how they reach each other.

The loop (forwarder.py) is made of rooms, one file each. A room that keeps no state of its
own that another room touches is an object of its own: the ``Forwarder`` makes it, hands it
what it uses (shared state, the room objects it calls, acts of the loop) and holds it as an
attribute, and the other rooms call its public methods. The two that remain, reading and
sending, are mixins of one class, the ``Forwarder``, each made of ``LoopState``: the fast
path reads and sends a batch in one pass over the same locals.

| room | file | is | what it does |
| --- | --- | --- | --- |
| ``Reading`` | reading.py | mixin | reads each topic's buffer in order, checks what must not go |
| ``Sending`` | send.py | mixin | builds and produces messages (the plain-message fast path) |
| ``Reports`` | reports.py | ``.reports`` | delivery reports: acknowledged messages, failed sends |
| ``Retries`` | retries.py | ``.retries`` | a failed send: a retry, the other cluster, a discard |
| ``Routing`` | routing.py | ``.routing`` | the cluster: local, or remote for fallback topics |
| ``StuckTopics`` | stuck_topics.py | ``.stuck_topics`` | topics that cannot deliver, and why |
| ``Leaving`` | leaving.py | ``.leaving`` | discards; the batched durable delete of what left |
| ``ClusterWatch`` | cluster_watch.py | ``.cluster_watch`` | cluster states from the sends; gauges |

The mixins share one in-flight table on one thread, every 2 ms step: a mixin reads and
writes the state declared here directly (no locks, no copies), and calls the other's step
through the abstract methods below, which list every way the two depend on each other.
A room object is handed what it shares with the rest of the loop when it is made:
``Shared`` (shared.py) names that state, in one place (each topic's state, the topics with
retries waiting, the messages in flight, the one log limiter); the mixins reach the same
objects through ``shared`` (each topic's state also as ``_topics``, bound once). A room
object that must act through the loop is handed those acts when it is made, by name
(``Retries``: the loop's two sends), so its constructor says all it calls of the loop. No
room reaches into a room object's fields, nor it into theirs: what it needs of the loop's
own (which topics have buffered messages, each topic's generation) goes through its
methods' arguments and results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeGuard

from agent.buffer.store import Corrupt, Store, StoredMessage
from agent.config import FerryConfig, TopicConfig
from agent.forwarder.cluster_watch import ClusterWatch
from agent.forwarder.clusters import Cluster
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.flight import Flight
from agent.forwarder.leaving import Leaving
from agent.forwarder.partitioner import TopicLayout
from agent.forwarder.reports import Reports
from agent.forwarder.retries import Retries
from agent.forwarder.routing import Routing
from agent.forwarder.shared import Shared
from agent.forwarder.shared import log as log
from agent.forwarder.stuck_topics import StuckTopics
from agent.forwarder.topic_state import TopicState
from agent.forwarder.transactions import ExactlyOnce
from agent.metrics import Registry
from agent.signals.commit import CommitListener


class LoopState(ABC):
    config: FerryConfig
    store: Store
    registry: Registry
    discard_log: DiscardLog
    topic_settings: Callable[[str], TopicConfig]
    clusters: dict[str, Cluster]
    exactly_once: ExactlyOnce
    max_in_flight: int
    per_topic_cap: int
    # What the rooms made objects share with the loop, and those rooms.
    shared: Shared
    leaving: Leaving
    routing: Routing
    stuck_topics: StuckTopics
    retries: Retries
    reports: Reports
    cluster_watch: ClusterWatch
    _commits: CommitListener | None
    _topics: dict[str, TopicState]  # shared.topics
    _generations: dict[str, int]
    _next_topic_scan: float
    _present: set[str]  # topics with buffered messages, as last scanned

    @abstractmethod
    def _sendable(self, m: StoredMessage | Corrupt, settings: TopicConfig, gen: int,
                  check_ttl: bool, now_ms: int) -> TypeGuard[StoredMessage]:
        ...

    @abstractmethod
    def _send(self, f: Flight, now: float) -> None:
        ...

    @abstractmethod
    def _send_values(self, topic: str, values: list[tuple[bytes, bytes]], st: TopicState,
                     settings: TopicConfig, gen: int, check_ttl: bool, now_ms: int,
                     producer: Any, layout: TopicLayout, now: float) -> None:
        ...
