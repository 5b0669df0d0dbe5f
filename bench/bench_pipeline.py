"""Core pipeline benchmark: datagrams in, Kafka out, on one machine with a real broker.

    .venv/bin/python bench/bench_pipeline.py [--messages 1000000] [--senders 2] [--size 200]
                                             [--client-encode] [--dgram-qlen 4096]
                                             [--broker kafka|tansu]

Senders run in their own processes with blocking sends (a full socket queue makes them wait,
so nothing is dropped); they send one pre-encoded datagram over and over, as a load
generator should (``--client-encode``: encode each with ``FerryClient.send`` instead). The
agent runs as in production: ingest process + forwarder process. The broker is a 3-node
Apache Kafka cluster (RF 3, min.insync.replicas 2) or, with ``--broker tansu``, one tansu
process (``bench/brokers.py``); the CPU line counts every broker process (all three JVMs).

The kernel's ``net.unix.max_dgram_qlen`` (default 10) caps how many datagrams wait on the
socket; the deb/rpm packages raise it to 4096. ``--dgram-qlen N`` (root only) sets it for the
run and puts the old value back; the value in effect is printed either way.
Prints: accepted rate (messages durably committed per second), commit latency p50/p99 (per
group commit, write + fsync), delivered rate (acknowledged by Kafka and removed from the
buffer), lost (sent - accepted - rejected, must be 0), and the agent's peak RSS.

Timing: the accepted run ends at the durable commit of the last datagram group (taken from
the writer's callbacks, exact); the delivered run ends when the buffer is empty again (read
from LMDB every 10 ms). The forwarder's own counters reach this process in snapshots every
0.25 s, too coarse to time a run of a few seconds; they still must add up to every message.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)
from brokers import add_broker_option, start_broker  # noqa: E402

from agent.config import ForwarderConfig, load_config  # noqa: E402
from agent.daemon.agent import Agent  # noqa: E402
from agent.metrics import Registry  # noqa: E402
from ferry_client import FerryClient  # noqa: E402
from ferry_client.wire import encode_any_partition  # noqa: E402
from tests.agent_harness import write_config  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


def sender(path: str, topic: str, count: int, size: int, start: multiprocessing.Event,
           client_encode: bool) -> None:
    value = b"v" * size
    start.wait()
    with FerryClient(Path(path)) as client:
        if client_encode:  # the Python client's own cost per message included
            for _ in range(count):
                client.send(topic, value)
            return
        # A load generator, like wrk for HTTP: the datagram is encoded once, so the two cores
        # go to Ferry rather than to building the same bytes in Python each time.
        datagram = encode_any_partition(topic, value)
        send = client.send_datagram
        for _ in range(count):
            send(datagram)


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User + system CPU time of a live process, or of its reaped children."""
    return sum(cpu_split(pid, children))


def cpu_split(pid: int, children: bool = False) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process, or of its reaped children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0, 0.0
    first = 13 if children else 11  # utime stime | cutime cstime
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[first]) / tick, int(fields[first + 1]) / tick


