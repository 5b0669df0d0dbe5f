"""The HTTP protocol alone: CPU per request of ``HttpProtocol`` for a 200-byte publish.

No socket, no buffer: a stand-in transport counts the answers and the publish callback answers
202 at once, so the figure is the protocol's own parsing, routing and answering, which the
whole-agent benchmarks (bench_http.py) cannot separate from the writer and the loop.

``--tree DIR`` measures the protocol of another checkout (an old commit in a worktree), run by
this interpreter; give it several times to alternate trees, old against new:

    .venv/bin/python bench/bench_http_protocol.py --tree /tmp/old --tree . --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REQUEST = (b"POST /topics/bench HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
           b"Content-Type: application/octet-stream\r\nContent-Length: 200\r\n\r\n" + b"v" * 200)


class StandInTransport(asyncio.Transport):
    """A connection's transport that counts the answers written (``on_write`` is told of
    each) and sends nothing: what the protocol does per request, without a socket."""

    def __init__(self, on_write: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.writes = 0
        self.on_write = on_write

    def write(self, data: Any) -> None:
        self.writes += 1
        if self.on_write is not None:
            self.on_write()

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default


async def _per_request_us(requests: int, repeats: int) -> float:
    protocol = importlib.import_module("agent.ingest.http.protocol")
    limits = protocol.Limits(request_line=8192, header_bytes=16384, headers=100,
                             header_timeout=10, body_timeout=10, keep_alive=60)

    def publish(topic: str, batch: bool, headers: Any, body: bytes, reply: Any) -> None:
        reply(202, [(b"ferry-message-id", b"0" * 32)], b"")

    conn = protocol.HttpProtocol(
        limits=limits, connections=protocol.Connections(100), date=protocol.DateHeader(),
        publish=publish, body_limit=lambda t, b: 1 << 20, too_large=lambda t, b, n: None,
        refused=lambda *a: None, gone=lambda b: None, asgi=lambda *a: None,
        read_limit=1 << 20)
    transport = StandInTransport()
    conn.connection_made(transport)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(requests):
            conn.data_received(REQUEST)
        best = min(best, (time.perf_counter() - started) / requests * 1e6)
    if transport.writes < requests * repeats:
        raise SystemExit(f"only {transport.writes} answers for {requests * repeats} requests")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", type=Path, default=None,
                    help="checkout whose agent/ingest/http/protocol.py to measure (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the trees, alternating")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7, help="best of this many per measure")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:  # one measure, in a fresh interpreter on that tree
        sys.path.insert(0, str(args.child))
        print(asyncio.run(_per_request_us(args.requests, args.repeats)))
        return
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    figures: dict[Path, list[float]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            out = subprocess.run([sys.executable, __file__, "--child", str(tree),
                                  "--requests", str(args.requests), "--repeats",
                                  str(args.repeats)], capture_output=True, text=True,
                                 check=True, timeout=600).stdout
            figures[tree].append(float(out.strip()))
            print(f"round {r + 1}: {tree}: {figures[tree][-1]:.2f} us per request", flush=True)
    for tree, values in figures.items():
        print(f"{tree}: median {statistics.median(values):.2f} us per request "
              f"(best of {args.repeats} x {args.requests} requests, {len(values)} rounds)")


if __name__ == "__main__":
    main()
