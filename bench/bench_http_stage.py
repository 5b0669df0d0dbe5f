"""The HTTP stage without sockets: CPU and Python bytecodes per 202 publish.

Fifty connections (``HttpProtocol`` with stand-in transports) each send one 200-byte publish
per round to the real ``Publisher``, ``Committer`` and LMDB buffer (fsynced, in ``--dir``), and
a round ends when all fifty are answered. With no sockets, no wrk and no broker, the figure is
the stage's own work: per thread (the event loop, the buffer writer) from /proc, and, with
``--count``, the Python bytecodes each publish executes (a tracer counts them; deterministic,
so it shows a change the host's noise would hide, but it slows the run down a hundredfold).

``--tree DIR`` (repeatable) measures another checkout (an old commit in a worktree) with this
interpreter, alternating with the others, as ``bench_http_protocol.py`` does:

    .venv/bin/python bench/bench_http_stage.py --tree /tmp/old --tree . --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_http_protocol import REQUEST, StandInTransport  # noqa: E402  (bench/, this script's own)

CONNECTIONS = 50


class _Answers:
    """Counts the answers the stand-in transports write; ``done`` when a round is answered."""

    def __init__(self) -> None:
        self.written = 0
        self.expected = 0
        self.done = asyncio.Event()

    def expect(self, n: int) -> None:
        self.expected += n
        self.done = asyncio.Event()

    def wrote(self) -> None:
        self.written += 1
        if self.written >= self.expected:
            self.done.set()


class _Bytecodes:
    """A tracer counting the bytecodes executed, per function, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.total = 0
        self.by_function: collections.Counter[str] = collections.Counter()
        self.by_thread: collections.Counter[str] = collections.Counter()

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.on:
            return None if event == "call" else self.trace
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            self.total += 1
            self.by_thread[threading.current_thread().name] += 1
            code = frame.f_code
            self.by_function[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return self.trace


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) per thread name of this process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def _measure(root: Path, rounds: int, count: bool) -> dict[str, Any]:
    from agent.buffer.committer import Committer
    from agent.buffer.store import Store
    from agent.config import FerryConfig
    from agent.ingest.http import protocol
    from agent.ingest.http.app import create_app
    from agent.metrics import Registry

    try:
        from agent.ingest.runtime import Phase, Runtime
    except ImportError:  # a tree from before issue #30's layout
        from agent.runtime import Phase, Runtime  # type: ignore[no-redef]

    bytecodes = _Bytecodes()
    if count:
        sys.settrace(bytecodes.trace)
        threading.settrace(bytecodes.trace)  # the writer thread, started below
    cfg = FerryConfig.model_validate({
        "buffer": {"path": str(root / "buffer"), "max_bytes": 8 * 1024**3},
        "socket": {"path": ""}, "http": {"listen": "127.0.0.1:0"},
        "topics": {"default": {"ack_timeout_ms": 0}}})
    store = Store(cfg.buffer.path, cfg.buffer.max_bytes)
    registry = Registry()
    committer = Committer(store, registry=registry,
                          max_batch_messages=cfg.buffer.commit_max_messages,
                          linger_ms=cfg.buffer.commit_interval_ms)
    committer.start()
    runtime = Runtime(cfg, store, committer, registry)
    publisher = create_app(runtime).publisher
    runtime.set_phase(Phase.RUNNING)
    limits = protocol.Limits(request_line=8192, header_bytes=16384, headers=100,
                             header_timeout=10, body_timeout=10, keep_alive=60)
    connections, date, answers = protocol.Connections(1000), protocol.DateHeader(), _Answers()
    # The publish entry: ``publish``, or ``direct`` in a tree from before it had one entry.
    publish = getattr(publisher, "publish", None) or publisher.direct
    conns = []
    for _ in range(CONNECTIONS):
        conn = protocol.HttpProtocol(
            limits=limits, connections=connections, date=date, publish=publish,
            body_limit=publisher.body_limit, too_large=publisher.too_large,
            refused=publisher.refused_early, gone=publisher.gone, asgi=lambda *a: None,
            read_limit=publisher.max_batch_bytes)
        conn.connection_made(StandInTransport(answers.wrote))
        conns.append(conn)

    async def run(n: int) -> None:
        for _ in range(n):
            answers.expect(CONNECTIONS)
            for conn in conns:
                conn.data_received(REQUEST)
            await answers.done.wait()

    await run(50)  # warm: imports, first commits, caches
    commits_before = registry.view().total("buffer_commits")
    cpu_before, wall_before = _thread_cpu(), time.perf_counter()
    bytecodes.on = count
    await run(rounds)
    bytecodes.on = False
    wall, cpu_after = time.perf_counter() - wall_before, _thread_cpu()
    sys.settrace(None)
    threading.settrace(None)
    committer.close()
    store.close()
    n = rounds * CONNECTIONS
    per_thread = {name: round((t - cpu_before.get(name, 0.0)) / n * 1e6, 1)
                  for name, t in cpu_after.items() if t - cpu_before.get(name, 0.0) > 0}
    out: dict[str, Any] = {
        "publishes": n,
        "commits": registry.view().total("buffer_commits") - commits_before,
        "publishes_per_s_wall": round(n / wall),
        "cpu_us_per_publish": round(sum(per_thread.values()), 1),
        "thread_cpu_us_per_publish": per_thread,
    }
    if count:
        out["bytecodes_per_publish"] = round(bytecodes.total / n)
        out["bytecodes_per_publish_by_thread"] = {
            name: round(ops / n) for name, ops in bytecodes.by_thread.items()}
        out["top_functions"] = {name: round(ops / n, 1)
                                for name, ops in bytecodes.by_function.most_common(15)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", type=Path, default=None,
                    help="checkout to measure (repeatable: alternated, old against new)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the trees")
    ap.add_argument("--publish-rounds", type=int, default=2000,
                    help="rounds of 50 publishes per measure (--count: 100 is plenty)")
    ap.add_argument("--count", action="store_true",
                    help="count the Python bytecodes per publish (slow; deterministic)")
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="where the buffer lives (its disk decides the fsync cost)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:  # one measure, in a fresh interpreter on that tree
        sys.path.insert(0, str(args.child))
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            print(json.dumps(asyncio.run(_measure(Path(tmp), args.publish_rounds,
                                                  args.count))))
        return
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parent.parent])]
    figures: dict[Path, list[dict[str, Any]]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            cmd = [sys.executable, __file__, "--child", str(tree), "--publish-rounds",
                   str(args.publish_rounds), "--dir", str(args.dir)]
            if args.count:
                cmd.append("--count")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 timeout=1800).stdout
            result = json.loads(out)
            figures[tree].append(result)
            print(f"round {r + 1}: {tree}: {json.dumps(result)}", flush=True)
    for tree, results in figures.items():
        cpu = statistics.median(x["cpu_us_per_publish"] for x in results)
        line = f"{tree}: median {cpu:.1f} us CPU per publish ({len(results)} rounds)"
        if args.count:
            line += (f", {statistics.median(x['bytecodes_per_publish'] for x in results):.0f}"
                     " bytecodes per publish")
        print(line)


if __name__ == "__main__":
    main()
