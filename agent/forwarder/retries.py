"""What a failed send becomes: a discard when Kafka's verdict is final (failures.py says which
errors are), a send to the other cluster for a fallback topic, or a retry with exponential
backoff, re-sent in message-id order behind nothing newer of its topic; a keyed message whose
partition's leader is out of reach is left in the buffer with its partition instead
(holding.py), so that it holds back only its partition, not its topic.

``Retries`` owns the rules and the producers' replacement times; the retry queues are each
topic's (``TopicState.retry``, shared with the loop: shared.py). It sends nothing itself:
the loop hands it its two send acts when it is made (``send``: a retry, to the cluster
routing.py names; ``produce``: the remote cluster's send of a fallback topic), so what it
calls of the loop is named in one place, its constructor.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping

from confluent_kafka import KafkaError

from agent import reasons
from agent.buffer import keys
from agent.forwarder import eligibility, failures, holding, isolation
from agent.forwarder.clusters import Cluster
from agent.forwarder.flight import LOCAL, REMOTE, Flight
from agent.forwarder.leaving import Leaving
from agent.forwarder.shared import Shared, log
from agent.forwarder.stuck_topics import StuckTopics
from agent.forwarder.topic_state import TopicState
from agent.metrics import Registry

# Errors after which an idempotent producer is rebuilt (at most every REPLACE_INTERVAL s).
STALE_PRODUCER = {
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError._MSG_TIMED_OUT,
}
REPLACE_INTERVAL = 5.0


class Retries:
    __slots__ = ("_shared", "_clusters", "_registry", "_leaving", "_stuck_topics",
                 "_backoff_initial", "_backoff_max", "_send", "_produce", "_replaced")

    def __init__(self, shared: Shared, clusters: Mapping[str, Cluster], registry: Registry,
                 leaving: Leaving, stuck_topics: StuckTopics, *, backoff_initial: float,
                 backoff_max: float, send: Callable[[Flight, float], None],
                 produce: Callable[[Flight, str], bool | None]) -> None:
        self._shared = shared
        self._clusters = clusters
        self._registry = registry
        self._leaving = leaving
        self._stuck_topics = stuck_topics
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        # The loop's sends (send.py): ``send(f, now)`` sends a retry where routing.py says;
        # ``produce(f, cluster)`` hands ``f`` to that cluster's producer (True sent, None
        # not now, False refused and already handled as that cluster's failure).
        self._send = send
        self._produce = produce
        # (cluster, acks) -> when its producers were last replaced (monotonic).
        self._replaced: dict[tuple[str, str], float] = {}

    def report_failed(self, f: Flight, cluster: str, err: KafkaError,
                      purge: set[tuple[str, str]]) -> None:
        """A delivery report said ``f``'s send to ``cluster`` failed. ``purge`` collects the
        producers whose queued messages must be failed too (reports.py), to keep key order."""
        code = err.code()
        if err.fatal() or (f.settings.acks == "all" and code in STALE_PRODUCER):
            # An idempotent producer whose id the cluster forgot (e.g. a cluster rebuilt
            # from scratch) never recovers by itself: start a fresh one.
            self.replace_producer(cluster, f.settings.acks, err)
        if failures.answered(code):
            self._clusters[cluster].health.answered()  # the cluster is up, the message is not
        if failures.isolates(code):
            self._refused(f, cluster, err, purge)
            return
        permanent = failures.discards(code)
        if not permanent and code != KafkaError._PURGE_QUEUE:
            purge.add((cluster, f.settings.acks))
        self.failed(f, cluster, err.str() or err.name(), permanent=permanent,
                    code=err.name(), attempt=code != KafkaError._PURGE_QUEUE,
                    operator=failures.needs_operator(code))

    def _refused(self, f: Flight, cluster: str, err: KafkaError,
                 purge: set[tuple[str, str]]) -> None:
        """Kafka refused ``f``'s batch, or ``f`` alone: isolation.py says what follows."""
        code, topic = err.code(), f.msg.topic
        r = f.msg.record
        now_ms = int(time.time() * 1000)
        verdict = isolation.verdict(code, f.alone, f.restamp, r.timestamp_ms,
                                    f.msg.accepted_ms, now_ms)
        detail = f"{err.name()}: {err.str()}"
        if verdict == "discard":
            self._registry.inc("messages_refused", topic=topic, cluster=cluster,
                               error=err.name())
            self.failed(f, cluster, f"refused alone: {detail}", permanent=True,
                        code=err.name())
            return
        # Kept: the messages queued behind it must not overtake its next send (per-key
        # order), as after any failure.
        purge.add((cluster, f.settings.acks))
        if verdict == "clock_skew":
            skew = (r.timestamp_ms - now_ms) / 1000.0
            self.failed(f, cluster, f"{detail} (the message's timestamp is {skew:+.0f} s from "
                        "this host's clock, outside the topic's limits by the broker's: are "
                        "the clocks apart?)", permanent=False, code=err.name(), operator=True)
            return
        self._registry.inc("delivery_failures", topic=topic, cluster=cluster, error=err.name())
        if verdict == "restamp":
            f.restamp = True
            self._registry.inc("messages_restamped", topic=topic)
        elif not f.alone:
            self._registry.inc("messages_isolated", topic=topic)
        f.alone = True
        f.last_error = detail
        if f.pending == 0:
            self.schedule(f, 0.0)

    def replace_producer(self, cluster: str, acks: str, err: KafkaError) -> None:
        """Have ``cluster`` start fresh producers for ``acks`` (at most every
        REPLACE_INTERVAL, unless the error is fatal)."""
        now = time.monotonic()
        if now - self._replaced.get((cluster, acks), 0.0) < REPLACE_INTERVAL and not err.fatal():
            return
        self._replaced[(cluster, acks)] = now
        log.warning("recreating the %s acks=%s producer after %s", cluster, acks, err.str())
        self._clusters[cluster].replace_producer(acks)

    def failed(
        self, f: Flight, cluster: str, error: str, *, permanent: bool, code: str = "error",
        attempt: bool = True, operator: bool = False,
    ) -> None:
        """A send of ``f`` failed: discard it (permanent), or try the other cluster, or
        schedule a retry. ``attempt`` False: Ferry itself withdrew the send (a purge), which
        does not count against ``max_attempts``."""
        f.last_error = error
        self._registry.inc("delivery_failures", topic=f.msg.topic, cluster=cluster, error=code)
        self._registry.sample("error", code, {"topic": f.msg.topic, "cluster": cluster,
                                              "id": keys.id_text(f.msg.id), "detail": error})
        if f.pending > 0:
            # The other cluster may still acknowledge it: its answer decides, even when this
            # one refused the message for good (e.g. the remote cluster's ACLs differ).
            return
        if permanent:
            self._leaving.discard(f, reasons.INVALID, f"{cluster}: {error}", in_flight=True)
            return
        # Hermes' fallback: the local send failed, try the remote datacenter at once.
        if (cluster == LOCAL and f.settings.fallback_to_remote and REMOTE in self._clusters
                and not f.sent_remote and self._produce(f, REMOTE) is not None):
            return  # sent; or refused at once, and already handled as the remote's failure
        if attempt:
            f.attempts += 1
        if attempt and f.settings.max_attempts and f.attempts >= f.settings.max_attempts:
            self._leaving.discard(f, reasons.ATTEMPTS,
                                  f"{f.attempts} attempts, last error: {error}", in_flight=True)
            return
        if attempt:
            self._stuck_topics.stuck(f.msg.topic, code, cluster, error, operator)
        delay = min(self._backoff_initial * (2 ** min(max(f.attempts - 1, 0), 16)),
                    self._backoff_max)
        self.schedule(f, delay)

    def schedule(self, f: Flight, delay: float) -> None:
        """Queue ``f`` to be sent again after ``delay``, behind nothing newer of its topic.

        Retries are kept per topic and re-sent in message-id order, and the topic reads no new
        messages until every retry has been re-sent and every send of the topic has reported:
        otherwise messages accepted later could overtake the failed ones once the cluster is
        back, breaking per-key order within a cluster. Waiting for the re-sent ones to report,
        not just to be re-sent, matters when the network returns just as they time out again:
        librdkafka fails timed-out messages up to a second late, and a newer message queued
        behind them could already be on the wire by then, where no purge can reach it."""
        st = self._shared.topics.setdefault(f.msg.topic, TopicState())
        if self._left_behind(f, st):
            return
        st.recovering = True
        bisect.insort(st.retry, f, key=lambda x: x.msg.id)
        st.retry_at = max(st.retry_at, time.monotonic() + delay)
        self._shared.retry_topics.add(f.msg.topic)

    def _left_behind(self, f: Flight, st: TopicState) -> bool:
        """Leave ``f`` in the buffer with its partition, when its key names one whose leader
        is out of reach (or which holds older messages back): holding.py. It is no longer in
        flight; a rewind reads it again. Not for a fallback topic: the remote cluster may
        take it meanwhile."""
        if f.settings.fallback_to_remote and REMOTE in self._clusters:
            return False
        layout = self._clusters[LOCAL].layout(f.msg.topic)
        if layout is None:
            return False
        r = f.msg.record
        waits = holding.partition_to_hold(layout, st.held, r.partition_key, r.hash_key, r.key)
        if waits is None:
            return False
        holding.hold(st, waits, f.msg.id)
        f.done = True
        st.in_flight -= 1
        self._shared.in_flight -= 1
        return True

    def due(self, now: float, generations: Mapping[str, int]) -> bool:
        """Send again the retries due by ``now``, each topic's in id order, once every
        earlier send of the topic has reported. ``generations``: each topic's current one
        (a retry of a topic deleted since is discarded). True if it did work."""
        worked = False
        now_ms = int(time.time() * 1000)
        topics, retry_topics = self._shared.topics, self._shared.retry_topics
        for topic in list(retry_topics):
            st = topics[topic]
            if st.retry_at > now or st.sending > 0:
                continue  # wait until every earlier send of the topic has reported
            due, st.retry = st.retry, []
            st.retry_at = 0.0
            retry_topics.discard(topic)
            gen = generations.get(topic, 0)
            if any(f.alone for f in due):
                # One of them must go alone: all of them do, through the same producer, or
                # a neighbour sent through the batching one could overtake it (key order).
                for f in due:
                    f.alone = True
            for i, f in enumerate(due):
                if f.done:
                    continue
                worked = True
                # Sent once already, it may not be sent again (eligibility.py): its topic
                # deleted since, or its TTL passed while it waited.
                why = eligibility.judge(f.msg, f.settings, gen,
                                        f.settings.max_message_bytes, now_ms)
                if why is not None:
                    self._leaving.discard(f, why.reason,
                                          f"{why.detail}; last error: {f.last_error}",
                                          in_flight=True)
                    continue
                if self._left_behind(f, st):
                    continue  # its partition's leader went out of reach meanwhile
                f.sent_remote = False
                self._send(f, now)
                if st.retry:
                    # It could not be sent (producer queue full, refused for now) and is queued
                    # again: the ones behind it wait too, or they would overtake it.
                    for g in due[i + 1:]:
                        if not g.done:
                            bisect.insort(st.retry, g, key=lambda x: x.msg.id)
                    break
        return worked
