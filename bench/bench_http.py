"""HTTP publishing benchmark: durable single-message and batch publishes, real server.

    .venv/bin/python bench/bench_http.py [--mode single|batch|both] [--seconds 10]
        [--connections 50] [--size 200] [--batch 1000] [--client wrk|python] [--kafka]
        [--dir PATH] [--linger-ms MS] [--switch-interval S] [--no-tune-gc]
        [--broker kafka|tansu]
    .venv/bin/python bench/bench_http.py --compare [--seconds 10] [--size 200]
        [--compare-connections 1,50,200] [--producer-linger-ms MS] [--rounds N]
        [--broker kafka|tansu]

The server is Ferry's HTTP stage as in production (``create_app`` + ``HttpServer``: Ferry's
protocol over httptools' parser, on uvloop) over a real ``Store`` and group ``Committer``
in a temporary directory under ``--dir`` (default: the repository, i.e. its disk), in its
own process. The load generator is another process: ``wrk`` (C; installed from Debian when
missing and run as root) or a built-in asyncio + uvloop raw-socket client; keep-alive, one
request in flight per connection, ``--connections`` in total.

Without ``--kafka`` nothing forwards the buffer, so topics use ack_timeout_ms = 0: every
answer is a 202, i.e. "committed and fsynced". With ``--kafka`` the full agent runs
(``ferry run``, forwarder process, a real broker) and the topic keeps ack_timeout_ms = 65, so
answers are 201 when Kafka acknowledged in time: that measures the Hermes-style 201 path.
The broker, for ``--kafka`` and ``--compare`` (``bench/brokers.py``): a 3-node Apache Kafka
cluster (RF 3, ``min.insync.replicas`` 2) by default, ``--broker tansu`` for one tansu
process; either way the broker's CPU per request is printed (every node's JVM together).

``--compare`` (issue 18) runs wrk at 50 and 200 connections (``--compare-connections``; 1
shows one request's latency alone) against one full agent and one real broker: the default
topic (201 when Kafka acknowledges within ack_timeout_ms = 65) and a 202-only topic
(ack_timeout_ms = 0), then a do-nothing asyncio server for the floor of the CPU a request
costs in Python; it prints the per-request CPU of each beside the others: the agent's ingest
process (what the do-nothing server compares with) and its forwarder process apart. The
forwarder runs with the configuration's default linger_ms unless ``--producer-linger-ms``.
``--rounds N`` repeats each pair (201, then 202-only; the order alternates from round to
round) and judges the ratio by its median: the host's speed swings within minutes, so one
pair says little.

Prints requests/s, messages/s, latency percentiles (client-measured), status codes, the
server's CPU time per request (what other load on the machine cannot inflate much), and
checks that the buffer (or Kafka) holds exactly the messages that were acknowledged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)
from brokers import BenchBroker, CpuMeter, add_broker_option, start_broker  # noqa: E402

TOPIC = "bench"
_LENGTH = re.compile(rb"content-length: *(\d+)", re.IGNORECASE)


# -- server process ------------------------------------------------------------------------
def serve(root: str, conn: Connection, linger_ms: float | None = None,
          switch_interval: float | None = None, tune_gc: bool = True) -> None:
    from agent.buffer.committer import Committer
    from agent.buffer.store import Store
    from agent.config import FerryConfig
    from agent.ingest.http.app import create_app
    from agent.ingest.http.server import HttpServer
    from agent.ingest.runtime import Phase, Runtime
    from agent.metrics import Registry

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    cfg = FerryConfig.model_validate({
        "buffer": {"path": root, "max_bytes": 8 * 1024**3},
        "socket": {"path": ""},
        "http": {"listen": "127.0.0.1:0"},
        "topics": {"default": {"ack_timeout_ms": 0}},
    })
    store = Store(cfg.buffer.path, cfg.buffer.max_bytes)
    registry = Registry()
    committer = Committer(store, registry=registry,
                          max_batch_messages=cfg.buffer.commit_max_messages,
                          linger_ms=cfg.buffer.commit_interval_ms if linger_ms is None
                          else linger_ms, nice=cfg.buffer.writer_nice)
    committer.start()
    runtime = Runtime(cfg, store, committer, registry)
    # Without --switch-interval the server lowers it as in production (SWITCH_INTERVAL).
    if switch_interval is None:
        server = HttpServer(runtime, create_app(runtime), tune_gc=tune_gc)
    else:
        server = HttpServer(runtime, create_app(runtime), switch_interval=None,
                            tune_gc=tune_gc)
    server.start()
    runtime.set_phase(Phase.RUNNING)
    conn.send(server.port)
    while conn.recv() == "cpu":  # until "stop": CPU seconds this process used so far
        usage = resource.getrusage(resource.RUSAGE_SELF)
        conn.send((usage.ru_utime + usage.ru_stime, _thread_cpu()))
    server.stop()
    committer.close()
    view = registry.view()
    stats = {s.topic: s.messages for s in store.topic_stats()}
    conn.send({
        "buffered": stats.get(TOPIC, 0),
        "commits": view.total("buffer_commits"),
        "commit_p99": view.histogram("buffer_commit_seconds").quantile(0.99),
        "rss_kb": _rss_kb(os.getpid()),
    })
    store.close()


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name of this process, from /proc: user time as "<name>",
    system time as "<name> sys"."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name), "other")
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        for kind, field in (("", 11), (" sys", 12)):  # utime, stime
            out[name + kind] = out.get(name + kind, 0.0) + int(fields[field]) / tick
    return out


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- load generator ------------------------------------------------------------------------
class _Client(asyncio.Protocol):
    def __init__(self, request: bytes, deadline: float, results: dict[str, Any],
                 done: asyncio.Future[None]) -> None:
        self.request = request
        self.deadline = deadline
        self.results = results
        self.done = done
        self.buf = b""
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        m = _LENGTH.search(self.buf, 0, end)
        length = int(m.group(1)) if m else 0
        if len(self.buf) < end + 4 + length:
            return
        now = time.perf_counter()
        status = self.buf[9:12].decode()
        self.buf = self.buf[end + 4 + length:]
        self.results["latencies"].append(now - self.sent_at)
        codes = self.results["codes"]
        codes[status] = codes.get(status, 0) + 1
        if now < self.deadline:
            self._send()
        else:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def load(port: int, request: bytes, connections: int, seconds: float, start_at: float,
         conn: Connection) -> None:
    import uvloop

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        results: dict[str, Any] = {"latencies": [], "codes": {}}
        await asyncio.sleep(max(0.0, start_at - time.time()))
        began = time.perf_counter()
        deadline = began + seconds
        dones = []
        for _ in range(connections):
            done: asyncio.Future[None] = loop.create_future()

            def client(d: asyncio.Future[None] = done) -> _Client:
                return _Client(request, deadline, results, d)

            await loop.create_connection(client, "127.0.0.1", port)
            dones.append(done)
        await asyncio.gather(*dones)
        results["elapsed"] = time.perf_counter() - began
        return results

    conn.send(uvloop.run(run()))


def _request(path: str, body: bytes, content_type: str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_mode(port: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    value = b"v" * args.size
    if mode == "single":
        path, body, ctype, per_request = f"/topics/{TOPIC}", value, "application/octet-stream", 1
    else:
        path, ctype, per_request = f"/topics/{TOPIC}/batch", "application/x-ndjson", args.batch
        body = b"\n".join([value] * args.batch) + b"\n"
    if args.client == "wrk":
        result = _run_wrk(port, path, body, ctype, args)
    else:
        result = _run_python(port, _request(path, body, ctype), args)
    ok = result.pop("ok")
    elapsed = result["elapsed_s"]
    return {
        "mode": mode,
        "client": args.client,
        "connections": args.connections,
        "requests": result["requests"],
        "acknowledged_messages": ok * per_request,
        "requests_per_s": round(result["requests"] / elapsed),
        "messages_per_s": round(ok * per_request / elapsed),
        **result,
    }


def _run_python(port: int, request: bytes, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 1.0
    per_loader = [args.connections // args.loaders + (1 if i < args.connections % args.loaders
                                                       else 0) for i in range(args.loaders)]
    pipes, procs = [], []
    for n in per_loader:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=load, args=(port, request, n, args.seconds, start_at, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    results = [pipe.recv() for pipe in pipes]
    for p in procs:
        p.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    codes: dict[str, int] = {}
    for r in results:
        for k, v in r["codes"].items():
            codes[k] = codes.get(k, 0) + v
    return {
        "requests": len(latencies),
        "ok": codes.get("201", 0) + codes.get("202", 0),
        "p50_ms": round(_percentile(latencies, 0.50) * 1000, 2),
        "p90_ms": round(_percentile(latencies, 0.90) * 1000, 2),
        "p99_ms": round(_percentile(latencies, 0.99) * 1000, 2),
        "max_ms": round(latencies[-1] * 1000, 2) if latencies else None,
        "codes": codes,
        "elapsed_s": round(max(r["elapsed"] for r in results), 2),
    }


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "%(ctype)s"
local f = io.open("%(body)s", "rb")
wrk.body = f:read("*all")
f:close()
local threads = {}
function setup(thread) table.insert(threads, thread) end
created, accepted = 0, 0
function response(status, headers, body)
  if status == 201 then created = created + 1 elseif status == 202 then accepted = accepted + 1 end
end
done = function(summary, latency, requests)
  local c201, c202 = 0, 0
  for _, t in ipairs(threads) do c201 = c201 + t:get("created"); c202 = c202 + t:get("accepted") end
  io.write(string.format("RESULT %%d %%d %%d %%d %%d %%d %%d %%d %%d %%d\\n", summary.requests,
    summary.duration, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, summary.errors.status, summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout, c201, c202))
end
"""


