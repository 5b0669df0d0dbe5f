"""Exactly-once bookkeeping in Kafka: the agent's identity, its progress records, and the
read-back that finds which of its uncertain messages already landed.

Every record of an exactly-once topic carries a ``ferry-id`` header, ``<identity>:<id hex>``
(the buffer id). Every transaction also writes, per topic it touched, one progress record to
the internal compacted topic (``forwarder.progress_topic``), keyed ``<identity>/<topic>``:

- ``last_id``: every message of the topic up to this buffer id is in Kafka (committed in this
  or an earlier transaction), so after a crash the buffer may drop them;
- ``scan_from``: per partition, an offset at or below which no later transaction of this
  agent can have written, i.e. where a read-back must start to see everything uncertain.

Both are read with ``isolation.level=read_committed`` *after* ``init_transactions()``, which
settles the previous instance's open transaction: Kafka aborts it (its records and progress
vanish), tansu commits it (its records, and its progress record if it got that far, become
visible). The read-back from ``scan_from`` then finds exactly the records that are visible
whichever the broker did (docs/design.md, "Exactly-once delivery").
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

log = logging.getLogger(__name__)

HEADER = "ferry-id"
MACHINE_ID = Path("/etc/machine-id")
_IDENTITY_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def agent_identity(configured: str, machine_id: Path = MACHINE_ID) -> str:
    """``forwarder.agent_id``, else /etc/machine-id, else the host name (made legal)."""
    if configured:
        return configured
    try:
        text = machine_id.read_text().strip()
    except OSError:
        text = ""
    if re.fullmatch(r"[0-9a-f]{32}", text):
        return text
    return _IDENTITY_CHARS.sub("-", socket.gethostname()).strip("-") or "ferry"


def tag(identity: str, message_id: bytes) -> bytes:
    """The ``ferry-id`` header value of a message."""
    return f"{identity}:{message_id.hex()}".encode()


def progress_key(identity: str, topic: str) -> bytes:
    return f"{identity}/{topic}".encode()


@dataclass
class Progress:
    """One agent's position in one exactly-once topic (see the module docstring)."""

    last_id: bytes | None = None
    scan_from: dict[int, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({
            "last_id": self.last_id.hex() if self.last_id is not None else None,
            "scan_from": {str(p): o for p, o in sorted(self.scan_from.items())},
            "at_ms": int(time.time() * 1000),
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Progress:
        doc = json.loads(raw)
        last = doc.get("last_id")
        return cls(bytes.fromhex(last) if last else None,
                   {int(p): int(o) for p, o in doc.get("scan_from", {}).items()})

    def advanced(self, last_id: bytes, written: dict[int, int]) -> Progress:
        """After a transaction that wrote up to ``last_id``, its last offset per partition in
        ``written``: later transactions write above those offsets."""
        scan = dict(self.scan_from)
        for p, offset in written.items():
            scan[p] = max(scan.get(p, 0), offset + 1)
        return Progress(last_id, scan)


def client_config(bootstrap: str, properties: dict[str, Any]) -> dict[str, Any]:
    """A read_committed consumer that never joins its group nor commits (assign() only)."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"ferry-progress-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # An offset past the end (the topic was deleted and created again): from the start.
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
        "fetch.wait.max.ms": 50,
    }
    # Security settings (TLS, SASL) apply to every client; producer-only ones do not.
    for k, v in properties.items():
        if k.startswith(("security.", "ssl.", "sasl.", "client.")):
            conf[k] = v
    return conf


def ensure_topic(conf: dict[str, Any], name: str, timeout: float,
                 admin: AdminClient | None = None) -> None:
    """Create the progress topic (compacted, one partition) if it does not exist.

    Through ``admin`` when given (the probe's: no client of its own). An admin client made
    here outlives the call until the garbage collector's next full run (its futures and an
    exception's traceback hold it in a reference cycle), and with it its connections."""
    if admin is None:
        admin = AdminClient({k: v for k, v in conf.items() if k == "bootstrap.servers"
                             or k.startswith(("security.", "ssl.", "sasl."))})
    md = admin.list_topics(topic=name, timeout=timeout)
    tm = md.topics.get(name)
    if tm is not None and tm.error is None and tm.partitions:
        return
    futures = admin.create_topics([NewTopic(name, num_partitions=1,
                                            config={"cleanup.policy": "compact"})],
                                  operation_timeout=timeout)
    try:
        futures[name].result(timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return
        raise
    log.info("created the progress topic %s (compacted)", name)


def _partitions(consumer: Consumer, topic: str, timeout: float) -> list[int]:
    md = consumer.list_topics(topic=topic, timeout=timeout)
    tm = md.topics.get(topic)
    if tm is None or tm.error is not None:
        return []
    return sorted(tm.partitions)


def _read_to_end(consumer: Consumer, assignments: Iterable[TopicPartition], deadline: float,
                 on_message: Callable[[Message], None]) -> dict[int, int]:
    """Read each assigned partition to its (read_committed) end; returns the end offsets."""
    assignments = list(assignments)
    if not assignments:
        return {}
    pending = {tp.partition for tp in assignments}
    ends: dict[int, int] = {}
    consumer.assign(assignments)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"partitions {sorted(pending)} of {assignments[0].topic} "
                               "not read to their end in time")
        m = consumer.poll(0.2)
        if m is None:
            continue
        err = m.error()
        partition = int(m.partition() or 0)
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                pending.discard(partition)
                ends[partition] = int(m.offset() or 0)
                continue
            if err.fatal() or err.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                             KafkaError.GROUP_AUTHORIZATION_FAILED):
                raise KafkaException(err)
            continue  # transient (a broker reconnecting): keep polling until the deadline
        pending.add(partition)  # more arrived after its end: read on
        on_message(m)
    return ends


def read_progress(conf: dict[str, Any], progress_topic: str, identity: str,
                  timeout: float) -> dict[str, Progress]:
    """This agent's latest committed progress record per topic ({} if there is none)."""
    prefix = f"{identity}/".encode()
    found: dict[str, Progress] = {}

    def take(m: Message) -> None:
        key = m.key()
        if key is None or not key.startswith(prefix):
            return
        value = m.value()
        topic = key[len(prefix):].decode()
        if value is None:
            found.pop(topic, None)  # a tombstone: forgotten
            return
        try:
            found[topic] = Progress.decode(value)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring an unreadable progress record of %s: %s", topic, exc)

    consumer = Consumer(conf)
    try:
        deadline = time.monotonic() + timeout
        parts = _partitions(consumer, progress_topic, timeout)
        _read_to_end(consumer, (TopicPartition(progress_topic, p, 0) for p in parts),
                     deadline, take)
    finally:
        consumer.close()
    return found


@dataclass
class Landed:
    """What a read-back found: this agent's records of a topic beyond ``scan_from``."""

    ids: dict[bytes, tuple[int, int]]  # buffer id -> (partition, offset)
    ends: dict[int, int]  # every partition's end when it was read


def find_landed(conf: dict[str, Any], topic: str, identity: str, scan_from: dict[int, int],
                timeout: float) -> Landed:
    """Read ``topic`` (read_committed) from ``scan_from`` (0 where unknown) to its end and
    collect the buffer ids of this agent's records."""
    prefix = f"{identity}:".encode()
    ids: dict[bytes, tuple[int, int]] = {}

    def take(m: Message) -> None:
        raw = m.headers() or []
        # The stubs allow a dict; consumed messages carry a list of pairs.
        pairs = raw.items() if isinstance(raw, dict) else raw
        for name, value in pairs:
            if name == HEADER and isinstance(value, bytes) and value.startswith(prefix):
                with contextlib.suppress(ValueError):  # not one of ours after all
                    ids[bytes.fromhex(value[len(prefix):].decode())] = (
                        int(m.partition() or 0), int(m.offset() or 0))
                return

    consumer = Consumer(conf)
    try:
        deadline = time.monotonic() + timeout
        parts = _partitions(consumer, topic, timeout)
        ends = _read_to_end(consumer, (TopicPartition(topic, p, scan_from.get(p, 0))
                                       for p in parts), deadline, take)
    finally:
        consumer.close()
    return Landed(ids, ends)
