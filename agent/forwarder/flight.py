"""A message in flight on the forwarder's general send path, and the delivery reports its
sends leave behind.

The common path (send.py, ``Sending._send_values``) makes no Flight: its report carries the
message id and stored value instead (``ValueReport``), and a Flight is made only for a send
that failed and must be retried or discarded like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError, Message

from agent.buffer.store import StoredMessage, message
from agent.config import TopicConfig

LOCAL = "local"
REMOTE = "remote"


@dataclass(slots=True, eq=False)
class Flight:
    msg: StoredMessage
    settings: TopicConfig
    attempts: int = 0
    pending: int = 0  # produce() calls not yet reported
    sent_local_at: float | None = None
    sent_remote: bool = False
    sent_remote_at: float = 0.0
    done: bool = False
    last_error: str = ""
    # Kafka refused a batch this message was in: it is sent in a batch of its own until it
    # has its own verdict (isolation.py).
    alone: bool = False
    # Sent stamped with the send time, its own timestamp in a header (timestamps.py).
    restamp: bool = False
    # Where a local send's delivery report goes: the Flight itself is the on_delivery callback
    # of the common path, which saves a partial per message.
    sink: list[Report] | None = None

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        # Runs inside poll() on the forwarder's thread: just record; the reports room works.
        assert self.sink is not None
        self.sink.append((self, LOCAL, err, msg))


Report = tuple[Flight, str, KafkaError | None, Message]

# A report of the common path (_send_values): message id, its stored value, when it was sent,
# then the producer's (err, msg). No Flight exists for such a send until it fails.
ValueReport = tuple[bytes, bytes, float, KafkaError | None, Message]


def value_report(sink: list[ValueReport], mid: bytes, value: bytes, sent: float,
                 err: KafkaError | None, msg: Message) -> None:
    # The on_delivery of a common-path send, bound per message by a partial (the cheapest
    # callable that carries the message: no object of Ferry's per send). Runs inside poll()
    # on the forwarder's thread: just record; Reports.handle does the work.
    sink.append((mid, value, sent, err, msg))


def flight_of(topic: str, mid: bytes, value: bytes, settings: TopicConfig,
              sink: list[Report]) -> Flight:
    """The Flight of a common-path message that needs one (its send failed, or could not be
    made): decoded again from its stored value, which decoded when it was sent. Its local
    sends report to ``sink``."""
    m = message(topic, mid, value)
    assert isinstance(m, StoredMessage)
    f = Flight(m, settings)
    f.sink = sink
    return f
