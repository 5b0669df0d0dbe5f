"""Partition choice, as Bruce does it (seed 000).

AnyPartition messages go round-robin over the topic's available partitions. A PartitionKey
message goes to ``sorted_partitions[key % len(sorted_partitions)]``; when that partition has
no leader, to the next partition in the array that has one, and back to its own as soon as it
recovers. Messages with only a Kafka key are left to librdkafka's key hash (Hermes'
Partition-Key), signalled by ``UNASSIGNED``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

UNASSIGNED = -1  # RD_KAFKA_PARTITION_UA: let librdkafka's partitioner choose


@dataclass
class TopicLayout:
    """A topic's partitions (ascending) and which of them have a leader right now: one this
    agent can reach (brokers.py), else Bruce's rule treats it as having none."""

    partitions: tuple[int, ...]
    available: tuple[int, ...]
    # Each partition's leader (node id, -1: none), as the metadata said; empty: not known.
    leaders: tuple[int, ...] = ()
    # The available partitions whose leader this agent reaches, when that is fewer (empty:
    # all of them). AnyPartition messages go round-robin over these; PartitionKey messages
    # keep Bruce's rule on ``available``, so a key moves only when its partition has no
    # leader, never for one agent's network trouble.
    reachable: tuple[int, ...] = ()
    # The round-robin position: the index in the choices of the partition chosen last.
    position: int = field(default=0, repr=False)

    def round_robin(self) -> int:
        choices = self.reachable or self.available or self.partitions
        if not choices:
            return UNASSIGNED
        self.position = (self.position + 1) % len(choices)
        return choices[self.position]

    def route_around(self, unreachable: frozenset[int]) -> None:
        """Set ``available`` (led, as the metadata says) and ``reachable`` (of those, not led
        by a broker out of this agent's reach) from the leaders."""
        if self.leaders:
            pairs = list(zip(self.partitions, self.leaders, strict=True))
            self.available = tuple(p for p, leader in pairs if leader >= 0)
            reachable = tuple(p for p, leader in pairs
                              if leader >= 0 and leader not in unreachable)
            self.reachable = reachable if len(reachable) < len(self.available) else ()

    def all_available(self) -> bool:
        """Every partition has a leader: then ``for_partition_key(k)`` is
        ``partitions[k % n]`` and round-robin goes over ``partitions``, which the
        forwarder's common path computes inline (a method call per message costs more)."""
        return bool(self.partitions) and not self.reachable and (
            not self.available or len(self.available) == len(self.partitions))

    def for_partition_key(self, key: int) -> int:
        parts = self.partitions
        if not parts:
            return UNASSIGNED
        n = len(parts)
        start = (key & 0xFFFFFFFF) % n  # Bruce: static_cast<uint32_t>(partition_key) % n
        if not self.available or len(self.available) == n:
            return parts[start]
        up = set(self.available)
        for step in range(n):
            candidate = parts[(start + step) % n]
            if candidate in up:
                return candidate
        return parts[start]


def choose(layout: TopicLayout | None, partition_key: int | None, hash_key: bool) -> int:
    if partition_key is not None:
        return layout.for_partition_key(partition_key) if layout else UNASSIGNED
    if hash_key or layout is None:
        return UNASSIGNED
    return layout.round_robin()


def key_partition(layout: TopicLayout, partition_key: int | None, hash_key: bool,
                  key: bytes | None) -> int | None:
    """The partition a keyed message goes to: a PartitionKey message's is Bruce's rule, a
    Kafka key's librdkafka's default partitioner (``consistent_random``: CRC-32 of the key
    modulo the partition count, documented in its CONFIGURATION.md). None for a keyless
    message, which may go anywhere. A wrong guess would cost time, never order: one key
    always maps alike."""
    if partition_key is not None:
        return layout.for_partition_key(partition_key)
    if hash_key and key and layout.partitions:
        return zlib.crc32(key) % len(layout.partitions)
    return None


def out_of_reach(layout: TopicLayout, partition: int) -> bool:
    """``partition``'s leader is out of this agent's reach during a partial failure (or it
    has none while the others are reachable): ``layout.reachable`` leaves it out."""
    return bool(layout.reachable) and partition not in layout.reachable


def waits_for_reach(layout: TopicLayout | None, partition_key: int | None, hash_key: bool,
                    key: bytes | None) -> int | None:
    """The partition a keyed message must go to, when its leader is out of this agent's reach
    during a partial failure (``layout.reachable``); else None (reachable, keyless: sent
    round-robin over the reachable ones, or no partial failure). A key cannot move, so the
    message waits for its partition (``key_partition`` says which)."""
    if layout is None or not layout.reachable:
        return None
    partition = key_partition(layout, partition_key, hash_key, key)
    if partition is None or not out_of_reach(layout, partition):
        return None
    return partition
