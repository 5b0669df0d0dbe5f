"""Reading the buffer in order: each topic's messages after its cursor, FIFO, as many as
there is room in flight for; and the discard of what must not be sent (corrupt, an older
generation of its topic, too large, older than its TTL: eligibility.py's rule), with its
reason. Per topic, the loop reads in FIFO order after a cursor; after a restart the cursors
start at the head again, so everything not deleted is sent again (at-least-once).
"""

from __future__ import annotations

import time
from typing import TypeGuard

from agent.buffer import keys
from agent.buffer.store import Corrupt, StoredMessage, messages
from agent.config import TopicConfig
from agent.forwarder import eligibility, holding
from agent.forwarder.flight import LOCAL, Flight
from agent.forwarder.loop_state import LoopState
from agent.forwarder.stuck_topics import NO_PARTITIONS
from agent.forwarder.topic_state import TopicState

# Most expired messages one step discards from a topic it cannot send to (_expire_head).
EXPIRE_PER_STEP = 2000
# While the discard log refuses lines (disk full, or at buffer.discard_log_max_bytes), the
# discarded messages wait in memory (and in the buffer); beyond this many, no new messages
# are read until they can leave, so memory stays bounded. Deliveries go on meanwhile.
MAX_HELD_DISCARDS = 20_000


