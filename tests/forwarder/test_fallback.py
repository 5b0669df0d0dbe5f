"""Remote-datacenter fallback (issue 5) against two real brokers and a blackholing proxy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import load_config
from agent.daemon.agent import Agent
from agent.metrics import Registry
from ferry_client import FerryClient
from tests.agent_harness import write_config
from tests.kafka import Broker, TcpProxy, consume_all, create_topic, read_topic
from tests.waiting import wait_until

FB = "fallback-topic"
PLAIN = "plain-topic"


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[Broker]:
    with Broker(log_path=tmp_path / "remote.log") as b:
        yield b


@pytest.fixture
def two_dc_agent(
    tmp_path: Path, proxied_broker: tuple[Broker, TcpProxy], remote: Broker
) -> Iterator[tuple[Agent, Broker, TcpProxy, Broker]]:
    local, proxy = proxied_broker
    for b in (local, remote):
        create_topic(b.direct_bootstrap if b is local else b.bootstrap, FB, 2)
        create_topic(b.direct_bootstrap if b is local else b.bootstrap, PLAIN, 2)
    config = load_config(write_config(
        tmp_path / "agent", local.bootstrap, remote_bootstrap=remote.bootstrap, http=False,
        topics={FB: {"fallback_to_remote": True, "speculative_send_delay_ms": 250}},
    ))
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        yield agent, local, proxy, remote
    finally:
        agent.stop()


def _send(agent: Agent, topic: str, prefix: str, n: int) -> set[bytes]:
    assert agent.config.socket.path is not None
    values = {f"{prefix}-{i}".encode() for i in range(n)}
    with FerryClient(agent.config.socket.path) as client:
        for v in sorted(values):
            client.send(topic, v)
    return values


def _values(bootstrap: str, topic: str) -> set[bytes | None]:
    return {m.value for m in read_topic(bootstrap, topic, timeout=20)}


def test_local_blackholed_fallback_topics_go_remote_others_wait(
    two_dc_agent: tuple[Agent, Broker, TcpProxy, Broker],
) -> None:
    agent, local, proxy, remote = two_dc_agent
    before = _send(agent, FB, "before", 20)
    assert len(consume_all(local.direct_bootstrap, FB, 20, timeout=20)) == 20

    proxy.blackhole()
    t0 = time.monotonic()
    during_fb = _send(agent, FB, "during", 50)
    during_plain = _send(agent, PLAIN, "during", 50)
    got = consume_all(remote.bootstrap, FB, 50, timeout=15)
    took = time.monotonic() - t0
    assert {m.value for m in got} == during_fb
    # Speculative send after 250 ms, or straight to remote once local is marked down (2 s):
    # either way long before librdkafka would give up on the local send (300 s).
    assert took < 30, f"fallback took {took:.1f} s"
    # Topics without fallback stay buffered while the local cluster is unreachable.
    assert _values(remote.bootstrap, PLAIN) == set()
    wait_until(lambda: {s.topic: s.messages for s in agent.store.topic_stats()}.get(PLAIN) == 50,
               timeout=15, message="plain-topic messages buffered")
    wait_until(lambda: agent.registry.view().total("cluster_up", cluster="local") == 0,
               timeout=15, message="local cluster reported down")

    proxy.restore()
    wait_until(lambda: _values(local.direct_bootstrap, PLAIN) == during_plain, timeout=60,
               message="plain topic delivered locally after recovery")
    wait_until(lambda: not agent.store.topic_stats(), timeout=60, message="buffer drained")
    # Nothing lost: every fallback message is in one cluster or the other.
    fb_seen = _values(local.direct_bootstrap, FB) | _values(remote.bootstrap, FB)
    assert before | during_fb <= fb_seen
    view = agent.registry.view()
    assert view.total("messages_delivered", cluster="remote") >= 50
    wait_until(lambda: agent.registry.view().total("cluster_up", cluster="local") == 1,
               timeout=15, message="local cluster reported up again")


def test_both_clusters_down_everything_waits_then_goes_where_it_can(
    two_dc_agent: tuple[Agent, Broker, TcpProxy, Broker],
) -> None:
    agent, local, proxy, remote = two_dc_agent
    proxy.blackhole()
    remote.stop()
    fb = _send(agent, FB, "fb", 30)
    plain = _send(agent, PLAIN, "plain", 30)
    wait_until(lambda: agent.registry.view().total("messages_accepted") == 60,
               message="all accepted while both clusters are down")
    assert {s.topic: s.messages for s in agent.store.topic_stats()} == {FB: 30, PLAIN: 30}

    remote.start()  # memory storage: topics come back via auto-create
    wait_until(lambda: _values(remote.bootstrap, FB) == fb, timeout=60,
               message="fallback topic delivered to the remote cluster")
    # Kafka holds them before the forwarder's durable delete has committed: wait for it.
    wait_until(lambda: {s.topic: s.messages for s in agent.store.topic_stats()} == {PLAIN: 30},
               timeout=30, message="delivered fallback messages removed from the buffer")

    proxy.restore()
    wait_until(lambda: _values(local.direct_bootstrap, PLAIN) == plain, timeout=60,
               message="plain topic delivered once the local cluster is back")
    wait_until(lambda: not agent.store.topic_stats(), timeout=30, message="buffer drained")


def test_slow_local_cluster_speculative_send_wins_and_the_late_ack_is_a_duplicate(
    tmp_path: Path, proxied_broker: tuple[Broker, TcpProxy], remote: Broker
) -> None:
    # A local cluster that is slow, not down: its answers are held back, not lost. The
    # outage detector is set far off so that only the speculative send can reach the remote.
    local, proxy = proxied_broker
    create_topic(local.direct_bootstrap, FB, 2)
    create_topic(remote.bootstrap, FB, 2)
    config = load_config(write_config(
        tmp_path / "agent", local.bootstrap, remote_bootstrap=remote.bootstrap, http=False,
        topics={FB: {"fallback_to_remote": True, "speculative_send_delay_ms": 250}},
        outage_after_seconds=300,
    ))
    agent = Agent(config, registry=Registry())
    agent.start()
    try:
        warm = _send(agent, FB, "warm", 5)
        assert len(consume_all(local.direct_bootstrap, FB, 5, timeout=20)) == 5
        wait_until(lambda: not agent.store.topic_stats(), timeout=20, message="warm-up drained")

        proxy.hold()
        slow = _send(agent, FB, "slow", 20)
        got = consume_all(remote.bootstrap, FB, 20, timeout=20)
        assert {m.value for m in got} >= slow
        # The remote acknowledgement was the first: the messages left the buffer on it.
        wait_until(lambda: not agent.store.topic_stats(), timeout=20,
                   message="slow messages removed on the remote acknowledgement")
        wait_until(lambda: agent.registry.view().total(
            "messages_delivered", topic=FB, cluster="remote") >= 20, timeout=10,
            message="remote deliveries counted")
        view = agent.registry.view()
        assert view.total("cluster_up", cluster="local") == 1, "slow was taken for an outage"

        # The held requests reach the local cluster now; its acknowledgements come second
        # and are counted as duplicates, not deliveries.
        proxy.restore()
        wait_until(lambda: agent.registry.view().total(
            "messages_duplicate_acks", topic=FB, cluster="local") >= 20, timeout=30,
            message="late local acknowledgements counted as duplicates")
        assert _values(local.direct_bootstrap, FB) == warm | slow
        # Each message counted delivered once, whichever cluster answered first. (A warm-up
        # message may have gone both ways too when the first sends were slow: hence >= above.)
        assert agent.registry.view().total("messages_delivered", topic=FB) == 25
    finally:
        agent.stop()
