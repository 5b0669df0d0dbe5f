"""Keyed messages set aside with their partition while its leader is out of this agent's
reach (at-least-once topics sent to the local cluster; brokers.py finds such a broker).

A key cannot move to another partition, and the topic must not stop for it. So a message
whose key names such a partition (``partitioner.key_partition``) is not sent: it stays in the
buffer, and the topic reads on, its other partitions flowing. ``TopicState.held`` maps each
partition set aside to the first message id left behind for it; every later message for
that partition is left behind too, so that none overtakes an older one of its key. A failed
send of such a message (one handed to librdkafka before the broker was found out of reach,
which then times out) is left behind the same way, rather than queued for a retry: the retry
rule re-sends a topic's failed messages before it reads on, and re-sent to that partition
they would stop the whole topic for ``message_timeout_ms`` each time.

They go by a **rewind**, once a held partition's leader answers again (or, at most once a
``TTL_CHECK_SECONDS``, when the oldest one left behind is past its TTL, for the discard it is
owed): the topic stops reading until every send of it has reported, no retry waits and
everything delivered or discarded has left the buffer. The buffer then holds exactly the
topic's undelivered messages, in order, and the topic's cursor goes back to its head: the
read path sends them again in buffer order, checks each as it checks any message
(eligibility.py: the TTL), and leaves behind again those whose partition still waits.
Nothing is kept in memory but one id per partition; the cost is a short pause of the topic
while it settles, and reading again what is left behind.
"""

from __future__ import annotations

import time

from agent.buffer import keys
from agent.forwarder.partitioner import TopicLayout, key_partition, out_of_reach
from agent.forwarder.stuck import Stuck
from agent.forwarder.topic_state import TopicState

# The error a topic's row shows while messages of it are left behind (as exactly-once's).
OUT_OF_REACH = "BROKER_OUT_OF_REACH"
# How often the oldest message left behind is looked at for its TTL (seconds): a message
# past it is discarded up to this late, by a rewind, which costs a read of all held back.
TTL_CHECK_SECONDS = 60.0


def partition_to_hold(layout: TopicLayout, held: dict[int, bytes], partition_key: int | None,
                      hash_key: bool, key: bytes | None) -> int | None:
    """The partition a message must be left behind with (its key's, out of reach or already
    holding older messages of it), or None to send it now."""
    if not held and not layout.reachable:
        return None  # the common case: no partial failure, nothing held
    partition = key_partition(layout, partition_key, hash_key, key)
    if partition is None:
        return None
    if partition in held or out_of_reach(layout, partition):
        return partition
    return None


def hold(st: TopicState, partition: int, mid: bytes) -> None:
    """Leave message ``mid`` behind with ``partition`` (its lowest id is where a rewind must
    begin for it: a failed send may be older than what was left behind since)."""
    first = st.held.get(partition)
    if first is None or mid < first:
        st.held[partition] = mid
    if not st.held_since:
        st.held_since = time.time()


def rewind_due(st: TopicState, layout: TopicLayout | None, ttl_seconds: int, now: float,
               now_ms: int) -> bool:
    """A rewind should begin: a held partition's leader is in reach again, or the oldest
    message held back is past its TTL (looked at once a ``TTL_CHECK_SECONDS``)."""
    if not st.held or st.rewinding:
        return False
    if layout is not None and any(not out_of_reach(layout, p) for p in st.held):
        return True
    if now < st.rewind_check_at:
        return False
    st.rewind_check_at = now + TTL_CHECK_SECONDS
    oldest = min(st.held.values())
    return now_ms - keys.id_timestamp_ms(oldest) > ttl_seconds * 1000


def settled(st: TopicState) -> bool:
    """Nothing of the topic is in flight (sent and not reported, or reported and not yet
    deleted) or waiting for a retry: its buffer holds only what is undelivered."""
    return not (st.in_flight or st.sending or st.retry)


def rewind(st: TopicState) -> None:
    """Read the topic again from its head (``settled`` must hold, and none of its discards
    wait for their delete)."""
    st.cursor = None
    st.held.clear()
    st.held_since = 0.0
    st.rewinding = False
    st.drained_at = 0.0


def row(st: TopicState, cluster: str, brokers: str) -> dict[str, object]:
    """What the topic's row says while messages of it are left behind (its ``stuck``)."""
    parts = ", ".join(str(p) for p in sorted(st.held))
    why = brokers or "in reach again: they are being sent"
    detail = (f"keyed messages for partition{'s' if len(st.held) > 1 else ''} {parts} wait "
              f"in the buffer: the leader is out of this agent's reach ({why}); the topic's "
              "other partitions go on")
    stuck = Stuck(OUT_OF_REACH, cluster, detail, False, since=st.held_since,
                  last=time.time(), failures=0)
    return {**stuck.to_json(), "retrying": 0}