def _run_wrk(port: int, path: str, body: bytes, ctype: str, args: argparse.Namespace
             ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        body_file = Path(tmp) / "body"
        body_file.write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text(_WRK_SCRIPT % {"ctype": ctype, "body": body_file})
        out = subprocess.run(
            ["wrk", "-t1", f"-c{args.connections}", f"-d{args.seconds:g}s", "--timeout", "10s",
             "-s", str(script), f"http://127.0.0.1:{port}{path}"],
            capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    (requests, duration, p50, p90, p99, top, bad_status, socket_errors, created,
     accepted) = map(int, line.split()[1:])
    return {
        "requests": requests,
        "ok": created + accepted,
        "p50_ms": round(p50 / 1000, 2),
        "p90_ms": round(p90 / 1000, 2),
        "p99_ms": round(p99 / 1000, 2),
        "max_ms": round(top / 1000, 2),
        "codes": {"201": created, "202": accepted, "other": requests - created - accepted,
                  "socket_errors": socket_errors},
        "elapsed_s": round(duration / 1e6, 2),
    }


def _ensure_wrk() -> bool:
    """wrk (C, from Debian) loads the server without taking a core's worth of Python."""
    if shutil.which("wrk"):
        return True
    if os.geteuid() != 0:
        return False
    print("bench_http: installing wrk from Debian", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    ok = subprocess.run(["apt-get", "update", "-qq"], env=env).returncode == 0 and \
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], env=env).returncode == 0
    return ok and shutil.which("wrk") is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["single", "batch", "both"], default="both")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1000, help="messages per batch request")
    ap.add_argument("--client", choices=["wrk", "python"], default="wrk",
                    help="load generator: wrk (installed from Debian if missing) or the "
                    "built-in asyncio one (falls back to it when wrk cannot be had)")
    ap.add_argument("--loaders", type=int, default=1,
                    help="processes of the python load generator")
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent),
                    help="where the buffer lives (its disk decides the fsync cost)")
    ap.add_argument("--linger-ms", type=float, default=None,
                    help="the group commit's linger (default: buffer.commit_interval_ms, 0)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval() of the server process (default: what "
                    "HttpServer sets, agent.ingest.http.server.SWITCH_INTERVAL)")
    ap.add_argument("--no-tune-gc", dest="tune_gc", action="store_false",
                    help="leave the garbage collector as CPython sets it (HttpServer "
                    "otherwise freezes the startup heap and raises the young threshold)")
    ap.add_argument("--kafka", action="store_true",
                    help="full agent + broker (--broker); topic ack_timeout_ms=65 (201 path)")
    ap.add_argument("--compare", action="store_true",
                    help="issue 18: wrk at 50 and 200 connections, full agent and broker, "
                    "201 (default) against 202-only, beside a do-nothing asyncio server")
    ap.add_argument("--compare-connections", default="50,200",
                    type=lambda text: [int(n) for n in text.split(",")],
                    help="--compare: the connection counts, comma-separated (1 shows the "
                    "latency of one request alone)")
    ap.add_argument("--producer-linger-ms", type=float, default=None,
                    help="--compare: the forwarder's linger_ms (default: the configuration's "
                    "default)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--compare: pairs per connection count, alternating which mode "
                    "goes first; the ratio is judged by the median of the pairs")
    add_broker_option(ap)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(args.dir)), flush=True)
    if args.compare:
        if not _ensure_wrk():
            sys.exit("bench_http --compare needs wrk (Debian package wrk)")
        _compare(args)
        return
    if args.client == "wrk" and not _ensure_wrk():
        print("bench_http: wrk unavailable; using the python load generator", file=sys.stderr)
        args.client = "python"
    modes = ["single", "batch"] if args.mode == "both" else [args.mode]
    print(f"bench_http: {os.cpu_count()} CPUs, {args.connections} connections, "
          f"{args.size}-byte bodies, {args.seconds:g} s per mode, client {args.client}, "
          f"buffer under {args.dir}")
    if args.kafka:
        _with_kafka(modes, args)
        return
    total_acked = 0
    in_flight_max = sum(args.connections * (args.batch if m == "batch" else 1) for m in modes)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        server = ctx.Process(target=serve, args=(str(Path(tmp) / "buffer"), child,
                                                 args.linger_ms, args.switch_interval,
                                                 args.tune_gc))
        server.start()
        port = parent.recv()
        try:
            for mode in modes:
                parent.send("cpu")
                before, threads_before = parent.recv()
                result = run_mode(port, mode, args)
                parent.send("cpu")
                after, threads_after = parent.recv()
                used = after - before
                # CPU the server spent per request: what the machine's other load cannot skew.
                result["server_cpu_us_per_request"] = round(used / result["requests"] * 1e6, 1)
                result["server_cpu_busy"] = round(used / result["elapsed_s"], 2)
                # ...and per thread: the event loop ("http-server") and the buffer writer
                # share one GIL, so their sum is what bounds the rate.
                result["thread_cpu_us_per_request"] = {
                    name: round((t - threads_before.get(name, 0.0)) / result["requests"] * 1e6,
                                1)
                    for name, t in sorted(threads_after.items())
                    if t - threads_before.get(name, 0.0) > 0.05}
                total_acked += result["acknowledged_messages"]
                print(json.dumps(result))
        finally:
            parent.send("stop")
            summary = parent.recv()
            server.join(30)
        summary["acknowledged"] = total_acked
        # Requests still in flight when the load generator stopped were committed but their
        # answers not counted: at most one request per connection per mode.
        summary["committed_unanswered"] = summary["buffered"] - total_acked
        print(json.dumps({"server": summary}))
        if not 0 <= summary["committed_unanswered"] <= in_flight_max:
            sys.exit(f"MISMATCH: {total_acked} acknowledged, {summary['buffered']} buffered")


