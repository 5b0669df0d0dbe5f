"""Issue 23: a full *filesystem* never wedges the buffer.

The buffer sits on a real 48 MiB tmpfs with ``max_bytes`` = 1 GiB, so the filesystem is what
runs out, not the buffer's limit. LMDB copies on write: a delete needs free pages, and on a
filesystem with none, the forwarder could not drain the buffer once Kafka came back (the
issue's agent delivered nothing in 90 s and logged a failure 23 times a second). With the
file allocated ahead of use and a reserve that new messages never take (agent/buffer/
space.py), the agent must, by itself: refuse input clearly while full (counted disk_full,
HTTP 503), drain to empty as soon as Kafka takes messages, accept again, be healthy again,
lose nothing it accepted, and log each change of state once rather than per attempt.

Two ways to fill it: Ferry's own messages, and another program's file (then deleted).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferry_client import FerryClient
from tests.agent_harness import REPO_ROOT, write_config
from tests.filesystems import tmpfs
from tests.kafka import Broker
from tests.reliability.harness import Agent, metric_total, read_values
from tests.waiting import wait_until

# In the suite's waiting part (tests/conftest.py): each case waits on an agent that fills a
# disk and drains it, like the outage cases.
pytestmark = pytest.mark.waiting

MB = 1024 * 1024
VALUE = 200  # bytes per datagram, as in the issue
ROUND = 2000  # datagrams sent before waiting for the agent to have handled them
# Log lines about the buffer's space and the forwarder's deletes, each logged once per change
# of state: refusals start/end, the file cannot grow/can again, deletes fail/work again.
STATE_LINES = re.compile(r"refuses new messages|accepts new messages again|filesystem of the "
                         r"buffer|removing messages from the buffer|writing the discard log")


@pytest.fixture
def disk48(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs for this test (the tests run as root), the issue's filesystem size."""
    with tmpfs(tmp_path / "disk48", 48) as mnt:
        yield mnt


class Sender:
    """Numbered datagrams to one topic, in rounds, each round handled before the next."""

    def __init__(self, agent: Agent, topic: str) -> None:
        self.agent = agent
        self.topic = topic
        self.sent = 0

    def counters(self) -> tuple[int, int]:
        """(accepted, refused for lack of space) of this topic's socket source so far."""
        c = self.agent.counters()
        accepted = int(metric_total(c, "messages_accepted", source="socket", topic=self.topic))
        refused = int(metric_total(c, "messages_rejected", source="socket"))
        return accepted, refused

    def round(self, n: int = ROUND) -> tuple[int, int]:
        with FerryClient(self.agent.socket_path, timeout=10) as client:
            for _ in range(n):
                client.send(self.topic, b"%09d-" % self.sent + b"v" * (VALUE - 10))
                self.sent += 1
        # Stored or refused, every one: nothing may still wait in the writer's queue.
        def handled() -> tuple[int, int] | None:
            accepted, refused = self.counters()
            return (accepted, refused) if accepted + refused == self.sent else None

        done = wait_until(handled, timeout=60, interval=0.1,
                          message=f"{self.sent} datagrams stored or refused")
        assert done is not None
        return done

    def until_refused(self, limit: int = 400) -> tuple[int, int]:
        """Rounds until the agent refuses a whole round (disk_full); (accepted, refused)."""
        accepted = -1
        for _ in range(limit):
            before = accepted
            accepted, refused = self.round()
            if accepted == before:
                disk = metric_total(self.agent.counters(), "messages_rejected",
                                    source="socket", reason="disk_full")
                assert disk == refused, f"refused {refused}, of which disk_full {disk}"
                return accepted, refused
        raise AssertionError(f"{self.sent} datagrams of {VALUE} B never filled 48 MiB")


def _config(tmp_path: Path, disk: Path, bootstrap: str) -> Path:
    return write_config(tmp_path / "agent", bootstrap, spool=False,
                        buffer={"path": disk / "buffer", "max_bytes": 1024 * MB,
                                "reserve_bytes": 8 * MB},
                        topics={"default": {"ack_timeout_ms": 0}})


