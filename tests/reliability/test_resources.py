"""Resources run out: the buffer (LMDB) at its maximum size, file descriptors at the limit, a
full disk. Ferry refuses what it cannot store, says so (503 + Retry-After, counted rejects),
loses nothing it acknowledged, and recovers by itself when the resource returns.

The full-disk case on a real tmpfs is tests/forwarder/test_discards.py
(test_full_disk_refuses_input_clearly_and_recovers_when_space_returns, datagrams);
``test_full_disk_over_http_is_503_never_500_and_recovers`` here adds the HTTP answer to it;
the map filling with tracking entries (not messages) is the last LMDB test.
"""

from __future__ import annotations

import collections
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agent.buffer.store import BufferFull, BufferUnavailable, Outcome, Store, StoredMessage
from agent.records import Record
from ferry_client import FerryClient
from spool.format import SpoolRecord
from spool.writer import write_spool_file
from tests.agent_harness import write_config
from tests.kafka import Broker, read_topic
from tests.reliability.harness import Agent, metric_total
from tests.waiting import wait_until

MB = 1024 * 1024


def _post_until_refused(client: httpx.Client, url: str, prefix: bytes, limit: int = 20_000
                        ) -> tuple[set[bytes], httpx.Response | None]:
    """POST up to ``limit`` numbered 1 KiB messages, until one is refused: the acknowledged
    ones and the refusal (None if none was refused)."""
    acked: set[bytes] = set()
    for i in range(limit):
        value = prefix + b"-%06d-" % i + b"x" * 1000
        r = client.post(url, content=value)
        if r.status_code not in (201, 202):
            return acked, r
        acked.add(value)
    return acked, None


def _ready(client: httpx.Client, url: str) -> httpx.Response:
    return client.get(url + "/status/ready")


def test_buffer_at_max_bytes_refuses_clearly_and_recovers_as_kafka_drains_it(
    tmp_path: Path, broker: Broker
) -> None:
    http_topic, sock_topic, spool_topic = "full-http", "full-socket", "full-spool"
    # ack_timeout_ms 0: answer 202 at once rather than wait for a Kafka that is down.
    config = write_config(tmp_path / "agent", broker.bootstrap, spool=True,
                          buffer={"max_bytes": MB},
                          topics={"default": {"ack_timeout_ms": 0}})
    spool_dir = tmp_path / "agent" / "spool"
    broker.stop()  # nothing leaves the buffer: it must fill
    with Agent(config) as agent, httpx.Client(timeout=10) as client, \
            FerryClient(agent.socket_path, timeout=5) as sock:
        url = agent.http_url
        numbers = iter(range(1_000_000))

        def datagrams(n: int) -> None:
            for _ in range(n):
                sock.send(sock_topic, b"d-%06d-" % next(numbers) + b"y" * 1000)

        datagrams(50)
        wait_until(lambda: metric_total(agent.counters(), "messages_accepted",
                                        source="socket") == 50, message="datagrams accepted")
        # -- HTTP: 503 buffer_full with Retry-After; readiness says why ----------------------
        acked, refusal = _post_until_refused(client, f"{url}/topics/{http_topic}", b"h")
        assert refusal is not None, f"{len(acked)} KiB accepted into a {MB} byte buffer"
        assert refusal.status_code == 503, refusal.text
        assert refusal.json()["error"] == "buffer_full"
        assert int(refusal.headers["Retry-After"]) >= 1
        ready = _ready(client, url)
        assert ready.status_code == 503 and ready.json()["reason"] == "buffer_full"
        assert int(ready.headers["Retry-After"]) >= 1
        # -- datagrams: refused groups are counted as buffer_full -----------------------------
        def socket_refused() -> bool:
            datagrams(20)
            return metric_total(agent.counters(), "messages_rejected", source="socket",
                                reason="buffer_full") > 0

        wait_until(socket_refused, timeout=30, message="datagrams refused as buffer_full")
        counters = agent.counters()
        assert metric_total(counters, "messages_rejected", source="http",
                            reason="buffer_full") >= 1
        # -- Kafka back: the forwarder drains the buffer, no restart needed ------------------
        broker.start()
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
                   message="buffer drained once Kafka is back")
        more, refusal = _post_until_refused(client, f"{url}/topics/{http_topic}", b"after",
                                            limit=50)
        acked |= more
        assert refusal is None, f"refused after draining: {refusal.status_code} {refusal.text}"
        accepted_socket = int(metric_total(agent.counters(), "messages_accepted",
                                           source="socket", topic=sock_topic))
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
                   message="buffer drained")
        http_values = {m.value for m in read_topic(broker.bootstrap, http_topic)}
        socket_values = {m.value for m in read_topic(broker.bootstrap, sock_topic)}
        assert acked <= http_values, f"{len(acked - http_values)} acknowledged HTTP lost"
        assert len(socket_values) == accepted_socket > 0  # every accepted datagram delivered

        # -- spool: a 3 MB file into a 1 MB buffer waits on disk, then goes through ---------
        broker.stop()  # (tansu keeps nothing across a restart: topics were read above)
        values = [b"s-%06d-" % i + b"z" * 1000 for i in range(3000)]
        write_spool_file(spool_dir, "big.ferry", [SpoolRecord(spool_topic, v) for v in values])
        wait_until(lambda: metric_total(agent.counters(), "spool_batches_deferred",
                                        reason="buffer_full") > 0,
                   timeout=60, message="spool intake refused for lack of space")
        # A batch that waits in its file is not refused input (only HTTP's were, above).
        assert metric_total(agent.counters(), "messages_rejected", source="spool") == 0
        # The intake claimed the file (spool/.ingesting/) and waits with it, its progress kept.
        assert (spool_dir / ".ingesting" / "big.ferry").exists(), (
            "the file waits while the buffer is full")
        broker.start()
        wait_until(lambda: not (spool_dir / ".ingesting" / "big.ferry").exists(), timeout=90,
                   message="spool file ingested once Kafka drains the buffer")
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
                   message="buffer drained")
        assert not list((spool_dir / "quarantine").glob("*"))
        spool_values = collections.Counter(m.value for m in read_topic(broker.bootstrap,
                                                                       spool_topic))
        assert set(values) <= spool_values.keys()
        assert agent.alive


