"""How fast the host is right now, printed beside every benchmark's figures.

The dev VM's speed varies by a factor of two to three from one day to the next (the same
HTTP code measured 21,000 durable publishes/s one day and 7,000 another), so a figure means
little without the speed of the machine it was taken on. Three numbers that no Ferry code
affects: the time of one iteration of a plain Python loop (the interpreter's speed, which
bounds every Python stage), one send and receive of 200 bytes over a loopback TCP
connection (the kernel's cost per syscall, which bounds the HTTP stage more than Python
does), and the latency of one fdatasync of a 4 KiB write in the buffer's directory (what
each durable commit waits for at least). Compare figures only
between runs whose host line is about the same, or better, interleave the runs.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

LOOP_ITERATIONS = 2_000_000
SYNCS = 100
ROUND_TRIPS = 20_000


def python_loop_ns() -> float:
    """Nanoseconds per iteration of ``for i in range(n): s += i``, best of 3."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        s = 0
        for i in range(LOOP_ITERATIONS):
            s += i
        best = min(best, time.perf_counter() - start)
    return best / LOOP_ITERATIONS * 1e9


def loopback_us() -> float:
    """Microseconds per send + receive of 200 bytes over loopback TCP, best of 3."""
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    data = b"v" * 200
    best = float("inf")
    try:
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(ROUND_TRIPS):
                a.send(data)
                b.recv(4096)
            best = min(best, time.perf_counter() - start)
    finally:
        a.close()
        b.close()
    return best / ROUND_TRIPS * 1e6


def fdatasync_ms(directory: Path) -> float:
    """Median milliseconds of one fdatasync after a 4 KiB write, in ``directory``."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=".ferry-host-speed-")
    try:
        took = []
        block = b"x" * 4096
        for i in range(SYNCS):
            os.pwrite(fd, block, (i % 16) * 4096)
            start = time.perf_counter()
            os.fdatasync(fd)
            took.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(name)
    took.sort()
    return took[len(took) // 2] * 1000


def describe(directory: Path) -> str:
    """One line for a benchmark's output."""
    load = os.getloadavg()[0]
    return (f"host: python loop {python_loop_ns():.0f} ns/iteration, loopback send + "
            f"receive {loopback_us():.1f} us, fdatasync "
            f"{fdatasync_ms(directory):.2f} ms (median) in {directory}, load average "
            f"{load:.1f}")


if __name__ == "__main__":
    print(describe(Path.cwd()))
