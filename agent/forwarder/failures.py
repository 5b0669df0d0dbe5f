"""The failure policy: for every Kafka error the forwarder can see, retry or discard, and why.

The promise is that nothing acknowledged is lost by accident, so the default is to keep a
message and send it again (until its topic's ``ttl_seconds``, or ``max_attempts``). Only an
error that can never succeed for *that message* discards it (reason ``invalid``): sending the
same bytes again would fail the same way for ever and hold its topic up behind it.

Kafka validates a whole record batch and refuses it whole, and librdkafka then fails every
message of the batch with the batch's error. So an error about the message itself (too large,
a bad timestamp, a record the topic cannot take) says only that *something* in its batch was
refused: those errors ``isolate`` the message, which is sent again in a batch of its own
(isolation.py), and only a message refused alone is discarded, with Kafka's reason. This is
what Kafka's Java producer does for a batch too large, extended to every per-record refusal.

Errors an operator can fix (an ACL, a topic not created yet, credentials) are retried too:
a wrong ACL must cost a delay, never the backlog. While a topic fails with one of those, its
row on the status page says so and health is CRITICAL naming the topic and the error
(``operator`` below); any other error that keeps a topic from delivering makes it WARNING.

docs/design.md ("Failure policy") holds this table as a document; tests/forwarder/
test_failures.py checks that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from confluent_kafka import KafkaError

Action = Literal["retry", "discard", "isolate"]


@dataclass(frozen=True, slots=True)
class Policy:
    action: Action
    operator: bool  # only a person can make it succeed (health CRITICAL while a topic waits)
    why: str


def _discard(why: str) -> Policy:
    return Policy("discard", False, why)


def _retry(why: str, operator: bool = False) -> Policy:
    return Policy("retry", operator, why)


def _isolate(why: str) -> Policy:
    return Policy("isolate", False, why)


_E = KafkaError

POLICY: dict[int, Policy] = {
    # The message itself, or a neighbour in its batch: sent again alone; discarded only when
    # refused alone (the same bytes alone fail the same way for ever).
    _E.MSG_SIZE_TOO_LARGE: _isolate(
        "the batch (or the message alone) is larger than the topic's max.message.bytes"),
    _E.RECORD_LIST_TOO_LARGE: _isolate("the batch is larger than a request may be"),
    _E.INVALID_MSG_SIZE: _isolate("the broker finds the batch's size invalid"),
    _E.INVALID_MSG: _isolate(
        "the broker refuses a record as corrupt (on older brokers: a message without a key "
        "for a compacted topic)"),
    _E.INVALID_RECORD: _isolate(
        "the broker refuses a record (e.g. no key for a compacted topic)"),
    _E.INVALID_TIMESTAMP: _isolate(
        "a timestamp is outside the topic's message.timestamp.before/after.max.ms; alone, "
        "the timestamp rule decides (timestamps.py)"),
    _E.TOPIC_EXCEPTION: _discard("the topic name is invalid for this cluster"),
    # Fixable by an operator: keep the backlog, flag the topic, CRITICAL.
    _E.TOPIC_AUTHORIZATION_FAILED: _retry(
        "an ACL refuses Ferry's principal; fixing the ACL lets the backlog through", True),
    _E.CLUSTER_AUTHORIZATION_FAILED: _retry(
        "an ACL refuses Ferry's principal (e.g. IdempotentWrite for acks=all)", True),
    _E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: _retry(
        "an ACL refuses Ferry's transactional id (exactly-once topics: WRITE and DESCRIBE on "
        "TransactionalId ferry-*; docs/configuration.md, \"ACLs\")", True),
    _E.GROUP_AUTHORIZATION_FAILED: _retry(
        "an ACL refuses the group Ferry reads its exactly-once progress with (READ and "
        "DESCRIBE on Group ferry-progress-*)", True),
    _E.SASL_AUTHENTICATION_FAILED: _retry("the cluster refuses Ferry's credentials", True),
    _E._AUTHENTICATION: _retry("the cluster refuses Ferry's credentials", True),
    _E._SSL: _retry("TLS fails (certificate, trust store, protocol)", True),
    _E.UNKNOWN_TOPIC_OR_PART: _retry(
        "the topic does not exist on the cluster (auto-create off): kept until it is "
        "created, or until the TTL", True),
    _E._UNKNOWN_TOPIC: _retry(
        "the topic is not in the cluster's metadata: kept until it is created, or until "
        "the TTL", True),
    _E.UNSUPPORTED_FOR_MESSAGE_FORMAT: _retry(
        "the topic's message format is too old for this message (e.g. headers); an upgrade "
        "fixes it", True),
    _E.POLICY_VIOLATION: _retry("a broker policy refuses the request", True),
    _E.INVALID_REQUIRED_ACKS: _retry("the cluster refuses the configured acks", True),
    # Transient: the cluster or the network, not the message.
    _E._MSG_TIMED_OUT: _retry(
        "not acknowledged within forwarder.message_timeout_ms (cluster down or slow)"),
    _E._TIMED_OUT: _retry("a request timed out"),
    _E.REQUEST_TIMED_OUT: _retry("the broker timed out the request"),
    _E._TRANSPORT: _retry("the connection failed"),
    _E._ALL_BROKERS_DOWN: _retry("no broker connection is up"),
    _E.NETWORK_EXCEPTION: _retry("the connection failed"),
    _E.BROKER_NOT_AVAILABLE: _retry("a broker is unavailable"),
    _E.NOT_LEADER_FOR_PARTITION: _retry("partition leadership moved"),
    _E.LEADER_NOT_AVAILABLE: _retry("a leader election is under way"),
    _E._UNKNOWN_PARTITION: _retry("the partition is not in the metadata (yet)"),
    _E.NOT_ENOUGH_REPLICAS: _retry("fewer in-sync replicas than min.insync.replicas"),
    _E.NOT_ENOUGH_REPLICAS_AFTER_APPEND: _retry(
        "fewer in-sync replicas than min.insync.replicas"),
    _E.KAFKA_STORAGE_ERROR: _retry("a broker's disk failed"),
    _E.THROTTLING_QUOTA_EXCEEDED: _retry("a quota throttles Ferry"),
    # The producer's own state: the forwarder starts a fresh producer, then sends again.
    _E._FATAL: _retry("the producer reached a fatal state; a new one is made"),
    _E.OUT_OF_ORDER_SEQUENCE_NUMBER: _retry("idempotence lost its sequence; a new producer"),
    _E.UNKNOWN_PRODUCER_ID: _retry("the cluster forgot the producer id; a new producer"),
    _E.INVALID_PRODUCER_EPOCH: _retry("the producer was fenced; a new producer"),
    # Ferry's own withdrawals (to keep order behind a failed send); never counted as attempts.
    _E._PURGE_QUEUE: _retry("Ferry withdrew a queued send to keep per-key order"),
    _E._PURGE_INFLIGHT: _retry("Ferry withdrew an in-flight send (producer replaced)"),
}

# librdkafka's word for a message failed only because another record of its batch was
# refused (KIP-467): innocent, sent again alone. Absent from older librdkafka builds.
INVALID_DIFFERENT_RECORD: int | None = getattr(_E, "_INVALID_DIFFERENT_RECORD", None)
if INVALID_DIFFERENT_RECORD is not None:
    POLICY[INVALID_DIFFERENT_RECORD] = _isolate(
        "another record of the same batch was refused: this one is innocent")

# Any other error: kept and retried. A code not listed above is one nobody judged; the safe
# verdict for a store-and-forward agent is to keep the message.
DEFAULT = _retry("not classified: kept and retried until the TTL")


def policy(code: int) -> Policy:
    return POLICY.get(code, DEFAULT)


def discards(code: int) -> bool:
    """True for the errors after which the message can never be delivered, whatever it
    was sent with."""
    p = POLICY.get(code)
    return p is not None and p.action == "discard"


def isolates(code: int) -> bool:
    """True for a refusal of the batch the message was in: it needs a send of its own."""
    p = POLICY.get(code)
    return p is not None and p.action == "isolate"


def refused_alone(code: int) -> bool:
    """True when ``code``, answered to a message sent alone (or refused by produce() before
    any batch), is the verdict on that message itself."""
    return discards(code) or (isolates(code) and code != INVALID_DIFFERENT_RECORD)


def needs_operator(code: int) -> bool:
    p = POLICY.get(code)
    return p is not None and p.operator


# Operator errors that are not the cluster's answer about a message: with these the client
# never got as far as asking.
_NOT_ANSWERS = frozenset({_E.SASL_AUTHENTICATION_FAILED, _E._AUTHENTICATION, _E._SSL})


def answered(code: int) -> bool:
    """True when the error is the cluster's verdict on the message or its topic (discarded,
    or only an operator can fix it): proof the cluster answers, for its state (health.py)."""
    p = POLICY.get(code)
    return (p is not None and (p.action != "retry" or p.operator)
            and code not in _NOT_ANSWERS)


def name(code: int) -> str:
    """The error's name as the metrics label and the page show it (e.g. TOPIC_AUTHORIZATION_
    FAILED)."""
    return KafkaError(code).name()


def table() -> str:
    """The policy as the Markdown table of docs/design.md."""
    lines = ["| error | action | operator | why |", "| --- | --- | --- | --- |"]
    for code, p in POLICY.items():
        lines.append(f"| `{name(code)}` | {p.action} | {'yes' if p.operator else ''} "
                     f"| {p.why} |")
    lines.append(f"| any other | {DEFAULT.action} | | {DEFAULT.why} |")
    return "\n".join(lines)