def _health(client: httpx.Client, agent: Agent) -> dict[str, object]:
    doc: dict[str, object] = client.get(f"{agent.http_url}/status/all").json()["health"]
    return doc


def _refused_over_http(client: httpx.Client, agent: Agent, topic: str, acked: set[bytes]
                       ) -> None:
    """POSTs of 1 KiB to ``topic`` until one is refused: 503 disk_full with Retry-After
    (a small message may still fit where the datagrams' bigger groups did not). The
    acknowledged ones go into ``acked``. Readiness and health say so too."""
    for _ in range(2000):
        value = b"http-%06d-" % len(acked) + b"h" * 1000
        r = client.post(f"{agent.http_url}/topics/{topic}", content=value)
        if r.status_code != 202:
            break
        acked.add(value)
    else:
        raise AssertionError("2000 POSTs of 1 KiB accepted on a full filesystem")
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "disk_full", r.text
    assert int(r.headers["Retry-After"]) >= 1
    ready = client.get(f"{agent.http_url}/status/ready")
    assert ready.status_code == 503, ready.text
    # Why, as an operator needs it: the filesystem, not the buffer's own max_bytes.
    assert ready.json()["reason"] == "disk_full", ready.text
    assert "filesystem" in ready.json()["message"]
    assert _health(client, agent)["status"] == "critical"


def _recovered(client: httpx.Client, agent: Agent, sender: Sender) -> int:
    """Kafka has taken everything: the buffer drains to empty by itself, new datagrams are
    all accepted, readiness and health are back; returns how many were accepted in all."""
    wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=180, interval=0.5,
               message="the buffer drained to empty once Kafka is back")

    def whole_round_accepted() -> bool:
        # (Right after the drain a commit may still be refused: LMDB reuses a freed page
        # only once no transaction can see it any more.)
        before = sender.counters()[0]
        return sender.round()[0] - before == ROUND

    wait_until(whole_round_accepted, timeout=60, interval=0.2,
               message="a whole round of datagrams accepted again after the drain")
    accepted = sender.counters()[0]
    wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
               message="drained again")
    wait_until(lambda: client.get(f"{agent.http_url}/status/ready").status_code == 200,
               timeout=30, interval=0.2, message="/status/ready back to 200")
    wait_until(lambda: _health(client, agent)["status"] == "ok", timeout=30, interval=0.2,
               message=f"health back to ok (last: {_health(client, agent)})")
    return accepted


def _state_lines(agent: Agent) -> list[str]:
    return [line for line in agent.log_path.read_text(errors="replace").splitlines()
            if STATE_LINES.search(line)]


def _assert_nothing_lost(broker: Broker, topic: str, sender: Sender, accepted: int,
                         acked: set[bytes]) -> None:
    http = read_values(broker.bootstrap, topic + "-http", timeout=60)
    assert acked <= set(http), f"{len(acked - set(http))} acknowledged HTTP messages lost"
    got = read_values(broker.bootstrap, topic, timeout=300)
    sent = {b"%09d-" % i + b"v" * (VALUE - 10) for i in range(sender.sent)}
    assert set(got) <= sent, "values in Kafka that were never sent"
    # Datagrams carry no acknowledgement: every one the agent counted as accepted must be
    # in Kafka (at least once), and none it refused.
    assert len(got) == accepted, f"{accepted} accepted, {len(got)} distinct in Kafka"


