"""Spool intake into the buffer: binary spool files -> SpoolIntake -> durable LMDB commits.

    .venv/bin/python bench/bench_spool_intake.py [--records 1000000] [--files 4] [--size 200]
        [--topics 1] [--headers] [--kafka-limits]

``--topics N`` spreads the records round robin over N topics (the worst case for the bulk
path's runs of one topic); ``--headers`` gives every record a header (the record-at-a-time
fallback); ``--kafka-limits`` publishes limits for every topic first, as the forwarder does
once it knows them (Kafka 4's defaults: max.message.bytes 1048588, after.max.ms 1 h), so
each record is compared with them (none is refused).

No Kafka: this measures the ingest half (claim + read + verify and fingerprint + convert +
commit with progress). Prints records/s from the first scan to the last file finished, the
buffer's count, and the process's CPU time per record (user + system, every thread): on a
shared machine the CPU figure moves far less than the rate.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402  (bench/, the script's own directory)

from agent.buffer.committer import Committer  # noqa: E402
from agent.buffer.store import Store  # noqa: E402
from agent.config import BufferConfig, FerryConfig, SpoolConfig  # noqa: E402
from agent.ingest.runtime import Runtime  # noqa: E402
from agent.ingest.spool_intake import SpoolIntake  # noqa: E402
from agent.metrics import Registry  # noqa: E402
from agent.signals.limits import Limit, LimitsPublisher  # noqa: E402
from agent.signals.limits import file_path as limits_file_path  # noqa: E402
from spool.format import SpoolRecord  # noqa: E402
from spool.writer import SpoolWriter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--topics", type=int, default=1)
    ap.add_argument("--headers", action="store_true")
    ap.add_argument("--kafka-limits", action="store_true")
    args = ap.parse_args()
    # Before any load: how fast this host is now (bench/hostspeed.py).
    print(hostspeed.describe(Path(tempfile.gettempdir())), flush=True)
    with tempfile.TemporaryDirectory(prefix="ferry-bench-intake-") as tmp:
        root = Path(tmp)
        staging = root / "staging"
        staging.mkdir()
        per = args.records // args.files
        value = b"v" * args.size
        topics = [f"bench-{t}" if args.topics > 1 else "bench" for t in range(args.topics)]
        headers = (("trace-id", b"0123456789abcdef"),) if args.headers else ()
        for i in range(args.files):
            with SpoolWriter(staging, f"bench-{i}.ferry") as w:
                w.write_many(SpoolRecord(topics[n % len(topics)], value, headers=headers)
                             for n in range(per))
        config = FerryConfig(buffer=BufferConfig(path=root / "buffer", max_bytes=8 * 1024**3),
                             spool=SpoolConfig(dirs=[root / "spool"]))
        registry = Registry()
        store = Store(config.buffer.path, config.buffer.max_bytes, track=False)
        committer = Committer(store, registry=registry)
        committer.start()
        intake = SpoolIntake(Runtime(config, store, committer, registry))
        if args.kafka_limits:
            LimitsPublisher(limits_file_path(config.buffer.path), "lz4").publish(
                {t: Limit(1_048_588, None, 3_600_000) for t in topics})
        (root / "spool").mkdir()
        for f in staging.iterdir():
            f.rename(root / "spool" / f.name)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        finished = intake.scan_once()
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        total = sum(s.messages for s in store.topic_stats())
        commits = registry.view().total("buffer_commits")
        committer.close()
        store.close()
        print(f"files: {finished}/{args.files}; records in the buffer: {total} of "
              f"{per * args.files}; commits: {commits:.0f}")
        print(f"spool intake: {total / dt:,.0f} records/s ({dt:.2f} s, {args.size}-byte values)")
        print(f"CPU: {cpu / max(total, 1) * 1e6:.2f} us per record ({cpu:.2f} s user + system)")


if __name__ == "__main__":
    main()
