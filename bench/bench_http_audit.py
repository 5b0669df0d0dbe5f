"""Issue #37: what the audit's bad bodies cost the rest of the agent (in-process HTTP stage).

For each case: the process's CPU (rusage), the worst wait of a probe on another connection
(``GET /status/ping`` in a loop) and the growth of peak RSS. Run from the repository root:
``.venv/bin/python bench/bench_http_audit.py``.
"""

from __future__ import annotations

import gzip
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")

from tests.http.harness import Served, make_config, start  # noqa: E402
from tests.http.raw import status as _status  # noqa: E402
from tests.http.test_resources import _exchange, _Probe  # noqa: E402


def _peak_rss_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) // 1024
    return 0


def _post(path: bytes, body: bytes, *headers: bytes) -> bytes:
    head = b"\r\n".join([b"POST " + path + b" HTTP/1.1", b"Host: x", *headers,
                         b"Content-Length: %d" % len(body)])
    return head + b"\r\n\r\n" + body


def _case(served: Served, name: str, request: bytes) -> None:
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    peak, start_at = _peak_rss_mib(), time.monotonic()
    with _Probe(served) as probe:
        answer = _exchange(served, request)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    print(f"{name}: status {_status(answer)}, wall {time.monotonic() - start_at:.2f} s, "
          f"process CPU {cpu:.2f} s, probe worst {probe.worst * 1000:.1f} ms over "
          f"{probe.pings} pings, peak RSS +{_peak_rss_mib() - peak} MiB", flush=True)


def main() -> None:
    served = start(make_config(Path(tempfile.mkdtemp())))
    try:
        empty = gzip.compress(b"")
        gz, ndjson, json_ = (b"Content-Encoding: gzip", b"Content-Type: application/x-ndjson",
                             b"Content-Type: application/json")
        body = empty * (4 * 1024 * 1024 // len(empty)) + gzip.compress(b"one\ntwo\n")
        _case(served, "N1 4 MiB of empty gzip members",
              _post(b"/topics/m/batch", body, gz, ndjson))
        _case(served, "N1 45,000 empty members (<1 MB)",
              _post(b"/topics/m", empty * 45_000, gz))
        body = b"[" + b",".join([b"1"] * 2_100_000) + b"]"
        _case(served, "N6 4 MiB JSON array of 2.1 M messages",
              _post(b"/topics/j/batch", body, json_))
        items = [b'{"n":%d,"pad":"pppppppppppppppppppp"}' % i for i in range(10_000)]
        _case(served, "10,000-message JSON batch (stored)",
              _post(b"/topics/k/batch", b"[" + b",".join(items) + b"]", json_))
    finally:
        served.stop()


if __name__ == "__main__":
    main()
