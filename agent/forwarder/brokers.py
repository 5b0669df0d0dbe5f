"""Which of a cluster's brokers this agent cannot reach while the others answer, read from
librdkafka's statistics.

A broker can be out of one agent's reach and still well for the cluster (a network partition
between this host and that node): it stays leader of its partitions, and metadata, which
any broker serves, keeps naming it. Sends to its partitions then wait until
``message_timeout_ms`` (5 minutes by default) while the rest of the cluster answers. Ferry
learns it sooner from librdkafka's per-broker statistics, once a second per producer:

- **quiet**: the client has requests out to the broker and has received nothing from it
  for ``quiet_after`` seconds (``state`` UP, ``waitresp_cnt`` > 0, ``rxidle``), or it keeps
  trying to connect to it (a connecting state) with partitions to send there;
- **answering**: something received from it within the last second. An idle connection
  is neither: one through a network gone silent looks the same.

A broker quiet for ``quiet_after`` (no source answering meanwhile) is unreachable until a
sample shows it answering, or a request sent to it alone is answered (the probe's reach
check, every probe period while it is out of reach: librdkafka may not reconnect to a broker
it has nothing for, and Ferry sends nothing to its partitions meanwhile), or until
``HOLD_SECONDS`` pass without any sample or check calling it quiet (then its partitions are
tried again, and found quiet again if they still are). Idle brokers, and brokers leading no
partition of the agent's, are neither: no verdict is drawn from silence.

Only the ``brokers`` object of the statistics is decoded: its size grows with the
partitions the client writes to, the rest (per-topic detail) is not needed here.

Pure logic with an explicit clock, unit-tested on recorded statistics.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The states of a broker connection being set up: librdkafka is trying to reach it.
CONNECTING = frozenset({"TRY_CONNECT", "CONNECT", "SSL_HANDSHAKE", "AUTH_LEGACY",
                        "APIVERSION_QUERY", "AUTH_HANDSHAKE", "AUTH_REQ", "REAUTH"})
# Something received this recently (ms): the broker answers.
ANSWERED_MS = 1000
# How long a broker found unreachable stays so with no sample saying anything about it.
HOLD_SECONDS = 30.0
# librdkafka's statistics interval for every producer (ms).
STATS_INTERVAL_MS = 1000
# A client's quiet counts only while its samples keep saying so (seconds): a sample may be
# missed, or catch a connection being set up again between two tries.
QUIET_SEEN_WITHIN = 2.5 * STATS_INTERVAL_MS / 1000

_decoder = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class BrokerSample:
    """One broker in one client's statistics."""

    node: int
    address: str
    quiet_ms: int | None  # how long it has been quiet (ms), None when it is not
    answering: bool  # something received from it within ANSWERED_MS
    connected: bool  # UP: past ApiVersion on this connection
    partitions: tuple[tuple[str, int], ...]  # the partitions it leads for this client
    messages: int = 0  # messages in requests to it, sent or about to be, not answered
    throttle_ms: int = 0  # the longest quota throttle it asked for in the last interval


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A broker the agent cannot reach, and the partitions that wait for it."""

    node: int
    address: str
    since: float  # wall-clock seconds
    partitions: tuple[tuple[str, int], ...]

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "address": self.address, "since": self.since,
                "partitions": [f"{t}-{p}" for t, p in self.partitions]}


def queued_messages(stats: str) -> int | None:
    """The messages a client holds by one librdkafka statistics document (``msg_cnt``: queued,
    in flight, or their delivery reports not yet served), None when it says nothing. The
    first ``msg_cnt`` is the client's own: the top level comes before the brokers' and
    topics' entries."""
    start = stats.find('"msg_cnt":')
    if start < 0:
        return None
    at = start + len('"msg_cnt":')
    end = at
    while end < len(stats) and stats[end] in " \t\r\n0123456789":
        end += 1
    try:
        return int(stats[at:end])
    except ValueError:
        return None


