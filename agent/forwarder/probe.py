"""The probe: asks a cluster for its metadata every ``probe_interval_seconds``, whether or not
there is anything to send, and tells the cluster's ``ClusterHealth`` how that went.

The request is a Metadata request naming one topic that exists, answered by any broker that
is up: cheap on a cluster of any size. The topic is one Ferry sends to that the cluster lists
(``named``), else one the probe's last answer listed; the first probe, knowing none, asks for
every topic once and keeps one. Never a topic that does not exist: librdkafka keeps a topic
named in a request as its own for good and looks an unknown one up again about every second
(measured: 2.5 Metadata requests a second instead of 0.5, on every agent of a fleet). The
probe's client never asks for a topic to be created (``allow.auto.create.topics`` off).

It goes through its own admin client, so a producer's queue or a stuck topic lookup never
delays the verdict. The admin client's error callback supplies the cause a
person wants to read ("Connect to ipv4#127.0.0.1:9092 failed: Connection refused"); the
request itself only says it timed out.

Not DescribeCluster, nor any other admin request while the controller is gone: librdkafka
sends those to the controller the metadata names and, while that one refuses connections,
reconnects to it with no back-off at all (every failed connect wakes the request, which asks
for a connection at once: ``rd_kafka_admin_common_get_controller``), some 5,000 connects and
0.6 of a core per second of the request's timeout. With the KRaft quorum lost the survivors
go on naming a dead node, so every probe did that for its whole period. A Metadata request
waits for any broker with the client's reconnect back-off. The probe remembers which broker
the answer names as the controller, and ``controller_accepts`` tells the occasional admin
requests (a topic's limits, the in-sync diagnosis) whether it takes a connection now: when
it does not, they are not sent (docs/design.md, "Waiting costs little").
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from agent.config import KafkaClusterConfig
from agent.forwarder import insync
from agent.forwarder.connections import connection_config
from agent.forwarder.health import ClusterHealth

log = logging.getLogger(__name__)

# How long the reach check waits for a broker out of reach to answer a Metadata request: on
# a working network an answer takes milliseconds.
REACH_TIMEOUT = 1.0
# The check's errors that mean no connection or no answer: the broker is still cut off. Any
# other (authentication, TLS) is the check's own trouble and says nothing of the broker.
UNANSWERED = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                        KafkaError._ALL_BROKERS_DOWN})

# How long the controller check waits for a TCP connection: a refusal is immediate, and a
# controller that takes longer than this to accept would not answer a request in time either.
CONTROLLER_CONNECT_TIMEOUT = 0.5


def probe_config(name: str, cluster: KafkaClusterConfig, logger: logging.Logger | None,
                 on_error: Any) -> dict[str, Any]:
    conf = connection_config(cluster)
    conf["client.id"] = f"ferry-{name}-probe"
    if logger is not None:
        conf["logger"] = logger
    # TLS, SASL and the like apply to the probe as to the producers. (An admin client is a
    # producer-type handle in librdkafka, so producer settings there are accepted too.)
    conf.update(cluster.properties)
    # After the cluster's properties: the probe's Metadata request (and the in-sync
    # diagnosis's) must never create a topic, whatever the producers may do.
    conf["allow.auto.create.topics"] = False
    conf["error_cb"] = on_error
    return conf


class Probe:
    """A daemon thread probing one cluster until ``stop()``."""

    def __init__(self, name: str, cluster: KafkaClusterConfig, health: ClusterHealth,
                 logger: logging.Logger | None = None,
                 topics: Callable[[], list[str]] | None = None,
                 named: Callable[[], str | None] | None = None,
                 out_of_reach: Callable[[], dict[int, str]] | None = None,
                 reached: Callable[[int, bool], None] | None = None) -> None:
        self.name = name
        # The brokers out of this agent's reach (node -> "host:port"), and whom to tell
        # whether one answered a request sent to it alone (check_reach).
        self.out_of_reach = out_of_reach
        self.reached = reached
        self._cluster = cluster
        self._reach_turn = -1  # which broker out of reach check_reach asked last
        self.topics = topics  # Ferry's topics on the cluster: where to look for a shortfall
        self.named = named  # the topic to name, when the cluster has one (see the docstring)
        self._listed: str | None = None  # a topic the last answer listed, failing ``named``
        self.interval = cluster.probe_interval_seconds
        # A probe ends within one period, so probes never pile up and a failure is known
        # within outage_after_seconds + one period (the documented bound).
        self.timeout = max(self.interval, 0.5)
        self.health = health
        self._admin = AdminClient(probe_config(name, cluster, logger, self._error))
        # (host, port) of the broker the last metadata answer named as the controller; None
        # before the first answer, or when the answer named none.
        self._controller: tuple[str, int] | None = None
        self._controller_known = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def topic(self) -> str | None:
        """The topic the next probe names (None: it asks for every topic)."""
        named = self.named() if self.named is not None else None
        return named or self._listed

    @property
    def admin(self) -> AdminClient:
        """The probe's admin client, for the cluster's other occasional questions (a
        topic's limits): one connection serves them all."""
        return self._admin

    def stop(self) -> None:
        # Not waited for long: a probe of an unreachable cluster runs up to its timeout, and
        # a shutdown must not wait on it (the thread is a daemon; its verdict is moot now).
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(0.5)

    def _error(self, err: KafkaError) -> None:
        self.health.client_error(err.str(),
                                 generic=err.code() == KafkaError._ALL_BROKERS_DOWN)

    def probe_once(self) -> None:
        # The error callback (and the logger) are served from poll(): first the connect
        # errors met since the last probe, so a failure below comes with its cause.
        self._admin.poll(0)
        try:
            topic = self.topic
            md = (self._admin.list_topics(topic, timeout=self.timeout) if topic is not None
                  else self._admin.list_topics(timeout=self.timeout))
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            self._admin.poll(0)
            self.health.probe_failed(err.str() if err is not None else str(exc))
        except Exception as exc:  # noqa: BLE001 - a probe must outlive surprises; it is a fail
            log.exception("probing cluster %s failed", self.name)
            self.health.probe_failed(f"{type(exc).__name__}: {exc}")
        else:
            controller = md.brokers.get(md.controller_id)
            self._controller = (None if controller is None
                                else (str(controller.host), int(controller.port)))
            self._controller_known = True
            self._listed = self._pick(md.topics)
            self.health.probe_answered(len(md.brokers))
        self.check_reach()
        if self.health.stalled() and self.topics is not None:
            # Sends unanswered: ask why (agent/forwarder/insync.py). Whether or not the probe
            # answered: with two of three KRaft nodes stopped, the survivor still serves
            # metadata. Its min.insync.replicas question goes to the controller: only when
            # that one takes a connection (see the module's docstring).
            self.health.diagnosed(insync.diagnose(self._admin, self.topics(), self.timeout,
                                                  configs=self.controller_accepts()))

    def check_reach(self) -> None:
        """Ask each broker out of reach, alone, for the probed topic's metadata, through a
        client of its own whose only bootstrap server it is (so the request can go nowhere
        else), and report whether it answered (``UNANSWERED``: no connection or no answer;
        any other error says nothing and is not reported). Nothing else would notice one
        coming back soon: Ferry sends nothing to its partitions meanwhile, and librdkafka may
        not reconnect to a broker it has nothing for. Only while a broker is out of reach; a
        client costs about 3 ms of CPU, and waits at most ``REACH_TIMEOUT``. One broker a
        probe, in turn: the probe's own period (the cluster's verdict) never stretches by
        more than one check, however many brokers are cut off."""
        if self.out_of_reach is None or self.reached is None:
            return
        cut = sorted(self.out_of_reach().items())
        if not cut:
            return
        self._reach_turn = (self._reach_turn + 1) % len(cut)
        for node, address in cut[self._reach_turn:self._reach_turn + 1]:
            if not address or self._stop.is_set():
                continue
            conf = probe_config(self.name, self._cluster, None, None)
            del conf["error_cb"]  # its connect errors are not the cluster's
            conf["bootstrap.servers"] = address
            conf["client.id"] = f"ferry-{self.name}-reach"
            conf["log_level"] = 0  # a refused connect is the expected answer here
            client = AdminClient(conf)
            try:
                topic = self.topic
                if topic is not None:
                    client.list_topics(topic, timeout=REACH_TIMEOUT)
                else:
                    client.list_topics(timeout=REACH_TIMEOUT)
            except KafkaException as exc:
                err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if err is not None and err.code() in UNANSWERED:
                    self.reached(node, False)
                continue
            except Exception:  # noqa: BLE001 - a probe must outlive surprises
                log.exception("checking whether broker %d of %s answers failed", node,
                              self.name)
                continue
            finally:
                del client
            self.reached(node, True)

    def _pick(self, topics: dict[str, Any]) -> str | None:
        """A topic of the answer that exists, to name next time: one of Ferry's if listed.
        None (every topic asked for next time) when the named one was deleted, or the cluster
        has none, when that request is cheap."""
        listed = sorted(name for name, tm in topics.items()
                        if tm.error is None and tm.partitions)
        own = set(self.topics()) if self.topics is not None else set()
        return next((name for name in listed if name in own), listed[0] if listed else None)

    def controller_accepts(self) -> bool:
        """Whether the broker the last metadata answer named as the controller accepts a TCP
        connection now: where librdkafka sends an admin request (DescribeConfigs and the
        like), and reconnects without back-off while it refuses (see the module's
        docstring). True before any answer (nothing known to hold the request back); False
        when the answer named no controller (no admin request could be served)."""
        if not self._controller_known:
            return True
        address = self._controller
        if address is None:
            return False
        try:
            with socket.create_connection(address, timeout=CONTROLLER_CONNECT_TIMEOUT):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.probe_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
