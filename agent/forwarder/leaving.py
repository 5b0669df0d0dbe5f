"""Leaving the buffer: discards (with their discard-log lines) and the batched durable delete
of everything acknowledged or discarded.

Acknowledged and discarded messages leave the buffer in one fsynced transaction per
DELETE_BATCH_SECONDS or DELETE_BATCH_MESSAGES, whichever comes first (the loop asks
``due``). A discard-log line is written before its message's delete, so a crash between the
two leaves a message in both, never in neither.

``Leaving`` owns what waits for the delete (its ``LeavingBatch``) and the state of its two
kinds of trouble; the other rooms hand it discards (``discard``, ``discard_corrupt``) and
acknowledged runs (``delivered_runs``, ``count_delivered``), and the loop asks it to flush.
Of the loop's state it shares only each topic's ``in_flight`` count (``Shared.topics``); the
loop's own total is the loop's, and ``flush`` says how much to take off it.
"""

from __future__ import annotations

import time

from agent import reasons
from agent.buffer import keys
from agent.buffer.store import Corrupt, DeliveredRun, Outcome, Store
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.forwarder.flight import Flight
from agent.forwarder.leaving_batch import LeavingBatch
from agent.forwarder.shared import Shared, log
from agent.forwarder.trouble import Trouble
from agent.metrics import Registry
from agent.signals.ack import AckSender

# Acknowledged and discarded messages leave the buffer in one fsynced transaction per this
# many seconds or DELETE_BATCH_MESSAGES, whichever comes first. Nothing waits on the delete
# (a 201 is signalled at the delivery report, the space it frees is not needed within
# milliseconds), and each commit costs an fsync and holds the LMDB write lock the intake
# needs: at a few thousand 201s a second, 20 ms rather than 2 ms cut the forwarder's CPU per
# message by about a quarter (docs/design.md). A crash re-sends what was acknowledged but not
# yet deleted, as it always could (at-least-once).
DELETE_BATCH_SECONDS = 0.02
DELETE_BATCH_MESSAGES = 2000
# After a failed delete (disk trouble), or a refused discard-log write, try again this late.
DELETE_RETRY_SECONDS = 0.5
DISCARD_LOG_RETRY_SECONDS = 1.0


