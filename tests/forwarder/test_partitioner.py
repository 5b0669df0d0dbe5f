"""Partition choice as Bruce makes it (seed 000, docs/sending_messages.md and router_thread.cc).

PartitionKey: ``sorted_partitions[key % n]``, where Bruce computes the modulus on the key cast
to uint32 (``static_cast<uint32_t>(partition_key) % partition_vec.size()``); when that partition
has no leader, the next one in the array that has one, and back as soon as it recovers.
AnyPartition: round-robin over the partitions that have a leader.
"""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
from confluent_kafka import KafkaError, Message, Producer
from hypothesis import given
from hypothesis import strategies as st

from agent.forwarder.partitioner import UNASSIGNED, TopicLayout, choose, waits_for_reach


def layout(partitions: tuple[int, ...], available: tuple[int, ...] | None = None) -> TopicLayout:
    return TopicLayout(partitions, partitions if available is None else available)


# -- PartitionKey ------------------------------------------------------------------------------
def test_bruce_example_key_6_over_three_partitions_goes_to_partition_0() -> None:
    assert layout((0, 1, 2)).for_partition_key(6) == 0


@pytest.mark.parametrize(("key", "partition"), [(0, 0), (1, 1), (2, 2), (3, 0), (7, 1), (8, 2)])
def test_key_mod_partition_count_indexes_the_sorted_array(key: int, partition: int) -> None:
    assert layout((0, 1, 2)).for_partition_key(key) == partition


def test_the_key_indexes_the_array_not_the_partition_ids() -> None:
    # Partition ids need not be 0..n-1: the key picks a position in the sorted id list.
    topic = layout((3, 5, 9, 12))
    assert [topic.for_partition_key(k) for k in range(8)] == [3, 5, 9, 12, 3, 5, 9, 12]


def test_bruce_example_unavailable_partition_goes_to_next_available_then_back() -> None:
    topic = layout((0, 1, 2))
    assert topic.for_partition_key(6) == 0
    topic.available = (1, 2)  # partition 0 lost its leader
    assert topic.for_partition_key(6) == 1
    assert topic.for_partition_key(4) == 1  # keys of partition 1 are unaffected
    assert topic.for_partition_key(5) == 2
    topic.available = (0, 1, 2)  # partition 0 recovered
    assert topic.for_partition_key(6) == 0


def test_next_available_wraps_around_the_end_of_the_array() -> None:
    topic = layout((0, 1, 2), available=(0,))
    assert topic.for_partition_key(1) == 0  # 1 down, 2 down, wrap to 0
    assert topic.for_partition_key(2) == 0
    topic.available = (1,)
    assert topic.for_partition_key(2) == 1  # 2 down, wrap past 0 (down) to 1


def test_skips_several_unavailable_partitions_in_a_row() -> None:
    topic = layout((0, 1, 2, 3, 4), available=(0, 4))
    assert topic.for_partition_key(1) == 4
    assert topic.for_partition_key(3) == 4


def test_no_partition_available_keeps_the_keys_own_partition() -> None:
    # Nothing has a leader: keep the key's own partition (librdkafka waits for a leader).
    assert layout((0, 1, 2), available=()).for_partition_key(7) == 1


@pytest.mark.parametrize(
    ("key", "partition"),
    [
        # Bruce casts the int32 key to uint32 before the modulus: -1 -> 4294967295, and
        # 4294967295 % 3 == 0. Python's floor modulus would give -1 % 3 == 2 instead.
        (-1, 0),
        (-2, 2),
        (-3, 1),
        (-(2**31), 2),  # 2147483648 % 3
        (2**31 - 1, 1),  # 2147483647 % 3
    ],
)
def test_negative_partition_keys_use_bruces_unsigned_modulus(key: int, partition: int) -> None:
    assert layout((0, 1, 2)).for_partition_key(key) == partition


@given(st.integers(-(2**31), 2**31 - 1), st.integers(1, 20))
def test_every_int32_key_matches_bruces_uint32_modulus(key: int, n: int) -> None:
    parts = tuple(range(10, 10 + n))
    assert layout(parts).for_partition_key(key) == parts[(key & 0xFFFFFFFF) % n]


# -- AnyPartition ------------------------------------------------------------------------------
def test_round_robin_is_even_over_all_partitions() -> None:
    topic = layout((0, 1, 2, 3))
    counts = Counter(topic.round_robin() for _ in range(4000))
    assert counts == {0: 1000, 1: 1000, 2: 1000, 3: 1000}


def test_round_robin_visits_each_partition_once_per_cycle() -> None:
    topic = layout((0, 1, 2))
    for _ in range(5):
        assert sorted(topic.round_robin() for _ in range(3)) == [0, 1, 2]


def test_round_robin_skips_partitions_without_a_leader() -> None:
    topic = layout((0, 1, 2, 3), available=(1, 3))
    counts = Counter(topic.round_robin() for _ in range(1000))
    assert counts == {1: 500, 3: 500}
    topic.available = (0, 1, 2, 3)
    assert set(topic.round_robin() for _ in range(8)) == {0, 1, 2, 3}


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True), st.integers(1, 5))
def test_round_robin_is_exactly_even_over_whole_cycles(parts: list[int], cycles: int) -> None:
    available = tuple(sorted(parts))
    topic = TopicLayout(available, available)
    counts = Counter(topic.round_robin() for _ in range(cycles * len(available)))
    assert counts == {p: cycles for p in available}


