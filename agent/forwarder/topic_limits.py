"""What a topic on the cluster can take: its ``max.message.bytes``, timestamp limits and
cleanup policy, learnt by describing its configuration (DescribeConfigs), and the producer
batch size that follows from them.

Kafka refuses a whole record batch larger than the topic's ``max.message.bytes``, and
librdkafka builds batches up to its ``batch.size`` (1,000,000 bytes) whatever the topic: a
topic limited below that would see batch after batch refused. Ferry sends such a topic
through a producer whose ``batch.size`` fits under the limit (``batch_bytes``), so an ordinary
burst is never refused; a refusal that still happens is isolated (isolation.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # not re-exported
    AdminClient,
    ConfigResource,
)

log = logging.getLogger(__name__)

# librdkafka's default batch.size: a topic whose limit is at least this needs nothing else.
DEFAULT_BATCH_BYTES = 1_000_000
# Room left under the topic's limit for what the broker counts besides the records librdkafka
# counts in batch.size: the compression codec's framing of an incompressible batch.
MARGIN = 512
# batch_bytes' answer for "send each message in a batch of its own".
ALONE = 1
# The smallest batch worth building; a topic limited below this sends messages alone.
SMALLEST_BATCH = 1024


@dataclass(frozen=True, slots=True)
class TopicLimits:
    max_message_bytes: int
    compacted: bool = False
    before_max_ms: int | None = None
    after_max_ms: int | None = None


def _int(entries: dict[str, object], name: str) -> int | None:
    entry = entries.get(name)
    value = getattr(entry, "value", None)
    try:
        return int(str(value)) if value is not None else None
    except ValueError:
        return None


def describe(admin: AdminClient, topics: list[str], timeout: float
             ) -> dict[str, TopicLimits]:
    """The limits of each of ``topics`` the cluster describes (a topic it cannot describe,
    missing or denied, is left out: its sends find out the usual way)."""
    if not topics:
        return {}
    resources = [ConfigResource("topic", t) for t in topics]
    futures = admin.describe_configs(resources, request_timeout=timeout)
    found: dict[str, TopicLimits] = {}
    for resource, future in futures.items():
        try:
            entries = future.result(timeout)
        except KafkaException as exc:
            log.debug("describing topic %s failed: %s", resource.name, exc)
            continue
        size = _int(entries, "max.message.bytes")
        if size is None:
            continue
        policy = str(getattr(entries.get("cleanup.policy"), "value", "") or "")
        found[resource.name] = TopicLimits(
            max_message_bytes=size,
            compacted="compact" in policy,
            before_max_ms=_int(entries, "message.timestamp.before.max.ms"),
            after_max_ms=_int(entries, "message.timestamp.after.max.ms"),
        )
    return found


def batch_bytes(limits: TopicLimits | None) -> int:
    """The producer ``batch.size`` for a topic: 0 for librdkafka's default (the topic takes
    it), ``ALONE`` for a topic too small to batch in, else the largest power of two that
    leaves ``MARGIN`` under the topic's limit (powers of two, so topics with near limits
    share one producer)."""
    if limits is None or limits.max_message_bytes >= DEFAULT_BATCH_BYTES + MARGIN:
        return 0
    room = limits.max_message_bytes - MARGIN
    if room < SMALLEST_BATCH:
        return ALONE
    return 1 << (room.bit_length() - 1)
