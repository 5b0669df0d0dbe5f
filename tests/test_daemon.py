"""agent/daemon/agent.py's supervision of the forwarder process, with the real agent (`ferry run`)
and a real forwarder that the test SIGKILLs: restarts back off, a healthy run resets the
count, and crashes in a row past the limit stop the agent with exit code 1 (for systemd's
Restart=on-failure), losing nothing that was acknowledged."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.buffer.store import Store
from agent.config import load_config
from agent.daemon.agent import Agent, run_until_signalled
from agent.ingest.runtime import Phase
from agent.metrics import Registry
from agent.records import Record
from ferry_client import FerryClient
from tests.agent_harness import AgentProcess, wait_buffered, write_config
from tests.kafka import free_port
from tests.reliability.harness import process_group
from tests.waiting import wait_until

HEALTHY = 3.0  # forwarder.restart_healthy_seconds in this test


def forwarder_pid(agent: AgentProcess) -> int | None:
    """The agent's forwarder child (multiprocessing's spawn), if one is running."""
    assert agent.proc is not None
    pid = agent.proc.pid
    children: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None  # the agent is gone (and reaped)
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"spawn_main" in cmdline and state != "Z":
            return child
    return None


def age(pid: int) -> float:
    """Seconds since process ``pid`` started (from /proc, in clock ticks since boot)."""
    start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def next_forwarder(agent: AgentProcess, previous: int | None) -> int:
    pid = wait_until(lambda: (found := forwarder_pid(agent)) != previous and found,
                     timeout=30, message="a (new) forwarder process")
    assert pid is not None
    return pid


def kill_young(pid: int) -> None:
    assert age(pid) < HEALTHY - 1, "too old to count as a crash in a row"
    os.kill(pid, signal.SIGKILL)


def kill_healthy(pid: int) -> None:
    wait_until(lambda: age(pid) > HEALTHY + 0.5, timeout=HEALTHY + 5,
               message="the forwarder's healthy period")
    os.kill(pid, signal.SIGKILL)


def test_crashes_restart_with_decaying_back_off_until_too_many_in_a_row(tmp_path: Path) -> None:
    # No Kafka at all (a closed port): the forwarder still runs; messages stay buffered.
    config = write_config(tmp_path, "127.0.0.1:9", forwarder={
        "restart_backoff_seconds": 0.05, "restart_backoff_max_seconds": 0.2,
        "restart_healthy_seconds": HEALTHY, "restart_max_crashes": 2})
    with AgentProcess(config) as agent:
        with FerryClient(agent.socket_path, timeout=10) as client:
            for i in range(5):
                client.send("kept", b"m%d" % i)
        wait_buffered(agent, "kept", 5)
        # A healthy run's crash, then a young one: one crash in a row. Again. Without the
        # reset, the second young crash would be the second in a row and stop the agent,
        # and each back-off would be longer than the one before.
        first = next_forwarder(agent, None)
        kill_healthy(first)
        second = next_forwarder(agent, first)
        kill_young(second)
        third = next_forwarder(agent, second)
        kill_healthy(third)
        fourth = next_forwarder(agent, third)
        kill_young(fourth)
        fifth = next_forwarder(agent, fourth)
        assert agent.proc is not None and agent.proc.poll() is None
        pgid = agent.proc.pid
        assert agent.get_json("/status/ready")  # still serving
        # A second young crash in a row: the supervisor gives up and the agent exits 1.
        kill_young(fifth)
        code = agent.proc.wait(30)
        log = agent.log_path.read_text()
        assert code == 1, agent.log_tail()
        assert "CRITICAL" in log and "crashed 2 times in a row" in log
        assert "ferry stopped because" in log
        assert log.count("restarting it in 0.05 s (1 in a row of at most 2)") == 2  # reset
        assert log.count("after a healthy") == 2
        # Nothing left behind: no forwarder (nor helper) outlives the agent.
        wait_until(lambda: process_group(pgid) == [], timeout=10,
                   message="the agent's processes gone")
    # Everything acknowledged is still there for the next start.
    assert agent.buffered() == {"kept": 5}


def test_a_stop_during_a_back_off_is_not_delayed(tmp_path: Path) -> None:
    config = write_config(tmp_path, "127.0.0.1:9", forwarder={
        "restart_backoff_seconds": 600, "restart_backoff_max_seconds": 600,
        "restart_max_crashes": 0})
    with AgentProcess(config) as agent:
        os.kill(next_forwarder(agent, None), signal.SIGKILL)
        wait_until(lambda: "restarting it in 600 s" in agent.log_path.read_text(),
                   timeout=15, message="the restart back-off to begin")
        started = time.monotonic()
        assert agent.terminate(timeout=30) == 0
        assert time.monotonic() - started < 20  # not the 600 s back-off
        # No restart meanwhile: the one crash, logged once. (Counted over the whole log: the
        # shutdown now logs only three lines, so the crash line is within its last five.)
        assert agent.log_path.read_text().count("forwarder process crashed") == 1


class _MergeFails(Registry):
    def merge(self, child: str, snap: dict[str, Any]) -> None:
        raise RuntimeError("a bug in merging the forwarder's metrics")


def test_a_failing_watch_thread_stops_the_agent(tmp_path: Path) -> None:
    # Without its watch thread the forwarder would go unsupervised and its metrics stale,
    # unseen; the agent stops instead (and `ferry run` exits 1, as when it gives up).
    config = load_config(write_config(tmp_path, "127.0.0.1:9", http=False))
    agent = Agent(config, registry=_MergeFails())
    agent.start()
    try:
        assert agent.stop_requested.wait(30), "the agent was not asked to stop"
        assert agent.failure == "watching the forwarder process failed"
    finally:
        agent.stop()


def test_buffer_figures_are_read_before_the_agent_reports_ready(tmp_path: Path) -> None:
    """Started on a buffer holding a backlog, the agent is RUNNING (ready) only once the
    buffer gauges hold it: status and `ferry status` never show an empty buffer meanwhile."""
    path = write_config(tmp_path / "agent", f"127.0.0.1:{free_port()}", http=False)
    config = load_config(path)
    store = Store(config.buffer.path, config.buffer.max_bytes)
    try:
        store.append([[Record("backlog", b"m%d" % i) for i in range(500)]])
    finally:
        store.close()
    seen: list[float] = []
    agent = Agent(config, registry=Registry())
    set_phase = agent.runtime.set_phase

    def watching(phase: Phase) -> None:
        if phase is Phase.RUNNING:
            seen.append(agent.registry.view().total("buffer_messages"))
        set_phase(phase)

    agent.runtime.set_phase = watching  # type: ignore[method-assign]
    agent.start()
    try:
        assert seen == [500.0]
    finally:
        agent.stop()


def test_a_part_missing_from_the_installation_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No silent fallback: with spool directories configured and the spool intake not
    importable, the start fails with the ImportError (it used to run without the stage)."""
    config = load_config(write_config(tmp_path / "agent", f"127.0.0.1:{free_port()}",
                                      http=False, spool=True))
    agent = Agent(config, registry=Registry())
    monkeypatch.setitem(sys.modules, "agent.ingest.spool_intake", None)  # import fails
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(ImportError, match="agent.ingest.spool_intake"):
            run_until_signalled(agent)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert agent.forwarder.pid is not None
    assert not agent.forwarder._proc.is_alive()  # type: ignore[union-attr]  # stopped too