def brokers(stats: str) -> list[BrokerSample]:
    """The brokers of one librdkafka statistics document (learned brokers only: the
    bootstrap entries have no node id)."""
    start = stats.find('"brokers":')
    if start < 0:
        return []
    at = start + len('"brokers":')
    while at < len(stats) and stats[at] in " \t\r\n":
        at += 1
    try:
        found, _ = _decoder.raw_decode(stats, at)
    except ValueError:
        return []
    if not isinstance(found, dict):
        return []
    out = []
    for b in found.values():
        if not isinstance(b, dict) or int(b.get("nodeid", -1)) < 0:
            continue
        out.append(_sample(b))
    return out


def _sample(b: dict[str, Any]) -> BrokerSample:
    state = str(b.get("state", ""))
    rxidle_ms = int(b.get("rxidle", -1)) // 1000  # µs in the statistics
    waiting = int(b.get("waitresp_cnt", 0)) + int(b.get("outbuf_cnt", 0))
    toppars = b.get("toppars") or {}
    partitions = tuple(sorted((str(tp.get("topic")), int(tp.get("partition", -1)))
                              for tp in toppars.values() if isinstance(tp, dict)))
    answering = state == "UP" and 0 <= rxidle_ms < ANSWERED_MS
    quiet_ms: int | None = None
    if state == "UP":
        if waiting and not answering:
            quiet_ms = max(rxidle_ms, 0)  # requests out, nothing back since
    elif state in CONNECTING:
        quiet_ms = 0  # trying to connect: quiet from now (the watch keeps the start)
    if not partitions:
        quiet_ms = None  # it leads nothing of ours: nothing waits for it
    name = str(b.get("nodename") or b.get("name", ""))
    messages = int(b.get("waitresp_msg_cnt", 0)) + int(b.get("outbuf_msg_cnt", 0))
    throttle = b.get("throttle")
    throttle_ms = int(throttle.get("max", 0)) if isinstance(throttle, dict) else 0
    return BrokerSample(int(b["nodeid"]), name, quiet_ms, answering, state == "UP",
                        partitions, messages, throttle_ms)


