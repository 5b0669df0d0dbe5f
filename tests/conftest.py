"""Shared pytest fixtures. Keep this file thin: logic lives in tests/kafka.py and friends.

Sections: Kafka (real tansu brokers), Apache Kafka (a real 3-node cluster), the forwarder's
fakes, filesystems and artifacts. Add new fixtures under a section header.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Test modules import helpers as `tests.kafka`, `tests.waiting`. `python -m pytest` (dev/test)
# puts the repo root on sys.path, bare `pytest` does not; this conftest loads first, so it
# makes both work. (Superseded if tests/__init__.py or `pythonpath = ["."]` is ever added.)
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # last: repo folders must not shadow installed packages

from tests.apache_kafka import KafkaCluster, kafka_version, newest_kafka_version  # noqa: E402
from tests.filesystems import tmpfs  # noqa: E402
from tests.kafka import Broker, TcpProxy, free_port, unique_topic_name  # noqa: E402

if TYPE_CHECKING:
    from tests.forwarder.fakes import Setup

# --------------------------------------------------------------------------------------------
# Two parts run at once: dev/test starts one pytest per part (FERRY_TEST_PART)
# --------------------------------------------------------------------------------------------

# The tests on the session's Apache Kafka clusters, and those marked ``waiting`` (outages
# and crashes on tansu: they wait on agents and timeouts), mostly wait; the rest mostly
# computes. dev/test runs the two parts in two processes at the same time, each costly shared
# thing (the clusters' JVMs, the SparkSession, the packages' build) made by one process only.
KAFKA_FIXTURES = frozenset({"kafka_cluster", "apache_kafka", "newest_kafka", "proxied_kafka"})
PARTS = ("waiting", "rest")
# The session-scoped Apache Kafka clusters, each started by its first test and stopped after
# its last (STARTED holds those running; LAST_USERS maps a test to those it is the last of).
SESSION_CLUSTERS = ("kafka_cluster", "newest_kafka", "proxied_kafka")
SESSION_ORDER = ("kafka_cluster", "proxied_kafka", "newest_kafka")  # the order they run in
STARTED: dict[str, KafkaCluster] = {}
LAST_USERS = pytest.StashKey[dict[str, set[str]]]()


def in_waiting_part(item: pytest.Item) -> bool:
    """Whether the test uses a session Apache Kafka cluster, is in a module that builds its
    own (it imports ``KafkaCluster``), or is marked ``waiting``."""
    if KAFKA_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if item.get_closest_marker("waiting") is not None:
        return True
    module = getattr(item, "module", None)
    return module is not None and getattr(module, "KafkaCluster", None) is KafkaCluster


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = os.environ.get("FERRY_TEST_PART", "")
    if part:
        _select_part(config, items, part)
    # After the last test that uses it, a session cluster stops (pytest_runtest_teardown):
    # idle, its JVMs still take 5-13 % of a core a node from everything that runs after.
    last = {name: item for item in items for name in session_clusters(item)}
    config.stash[LAST_USERS] = {item.nodeid: {n for n, i in last.items() if i is item}
                                for item in last.values()}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's own fixtures torn down first (apache_kafka waits until healthy)
    for name in item.config.stash.get(LAST_USERS, {}).get(item.nodeid, ()):
        cluster = STARTED.pop(name, None)
        if cluster is not None:
            cluster.stop()


def _select_part(config: pytest.Config, items: list[pytest.Item], part: str) -> None:
    if part not in PARTS:
        raise pytest.UsageError(f"FERRY_TEST_PART={part!r}: one of {', '.join(PARTS)}")
    waiting = part == "waiting"
    keep = [item for item in items if in_waiting_part(item) == waiting]
    dropped = [item for item in items if in_waiting_part(item) != waiting]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = sorted(keep, key=late_cluster) if waiting else keep


def session_clusters(item: pytest.Item) -> set[str]:
    """The session clusters (``SESSION_CLUSTERS``) a test uses: by fixture name, through
    ``apache_kafka``, or through a parameter naming the fixture or the version that a test
    hands to ``request.getfixturevalue`` (test_kafka_refusals.py, test_kafka_quota.py,
    test_kafka_quorum_killed.py)."""
    names = set(getattr(item, "fixturenames", ()))
    used = names & set(SESSION_CLUSTERS)
    if "apache_kafka" in names:
        used.add("kafka_cluster")
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec is not None else ()):
        if value in ("apache_kafka", kafka_version()):
            used.add("kafka_cluster")
        elif value in ("newest_kafka", newest_kafka_version()):
            used.add("newest_kafka")
    return used


def late_cluster(item: pytest.Item) -> int:
    """Where a test of the waiting part runs, so that at most one session cluster runs at a
    time (each starts at its first test and stops after its last: pytest_runtest_teardown),
    their JVMs taking CPU from both parts: first the tests that use none (tansu, or a
    cluster of their own), then those of ``kafka_cluster``, of ``proxied_kafka``, and of
    ``newest_kafka`` (sorted() keeps the order otherwise)."""
    used = session_clusters(item)
    return max((SESSION_ORDER.index(name) + 1 for name in used), default=0)


# --------------------------------------------------------------------------------------------
# Kafka: real tansu brokers on 127.0.0.1 (memory storage; a restart empties them)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A fresh broker for this test alone; use it when the test stops/starts the broker."""
    with Broker(log_path=tmp_path / "tansu.log") as fresh:
        yield fresh


