"""What an idle agent costs: its CPU with nothing to do, per process and per thread.

    .venv/bin/python bench/bench_idle_agent.py [--window 30] [--exactly-once]

A whole agent (``ferry run``, the default configuration but for the buffer's place) on one
tansu broker, an ``acks = "all"`` topic (and with ``--exactly-once`` an exactly-once topic
beside it), 20 messages sent and delivered, then left alone: after a settling pause, the
CPU each of its processes and threads used over ``--window`` seconds of wall time, from
``/proc/<pid>/task/<tid>/stat`` (librdkafka's threads included, named ``rdk:...``; Python's
own threads all read ``python`` there). On a fleet this is paid on every host all day.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)

from ferry_client import FerryClient  # noqa: E402
from tests.agent_harness import AgentProcess, write_config  # noqa: E402
from tests.kafka import Broker  # noqa: E402
from tests.proc_stats import group_pids  # noqa: E402
from tests.reliability.harness import metric_total  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds of each thread of ``pid``, keyed by (tid, name)."""
    out: dict[tuple[int, str], float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[(int(task.name), name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def command(pid: int) -> str:
    text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return "forwarder" if "spawn_main" in text else "ingest" if " run " in text else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds left idle before the window")
    parser.add_argument("--exactly-once", action="store_true",
                        help="an exactly-once topic beside the at-least-once one")
    args = parser.parse_args()
    print(hostspeed.describe(Path(tempfile.gettempdir())))
    topics = {"idle-alo": {"acks": "all"}}
    if args.exactly_once:
        topics["idle-eo"] = {"acks": "all", "delivery": "exactly_once"}
    with tempfile.TemporaryDirectory(prefix="ferry-idle-") as tmp:
        root = Path(tmp)
        with Broker(log_path=root / "tansu.log") as broker:
            config = write_config(root / "agent", broker.bootstrap, topics=topics)
            with AgentProcess(config) as agent, FerryClient(agent.socket_path) as client:
                for topic in topics:
                    for i in range(20):
                        client.send(topic, b"idle-%d" % i)
                wait_until(lambda: metric_total(agent.get_json("/status/counters"),
                                                "messages_delivered") >= 20 * len(topics),
                           timeout=60, message="the first messages delivered")
                time.sleep(args.settle)  # left idle on purpose: what is measured
                assert agent.proc is not None
                pids = group_pids(agent.proc.pid)
                roles = {pid: command(pid) for pid in pids}
                before = {pid: thread_cpu(pid) for pid in pids}
                started = time.monotonic()
                time.sleep(args.window)  # the window measured, not a synchronisation
                elapsed = time.monotonic() - started
                after = {pid: thread_cpu(pid) for pid in pids}
    print(f"idle agent, {'at-least-once + exactly-once' if args.exactly_once else 'at-least-once'}"
          f" topic(s), window {elapsed:.0f} s (share of one core):")
    for pid in pids:
        used = {key: after[pid][key] - before[pid].get(key, 0.0) for key in after[pid]}
        total = sum(used.values()) / elapsed
        print(f"  {roles[pid]:9} {total:.4f}")
        for (tid, name), seconds in sorted(used.items(), key=lambda kv: -kv[1])[:6]:
            if seconds > 0:
                print(f"    {name:16} {tid:>8} {seconds / elapsed:.4f}")


if __name__ == "__main__":
    main()
