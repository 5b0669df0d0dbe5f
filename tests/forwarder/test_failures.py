"""The failure policy (agent/forwarder/failures.py): what an error does to a backlog.

A fault-injecting cluster (the fake producer of fakes.py) answers sends with the error
under test, as a cluster with a wrong ACL or without the topic would; the forwarder must keep
every message, flag the topic (its row, health naming topic and error), and deliver it all
once the fault is gone. Only errors that can never succeed discard, as ``invalid``."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from agent.config import TopicConfig
from agent.forwarder import failures
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.partitioner import TopicLayout
from agent.records import Record
from status import model
from tests.forwarder.fakes import FakeCluster, Setup, run_until

REPO = Path(__file__).resolve().parents[2]
COUNT = 20


def answer_all(cluster: FakeCluster, err: KafkaError | None) -> int:
    pending = [v for v, _ in cluster.p.pending]
    for v in pending:
        cluster.p._answer(v, err)
    return len(pending)


def health(fwd: Forwarder) -> dict[str, object]:
    fwd.cluster_watch.gauges()  # what the forwarder publishes twice a second
    ctx = model.Context(version="t", hostname="h", pid=1, started_at=time.time(),
                        now=time.time(), phase="running", ready=True, ready_reason="ready",
                        clusters={"local": "127.0.0.1:9092"})
    return model.everything(fwd.registry.view(), ctx)


@pytest.mark.parametrize("code", [
    KafkaError.TOPIC_AUTHORIZATION_FAILED,   # a wrong ACL
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.UNKNOWN_TOPIC_OR_PART,        # the topic not created on the cluster
    KafkaError._UNKNOWN_TOPIC,
], ids=lambda c: KafkaError(c).name())
def test_an_operator_fixable_error_keeps_the_backlog_flags_it_and_recovers(
    setup: Setup, code: int
) -> None:
    local = FakeCluster()
    fwd = setup.forwarder({"local": local}, lambda t: TopicConfig(ttl_seconds=3600))
    values = [b"m%02d" % i for i in range(COUNT)]
    setup.store.append([[Record("orders", v, key=b"k") for v in values]])
    name = KafkaError(code).name()
    # The fault: every send is refused, round after round of retries.
    failed = 0
    deadline = time.monotonic() + 10
    while failed < 5 * COUNT and time.monotonic() < deadline:
        fwd.step()
        failed += answer_all(local, KafkaError(code))
    assert failed >= 5 * COUNT, "the forwarder stopped retrying"
    for _ in range(20):
        fwd.step()
    # Nothing discarded, all of it still buffered.
    assert setup.discard_reasons() == []
    assert sum(s.messages for s in setup.store.topic_stats()) == COUNT
    assert fwd.registry.view().total("messages_discarded") == 0
    # The topic's row says why, and health names topic and error: CRITICAL.
    doc = health(fwd)
    row = next(t for t in doc["topics"] if t["topic"] == "orders")
    assert row["stuck"] is not None
    assert (row["stuck"]["error"], row["stuck"]["cluster"]) == (name, "local")
    assert row["stuck"]["operator"] is True and row["stuck"]["failures"] >= failed - COUNT
    assert doc["health"]["status"] == "critical"
    (problem,) = [p for p in doc["health"]["problems"] if p["check"] == "topic"]
    assert "topic orders" in problem["message"] and name in problem["message"]
    assert fwd.registry.view().total("topics_stuck") == 1  # what FerryTopicStuck reads
    # The operator fixes it: everything is delivered, and the flag goes.
    run_until(fwd, lambda: (answer_all(local, None) >= 0
                            and not setup.store.topic_stats()), "the backlog to deliver")
    assert fwd.registry.view().total("messages_delivered", topic="orders") == COUNT
    assert setup.discard_reasons() == []
    doc = health(fwd)
    assert next(t for t in doc["topics"] if t["topic"] == "orders")["stuck"] is None
    assert doc["health"]["status"] == "ok", doc["health"]
    assert fwd.registry.view().total("topics_stuck") == 0


@pytest.mark.parametrize("code", [KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD,
                                  KafkaError.INVALID_MSG],
                         ids=lambda c: KafkaError(c).name())
def test_an_error_that_can_never_succeed_discards_only_that_message(
    setup: Setup, code: int
) -> None:
    """Refused in a batch, then refused alone (isolation.py): only then discarded."""
    local = FakeCluster()
    fwd = setup.forwarder({"local": local})
    setup.store.append([[Record("t", b"bad"), Record("t", b"good")]])
    run_until(fwd, lambda: len(local.p.pending) == 2, "both sent")
    local.p._answer(b"bad", KafkaError(code))
    local.p.ack(b"good")
    run_until(fwd, lambda: len(local.p.pending) == 1, "the refused one sent again, alone")
    assert setup.discard_reasons() == []
    local.p._answer(b"bad", KafkaError(code))
    run_until(fwd, lambda: not setup.store.topic_stats(), "both to leave the buffer")
    assert setup.discard_reasons() == ["invalid"]
    view = fwd.registry.view()
    assert view.total("messages_discarded", topic="t", reason="invalid") == 1
    assert view.total("messages_refused", topic="t", error=KafkaError(code).name()) == 1
    assert view.total("messages_delivered", topic="t") == 1


def test_an_error_nobody_classified_is_retried() -> None:
    assert failures.policy(KafkaError.UNKNOWN).action == "retry"
    assert not failures.discards(KafkaError.UNKNOWN)


def test_only_message_errors_discard() -> None:
    discarding = {failures.name(c) for c, p in failures.POLICY.items()
                  if p.action == "discard"}
    assert discarding == {"TOPIC_EXCEPTION"}
    # The errors about a message or its batch: discarded only when refused alone.
    isolating = {failures.name(c) for c, p in failures.POLICY.items()
                 if p.action == "isolate"}
    assert isolating == {"MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE", "INVALID_MSG_SIZE",
                         "INVALID_MSG", "INVALID_RECORD", "INVALID_TIMESTAMP",
                         "_INVALID_DIFFERENT_RECORD"}
    assert not failures.refused_alone(KafkaError._INVALID_DIFFERENT_RECORD)
    assert failures.needs_operator(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert not failures.needs_operator(KafkaError._MSG_TIMED_OUT)


def test_design_md_holds_the_code_s_table() -> None:
    text = (REPO / "docs" / "design.md").read_text()
    assert failures.table() in text, "docs/design.md's failure table differs from the code"
    # Every error name the table lists is a real librdkafka error.
    for name in re.findall(r"^\| `([A-Z_]+)` \|", failures.table(), re.M):
        assert hasattr(KafkaError, name), name


class Unreachable(FakeCluster):
    """Partitions that cannot be learnt until ``reachable`` (the cluster does not answer
    for the topic): nothing is sent, so no send can fail to say why."""

    reachable = False

    def layout(self, topic: str) -> TopicLayout:
        return TopicLayout((0,), (0,)) if self.reachable else None  # type: ignore[return-value]


def test_a_topic_waiting_for_its_partitions_is_shown_stuck_with_the_cluster_state(
    setup: Setup,
) -> None:
    local = Unreachable(outage_after_seconds=0.2)
    fwd = setup.forwarder({"local": local})
    setup.store.append([[Record("orders", b"m")]])
    run_until(fwd, lambda: fwd._topics.get("orders") is not None
              and fwd._topics["orders"].stuck is not None, "the topic to be flagged")
    row = next(t for t in health(fwd)["topics"] if t["topic"] == "orders")
    assert row["stuck"]["error"] == "NO_PARTITIONS"
    assert "cluster local is up" in row["stuck"]["detail"]
    assert local.p.sent == []
    local.reachable = True
    run_until(fwd, lambda: answer_all(local, None) >= 0 and not setup.store.topic_stats(),
              "delivered once the partitions are known")
    assert next(t for t in health(fwd)["topics"] if t["topic"] == "orders")["stuck"] is None
