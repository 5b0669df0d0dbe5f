"""What waiting costs: the agent's CPU while Kafka's controller quorum is gone.

    .venv/bin/python bench/bench_waiting_cost.py [--versions 4.1.2,4.4.0] [--window 20]
                                                 [--rate 340]
                                                 [--delivery exactly_once]
                                                 [--forwarder KEY=VALUE ...]

For each Apache Kafka version: a dedicated 3-node KRaft cluster (``tests/apache_kafka.py``,
RF 3, ``min.insync.replicas`` 2), an ``acks = "all"`` topic of 3 partitions, and a whole
agent (``ferry run``) with ``outage_after_seconds`` 10. After a warm-up is delivered, two of
the three nodes are killed with SIGKILL: the KRaft quorum is lost with them, the survivor
still answers metadata requests, and no acks=all write can complete. Then three windows of
``--window`` seconds each:

- ``idle``: nothing buffered, no input (the probe and the idle producers alone);
- ``trickle``: ``--rate`` datagrams/s arriving (the bug report's 340);
- ``backlog``: no more input, the trickle's messages waiting in the buffer.

For each window it prints the agent's CPU per second of wall time (the ingest process and
the forwarder process apart, from ``/proc/<pid>/stat``, which counts librdkafka's threads),
the busiest threads, the host's TCP connects and refused connects per second
(``/proc/net/snmp``: host-wide, so the healthy window gives the floor; the agent's clients
are what refuse while the nodes are dead), and, during the trickle, how long after the kill
the cluster turned ``down`` and ``/status/health`` CRITICAL, with the reason. Finally the
nodes are started again, the buffer drains, and a consumer counts what arrived (lost must
be 0). With ``--delivery exactly_once`` the topic is an exactly-once one, read back
``read_committed``: duplicated must be 0 too, and the transactions committed and given up
are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)

from ferry_client import FerryClient  # noqa: E402
from tests import proc_stats  # noqa: E402
from tests.agent_harness import AgentProcess, write_config  # noqa: E402
from tests.apache_kafka import KafkaCluster, kafka_version, newest_kafka_version  # noqa: E402
from tests.kafka import read_topic  # noqa: E402
from tests.proc_stats import group_pids  # noqa: E402
from tests.reliability.harness import metric_total  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

PARTITIONS = 3
OUTAGE_AFTER = 10.0


def threads(pid: int) -> dict[str, float]:
    """CPU seconds per thread of ``pid``, by "comm/tid"."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        got = proc_stats.stat(stat)
        if got is not None:
            out[f"{got[0]}/{stat.parent.name}"] = got[2]
    return out


class Meter:
    """CPU of each process of the agent (and of each thread) over a window."""

    def __init__(self, agent: AgentProcess) -> None:
        assert agent.proc is not None
        self.leader = agent.proc.pid
        self.pids = group_pids(self.leader)
        self._t0 = 0.0
        self._before: dict[int, dict[str, float]] = {}
        self._tcp = (0, 0)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._before = {pid: threads(pid) for pid in self.pids}
        self._tcp = tcp_counters()

    def stop(self) -> dict[str, Any]:
        seconds = time.monotonic() - self._t0
        per_process: dict[str, float] = {}
        busiest: list[tuple[float, str]] = []
        for pid in self.pids:
            after = threads(pid)
            used = {k: v - self._before[pid].get(k, 0.0) for k, v in after.items()}
            role = "ingest" if pid == self.leader else "forwarder"
            per_process[role] = round(sum(used.values()) / seconds, 3)
            busiest += [(v / seconds, f"{role}:{k.split('/')[0]}") for k, v in used.items()]
        busiest.sort(reverse=True)
        opens, fails = (b - a for a, b in zip(self._tcp, tcp_counters(), strict=True))
        return {"seconds": round(seconds, 1), "cpu_per_s": per_process,
                "host_connects_per_s": round(opens / seconds, 1),
                "host_refused_per_s": round(fails / seconds, 1),
                "cpu_per_s_total": round(sum(per_process.values()), 3),
                "busiest_threads": [(name, round(v, 3)) for v, name in busiest[:6] if v > 0]}


class Trickle:
    """Numbered datagrams at ``rate`` a second to ``topic`` until stopped (bounded)."""

    def __init__(self, socket_path: Path, topic: str, start: int, rate: float,
                 seconds: float) -> None:
        self.socket_path, self.topic, self.rate = socket_path, topic, rate
        self.next = start
        self.seconds = seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Trickle:
        self._thread.start()
        return self

    def _run(self) -> None:
        started, first = time.monotonic(), self.next
        with FerryClient(self.socket_path, timeout=30.0) as client:
            while not self._stop.is_set() and time.monotonic() - started < self.seconds:
                client.send(self.topic, b"%08d" % self.next, key=b"k%d" % (self.next % 12),
                            partition_key=self.next % 12)
                self.next += 1
                ahead = started + (self.next - first) / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)  # pacing: a rate, not a wait for anything

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(30)
        return self.next


def cluster_row(agent: AgentProcess) -> dict[str, Any]:
    rows = agent.get_json("/status/clusters")["clusters"]
    row: dict[str, Any] = next(r for r in rows if r["name"] == "local")
    return row


def health(agent: AgentProcess) -> dict[str, Any]:
    doc: dict[str, Any] = agent.get_json("/status/all")["health"]
    return doc


