"""Why acks=all sends go unanswered while a cluster answers probes: too few in-sync replicas.

With fewer in-sync replicas than ``min.insync.replicas``, a partition leader refuses acks=all
writes with NOT_ENOUGH_REPLICAS. The idempotent producer retries that inside librdkafka until
``forwarder.message_timeout_ms``, and only then reports the message, as ``_MSG_TIMED_OUT``:
the broker's answer reaches no callback (only librdkafka's debug log), so the forwarder alone
can only say "sent, none acknowledged". The cluster's own metadata can say more: each
partition's in-sync replicas, and each topic's ``min.insync.replicas``. The probe asks for
them while sends are stalled (agent/forwarder/probe.py) and the cluster's state carries the
answer as its cause (agent/forwarder/health.py).

:func:`shortfalls` is pure (metadata in, findings out); :func:`diagnose` asks the cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # not re-exported
    AdminClient,
    ConfigResource,
    ResourceType,
)

log = logging.getLogger(__name__)

ERROR = "NOT_ENOUGH_REPLICAS"  # the broker's error name, as failures.py and the page show it
MIN_ISR = "min.insync.replicas"
SHOWN_TOPICS = 3  # a reason is read by people: name a few topics, count the rest
# Topics looked at per diagnosis, one metadata request each (a full metadata answer of a
# large shared cluster is megabytes, every probe interval while the sends stall).
MAX_TOPICS = 50


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Partitions of one topic with fewer in-sync replicas than the topic needs."""

    topic: str
    partitions: tuple[int, ...]
    in_sync: int  # the fewest in-sync replicas among them
    needed: int  # the topic's min.insync.replicas

    def __str__(self) -> str:
        parts = ", ".join(map(str, self.partitions))
        word = "partition" if len(self.partitions) == 1 else "partitions"
        return (f"{self.topic} {word} {parts}: {self.in_sync} in-sync "
                f"{'replica' if self.in_sync == 1 else 'replicas'}, "
                f"{MIN_ISR} {self.needed}")


def under_replicated(topics: Mapping[str, Any]) -> dict[str, dict[int, int]]:
    """Per topic, its partitions with fewer in-sync replicas than replicas (partition → number
    in sync), from a metadata answer's ``topics``. Kafka's internal topics (``__...``) are
    left out: Ferry never writes to them."""
    found: dict[str, dict[int, int]] = {}
    for name, topic in topics.items():
        if name.startswith("__") or getattr(topic, "error", None) is not None:
            continue
        short = {pid: len(p.isrs) for pid, p in topic.partitions.items()
                 if len(p.isrs) < len(p.replicas)}
        if short:
            found[name] = short
    return found


def shortfalls(in_sync: Mapping[str, Mapping[int, int]],
               needed: Mapping[str, int]) -> list[Shortfall]:
    """The partitions of ``in_sync`` (from :func:`under_replicated`) below their topic's
    ``needed`` min.insync.replicas; a topic whose setting is unknown is left out."""
    out = []
    for topic in sorted(in_sync):
        need = needed.get(topic)
        if need is None:
            continue
        below = sorted(p for p, n in in_sync[topic].items() if n < need)
        if below:
            out.append(Shortfall(topic, tuple(below), min(in_sync[topic][p] for p in below),
                                 need))
    return out


def describe(found: Sequence[Shortfall]) -> str:
    """The cause as people read it (empty: nothing found)."""
    if not found:
        return ""
    text = "; ".join(str(s) for s in found[:SHOWN_TOPICS])
    if len(found) > SHOWN_TOPICS:
        text += f"; and {len(found) - SHOWN_TOPICS} more topics"
    return f"{ERROR}: {text} (the cluster refuses acks=all writes there)"


def min_insync(admin: AdminClient, topics: Iterable[str], timeout: float) -> dict[str, int]:
    """Each topic's effective min.insync.replicas (its own, else the broker's default)."""
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
    if not resources:
        return {}
    out: dict[str, int] = {}
    for resource, future in admin.describe_configs(resources,
                                                   request_timeout=timeout).items():
        entry = future.result(timeout=timeout).get(MIN_ISR)
        if entry is not None and entry.value is not None:
            out[resource.name] = int(entry.value)
    return out


def diagnose(admin: AdminClient, topics: Sequence[str], timeout: float,
             configs: bool = True) -> str:
    """Ask the cluster which partitions of ``topics`` (Ferry's, at most MAX_TOPICS) are below
    min.insync.replicas; the cause as text, or "" when none is (or the cluster does not
    answer: then the probe's verdict says so). Other teams' topics on a shared cluster are
    not Ferry's business, nor named.

    ``configs`` False: the topics' min.insync.replicas are not asked for (DescribeConfigs
    goes to the controller, which does not take connections now: probe.py says why that
    costs a core): nothing is named then."""
    try:
        metadata: dict[str, Any] = {}
        for topic in topics[:MAX_TOPICS]:
            metadata.update(admin.list_topics(topic, timeout=timeout).topics)
        in_sync = under_replicated({t: m for t, m in metadata.items() if t in topics})
        if not in_sync or not configs:
            return ""
        return describe(shortfalls(in_sync, min_insync(admin, in_sync, timeout)))
    except (KafkaException, TimeoutError, ValueError) as exc:
        log.debug("in-sync replica diagnosis failed: %s", exc)
        return ""
