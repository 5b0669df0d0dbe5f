"""Spark writer benchmark: ``df.write.format("ferry")`` against ``df.write.json`` on the same rows.

    .venv/bin/python bench/bench_spark_writer.py [--rows 1000000] [--size 200] [--repeat 3]
        [--master local[2]] [--partitions 2]

Builds a DataFrame of ``--rows`` rows (a topic and a ``--size``-byte string value; the same
columns for both writers), caches it, then alternates the two writes ``--repeat`` times after
one warm-up each (JIT, Python workers) and prints the best and median time of each and the
ratio ferry / json. The target: ferry within 2x of json. The ferry output is checked with
``spool.reader.verify`` (every row in a verified file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from pyspark.sql import DataFrame, SparkSession  # noqa: E402

import spark_writer  # noqa: E402
from spool.reader import list_ready_files, verify  # noqa: E402


def frame(spark: SparkSession, rows: int, size: int, partitions: int) -> DataFrame:
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "if(id % 2 = 0, 'clicks', 'orders') AS topic",
        f"rpad(cast(id AS string), {size}, 'x') AS value",
    )


def write_ferry(df: DataFrame, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    started = time.perf_counter()
    df.write.format("ferry").mode("append").save(str(out))
    return time.perf_counter() - started


def write_json(df: DataFrame, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    df.write.mode("overwrite").json(str(out))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=200, help="value bytes per row")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=2)
    args = parser.parse_args()

    spark = (
        SparkSession.builder.master(args.master)
        .appName("ferry-bench-spark-writer")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark_writer.register(spark)
    with tempfile.TemporaryDirectory(prefix="ferry-bench-spark-") as tmp:
        df = frame(spark, args.rows, args.size, args.partitions).cache()
        assert df.count() == args.rows
        warm = frame(spark, 10_000, args.size, args.partitions)
        write_ferry(warm, Path(tmp) / "warm-ferry")
        write_json(warm, Path(tmp) / "warm-json")

        ferry_s: list[float] = []
        json_s: list[float] = []
        for _ in range(args.repeat):
            ferry_s.append(write_ferry(df, Path(tmp) / "ferry"))
            json_s.append(write_json(df, Path(tmp) / "json"))

        files = list_ready_files(Path(tmp) / "ferry")
        written = sum(verify(path) for path in files)
        if written != args.rows:
            raise SystemExit(f"ferry wrote {written} rows, expected {args.rows}")
        ferry_mb = sum(p.stat().st_size for p in files) / 1e6
        json_mb = sum(p.stat().st_size for p in (Path(tmp) / "json").glob("part-*")) / 1e6

    spark.stop()
    print(f"{args.rows:,} rows, {args.size}-byte values, master {args.master}, "
          f"{args.partitions} partitions, {args.repeat} runs each")
    for name, times, mb in (("ferry", ferry_s, ferry_mb), ("json", json_s, json_mb)):
        print(f"{name:6s} best {min(times):6.2f} s   median {statistics.median(times):6.2f} s   "
              f"({args.rows / min(times):,.0f} rows/s, {mb:,.0f} MB)")
    print(f"ferry / json: best {min(ferry_s) / min(json_s):.2f}x, "
          f"median {statistics.median(ferry_s) / statistics.median(json_s):.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
