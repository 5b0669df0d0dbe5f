"""Issue #37 item 2's resource bounds, per seed, against each candidate front door.

    .venv/bin/python bench/bench_http_bounds.py [--seeds 1,2,3] [--random N]
        [--candidates ferry,granian-rsgi,granian-asgi,hypercorn]

The streams of tests/http/test_resource_bounds.py (tests/http/streams.py: the same seed,
the same bytes) are played, a connection at a time, against each candidate serving a real
Store and Committer in a process of its own (bench_http_audit_servers.py's ``server_main``),
configured with the test's limits and deadlines where the candidate has them (body and
message limits, header and body deadline 2 s, keep-alive 0.5 s, write deadline 1 s:
Ferry's alone). The same four properties, measured from outside the server process:

- mem: the process's peak RSS growth during a connection (sampled every 20 ms) under
  64 MiB + 16 x the body limit (no candidate but Ferry exposes what it holds of bodies);
- cpu: the process's CPU time (all threads) for a connection under 5 x a baseline
  measured on the same candidate at its start (per byte of 1-byte chunks, per request, per
  connection), plus 0.2 s (the clock's ticks are 10 ms);
- fds: the process's sockets back to their idle count within the longest deadline, the
  write deadline and 10 s after the client's last action, whoever closed;
- trailers: stored key, Kafka headers and partition key as the headers said, no replay
  and no topic created by a trailer's Idempotency-Key or token;
- answers (beside the issue's four): statuses as the headers and bodies call for (granian's
  RSGI adapter answers 404 to the status and management routes: it does not serve them),
  every accepted message stored as sent.

A client that stops reading here cannot shrink the server's kernel buffer (the test does,
in process): its answers fit, so it shows whether idle connections are closed, not the write
deadline (bench_http_audit_servers.py's N2 does). Prints a line per connection as JSON,
then a table per seed of which property each server passed (``pass``, or how many
connections failed it), and the failures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_http_audit_servers import (  # noqa: E402 - after the path
    CANDIDATES,
    Sampler,
    Target,
    cpu_seconds,
    sockets,
    start,
    stop,
)

from tests.http import streams  # noqa: E402

PROFILE = streams.Profile()
LIMIT = max(PROFILE.batch_bytes, PROFILE.message_bytes)
HEADER_TIMEOUT = BODY_TIMEOUT = 2.0
KEEP_ALIVE = 0.5
WRITE_TIMEOUT = 1.0
LINGER = 2.0  # Ferry's protocol.LINGER_SECONDS
RELEASE = max(HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, LINGER) + WRITE_TIMEOUT + 10.0
RSS_GROWTH_MIB = (64 * 1024 * 1024 + 16 * LIMIT) / 1024 / 1024
CPU_FACTOR = 5.0
CPU_FLOOR = 0.2
PROPERTIES = ("mem", "cpu", "fds", "trailers", "answers")
SECTIONS: dict[str, Any] = {
    "http": {"management_token": streams.TOKEN, "header_allowlist": [streams.TRACE],
             "max_batch_bytes": PROFILE.batch_bytes, "max_header_bytes": PROFILE.header_bytes,
             "max_headers": PROFILE.headers, "header_timeout_seconds": HEADER_TIMEOUT,
             "body_timeout_seconds": BODY_TIMEOUT, "keep_alive_seconds": KEEP_ALIVE,
             "write_timeout_seconds": WRITE_TIMEOUT},
    "topics": {"default": {"ack_timeout_ms": 0, "max_message_bytes": PROFILE.message_bytes}},
}


def _settle(target: Target, idle: int, timeout: float) -> float | None:
    """Seconds until the server's sockets are back to ``idle``; None if not in ``timeout``."""
    began = time.monotonic()
    for _ in range(int(timeout / 0.02) + 1):
        if sockets(target.pid) <= idle:
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            break
        time.sleep(0.02)
    return None


def _cpu_of(target: Target, idle: int, data: bytes, answers: int) -> float:
    before = cpu_seconds(target.pid)
    with target.connect() as sock:
        sock.sendall(data)
        got = b""
        for _ in range(10_000):
            if len(streams.split(got)) >= answers:
                break
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    _settle(target, idle, 30.0)
    return float(cpu_seconds(target.pid) - before)


