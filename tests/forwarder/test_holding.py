"""Keyed messages left behind with their partition while its leader is out of reach
(agent/forwarder/holding.py): the rule alone, then the forwarder's loop over a fake cluster
whose test decides which broker is out of reach and when each send is answered. (The same on
real Apache Kafka with a broker cut off: tests/forwarder/test_kafka_partial.py.)"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest

from agent.buffer import keys
from agent.config import TopicConfig
from agent.forwarder import holding
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.partitioner import TopicLayout
from agent.forwarder.topic_state import TopicState
from agent.records import Record
from tests.forwarder.fakes import FakeCluster, Setup, run_until, steps_until

# Partitions 0-3, led by brokers 1, 2, 1, 2.
LEADERS = (1, 2, 1, 2)


def layout(unreachable: frozenset[int]) -> TopicLayout:
    lay = TopicLayout((0, 1, 2, 3), (0, 1, 2, 3), leaders=LEADERS)
    lay.route_around(unreachable)
    return lay


# -- the rule --------------------------------------------------------------------------------


def test_a_key_whose_partition_is_out_of_reach_is_held_and_keyless_never_is() -> None:
    cut = layout(frozenset({2}))
    assert [holding.partition_to_hold(cut, {}, k, False, None) for k in range(4)] == [
        None, 1, None, 3]
    assert holding.partition_to_hold(cut, {}, None, False, None) is None
    key = next(k for k in (b"k%d" % i for i in range(100)) if zlib.crc32(k) % 4 == 3)
    assert holding.partition_to_hold(cut, {}, None, True, key) == 3


def test_once_held_a_partition_holds_every_later_message_of_it_until_the_rewind() -> None:
    """Back in reach, a partition with older messages left behind keeps holding the newer
    ones: they would overtake the older ones of their key."""
    whole = layout(frozenset())
    assert holding.partition_to_hold(whole, {}, 1, False, None) is None
    assert holding.partition_to_hold(whole, {1: b"x"}, 1, False, None) == 1
    assert holding.partition_to_hold(whole, {1: b"x"}, 0, False, None) is None


def test_the_first_id_held_is_the_lowest_and_a_rewind_reads_from_the_head() -> None:
    st = TopicState(cursor=b"c")
    holding.hold(st, 1, b"\x05")
    holding.hold(st, 1, b"\x09")
    holding.hold(st, 1, b"\x02")  # a failed send, older than what was left behind since
    holding.hold(st, 3, b"\x07")
    assert st.held == {1: b"\x02", 3: b"\x07"} and st.held_since > 0
    st.rewinding = True
    holding.rewind(st)
    assert st.cursor is None and st.held == {} and not st.rewinding and not st.held_since


def test_a_rewind_is_due_when_a_held_partition_is_in_reach_or_the_oldest_is_past_its_ttl(
) -> None:
    now_ms = int(time.time() * 1000)
    st = TopicState()
    mid = keys.make_id(now_ms - 120_000, 0)  # accepted two minutes ago
    holding.hold(st, 1, mid)
    cut = layout(frozenset({2}))
    # Still out of reach, younger than its TTL: no rewind.
    assert not holding.rewind_due(st, cut, 3600, 0.0, now_ms)
    # Past its TTL: one is due, looked at once a TTL_CHECK_SECONDS.
    st.rewind_check_at = 0.0
    assert holding.rewind_due(st, cut, 60, 0.0, now_ms)
    assert not holding.rewind_due(st, cut, 60, 1.0, now_ms)
    # In reach again: due at once.
    assert holding.rewind_due(st, layout(frozenset()), 3600, 1.0, now_ms)
    # Partitions not known (None): only the TTL can make one due.
    assert not holding.rewind_due(st, None, 3600, 1.0, now_ms)


# -- the loop --------------------------------------------------------------------------------


class CutOff(FakeCluster):
    """Four partitions led by brokers 1, 2, 1, 2; the test sets which are out of reach.
    Each produce() is recorded with its partition."""

    def __init__(self) -> None:
        super().__init__()
        self.lay = layout(frozenset())
        self.partitions: list[tuple[bytes, int]] = []
        produce = self.p.produce

        def recorded(topic: str, value: bytes, key: bytes | None = None,
                     partition: int = -1, *args: Any, **kwargs: Any) -> None:
            self.partitions.append((value, partition))
            produce(topic, value, key, partition, *args, **kwargs)

        self.p.produce = recorded  # type: ignore[method-assign]

    def cut(self, *nodes: int) -> None:
        self.lay.route_around(frozenset(nodes))

    def layout(self, topic: str) -> TopicLayout:
        return self.lay

    def ack_all(self) -> None:
        for value, _ in list(self.p.pending):
            self.p.ack(value)


def _loop(setup: Setup) -> tuple[Forwarder, CutOff]:
    cluster = CutOff()
    return setup.forwarder({"local": cluster}), cluster


def _sent(cluster: CutOff, partition: int) -> list[bytes]:
    return [v for v, p in cluster.partitions if p == partition]


def _stuck(fwd: Forwarder) -> dict[str, Any]:
    fwd.cluster_watch.gauges()
    info: dict[str, Any] = fwd.registry.view().info.get("stuck_topics") or {}
    return info


def test_the_reachable_partitions_flow_while_keys_of_a_cut_one_wait_then_go_in_order(
    setup: Setup,
) -> None:
    fwd, cluster = _loop(setup)
    cluster.cut(2)  # partitions 1 and 3 wait
    setup.store.append([[Record("t", b"k%d-%d" % (k, i), partition_key=k)
                         for i in range(3) for k in range(4)]])
    assert steps_until(fwd, lambda: len(cluster.partitions) == 6)
    assert not steps_until(fwd, lambda: len(cluster.partitions) > 6, limit=300)
    assert {p for _, p in cluster.partitions} == {0, 2}
    cluster.ack_all()
    assert steps_until(fwd, lambda: sum(s.messages for s in setup.store.topic_stats()) == 6)
    # More arrives: the reachable partitions keep flowing, keyless messages too.
    setup.store.append([[Record("t", b"k0-3", partition_key=0), Record("t", b"free")]])
    assert steps_until(fwd, lambda: len(cluster.partitions) == 8)
    row = _stuck(fwd)["t"]
    assert row["error"] == "BROKER_OUT_OF_REACH" and "partitions 1, 3" in row["detail"], row
    cluster.ack_all()

    cluster.cut()  # in reach again: the topic settles, reads from its head
    assert steps_until(fwd, lambda: len(cluster.partitions) == 14)
    assert _sent(cluster, 1) == [b"k1-0", b"k1-1", b"k1-2"]
    assert _sent(cluster, 3) == [b"k3-0", b"k3-1", b"k3-2"]
    cluster.ack_all()
    assert steps_until(fwd, lambda: not setup.store.topic_stats())
    assert "t" not in _stuck(fwd)
    assert fwd.registry.view().total("messages_delivered", topic="t") == 14


def test_a_send_to_a_cut_partition_that_times_out_waits_there_without_stopping_the_topic(
    setup: Setup,
) -> None:
    """Handed to librdkafka before the broker was found out of reach, it times out: it is
    left behind with its partition (not retried, which would hold the topic), and goes
    first when the partition answers, before the newer ones of its key."""
    fwd, cluster = _loop(setup)
    setup.store.append([[Record("t", b"old-1", partition_key=1),
                         Record("t", b"old-0", partition_key=0)]])
    assert steps_until(fwd, lambda: len(cluster.partitions) == 2)
    cluster.cut(2)
    setup.store.append([[Record("t", b"new-1", partition_key=1)]])
    cluster.p.ack(b"old-0")
    cluster.p.fail(b"old-1")  # timed out
    assert steps_until(fwd, lambda: fwd.stats()["in_flight"] == 0)
    assert fwd.stats()["retries"] == 0
    # The topic reads on: a new message for a reachable partition goes at once.
    setup.store.append([[Record("t", b"new-0", partition_key=0)]])
    assert steps_until(fwd, lambda: _sent(cluster, 0) == [b"old-0", b"new-0"])
    assert _sent(cluster, 1) == [b"old-1"]
    cluster.ack_all()

    cluster.cut()
    assert steps_until(fwd, lambda: len(_sent(cluster, 1)) == 3)
    assert _sent(cluster, 1) == [b"old-1", b"old-1", b"new-1"]
    cluster.ack_all()
    assert steps_until(fwd, lambda: not setup.store.topic_stats())


def test_a_retry_due_while_its_partition_is_cut_waits_there(setup: Setup) -> None:
    """Failed before the cut and queued for a retry, it is not re-sent into the cut: left
    behind instead, the topic reads on."""
    fwd, cluster = _loop(setup)
    setup.store.append([[Record("t", b"a-1", partition_key=1)]])
    assert steps_until(fwd, lambda: len(cluster.partitions) == 1)
    cluster.p.fail(b"a-1")
    cluster.cut(2)  # found out of reach before the retry is due
    assert steps_until(fwd, lambda: fwd.stats()["in_flight"] == 0)
    setup.store.append([[Record("t", b"b-0", partition_key=0)]])
    assert steps_until(fwd, lambda: _sent(cluster, 0) == [b"b-0"])
    assert _sent(cluster, 1) == [b"a-1"]
    cluster.ack_all()
    cluster.cut()
    assert steps_until(fwd, lambda: _sent(cluster, 1) == [b"a-1", b"a-1"])
    cluster.ack_all()
    assert steps_until(fwd, lambda: not setup.store.topic_stats())


def test_held_messages_past_their_ttl_are_discarded_with_the_reason(
    setup: Setup, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(holding, "TTL_CHECK_SECONDS", 0.0)
    cluster = CutOff()
    fwd = setup.forwarder({"local": cluster}, lambda t: TopicConfig(ttl_seconds=1))
    cluster.cut(2)
    setup.store.append([[Record("t", b"k1", partition_key=1),
                         Record("t", b"k0", partition_key=0)]])
    assert steps_until(fwd, lambda: len(cluster.partitions) == 1)
    cluster.ack_all()
    run_until(fwd, lambda: not setup.store.topic_stats(), "the held message expired")
    assert setup.discard_reasons() == ["ttl"]
    assert _sent(cluster, 1) == []