def cpu_split_all(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of several live processes together (a cluster's nodes)."""
    splits = [cpu_split(pid) for pid in pids]
    return sum(u for u, _ in splits), sum(s for _, s in splits)


def time_commits(agent: Agent) -> list[float]:
    """Seconds of each durable commit of the ingest writer (``Store.append``: waiting for the
    write lock, writing, fsync), kept exactly; the registry's histogram has only buckets."""
    store = agent.committer.store
    append = store.append
    seconds: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return append(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    store.append = timed  # type: ignore[method-assign]
    return seconds


def time_acks(agent: Agent) -> tuple[list[float], list[float]]:
    """Seconds from each datagram group's hand-over to the writer to its durable commit (the
    queue behind the commit in progress included): how long the socket's messages waited to
    count as accepted once received. And, as a one-item list, when the last one was durable."""
    committer = agent.committer
    submit = committer.submit_encoded
    seconds: list[float] = []
    last = [0.0]

    def timed(group: Any, source: str, callback: Any = None) -> None:
        started = time.perf_counter()

        def done(result: Any) -> None:
            last[0] = now = time.perf_counter()
            seconds.append(now - started)
            if callback is not None:
                callback(result)

        submit(group, source, done)

    committer.submit_encoded = timed  # type: ignore[method-assign]
    return seconds, last


def _percentiles(label: str, values: list[float]) -> str:
    ms = sorted(d * 1000 for d in values)
    return (f"  {label}: p50 {ms[len(ms) // 2]:.1f} ms, "
            f"p99 {ms[min(len(ms) - 1, len(ms) * 99 // 100)]:.1f} ms, max {ms[-1]:.1f} ms")


QLEN = Path("/proc/sys/net/unix/max_dgram_qlen")


def _forwarder_settings(args: argparse.Namespace) -> dict[str, float]:
    """[forwarder] as a user gets it, unless --producer-linger-ms says otherwise (the tests'
    config helper sets linger_ms = 1, which is not the default)."""
    linger = ForwarderConfig().linger_ms if args.producer_linger_ms is None \
        else args.producer_linger_ms
    return {"linger_ms": linger}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--producer-linger-ms", type=float, default=None,
                    help="forwarder.linger_ms (default: the shipped default)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--client-encode", action="store_true",
                    help="senders encode each datagram with FerryClient.send (default: once)")
    ap.add_argument("--dgram-qlen", type=int, default=None,
                    help="set net.unix.max_dgram_qlen for the run (needs root); "
                         "the packages use 4096")
    add_broker_option(ap)
    args = ap.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    old_qlen = int(QLEN.read_text())
    if args.dgram_qlen is not None:
        try:
            QLEN.write_text(str(args.dgram_qlen))  # read by the kernel when the socket is made
        except OSError as exc:
            sys.exit(f"--dgram-qlen needs root (cannot write {QLEN}: {exc}); "
                     f"the value now is {old_qlen}")
    try:
        run(args)
    finally:
        if args.dgram_qlen is not None:
            QLEN.write_text(str(old_qlen))


def run(args: argparse.Namespace) -> None:
    topic = "bench"
    per = args.messages // args.senders
    total = per * args.senders
    with tempfile.TemporaryDirectory() as tmp, start_broker(args.broker, Path(tmp)) as broker:
        broker.create_topic(topic, 8)
        cfg = load_config(write_config(Path(tmp), broker.bootstrap, http=False,
                                       buffer={"max_bytes": 8 * 1024**3},
                                       forwarder=_forwarder_settings(args)))
        registry = Registry()
        agent = Agent(cfg, registry=registry)
        commit_seconds = time_commits(agent)
        ack_seconds, last_ack = time_acks(agent)
        agent.start()
        # What buffer.writer_nice came to (it needs privileges; the log says when refused).
        tid = agent.committer.native_id
        writer_nice = os.getpriority(os.PRIO_PROCESS, tid) if tid is not None else "?"
        # The forwarder process is spawned: wait until its loop runs (its gauges arrive over
        # the pipe), so its start-up (imports, connecting) is not counted as per-message CPU.
        wait_until(lambda: registry.view().total("cluster_up") >= 1, timeout=60,
                   message="the forwarder to start and reach the broker")
        ctx = multiprocessing.get_context("fork")
        go = ctx.Event()
        procs = [ctx.Process(target=sender, args=(str(cfg.socket.path), topic, per, args.size,
                                                 go, args.client_encode))
                 for _ in range(args.senders)]
        for p in procs:
            p.start()
        peak = {"rss": 0}
        stop = threading.Event()

        def watch_rss() -> None:
            while not stop.wait(0.2):
                now = rss_kb(os.getpid()) + rss_kb(agent.forwarder.pid or 0)
                peak["rss"] = max(peak["rss"], now)

        threading.Thread(target=watch_rss, daemon=True).start()
        pids = {"ingest": [os.getpid()], "forwarder": [agent.forwarder.pid or 0],
                "broker": broker.pids()}
        cpu0 = {name: cpu_split_all(p) for name, p in pids.items()}
        t0 = time.perf_counter()
        go.set()
        accepted_at = delivered_at = None
        deadline = t0 + args.timeout
        next_view = 0.0
        while time.perf_counter() < deadline:
            now = time.perf_counter()
            if accepted_at is None and now >= next_view:
                v = registry.view()
                if v.total("messages_accepted") + v.total("messages_rejected") >= total:
                    accepted_at = last_ack[0]
                next_view = now + 0.05
            if accepted_at is not None and not agent.store.topic_stats():
                delivered_at = now
                break
            time.sleep(0.01)  # sampling the buffer, not synchronising anything
        # Every delivery must also be counted by the forwarder (its counters lag <= 0.25 s).
        if delivered_at is not None:
            wait_until(lambda: registry.view().total("messages_delivered") >= total,
                       timeout=10, message="the forwarder's delivery counters")
        # CPU per process over the run (ingest includes this script's sampling loop).
        split = {name: tuple(b - a for a, b in zip(cpu0[name], cpu_split_all(p), strict=True))
                 for name, p in pids.items()}
        cpu = {name: user + system for name, (user, system) in split.items()}
        children0 = cpu_seconds(os.getpid(), children=True)
        for p in procs:
            p.join(10)
        cpu["senders"] = cpu_seconds(os.getpid(), children=True) - children0
        stop.set()
        v = registry.view()
        h = v.histogram("buffer_commit_seconds")
        acc, rej, dlv = (v.total("messages_accepted"), v.total("messages_rejected"),
                         v.total("messages_delivered"))
        agent.stop()
        end = accepted_at or time.perf_counter()
        print(broker.describe())
        print(f"machine: {os.cpu_count()} cores; messages: {total} x {args.size} B; "
              f"senders: {args.senders}; net.unix.max_dgram_qlen: {QLEN.read_text().strip()}; "
              f"writer thread nice: {writer_nice}; forwarder.linger_ms {cfg.forwarder.linger_ms:g}")
        print(f"accepted: {acc:.0f} in {end - t0:.2f} s = {acc / (end - t0):,.0f} msg/s")
        print(f"rejected: {rej:.0f}; lost (sent - accepted - rejected): {total - acc - rej:.0f}")
        print(f"commits: {h.count}; commit latency p50 <= {(h.quantile(0.5) or 0) * 1000:.1f} ms,"
              f" p99 <= {(h.quantile(0.99) or 0) * 1000:.1f} ms (bucket bounds)")
        if commit_seconds:
            print(_percentiles(f"exact, from the ingest writer's {len(commit_seconds)} commits",
                               commit_seconds))
        if ack_seconds:
            print(_percentiles(f"{len(ack_seconds)} datagram groups, hand-over to durable",
                               ack_seconds))
        if delivered_at:
            print(f"delivered end to end: {dlv:.0f} in {delivered_at - t0:.2f} s = "
                  f"{dlv / (delivered_at - t0):,.0f} msg/s")
        else:
            print(f"delivered: only {dlv:.0f} of {total} within {args.timeout} s")
        print(f"agent peak RSS (ingest + forwarder): {peak['rss'] / 1024:.0f} MiB")
        print("CPU during the run, us per message: " + ", ".join(
            f"{name} {seconds / total * 1e6:.1f}" for name, seconds in cpu.items()))
        print("  of which in the kernel: " + ", ".join(
            f"{name} {system / total * 1e6:.1f}" for name, (_, system) in split.items()))


if __name__ == "__main__":
    main()
