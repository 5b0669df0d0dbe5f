"""The idle wait on delivery reports (agent/forwarder/clusters.py ``wait_for_reports``): a
report of any producer of any cluster ends it, not only one of the first producer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer.store import Store
from agent.config import BufferConfig, FerryConfig, ForwarderConfig, KafkaClusterConfig
from agent.forwarder.clusters import Cluster, wait_for_reports
from agent.forwarder.discard_log import DiscardLog
from agent.forwarder.forwarder import Forwarder
from agent.metrics import Registry
from tests.forwarder.fakes import FakeCluster
from tests.waiting import wait_until

LONG = 30.0  # a wait the tests expect to end early; ending after it fails them


class BlockingProducer:
    """librdkafka's poll as the wait sees it: blocks up to ``timeout`` for a report."""

    def __init__(self) -> None:
        self.report = threading.Event()
        self.served = 0
        self.timeouts: list[float] = []

    def poll(self, timeout: float = 0) -> int:
        self.timeouts.append(timeout)
        if self.report.wait(timeout):
            self.report.clear()
            self.served += 1
            return 1
        return 0


def report_later(producer: BlockingProducer, after: float = 0.05) -> threading.Timer:
    timer = threading.Timer(after, producer.report.set)
    timer.start()
    return timer


def test_no_producer_means_no_wait() -> None:
    started = time.monotonic()
    assert wait_for_reports([], LONG) is False
    assert time.monotonic() - started < 1.0


def test_one_producer_is_one_blocking_poll() -> None:
    p = BlockingProducer()
    timer = report_later(p)
    assert wait_for_reports([p], LONG) is True
    timer.join()
    assert p.served == 1 and p.timeouts == [LONG]


def test_a_report_of_the_last_producer_ends_the_wait() -> None:
    producers = [BlockingProducer() for _ in range(3)]
    timer = report_later(producers[-1])
    started = time.monotonic()
    assert wait_for_reports(producers, LONG) is True
    timer.join()
    assert time.monotonic() - started < LONG / 2
    assert [p.served for p in producers] == [0, 0, 1]


def test_a_waiting_report_is_served_without_blocking() -> None:
    producers = [BlockingProducer() for _ in range(2)]
    producers[1].report.set()
    assert wait_for_reports(producers, LONG) is True
    assert producers[1].served == 1
    assert producers[0].timeouts == [0] and producers[1].timeouts == [0]


def test_the_turns_last_the_timeout_and_never_spin() -> None:
    producers = [BlockingProducer() for _ in range(3)]
    started = time.monotonic()
    assert wait_for_reports(producers, 0.002) is True  # the loop's IDLE_WAIT
    assert time.monotonic() - started >= 0.002
    blocking = [t for p in producers for t in p.timeouts if t > 0]
    assert blocking and min(blocking) >= 0.001 - 1e-9  # librdkafka truncates below 1 ms
    # A quiet wait costs a few polls per round, not a spin.
    for p in producers:
        p.timeouts.clear()
    assert wait_for_reports(producers, 0.05) is True
    assert sum(len(p.timeouts) for p in producers) <= 3 * (0.05 / 0.01 + 2)


def test_a_cluster_lists_every_producer() -> None:
    cluster = Cluster("local", KafkaClusterConfig(), ForwarderConfig())
    assert cluster.producers() == []
    made = [BlockingProducer() for _ in range(3)]  # none of librdkafka's: no broker here
    cluster._producers = dict(zip([("all", 0), ("leader", 0), ("all", 1)], made,
                                  strict=True))  # type: ignore[arg-type]
    assert cluster.producers() == made


def test_an_idle_producer_with_a_callback_waiting_is_not_sending() -> None:
    # librdkafka's len() counts callbacks waiting for poll(): every second the statistics'
    # own. The metadata thread asks sending() whenever it likes, between the loop's polls.
    cluster = Cluster("local", KafkaClusterConfig(bootstrap_servers="127.0.0.1:1"),
                      ForwarderConfig())
    try:
        p = cluster.producer("all")
        wait_until(lambda: len(p) > 0, timeout=10, interval=0.05,
                   message="a statistics callback waiting for poll()")
        assert cluster.sending() is True  # no statistics served yet: len() is all there is
        # Serve callbacks until the statistics' own was among them: 0 messages held.
        wait_until(lambda: (p.poll(0.05), cluster._queued.get("all-0") == 0)[1], timeout=10,
                   message="the producer's statistics served")
        wait_until(lambda: len(p) > 0, timeout=10, interval=0.05,
                   message="the next statistics callback waiting for poll()")
        assert cluster.sending() is False
        p.produce("t", b"held: no broker answers")
        assert cluster.sending() is False  # by the statistics of the last second ...
        wait_until(lambda: (p.poll(0), cluster.sending())[1], timeout=10, interval=0.05,
                   message="... which count the message once they come")
    finally:
        cluster.close(0)


@pytest.fixture
def two_clusters(tmp_path: Path) -> Iterator[tuple[Forwarder, BlockingProducer,
                                                   BlockingProducer]]:
    config = FerryConfig(buffer=BufferConfig(path=tmp_path / "buffer"))
    store = Store(config.buffer.path, 64 * 1024 * 1024)
    local, remote = FakeCluster(), FakeCluster()
    local.p, remote.p = BlockingProducer(), BlockingProducer()  # type: ignore[assignment]
    fwd = Forwarder(config, store, registry=Registry(),
                    discard_log=DiscardLog(tmp_path / "discards.jsonl"),
                    clusters={"local": local, "remote": remote})  # type: ignore[dict-item]
    # Sends in flight: the loop waits on the producers, not on the commit signal.
    if fwd._commits is not None:
        fwd._commits.close()
        fwd._commits = None
    try:
        yield fwd, local.p, remote.p  # type: ignore[misc]
    finally:
        store.close()


def test_the_forwarder_wakes_on_a_report_of_the_second_cluster(
    two_clusters: tuple[Forwarder, BlockingProducer, BlockingProducer],
) -> None:
    fwd, local, remote = two_clusters
    timer = report_later(remote)
    started = time.monotonic()
    fwd._wait(LONG)
    timer.join()
    assert time.monotonic() - started < LONG / 2
    assert (local.served, remote.served) == (0, 1)
