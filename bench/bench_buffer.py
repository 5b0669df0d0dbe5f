"""The buffer alone: space per message by where a topic sorts, restart-to-ready with a
backlog, and the one-time move of a layout-1 buffer. No Kafka.

    .venv/bin/python bench/bench_buffer.py [--messages 1000000] [--size 200] [--agent]

1. Space: ``--messages`` values of ``--size`` bytes to topic ``aaa`` while one message of
   ``zzz`` is buffered, then the same to ``zzz`` beside one ``aaa``; prints LMDB's bytes per
   message (``Store.used_bytes``) and the data file's size for each.
2. Restart: closes the second buffer and times what a start does before it reports ready
   (open the store, read every topic's figures); with ``--agent`` also a real ``ferry run``
   on that buffer (no broker reachable), from exec to ``/status/ready``.
3. Upgrade: writes a layout-1 buffer (``topic NUL id`` in one tree) of the same size and times
   its move to the current layout at open.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)
import lmdb  # noqa: E402

from agent.buffer import codec, keys  # noqa: E402
from agent.buffer.store import Store  # noqa: E402
from agent.records import Record  # noqa: E402

MAX = 64 * 1024**3
BATCH = 10_000


def fill(path: Path, topic: str, other: str, n: int, size: int) -> tuple[float, int]:
    value = b"v" * size
    with Store(path, MAX) as store:
        store.append([[Record(other, b"x")]])
        for start in range(0, n, BATCH):
            store.append([[Record(topic, value) for _ in range(min(BATCH, n - start))]])
        used = store.used_bytes()
    return used / n, (path / "data.mdb").stat().st_size


def restart(path: Path) -> float:
    t0 = time.perf_counter()
    with Store(path, MAX) as store:
        store.topic_stats()
    return time.perf_counter() - t0


def agent_ready(root: Path, path: Path) -> float:
    import httpx

    from tests.agent_harness import AgentProcess, write_config

    cfg = write_config(root, "127.0.0.1:1", buffer={"path": str(path), "max_bytes": MAX})
    agent = AgentProcess(cfg)
    t0 = time.perf_counter()
    with agent:
        while True:
            try:
                if httpx.get(agent.http_url + "/status/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 120:
                raise SystemExit("agent not ready in 120 s")
            time.sleep(0.01)


def legacy(path: Path, n: int, size: int) -> None:
    """Layout 1, as an older Ferry left it: two topics interleaved."""
    path.mkdir(parents=True)
    env = lmdb.open(str(path), map_size=MAX, max_dbs=8)
    messages, meta = env.open_db(b"messages"), env.open_db(b"meta")
    env.open_db(b"state")
    env.open_db(b"tracking")
    value = {t: codec.encode(Record(t, b"v" * size), 0) for t in ("a", "b")}
    seq = 0
    for start in range(0, n, BATCH):
        with env.begin(write=True) as txn:
            for i in range(start, min(start + BATCH, n)):
                t = "ab"[i % 2]
                txn.put(keys.message_key(t, keys.make_id(1_700_000_000_000, seq)), value[t],
                        db=messages)
                seq += 1
            txn.put(b"last_id", keys.make_id(1_700_000_000_000, seq - 1), db=meta)
    with env.begin(write=True) as txn:
        for t in ("a", "b"):
            count = n // 2 + (n % 2 if t == "a" else 0)
            txn.put(b"n:" + t.encode(), count.to_bytes(8, "big") +
                    (count * (14 + len(value[t]))).to_bytes(8, "big"), db=meta)
    env.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--agent", action="store_true", help="also time a real `ferry run`")
    args = ap.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    n, size = args.messages, args.size
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        print(f"machine: {os.cpu_count()} cores; {n:,} messages of {size} B")
        for name, topic, other in (("first", "aaa", "zzz"), ("last", "zzz", "aaa")):
            t0 = time.perf_counter()
            per, file = fill(root / name, topic, other, n, size)
            print(f"space, topic sorting {name}: {per:.0f} bytes per message "
                  f"(file {file / 1024**2:,.0f} MiB; filled in {time.perf_counter() - t0:.1f} s)")
        print(f"restart with {n:,} buffered: store open + topic figures "
              f"{restart(root / 'last') * 1000:.0f} ms")
        if args.agent:
            print(f"restart with {n:,} buffered: `ferry run` to /status/ready "
                  f"{agent_ready(root / 'agent', root / 'last'):.2f} s")
        legacy(root / "legacy", n, size)
        t0 = time.perf_counter()
        Store(root / "legacy", MAX).close()
        took = time.perf_counter() - t0
        print(f"upgrade: layout-1 buffer of {n:,} moved at open in {took:.1f} s "
              f"({n / took:,.0f} msg/s)")


if __name__ == "__main__":
    main()