def test_no_partitions_is_unassigned() -> None:
    empty = layout(())
    assert empty.round_robin() == UNASSIGNED
    assert empty.for_partition_key(5) == UNASSIGNED


# -- choose ------------------------------------------------------------------------------------
def test_choose_uses_the_partition_key_when_there_is_one() -> None:
    topic = layout((0, 1, 2))
    assert choose(topic, 6, hash_key=False) == 0
    assert choose(topic, 7, hash_key=True) == 1  # a partition key wins over the key hash


def test_choose_leaves_key_hashed_messages_to_librdkafka() -> None:
    assert choose(layout((0, 1, 2)), None, hash_key=True) == UNASSIGNED


def test_choose_round_robins_any_partition_messages() -> None:
    topic = layout((0, 1))
    assert {choose(topic, None, hash_key=False) for _ in range(4)} == {0, 1}


def test_choose_without_metadata_is_unassigned() -> None:
    assert choose(None, 6, hash_key=False) == UNASSIGNED
    assert choose(None, None, hash_key=False) == UNASSIGNED


def test_partitions_led_by_a_broker_out_of_reach_are_routed_around() -> None:
    """A partition whose leader the agent cannot reach (brokers.py): AnyPartition messages
    skip it; PartitionKey messages keep Bruce's rule on the metadata's leaders (a key moves
    only when its partition has no leader), and both are as before once the broker answers."""
    lay = TopicLayout((0, 1, 2, 3), (), leaders=(1, 2, -1, 2))
    lay.route_around(frozenset())
    assert lay.available == (0, 1, 3) and lay.reachable == ()
    lay.route_around(frozenset({2}))
    assert lay.available == (0, 1, 3) and lay.reachable == (0,)
    assert not lay.all_available()
    assert {lay.round_robin() for _ in range(8)} == {0}
    assert lay.for_partition_key(1) == 1 and lay.for_partition_key(2) == 3
    lay.route_around(frozenset())
    assert {lay.round_robin() for _ in range(8)} == {0, 1, 3}
    # Leaders unknown (a layout made without them): left as it was.
    bare = TopicLayout((0, 1), (0, 1))
    bare.route_around(frozenset({1}))
    assert bare.available == (0, 1) and bare.reachable == ()


# -- A partial failure: keyed messages wait for their partition ---------------------------------


def cut_off(unreachable: frozenset[int]) -> TopicLayout:
    """Partitions 0-3, led by brokers 1, 2, 1, 2; ``unreachable`` out of the agent's reach."""
    topic = TopicLayout((0, 1, 2, 3), (0, 1, 2, 3), leaders=(1, 2, 1, 2))
    topic.route_around(unreachable)
    return topic


def test_a_keyed_message_waits_for_a_partition_led_by_a_broker_out_of_reach() -> None:
    topic = cut_off(frozenset({2}))
    assert topic.reachable == (0, 2)
    assert [waits_for_reach(topic, k, False, None) for k in range(4)] == [None, 1, None, 3]
    # A Kafka key goes where librdkafka's default partitioner puts it: CRC-32 modulo 4.
    waiting = {k: waits_for_reach(topic, None, True, k)
               for k in (b"k%d" % i for i in range(40))}
    assert waiting == {k: None if zlib.crc32(k) % 4 in (0, 2) else zlib.crc32(k) % 4
                       for k in waiting}
    # Keyless messages go round-robin over the reachable partitions: they never wait.
    assert waits_for_reach(topic, None, False, None) is None
    assert {topic.round_robin() for _ in range(8)} == {0, 2}


def test_nothing_waits_without_a_partial_failure() -> None:
    for topic in (cut_off(frozenset()), None):
        assert waits_for_reach(topic, 1, False, None) is None
        assert waits_for_reach(topic, None, True, b"k") is None


def test_a_kafka_keys_partition_is_the_one_librdkafkas_default_partitioner_picks() -> None:
    """The CRC-32 rule waits_for_reach assumes, checked against librdkafka itself: a producer
    on its built-in mock cluster (``test.mock.num.brokers``, in this process, no network
    beyond loopback), 200 keys, each key's partition as its delivery report says."""
    partitions: dict[bytes, int] = {}

    def report(err: KafkaError | None, msg: Message) -> None:
        assert err is None, err
        partitions[msg.key()] = msg.partition()

    producer = Producer({"test.mock.num.brokers": 1, "log_level": 3})
    try:
        producer.produce("keys", b"v", b"first", on_delivery=report)
        assert producer.flush(10) == 0
        n = len(producer.list_topics("keys", timeout=10).topics["keys"].partitions)
        assert n > 1
        keys = [b"key-%d" % i for i in range(200)]
        for key in keys:
            producer.produce("keys", b"v", key, on_delivery=report)
        assert producer.flush(10) == 0
    finally:
        producer.flush(0)
    assert {k: partitions[k] for k in keys} == {k: zlib.crc32(k) % n for k in keys}
