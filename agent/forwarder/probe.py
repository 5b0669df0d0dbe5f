"""The probe: asks a cluster for its metadata every ``probe_interval_seconds``, whether or not
there is anything to send, and tells the cluster's ``ClusterHealth`` how that went.

The request is DescribeCluster (brokers and controller, no topics): cheap on a cluster of any
size, unlike a full metadata refresh. It goes through its own admin client, so a producer's
queue or a stuck topic lookup never delays the verdict. The admin client's error callback
supplies the cause a person wants to read ("Connect to ipv4#127.0.0.1:9092 failed:
Connection refused"); the request itself only says it timed out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from agent.config import KafkaClusterConfig
from agent.forwarder import insync
from agent.forwarder.health import ClusterHealth

log = logging.getLogger(__name__)

def probe_config(name: str, cluster: KafkaClusterConfig, logger: logging.Logger | None,
                 on_error: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": cluster.bootstrap_servers,
        "client.id": f"ferry-{name}-probe",
        "reconnect.backoff.max.ms": 2000,
        "socket.keepalive.enable": True,
    }
    if logger is not None:
        conf["logger"] = logger
    # TLS, SASL and the like apply to the probe as to the producers. (An admin client is a
    # producer-type handle in librdkafka, so producer settings there are accepted too.)
    conf.update(cluster.properties)
    conf["error_cb"] = on_error
    return conf


class Probe:
    """A daemon thread probing one cluster until ``stop()``."""

    def __init__(self, name: str, cluster: KafkaClusterConfig, health: ClusterHealth,
                 logger: logging.Logger | None = None,
                 topics: Callable[[], list[str]] | None = None) -> None:
        self.name = name
        self.topics = topics  # Ferry's topics on the cluster: where to look for a shortfall
        self.interval = cluster.probe_interval_seconds
        # A probe ends within one period, so probes never pile up and a failure is known
        # within outage_after_seconds + one period (the documented bound).
        self.timeout = max(self.interval, 0.5)
        self.health = health
        self._admin = AdminClient(probe_config(name, cluster, logger, self._error))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

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
            desc = self._admin.describe_cluster(request_timeout=self.timeout).result()
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            self._admin.poll(0)
            self.health.probe_failed(err.str() if err is not None else str(exc))
        except Exception as exc:  # noqa: BLE001 - a probe must outlive surprises; it is a fail
            log.exception("probing cluster %s failed", self.name)
            self.health.probe_failed(f"{type(exc).__name__}: {exc}")
        else:
            self.health.probe_answered(len(desc.nodes))
        if self.health.stalled() and self.topics is not None:
            # Sends unanswered: ask why (agent/forwarder/insync.py). Whether or not the probe
            # answered: with two of three KRaft nodes stopped, the survivor still serves
            # metadata, but DescribeCluster may wait for a controller that is gone.
            self.health.diagnosed(insync.diagnose(self._admin, self.topics(), self.timeout))

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.probe_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
