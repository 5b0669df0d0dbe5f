"""One cluster's state, as every reader sees it: ``unknown``, ``up`` or ``down``, and why.

Two witnesses decide it, never the mere absence of traffic:

- **probes**: a metadata request every ``probe_interval_seconds`` (agent/forwarder/probe.py),
  sent whether or not there is anything to deliver;
- **sends**: messages handed to the cluster and not answered yet, and messages it failed
  that wait to be sent to it again (a retry's back-off, a send withdrawn to keep per-key
  order): both are "sent, none acknowledged" until one is.

The rules (docs/design.md, "Cluster state"):

- ``unknown`` only until the first probe answers or fails;
- a cluster that never answered is ``down`` as soon as a probe fails; one that answered is
  ``down`` once probes have failed for ``outage_after_seconds`` since the first failure;
- ``down`` too while sends are outstanding (in the producers, or waiting for a retry) and
  nothing was acknowledged for ``outage_after_seconds`` since they became outstanding (or
  since the last acknowledgement, whichever is later), even while every probe answers: with
  the KRaft quorum lost a surviving broker answers metadata requests, but no acks=all write
  completes. An idle cluster has nothing outstanding, so idleness never counts;
- otherwise ``up``.

While sends go unanswered for ``outage_after_seconds``, the probe asks the cluster whether
partitions of Ferry's topics are below ``min.insync.replicas`` (agent/forwarder/insync.py):
if so, that is the cause every ``down`` reason names, rather than the client's last error
(with nodes stopped, a connect error to one of them, which is not why).

Pure logic with an explicit clock (monotonic seconds), so the rules are unit-tested without a
broker. The probe thread and the forwarder's thread both call in; a lock keeps it whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["unknown", "up", "down"]

# Nothing outstanding counts once it lasted this long: between a failed send and its place in
# the forwarder's retry queue (a replaced producer's reports served a step later) a message
# is briefly in neither count, and that gap is no delivery. Short: a longer wait let a send
# counted a step late hold a cluster "busy" through every gap (a missing topic read as an
# outage).
SETTLE_SECONDS = 0.25


@dataclass(frozen=True, slots=True)
class Change:
    """A state change, for the caller to log (rate-limited) and count."""

    cluster: str
    old: State
    new: State
    reason: str
    after_seconds: float  # how long the old state lasted


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the status documents show about a cluster (times are wall-clock seconds)."""

    state: State
    reason: str
    since: float
    last_probe_time: float | None
    last_probe_ok: bool | None
    last_error: str
    errors: int
    in_sync_shortfall: str = ""

    def to_json(self) -> dict[str, object]:
        return {"state": self.state, "reason": self.reason, "since": self.since,
                "last_probe_time": self.last_probe_time, "last_probe_ok": self.last_probe_ok,
                "last_error": self.last_error, "errors": self.errors,
                "in_sync_shortfall": self.in_sync_shortfall}


