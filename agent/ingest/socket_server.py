"""The Bruce-compatible UNIX datagram socket: receive, validate, hand to the buffer.

One thread receives with blocking ``recv_into`` into one reused buffer, drains whatever else
is queued without blocking, encodes each datagram straight into the value the buffer stores,
and submits the lot as one group. It never waits for an fsync:
the writer thread commits while this one receives. When the writer falls behind, ``submit``
blocks, this thread stops receiving, the kernel queue fills and senders using blocking sends
wait: back-pressure instead of loss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent import reasons
from agent.buffer.committer import Committer, Result, ShuttingDown
from agent.buffer.generations import GENERATIONS_MAX_AGE
from agent.buffer.store import EncodedGroup
from agent.config import FerryConfig, TopicConfig
from agent.ingest import datagram, kafka_limits
from agent.ingest.gil import lower_switch_interval
from agent.metrics import REGISTRY, Registry
from agent.process.log_limit import LogLimit
from agent.records import Source
from agent.signals.limits import LimitsView
from agent.signals.limits import file_path as limits_file_path

log = logging.getLogger(__name__)

# The receive buffer holds the largest datagram any configured topic may take (key + value
# up to max_message_bytes, plus header and topic name), and at least this much. A sender may
# raise its SO_SNDBUF well past the kernel's default datagram size (the client suggests it
# for big messages), so a bigger datagram is not "impossible": recv reports its true length
# (MSG_TRUNC) and it is refused as too_large, not misread as malformed.
MIN_RECEIVE_BUFFER = 65536 * 4
DATAGRAM_OVERHEAD = 65536  # header, sizes and the longest legal topic name, with room to spare
# Datagrams drained before handing them to the writer. The writer merges what is waiting
# into one commit anyway; smaller hand-overs let it start sooner and hold the GIL for less
# at a time. bench_pipeline.py (2 vCPUs, 4096-datagram queue): 2000 gave commit p50 10-20 ms
# and 83,000-107,000 msg/s accepted, 500 gave p50 5 ms and 97,000-113,000 msg/s.
BATCH = 500


class SocketServer:
    def __init__(
        self, config: FerryConfig, committer: Committer, registry: Registry = REGISTRY,
        *, topic_settings: Callable[[str], TopicConfig] | None = None,
        limits: LimitsView | None = None,
    ) -> None:
        assert config.socket.path is not None
        self.path: Path = config.socket.path
        self.config = config
        self.committer = committer
        self.registry = registry
        # Per-topic settings: the daemon passes the topic catalog's, so topics defined over
        # HTTP count too; the limits read from it are looked up again every second.
        self.topic_settings = topic_settings or config.topic
        # What the Kafka topics can never take, as the forwarder learnt it
        # (agent/signals/limits.py): refused here, before anything is stored.
        self.kafka_limits = limits or LimitsView(limits_file_path(config.buffer.path))
        self.receive_buffer = max(
            MIN_RECEIVE_BUFFER,
            max(t.max_message_bytes for t in config.topics.values()) + DATAGRAM_OVERHEAD)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="socket-input", daemon=True)
        self._limits: dict[str, int] = {}

    def bind(self) -> None:
        """Bind the socket, replacing a stale socket file left by a crash."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if not stat.S_ISSOCK(st.st_mode):
                raise RuntimeError(f"{self.path} exists and is not a socket; not replacing it")
            if _in_use(self.path):
                raise RuntimeError(f"{self.path} is in use by another process")
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF,
                            self.config.socket.receive_buffer_bytes)
        sock.bind(str(self.path))
        os.chmod(self.path, int(self.config.socket.mode, 8))
        # Truly blocking: with a Python-level timeout, recv(MSG_DONTWAIT) would wait for the
        # timeout instead of returning at once, and a slow trickle would never be submitted.
        # stop() wakes the thread with an empty datagram instead.
        sock.setblocking(True)
        self._sock = sock

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        lower_switch_interval()  # the writer thread's commits wait less for the GIL
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            with contextlib.suppress(OSError), socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM
            ) as waker:
                waker.settimeout(1.0)
                waker.sendto(b"", str(self.path))
            self._thread.join(5.0)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _max_bytes(self, topic: str) -> int:
        limit = self._limits.get(topic)
        if limit is None:
            limit = self._limits[topic] = self.topic_settings(topic).max_message_bytes
        return limit

    def _generations(self, current: dict[str, int]) -> dict[str, int]:
        """The buffer's topic generations now; ``current`` if they cannot be read (the buffer
        re-encodes what is stale, and the commit reports a disk that is really gone)."""
        try:
            return self.committer.store.generations()
        except Exception as exc:  # noqa: BLE001 - the receive loop must go on
            log.warning("could not read topic generations (using the last known): %s", exc)
            return current

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        size = self.receive_buffer
        buf = bytearray(size)
        view = memoryview(buf)
        trunc = socket.MSG_TRUNC
        drain = socket.MSG_TRUNC | socket.MSG_DONTWAIT
        parse = datagram.parse_encoded
        limit = self._max_bytes
        reg = self.registry
        generations: dict[str, int] = {}
        generations_at = -GENERATIONS_MAX_AGE
        while not self._stop.is_set():
            try:
                n = sock.recv_into(buf, 0, trunc)  # the datagram's true length
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.error("socket receive failed: %s", exc)
                continue
            if self._stop.is_set():
                return
            if time.monotonic() - generations_at > GENERATIONS_MAX_AGE:
                generations = self._generations(generations)
                generations_at = time.monotonic()
                self._limits.clear()  # topics redefined over HTTP meanwhile
            # Looked at once per round, not per datagram: usually empty (nothing learnt yet,
            # or no topic limited), and then each datagram costs one truth test.
            snapshot = self.kafka_limits.current()
            kafka_topics = snapshot.topics
            now_ms = int(time.time() * 1000) if kafka_topics else 0
            # Values by topic, each topic's in arrival order (the order the buffer keeps).
            by_topic: dict[str, list[bytes]] = {}
            rejects: dict[str, int] = {}
            received = 0
            while True:
                received += 1
                try:
                    if n > size:
                        raise datagram.Reject(
                            datagram.TOO_LARGE, f"a datagram of {n} bytes; this agent receives at "
                            f"most {size} (the largest max_message_bytes configured, plus "
                            "the header)")
                    topic, value = parse(view[:n], limit, generations)
                    if kafka_topics:
                        kafka_limit = kafka_topics.get(topic)
                        if kafka_limit is not None:
                            refused = kafka_limits.stored_refusal(
                                topic, kafka_limit, snapshot.compression, value, now_ms)
                            if refused is not None:
                                raise datagram.Reject(*refused)
                except datagram.Reject as rej:
                    rejects[rej.reason] = rejects.get(rej.reason, 0) + 1
                    reg.sample("rejected", rej.reason, {"source": Source.SOCKET,
                                                        "detail": str(rej),
                                                        "bytes": bytes(view[:min(n, 64)]).hex()})
                else:
                    values = by_topic.get(topic)
                    if values is None:
                        values = by_topic[topic] = []
                    values.append(value)
                if received >= BATCH:
                    break
                try:
                    n = sock.recv_into(buf, 0, drain)
                except (BlockingIOError, InterruptedError):
                    break
                if not n and self._stop.is_set():
                    break  # stop()'s wake-up, not a sender's datagram
            reg.inc("messages_received", received, source=Source.SOCKET)
            for reason, count in rejects.items():
                reg.inc("messages_rejected", count, source=Source.SOCKET, reason=reason)
            if by_topic:
                group = EncodedGroup([(topic, values, generations.get(topic, 0))
                                      for topic, values in by_topic.items()])
                try:
                    self.committer.submit_encoded(group, Source.SOCKET, _log_refusal)
                except ShuttingDown:
                    reg.inc("messages_rejected", len(group), source=Source.SOCKET,
                            reason=reasons.SHUTTING_DOWN)
                    return


_refusals = LogLimit(log)


def _log_refusal(result: Result) -> None:
    # The committer counts refused groups (messages_rejected{reason=buffer_full|disk_*}) and
    # logs refusals for lack of space once per episode: a line per group would be thousands
    # a second while the buffer or its disk is full.
    if not isinstance(result, list):
        if result.reason in reasons.SPACE:
            log.debug("datagrams refused: %s", result)
        else:
            # Any other refusal repeats with every group too: a line a minute per reason,
            # with the count of the lines left out.
            _refusals.warning(result.reason, "datagrams refused: %s", result)


def _in_use(path: Path) -> bool:
    """True if something is bound to the socket file (a live Ferry); False if it is stale."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()
