"""Messages of every shape a forwarder send path must carry unchanged (for the send-path
tests of the at-least-once loop and of the exactly-once thread)."""

from __future__ import annotations

from agent.records import Record


def records_of_every_kind(topic: str) -> list[Record]:
    """Round-robin, partition keys (one negative), a hashed key, a key with AnyPartition, an
    empty value, and one with headers of its own (the general path, not the plain one)."""
    return [
        Record(topic, b"any-1", timestamp_ms=1_000_001),  # round-robin
        Record(topic, b"pk-7", partition_key=7, timestamp_ms=1_000_002),
        Record(topic, b"pk-neg", key=b"k-neg", partition_key=-3, timestamp_ms=1_000_003),
        Record(topic, b"hashed", key=b"account-9", hash_key=True, timestamp_ms=1_000_004),
        Record(topic, b"keyed-any", key=b"bruce-key", timestamp_ms=1_000_005),
        Record(topic, b"", key=b"empty", partition_key=2, timestamp_ms=1_000_006),
        Record(topic, b"with-headers", partition_key=1, timestamp_ms=1_000_007,
               headers=(("trace", b"t-1"), ("empty", b""))),
        Record(topic, b"any-2", timestamp_ms=1_000_008),
    ]
