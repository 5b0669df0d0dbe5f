"""Outage: the local cluster blackholed (a network partition, not a clean shutdown) for 15 s
under load (``FERRY_RELIABILITY_OUTAGE_SECONDS``): three message timeouts of 5 s. Nothing
acknowledged is lost, and messages with one partition key reach their partition in the order
they were sent.

The broker sits behind a TcpProxy (tests/kafka.py): in a blackhole connections stay open and
every byte is dropped both ways, so requests in flight hang until librdkafka times them out
(``message_timeout_ms``, shortened here so the outage spans several fail-and-retry cycles)
and some requests may have been written by the broker with their answers lost: duplicates.
Order is checked on the first copy of each message (a re-sent duplicate of an earlier message
may follow later ones; that is at-least-once, not reordering). The outage ends right after a
round of delivery failures: the moment when failed messages wait to be re-sent while later
ones of the same partitions are still queued in the producer.

Each topic has an exactly-once twin (``delivery = "exactly_once"``, issue 22), read back
``read_committed``: there the blackhole's uncertain transactions must leave no duplicate.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.agent_harness import write_config
from tests.kafka import Broker, ConsumedMessage, TcpProxy, create_topic, read_topic
from tests.reliability.harness import Agent, metric_total
from tests.reliability.keyed_load import KeyedSender, http_load, socket_load, tally_of
from tests.waiting import wait_until

# Mostly waits (on agents, brokers and an outage): run beside the Apache Kafka tests
# (tests/conftest.py, in_waiting_part).
pytestmark = pytest.mark.waiting

OUTAGE_SECONDS = float(os.environ.get("FERRY_RELIABILITY_OUTAGE_SECONDS", "15"))


def test_a_blackhole_under_load_loses_nothing_and_keeps_key_order(
    tmp_path: Path, proxied_broker: tuple[Broker, TcpProxy], artifacts_dir: Path
) -> None:
    broker, proxy = proxied_broker
    topics = {"http": "outage-http", "socket": "outage-socket",
              "http-eo": "outage-http-eo", "socket-eo": "outage-socket-eo"}
    for topic in topics.values():
        create_topic(broker.bootstrap, topic, 4)
    # HTTP's topic uses idempotent acks=all producers, the socket's acks=leader: both kinds.
    # The -eo twins are exactly-once topics (issue 22), read back read_committed: there the
    # blackhole's uncertain transactions must leave no duplicates either.
    eo = {"delivery": "exactly_once", "acks": "all"}
    config = write_config(
        tmp_path / "agent", broker.bootstrap, spool=False,
        topics={topics["http"]: {"acks": "all", "ack_timeout_ms": 20},
                topics["socket"]: {"acks": "leader"},
                topics["http-eo"]: {**eo, "ack_timeout_ms": 20}, topics["socket-eo"]: eo},
        forwarder={"message_timeout_ms": 5000, "retry_backoff_max_ms": 2000})
    senders = {name: KeyedSender(name) for name in topics}
    timeline: dict[str, float] = {}
    with Agent(config) as agent:
        threads = [
            threading.Thread(target=socket_load if name.startswith("socket") else http_load,
                             args=(agent, topic, senders[name]))
            for name, topic in topics.items()
        ]
        for t in threads:
            t.start()
        try:
            t0 = time.monotonic()
            wait_until(lambda: all(len(s.acked) > 200 for s in senders.values()), timeout=30,
                       message="load flowing before the outage")
            proxy.blackhole()
            blackhole_ms = int(time.time() * 1000)
            timeline["blackhole_at"] = time.monotonic() - t0
            acked_at_blackhole = {n: len(s.acked) for n, s in senders.items()}
            # The outage itself: its length is the point of the test, not a synchronisation.
            time.sleep(OUTAGE_SECONDS)
            # Then end it at the worst moment: right after a round of delivery failures, when
            # the failed messages wait to be re-sent and later ones are still queued.
            failures = metric_total(agent.counters(), "delivery_failures")
            cluster_down = failures > 0
            with contextlib.suppress(AssertionError):
                wait_until(lambda: metric_total(agent.counters(), "delivery_failures")
                           > failures, timeout=15, interval=0.02)
            acked_during = {n: len(s.acked) - acked_at_blackhole[n] for n, s in senders.items()}
            proxy.restore()
            timeline["restored_at"] = time.monotonic() - t0
            acked_at_restore = {n: len(s.acked) for n, s in senders.items()}
            wait_until(lambda: all(len(s.acked) > acked_at_restore[n] + 200
                                   for n, s in senders.items()),
                       timeout=30, message="load flowing after the outage")
        finally:
            for s in senders.values():
                s.stop.set()
            for t in threads:
                t.join(30)
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=120, interval=0.2,
                   message="buffer drained after the outage")
        timeline["drained_at"] = time.monotonic() - t0
        counters = agent.counters()
    tallies = {name: tally_of(senders[name], read_topic(broker.bootstrap, topic, 60,
                                                      read_committed=name.endswith("-eo")),
                            blackhole_ms) for name, topic in topics.items()}
    report = {
        "outage_seconds": OUTAGE_SECONDS, "timeline": timeline,
        "acked_during_outage": acked_during,
        "delivery_failures": metric_total(counters, "delivery_failures"),
        "transactions_committed": metric_total(counters, "transactions_committed"),
        "transactions_aborted": metric_total(counters, "transactions_aborted"),
        "client_errors": {n: dict(s.errors) for n, s in senders.items()},
        "inputs": {n: asdict(t) for n, t in tallies.items()},
    }
    (artifacts_dir / "outage-report.json").write_text(json.dumps(report, indent=2))
    print("\n" + json.dumps(report, indent=2))
    assert cluster_down, "the blackhole should have failed deliveries"
    for name, tally in tallies.items():
        assert acked_during[name] > 0, f"{name}: nothing acknowledged during the outage"
        assert tally.lost == 0, f"{name}: {tally.lost} acknowledged lost: {tally.lost_examples}"
        assert tally.keys_split_over_partitions == 0, f"{name}: a key spans partitions"
        if name.endswith("-eo"):
            assert tally.duplicates == 0, f"{name}: {tally.duplicates} duplicates"
    broken = {n: t.order_examples[:3] for n, t in tallies.items() if t.out_of_order}
    assert not broken, f"key order broken across the outage: {broken}"


def _consumed(partition: int, offset: int, value: bytes) -> ConsumedMessage:
    return ConsumedMessage("t", partition, offset, None, value, 0, 0, ())


def test_the_order_check_tells_a_resent_duplicate_from_a_reordering() -> None:
    """The checker above must be able to fail: a message overtaken by a later one of its key
    is out of order; a second copy of an earlier message after later ones is not."""
    sender = KeyedSender("x")
    values = [sender.value(0) for _ in range(4)]  # x-0-00000000 .. x-0-00000003
    sender.acked.update(values)
    resent = [_consumed(0, i, v) for i, v in enumerate([*values[:3], values[1], values[3]])]
    tally = tally_of(sender, resent)
    assert (tally.out_of_order, tally.resend_regressions, tally.duplicates) == (0, 1, 1)
    swapped = [_consumed(0, i, v) for i, v in enumerate([values[0], values[2], values[1],
                                                         values[3]])]
    assert tally_of(sender, swapped).out_of_order == 1
    split = [_consumed(i % 2, i, v) for i, v in enumerate(values)]
    assert tally_of(sender, split).keys_split_over_partitions == 1
    assert tally_of(sender, split[:2]).lost == 2