def test_readiness_returns_by_itself_once_the_full_buffer_drains(
    tmp_path: Path, broker: Broker
) -> None:
    """/status/ready says buffer_full while the buffer is full, and ready again once Kafka has
    drained it, without any client having to send first: load balancers and clients that
    follow readiness send nothing to a not-ready instance."""
    config = write_config(tmp_path / "agent", broker.bootstrap, spool=False,
                          buffer={"max_bytes": MB}, topics={"default": {"ack_timeout_ms": 0}})
    broker.stop()
    with Agent(config) as agent, httpx.Client(timeout=10) as client:
        acked, refusal = _post_until_refused(client, f"{agent.http_url}/topics/ready", b"r")
        assert refusal is not None and refusal.status_code == 503
        assert _ready(client, agent.http_url).json()["reason"] == "buffer_full"
        broker.start()
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
                   message="buffer drained once Kafka is back")
        stuck = _wait_ready(client, agent.http_url, timeout=10)
        assert stuck is None, stuck


def _wait_ready(client: httpx.Client, url: str, timeout: float) -> str | None:
    """None once /status/ready answers 200 within ``timeout``; else what it said last."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        r = _ready(client, url)
        if r.status_code == 200:
            return None
        last = f"{r.status_code} {r.text}"
        time.sleep(0.1)
    return f"/status/ready still answers {last} {timeout:g} s after the buffer drained"


def test_tracking_of_delivered_messages_never_fills_the_buffer(tmp_path: Path) -> None:
    """Found by the long crash run: ``tracking`` keeps what became of every delivered message
    for ``status.track_seconds`` (an hour), inside the LMDB map but outside ``max_bytes``. At
    ~300 bytes per entry (the topic is in it) the map's headroom fills after a few hundred
    thousand deliveries; then every commit fails -- input refused ("the buffer's LMDB map is at
    its maximum size") *and* the forwarder's deletes, so the buffer cannot drain either: the
    agent is wedged until tracking entries expire, which needs a write that cannot happen.

    The real Store, as the forwarder uses it: append, read, remove as delivered; 1 MiB
    max_bytes (map cap 65 MiB), a long topic name."""
    store = Store(tmp_path / "buffer", MB, track=True, track_seconds=3600)
    topic = "t" * 240
    delivered = 0

    def deliver(batch: list[StoredMessage]) -> None:
        store.remove([Outcome(m.key, m.stored_bytes, topic, "delivered", "local", 0, i)
                      for i, m in enumerate(batch)])

    try:
        for _ in range(400):  # 400,000 messages in a few seconds; ~1,000 buffered at a time
            before = [m for m in store.read(topic, None, 5000) if isinstance(m, StoredMessage)]
            try:
                [ids] = store.append([[Record(topic, b"v", None, None, 1) for _ in range(1000)]])
            except (BufferFull, BufferUnavailable) as exc:
                ids = exc  # type: ignore[assignment]
            if not isinstance(ids, list):
                try:
                    deliver(before)
                    drains = "the forwarder can still delete"
                except (BufferFull, BufferUnavailable) as exc:
                    drains = f"and deleting the {len(before)} buffered fails too: {exc}"
                raise AssertionError(f"append refused after {delivered:,} deliveries with "
                                     f"{len(before)} buffered: {ids}; {drains}")
            deliver(before)
            delivered += len(before)
    finally:
        store.close()


# --------------------------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------------------------


def test_full_disk_over_http_is_503_never_500_and_recovers(
    tmp_path: Path, small_disk: Path, broker: Broker
) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 6 * MB)
    topic = "disk-full-http"
    config = write_config(tmp_path / "agent", broker.bootstrap, spool=False,
                          buffer={"path": small_disk / "buffer", "max_bytes": 512 * MB,
                                  "reserve_bytes": 2 * MB},
                          topics={"default": {"ack_timeout_ms": 0}})
    broker.stop()  # nothing leaves the buffer: the disk must fill
    with Agent(config) as agent, httpx.Client(timeout=10) as client:
        url = f"{agent.http_url}/topics/{topic}"
        acked, refusal = _post_until_refused(client, url, b"disk")
        assert refusal is not None, "a 12 MiB disk took everything"
        assert refusal.status_code == 503, refusal.text
        assert refusal.json()["error"] == "disk_full", refusal.text
        assert int(refusal.headers["Retry-After"]) >= 1
        # Further attempts: refused clearly, or (a small one fitting in a free page) stored.
        statuses: collections.Counter[int] = collections.Counter()
        for i in range(20):
            value = b"more-%02d-" % i + b"m" * 1000
            r = client.post(url, content=value)
            statuses[r.status_code] += 1
            if r.status_code in (201, 202):
                acked.add(value)
        assert set(statuses) <= {201, 202, 503}, statuses
        refused = 1 + statuses[503]
        wait_until(lambda: metric_total(agent.counters(), "messages_rejected", source="http",
                                        reason="disk_full") == refused,
                   message=f"{refused} refusals counted as disk_full")
        filler.unlink()  # space returns: accepted again, no restart
        more, refusal = _post_until_refused(client, url, b"after", limit=20)
        assert refusal is None, f"{refusal.status_code} {refusal.text}"
        acked |= more
        broker.start()
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
                   message="buffer drained")
        assert agent.alive
    got = {m.value for m in read_topic(broker.bootstrap, topic)}
    assert acked <= got, f"{len(acked - got)} acknowledged messages lost"


# --------------------------------------------------------------------------------------------
# File descriptors
# --------------------------------------------------------------------------------------------

NOFILE = 128


# Header and keep-alive deadlines shorter than the defaults (10 s and 5 s), so that the
# test of idle connections waits seconds, not tens of them; tests/http/test_limits.py
# covers the deadlines themselves.
HEADER_TIMEOUT = 2.0


@pytest.fixture
def fd_starved_agent(tmp_path: Path, session_broker: Broker) -> Iterator[Agent]:
    """An agent whose processes may open only NOFILE file descriptors each."""
    config = write_config(tmp_path / "agent", session_broker.bootstrap, spool=True,
                          http={"header_timeout_seconds": HEADER_TIMEOUT,
                                "keep_alive_seconds": HEADER_TIMEOUT})
    agent = Agent(config, nofile=NOFILE)
    with agent:
        yield agent


def _connect_many(agent: Agent, n: int) -> list[socket.socket]:
    host, port = agent.config.http.host, agent.config.http.port
    conns = []
    for _ in range(n):  # the kernel completes handshakes into the backlog (2048)
        conns.append(socket.create_connection((host, port), timeout=5))
    return conns


def _ingest_fds(agent: Agent) -> int:
    assert agent.proc is not None
    return agent.usage().per_pid[agent.proc.pid].fds


def test_a_connection_flood_at_the_descriptor_limit_starves_no_intake(
    fd_starved_agent: Agent, session_broker: Broker, unique_topic: str
) -> None:
    """Twice as many HTTP connections as the process may open descriptors: the HTTP
    connection cap (agent/ingest/http/server.py, a quarter of a limit this small kept for
    the rest) holds the listener below the limit, so datagrams, a spool file and a new HTTP
    publish all go through during the flood."""
    agent = fd_starved_agent
    assert agent.proc is not None
    spool_dir = Path(agent.config.spool.dirs[0])
    conns = _connect_many(agent, 2 * NOFILE)
    try:
        values = [b"fd-%04d" % i for i in range(500)]
        with FerryClient(agent.socket_path, timeout=5) as sock:
            for v in values:
                sock.send(unique_topic, v)
        spool_values = [b"fd-spool-%04d" % i for i in range(100)]
        write_spool_file(spool_dir, "during.ferry",
                         [SpoolRecord(unique_topic, v) for v in spool_values])
        with httpx.Client(timeout=5) as client:
            r = client.post(f"{agent.http_url}/topics/{unique_topic}", content=b"fd-during")
            assert r.status_code in (201, 202), r.text
        wait_until(lambda: not (spool_dir / "during.ferry").exists()
                   and not (spool_dir / ".ingesting" / "during.ferry").exists(), timeout=30,
                   message="the spool file ingested during the flood")
        expected = set(values) | set(spool_values) | {b"fd-during"}
        wait_until(lambda: expected <= {m.value for m in read_topic(
            session_broker.bootstrap, unique_topic)}, timeout=30, interval=0.5,
            message="everything delivered")
        assert _ingest_fds(agent) < NOFILE, "the listener took every descriptor"
        assert agent.alive
    finally:
        for c in conns:
            c.close()
    counters = agent.counters()
    assert metric_total(counters, "process_restarts") == 0
    assert not list((spool_dir / "quarantine").glob("*"))


def test_idle_connections_do_not_hold_descriptors_forever(fd_starved_agent: Agent) -> None:
    """A client that connects and never sends a request (or stops halfway through its
    headers) must not keep a descriptor for good: enough of them starve HTTP of new
    connections. A connection idle after a response goes after ``http.keep_alive_seconds``;
    these two kinds after ``http.header_timeout_seconds`` (HEADER_TIMEOUT here)."""
    agent = fd_starved_agent
    before = _ingest_fds(agent)
    idle = _connect_many(agent, 20)
    partial = _connect_many(agent, 20)
    for c in partial:
        c.sendall(b"POST /topics/t HTTP/1.1\r\nHost: x\r\n")  # headers never finish
    try:
        # (Margins: the agent opens and closes a few descriptors of its own now and then.)
        wait_until(lambda: _ingest_fds(agent) >= before + 35, timeout=10,
                   message="the connections accepted")
        wait_until(lambda: _ingest_fds(agent) <= before + 5, timeout=15, interval=0.5,
                   message="idle and half-sent connections closed by the agent "
                           f"(descriptors before them: {before})")
    finally:
        for c in idle + partial:
            c.close()
