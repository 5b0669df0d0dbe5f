"""The positional produce() call (agent/forwarder/producing.py, the one module that makes
it), as a contract with confluent-kafka: its documented signature is keyword arguments, and
Ferry passes them by position for speed (bench/bench_produce_call.py measures what that
saves). This proves the order producing.py relies on, through both its forms (the bound
method the hot loops call positionally, and ``produce`` by name), on the installed
confluent-kafka, against a real tansu broker: raising the version bound in pyproject.toml
means this passing on the new version. A change of the order makes a field arrive in
another's place, or the delivery callback not be called."""

from __future__ import annotations

from confluent_kafka import KafkaError, Message, Producer

from agent.forwarder import producing
from tests.kafka import Broker, create_topic, read_topic
from tests.waiting import wait_until


def test_positional_arguments_are_the_order_the_send_path_uses(session_broker: Broker,
                                                               unique_topic: str) -> None:
    create_topic(session_broker.bootstrap, unique_topic, 3)
    reports: list[tuple[str, KafkaError | None, Message]] = []
    producer = Producer({"bootstrap.servers": session_broker.bootstrap, "linger.ms": 1})
    produce = producing.positional(producer)
    # (topic, value, key, partition, on_delivery, None, timestamp, headers): the
    # at-least-once loop passes the first seven, the exactly-once loop all eight.
    produce(unique_topic, b"v7", b"k7", 2,
            lambda err, msg: reports.append(("seven", err, msg)), None, 1_700_000_000_007)
    produce(unique_topic, b"v8", None, 1,
            lambda err, msg: reports.append(("eight", err, msg)), None, 1_700_000_000_008,
            [("ferry-id", b"agent:01")])
    # By name: every other site (the general path, decoded exactly-once messages).
    producing.produce(producer, unique_topic, b"vn", b"kn", partition=0,
                      on_delivery=lambda err, msg: reports.append(("named", err, msg)),
                      timestamp=1_700_000_000_009, headers=[("h", b"x")])
    # By name with the defaults: a progress record (no callback, no partition, no time).
    producing.produce(producer, unique_topic, b"vd", b"kd")
    wait_until(lambda: producer.poll(0.05) >= 0 and len(reports) == 3, timeout=30,
               message="the three delivery reports")
    assert producer.flush(5) == 0
    assert sorted((name, err) for name, err, _ in reports) == [
        ("eight", None), ("named", None), ("seven", None)]
    got = {m.value: m for m in read_topic(session_broker.bootstrap, unique_topic)}
    seven, eight, named, plain = got[b"v7"], got[b"v8"], got[b"vn"], got[b"vd"]
    assert (seven.key, seven.partition, seven.timestamp_ms, seven.headers) == (
        b"k7", 2, 1_700_000_000_007, ())
    assert (eight.key, eight.partition, eight.timestamp_ms, eight.headers) == (
        None, 1, 1_700_000_000_008, (("ferry-id", b"agent:01"),))
    assert (named.key, named.partition, named.timestamp_ms, named.headers) == (
        b"kn", 0, 1_700_000_000_009, (("h", b"x"),))
    assert (plain.key, plain.headers) == (b"kd", ())
    assert plain.timestamp_ms > 1_700_000_000_009  # 0 asks for the send time
