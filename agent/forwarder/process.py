"""The forwarder's own process: it shares the LMDB environment, not the ingest's GIL.

The ingest process starts it (multiprocessing, spawn) with the configuration and one end of
a pipe; over the pipe it sends metric snapshots a few times a second, and it stops when told
to (or when the pipe closes, i.e. its parent died).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from agent.buffer.store import Store
from agent.config import FerryConfig, TopicConfig
from agent.forwarder.forwarder import Forwarder
from agent.metrics import REGISTRY
from agent.process.gc_tuning import freeze_startup_heap
from agent.process.logs import setup_logging
from agent.topics import TopicCatalog

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL = 0.25
# The young-generation GC threshold of this process (agent/process/gc_tuning.py). The
# forwarder makes a few container objects per message and holds tens of thousands in
# flight; with CPython's defaults the collector's walks took ~20 % of its thread.
# bench_forwarder.py (300,000 messages, 2 vCPUs): 16.1 us per message with the defaults, 12.8
# with the startup heap frozen and 10,000, 12.4 with 50,000 (collections: 3,260 -> 159 -> 3).
GC_GEN0_THRESHOLD = 50_000


def main(config_data: dict[str, Any], conn: Connection) -> None:
    config = FerryConfig.model_validate(config_data)
    setup_logging(config.log_level, process="forwarder")
    # `kill -USR1 <pid>` prints every thread's stack to the journal: for a stuck forwarder.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The parent handles SIGINT/SIGTERM and tells us to stop over the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop = threading.Event()
    store = Store(config.buffer.path, config.buffer.max_bytes,
                  track=config.status.track_messages, track_seconds=config.status.track_seconds,
                  reserve_bytes=config.buffer.reserve_bytes,
                  preallocate=config.buffer.preallocate)
    forwarder = Forwarder(config, store, topic_settings=_topic_settings(config, store))

    def talk() -> None:
        while not stop.is_set():
            try:
                if conn.poll(SNAPSHOT_INTERVAL):
                    msg = conn.recv()
                    if msg == "stop":
                        stop.set()
                conn.send(("metrics", REGISTRY.snapshot()))
            except (EOFError, OSError):
                log.warning("lost the parent process; stopping")
                stop.set()
        with contextlib.suppress(EOFError, OSError):
            conn.send(("metrics", REGISTRY.snapshot()))

    talker = threading.Thread(target=talk, name="forwarder-pipe", daemon=True)
    talker.start()
    freeze_startup_heap(GC_GEN0_THRESHOLD)
    log.info("forwarder started")
    try:
        forwarder.run(stop.is_set)
    finally:
        store.close()
        talker.join(2.0)
        try:
            conn.send(("metrics", REGISTRY.snapshot()))
            conn.send(("stopped", time.time()))
        except (EOFError, OSError):
            pass
        log.info("forwarder stopped")
    # Everything that matters is in LMDB (closed above). Skip interpreter teardown: tearing
    # down librdkafka handles during finalisation was seen to hang the exit now and then.
    # (No logging.shutdown(): it takes handler locks a librdkafka thread may hold.)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(0)


def _topic_settings(config: FerryConfig, store: Store) -> Callable[[str], TopicConfig]:
    """Per-topic settings: API-managed topics (HTTP management) override the config file's."""
    return TopicCatalog(config, store).settings