def baseline(target: Target, idle: int) -> tuple[float, float, float]:
    """CPU seconds per byte (1-byte chunks), per request and per connection: the least of
    five tries each, on small inputs. The chunked body is larger than the test's (64 KiB
    in 1-byte chunks), for the process clock's 10 ms ticks."""
    chunked = (b"POST /topics/base HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"1\r\nx\r\n" * 65536 + b"0\r\n\r\n")
    small = b"POST /topics/base HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx"
    requests = streams.PING * 50 + (b"POST /topics/base HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Length: 1\r\n\r\nv") * 50
    _cpu_of(target, idle, requests, 100)
    per_byte, per_request, per_connection = [], [], []
    for _ in range(5):
        per_connection.append(_cpu_of(target, idle, b"", 0))
        per_request.append(_cpu_of(target, idle, requests, 100) / 100)
        one = _cpu_of(target, idle, small, 1)
        per_byte.append((_cpu_of(target, idle, chunked, 1) - one) / (len(chunked) - len(small)))
    return max(min(per_byte), 1e-9), min(per_request), min(per_connection)


def _exists(target: Target, name: str) -> bool:
    with target.connect() as sock:
        sock.sendall(b"GET /topics/" + name.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + streams.TOKEN.encode() + b"\r\n\r\n")
        got = b""
        for _ in range(1000):
            if streams.split(got):
                break
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    answers = streams.split(got)
    return not answers or streams.status(answers[0]) != 404


def run_stream(target: Target, stream: streams.Stream,
               base: tuple[float, float, float]) -> dict[str, Any]:
    idle = sockets(target.pid)
    cpu0 = cpu_seconds(target.pid)
    with Sampler(target.pid) as sampler:
        rss0 = sampler.rss
        try:
            played = streams.play(stream, "127.0.0.1", target.port)
        except OSError as exc:
            played = streams.Played([], 0, time.monotonic(), None, type(exc).__name__)
        try:
            waited = time.monotonic() - played.ended
            settled = _settle(target, idle, max(0.0, RELEASE - waited))
        finally:
            if played.sock is not None:
                played.sock.close()
    released = None if settled is None else waited + settled
    cpu = cpu_seconds(target.pid) - cpu0
    size = played.sent + sum(r.decoded for r in stream.whole())
    per_byte, per_request, per_connection = base
    allowed = CPU_FACTOR * (per_byte * size + per_request * len(stream.requests)
                            + per_connection) + CPU_FLOOR
    growth = sampler.rss - rss0
    try:
        verdict = streams.judge(stream, played, target.stored_full(stream.topic),
                                lambda name: _exists(target, name))
    except (OSError, EOFError) as exc:
        verdict = streams.Verdict(answers=[f"could not judge: {exc!r}"])
    return {"server": target.candidate, "seed": stream.seed, "conn": stream.index,
            "what": stream.describe(), "bytes": size, "mem": growth < RSS_GROWTH_MIB,
            "rss_mib": round(growth, 1), "cpu": cpu <= allowed, "cpu_s": round(cpu, 3),
            "cpu_allowed_s": round(allowed, 3), "fds": settled is not None,
            "released_s": None if released is None else round(released, 2),
            "trailers": not verdict.trailers, "answers": not verdict.answers,
            "faults": verdict.all(), "client": played.error}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2,3,5,8,13,21",
                    help="the test's fixed seeds by default")
    ap.add_argument("--random", type=int, default=0, help="this many seeds from the clock")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--dir", type=Path, default=None, help="where the buffers live")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    seeds += [time.time_ns() % 1_000_000_007 + i for i in range(args.random)]
    candidates = args.candidates.split(",")
    if unknown := set(candidates) - set(CANDIDATES):
        sys.exit(f"unknown: {sorted(unknown)}")
    print(f"seeds {seeds} (replay one: --seeds N, or FERRY_HTTP_SEED=N for the test)",
          flush=True)
    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for candidate in candidates:
            for seed in seeds:  # a fresh server a seed, as in the test
                root = Path(tmp) / f"{candidate}-{seed}"
                root.mkdir()
                target = start(ctx, candidate, root, None, SECTIONS)
                try:
                    idle = sockets(target.pid)
                    base = baseline(target, idle)
                    print(f"{candidate} seed {seed}: baseline "
                          f"{base[0] * 1e9:.0f} ns/byte, {base[1] * 1e6:.0f} µs/request, "
                          f"{base[2] * 1e6:.0f} µs/connection", flush=True)
                    for stream in streams.streams(seed, PROFILE):
                        row = run_stream(target, stream, base)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    stop(target)
    report(rows, candidates, seeds)


def report(rows: list[dict[str, Any]], candidates: list[str], seeds: list[int]) -> None:
    print(f"\n{'seed':>10} {'property':9}" + "".join(f"{c:>14}" for c in candidates))
    for seed in seeds:
        for prop in PROPERTIES:
            cells = []
            for candidate in candidates:
                mine = [r for r in rows if r["server"] == candidate and r["seed"] == seed]
                failed = sum(1 for r in mine if not r[prop])
                cells.append("-" if not mine else "pass" if not failed
                             else f"FAIL {failed}/{len(mine)}")
            print(f"{seed:>10} {prop:9}" + "".join(f"{c:>14}" for c in cells))
    print(f"{'all':>10} {'passed':9}" + "".join(
        f"{sum(1 for r in rows if r['server'] == c and all(r[p] for p in PROPERTIES)):>9}"
        f"/{sum(1 for r in rows if r['server'] == c):<4}" for c in candidates))
    for r in rows:
        if not all(r[p] for p in PROPERTIES):
            bad = [p for p in PROPERTIES if not r[p]]
            print(f"\n{r['server']} seed {r['seed']} {r['what']}: {', '.join(bad)} failed "
                  f"(+{r['rss_mib']} MiB, CPU {r['cpu_s']} of {r['cpu_allowed_s']} s, "
                  f"released {r['released_s']} s)")
            for fault in r["faults"][:5]:
                print(f"    {fault[:300]}")


if __name__ == "__main__":
    main()
