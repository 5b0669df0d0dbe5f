"""Leaving the buffer: discards (with their discard-log lines) and the batched durable delete
of everything acknowledged or discarded.

Acknowledged and discarded messages leave the buffer in one fsynced transaction per
DELETE_BATCH_SECONDS or DELETE_BATCH_MESSAGES, whichever comes first (forwarder.py). A
discard-log line is written before its message's delete, so a crash between the two leaves a
message in both, never in neither.
"""

from __future__ import annotations

import time

from agent import reasons
from agent.buffer import keys
from agent.buffer.store import Corrupt, Outcome
from agent.forwarder.discard_log import Discard
from agent.forwarder.flight import Flight
from agent.forwarder.leaving_batch import LeavingBatch
from agent.forwarder.loop_state import LoopState, log

# After a failed delete (disk trouble), or a refused discard-log write, try again this late.
DELETE_RETRY_SECONDS = 0.5
DISCARD_LOG_RETRY_SECONDS = 1.0


class Leaving(LoopState):
    def _discard(self, f: Flight, reason: str, detail: str, in_flight: bool = False) -> None:
        f.done = True
        m = f.msg
        d = Discard(reason, m.topic, keys.id_text(m.id), m.accepted_ms, m.record,
                    attempts=f.attempts, detail=detail)
        self._leave(f if in_flight else None,
                    Outcome(m.key, m.stored_bytes, m.topic, "discarded", reason=reason),
                    discard=d)
        log.warning("discarding message %s of %s: %s (%s)", d.message_id, m.topic, reason, detail)

    def _discard_corrupt(self, m: Corrupt) -> None:
        d = Discard(reasons.CORRUPT, m.topic, keys.id_text(m.id), keys.id_timestamp_ms(m.id), None,
                    raw=m.raw, detail=m.error)
        self._leave(None, Outcome(m.key, len(m.key) + len(m.raw), m.topic, "discarded",
                                  reason=reasons.CORRUPT), discard=d)
        log.error("discarding undecodable message %s of %s: %s", d.message_id, m.topic, m.error)

    def _leave(self, f: Flight | None, outcome: Outcome, discard: Discard) -> None:
        lv = self._leaving
        if not len(lv):
            lv.since = time.monotonic()
        lv.outcomes.append(outcome)
        lv.flights.append(f)
        lv.discards.append(discard)

    def _flush_leaving(self) -> None:
        lv = self._leaving
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
            return
        try:
            removed, runs_removed = self.store.remove_many(lv.outcomes[:ready], runs)
        except Exception as exc:  # noqa: BLE001 - disk trouble: keep everything, try later
            self._delete_trouble.failed(exc, len(lv), "retried every "
                                        f"{DELETE_RETRY_SECONDS:g} s")
            lv.retry_at = now + DELETE_RETRY_SECONDS
            return
        self._delete_trouble.worked(ready + lv.delivered)
        # Waits for discarded messages end now (202); acknowledged ones were signalled
        # when their delivery reports came (_handle_reports).
        self._ack_signal.send((), [o.key for o in lv.outcomes[:ready]
                                   if o.state == "discarded"])
        self._leaving = LeavingBatch()
        if ready < len(lv.outcomes):
            rest = self._leaving
            rest.outcomes = lv.outcomes[ready:]
            rest.flights = lv.flights[ready:]
            rest.discards = lv.discards[ready:]
            rest.since = now
            del lv.outcomes[ready:], lv.flights[ready:], lv.discards[ready:]
        reg = self.registry
        delivered: dict[tuple[str, str], int] = {}
        dup: dict[tuple[str, str], int] = {}
        topics = self._topics
        for outcome, f, ok in zip(lv.outcomes, lv.flights, removed, strict=True):
            topic = outcome.topic
            if f is not None:
                st = topics.get(topic)
                if st is not None:
                    st.in_flight -= 1
                self._in_flight -= 1
            if outcome.state == "delivered":
                key = (topic, outcome.cluster)
                target = delivered if ok else dup
                target[key] = target.get(key, 0) + 1
        for run, oks in zip(runs, runs_removed, strict=True):
            # Every message of a run was in flight.
            st = topics.get(run.topic)
            if st is not None:
                st.in_flight -= len(oks)
            self._in_flight -= len(oks)
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
