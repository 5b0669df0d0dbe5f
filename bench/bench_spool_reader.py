"""Spool reader benchmark: how fast a binary spool file is checked and decoded.

    .venv/bin/python bench/bench_spool_reader.py [--records 1000000] [--size 200] [--repeat 3]

Writes one spool file of ``--records`` records with ``--size``-byte values (four topics, a key
on every other record, like a Spark job's output) to a temporary directory, then times, best
of ``--repeat``:

- verify:        ``verify(path)``, every block CRC plus the trailer; what the agent runs first
- decode:        ``iter_records(verify_first=False)``, every record built and yielded
- read:          ``iter_records()`` (the default: verify, then decode through the same fd)
- deep verify:   ``verify(path, deep=True)``, every record decoded but not kept

and prints records/s and MB/s for each, then the peak Python memory (tracemalloc) of one more
``read``: it stays at about one block of records, whatever the file size. The target: ``read``
>= 300,000 records/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)

from spool.format import encode_columns  # noqa: E402
from spool.reader import BinarySpoolReader, verify  # noqa: E402
from spool.writer import SpoolWriter  # noqa: E402

TOPICS = ["clicks", "orders", "page-views", "payments.v2"]


def write_file(directory: Path, records: int, size: int) -> tuple[Path, float]:
    batch = 10_000
    values = [os.urandom(size) for _ in range(256)]
    started = time.perf_counter()
    with SpoolWriter(directory, "bench.ferry") as writer:
        for first in range(0, records, batch):
            n = min(batch, records - first)
            rows = range(first, first + n)
            for body, count in encode_columns(
                [TOPICS[i % 4] for i in rows],
                [values[i % 256] for i in rows],
                [str(i).encode() if i % 2 else None for i in rows],
                None,
                1_700_000_000_000,
            ):
                writer.write_block(body, count)
    return writer.path, time.perf_counter() - started


def count_decoded(path: Path, verify_first: bool) -> int:
    n = 0
    for _index, _record in BinarySpoolReader(path).iter_records(verify_first=verify_first):
        n += 1
    return n


def best_of(repeat: int, run: Callable[[], int], expected: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        got = run()
        elapsed = time.perf_counter() - started
        if got != expected:
            raise SystemExit(f"read {got} records, expected {expected}")
        best = min(best, elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=200, help="value bytes per record")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)

    with tempfile.TemporaryDirectory(prefix="ferry-bench-spool-") as tmp:
        path, write_s = write_file(Path(tmp), args.records, args.size)
        size_mb = path.stat().st_size / 1e6
        print(
            f"file: {args.records:,} records, {args.size}-byte values, {size_mb:,.1f} MB; "
            f"written in {write_s:.2f} s ({args.records / write_s:,.0f} records/s)"
        )
        runs: list[tuple[str, Callable[[], int]]] = [
            ("verify", lambda: verify(path)),
            ("decode", lambda: count_decoded(path, verify_first=False)),
            ("read (verify + decode)", lambda: count_decoded(path, verify_first=True)),
            ("deep verify", lambda: verify(path, deep=True)),
        ]
        for name, run in runs:
            seconds = best_of(args.repeat, run, args.records)
            print(
                f"{name:24s} {seconds:6.3f} s  {args.records / seconds:>12,.0f} records/s  "
                f"{size_mb / seconds:8,.0f} MB/s"
            )
        tracemalloc.start()
        count_decoded(path, verify_first=True)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"peak Python memory while reading the {size_mb:,.0f} MB file: {peak / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
