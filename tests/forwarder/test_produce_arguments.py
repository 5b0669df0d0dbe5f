"""The positional produce() call of the forwarder's send path (agent/forwarder/send.py), as a
contract with confluent-kafka: its documented signature is keyword arguments, and the send
path passes them by position for speed (bench/bench_produce_call.py measures what that
saves). This proves the order the send path relies on, on the installed confluent-kafka,
against a real tansu broker: raising the version bound in pyproject.toml means this passing
on the new version. A change of the order makes a field arrive in another's place, or the
delivery callback not be called."""

from __future__ import annotations

from confluent_kafka import KafkaError, Message, Producer

from tests.kafka import Broker, create_topic, read_topic
from tests.waiting import wait_until


def test_positional_arguments_are_the_order_the_send_path_uses(session_broker: Broker,
                                                               unique_topic: str) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 3)
    reports: list[tuple[str, KafkaError | None, Message]] = []
    producer = Producer({"bootstrap.servers": session_broker.bootstrap, "linger.ms": 1})
    # (topic, value, key, partition, callback, on_delivery, timestamp, headers): the
    # at-least-once loop passes the first seven, the exactly-once loop all eight.
    producer.produce(unique_topic, b"v7", b"k7", 2,
                     lambda err, msg: reports.append(("seven", err, msg)), None,
                     1_700_000_000_007)
    producer.produce(unique_topic, b"v8", None, 1,
                     lambda err, msg: reports.append(("eight", err, msg)), None,
                     1_700_000_000_008, [("ferry-id", b"agent:01")])
    wait_until(lambda: producer.poll(0.05) >= 0 and len(reports) == 2, timeout=30,
               message="both delivery reports")
    producer.flush(5)
    assert sorted((name, err) for name, err, _ in reports) == [("eight", None),
                                                               ("seven", None)]
    got = {m.value: m for m in read_topic(session_broker.bootstrap, unique_topic)}
    seven, eight = got[b"v7"], got[b"v8"]
    assert (seven.key, seven.partition, seven.timestamp_ms, seven.headers) == (
        b"k7", 2, 1_700_000_000_007, ())
    assert (eight.key, eight.partition, eight.timestamp_ms, eight.headers) == (
        None, 1, 1_700_000_000_008, (("ferry-id", b"agent:01"),))
