"""The one message type every ingest source hands to the buffer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

Headers = tuple[tuple[str, bytes], ...]


# Not frozen: a frozen dataclass costs ~1.3 us per instance against ~0.3 us, and one is made per
# message on the 100k msg/s ingest path. Treat instances as immutable all the same.
@dataclass(slots=True)
class Record:
    """A message as accepted from a client, before Ferry assigns it an id.

    ``partition_key`` is Bruce's 32-bit partition key (partition = key mod the topic's sorted
    partition list); it is unrelated to the Kafka record ``key``. When ``partition_key`` is
    None, ``hash_key`` chooses between librdkafka's key hash (HTTP Partition-Key, spool keys)
    and round-robin (Bruce AnyPartition, which ignores the Kafka key for placement).
    """

    topic: str
    value: bytes
    key: bytes | None = None
    partition_key: int | None = None
    timestamp_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    headers: Headers = ()
    hash_key: bool = False

    @property
    def size(self) -> int:
        """Bytes this record weighs against ``max_message_bytes`` (key + value)."""
        return len(self.value) + (len(self.key) if self.key else 0)


class Source:
    """Names of the ingest sources, used as metric labels."""

    SOCKET = "socket"
    HTTP = "http"
    SPOOL = "spool"
    REPLAY = "replay"


# `ferry replay` writes to the buffer from its own process, outside the daemon's registry:
# it keeps a running total per topic in the buffer's state (``REPLAYED`` + topic -> count,
# committed with the messages), which the daemon turns into messages_accepted{source=replay}.
REPLAYED = b"replayed:"
