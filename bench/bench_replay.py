"""`ferry replay` benchmark: lines per second put back, and skipped on a second run.

    .venv/bin/python bench/bench_replay.py [--lines 60000] [--size 200] [--repeat 1]

Writes a discard log of ``--lines`` lines (``--size``-byte values, one topic, as the forwarder
writes them) with the real ``DiscardLog``, then runs ``ferry replay`` on it twice in this
process against a fresh buffer under a temporary directory: the first run puts every line
back, the second finds every line already put back. Prints lines/s of each (best of
``--repeat`` fresh buffers). Run from another checkout's root to compare with older code: the
script imports Ferry from the directory above it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.buffer import keys  # noqa: E402
from agent.cli.main import main  # noqa: E402
from agent.forwarder.discard_log import Discard, DiscardLog  # noqa: E402
from agent.records import Record  # noqa: E402


def write_log(path: Path, lines: int, size: int) -> None:
    log = DiscardLog(path)
    value = b"x" * size
    for first in range(0, lines, 10_000):
        log.write([Discard("ttl", "orders", keys.id_text(keys.make_id(1_700_000_000_000, i)),
                           1_700_000_000_000, Record("orders", value, key=b"k", timestamp_ms=i))
                   for i in range(first, min(lines, first + 10_000))])


def run_twice(root: Path, log: Path) -> tuple[float, float, str]:
    cfg = root / "ferry.toml"
    cfg.write_text(f'[buffer]\npath = "{root / "buffer"}"\nmax_bytes = {1 << 32}\n'
                   '[socket]\npath = ""\n[http]\nlisten = ""\n')
    times = []
    out = io.StringIO()
    for _ in range(2):
        started = time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = main(["replay", str(log), "--config", str(cfg)])
        times.append(time.perf_counter() - started)
        if code != 0:
            raise SystemExit(f"ferry replay failed: exit {code}")
    shutil.rmtree(root / "buffer")
    return times[0], times[1], out.getvalue().strip().splitlines()[-1]


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=60_000)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        log = root / "discards.jsonl"
        write_log(log, args.lines, args.size)
        runs = [run_twice(root, log) for _ in range(args.repeat)]
    first = min(r[0] for r in runs)
    second = min(r[1] for r in runs)
    print(f"{args.lines} lines of {args.size}-byte values, best of {args.repeat}:")
    print(f"  first run (all put back):    {args.lines / first:10,.0f} lines/s ({first:.2f} s)")
    print(f"  second run (same file again): {args.lines / second:10,.0f} lines/s "
          f"({second:.2f} s)")
    print(f"  second run said: {runs[-1][2]}")


if __name__ == "__main__":
    main_()
