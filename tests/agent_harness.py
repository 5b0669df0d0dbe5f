"""Run the real agent for tests: `ferry run --config` in its own process group (and
``ferry(*args)``: any other command of the CLI, run to its end).

Tests that kill -9 the agent need it in another process; ``AgentProcess.kill()`` SIGKILLs
the whole group (ingest and forwarder processes), as systemd would kill its cgroup.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from agent.buffer.store import Store
from agent.config import load_config
from agent.daemon.agent import Agent
from agent.metrics import Registry
from tests import proc_stats
from tests.kafka import free_port
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def write_config(
    root: Path,
    bootstrap: str,
    *,
    remote_bootstrap: str | None = None,
    http: bool | dict[str, Any] = True,
    spool: bool = False,
    topics: dict[str, dict[str, Any]] | None = None,
    buffer: dict[str, Any] | None = None,
    forwarder: dict[str, Any] | None = None,
    extra: str = "",
    outage_after_seconds: float = 2.0,
    cluster: dict[str, Any] | None = None,
) -> Path:
    """A config for an agent whose state lives under ``root``; returns the file's path.
    ``http``: False for no HTTP listener, or settings of ``[http]`` beside its listener.
    ``cluster``: more settings of ``[kafka.local]`` (and ``[kafka.remote]``)."""
    root.mkdir(parents=True, exist_ok=True)
    sections: dict[str, dict[str, Any]] = {
        "buffer": {"path": root / "buffer", "max_bytes": 256 * 1024 * 1024, **(buffer or {})},
        "socket": {"path": root / "ferry.sock"},
        "http": {"listen": f"127.0.0.1:{free_port()}" if http else "",
                 **(http if isinstance(http, dict) else {})},
        "spool": {"dirs": [root / "spool"] if spool else []},
        "kafka.local": {"bootstrap_servers": bootstrap,
                        "outage_after_seconds": outage_after_seconds, **(cluster or {})},
        "forwarder": {"linger_ms": 1, **(forwarder or {})},
    }
    if remote_bootstrap:
        sections["kafka.remote"] = {"bootstrap_servers": remote_bootstrap,
                                    "outage_after_seconds": outage_after_seconds,
                                    **(cluster or {})}
    for name, settings in (topics or {}).items():
        sections[f'topics."{name}"' if name != "default" else "topics.default"] = settings
    lines = []
    for name, settings in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in settings.items()]
        lines.append("")
    path = root / "ferry.toml"
    path.write_text("\n".join(lines) + extra)
    return path


def ferry(*args: str, stdin: str | None = None, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli.main", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, input=stdin,
                          env={**os.environ, **(env or {})})


class AgentProcess:
    def __init__(self, config_path: Path, log_path: Path | None = None) -> None:
        self.config_path = config_path
        from agent.config import load_config

        self.config = load_config(config_path)
        self.log_path = log_path or config_path.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        assert self.config.socket.path is not None
        return self.config.socket.path

    @property
    def http_url(self) -> str:
        return f"http://{self.config.http.listen}"

    def start(self, timeout: float = 30.0) -> Self:
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli.main", "run", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
            start_new_session=True,
        )
        wait_until(self._ready, timeout=timeout, message=f"agent ready (log {self.log_path})")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log_tail()}")
        if not self.socket_path.exists():
            return False
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(str(self.socket_path))
        except OSError:
            return False
        finally:
            probe.close()
        if self.config.http.listen:
            try:
                with urllib.request.urlopen(self.http_url + "/status/ready", timeout=1) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False
        return True

    def kill(self) -> None:
        """SIGKILL every process of the agent at once: no chance to clean up."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._reap_group()

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._reap_group()
        return code

    def _reap_group(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a forwarder child left behind

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every process of the agent's process group so far
        (it runs in a session of its own: the ingest process and the forwarder)."""
        assert self.proc is not None
        return sum(proc_stats.cpu_seconds(pid) for pid in proc_stats.group_pids(self.proc.pid))

    def thread_cpu_seconds(self) -> dict[str, float]:
        """CPU time so far per thread name (``comm``: librdkafka's ``rdk:broker1``, Python's
        ``python``) over the agent's process group: where a CPU bound went, when it fails."""
        assert self.proc is not None
        out: dict[str, float] = collections.defaultdict(float)
        for task in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
            got = proc_stats.stat(task)
            if got is not None and got[1] == self.proc.pid:
                out[got[0]] += got[2]
        return dict(out)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.http_url + path, timeout=5) as r:
            return json.loads(r.read())

    def buffered(self) -> dict[str, int]:
        """Messages per topic in the agent's buffer, read straight from LMDB."""
        store = Store(self.config.buffer.path, self.config.buffer.max_bytes)
        try:
            return {s.topic: s.messages for s in store.topic_stats()}
        finally:
            store.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()


@contextmanager
def running_agent(root: Path, bootstrap: str, **config: Any) -> Iterator[Agent]:
    """The whole agent in this process (the forwarder still gets its own process), with a
    registry of its own; ``config`` goes to write_config (HTTP off unless asked for)."""
    config.setdefault("http", False)
    agent = Agent(load_config(write_config(root, bootstrap, **config)), registry=Registry())
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def wait_buffered(agent: AgentProcess, topic: str, count: int, timeout: float = 15.0) -> None:
    wait_until(lambda: agent.buffered().get(topic, 0) >= count, timeout=timeout,
               message=f"{count} messages of {topic} in the buffer")


def wait_drained(agent: AgentProcess, timeout: float = 30.0) -> None:
    wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=timeout,
               message="buffer drained", interval=0.1)


def now_ms() -> int:
    return int(time.time() * 1000)
