"""The daemon: starts each stage, watches them, stops them in order.

Process layout (docs/design.md explains why): the ingest process runs the socket, HTTP and
spool sources and the buffer's writer thread; the forwarder runs in a second process that
opens the same LMDB environment, so neither competes with the other for one GIL. The ingest
process restarts the forwarder if it dies (supervision.py: back-off, give-up) and merges its
metrics into the one registry.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from agent.buffer.committer import Committer
from agent.buffer.store import Store
from agent.config import FerryConfig
from agent.daemon.supervision import Exit, GaveUp, RestartPolicy, supervise
from agent.forwarder import process as forwarder_process
from agent.ingest.runtime import Phase, Runtime
from agent.metrics import REGISTRY, Registry
from agent.process import memory
from agent.records import REPLAYED, Source
from agent.signals.commit import CommitSender
from agent.signals.commit import socket_path as commit_socket_path

# Reading /proc/<pid>/smaps is kernel work (tens of µs of Python); memory moves slowly.
MEMORY_SAMPLE_SECONDS = 5.0

log = logging.getLogger(__name__)


class Stage(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class ForwarderHandle:
    """The forwarder child process, seen from the ingest process.

    A watch thread relays its metrics and restarts it when it dies, as agent/daemon/supervision.py
    decides; when that gives up, ``on_give_up`` is called with the reason (the Agent then
    stops and the daemon exits non-zero).
    """

    def __init__(self, config: FerryConfig, registry: Registry,
                 store: Store | None = None,
                 on_give_up: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.registry = registry
        self.store = store  # the ingest process's: its reader slots are checked after a crash
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._started_at = 0.0
        self._exited = False  # the current process was seen to end: the next run starts one
        self._stopping = False
        self._woken = threading.Event()  # set by stop(): cuts a restart back-off short
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="forwarder-watch", daemon=True)
        self._on_give_up = on_give_up
        fwd = config.forwarder
        self.policy = RestartPolicy(backoff=fwd.restart_backoff_seconds,
                                    backoff_max=fwd.restart_backoff_max_seconds,
                                    healthy_after=fwd.restart_healthy_seconds,
                                    max_crashes=fwd.restart_max_crashes)
        self.restarts = 0

    def start(self) -> None:
        with self._lock:
            self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        """Start a forwarder process; called with ``_lock`` held."""
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=forwarder_process.main,
            args=(self.config.model_dump(mode="json", by_alias=True), child),
            name="ferry-forwarder",
            daemon=True,
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self._started_at = time.monotonic()
        self._exited = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _watch(self) -> None:
        try:
            supervise("forwarder", self._run, self.policy, self._back_off)
        except GaveUp as exc:
            self._give_up(str(exc))
        except Exception:  # noqa: BLE001 - unsupervised, the forwarder would fail unseen
            log.exception("watching the forwarder process failed")
            self._give_up("watching the forwarder process failed")

    def _give_up(self, reason: str) -> None:
        log.critical("%s: Ferry stops, and exits non-zero for its service manager to "
                     "restart it", reason)
        sd_notify(f"STATUS=stopping: {reason}")
        if self._on_give_up is not None:
            self._on_give_up(reason)

    def _back_off(self, seconds: float) -> None:
        self._woken.wait(seconds)  # stop() sets it: no back-off delays a shutdown

    def _run(self) -> Exit | None:
        """One run of the forwarder: start it unless it runs, relay its metrics until it
        ends; how it ended, or None once it was asked to stop."""
        if self._exited and not self._restart():
            return None
        with self._lock:
            conn, proc, started = self._conn, self._proc, self._started_at
        assert conn is not None and proc is not None
        while True:
            try:
                if conn.poll(0.5):
                    kind, payload = conn.recv()
                    if kind == "metrics":
                        self.registry.merge("forwarder", payload)
                    continue
            except (EOFError, OSError):
                # Its end of the pipe is closed: it is exiting. Wait on the sentinel rather
                # than spin on a pipe that is always readable now.
                wait([proc.sentinel], 0.5)
            if proc.is_alive():
                continue
            if self._stopping:
                return None
            self._exited = True
            if self.store is not None:
                # Killed inside a read transaction, it left a reader slot that would keep
                # LMDB from reusing any page freed from now on: cleared now, not after the
                # back-off.
                freed = self.store.reader_check()
                if freed:
                    log.info("cleared %d reader slot(s) the forwarder left", freed)
            return Exit(proc.exitcode, time.monotonic() - started)

    def _restart(self) -> bool:
        """Start the next forwarder after a crash; False when stopping instead."""
        with self._lock:
            if self._stopping:  # stop() must not race a new child into existence
                return False
            self.restarts += 1
            self.registry.inc("process_restarts", process="forwarder")
            self._spawn()
        return True

    def stop(self, timeout: float = 15.0) -> None:
        with self._lock:
            self._stopping = True
            conn, proc = self._conn, self._proc
        self._woken.set()
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send("stop")
        if proc is not None:
            # Wait on the sentinel (closed when the child exits), not on is_alive(): the
            # watch thread polls the same child, and two threads calling waitpid() can leave
            # one of them believing a finished child still runs.
            exited = bool(wait([proc.sentinel], timeout))
            if exited:
                proc.join(1.0)
            else:
                log.error("forwarder did not stop in %.0f s; killing it", timeout)
                if proc.pid is not None:
                    with contextlib.suppress(OSError):
                        os.kill(proc.pid, signal.SIGUSR1)  # its stacks, for the log
                    proc.join(1.0)
                proc.kill()
                proc.join(5)
        if self._thread.is_alive():
            self._thread.join(2.0)


class Agent:
    def __init__(self, config: FerryConfig, registry: Registry = REGISTRY) -> None:
        self.config = config
        self.registry = registry
        # A buffer without its disk reserve stops start-up (docs/buffer.md, "Disk space").
        self.store = Store(config.buffer.path, config.buffer.max_bytes,
                           track=config.status.track_messages,
                           track_seconds=config.status.track_seconds,
                           reserve_bytes=config.buffer.reserve_bytes,
                           preallocate=config.buffer.preallocate, open_space="require")
        self.committer = Committer(self.store, registry=registry,
                                   max_batch_messages=config.buffer.commit_max_messages,
                                   linger_ms=config.buffer.commit_interval_ms,
                                   nice=config.buffer.writer_nice,
                                   committed=CommitSender(
                                       commit_socket_path(config.buffer.path)).send)
        self.runtime = Runtime(config, self.store, self.committer, registry)
        # Set by a signal (run_until_signalled) or by the forwarder's supervisor giving up.
        self.stop_requested = threading.Event()
        self.failure: str | None = None  # why the agent stopped itself; the daemon exits 1
        self.forwarder = ForwarderHandle(config, registry, self.store,
                                         on_give_up=self._give_up)
        self.stages: list[Stage] = []
        self._stopped = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="monitor", daemon=True)
        # Totals `ferry replay` keeps in the buffer, as last seen: growth is counted.
        self._replayed = self._replay_totals()
        self._next_memory_sample = 0.0
        registry.set_info("version", _version())
        registry.set("buffer_max_bytes", float(config.buffer.max_bytes))

    def start(self) -> None:
        self.committer.start()
        self.forwarder.start()
        cfg = self.config
        if cfg.socket.path is not None:
            from agent.ingest.socket_server import SocketServer
            from agent.topics import TopicCatalog

            # Topics defined over HTTP set their max_message_bytes for datagrams too.
            catalog = TopicCatalog(cfg, self.store)
            self.stages.append(SocketServer(cfg, self.committer, self.registry,
                                            topic_settings=catalog.settings,
                                            limits=self.runtime.limits))
        if cfg.http.listen:
            self.stages.append(_http_stage(self.runtime))
        if cfg.spool.dirs:
            self.stages.append(_spool_stage(self.runtime))
        for stage in self.stages:
            stage.start()
        # The buffer's figures before anything reports ready: status and `ferry status` must
        # not show an empty buffer for the first second after a start with millions in it.
        self.refresh_gauges()
        self._monitor.start()
        self.runtime.set_phase(Phase.RUNNING)
        sd_notify("READY=1\nSTATUS=accepting messages")
        log.info("ferry %s running: buffer %s, socket %s, http %s", _version(),
                 cfg.buffer.path, cfg.socket.path, cfg.http.listen or "off")

    def stop(self) -> None:
        """Refuse new work, finish what is in progress, leave the buffer consistent."""
        sd_notify("STOPPING=1")
        self.runtime.set_phase(Phase.STOPPING)
        for stage in reversed(self.stages):
            try:
                stage.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("stopping %s failed", type(stage).__name__)
        self.committer.close()
        self.forwarder.stop()
        self._stopped.set()
        self.store.close()
        log.info("ferry stopped")

    def _give_up(self, reason: str) -> None:
        self.failure = reason
        self.stop_requested.set()

    def _replay_totals(self) -> dict[str, int]:
        return {key[len(REPLAYED):].decode("ascii", "replace"): _decode_total(raw)
                for key, raw in self.store.state_items(REPLAYED)}

    def _monitor_loop(self) -> None:
        """Buffer gauges for the status page, once a second."""
        while not self._stopped.wait(1.0):
            try:
                self.refresh_gauges()
            except Exception:  # noqa: BLE001 - monitoring must not take the agent down
                log.exception("refreshing buffer gauges failed")

    def refresh_gauges(self) -> None:
        if self._stopped.is_set():
            return
        now_ms = time.time() * 1000
        stats = self.store.topic_stats()
        reg = self.registry
        reg.replace_gauge("buffer_messages", {(("topic", s.topic),): s.messages for s in stats})
        reg.replace_gauge("buffer_bytes", {(("topic", s.topic),): s.bytes for s in stats})
        reg.replace_gauge("buffer_oldest_age_seconds", {
            (("topic", s.topic),): max(0.0, (now_ms - s.oldest_ms) / 1000)
            for s in stats if s.oldest_ms is not None})
        reg.set("buffer_used_bytes", float(self.store.used_bytes()))
        replayed = self._replay_totals()
        for topic, total in replayed.items():
            grown = total - self._replayed.get(topic, 0)
            if grown > 0:
                reg.inc("messages_accepted", grown, source=Source.REPLAY, topic=topic)
        self._replayed = replayed
        # Re-checked here too, not only when /status/ready asks: with no input and only
        # /metrics scraped, the gauge would otherwise stay 1 after the buffer drained.
        reg.set("buffer_full", 1.0 if self.committer.full else 0.0)
        # Also looks for a new snapshot when no input did (agent/signals/limits.py).
        reg.set("kafka_topic_limits_known", float(len(self.runtime.limits.current().topics)))
        if time.monotonic() >= self._next_memory_sample:
            self._next_memory_sample = time.monotonic() + MEMORY_SAMPLE_SECONDS
            self._sample_memory()

    def _sample_memory(self) -> None:
        data_file = self.config.buffer.path / "data.mdb"
        series: dict[tuple[tuple[str, str], ...], float] = {}
        for name, pid in (("ingest", os.getpid()), ("forwarder", self.forwarder.pid)):
            mem = memory.read(pid, data_file) if pid is not None else None
            if mem is None:
                continue
            for kind, value in (("rss", mem.rss_bytes), ("anonymous", mem.anonymous_bytes),
                                ("buffer_mapped", mem.buffer_mapped_bytes)):
                series[(("kind", kind), ("process", name))] = float(value)
        self.registry.replace_gauge("process_memory_bytes", series)


def _decode_total(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        return 0


def _http_stage(runtime: Runtime) -> Stage:
    from agent.ingest.http.app import create_app
    from agent.ingest.http.server import HttpServer
    from status.routes import routes

    server: Stage = HttpServer(runtime, create_app(runtime, routes(runtime)))
    return server


def _spool_stage(runtime: Runtime) -> Stage:
    # Imported here like the HTTP stage (only hosts with spool dirs pay for it), but never
    # guarded: a part missing from the installation stops the start with its ImportError.
    from agent.ingest.spool_intake import SpoolIntake

    intake: Stage = SpoolIntake(runtime)
    return intake


def _version() -> str:
    from agent import __version__

    return __version__


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op when not run by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc)


def run_until_signalled(agent: Agent, started: Callable[[], None] | None = None) -> int:
    """Run ``agent`` until SIGTERM/SIGINT or until it fails; the process's exit code.

    ``started`` is called once every listener is open (try-out prints its banner then). A
    start that fails (a port taken) raises, after stopping what had started already: the
    forwarder process is never left behind."""

    def handler(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        agent.stop_requested.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        agent.start()
        if started is not None:
            started()
        agent.stop_requested.wait()
    finally:
        agent.stop()
    if agent.failure is not None:
        log.critical("ferry stopped because %s", agent.failure)
        return 1
    return 0
