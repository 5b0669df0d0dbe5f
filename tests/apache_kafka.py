"""Real Apache Kafka for tests and benchmarks: KRaft nodes started from Kafka's own jars.

A :class:`KafkaCluster` formats KRaft storage and starts N combined broker+controller nodes
(``process.roles=broker,controller``) on loopback ports, each one JVM whose PID this module
holds: :meth:`KafkaCluster.kill` is a SIGKILL of that PID, :meth:`KafkaCluster.start_node`
starts the same node again on its own ports and data, as an operator's restart would.

The jars are Apache Kafka's, at the version pinned in ``dev/kafka/pom.xml``, copied from Maven
Central into ``.venv/kafka/<version>/libs`` by ``dev/kafka/fetch`` (``dev/bootstrap test``
runs it). Nothing here downloads anything.

Settings that differ from a broker's defaults, and why (everything else is Kafka's default):

- ``default.replication.factor`` = 3 and ``min.insync.replicas`` = 2 with three nodes, as
  operators run (``offsets``/``transaction.state`` topics likewise).
- ``broker.session.timeout.ms`` 4 s (default 9 s), heartbeats every 0.5 s: a killed node is
  fenced, and its partitions' leadership moves, in seconds rather than tens of them, so
  failure tests wait less. The mechanism is the same.
- 10 partitions (default 50) for ``__consumer_offsets`` and ``__transaction_state``, a small
  log-cleaner buffer and few network/IO threads: five JVMs on a 2-core machine.
- The JVMs run with the C1 compiler alone (``-XX:TieredStopAtLevel=1``): starts and restarts,
  which Kafka tests wait on, cost less CPU; test traffic needs no C2 code.
- The JVMs load Kafka's classes from a class-data archive when there is one
  (:func:`build_class_archive`, which ``dev/test`` runs before the suite): a node's start then
  costs about half the CPU and half the time, since most of it is loading and verifying the
  same few thousand classes. Without the archive (or with one the JVM finds stale) the nodes
  start as usual, from the jars.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from confluent_kafka import KafkaException, TopicCollection
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # not re-exported
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewPartitions,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)

from tests.kafka import (
    LOOPBACK,
    TcpProxy,
    kill_process,
    log_tail,
    port_accepts,
    track_process,
)
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
POM = REPO_ROOT / "dev" / "kafka" / "pom.xml"


@functools.cache
def kafka_version() -> str:
    """The Apache Kafka version the suite runs (``dev/kafka/pom.xml``, its one pin)."""
    found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    if found is None:
        raise RuntimeError(f"no <kafka.version> in {POM}")
    return found.group(1)


@functools.cache
def newest_kafka_version() -> str:
    """The newest Apache Kafka release, run beside the pinned one by the cases that must
    hold on both (``<kafka.newest.version>`` in ``dev/kafka/pom.xml``)."""
    found = re.search(r"<kafka\.newest\.version>([^<]+)</kafka\.newest\.version>",
                      POM.read_text())
    if found is None:
        raise RuntimeError(f"no <kafka.newest.version> in {POM}")
    return found.group(1)


def config_command(version: str) -> str:
    """The main class of Kafka's ``kafka-configs`` tool in ``version``: in the tools module
    (kafka-tools) where that has it, as 4.4 does; in the core jar before."""
    for jar in kafka_libs(version).glob(f"kafka-tools-{version}.jar"):
        with zipfile.ZipFile(jar) as tools:
            if "org/apache/kafka/tools/ConfigCommand.class" in tools.namelist():
                return "org.apache.kafka.tools.ConfigCommand"
    return "kafka.admin.ConfigCommand"


def kafka_libs(version: str | None = None) -> Path:
    """The folder of Kafka's jars (the pinned version, or ``version``); FileNotFoundError
    says how to get them."""
    version = version or kafka_version()
    libs = REPO_ROOT / ".venv" / "kafka" / version / "libs"
    if not (libs.parent / ".complete").is_file():
        raise FileNotFoundError(
            f"Apache Kafka {version}'s jars are not in {libs}: run dev/bootstrap test "
            "(or dev/kafka/fetch alone)"
        )
    return libs


def class_archive(version: str | None = None) -> Path:
    """Where :func:`build_class_archive` keeps the class-data archive of Kafka ``version``."""
    return kafka_libs(version).parent / "classes.jsa"


def build_class_archive(version: str | None = None, timeout: float = 180.0) -> Path:
    """Write the class-data archive of Kafka ``version`` (the pinned one by default), unless
    it exists: one node is started with ``-XX:ArchiveClassesAtExit`` and stopped as systemd
    would (SIGTERM), and the JVM writes every class it loaded into the archive as it exits.
    Every JVM of this module starts from it after that (``-XX:SharedArchiveFile``). The JVM
    checks the archive against itself and the jars, and ignores one that does not match."""
    version = version or kafka_version()
    archive = class_archive(version)
    if archive.exists():
        return archive
    partial = archive.with_name(f"{archive.name}.{uuid.uuid4().hex}.tmp")
    root = Path(tempfile.mkdtemp(prefix="ferry-kafka-archive-"))
    cluster = KafkaCluster(root, nodes=1, version=version, start_timeout=timeout,
                           archive_to=partial)
    try:
        cluster.start()
        cluster.stop_node(1, timeout=timeout)
        if not partial.is_file():
            raise KafkaStartError(f"the JVM wrote no class archive at {partial}\n"
                                  f"{cluster.node(1).log_tail()}")
        partial.replace(archive)  # whole or not at all: a half-written one is never used
    finally:
        cluster.stop()  # a node that never became ready is not left running
        partial.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    return archive


_handed_out: set[int] = set()


def node_port() -> int:
    """A free loopback port below the kernel's ephemeral range, for a node's listener.

    A node keeps its ports across kills and restarts, and binds them seconds after they are
    picked. Ports from the ephemeral range (what ``free_port`` and every outgoing client
    connection use) can be taken by some client's connection in between; below the range,
    only another listener can take one.
    """
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (Kafka's Uuid).

    Never one that starts with "-" (1 in 64 would): the storage tool's argument parser takes
    it for an option, as Kafka's own ``Uuid.randomUuid`` avoids for the same reason."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode()`` (UTF-16 code units), as a signed 32-bit int."""
    value = 0
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        value = (31 * value + int.from_bytes(data[i:i + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def transaction_state_partition(transactional_id: str, partitions: int) -> int:
    """The ``__transaction_state`` partition (and so the coordinator) of a transactional id:
    Kafka's ``Utils.abs(id.hashCode()) % partitions``, where abs(MIN_VALUE) is 0."""
    code = java_string_hash(transactional_id)
    return (0 if code == -(1 << 31) else abs(code)) % partitions


class KafkaStartError(RuntimeError):
    """A node did not start or join in time; the message carries the end of its log."""


PROXIED = "PROXIED"

_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
logger.state.name = state.change.logger
logger.state.level = warn
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.zk.name = org.apache.kafka.raft
logger.zk.level = warn
"""


@dataclass(frozen=True)
class Listener:
    """An extra client listener on every node: ``name`` (e.g. ``SASL_SSL``), its security
    protocol, and broker properties for it, each written as
    ``listener.name.<name lower>.<key>=<value>``."""

    name: str
    protocol: str
    properties: Mapping[str, str] = field(default_factory=dict)


@dataclass
class KafkaNode:
    """One combined broker+controller JVM. Its ports and data survive kills and restarts."""

    node_id: int
    port: int
    controller_port: int
    extra_ports: dict[str, int]
    root: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def config_path(self) -> Path:
        return self.root / "server.properties"

    @property
    def log_path(self) -> Path:
        return self.root / "node.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


class KafkaCluster:
    """``nodes`` Apache Kafka nodes in KRaft mode on 127.0.0.1, all voters of the quorum.

    ``bootstrap`` names every node's PLAINTEXT listener. ``listeners`` adds client listeners
    (TLS, SASL) next to it; ``scram_users`` (name → password) are written into the storage
    at format time as SCRAM-SHA-512 credentials, as ``kafka-storage format --add-scram`` does.
    ``properties`` override the broker settings this module picks.

    ``proxied=True`` adds a client listener ``PROXIED`` on every node, advertised at the port
    of a :class:`~tests.kafka.TcpProxy` in front of it (:meth:`proxy`), so that clients
    bootstrapped from :attr:`proxied_bootstrap` send *all* their traffic through the proxies,
    while the nodes replicate to each other directly: a proxy's ``hold``, ``blackhole`` or
    ``cut`` acts on the clients' traffic to that node alone.

    Use as a context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        root: Path,
        nodes: int = 3,
        *,
        min_insync_replicas: int | None = None,
        auto_create_topics: bool = True,
        listeners: Iterable[Listener] = (),
        scram_users: Mapping[str, str] | None = None,
        properties: Mapping[str, str | int] | None = None,
        heap: str = "768m",
        start_timeout: float = 180.0,
        proxied: bool = False,
        version: str | None = None,
        archive_to: Path | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.root = root
        self.version = version or kafka_version()
        self.size = nodes
        self.replication = min(3, nodes)
        self.min_insync = (
            min_insync_replicas if min_insync_replicas is not None else min(2, nodes)
        )
        self.auto_create_topics = auto_create_topics
        self.listeners = tuple(listeners)
        if proxied:
            self.listeners += (Listener(PROXIED, "PLAINTEXT"),)
        self.scram_users = dict(scram_users or {})
        self.properties = dict(properties or {})
        self.heap = heap
        self.start_timeout = start_timeout
        self.cluster_id = new_cluster_id()
        self.nodes = [
            KafkaNode(
                node_id=i,
                port=node_port(),
                controller_port=node_port(),
                extra_ports={listener.name: node_port() for listener in self.listeners},
                root=root / f"node-{i}",
            )
            for i in range(1, nodes + 1)
        ]
        self._proxies = {
            node.node_id: TcpProxy(node.extra_ports[PROXIED]) for node in self.nodes
        } if proxied else {}
        self._formatted = False
        # Only build_class_archive sets it: the JVMs write the classes they loaded there.
        self._archive_to = archive_to

    # -- addresses ---------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for PLAINTEXT clients: every node."""
        return ",".join(node.bootstrap for node in self.nodes)

    def listener_bootstrap(self, name: str) -> str:
        """``bootstrap.servers`` for the extra listener called ``name``."""
        return ",".join(f"{LOOPBACK}:{node.extra_ports[name]}" for node in self.nodes)

    @property
    def proxied_bootstrap(self) -> str:
        """``bootstrap.servers`` through the proxies (``proxied=True`` only)."""
        return ",".join(f"{LOOPBACK}:{proxy.port}" for proxy in self._proxies.values())

    def proxy(self, node_id: int) -> TcpProxy:
        """The TcpProxy in front of node ``node_id``'s PROXIED listener."""
        return self._proxies[node_id]

    def node(self, node_id: int) -> KafkaNode:
        return self.nodes[node_id - 1]

    # -- configuration -------------------------------------------------------------------------

    def _server_properties(self, node: KafkaNode) -> dict[str, str]:
        voters = ",".join(f"{n.node_id}@{LOOPBACK}:{n.controller_port}" for n in self.nodes)
        listeners = [f"PLAINTEXT://{LOOPBACK}:{node.port}"]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        for listener in self.listeners:
            listeners.append(f"{listener.name}://{LOOPBACK}:{node.extra_ports[listener.name]}")
            protocols.append(f"{listener.name}:{listener.protocol}")
        advertised = [
            f"{PROXIED}://{LOOPBACK}:{self._proxies[node.node_id].port}"
            if entry.startswith(f"{PROXIED}://") else entry
            for entry in listeners
        ]
        listeners.append(f"CONTROLLER://{LOOPBACK}:{node.controller_port}")
        rf = str(self.replication)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": ",".join(protocols),
            "log.dirs": str(node.data_dir),
            "auto.create.topics.enable": str(self.auto_create_topics).lower(),
            "num.partitions": "1",
            "default.replication.factor": rf,
            "min.insync.replicas": str(self.min_insync),
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": str(self.min_insync),
            "transaction.state.log.num.partitions": "10",
            "group.initial.rebalance.delay.ms": "0",
            "broker.heartbeat.interval.ms": "500",
            "broker.session.timeout.ms": "4000",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "background.threads": "4",
            "num.recovery.threads.per.data.dir": "1",
            "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
        }
        for listener in self.listeners:
            prefix = f"listener.name.{listener.name.lower()}."
            props.update({prefix + k: v for k, v in listener.properties.items()})
        props.update({k: str(v) for k, v in self.properties.items()})
        return props

    def _write_config(self, node: KafkaNode) -> None:
        node.root.mkdir(parents=True, exist_ok=True)
        lines = [f"{k}={v}" for k, v in self._server_properties(node).items()]
        node.config_path.write_text("\n".join(lines) + "\n")

    def _java(self, *args: str, heap: str = "256m") -> list[str]:
        log4j = self.root / "log4j2.properties"
        if not log4j.exists():
            log4j.parent.mkdir(parents=True, exist_ok=True)
            log4j.write_text(_LOG4J2)
        return [
            "java",
            f"-Xmx{heap}",
            "-Xms128m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            # C1 only: a node's start is mostly JIT work, which C2 makes several times
            # costlier, and on a shared 2-core host the start of each JVM (a cluster's,
            # every restart's) is what Kafka tests wait on; the brokers here carry test
            # traffic, far below what C1's code sustains.
            "-XX:TieredStopAtLevel=1",
            # A node out of memory stops at once with the error in its log, rather than
            # living on with a dead thread (a controller channel) and failing tests obscurely.
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            *self._archive_options(),
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            f"{kafka_libs(self.version)}/*",
            *args,
        ]

    def _archive_options(self) -> list[str]:
        """The class-data archive's JVM options (build_class_archive). Its log lines are off:
        a stale archive is ignored with a warning, on the standard output that the callers
        of Kafka's tools read."""
        if self._archive_to is not None:
            return [f"-XX:ArchiveClassesAtExit={self._archive_to}"]
        archive = class_archive(self.version)
        if not archive.is_file():
            return []
        return [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]

    def _format(self) -> None:
        for node in self.nodes:
            self._write_config(node)
            command = self._java(
                "kafka.tools.StorageTool", "format", "--ignore-formatted",
                "-t", self.cluster_id, "-c", str(node.config_path),
            )
            for name, password in self.scram_users.items():
                command += ["--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise KafkaStartError(
                    f"formatting node {node.node_id} failed:\n{done.stdout}\n{done.stderr}"
                )
        self._formatted = True

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Format storage (first time only), start every node, wait until all have joined."""
        if not self._formatted:
            self._format()
        for node in self.nodes:
            if not node.running:
                self._spawn(node)
        self.wait_ready()

    def _spawn(self, node: KafkaNode) -> None:
        node.starts += 1
        with node.log_path.open("ab") as log:
            log.write(f"=== ferry tests: start #{node.starts}\n".encode())
            log.flush()
            node.process = subprocess.Popen(
                self._java("kafka.Kafka", str(node.config_path), heap=self.heap),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the test run is not the node's
            )
        track_process(node.process)

    def start_node(self, node_id: int, *, wait: bool = True,
                   timeout: float | None = None) -> None:
        """Start a stopped node again (same ports, same data); wait until it has joined,
        for ``timeout`` seconds (default: the cluster's ``start_timeout``). A node restarted
        after a kill -9 recovers its logs first, which takes longer on a loaded host."""
        node = self.node(node_id)
        if node.running:
            raise RuntimeError(f"node {node_id} is running")
        self._spawn(node)
        if wait:
            self.wait_ready([node_id], timeout=timeout)

    def kill(self, node_id: int) -> None:
        """SIGKILL one node's JVM (no shutdown of any kind) and reap it."""
        node = self.node(node_id)
        process, node.process = node.process, None
        if process is not None:
            kill_process(process)

    def stop_node(self, node_id: int, timeout: float = 60.0) -> None:
        """SIGTERM: a controlled shutdown (leadership moved away first), as systemd stops."""
        node = self.node(node_id)
        process, node.process = node.process, None
        if process is None:
            return
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
        kill_process(process)  # reaps it; SIGKILLs it only if the shutdown hung

    def restart(self, node_id: int) -> None:
        """kill -9 then start again, and wait until the node is back in every ISR."""
        self.kill(node_id)
        self.start_node(node_id)
        self.wait_healthy()

    def stop(self) -> None:
        """SIGKILL every node and close the proxies. Idempotent."""
        for node in self.nodes:
            self.kill(node.node_id)
        for proxy in self._proxies.values():
            proxy.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        states = ", ".join(
            f"{n.node_id}:{n.port}{'' if n.running else ' down'}" for n in self.nodes
        )
        return f"<KafkaCluster {self.cluster_id} [{states}] at {self.root}>"

    # -- readiness -----------------------------------------------------------------------------

    def admin(self, **extra: Any) -> AdminClient:
        """An AdminClient on the running nodes (keep it alive while its futures run)."""
        running = [n.bootstrap for n in self.nodes if n.running] or [self.bootstrap]
        return AdminClient({"bootstrap.servers": ",".join(running), "log_level": 0, **extra})

    def live_brokers(self, via: KafkaNode | None = None) -> set[int]:
        """Node ids the cluster's metadata lists as brokers now (empty if none answers)."""
        targets = [via] if via is not None else [n for n in self.nodes if n.running]
        for node in targets:
            if not port_accepts(node.port, timeout=0.5):
                continue
            admin = AdminClient({"bootstrap.servers": node.bootstrap, "log_level": 0})
            try:
                return set(admin.list_topics(timeout=3.0).brokers)
            except KafkaException:
                continue
        return set()

    def wait_ready(self, node_ids: Iterable[int] | None = None, *,
                   timeout: float | None = None) -> None:
        """Until each named node (default: every running one) is up and listed as a broker."""
        wanted = list(node_ids) if node_ids is not None else [
            n.node_id for n in self.nodes if n.running
        ]
        limit = timeout if timeout is not None else self.start_timeout
        deadline = time.monotonic() + limit
        for node_id in wanted:
            node = self.node(node_id)
            while True:
                if not node.running:
                    raise KafkaStartError(
                        f"node {node_id} exited during start-up\n{node.log_tail()}"
                    )
                if node_id in self.live_brokers(via=node):
                    break
                if time.monotonic() > deadline:
                    raise KafkaStartError(
                        f"node {node_id} not ready within {limit}s\n"
                        f"{node.log_tail()}"
                    )
                time.sleep(0.1)

    def under_replicated(self) -> list[tuple[str, int]]:
        """(topic, partition) whose in-sync replicas are fewer than their replicas."""
        metadata = self.admin().list_topics(timeout=10.0)
        return [
            (name, pid)
            for name, topic in metadata.topics.items()
            for pid, partition in topic.partitions.items()
            if len(partition.isrs) < len(partition.replicas) or partition.leader < 0
        ]

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Until every node runs, is a broker, and every partition is fully in sync."""
        for node in self.nodes:
            if not node.running:
                self.start_node(node.node_id)
        wait_until(
            lambda: self.live_brokers() == {n.node_id for n in self.nodes}
            and not self.under_replicated(),
            timeout=timeout,
            message=f"{self!r} healthy (every node a broker, no under-replicated partition)",
        )

    # -- topics --------------------------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        *,
        replication: int | None = None,
        config: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Create ``name`` and return once every node's metadata has all its leaders."""
        admin = self.admin()
        rf = replication if replication is not None else self.replication
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=rf,
                      config=dict(config or {}))],
            request_timeout=timeout,
        )
        futures[name].result(timeout=timeout)
        self.wait_for_leaders(name, partitions, timeout=timeout)

    def set_acl(self, resource: str, name: str, operation: str, permission: str,
                principal: str = "User:ANONYMOUS", *, prefixed: bool = False,
                remove: bool = False, timeout: float = 30.0) -> None:
        """Add (or ``remove``) an ACL (needs a cluster with an authorizer), e.g.
        ``("TOPIC", "orders", "WRITE", "DENY")``; ``resource`` is confluent-kafka's
        ResourceType name (TOPIC, GROUP, TRANSACTIONAL_ID, BROKER for the cluster), and
        ``prefixed`` matches every name starting with ``name``. Returns once every running
        node enforces it."""
        pattern = ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL
        kind = ResourceType[resource]
        op, allow = AclOperation[operation], AclPermissionType[permission]
        admin = self.admin()
        if remove:
            futures = admin.delete_acls(
                [AclBindingFilter(kind, name, pattern, principal, "*", op, allow)],
                request_timeout=timeout)
        else:
            futures = admin.create_acls([AclBinding(kind, name, pattern, principal, "*", op,
                                                    allow)], request_timeout=timeout)
        for future in futures.values():
            future.result(timeout=timeout)
        want = 0 if remove else 1
        match = AclBindingFilter(kind, name, pattern, principal, None, op, allow)

        def everywhere() -> bool:
            for node in self.nodes:
                if not node.running:
                    continue
                client = self.admin(**{"bootstrap.servers": node.bootstrap})
                found = client.describe_acls(match, request_timeout=timeout).result(
                    timeout=timeout)
                if len(found) != want:
                    return False
            return True

        wait_until(everywhere, timeout=timeout, interval=0.2,
                   message=f"the ACL on {resource} {name} {'gone' if remove else 'in force'}")

    def set_client_quota(self, client_id: str, producer_byte_rate: int | None,
                         timeout: float = 120.0) -> None:
        """Give the clients whose ``client.id`` is ``client_id`` a producer quota of
        ``producer_byte_rate`` bytes a second on each broker (None: remove it). Kafka
        throttles a client above its quota (it delays its next requests), it refuses
        nothing. A quota on a client id the test chose leaves every other test's clients
        alone, should its removal fail.

        Run with Kafka's own ``ConfigCommand`` and the cluster's jars: confluent-kafka 2.16's
        AdminClient has no client-quota call. It returns once the controller has committed
        the change; each broker applies it from the metadata log as it reads it."""
        change = (["--add-config", f"producer_byte_rate={producer_byte_rate}"]
                  if producer_byte_rate is not None else ["--delete-config", "producer_byte_rate"])
        running = ",".join(n.bootstrap for n in self.nodes if n.running) or self.bootstrap
        done = subprocess.run(
            self._java(config_command(self.version), "--bootstrap-server", running, "--alter",
                       *change, "--entity-type", "clients", "--entity-name", client_id),
            capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or "Completed updating config" not in done.stdout:
            raise RuntimeError(f"quota on client id {client_id!r} not changed:\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    @contextlib.contextmanager
    def client_quota(self, client_id: str, producer_byte_rate: int) -> Iterator[None]:
        """:meth:`set_client_quota` for the ``with`` block, removed however it ends."""
        self.set_client_quota(client_id, producer_byte_rate)
        try:
            yield
        finally:
            self.set_client_quota(client_id, None)

    def add_partitions(self, name: str, total: int, timeout: float = 30.0) -> None:
        admin = self.admin()
        futures = admin.create_partitions([NewPartitions(name, total)], request_timeout=timeout)
        futures[name].result(timeout=timeout)
        self.wait_for_leaders(name, total, timeout=timeout)

    def delete_topic(self, name: str, timeout: float = 30.0) -> None:
        """Delete ``name`` and return once no node knows the deleted topic any more. With
        auto-create on, a client's metadata request may re-create it at once: a topic of
        the same name with another topic id counts as gone."""
        admin = self.admin()
        before = self.topic_id(name)
        admin.delete_topics([name], request_timeout=timeout)[name].result(timeout=timeout)

        def gone_everywhere() -> bool:
            for node in self.nodes:
                if node.running and name in self._topics_via(node):
                    current = self.topic_id(name, via=node)
                    if current is None or current == before:
                        return False
            return True

        wait_until(gone_everywhere, timeout=timeout,
                   message=f"topic {name!r} (id {before}) gone from every node's metadata")

    def topic_id(self, name: str, via: KafkaNode | None = None) -> str | None:
        """The topic id of ``name`` as a node (default: any running one) describes it, or
        None when it does not know the topic."""
        bootstrap = via.bootstrap if via is not None else ",".join(
            n.bootstrap for n in self.nodes if n.running)
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
        future = admin.describe_topics(TopicCollection([name]), request_timeout=10)[name]
        try:
            return str(future.result(timeout=15).topic_id)
        except KafkaException:
            return None

    def _topics_via(self, node: KafkaNode) -> dict[str, Any]:
        admin = AdminClient({"bootstrap.servers": node.bootstrap, "log_level": 0})
        topics: dict[str, Any] = admin.list_topics(timeout=5.0).topics
        return topics

    def wait_for_leaders(self, name: str, partitions: int, timeout: float = 30.0) -> None:
        def everywhere() -> bool:
            for node in self.nodes:
                if not node.running:
                    continue
                topic = self._topics_via(node).get(name)
                if topic is None or topic.error is not None:
                    return False
                if sorted(topic.partitions) != list(range(partitions)):
                    return False
                if any(p.leader < 0 for p in topic.partitions.values()):
                    return False
            return True

        wait_until(everywhere, timeout=timeout,
                   message=f"topic {name!r}: {partitions} partitions with leaders everywhere")

    def leader(self, topic: str, partition: int = 0) -> int:
        """The node id leading ``topic``'s ``partition`` now (-1: none, or not known yet: a
        broker that answers just after the topic's creation may not list it)."""
        metadata = self.admin().list_topics(topic, timeout=10.0)
        found = metadata.topics.get(topic)
        p = found.partitions.get(partition) if found is not None else None
        return int(p.leader) if p is not None else -1

    def isr(self, topic: str, partition: int = 0) -> list[int]:
        metadata = self.admin().list_topics(topic, timeout=10.0)
        return list(metadata.topics[topic].partitions[partition].isrs)

    def transaction_coordinator(self, transactional_id: str) -> int:
        """The node leading the ``__transaction_state`` partition of ``transactional_id``;
        ``LookupError`` until the first transactional producer has made that topic."""
        metadata = self.admin().list_topics("__transaction_state", timeout=10.0)
        topic = metadata.topics["__transaction_state"]
        if not topic.partitions:
            raise LookupError("__transaction_state does not exist yet")
        index = transaction_state_partition(transactional_id, len(topic.partitions))
        leader: int = topic.partitions[index].leader
        return leader


if __name__ == "__main__":
    # dev/test: the class-data archives of the Kafka versions the suite runs, side by side
    # (each is mostly one JVM's start, while the lint stage keeps one core busy).
    from concurrent.futures import ThreadPoolExecutor

    versions = sorted({kafka_version(), newest_kafka_version()})
    with ThreadPoolExecutor(len(versions)) as pool:
        for each, archive in zip(versions, pool.map(build_class_archive, versions),
                                 strict=True):
            print(f"apache_kafka: class archive of Kafka {each}: {archive}")