class Reading(LoopState):
    def _read_and_send(self, now: float) -> bool:
        if self.leaving.held_discards() >= MAX_HELD_DISCARDS:
            return False  # the discard log refuses lines: hold no more (see the constant)
        if now >= self._next_topic_scan:
            present = self.store.topics()
            for t in present:
                self._topics.setdefault(t, TopicState())
            self._present = set(present)
            self._prune_topics()
            self._generations = self.store.generations()
            self._next_topic_scan = now + 0.01
        worked = False
        for topic, st in self._topics.items():
            if self.exactly_once.owns(topic):
                continue  # sent in transactions by self.exactly_once
            room = min(self.per_topic_cap - st.in_flight,
                       self.max_in_flight - self.shared.in_flight)
            if st.recovering:
                if st.retry or st.sending:
                    continue
                st.recovering = False  # everything re-sent has been acknowledged (or left)
            if st.held and not self._rewound(topic, st, now):
                continue  # settling before it reads again from its head (holding.py)
            if room <= 0:
                continue
            if st.drained_at and now - st.drained_at < 0.001:
                continue
            if not self.routing.layout_known(topic):
                # Partitions being looked up (or the cluster is unreachable): the messages
                # wait in the buffer, but the TTL still applies to them.
                worked |= self._expire_head(topic, st, now)
                self.stuck_topics.waiting_for_layout(topic, st, now, topic in self._present)
                continue
            if st.waiting_since:
                st.waiting_since = 0.0
                if st.stuck is not None and st.stuck.error == NO_PARTITIONS:
                    self.stuck_topics.unstuck(topic, st)
            values = self.store.read_values(topic, st.cursor, min(room, 2000))
            if not values:
                st.drained_at = now
                continue
            st.drained_at = 0.0
            worked = True
            settings = self.topic_settings(topic)
            gen = self._generations.get(topic, 0)
            now_ms = int(time.time() * 1000)
            # Messages are in acceptance order: if the newest one read is older than the TTL,
            # the check is needed per message; if the oldest one is younger, for none.
            check_ttl = now_ms - keys.id_timestamp_ms(values[0][0]) > settings.ttl_seconds * 1000
            direct = self.routing.direct(topic, settings)
            if direct is not None:
                # The common case sends from the undecoded values (no object per message).
                self._send_values(topic, values, st, settings, gen, check_ttl, now_ms,
                                  direct[0], direct[1], now)
                continue
            for m in messages(topic, values):
                st.cursor = m.id
                if not self._sendable(m, settings, gen, check_ttl, now_ms):
                    continue
                st.in_flight += 1
                self.shared.in_flight += 1
                self._send(Flight(m, settings), now)
                if st.recovering:
                    break  # it is queued for a retry: the rest of the batch waits behind it
        return worked

    def _rewound(self, topic: str, st: TopicState, now: float) -> bool:
        """False while the topic settles for a rewind (holding.py): it reads nothing then.
        A rewind begins when a partition it holds messages for is in reach again (or the
        oldest held is past its TTL), and is done once nothing of the topic is in flight,
        retried or waiting for its delete; the topic then reads from its head."""
        if not st.rewinding:
            if not holding.rewind_due(st, self.clusters[LOCAL].layout(topic),
                                      self.topic_settings(topic).ttl_seconds, now,
                                      int(time.time() * 1000)):
                return True
            st.rewinding = True
        if not holding.settled(st) or topic in self.leaving.discarded_topics():
            return False
        holding.rewind(st)
        return True

    def _sendable(self, m: StoredMessage | Corrupt, settings: TopicConfig, gen: int,
                  check_ttl: bool, now_ms: int) -> TypeGuard[StoredMessage]:
        """False when ``m`` must not be sent (eligibility.py), and was discarded with its
        reason."""
        why = eligibility.judge(m, settings, gen, settings.max_message_bytes, now_ms, check_ttl)
        if why is None:
            return True
        self._discard_unsendable(m, settings, why)
        return False

    def _discard_unsendable(self, m: StoredMessage | Corrupt, settings: TopicConfig,
                            why: eligibility.Unsendable) -> None:
        """Discard ``m``, not in flight, for the reason the rule gave."""
        if isinstance(m, Corrupt):
            self.leaving.discard_corrupt(m)
        else:
            self.leaving.discard(Flight(m, settings), why.reason, why.detail)

    def _expire_head(self, topic: str, st: TopicState, now: float) -> bool:
        """Discard what cannot be sent at the head of a topic that cannot be sent to right
        now (its partitions unknown): the TTL still applies while its messages wait.

        Messages are in acceptance order, so the expired ones are a prefix; the head leaves
        by the same rule as a message read to be sent (eligibility.py), so one undecodable,
        of an older generation or too large met on the way leaves with them. The first one
        the rule would send ends the call. At most ``EXPIRE_PER_STEP`` a call: a long outage
        can leave millions expired, and what is discarded is held until its batched
        delete."""
        if now < st.expiry_check_at:
            return False
        settings = self.topic_settings(topic)
        gen = self._generations.get(topic, 0)
        max_bytes = settings.max_message_bytes
        now_ms = int(time.time() * 1000)
        worked = False
        budget = EXPIRE_PER_STEP
        while budget > 0:
            want = min(1000, budget)
            batch = self.store.read(topic, st.cursor, want)
            for m in batch:
                why = eligibility.judge(m, settings, gen, max_bytes, now_ms)
                if why is None:
                    st.expiry_check_at = now + 1.0  # the head may be sent: look again later
                    return worked
                self._discard_unsendable(m, settings, why)
                st.cursor = m.id
                worked = True
                budget -= 1
            if len(batch) < want:
                st.expiry_check_at = now + 1.0  # all of the topic expired and discarded
                return worked
        return worked  # more may have expired: the next step goes on, after the delete

    def _prune_topics(self) -> None:
        """Drop the state of topics that hold nothing any more: every step walks every entry,
        so topics that come and go (10,000 in a day is ordinary) must not leave theirs
        behind. Kept: a topic with buffered messages (it is read again at once), any
        state ``TopicState.holds_nothing`` names, and a topic with discards waiting for
        their delete (not in flight, so a fresh cursor would read and discard them again).
        A dropped topic is forgotten by the clusters too (``Cluster.forget``)."""
        topics = self._topics
        if len(topics) == len(self._present):
            return  # every entry has buffered messages: nothing to drop (the common case)
        leaving = self.leaving.discarded_topics()
        gone = [t for t, st in topics.items()
                if st.holds_nothing() and t not in self._present and t not in leaving]
        for t in gone:
            del topics[t]
            for c in self.clusters.values():
                c.forget(t)

