"""The crash checker: numbered messages over all three inputs, SIGKILLs at random points, and a
count of what Kafka holds at the end.

``run_crash_check`` runs the agent (``ferry run``, both processes) against a broker that stays
up, feeds it from four load threads, and SIGKILLs the whole process group ``kills`` times at
random points. After the last kill it starts the agent once more, lets it finish (spool files
ingested, buffer drained), reads every topic back and compares with what was acknowledged.

Each message value names its input and a sequence number (``http-00000123``); each input has
its own topic. What counts as *acknowledged*, per input:

- **http**: the request got 201 or 202. A request whose answer never arrived (the connection
  died with the agent) is not acknowledged, even if it was committed.
- **spool**: ``write_spool_file`` returned, i.e. the file was fsynced and renamed into the
  spool directory (the agent's ack for a spool file is the directory entry itself).
- **socket**: datagrams carry no answer, so they go in *rounds*. A round counts as
  acknowledged only once the agent's ``messages_accepted{source="socket", topic}`` counter
  (per process life, read from ``/status/counters``) shows every datagram sent in this life,
  this round included. A kill before that leaves the whole round unacknowledged. The socket
  topic has no other sender, so the counter can only be reached by these datagrams; the
  counter moves after the commit (fsync), so a counted datagram is durable.

At the end: ``lost`` = acknowledged values missing from Kafka (must be 0); ``duplicates`` =
extra copies of any value (at-least-once delivery allows them: a kill between a Kafka ack and
the buffer's delete); ``unacked_delivered`` = values delivered though their sender never saw
an acknowledgement (committed, then killed before the answer); ``unknown`` = values in Kafka
that were never sent (must be 0).

Kill points (``KILL_MODES``), chosen at random per life:

- ``timer``: a random delay under load (HTTP requests, datagram rounds and spool files in
  progress, the forwarder delivering).
- ``http_ack``: the moment an HTTP request was answered (commit just done, more in flight).
- ``spool_mid_file``: while a spool file larger than one intake batch (20,000 records) is half
  ingested: its first batch committed, the file still there.
- ``startup``: while the agent is still starting (recovering from the previous kill): spool
  files resuming, the forwarder re-sending what is buffered.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from confluent_kafka import Consumer, TopicPartition

from agent.buffer.store import Store
from ferry_client import FerryClient
from spool.format import SpoolRecord
from spool.writer import unique_file_name, write_spool_file
from tests.agent_harness import write_config
from tests.kafka import Broker, topic_partitions
from tests.reliability.harness import Agent, metric_total, read_values
from tests.waiting import wait_until


def spool_files_left(spool_dir: Path) -> list[Path]:
    """Spool files not ingested yet: waiting under their names, or claimed by the agent and
    being read (``.ingesting/``, where a killed agent's file resumes)."""
    return [*spool_dir.glob("*.ferry"), *(spool_dir / ".ingesting").glob("*.ferry")]


INPUTS = ("http", "spool", "socket")
# With exactly_once=True, each input also feeds a topic with delivery = "exactly_once", read
# back read_committed: its stream is "<input>-eo" (e.g. http-eo), and must show no duplicates.
EO_SUFFIX = "-eo"


def streams(exactly_once: bool) -> tuple[str, ...]:
    return INPUTS + tuple(n + EO_SUFFIX for n in INPUTS) if exactly_once else INPUTS


def is_exactly_once(stream: str) -> bool:
    return stream.endswith(EO_SUFFIX)
KILL_MODES = ("timer", "http_ack", "spool_mid_file", "startup")
HTTP_THREADS = 2
# A spool file bigger than this spans several intake batches (agent/ingest/spool_batch.BATCH).
SPOOL_BATCH = 20_000


@dataclass
class InputTally:
    sent: int = 0
    acked: int = 0
    delivered: int = 0  # distinct acknowledged values found in Kafka
    lost: int = 0
    duplicates: int = 0
    unacked_delivered: int = 0
    unknown: int = 0
    lost_examples: list[str] = field(default_factory=list)


@dataclass
class Life:
    """One run of the agent, from launch to SIGKILL."""

    mode: str
    seconds: float  # from launch to the kill
    http_in_flight: int
    spool_files_waiting: int
    socket_round_open: bool
    acked: dict[str, int]


@dataclass
class Report:
    seed: int
    kills: int
    requested_kills: int
    seconds: float
    inputs: dict[str, InputTally]
    lives: list[Life]
    socket_round_timeouts: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    final_drain_seconds: float = 0.0

    @property
    def lost(self) -> int:
        return sum(t.lost for t in self.inputs.values())

    @property
    def unknown(self) -> int:
        return sum(t.unknown for t in self.inputs.values())

    @property
    def duplicates(self) -> int:
        return sum(t.duplicates for t in self.inputs.values())

    def modes(self) -> dict[str, int]:
        return dict(collections.Counter(life.mode for life in self.lives))

    def to_json(self) -> str:
        doc = asdict(self)
        doc["kill_modes"] = self.modes()
        doc["lost"] = self.lost
        doc["duplicates"] = self.duplicates
        return json.dumps(doc, indent=2)

    def summary(self) -> str:
        lines = [
            f"crash check: {self.kills} SIGKILLs (of {self.requested_kills} asked) in "
            f"{self.seconds:.0f} s, seed {self.seed}; kill points {self.modes()}",
            f"{'input':<8}{'sent':>10}{'acked':>10}{'lost':>6}{'dups':>7}"
            f"{'unacked but delivered':>23}{'unknown':>9}",
        ]
        for name, t in self.inputs.items():
            lines.append(f"{name:<8}{t.sent:>10}{t.acked:>10}{t.lost:>6}{t.duplicates:>7}"
                         f"{t.unacked_delivered:>23}{t.unknown:>9}")
        lines.append(f"socket rounds not counted in time: {self.socket_round_timeouts}; "
                     f"client errors: {self.errors}; final drain {self.final_drain_seconds:.1f}"
                     " s")
        return "\n".join(lines)


class Ledger:
    """What each input sent and had acknowledged, across lives. Thread-safe."""

    def __init__(self, names: tuple[str, ...] = INPUTS) -> None:
        self.lock = threading.Lock()
        self.seq = {name: itertools.count() for name in names}
        self.sent: dict[str, set[bytes]] = {name: set() for name in names}
        self.acked: dict[str, set[bytes]] = {name: set() for name in names}
        self.errors: collections.Counter[str] = collections.Counter()
        self.round_timeouts = 0

    def values(self, name: str, n: int) -> list[bytes]:
        with self.lock:
            out = [b"%s-%08d" % (name.encode(), next(self.seq[name])) for _ in range(n)]
            self.sent[name].update(out)
        return out

    def ack(self, name: str, values: list[bytes]) -> None:
        with self.lock:
            self.acked[name].update(values)


class Load:
    """The load threads of one agent life."""

    def __init__(self, agent: Agent, topics: dict[str, str], spool_dir: Path, ledger: Ledger,
                 rng: random.Random, big_spool: bool = False, *,
                 spool_pause: tuple[float, float] = (0.05, 0.3), socket_pause: float = 0.0,
                 http_pause: float = 0.0) -> None:
        self.agent = agent
        self.topics = topics
        self.spool_dir = spool_dir
        self.ledger = ledger
        self.rng = random.Random(rng.random())
        self.big_spool = big_spool
        self.spool_pause = spool_pause
        self.socket_pause = socket_pause
        self.http_pause = http_pause
        self.stop = threading.Event()
        self.killing = threading.Event()  # set just before the kill: errors are expected now
        self.http_answered = threading.Event()
        self.http_in_flight = 0
        self.round_open = False
        self.big_file: str | None = None
        self.acked = dict.fromkeys(topics, 0)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._http, args=(i,), daemon=True)
                         for i in range(HTTP_THREADS)]
        self._threads += [threading.Thread(target=self._spool, daemon=True),
                          threading.Thread(target=self._socket, daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)
            assert not t.is_alive(), f"load thread {t.name} did not stop"

    def _stream(self, name: str, rng: random.Random) -> str:
        """``name``, or half the time its exactly-once twin when the run has one."""
        twin = name + EO_SUFFIX
        return twin if twin in self.topics and rng.random() < 0.5 else name

    def _acked(self, name: str, values: list[bytes]) -> None:
        self.ledger.ack(name, values)
        with self._lock:
            self.acked[name] += len(values)

    # -- http ------------------------------------------------------------------------------
    def _http(self, index: int) -> None:
        rng = random.Random(self.rng.random())
        with httpx.Client(timeout=10.0) as client:
            for _ in range(1_000_000):  # bounded; a life lasts seconds
                if self.stop.is_set():
                    return
                stream = self._stream("http", rng)
                url = f"{self.agent.http_url}/topics/{self.topics[stream]}"
                batch = rng.random() < 0.2
                values = self.ledger.values(stream, rng.randint(2, 20) if batch else 1)
                with self._lock:
                    self.http_in_flight += 1
                try:
                    if batch:
                        r = client.post(url + "/batch", content=b"\n".join(values),
                                        headers={"content-type": "application/x-ndjson"})
                    else:
                        r = client.post(url, content=values[0])
                except httpx.HTTPError as exc:
                    when = "at kill" if self.killing.is_set() else "while alive"
                    with self.ledger.lock:
                        self.ledger.errors[f"http {type(exc).__name__} {when}"] += 1
                    if self.killing.is_set():
                        return
                    continue
                finally:
                    with self._lock:
                        self.http_in_flight -= 1
                if r.status_code in (201, 202):
                    self._acked(stream, values)
                    self.http_answered.set()
                else:
                    with self.ledger.lock:
                        self.ledger.errors[f"http status {r.status_code}"] += 1
                if self.http_pause:
                    self.stop.wait(self.http_pause)

    # -- spool -----------------------------------------------------------------------------
    def _spool(self) -> None:
        rng = random.Random(self.rng.random())
        first = True
        for _ in range(100_000):
            if self.stop.is_set():
                return
            if len(spool_files_left(self.spool_dir)) >= 2:
                self.stop.wait(0.02)  # pacing: at most two files waiting
                continue
            if first and self.big_spool:
                n = rng.randint(SPOOL_BATCH + 5_000, 2 * SPOOL_BATCH + 10_000)
            else:
                n = rng.randint(50, 2_000)
            name = unique_file_name("crash-")
            stream = "spool" if first and self.big_spool else self._stream("spool", rng)
            topic = self.topics[stream]
            if first and self.big_spool:
                self.big_file = name
            first = False
            values = self.ledger.values(stream, n)
            write_spool_file(self.spool_dir, name, [SpoolRecord(topic, v) for v in values])
            self._acked(stream, values)  # renamed into place: the agent will take it
            self.stop.wait(rng.uniform(*self.spool_pause))  # pacing: HTTP and datagrams get a share

    # -- socket ----------------------------------------------------------------------------
    def _socket(self) -> None:
        rng = random.Random(self.rng.random())
        sent_this_life: dict[str, int] = {}
        try:
            client = FerryClient(self.agent.socket_path, timeout=2.0)
        except OSError:
            return
        with client, httpx.Client(timeout=2.0) as http:
            for _ in range(100_000):
                if self.stop.is_set():
                    return
                stream = self._stream("socket", rng)
                topic = self.topics[stream]
                values = self.ledger.values(stream, rng.randint(20, 300))
                self.round_open = True
                try:
                    for v in values:
                        client.send(topic, v)
                        sent_this_life[topic] = sent_this_life.get(topic, 0) + 1
                except OSError as exc:
                    if not self.killing.is_set():
                        with self.ledger.lock:
                            self.ledger.errors[f"socket {type(exc).__name__} while alive"] += 1
                    return  # the agent is gone: this round is not acknowledged
                if self._counted(http, topic, sent_this_life[topic]):
                    self._acked(stream, values)
                    self.round_open = False
                    if self.socket_pause:
                        self.stop.wait(self.socket_pause)
                elif self.killing.is_set():
                    return
                else:
                    with self.ledger.lock:
                        self.ledger.round_timeouts += 1
                    return

    def _counted(self, http: httpx.Client, topic: str, expected: int) -> bool:
        """Whether this life's accepted counter reached ``expected`` (within 10 s)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                doc = http.get(self.agent.http_url + "/status/counters").json()
            except (httpx.HTTPError, ValueError):
                if self.killing.is_set():
                    return False
                continue
            if metric_total(doc, "messages_accepted", source="socket", topic=topic) >= expected:
                return True
            if self.stop.wait(0.01):
                return False
        return False

    def spool_mid_file(self, store: Store) -> bool:
        """The big spool file of this life is partly ingested: its progress record says some
        batches are committed, not all."""
        name = self.big_file
        if name is None:
            return False
        raw = store.get_state(b"spool:0:" + name.encode())
        if raw is None:
            return False
        progress = json.loads(raw)
        return bool(0 < progress["next"] < progress["count"])


def run_crash_check(
    root: Path,
    broker: Broker | str,
    *,
    kills: int,
    duration: float | None = None,
    seed: int | None = None,
    log: Callable[[str], None] = lambda line: None,
    exactly_once: bool = False,
    kill_modes: Sequence[str] | None = None,
) -> Report:
    """SIGKILL the agent ``kills`` times (fewer if ``duration`` seconds run out) under load on
    all three inputs, then check Kafka. ``root`` holds the agent's state and logs.

    ``broker``: a tansu :class:`Broker`, or the ``bootstrap.servers`` of any cluster (e.g. an
    Apache Kafka cluster's); the checker only ever talks to it through that address.
    ``kill_modes``: the kill points to take in turn instead of random ones, so that a short
    run (a few kills) still lands in each of them."""
    bootstrap = broker if isinstance(broker, str) else broker.bootstrap
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    unknown = set(kill_modes or ()) - set(KILL_MODES)
    if unknown:
        raise ValueError(f"unknown kill modes {sorted(unknown)}; known: {KILL_MODES}")
    tag = uuid.uuid4().hex[:8]
    names = streams(exactly_once)
    topics = {name: f"crash-{tag}-{name}" for name in names}
    # HTTP answers 201 when Kafka acknowledges within 10 ms, else 202: both are acks.
    # The buffer keeps write_config's 256 MiB: a run delivers far more than the tracking of
    # delivered messages may hold in the map's headroom, so its cap is exercised too.
    settings: dict[str, dict[str, object]] = {topics["http"]: {"ack_timeout_ms": 10}}
    for name in names:
        if is_exactly_once(name):
            settings.setdefault(topics[name], {}).update(delivery="exactly_once", acks="all")
    config = write_config(root, bootstrap, http=True, spool=True, topics=settings,
                          forwarder={"retry_backoff_max_ms": 1000})
    spool_dir = root / "spool"
    spool_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(names)
    lives: list[Life] = []
    started = time.monotonic()
    deadline = started + duration if duration is not None else float("inf")
    for n in range(kills):
        if time.monotonic() >= deadline:
            break
        mode = kill_modes[n % len(kill_modes)] if kill_modes else rng.choice(KILL_MODES)
        lives.append(_one_life(config, topics, spool_dir, ledger, rng, mode))
        log(f"kill {n + 1}/{kills}: {lives[-1]}")
    final_started = time.monotonic()
    with Agent(config) as agent:
        wait_until(lambda: not spool_files_left(spool_dir), timeout=120,
                   message="every spool file ingested")
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=120, interval=0.2,
                   message="buffer drained")
        agent.terminate()
    drain = time.monotonic() - final_started
    for name in names:
        if is_exactly_once(name):
            wait_transactions_settled(bootstrap, topics[name])
    inputs = {name: tally(ledger, name, read_values(bootstrap, topics[name],
                                                    read_committed=is_exactly_once(name)))
              for name in names}
    quarantined = list((spool_dir / "quarantine").glob("*"))
    assert not quarantined, f"spool files quarantined: {quarantined}"
    return Report(seed=seed, kills=len(lives), requested_kills=kills,
                  seconds=time.monotonic() - started, inputs=inputs, lives=lives,
                  socket_round_timeouts=ledger.round_timeouts,
                  errors=dict(ledger.errors), final_drain_seconds=drain)


def wait_transactions_settled(bootstrap: str, topic: str, timeout: float = 60.0) -> None:
    """Until no transaction is open on any partition of ``topic``: each partition's last
    stable offset (how far a read_committed reader may read) has reached its high watermark.

    Kafka answers a commit before it writes the commit markers to the partitions, so just
    after a commit a read_committed reader meets "the end" of a partition at the start of
    that transaction and sees none of it (measured: a few hundred ms on a loaded machine).
    Read only once this holds, and only while nothing else writes the topic."""
    partitions = topic_partitions(bootstrap, topic, timeout=10) or []
    readers = {level: Consumer({"bootstrap.servers": bootstrap, "log_level": 0,
                                "group.id": f"ferry-settled-{uuid.uuid4().hex}",
                                "isolation.level": level})
               for level in ("read_committed", "read_uncommitted")}

    def ends(level: str) -> list[int]:
        return [readers[level].get_watermark_offsets(TopicPartition(topic, p), timeout=10,
                                                      cached=False)[1] for p in partitions]

    try:
        wait_until(lambda: ends("read_committed") == ends("read_uncommitted"),
                   timeout=timeout, interval=0.1,
                   message=f"every transaction on {topic} settled (last stable offsets at "
                   "the high watermarks)")
    finally:
        for reader in readers.values():
            reader.close()


def _one_life(config: Path, topics: dict[str, str], spool_dir: Path, ledger: Ledger,
              rng: random.Random, mode: str) -> Life:
    agent = Agent(config)
    launched = time.monotonic()
    agent.launch()
    load: Load | None = None
    try:
        if mode == "startup":
            # Somewhere in start-up: before, during or just after recovery.
            time.sleep(rng.uniform(0.05, 1.5))  # the random kill point itself
        else:
            agent.wait_ready()
            load = Load(agent, topics, spool_dir, ledger, rng,
                         big_spool=mode == "spool_mid_file")
            load.start()
            if mode == "timer":
                time.sleep(rng.uniform(0.1, 3.0))  # the random kill point itself
            elif mode == "http_ack":
                time.sleep(rng.uniform(0.1, 1.5))
                load.http_answered.clear()
                load.http_answered.wait(10)
            elif mode == "spool_mid_file":
                store = Store(agent.config.buffer.path, agent.config.buffer.max_bytes)
                try:
                    with contextlib.suppress(AssertionError):  # if missed, kill whenever
                        wait_until(lambda: load is not None and load.spool_mid_file(store),
                                   timeout=15, interval=0.002,
                                   message="a spool file half ingested")
                finally:
                    store.close()
        # What was going on at the kill.
        seconds = time.monotonic() - launched
        http_in_flight = load.http_in_flight if load else 0
        round_open = load.round_open if load else False
        if load is not None:
            load.killing.set()
        agent.kill()
    finally:
        if load is not None:
            load.killing.set()
        agent.kill()
        if load is not None:
            load.finish()
    return Life(mode=mode, seconds=round(seconds, 3), http_in_flight=http_in_flight,
                spool_files_waiting=len(spool_files_left(spool_dir)),
                socket_round_open=round_open,
                acked=load.acked if load else dict.fromkeys(topics, 0))


def tally(ledger: Ledger, name: str, counts: collections.Counter[bytes]) -> InputTally:
    """Compare what Kafka holds (value -> copies) with what ``name`` sent and had acked."""
    sent, acked = ledger.sent[name], ledger.acked[name]
    missing = sorted(acked - counts.keys())
    found = counts.keys()
    return InputTally(
        sent=len(sent),
        acked=len(acked),
        delivered=len(acked & found),
        lost=len(missing),
        duplicates=sum(c - 1 for c in counts.values()),
        unacked_delivered=len((sent - acked) & found),
        unknown=len(found - sent),
        lost_examples=[v.decode() for v in missing[:20]],
    )


def check_report(report: Report, artifacts: Path, kills: int) -> None:
    """Save ``report`` among the artifacts and assert what a crash run must show: every kill
    ran, nothing acknowledged lost, no value nobody sent, acknowledged traffic on every
    input, no duplicate on an exactly-once stream, every datagram round counted, and kills
    in at least three kinds of state. (test_crash.py, test_crash_kafka.py)"""
    (artifacts / "crash-report.json").write_text(report.to_json())
    print("\n" + report.summary())
    assert report.kills == kills, f"only {report.kills} of {kills} kills ran in the time budget"
    for name, tally in report.inputs.items():
        assert tally.lost == 0, (
            f"{tally.lost} acknowledged {name} messages lost, e.g. {tally.lost_examples}; "
            f"{report.summary()}")
        assert tally.unknown == 0, f"{name}: {tally.unknown} values in Kafka nobody sent"
        # The check means something only if every input had acknowledged traffic.
        assert tally.acked > 0, f"no {name} message was acknowledged: {report.summary()}"
        if is_exactly_once(name):
            # delivery = "exactly_once", read read_committed: not one value twice (the
            # at-least-once streams of the same run show what kills do without it).
            assert tally.duplicates == 0, f"{name}: {tally.duplicates} duplicates; " \
                f"{report.summary()}"
    assert report.socket_round_timeouts == 0, "a live agent never counted a datagram round"
    modes = report.modes()
    assert len(modes) >= 3, f"kills should land in varied states: {modes}"
