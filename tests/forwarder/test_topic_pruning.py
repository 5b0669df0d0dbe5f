"""Topics that come and go leave nothing behind in the forwarder's loop: every step walks the
per-topic state, so an entry must go once its topic holds nothing (topic_state.py). Real
buffer, real tansu broker (a fresh one: thousands of topics would crowd a shared broker's
metadata), the forwarder's own loop. Entries are counted, not timed. The topics are created
in bulk, and deleted once delivered (they come and go at the broker too): tansu creates one
per lookup far slower than a batch, and creates a topic in a time that grows with how many
it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import NewTopic

from agent.buffer.store import Store
from agent.config import load_config
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.stuck import Stuck
from agent.forwarder.topic_state import TopicState
from agent.metrics import Registry
from agent.records import Record
from tests.agent_harness import write_config
from tests.kafka import Broker, admin_client
from tests.waiting import wait_until

# Three waves of 500: after each, what a step walks is back to nothing, so the bound does
# not depend on how many topics came before. A wave is ten times the largest per-step batch
# over topics (insync.MAX_TOPICS, 50), and a leaked entry per topic would leave 500 behind.
# (Ten thousand in five waves, then three waves of 1,000, proved no more: the time is
# per topic, tansu creating them and the forwarder describing and delivering each.)
TOPICS = 1_500
WAVE = 500


def _step_until(forwarder: Forwarder, done: Callable[[], bool], timeout: float,
                message: str) -> None:
    def stepped() -> bool:
        if not forwarder.step():
            forwarder._wait(0.002)
        return done()

    wait_until(stepped, timeout=timeout, interval=0.001, message=message)


def _create_topics(bootstrap: str, names: list[str]) -> None:
    admin = admin_client(bootstrap)  # must outlive the futures
    futures = admin.create_topics([NewTopic(n, num_partitions=1, replication_factor=1)
                                   for n in names], operation_timeout=120, request_timeout=120)
    for future in futures.values():
        future.result(timeout=120)


def _delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = admin_client(bootstrap)
    futures = admin.delete_topics(names, operation_timeout=120, request_timeout=120)
    for future in futures.values():
        future.result(timeout=120)


@pytest.mark.timeout(600)  # creating thousands of topics on tansu takes a while
def test_topics_that_come_and_go_leave_the_per_step_work_bounded(tmp_path: Path,
                                                                 broker: Broker) -> None:
    cfg = load_config(write_config(tmp_path, broker.bootstrap, http=False))
    registry = Registry()
    with Store(cfg.buffer.path, cfg.buffer.max_bytes) as store:
        forwarder = Forwarder(cfg, store, registry=registry)
        try:
            # One topic that stays: the steady state the burst must return to.
            store.append([[Record("steady", b"s0")]])
            _step_until(forwarder, lambda: not store.topic_stats(), 60, "steady delivered")
            _step_until(forwarder, lambda: forwarder.topic_count() == 0, 10,
                        "the steady topic's state dropped once it held nothing")
            delivered = 1
            for wave in range(TOPICS // WAVE):
                names = [f"come-and-go-{wave}-{i}" for i in range(WAVE)]
                started = time.monotonic()
                _create_topics(broker.bootstrap, names)
                print(f"wave {wave}: topics created in {time.monotonic() - started:.1f} s")
                store.append([[Record(t, t.encode()) for t in names]])
                delivered += WAVE
                _step_until(forwarder, lambda n=delivered: registry.view().total(
                    "messages_delivered") >= n, 300, f"wave {wave} delivered")
                _step_until(forwarder, lambda: not store.topic_stats(), 30,
                            f"wave {wave} removed from the buffer")
                # What a step walks is back to nothing: no entry per topic gone.
                _step_until(forwarder, lambda: forwarder.topic_count() == 0, 10,
                            f"wave {wave}'s topic states dropped")
                assert forwarder.stats()["topics"] == {}
                assert forwarder.clusters["local"].topics() == []
                _delete_topics(broker.bootstrap, names)
            assert registry.view().total("messages_delivered") == TOPICS + 1
            # The cluster's layouts of the deleted topics go with the next full refresh.
            cluster = forwarder.clusters["local"]
            cluster.refresh()
            assert cluster.layout_count() <= 5  # "steady" and internal ones, not 1,500
            # A topic that comes back is read again from its head: nothing lost, nothing twice.
            store.append([[Record("steady", b"s1"), Record("steady", b"s2")]])
            _step_until(forwarder, lambda: registry.view().total("messages_delivered")
                        >= TOPICS + 3, 60, "a returning topic delivered")
            assert registry.view().total("messages_delivered") == TOPICS + 3
            assert registry.view().total("messages_delivered", topic="steady") == 3
        finally:
            forwarder.shutdown()


def test_a_topic_holds_something_while_any_of_its_state_must_outlive_the_step() -> None:
    assert TopicState().holds_nothing()
    assert TopicState(cursor=b"x" * 16, drained_at=1.0, expiry_check_at=2.0).holds_nothing()
    for kept in (TopicState(in_flight=1), TopicState(sending=1), TopicState(recovering=True),
                 TopicState(stuck=Stuck("TOPIC_AUTHORIZATION_FAILED", "local", "acl", True)),
                 TopicState(waiting_since=5.0)):
        assert not kept.holds_nothing(), kept
