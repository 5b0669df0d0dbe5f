"""The GIL switch interval of the ingest process.

The buffer's writer thread gives up the GIL around each LMDB call and its fsync, and must get
it back from a busy source thread (the socket's receive loop, the HTTP event loop) each time.
CPython makes a waiting thread wait up to the switch interval, 5 ms by default, so under load
every group commit, and every message waiting for it, took several of those.

Measured: on the publish benchmark (2 shared vCPUs) 1 ms raised durable publishes from
11-12k to 12-14.5k/s and cut p99 from 15-40 ms to 12-15 ms, and 0.5 ms and below did no
better; on the datagram pipeline benchmark, 2 interleaved pairs, the commit p99 went from
22-28 ms to 19-20 ms, the accepted rate unchanged within noise.
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL = 0.001


def lower_switch_interval(seconds: float | None = SWITCH_INTERVAL) -> None:
    """Process-wide: set the switch interval to ``seconds`` if it is higher now; never raise
    it (someone chose a lower one). None leaves the interpreter's setting alone."""
    if seconds is not None and sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)
