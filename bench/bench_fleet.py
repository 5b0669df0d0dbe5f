"""A fleet against one Kafka cluster: what each agent costs it, idle and busy, and a restart
storm (issue #38, items 2 and 3).

    .venv/bin/python bench/bench_fleet.py [--agents 1,5,20] [--busy 20] [--idle 40]
                                          [--rate 20] [--storm 20] [--storm-jitter 10]
                                          [--version 4.1.2]

One 3-node Apache Kafka cluster (``tests/apache_kafka.py``, RF 3, ``min.insync.replicas``
2) whose client traffic crosses a counting proxy per node (``TcpProxy``: connections, and
requests by API key and client id). Every agent is a whole ``ferry run`` with the default
settings a user gets (``idle_connection_seconds`` 30, ``probe_interval_seconds`` 2), an
``acks = "all"`` topic and an exactly-once topic beside it, and its own client id
(``[kafka.local.properties] client.id``), so the proxies can tell the agents apart.

For each N of ``--agents``, N agents are started together and then:

- **busy**: each sends ``--rate`` datagrams a second to each topic for ``--busy`` seconds;
- **idle**: once everything is delivered and ``idle_connection_seconds`` have passed, a
  window of ``--idle`` seconds with no input.

Per window it prints, per agent (the median and the largest over the N agents): connections
held to the brokers (ESTABLISHED sockets of the agent's processes, from ``/proc``), requests
a second by Kafka API; and for the idle window the brokers' CPU (the three JVMs, from
``/proc/<pid>/stat``) per agent, above the same cluster with no agent at all.

**Restart storm** (``--storm`` agents, 0 for none): the agents are stopped with SIGTERM all
at once and started again all at once, with the default ``start_jitter_seconds`` (0) and
then with each of ``--storm-jitter``. It prints the connections the cluster accepted in
the busiest 100 ms and the busiest second, the requests in the busiest second by API, how
long until every agent's cluster was up and one message from each was delivered, and
whether any agent logged a refused or failed connection.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)

from ferry_client import FerryClient  # noqa: E402
from tests.agent_harness import AgentProcess, write_config  # noqa: E402
from tests.apache_kafka import KafkaCluster, kafka_version  # noqa: E402
from tests.kafka import TcpProxy  # noqa: E402
from tests.proc_stats import cpu_seconds, established, group_pids  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

PARTITIONS = 3
IDLE_CONNECTION_SECONDS = 30.0  # the default, which the idle window waits out first
API_NAMES = {0: "Produce", 1: "Fetch", 2: "ListOffsets", 3: "Metadata", 8: "OffsetCommit",
             9: "OffsetFetch", 10: "FindCoordinator", 18: "ApiVersions", 19: "CreateTopics",
             22: "InitProducerId", 24: "AddPartitionsToTxn", 25: "AddOffsetsToTxn",
             26: "EndTxn", 28: "TxnOffsetCommit", 32: "DescribeConfigs",
             60: "DescribeCluster"}
T = TypeVar("T")


def in_parallel(calls: Iterable[Callable[[], T]]) -> list[T]:
    """Run every call on its own thread, all at once; their results in order."""
    calls = list(calls)
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], T]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


class Fleet:
    def __init__(self, cluster: KafkaCluster, root: Path, n: int, alo: str, eo: str,
                 jitter: float = 0.0) -> None:
        self.cluster, self.alo, self.eo = cluster, alo, eo
        self.ids = [f"fleet{n}-{i}" for i in range(n)]
        self.agents = []
        for agent_id in self.ids:
            config = write_config(
                root / agent_id, cluster.proxied_bootstrap, http=True,
                outage_after_seconds=10.0,
                forwarder={"agent_id": agent_id, "start_jitter_seconds": jitter},
                topics={alo: {"acks": "all"}, eo: {"acks": "all", "delivery": "exactly_once"}},
                extra=f'\n[kafka.local.properties]\n"client.id" = "{agent_id}"\n')
            self.agents.append(AgentProcess(config))
        self.sent = [0] * n

    def start(self) -> None:
        self.sent = [0] * len(self.agents)  # a new process counts its deliveries from 0
        in_parallel([partial(AgentProcess.start, a, 180.0) for a in self.agents])

    def stop(self) -> None:
        in_parallel([partial(AgentProcess.terminate, a, 60.0) for a in self.agents])

    def send(self, rate: float, seconds: float) -> None:
        """``rate`` datagrams a second to each topic from every agent, for ``seconds``."""
        def one(i: int) -> int:
            agent = self.agents[i]
            sent = 0
            with FerryClient(agent.socket_path) as client:
                started = time.monotonic()
                while (now := time.monotonic()) - started < seconds:
                    due = int((now - started) * rate) + 1
                    while sent < due:
                        for topic in (self.alo, self.eo):
                            client.send(topic, b"%s %d" % (self.ids[i].encode(), sent))
                        sent += 1
                    time.sleep(min(0.05, 1 / rate))  # pacing the load, not a synchronisation
            self.sent[i] += sent
            return sent
        in_parallel([partial(one, i) for i in range(len(self.agents))])

    def delivered(self, i: int) -> bool:
        rows = self.agents[i].get_json("/status/topics")["topics"]
        done = {r["topic"]: r["delivered"] for r in rows}
        return all(done.get(t, 0) >= self.sent[i] for t in (self.alo, self.eo))

    def wait_delivered(self, timeout: float) -> float:
        started = time.monotonic()
        wait_until(lambda: all(self.delivered(i) for i in range(len(self.agents))),
                   timeout=timeout, interval=0.5, message="every agent's messages delivered")
        return time.monotonic() - started

    def connections(self) -> list[int]:
        ports = {p.port for p in proxies(self.cluster)}
        return [len(established(group_pids(a.proc.pid), ports)) for a in self.agents
                if a.proc is not None]


def proxies(cluster: KafkaCluster) -> list[TcpProxy]:
    return [cluster.proxy(node.node_id) for node in cluster.nodes]


def request_counts(cluster: KafkaCluster) -> dict[tuple[int, str], int]:
    total: dict[tuple[int, str], int] = {}
    for proxy in proxies(cluster):
        for key, n in proxy.request_counts().items():
            total[key] = total.get(key, 0) + n
    return total


def broker_cpu(cluster: KafkaCluster) -> float:
    return sum(cpu_seconds(node.pid) for node in cluster.nodes if node.pid is not None)


def per_agent_rates(before: dict[tuple[int, str], int], after: dict[tuple[int, str], int],
                    ids: list[str], seconds: float) -> dict[str, list[float]]:
    """Requests a second per API name, one figure per agent (client ids start with its id)."""
    rates: dict[str, list[float]] = {}
    apis = sorted({api for api, _ in after})
    for api in apis:
        name = API_NAMES.get(api, str(api))
        per = []
        for agent_id in ids:
            n = sum(after[k] - before.get(k, 0) for k in after
                    if k[0] == api and (k[1] == agent_id or k[1].startswith(agent_id + "-")))
            per.append(n / seconds)
        if any(per):
            rates[name] = per
    rates["all"] = [sum(col) for col in zip(*rates.values(), strict=True)] if rates else []
    return rates


def median_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def window(cluster: KafkaCluster, fleet: Fleet, seconds: float,
           load: Callable[[], None] | None) -> tuple[dict[str, list[float]], list[int], float]:
    before, cpu0, t0 = request_counts(cluster), broker_cpu(cluster), time.monotonic()
    if load is not None:
        load()
        connections = fleet.connections()
    else:
        time.sleep(seconds)  # the window measured, not a synchronisation
        connections = fleet.connections()
    elapsed = time.monotonic() - t0
    rates = per_agent_rates(before, request_counts(cluster), fleet.ids, elapsed)
    return rates, connections, (broker_cpu(cluster) - cpu0) / elapsed


class Sampler:
    """Connections accepted and requests seen by the proxies, every 100 ms."""

    def __init__(self, cluster: KafkaCluster) -> None:
        self.cluster = cluster
        self.samples: list[tuple[float, int, dict[tuple[int, str], int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            accepted = sum(p.connections_accepted for p in proxies(self.cluster))
            self.samples.append((time.monotonic(), accepted, request_counts(self.cluster)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self) -> tuple[int, int, int, dict[str, int]]:
        """Most connections in 100 ms, in one second; most requests in one second, and the
        busiest second's requests by API."""
        s = self.samples
        per_tick = max((b[1] - a[1] for a, b in zip(s, s[1:], strict=False)), default=0)
        per_second, requests = 0, 0
        by_api: dict[str, int] = {}
        for i, (t, accepted, counts) in enumerate(s):
            j = next((j for j in range(i, len(s)) if s[j][0] - t >= 1.0), None)
            if j is None:
                break
            per_second = max(per_second, s[j][1] - accepted)
            diff = {k: s[j][2].get(k, 0) - counts.get(k, 0) for k in s[j][2]}
            if sum(diff.values()) > requests:
                requests = sum(diff.values())
                by_api = {}
                for (api, _), n in diff.items():
                    name = API_NAMES.get(api, str(api))
                    by_api[name] = by_api.get(name, 0) + n
        return per_tick, per_second, requests, by_api