class BrokerWatch:
    """The brokers of one cluster found unreachable, from every client's statistics."""

    def __init__(self, quiet_after: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.quiet_after = quiet_after
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        # (source, node) -> (quiet since, last sample that said so), monotonic
        self._quiet: dict[tuple[str, int], tuple[float, float]] = {}
        self._answered: dict[int, float] = {}  # node -> last answering sample (monotonic)
        self._last_quiet: dict[int, float] = {}  # node -> last quiet sample (monotonic)
        self._partitions: dict[int, tuple[tuple[str, int], ...]] = {}
        self._addresses: dict[int, str] = {}
        self._unreachable: dict[int, Unreachable] = {}
        self._messages: dict[tuple[str, int], int] = {}  # (source, node) -> in requests
        # node -> (longest throttle asked for, when): a broker enforcing a quota delays its
        # answers by design, which must not read as unreachable.
        self._throttle: dict[int, tuple[float, float]] = {}

    def sample(self, source: str, stats: str) -> bool:
        """Take one client's statistics; True when the set of unreachable brokers changed."""
        found = brokers(stats)
        with self._lock:
            now = self._clock()
            for b in found:
                key = (source, b.node)
                self._addresses[b.node] = b.address
                self._messages[key] = b.messages
                if b.throttle_ms > 0:
                    self._throttle[b.node] = (max(b.throttle_ms / 1000.0,
                                                  self._throttle_s(b.node, now)), now)
                if b.partitions:
                    self._partitions[b.node] = b.partitions
                if b.answering:
                    self._answered[b.node] = now
                    self._quiet.pop(key, None)
                elif b.quiet_ms is None and b.connected:
                    # Connected and waiting for nothing: this client is not kept waiting.
                    # Not an answer, though: an idle connection through a network that
                    # went silent looks just the same.
                    self._quiet.pop(key, None)
                elif b.quiet_ms is not None:
                    began = now - b.quiet_ms / 1000.0
                    since = self._quiet[key][0] if key in self._quiet else began
                    self._quiet[key] = (min(since, began), now)
                    self._last_quiet[b.node] = now
            return self._judge(now)

    def answered(self, node: int) -> bool:
        """A request sent to ``node`` alone was answered (the probe's reach check, probe.py):
        it answers again, whatever the clients' statistics said last. True when the set of
        unreachable brokers changed."""
        with self._lock:
            now = self._clock()
            self._answered[node] = now
            return self._judge(now)

    def unanswered(self, node: int) -> None:
        """A request sent to ``node`` alone went unanswered, for want of a connection or an
        answer (not refused by authentication: that is the check's own trouble): a quiet
        sample, so ``HOLD_SECONDS`` does not run out while the checks say it is still cut
        off, and its partitions are not tried again for nothing (which cost a pause of the
        topic, and a transaction held to its commit limit)."""
        with self._lock:
            if node in self._unreachable:
                self._last_quiet[node] = self._clock()

    def _judge(self, now: float) -> bool:
        before = set(self._unreachable)
        for key, (since, seen) in list(self._quiet.items()):
            node = key[1]
            if node in self._unreachable:
                continue
            if now - seen > QUIET_SEEN_WITHIN:
                # Not said quiet lately: a connection caught once being set up, then left
                # alone (an idle agent's connection closed and not wanted again) is no
                # verdict, however long ago that began; a quiet spell later starts afresh.
                del self._quiet[key]
                continue
            # Quiet for as long as the samples said so (and up to one interval past the
            # last), not merely since the first: one sample is not a spell.
            quiet_for = min(now, seen + STATS_INTERVAL_MS / 1000) - since
            if (quiet_for >= self.quiet_after + self._throttle_s(node, now)
                    and now - self._answered.get(node, float("-inf")) >= self.quiet_after):
                wall_since = self._wall() - (now - since)
                self._unreachable[node] = Unreachable(
                    node, self._addresses.get(node, ""), wall_since,
                    self._partitions.get(node, ()))
        for node, u in list(self._unreachable.items()):
            answered = self._answered.get(node, float("-inf"))
            last_quiet = self._last_quiet.get(node, float("-inf"))
            if answered > last_quiet or now - last_quiet >= HOLD_SECONDS:
                del self._unreachable[node]
                for key in [k for k in self._quiet if k[1] == node]:
                    del self._quiet[key]
            elif u.partitions != self._partitions.get(node, u.partitions):
                self._unreachable[node] = Unreachable(u.node, u.address, u.since,
                                                      self._partitions[node])
        return set(self._unreachable) != before

    def _throttle_s(self, node: int, now: float) -> float:
        """The throttle ``node`` asked for in the last minute (seconds), else 0."""
        seconds, at = self._throttle.get(node, (0.0, float("-inf")))
        return seconds if now - at < 60.0 else 0.0

    def stranded(self, source: str | None = None) -> int:
        """Messages in requests to unreachable brokers (of one client, or of all): they wait
        for that broker (or for ``message_timeout_ms``), and say nothing of whether the rest
        of the cluster answers."""
        with self._lock:
            if not self._unreachable:
                return 0
            return sum(n for (src, node), n in self._messages.items()
                       if node in self._unreachable and source in (None, src))

    def unreachable(self) -> dict[int, Unreachable]:
        with self._lock:
            return dict(self._unreachable)

    def describe(self) -> str:
        """The unreachable brokers in words, for health's reasons ("" : none)."""
        with self._lock:
            return "; ".join(
                f"broker {u.node} ({u.address}) does not answer this agent, "
                f"{len(u.partitions)} partitions wait for it"
                for u in sorted(self._unreachable.values(), key=lambda u: u.node))

    def nodes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._unreachable)