class ClusterHealth:
    def __init__(self, name: str, outage_after: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.outage_after = outage_after
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        # Read without the lock on the forwarder's hot path (routing): a str is swapped whole.
        self.state: State = "unknown"
        self.reason = "no probe answered yet"
        self._since = clock()
        self._since_wall = wall()
        self._answered = False  # some probe ever answered
        self._probe_failing_since: float | None = None
        self._probe_error = ""
        self._last_probe_time: float | None = None
        self._last_probe_ok: bool | None = None
        self._busy_since: float | None = None  # sends outstanding since (None: none)
        self._settling_since: float | None = None  # nothing outstanding since (busy still)
        self._last_ack = float("-inf")
        self._last_answer = float("-inf")  # a send refused by the cluster's own verdict
        self._outstanding = 0
        self._retrying = 0  # failed here, waiting to be sent again (counted as unanswered)
        self.last_error = ""  # the client's last error report (e.g. a connect error)
        self.in_sync_shortfall = ""  # insync.describe() of the probe's last diagnosis
        self.brokers_unreachable = ""  # brokers.BrokerWatch.describe(): "" when none
        self._partial = ""  # the reason shown while up with brokers out of reach
        self._partial_failure = False  # at most half of the brokers out of reach
        self._cause_held = False  # last_error is a specific cause, not answered away since
        self.errors = 0
        self._changes: list[Change] = []

    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def down(self) -> bool:
        return self.state == "down"

    # -- witnesses ---------------------------------------------------------------------------
    def probe_answered(self, brokers: int) -> None:
        with self._lock:
            self._answered = True
            self._probe_failing_since = None
            self._probe_error = ""
            self._last_probe_time = self._wall()
            self._last_probe_ok = True
            self._cause_held = False
            self._decide(f"answered a metadata request ({brokers} brokers)")

    def probe_failed(self, error: str) -> None:
        with self._lock:
            now = self._clock()
            if self._probe_failing_since is None:
                self._probe_failing_since = now
            self._probe_error = error
            self._last_probe_time = self._wall()
            self._last_probe_ok = False
            self._decide("")

    def client_error(self, error: str, generic: bool = False) -> None:
        """librdkafka's error callback: kept as the likely cause, not a verdict by itself
        (an idle connection closed by the broker reports "all brokers down" too).

        ``generic``: "all brokers are down", which librdkafka reports *after* the error that
        took them down (refused credentials, a failed TLS handshake) and reports only once:
        it does not replace that cause until the cluster answers again."""
        with self._lock:
            if not (generic and self._cause_held):
                self.last_error = error
                self._cause_held = not generic
            self.errors += 1

    def acknowledged(self) -> None:
        with self._lock:
            self._last_ack = self._clock()
            self.in_sync_shortfall = ""  # writes are taken again
            self._cause_held = False
            if self.state != "up":
                self._decide("acknowledged a message")

    def answered(self) -> None:
        """A send failed with the cluster's verdict on it (an unknown topic, an ACL, a
        message too large: failures.answered): the cluster answers, so its sends do not count
        as unanswered from before this. Not an acknowledgement: it neither outweighs failing
        probes nor says anything got through. Without it, one topic missing on the cluster
        (its messages retried, so always outstanding) made the whole cluster down, and sent
        every fallback topic to the remote one."""
        with self._lock:
            self._last_answer = self._clock()
            if self.state == "down" and self._busy_since is not None:
                self._decide("answered a send (with an error about the message)")

    def sends(self, outstanding: int, retrying: int = 0) -> None:
        """How many sends the cluster holds unanswered now, and how many messages it failed
        wait for a retry to it (called every forwarder step).

        A message between a failed send and its retry is as unacknowledged as one in flight:
        were it not counted, every retry's back-off (or a message timeout shorter than
        ``outage_after_seconds``) would restart the clock, and a cluster that acknowledges
        nothing would read ``up`` whenever its probes answer."""
        total = outstanding + retrying
        if (outstanding == self._outstanding and retrying == self._retrying
                and (self._busy_since is None if total == 0 else self.state == "down")):
            return  # nothing new to judge: the common idle and busy-down cases, lock-free
        with self._lock:
            now = self._clock()
            if total == 0:
                # Idle again only once it lasts (SETTLE_SECONDS).
                if self._settling_since is None:
                    self._settling_since = now
                if now - self._settling_since >= SETTLE_SECONDS:
                    self._busy_since = self._settling_since = None
            else:
                self._settling_since = None
                if self._busy_since is None:
                    self._busy_since = now
            self._outstanding = outstanding
            self._retrying = retrying
            self._decide("")

    def stalled(self) -> bool:
        """Sends outstanding and none acknowledged for ``outage_after_seconds``: the time to
        ask the cluster why (insync.py), as the probe does."""
        busy = self._busy_since
        return busy is not None and (self._clock() - max(busy, self._last_ack)
                                     >= self.outage_after)

    def diagnosed(self, shortfall: str) -> None:
        """The probe's in-sync replica diagnosis while stalled ("" : nothing short)."""
        with self._lock:
            self.in_sync_shortfall = shortfall
            self._decide("")

    def unreachable(self, brokers: str, partial: bool = False) -> None:
        """Brokers out of this agent's reach (brokers.py), in words; "" when none. A cause
        for a ``down`` reason, and shown while ``up`` (the other brokers answer).

        ``partial``: at most half of the brokers. The probe asks one broker, maybe the cut
        one; its failures then say no more than the broker watch already does, and do not
        make the cluster down (its sends still can, counted without the stranded ones)."""
        if brokers == self.brokers_unreachable and partial == self._partial_failure:
            return
        with self._lock:
            self.brokers_unreachable = brokers
            self._partial_failure = partial
            self._decide("")

    def check(self) -> None:
        """Re-judge with the time that passed (called every forwarder step)."""
        if self.state == "down" and self._busy_since is not None:
            return
        if self._busy_since is None and self._probe_failing_since is None:
            return
        with self._lock:
            self._decide("")

    # -- the rules ---------------------------------------------------------------------------
    def _verdict(self, now: float) -> tuple[State, str]:
        limit = self.outage_after
        failing = self._probe_failing_since
        # A shortfall of in-sync replicas, once the probe found one, is why; the client's last
        # error (with nodes stopped, a connect error to one of them) is not.
        found = self.in_sync_shortfall or self.brokers_unreachable or self.last_error
        cause = f": {found}" if found else ""
        # An acknowledgement after the probes began failing proves the cluster works; so does
        # a partial failure (unreachable()), once the cluster answered.
        if failing is not None and self._last_ack < failing and not (
                self._answered and self._partial_failure):
            if not self._answered:
                return "down", f"no answer to a metadata request ({self._probe_error}){cause}"
            if now - failing >= limit:
                return "down", (f"no answer to metadata requests for {now - failing:.0f} s "
                                f"({self._probe_error}){cause}")
        busy = self._busy_since
        if busy is not None:
            quiet = now - max(busy, self._last_ack, self._last_answer)
            if quiet >= limit:
                waiting = self._outstanding + self._retrying
                return "down", (f"{waiting} messages sent, none acknowledged for "
                                f"{quiet:.0f} s{cause}")
        if self._answered or self._last_ack > float("-inf"):
            return "up", self.brokers_unreachable
        if failing is not None and self._last_ack < failing:
            return "down", f"no answer to a metadata request ({self._probe_error}){cause}"
        return "unknown", "no probe answered yet"

    def _decide(self, why_up: str) -> None:
        now = self._clock()
        state, reason = self._verdict(now)
        if state == "up" and not reason:
            # A partial failure (brokers out of reach) is the reason while it lasts; once it
            # is over, the last whole reason is not its text.
            keep = self.state == "up" and self.reason != self._partial
            reason = why_up or self.reason if keep else (why_up or "answering")
        self._partial = reason if state == "up" and reason == self.brokers_unreachable else ""
        if state != self.state:
            self._changes.append(Change(self.name, self.state, state, reason,
                                        now - self._since))
            self.state = state
            self._since = now
            self._since_wall = self._wall()
        self.reason = reason

    # -- reading -----------------------------------------------------------------------------
    def changes(self) -> list[Change]:
        """State changes since the last call, oldest first."""
        with self._lock:
            out, self._changes = self._changes, []
            return out

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self.state, self.reason, self._since_wall, self._last_probe_time,
                            self._last_probe_ok, self.last_error, self.errors,
                            self.in_sync_shortfall)