class Leaving:
    def __init__(self, shared: Shared, store: Store, registry: Registry,
                 discard_log: DiscardLog, ack_signal: AckSender) -> None:
        self._topics = shared.topics
        self.store = store
        self.registry = registry
        self.discard_log = discard_log  # an attribute: tests swap in one that refuses lines
        self._ack_signal = ack_signal  # ends the waits of discarded messages (202)
        self._batch = LeavingBatch()
        self._delete_trouble = Trouble("removing messages from the buffer", registry,
                                       "buffer_delete")
        self._log_trouble = Trouble("writing the discard log", registry, "discard_log")
        self._log_retry_at = 0.0

    # -- what the other rooms hand over ---------------------------------------------------
    def discard(self, f: Flight, reason: str, detail: str, in_flight: bool = False) -> None:
        f.done = True
        m = f.msg
        d = Discard(reason, m.topic, keys.id_text(m.id), m.accepted_ms, m.record,
                    attempts=f.attempts, detail=detail)
        self._leave(f if in_flight else None,
                    Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=reason),
                    discard=d)
        log.warning("discarding message %s of %s: %s (%s)", d.message_id, m.topic, reason, detail)

    def discard_corrupt(self, m: Corrupt) -> None:
        d = Discard(reasons.CORRUPT, m.topic, keys.id_text(m.id), keys.id_timestamp_ms(m.id), None,
                    raw=m.raw, detail=m.error)
        self._leave(None, Outcome(m.key, len(m.key) + len(m.raw), m.topic, "discarded",
                                  reason=reasons.CORRUPT), discard=d)
        log.error("discarding undecodable message %s of %s: %s", d.message_id, m.topic, m.error)

    def delivered_runs(self, now: float) -> dict[tuple[str, str], DeliveredRun]:
        """Where acknowledged messages wait for the delete: a run per topic and cluster
        (``DeliveredRun``), which the caller creates when missing and appends to, columns at
        a time, then counts what it added with ``count_delivered``. Valid until the next
        ``flush``."""
        lv = self._batch
        if not len(lv):
            lv.since = now
        return lv.runs

    def count_delivered(self, n: int) -> None:
        self._batch.delivered += n

    # -- what the loop and the reader ask -------------------------------------------------
    def waiting(self) -> int:
        """Messages waiting for the delete: acknowledged, and discarded."""
        return len(self._batch)

    def due(self, now: float) -> bool:
        """Whether the batched delete is due (DELETE_BATCH_SECONDS, DELETE_BATCH_MESSAGES),
        and not held back by a failed one."""
        lv = self._batch
        n = len(lv)
        return bool(n) and now >= lv.retry_at and (n >= DELETE_BATCH_MESSAGES
                                                   or now - lv.since >= DELETE_BATCH_SECONDS)

    def held_discards(self) -> int:
        """Discards waiting for their discard-log lines (the log refusing them)."""
        lv = self._batch
        return len(lv.discards) - lv.logged

    def discarded_topics(self) -> set[str]:
        """Topics with discards waiting for their delete: read, not in flight, not gone."""
        lv = self._batch
        return lv.discarded_topics() if lv.outcomes else set()

    def discards(self) -> list[Discard]:
        """The discards waiting for their delete (the list itself: read, do not change)."""
        return self._batch.discards

    # -- the delete -------------------------------------------------------------------------
    def _leave(self, f: Flight | None, outcome: Outcome, discard: Discard) -> None:
        lv = self._batch
        if not len(lv):
            lv.since = time.monotonic()
        lv.outcomes.append(outcome)
        lv.flights.append(f)
        lv.discards.append(discard)

    def flush(self) -> int:
        """The batched durable delete of what may leave now. Returns how many of the messages
        that left were in flight: the loop's count of them (its own) goes down by that many;
        each topic's count is taken off here."""
        lv = self._batch
        now = time.monotonic()
        # Discard-log lines first: a crash between the two leaves a message in both.
        # Each line once: after a failed delete only the discards added since are new.
        if lv.logged < len(lv.discards) and now >= self._log_retry_at:
            try:
                self.discard_log.write(lv.discards[lv.logged:])
            except Exception as exc:  # noqa: BLE001 - disk full, log at its limit: later
                self._log_retry_at = now + DISCARD_LOG_RETRY_SECONDS
                self._log_trouble.failed(exc, len(lv.discards) - lv.logged,
                                         "and deliveries go on meanwhile")
            else:
                self._log_trouble.worked(len(lv.discards) - lv.logged)
                lv.logged = len(lv.discards)
        # What may leave now: every acknowledged run, and the discards in the discard log.
        # The rest waits for the log without holding up deliveries.
        ready = lv.logged
        runs = list(lv.runs.values())
        if not runs and not ready:
            lv.retry_at = self._log_retry_at
            return 0
        try:
            removed, runs_removed = self.store.remove_many(lv.outcomes[:ready], runs)
        except Exception as exc:  # noqa: BLE001 - disk trouble: keep everything, try later
            self._delete_trouble.failed(exc, len(lv), "retried every "
                                        f"{DELETE_RETRY_SECONDS:g} s")
            lv.retry_at = now + DELETE_RETRY_SECONDS
            return 0
        self._delete_trouble.worked(ready + lv.delivered)
        # Waits for discarded messages end now (202); acknowledged ones were signalled
        # when their delivery reports came (reports.py).
        self._ack_signal.send((), [o.key for o in lv.outcomes[:ready]
                                   if o.state == "discarded"])
        self._batch = LeavingBatch()
        if ready < len(lv.outcomes):
            rest = self._batch
            rest.outcomes = lv.outcomes[ready:]
            rest.flights = lv.flights[ready:]
            rest.discards = lv.discards[ready:]
            rest.since = now
            del lv.outcomes[ready:], lv.flights[ready:], lv.discards[ready:]
        reg = self.registry
        delivered: dict[tuple[str, str], int] = {}
        dup: dict[tuple[str, str], int] = {}
        topics = self._topics
        left_flight = 0
        for outcome, f, ok in zip(lv.outcomes, lv.flights, removed, strict=True):
            topic = outcome.topic
            if f is not None:
                st = topics.get(topic)
                if st is not None:
                    st.in_flight -= 1
                left_flight += 1
            if outcome.state == "delivered":
                key = (topic, outcome.cluster)
                target = delivered if ok else dup
                target[key] = target.get(key, 0) + 1
        for run, oks in zip(runs, runs_removed, strict=True):
            # Every message of a run was in flight.
            st = topics.get(run.topic)
            if st is not None:
                st.in_flight -= len(oks)
            left_flight += len(oks)
            key = (run.topic, run.cluster)
            n = sum(oks)
            if n:
                delivered[key] = delivered.get(key, 0) + n
            if n < len(oks):
                dup[key] = dup.get(key, 0) + len(oks) - n
        for (topic, cluster), n in delivered.items():
            reg.inc("messages_delivered", n, topic=topic, cluster=cluster)
        for (topic, cluster), n in dup.items():
            reg.inc("messages_duplicate_acks", n, topic=topic, cluster=cluster)
        for d in lv.discards:
            reg.inc("messages_discarded", topic=d.topic, reason=d.reason)
            reg.sample("discarded", d.reason, {"topic": d.topic, "id": d.message_id,
                                               "detail": d.detail})
        return left_flight