def _with_kafka(modes: list[str], args: argparse.Namespace) -> None:
    from tests.agent_harness import AgentProcess, wait_drained, write_config
    from tests.kafka import read_topic

    with tempfile.TemporaryDirectory() as tmp, start_broker(args.broker, Path(tmp)) as broker:
        print(broker.describe(), flush=True)
        broker.create_topic(TOPIC, 8)
        path = write_config(Path(tmp) / "agent", broker.bootstrap,
                            buffer={"max_bytes": 8 * 1024**3})
        agent = AgentProcess(path).start()
        meter = CpuMeter(broker)
        try:
            port = agent.config.http.port
            total = 0
            for mode in modes:
                meter.start()
                result = run_mode(port, mode, args)
                result["broker_cpu_us_per_request"] = round(
                    meter.seconds() / max(1, result["requests"]) * 1e6, 1)
                total += result["acknowledged_messages"]
                print(json.dumps(result))
            wait_drained(agent, timeout=600)
        finally:
            agent.terminate()
        delivered = len(read_topic(broker.bootstrap, TOPIC, timeout=300))
        # Requests in flight when the load stopped were stored too, unanswered (<= 1 per
        # connection per mode); duplicates are possible only after a crash.
        print(json.dumps({"acknowledged": total, "in_kafka": delivered}))
        if delivered < total:
            sys.exit(f"MISSING: {total} acknowledged, {delivered} in Kafka")


# -- the issue-18 comparison: 201 mode against 202-only, same agent and broker ------------
TOPIC_202 = "bench202"


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _agent_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the agent: its ingest process (HTTP stage, writer) and its children
    (the forwarder process; the broker is not one of them)."""
    children = 0.0
    for child in _children(pid):
        try:
            children += _process_cpu(child)
        except OSError:
            continue  # it ended meanwhile
    return _process_cpu(pid), children


def _null_server(conn: Connection) -> None:
    """A do-nothing asyncio server on uvloop: answers every request with a canned 202,
    parsing nothing but the end of the headers and Content-Length. The floor of what any
    Python asyncio HTTP server costs per request on this machine."""
    import uvloop

    answer = (b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\n"
              b"content-length: 2\r\n\r\n{}")

    class Null(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.data = b""

        def data_received(self, data: bytes) -> None:
            self.data += data
            while True:
                end = self.data.find(b"\r\n\r\n")
                if end < 0:
                    return
                m = _LENGTH.search(self.data, 0, end)
                total = end + 4 + (int(m.group(1)) if m else 0)
                if len(self.data) < total:
                    return
                self.data = self.data[total:]
                self.transport.write(answer)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Null, "127.0.0.1", 0, backlog=2048)
        conn.send(server.sockets[0].getsockname()[1])
        await loop.run_in_executor(None, conn.recv)
        server.close()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    uvloop.run(run())


def _measured(pid: int, port: int, topic: str, connections: int, args: argparse.Namespace,
              broker: BenchBroker | None = None) -> dict[str, Any]:
    args.connections = connections
    ingest, forwarder = _agent_cpu(pid)
    broker_cpu = broker.cpu_seconds() if broker is not None else 0.0
    client = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = _run_wrk(port, f"/topics/{topic}", b"v" * args.size, "application/octet-stream",
                      args)
    ingest_after, forwarder_after = _agent_cpu(pid)
    broker_after = broker.cpu_seconds() if broker is not None else 0.0
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    n = max(1, result["requests"])
    result["requests_per_s"] = round(result["requests"] / result["elapsed_s"])
    # The ingest process (HTTP stage and writer): what the do-nothing server compares with.
    result["cpu_us_per_request"] = round((ingest_after - ingest) / n * 1e6, 1)
    result["forwarder_cpu_us_per_request"] = round((forwarder_after - forwarder) / n * 1e6, 1)
    # Where the rest of the two cores went: the broker, and wrk (the only child that ends
    # during the run, so the children's usage delta is its own).
    result["broker_cpu_us_per_request"] = round((broker_after - broker_cpu) / n * 1e6, 1)
    wrk = (client_after.ru_utime + client_after.ru_stime
           - client.ru_utime - client.ru_stime)
    result["wrk_cpu_us_per_request"] = round(wrk / n * 1e6, 1)
    return result


def _compare(args: argparse.Namespace) -> None:
    """wrk at 50 and 200 connections against one agent and one real broker: the default
    topic (ack_timeout_ms 65: 201 when Kafka acknowledges in time) and a 202-only topic
    (ack_timeout_ms 0), interleaved; then a do-nothing asyncio server for the CPU floor."""
    from agent.config import ForwarderConfig
    from tests.agent_harness import AgentProcess, wait_drained, write_config
    from tests.kafka import read_topic

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, \
            start_broker(args.broker, Path(tmp)) as broker:
        print(broker.describe(), flush=True)
        for topic in (TOPIC, TOPIC_202):
            broker.create_topic(topic, 8)
        # The forwarder as configured by default (the test harness lowers linger_ms to 1).
        linger = (ForwarderConfig().linger_ms if args.producer_linger_ms is None
                  else args.producer_linger_ms)
        path = write_config(Path(tmp) / "agent", broker.bootstrap,
                            buffer={"max_bytes": 8 * 1024**3},
                            forwarder={"linger_ms": linger},
                            topics={TOPIC_202: {"ack_timeout_ms": 0}})
        print(json.dumps({"producer_linger_ms": linger}), flush=True)
        agent = AgentProcess(path).start()
        try:
            assert agent.proc is not None
            pid, port = agent.proc.pid, agent.config.http.port
            acked = 0
            pair = ((TOPIC, "201 (default)"), (TOPIC_202, "202-only"))
            for connections in args.compare_connections:
                for n in range(args.rounds):
                    # Alternate which mode goes first: a host slowing down during the
                    # round must not always count against the same one.
                    for topic, label in pair if n % 2 == 0 else pair[::-1]:
                        r = _measured(pid, port, topic, connections, args, broker)
                        acked += r["ok"]
                        rows.append({"server": "ferry", "mode": label, "round": n + 1,
                                     "connections": connections, **r})
                        print(json.dumps(rows[-1]), flush=True)
            wait_drained(agent, timeout=600)
        finally:
            agent.terminate()
        delivered = sum(len(read_topic(broker.bootstrap, t, timeout=300))
                        for t in (TOPIC, TOPIC_202))
        print(json.dumps({"acknowledged": acked, "in_kafka": delivered}), flush=True)
        if delivered < acked:
            sys.exit(f"MISSING: {acked} acknowledged, {delivered} in Kafka")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    null = ctx.Process(target=_null_server, args=(child,))
    null.start()
    try:
        port = parent.recv()
        assert null.pid is not None
        for connections in args.compare_connections:
            r = _measured(null.pid, port, "null", connections, args)
            rows.append({"server": "do-nothing asyncio", "mode": "-",
                         "connections": connections, **r})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        parent.send("stop")
        null.join(10)
    print()
    print(f"{'server':20} {'mode':14} {'conns':>5} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'CPU us/req':>10} {'fwd us/req':>10} {'broker':>7} {'wrk':>5} "
          f"{'201':>8} {'202':>8}")
    for r in rows:
        print(f"{r['server']:20} {r['mode']:14} {r['connections']:>5} {r['requests_per_s']:>8} "
              f"{r['p50_ms']:>7} {r['p99_ms']:>7} {r['cpu_us_per_request']:>10} "
              f"{r['forwarder_cpu_us_per_request']:>10} "
              f"{r['broker_cpu_us_per_request']:>7} {r['wrk_cpu_us_per_request']:>5} "
              f"{r['codes']['201']:>8} {r['codes']['202']:>8}")
    for connections in args.compare_connections:
        ratios = []
        for n in range(args.rounds):
            by = {r["mode"]: r for r in rows if r["server"] == "ferry"
                  and r["connections"] == connections and r["round"] == n + 1}
            d, o = by["201 (default)"], by["202-only"]
            ratios.append(d["requests_per_s"] / max(1, o["requests_per_s"]))
            print(f"{connections} connections, round {n + 1}: 201 mode "
                  f"{d['requests_per_s']}/s = {ratios[-1]:.2f} x the 202-only rate "
                  f"({o['requests_per_s']}/s)")
        print(f"{connections} connections: median ratio {statistics.median(ratios):.2f} over "
              f"{len(ratios)} round(s); targets: 201 >= 15000/s and >= 0.70 x, "
              f"202-only >= 20000/s")


if __name__ == "__main__":
    main()
