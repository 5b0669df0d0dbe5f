"""A connection flood against a whole agent with a default service's descriptor limit (1,024):
2,000 idle connections, then 1,000 that are answered before their body (or wait for one
that never comes). A new publish is still answered at once, and the spool intake,
which needs descriptors of the same process, keeps working (issue 18)."""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spool.format import SpoolRecord
from spool.writer import write_spool_file
from tests.agent_harness import write_config
from tests.kafka import Broker, read_topic
from tests.reliability.harness import Agent
from tests.waiting import wait_until

NOFILE = 1024  # a service's default (the unit raises it: packaging/ferry.service)
IDLE = 2000
EARLY = 1000


@pytest.fixture
def open_files() -> Iterator[None]:
    """The test process holds 3,000+ sockets: raise its own soft descriptor limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + EARLY + 512
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.fail(f"the test needs {want} descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect(host: str, port: int) -> socket.socket:
    return socket.create_connection((host, port), timeout=10)


def test_a_flood_of_idle_and_early_answered_connections_starves_nothing(
    tmp_path: Path, session_broker: Broker, unique_topic: str, open_files: None
) -> None:
    config = write_config(tmp_path / "agent", session_broker.bootstrap, spool=True)
    conns: list[socket.socket] = []
    with Agent(config, nofile=NOFILE) as agent:
        host, port = agent.config.http.host, agent.config.http.port
        spool_dir = Path(agent.config.spool.dirs[0])
        try:
            for _ in range(IDLE):
                conns.append(_connect(host, port))
            for i in range(EARLY):
                sock = _connect(host, port)
                conns.append(sock)
                if i % 2:  # refused at once (413), the body never sent
                    sock.sendall(f"POST /topics/{unique_topic} HTTP/1.1\r\nHost: x\r\n"
                                 "Content-Length: 999999999\r\n\r\n".encode())
                else:  # a probe declaring a body it never sends
                    sock.sendall(b"GET /status/ping HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: 1000\r\n\r\n")
            started = time.monotonic()
            with _connect(host, port) as sock:
                connected = time.monotonic() - started
                sock.sendall(f"POST /topics/{unique_topic} HTTP/1.1\r\nHost: x\r\n"
                             "Content-Length: 3\r\n\r\nnew".encode())
                answer = sock.recv(65536)
            took = time.monotonic() - started
            print(f"connected after {connected:.3f} s, answered after {took:.3f} s")
            assert answer.split(b" ", 2)[1] in (b"201", b"202"), answer
            # The target is 1 s (issue 18; measured 0.2-1.5 s on the shared 2-vCPU test host,
            # most of it the server accepting the 3,000 connections queued ahead of this
            # one, and 3.2 s once with both parts of the suite and another job on its two
            # cores). A timed test must not fail on a loaded host, so it asserts the defect's
            # absence: before the cap, new clients got nothing for about 10 s.
            assert took < 7.0, f"a publish during the flood took {took:.2f} s"
            # The spool intake opens files in the same process: it must still find
            # descriptors.
            write_spool_file(spool_dir, "flood.ferry",
                             [SpoolRecord(unique_topic, b"spooled")])
            wait_until(lambda: {b"new", b"spooled"} <= {m.value for m in read_topic(
                session_broker.bootstrap, unique_topic)}, timeout=30, interval=0.5,
                message="the publish and the spool file delivered during the flood")
            assert agent.alive
        finally:
            for sock in conns:
                sock.close()