def tcp_counters() -> tuple[int, int]:
    """(ActiveOpens, AttemptFails) of this host's TCP stack (/proc/net/snmp): connects begun,
    and connects that failed (refused, on loopback). Host-wide: other processes' connects
    count too, so each window also reports the healthy idle window's rate as the floor."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()
             if line.startswith("Tcp:")]
    values = dict(zip(lines[0][1:], lines[1][1:], strict=True))
    return int(values["ActiveOpens"]), int(values["AttemptFails"])


def timed(what: Callable[[], Any], timeout: float, message: str) -> tuple[float, Any]:
    t0 = time.monotonic()
    value = wait_until(what, timeout=timeout, interval=0.1, message=message)
    return time.monotonic() - t0, value


def run_version(version: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    topic = "waiting"
    out: dict[str, Any] = {"kafka": version}
    with KafkaCluster(root / "kafka", nodes=3, version=version) as cluster:
        cluster.create_topic(topic, PARTITIONS)
        forwarder: dict[str, Any] = {}
        for item in args.forwarder:
            key, value = item.split("=", 1)
            forwarder[key] = int(value) if value.isdigit() else value
        settings: dict[str, Any] = {"acks": "all"}
        if args.delivery == "exactly_once":
            settings["delivery"] = "exactly_once"
        out["delivery"] = args.delivery
        config = write_config(root / "agent", cluster.bootstrap,
                              topics={topic: settings}, forwarder=forwarder,
                              outage_after_seconds=OUTAGE_AFTER)
        with AgentProcess(config) as agent:
            meter = Meter(agent)
            warm = 100
            with FerryClient(agent.socket_path) as client:
                for seq in range(warm):
                    client.send(topic, b"%08d" % seq, key=b"k%d" % (seq % 12),
                                partition_key=seq % 12)
            wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60,
                       message="warm-up delivered")
            meter.start()
            time.sleep(args.window)  # a measuring window, not a wait for anything
            out["healthy_idle"] = meter.stop()

            survivor = cluster.leader(topic, 0)
            killed = [n.node_id for n in cluster.nodes if n.node_id != survivor]
            killed_at = time.monotonic()
            for node_id in killed:
                cluster.kill(node_id)
            out["killed"] = killed
            meter.start()
            time.sleep(args.window)
            out["idle"] = meter.stop()
            out["idle"]["state"] = cluster_row(agent)["state"]
            out["idle"]["health"] = health(agent)["status"]

            trickle = Trickle(agent.socket_path, topic, warm, args.rate,
                              args.window + 60).start()
            trickle_at = time.monotonic()
            meter.start()
            try:
                took, _ = timed(lambda: health(agent)["status"] == "critical",
                                OUTAGE_AFTER + 30, "health CRITICAL")
                row = cluster_row(agent)
                out["critical_after_trickle_s"] = round(took, 1)
                out["critical_after_kill_s"] = round(time.monotonic() - killed_at, 1)
                out["state"] = row["state"]
                out["reason"] = row["reason"]
                out["problems"] = [p["message"] for p in health(agent)["problems"]]
            except AssertionError as exc:
                out["critical_after_trickle_s"] = None
                out["state_at_timeout"] = cluster_row(agent)
                out["health_at_timeout"] = health(agent)
                out["not_critical"] = str(exc)[:200]
            left = args.window - (time.monotonic() - trickle_at)
            if left > 0:
                time.sleep(left)
            out["trickle"] = meter.stop()
            sent = trickle.stop()
            out["trickle"]["rate"] = args.rate
            out["sent"] = sent
            meter.start()
            time.sleep(args.window)
            out["backlog"] = meter.stop()
            out["backlog"]["buffered"] = sum(agent.buffered().values())

            back_at = time.monotonic()
            for node_id in killed:
                cluster.start_node(node_id, wait=False)
            took, _ = timed(lambda: sum(agent.buffered().values()) == 0, 180,
                            "buffer drained once the nodes are back")
            out["drained_after_restart_s"] = round(took, 1)
            out["restart_to_drained_s"] = round(time.monotonic() - back_at, 1)
            counters = agent.get_json("/status/counters")
            out["transactions"] = {name: metric_total(counters, name)
                                   for name in ("transactions_committed",
                                                "transactions_aborted")}
        got = [int(m.value) for m in read_topic(cluster.bootstrap, topic, 60,
                                                 read_committed=True)
               if m.value is not None]
        out["lost"] = len(set(range(sent)) - set(got))
        out["duplicated"] = len(got) - len(set(got))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=f"{kafka_version()},{newest_kafka_version()}")
    parser.add_argument("--window", type=float, default=20.0,
                        help="seconds of each measuring window")
    parser.add_argument("--rate", type=float, default=340.0,
                        help="datagrams/s during the trickle window")
    parser.add_argument("--delivery", choices=("at_least_once", "exactly_once"),
                        default="at_least_once", help="the topic's delivery mode")
    parser.add_argument("--forwarder", action="append", default=[],
                        help="a [forwarder] setting for the agent, KEY=VALUE (repeatable)")
    args = parser.parse_args()
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    for version in args.versions.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-waiting-") as tmp:
            print(json.dumps(run_version(version, Path(tmp), args)), flush=True)


if __name__ == "__main__":
    main()
