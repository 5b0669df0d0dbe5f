"""Spark writer benchmark: ``df.write.format("ferry")`` against ``df.write.json`` and
``df.write.parquet`` on the same rows, without and with headers.

    .venv/bin/python bench/bench_spark_writer.py [--rows 1000000] [--size 200] [--repeat 5]
        [--master local[2]] [--partitions 2] [--shapes plain,headers]

Shapes: ``plain`` (a topic and a ``--size``-byte string value) and ``headers`` (the same plus
one header on every row, ``array<struct<key:string,value:binary>>``: "trace" → 16 bytes).
Each shape's DataFrame is cached, each writer warmed up once (JIT, Python workers), then the
three writes alternate ``--repeat`` times. Prints the best and median time of each and the
ratios ferry / json and ferry / parquet. The target: ferry within 2x of json, headers too.
The ferry output (publish mode "driver", the default) is checked with ``spool.reader.verify``
(every row in a verified file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from pyspark.sql import DataFrame, SparkSession  # noqa: E402

import spark_writer  # noqa: E402
from spool.reader import list_ready_files, verify  # noqa: E402

Writer = Callable[[DataFrame, Path], float]


def frame(spark: SparkSession, rows: int, size: int, partitions: int, headers: bool
          ) -> DataFrame:
    columns = [
        "if(id % 2 = 0, 'clicks', 'orders') AS topic",
        f"rpad(cast(id AS string), {size}, 'x') AS value",
    ]
    if headers:
        columns.append("array(named_struct('key', 'trace', 'value', "
                       "cast(lpad(hex(id), 16, '0') AS binary))) AS headers")
    return spark.range(0, rows, numPartitions=partitions).selectExpr(*columns)


def timed(write: Callable[[], None]) -> float:
    started = time.perf_counter()
    write()
    return time.perf_counter() - started


def write_ferry(df: DataFrame, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    return timed(lambda: df.write.format("ferry").mode("append").save(str(out)))


def write_json(df: DataFrame, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    return timed(lambda: df.write.mode("overwrite").json(str(out)))


def write_parquet(df: DataFrame, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    return timed(lambda: df.write.mode("overwrite").parquet(str(out)))


WRITERS: dict[str, Writer] = {"ferry": write_ferry, "json": write_json,
                              "parquet": write_parquet}


def run_shape(spark: SparkSession, args: argparse.Namespace, headers: bool, tmp: Path
              ) -> dict[str, tuple[list[float], float]]:
    """{writer: (times, MB written)} for one shape."""
    df = frame(spark, args.rows, args.size, args.partitions, headers).cache()
    assert df.count() == args.rows
    warm = frame(spark, 10_000, args.size, args.partitions, headers)
    for name, write in WRITERS.items():
        write(warm, tmp / f"warm-{name}")
    times: dict[str, list[float]] = {name: [] for name in WRITERS}
    for _ in range(args.repeat):
        for name, write in WRITERS.items():
            times[name].append(write(df, tmp / name))
    files = list_ready_files(tmp / "ferry")
    written = sum(verify(path) for path in files)
    if written != args.rows:
        raise SystemExit(f"ferry wrote {written} rows, expected {args.rows}")
    sizes = {
        "ferry": sum(p.stat().st_size for p in files),
        "json": sum(p.stat().st_size for p in (tmp / "json").glob("part-*")),
        "parquet": sum(p.stat().st_size for p in (tmp / "parquet").glob("part-*")),
    }
    df.unpersist()
    return {name: (times[name], sizes[name] / 1e6) for name in WRITERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=200, help="value bytes per row")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--shapes", default="plain,headers")
    args = parser.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    shapes = args.shapes.split(",")

    spark = (
        SparkSession.builder.master(args.master)
        .appName("ferry-bench-spark-writer")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark_writer.register(spark)
    results: dict[str, dict[str, tuple[list[float], float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ferry-bench-spark-") as tmp:
        for shape in shapes:
            if shape not in ("plain", "headers"):
                raise SystemExit(f"unknown shape {shape!r}")
            results[shape] = run_shape(spark, args, shape == "headers", Path(tmp))
    spark.stop()

    print(f"{args.rows:,} rows, {args.size}-byte values, master {args.master}, "
          f"{args.partitions} partitions, {args.repeat} runs each")
    for shape, by_writer in results.items():
        print(f"\n{shape}" + (" (one header on every row)" if shape == "headers" else ""))
        for name, (times, mb) in by_writer.items():
            print(f"  {name:8s} best {min(times):6.2f} s   median {statistics.median(times):6.2f} s"
                  f"   ({args.rows / min(times):,.0f} rows/s, {mb:,.0f} MB)")
        ferry = by_writer["ferry"][0]
        for other in ("json", "parquet"):
            theirs = by_writer[other][0]
            print(f"  ferry / {other}: best {min(ferry) / min(theirs):.2f}x, median "
                  f"{statistics.median(ferry) / statistics.median(theirs):.2f}x"
                  + ("  (target <= 2x)" if other == "json" else ""))


if __name__ == "__main__":
    main()