def storm(cluster: KafkaCluster, fleet: Fleet, jitter: float) -> None:
    before = [a.log_path.stat().st_size if a.log_path.exists() else 0 for a in fleet.agents]
    with Sampler(cluster) as sampler:
        started = time.monotonic()
        fleet.start()
        wait_until(lambda: all(
            next(c for c in a.get_json("/status/clusters")["clusters"]
                 if c["name"] == "local")["state"] == "up" for a in fleet.agents),
            timeout=120, interval=0.2, message="every agent's cluster up")
        up = time.monotonic() - started
        fleet.send(rate=1, seconds=1)
        fleet.wait_delivered(timeout=180)
        delivered = time.monotonic() - started
    tick, second, requests, by_api = sampler.peaks()
    failed = 0
    for agent, offset in zip(fleet.agents, before, strict=True):
        with agent.log_path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        failed += sum(1 for line in text.splitlines()
                      if "Connection refused" in line or "Connect to" in line)
    apis = ", ".join(f"{k} {v}" for k, v in sorted(by_api.items()))
    print(f"restart storm, {len(fleet.agents)} agents, start_jitter_seconds {jitter:g}: "
          f"every cluster up {up:.1f} s after the start, one message from each delivered "
          f"at {delivered:.1f} s; connections accepted "
          f"{tick} in the busiest 100 ms, {second} in the busiest second; requests "
          f"{requests} in the busiest second ({apis}); "
          f"agents' log lines of refused or failed connects: {failed}")