def test_filled_by_its_own_messages_drains_and_accepts_again_by_itself(
    tmp_path: Path, disk48: Path, broker: Broker
) -> None:
    topic = "full-fs-own"
    config = _config(tmp_path, disk48, broker.bootstrap)
    broker.stop()  # Kafka away: the buffer only grows, until the filesystem is full
    with Agent(config) as agent, httpx.Client(timeout=10) as client:
        sender = Sender(agent, topic)
        accepted, refused = sender.until_refused()
        assert accepted > 100_000, f"only {accepted} messages of {VALUE} B fit in 48 MiB"
        acked: set[bytes] = set()
        _refused_over_http(client, agent, topic + "-http", acked)
        # More load while full: still refused, counted, and not logged per attempt.
        for _ in range(5):
            sender.round()
        broker.start()
        accepted = _recovered(client, agent, sender)
        lines = _state_lines(agent)
        assert agent.alive
    _assert_nothing_lost(broker, topic, sender, accepted, acked)
    # refusals start and end, the file cannot grow (and, as the drain frees pages inside it,
    # need not): a handful of lines, not one per refused datagram or failed delete.
    assert 2 <= len(lines) <= 8, "\n".join(lines)
    assert not [line for line in lines if "removing messages" in line], "\n".join(lines)


def test_filled_by_another_file_drains_accepts_again_and_recovers_when_it_is_freed(
    tmp_path: Path, disk48: Path, broker: Broker
) -> None:
    topic = "full-fs-other"
    config = _config(tmp_path, disk48, broker.bootstrap)
    broker.stop()
    filler = disk48 / "other-program.log"
    with Agent(config) as agent, httpx.Client(timeout=10) as client:
        sender = Sender(agent, topic)
        for _ in range(10):  # 20,000 messages (~5 MB) buffered before the disk fills
            sender.round()
        # Another program fills the filesystem to the last block while Ferry runs.
        with filler.open("wb", buffering=0) as f:
            chunk = b"\0" * MB
            try:
                for _ in range(64):
                    f.write(chunk)
            except OSError:
                pass
            try:
                for _ in range(MB // 4096):
                    f.write(chunk[:4096])
            except OSError:
                pass
        free = subprocess.run(["df", "--output=avail", "-B1", str(disk48)], check=True,
                              capture_output=True, text=True).stdout.split()[-1]
        assert int(free) < MB, f"{free} bytes still free"
        accepted, refused = sender.until_refused()
        acked: set[bytes] = set()
        _refused_over_http(client, agent, topic + "-http", acked)
        # Kafka back, the other file still there: the buffer drains into the pages it owns
        # and takes new messages into them.
        broker.start()
        accepted = _recovered(client, agent, sender)
        assert filler.exists()
        # The other program's file goes: the buffer can grow again.
        refused = sender.counters()[1]
        filler.unlink()
        for _ in range(5):
            accepted, refused_now = sender.round()
        assert refused_now == refused, "refused after the filesystem was freed"
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=60, interval=0.2,
                   message="drained")
        lines = _state_lines(agent)
        assert agent.alive
    _assert_nothing_lost(broker, topic, sender, accepted, acked)
    assert 2 <= len(lines) <= 8, "\n".join(lines)
    assert not [line for line in lines if "removing messages" in line], "\n".join(lines)


def test_start_up_without_room_for_the_reserve_fails_with_a_clear_message(
    tmp_path: Path, disk48: Path
) -> None:
    """Fail-fast, not degraded: a buffer without its reserve is the one that can wedge."""
    filler = disk48 / "other-program.log"  # leaves 4 MiB: less than the reserve
    subprocess.run(["fallocate", "-l", str(44 * MB), str(filler)], check=True)
    config = write_config(tmp_path / "agent", "127.0.0.1:1", spool=False,
                          buffer={"path": disk48 / "buffer", "max_bytes": 1024 * MB,
                                  "reserve_bytes": 8 * MB})
    done = subprocess.run([sys.executable, "-m", "agent.cli.main", "run", "--config", str(config)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "cannot open the buffer" in done.stderr
    assert "reserve of 8.0 MiB" in done.stderr and "buffer.reserve_bytes" in done.stderr
    # Freed: it starts (and then holds its reserve, so a later full disk cannot stop it).
    filler.unlink()
    with Agent(config) as agent:
        assert agent.alive
        assert (disk48 / "buffer" / "data.mdb").stat().st_size >= 8 * MB
