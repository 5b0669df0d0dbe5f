"""The broker-connection settings every long-lived client of a cluster shares (producers,
the exactly-once producer, the probe's admin client).

``connections.max.idle.ms`` closes a connection that carried nothing for
``idle_connection_seconds`` (librdkafka subtracts up to 2 s of jitter from values of 4 s and
more, so that a client's connections do not all close at once). librdkafka opens a closed
connection again when it next has a request for that broker: a message after an idle period
waits for a TCP connect and an ApiVersions round trip first (docs/design.md, "Connections").
The probe's Metadata request every ``probe_interval_seconds`` keeps its one connection busy,
so an idle agent holds that one and no other.
"""

from __future__ import annotations

import math
from typing import Any

from agent.config import KafkaClusterConfig

# Come back within seconds of an outage ending (librdkafka's default backs off to 10 s).
RECONNECT_BACKOFF_MAX_MS = 2000


def idle_ms(cluster: KafkaClusterConfig) -> int:
    """``connections.max.idle.ms`` for ``cluster``: 0 (never close) or at least 1 ms."""
    seconds = cluster.idle_connection_seconds
    return 0 if seconds <= 0 else max(1, math.ceil(seconds * 1000))


def connection_config(cluster: KafkaClusterConfig) -> dict[str, Any]:
    """Where the cluster is and how its connections live; a cluster's ``properties`` are
    applied after these by every caller, and so override them."""
    return {
        "bootstrap.servers": cluster.bootstrap_servers,
        "socket.keepalive.enable": True,
        "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
        "connections.max.idle.ms": idle_ms(cluster),
    }