def floor_cpu(cluster: KafkaCluster, seconds: float) -> float:
    """The brokers' CPU per second of wall time over ``seconds`` with no agent running."""
    cpu0, t0 = broker_cpu(cluster), time.monotonic()
    time.sleep(seconds)  # the window measured, not a synchronisation
    return (broker_cpu(cluster) - cpu0) / (time.monotonic() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="1,5,20")
    parser.add_argument("--busy", type=float, default=20.0)
    parser.add_argument("--idle", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=20.0,
                        help="datagrams a second per agent and topic while busy")
    parser.add_argument("--storm", type=int, default=20)
    parser.add_argument("--storm-jitter", default="10",
                        help="start_jitter_seconds of further storms, after one without")
    parser.add_argument("--version", default=kafka_version())
    args = parser.parse_args()
    counts = [int(n) for n in args.agents.split(",")]
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        with KafkaCluster(root / "kafka", nodes=3, proxied=True, version=args.version) as kafka:
            alo, eo = "fleet-alo", "fleet-eo"
            for topic in (alo, eo):
                kafka.create_topic(topic, PARTITIONS)
            floor = floor_cpu(kafka, args.idle)
            print(f"Apache Kafka {args.version}, 3 nodes; brokers' CPU with no agent: "
                  f"{floor:.3f} of a core (all three)")
            print("| agents | window | connections per agent (median / max) | requests/s per "
                  "agent by API (median / max) | brokers' CPU per agent (no agent before / "
                  "after) |")
            print("| --- | --- | --- | --- | --- |")
            for n in counts:
                fleet = Fleet(kafka, root / f"n{n}", n, alo, eo)
                fleet.start()
                try:
                    rates, conns, _ = window(kafka, fleet, args.busy,
                                             partial(fleet.send, args.rate, args.busy))
                    fleet.wait_delivered(timeout=300)
                    print(f"| {n} | busy | {median_max([float(c) for c in conns])} | "
                          + "; ".join(f"{k} {median_max(v)}" for k, v in rates.items())
                          + " | - |", flush=True)
                    time.sleep(IDLE_CONNECTION_SECONDS + 5)  # the idle period waited out
                    rates, conns, cpu = window(kafka, fleet, args.idle, None)
                    idle_row = (f"| {n} | idle | {median_max([float(c) for c in conns])} | "
                                + "; ".join(f"{k} {median_max(v)}" for k, v in rates.items()))
                    if n == args.storm:
                        for jitter in [0.0] + [float(j) for j in args.storm_jitter.split(",")
                                               if j]:
                            fleet.stop()
                            fleet = Fleet(kafka, root / f"n{n}", n, alo, eo, jitter)
                            storm(kafka, fleet, jitter)
                finally:
                    for agent in fleet.agents:
                        agent.kill()
                # The brokers' own CPU drifts (GC, log cleaning): the same window with no
                # agent before and after, their mean the floor of this N's idle window.
                after = floor_cpu(kafka, args.idle)
                print(f"{idle_row} | {(cpu - (floor + after) / 2) / n:+.4f} of a core "
                      f"({floor:.3f} / {after:.3f} with no agent, {cpu:.3f} with {n}) |",
                      flush=True)
                floor = after


if __name__ == "__main__":
    main()
