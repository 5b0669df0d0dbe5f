"""Isolation: a refusal costs exactly the refused message.

Kafka validates a record batch as a whole and refuses it whole (too large for the topic, one
record with a bad timestamp or without the key a compacted topic needs), and librdkafka fails
every message of the batch with that error, or with ``_INVALID_DIFFERENT_RECORD`` for the
innocent ones when the broker named the culprit (KIP-467). Neither says for sure which
message is at fault, so a message failed with an isolating error (failures.py) is sent again
in a batch of its own, and only Kafka's answer to that send is its verdict:

- acknowledged: delivered, like any other;
- refused with a per-record error: discarded as ``invalid`` with Kafka's error, counted in
  ``messages_refused{error}`` (and ``messages_discarded{reason="invalid"}``);
- refused for its timestamp: the timestamp rule decides (timestamps.py), which never
  discards a message for the time it waited in the buffer.

The at-least-once loop sends an isolated message through a producer that puts one message
in each batch (``Cluster.producer(acks, ALONE)``); the exactly-once loop sends it between two
flushes of its transactional producer (transactions.py). Both decide through ``verdict``.
"""

from __future__ import annotations

from typing import Literal

from confluent_kafka import KafkaError

from agent.forwarder import failures, timestamps

Verdict = Literal["isolate", "discard", "restamp", "clock_skew"]


def verdict(code: int, alone: bool, restamped: bool, ts_ms: int, accepted_ms: int,
            now_ms: int) -> Verdict:
    """What a message failed with the isolating error ``code`` becomes.

    ``alone``: it was sent in a batch of its own (the answer is about it alone);
    ``restamped``: it was sent stamped with the send time (timestamps.py)."""
    if not alone or not failures.refused_alone(code):
        return "isolate"  # a batch's verdict (or an innocent neighbour's): send it alone
    if code != KafkaError.INVALID_TIMESTAMP:
        return "discard"
    if restamped:
        # Stamped with this host's time and still refused: the clocks disagree; keep it.
        return "clock_skew"
    rule = timestamps.verdict(ts_ms, accepted_ms, now_ms)
    if rule == "refuse":
        return "discard"
    return "restamp" if rule == "restamp" else "clock_skew"