@pytest.fixture(scope="session")
def session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the whole run. Never stop it; isolate with ``unique_topic``."""
    with Broker(log_path=tmp_path_factory.mktemp("session-broker") / "tansu.log") as shared:
        yield shared


@pytest.fixture
def unique_topic(request: pytest.FixtureRequest) -> str:
    """A legal topic name no other test uses (it is not created; see kafka.create_topic)."""
    return unique_topic_name(request.node.name)


@pytest.fixture
def proxied_broker(tmp_path: Path) -> Iterator[tuple[Broker, TcpProxy]]:
    """A fresh broker advertising a TcpProxy, so all client traffic crosses the proxy.

    ``broker.bootstrap`` is the proxy's address. There is no way around the proxy: clients
    follow metadata, which only ever names the proxy.
    """
    port = free_port()
    with (
        TcpProxy(port) as proxy,
        Broker(port, advertised_port=proxy.port, log_path=tmp_path / "tansu.log") as proxied,
    ):
        yield proxied, proxy


# --------------------------------------------------------------------------------------------
# Apache Kafka: a real 3-node KRaft cluster (tests/apache_kafka.py), RF 3, min.insync.replicas 2
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """Three Apache Kafka nodes shared by the whole run; request ``apache_kafka`` instead."""
    with KafkaCluster(tmp_path_factory.mktemp("apache-kafka")) as cluster:
        STARTED["kafka_cluster"] = cluster
        yield cluster


@pytest.fixture(scope="session")
def newest_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """Three nodes of the newest Apache Kafka release (``kafka.newest.version`` in
    dev/kafka/pom.xml), for the cases that must hold on the pinned version and the newest
    alike (Kafka's refusals); started only when such a case runs."""
    with KafkaCluster(tmp_path_factory.mktemp("newest-kafka"),
                      version=newest_kafka_version()) as cluster:
        STARTED["newest_kafka"] = cluster
        yield cluster


@pytest.fixture(scope="session")
def proxied_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """Two nodes (RF 2, min.insync.replicas 2) whose client traffic crosses a TcpProxy each,
    so that holding one node's proxy leaves the other node's partitions reachable, and
    blackholing both is an outage for the agent alone. Its own cluster (the shared one has
    no proxies), shared by the tests that need proxies; two nodes, not three: the machine
    is shared, and a hold needs no third replica. A test restores what it held."""
    with KafkaCluster(tmp_path_factory.mktemp("proxied-kafka"), nodes=2,
                      proxied=True) as cluster:
        STARTED["proxied_kafka"] = cluster
        yield cluster


@pytest.fixture
def apache_kafka(kafka_cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The shared cluster, healthy when the test starts (every node up, every partition in
    sync). A test may kill, stop or restart nodes: whatever it left down is started again
    afterwards, and the cluster is healthy again before the next test. Isolate tests with
    ``unique_topic``, as Kafka's own integration tests do."""
    kafka_cluster.wait_healthy()
    yield kafka_cluster
    kafka_cluster.wait_healthy()


# --------------------------------------------------------------------------------------------
# The forwarder's fakes (tests/forwarder/fakes.py): no broker, the test plays the clusters
# --------------------------------------------------------------------------------------------


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    """A config, a buffer and a discard log to build a Forwarder over FakeClusters with
    ``setup.forwarder(clusters)``. (tests/forwarder/test_order.py has its own ``setup``.)"""
    from tests.forwarder.fakes import Setup  # here: loading this file imports no agent code

    s = Setup(tmp_path)
    try:
        yield s
    finally:
        s.store.close()


# --------------------------------------------------------------------------------------------
# Filesystems: real ones that run out of space (needs root, as CI has)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs mounted for this test."""
    with tmpfs(tmp_path / "small", 12) as mnt:
        yield mnt


# --------------------------------------------------------------------------------------------
# Artifacts: files a human may want after the run (screenshots, dumps); kept in test-artifacts/
# --------------------------------------------------------------------------------------------

ARTIFACTS_ROOT = REPO_ROOT / "test-artifacts"


@pytest.fixture
def artifacts_dir(request: pytest.FixtureRequest) -> Path:
    """An empty ``test-artifacts/<test id>/`` directory for this test (git-ignored)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", request.node.nodeid).strip("_")[:150]
    directory = ARTIFACTS_ROOT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory
