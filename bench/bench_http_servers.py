"""Issues #29, #37: Ferry's own HTTP protocol against granian and hypercorn, side by side.

    .venv/bin/python bench/bench_http_servers.py [--seconds 10] [--connections 50,200]
        [--rounds 2] [--modes 202,201]
        [--candidates ferry,granian-rsgi,granian-asgi,hypercorn]
        [--size 200] [--dir PATH]

Each candidate is a whole agent in its own process (``Agent``: buffer, group committer,
forwarder process, one tansu broker for all), differing only in its HTTP stage:

- ``ferry``: today's front door (``HttpServer``: protocol.py over httptools, on uvloop), as
  ``ferry run`` starts it;
- ``granian-rsgi``: granian's embedded server on the agent's own uvloop thread, an RSGI
  adapter handing each publish to ``Publisher.publish`` (bench/http_candidates/);
- ``granian-asgi``: the same server serving the ``FerryApp`` over ASGI (``Publisher.__call__``);
- ``hypercorn``: hypercorn (h11) on the agent's own uvloop thread, serving the ``FerryApp``
  over ASGI (issue #37);
- ``ferry-https`` (not run unless named): today's front door over its HTTPS listener
  (``http.tls_listen``, a test CA's certificate, no client certificate), what TLS costs;

plus the issue's baseline, a do-nothing asyncio server on uvloop that answers a canned 202
after finding the end of each request.

wrk (one thread, keep-alive, one request in flight per connection) publishes 200-byte
messages at each ``--connections`` count, to a 202-only topic (ack_timeout_ms 0: answered
once fsynced) and to a default topic (201 when Kafka acknowledges within 65 ms). Within a
round every candidate runs once per mode, in an order that rotates from round to round, so
a host that slows down during the run does not always count against the same one. Printed
per run: publishes/s, p50/p99 (wrk's), the ingest process's CPU per request (granian's Rust
threads included), the forwarder's apart. At the end every agent drains its buffer and each
topic is read back from the broker: acknowledged publishes missing there are printed as
lost, and the run fails.

The ratios the issue sets are printed from the medians over rounds: 202-only at 50
connections against the do-nothing server (>= 0.22), 201 against 202-only at 200 (>= 0.7).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CANDIDATES = ("ferry", "granian-rsgi", "granian-asgi", "hypercorn")
HTTPS = "ferry-https"  # Ferry's own protocol over TLS: a mode of the same front door
NULL = "do-nothing"
_CONTENT_LENGTH = re.compile(rb"content-length: *(\d+)", re.IGNORECASE)


# -- the agents ----------------------------------------------------------------------------
def agent_main(config_path: str, candidate: str, conn: Connection) -> None:
    """One agent whose HTTP stage is ``candidate``; answers "drain"/"stop" on ``conn``."""
    import agent.daemon.agent as daemon
    from agent.config import load_config
    from agent.daemon.agent import Agent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if candidate == "hypercorn":
        from http_candidates.hypercorn_stage import HypercornStage

        daemon._http_stage = HypercornStage
    elif candidate not in ("ferry", HTTPS):
        from http_candidates.granian_stage import GranianStage

        interface = candidate.split("-", 1)[1]
        daemon._http_stage = lambda runtime: GranianStage(runtime, interface)
    config = load_config(Path(config_path), system_default=False)
    agent = Agent(config)
    agent.start()
    conn.send(config.http.tls_port if candidate == HTTPS else config.http.port)
    while (command := conn.recv()) != "stop":
        if command == "drain":  # until the forwarder has shipped everything
            deadline = time.monotonic() + 600
            while (sum(s.messages for s in agent.store.topic_stats()) > 0
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            conn.send(sum(s.messages for s in agent.store.topic_stats()))
    agent.stop()
    conn.send("stopped")


def null_main(conn: Connection) -> None:
    """The baseline: reads requests (end of headers, Content-Length) and answers each
    with the same 202, nothing else."""
    import uvloop

    canned = b"HTTP/1.1 202 Accepted\r\ncontent-length: 2\r\n\r\n{}"

    class Canned(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.out: Any = transport
            self.pending = b""

        def data_received(self, data: bytes) -> None:
            pending = self.pending + data
            while (head := pending.find(b"\r\n\r\n")) >= 0:
                found = _CONTENT_LENGTH.search(pending, 0, head)
                end = head + 4 + (int(found.group(1)) if found else 0)
                if end > len(pending):
                    break
                pending = pending[end:]
                self.out.write(canned)
            self.pending = pending

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(
            Canned, "127.0.0.1", 0, backlog=2048)
        conn.send(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        server.close()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    uvloop.run(serve())


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu(pid: int) -> float:
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(cpu_seconds(int(k)) for k in kids)
    return total


# -- the load ------------------------------------------------------------------------------
_WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.body = string.rep("v", %(size)d)
local all = {}
function setup(thread) table.insert(all, thread) end
n201, n202 = 0, 0
function response(status, headers, body)
  if status == 201 then n201 = n201 + 1 elseif status == 202 then n202 = n202 + 1 end
end
done = function(summary, latency, requests)
  local a, b = 0, 0
  for _, t in ipairs(all) do a = a + t:get("n201"); b = b + t:get("n202") end
  io.write(string.format("FIGURES %%d %%d %%d %%d %%d %%d %%d\\n", summary.requests,
    summary.duration, latency:percentile(50), latency:percentile(99), a, b,
    summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout))
end
"""


def wrk(url: str, connections: int, seconds: float, size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "publish.lua"
        script.write_text(_WRK_LUA % {"size": size})
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s",
             "-s", str(script), url],
            capture_output=True, text=True, check=True, timeout=seconds + 120).stdout
    line = next(x for x in out.splitlines() if x.startswith("FIGURES "))
    requests, micros, p50, p99, n201, n202, errors = map(int, line.split()[1:])
    return {"requests": requests, "elapsed_s": micros / 1e6, "p50_ms": p50 / 1000,
            "p99_ms": p99 / 1000, "201": n201, "202": n202, "socket_errors": errors}


def measure(pid: int, url: str, connections: int, args: argparse.Namespace) -> dict[str, Any]:
    ingest, forwarder = cpu_seconds(pid), children_cpu(pid)
    result = wrk(url, connections, args.seconds, args.size)
    n = max(1, result["requests"])
    result["per_s"] = round(result["requests"] / result["elapsed_s"])
    result["cpu_us"] = round((cpu_seconds(pid) - ingest) / n * 1e6, 1)
    result["fwd_cpu_us"] = round((children_cpu(pid) - forwarder) / n * 1e6, 1)
    return result


# -- the run -------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", default="50,200")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="202,201")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=None, help="where the buffers live")
    ap.add_argument("--drain", action="store_true",
                    help="after each run, wait until the forwarder has emptied the buffer: a "
                    "202 run accepts faster than the forwarder and the broker deliver on two "
                    "shared cores, and the next run would pay for its backlog")
    args = ap.parse_args()
    candidates = [c for c in args.candidates.split(",") if c]
    unknown = set(candidates) - {*CANDIDATES, HTTPS}
    if unknown:
        sys.exit(f"unknown candidate(s) {sorted(unknown)}; known: {(*CANDIDATES, HTTPS)}")
    modes = args.modes.split(",")
    counts = [int(c) for c in args.connections.split(",")]

    from agent.config import ForwarderConfig
    from tests.agent_harness import write_config
    from tests.certificates import CertificateAuthority
    from tests.kafka import Broker, create_topic, free_port, read_topic

    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    acked: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, \
            Broker(log_path=Path(tmp) / "tansu.log") as broker:
        agents: dict[str, tuple[Any, Connection, int]] = {}
        try:
            for cand in candidates:
                for mode in modes:
                    create_topic(broker.bootstrap, f"{cand}-{mode}", 8)
                http: dict[str, Any] = {}
                if cand == HTTPS:  # wrk does not check the certificate; curl would need the CA
                    cert = CertificateAuthority(Path(tmp) / "pki").issue("server", server=True)
                    http = {"tls_listen": f"127.0.0.1:{free_port()}",
                            "tls_cert_file": cert.cert, "tls_key_file": cert.key}
                path = write_config(Path(tmp) / cand, broker.bootstrap, http=http or True,
                                    buffer={"max_bytes": 8 * 1024**3},
                                    forwarder={"linger_ms": ForwarderConfig().linger_ms},
                                    topics={f"{cand}-202": {"ack_timeout_ms": 0}})
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=agent_main, args=(str(path), cand, child),
                                   name=f"agent-{cand}")
                proc.start()
                agents[cand] = (proc, parent, parent.recv())
            parent, child = ctx.Pipe()
            null = ctx.Process(target=null_main, args=(child,), name="do-nothing")
            null.start()
            agents[NULL] = (null, parent, parent.recv())
            for connections in counts:
                for n in range(args.rounds):
                    order = candidates[n % len(candidates):] + candidates[:n % len(candidates)]
                    runs = [(c, m) for m in (modes if n % 2 == 0 else modes[::-1])
                            for c in order]
                    runs.insert(n % (len(runs) + 1), (NULL, "202"))
                    for cand, mode in runs:
                        proc, _, port = agents[cand]
                        topic = "null" if cand == NULL else f"{cand}-{mode}"
                        scheme = "https" if cand == HTTPS else "http"
                        r = measure(proc.pid, f"{scheme}://127.0.0.1:{port}/topics/{topic}",
                                    connections, args)
                        if cand != NULL:
                            acked[topic] = acked.get(topic, 0) + r["201"] + r["202"]
                        rows.append({"server": cand, "mode": mode, "connections": connections,
                                     "round": n + 1, **r})
                        if args.drain and cand != NULL:
                            pipe = agents[cand][1]
                            pipe.send("drain")
                            rows[-1]["left_after_drain"] = pipe.recv()
                        print(json.dumps(rows[-1]), flush=True)
            agents[NULL][1].send("stop")
            agents[NULL][0].join(10)
            del agents[NULL]
            for cand, (_, pipe, _) in agents.items():
                pipe.send("drain")
                left = pipe.recv()
                print(json.dumps({"server": cand, "left_in_buffer": left}), flush=True)
        finally:
            for proc, pipe, _ in agents.values():
                pipe.send("stop")
                pipe.recv()
                proc.join(30)
        lost = {}
        for topic, n in sorted(acked.items()):
            delivered = len(read_topic(broker.bootstrap, topic, timeout=300))
            lost[topic] = max(0, n - delivered)
            print(json.dumps({"topic": topic, "acknowledged": n, "in_kafka": delivered,
                              "lost": lost[topic],
                              "unanswered_or_duplicated": max(0, delivered - n)}), flush=True)
    report(rows, counts, candidates)
    if any(lost.values()):
        sys.exit(f"LOST acknowledged publishes: {lost}")


def report(rows: list[dict[str, Any]], counts: list[int], candidates: list[str]) -> None:
    print()
    print(f"{'server':14} {'mode':4} {'conns':>5} {'runs':>4} {'publishes/s':>11} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'CPU us/req':>10} {'fwd us/req':>10}")

    def median(server: str, mode: str, connections: int, key: str) -> float | None:
        values = [r[key] for r in rows if r["server"] == server and r["mode"] == mode
                  and r["connections"] == connections]
        return statistics.median(values) if values else None

    for connections in counts:
        for server in [*candidates, NULL]:
            for mode in ("202", "201"):
                runs = [r for r in rows if r["server"] == server and r["mode"] == mode
                        and r["connections"] == connections]
                if not runs:
                    continue
                figures = [median(server, mode, connections, k)
                           for k in ("per_s", "p50_ms", "p99_ms", "cpu_us", "fwd_cpu_us")]
                print(f"{server:14} {mode:4} {connections:>5} {len(runs):>4} "
                      f"{figures[0]:>11.0f} {figures[1]:>7.2f} {figures[2]:>7.2f} "
                      f"{figures[3]:>10.1f} {figures[4]:>10.1f}")
    print()
    floor = median(NULL, "202", 50, "per_s")
    for server in candidates:
        quick50 = median(server, "202", 50, "per_s")
        quick200 = median(server, "202", 200, "per_s")
        acked200 = median(server, "201", 200, "per_s")
        if floor and quick50:
            print(f"{server}: 202-only at 50 = {quick50 / floor:.2f} x the do-nothing server "
                  f"(issue: >= 0.22)")
        if quick200 and acked200:
            print(f"{server}: 201 at 200 = {acked200 / quick200:.2f} x 202-only at 200 "
                  f"(issue: >= 0.70)")
        for mode, bound in (("202", 10.0), ("201", 20.0)):
            p99 = median(server, mode, 50, "p99_ms")
            if p99 is not None:
                print(f"{server}: p99 {mode} at 50 = {p99:.2f} ms (issue: <= {bound:g} ms)")


if __name__ == "__main__":
    main()
