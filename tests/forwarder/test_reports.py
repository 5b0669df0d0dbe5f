"""agent/forwarder/reports.py: what the producers' delivery reports become, as a room of its
own: an acknowledged message goes into its run for the batched delete and its 201 is
signalled; a failed send goes to the retry rules (retries.py) and the producer's queued
messages are purged behind it. (The same through the whole loop: test_send_path.py,
test_failure_paths.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from agent.config import TopicConfig
from agent.forwarder.flight import LOCAL, REMOTE, value_report
from agent.forwarder.topic_state import TopicState
from tests.forwarder.fakes import FakeMessage, Rooms


@pytest.fixture
def room(tmp_path: Path) -> Iterator[Rooms]:
    r = Rooms(tmp_path, LOCAL, REMOTE)
    yield r
    r.close()


def _sent(room: Rooms, seqs: range) -> tuple[TopicState, list[bytes], list[bytes]]:
    """Common-path sends of topic "t" (send.py): in flight, each with its report's sink."""
    st = room.shared.topics.setdefault("t", TopicState())
    stored = [room.stored(seq) for seq in seqs]
    st.in_flight += len(stored)
    st.sending += len(stored)
    room.shared.in_flight += len(stored)
    return st, [mid for mid, _ in stored], [v for _, v in stored]


def test_acknowledged_common_path_sends_leave_and_are_signalled(room: Rooms) -> None:
    st, mids, values = _sent(room, range(1, 4))
    for i, (mid, v) in enumerate(zip(mids, values, strict=True)):
        value_report(st.sink, mid, v, 0.0, None, FakeMessage(0, 100 + i))
    assert room.reports.pending()
    assert room.reports.handle() is True
    assert not room.reports.pending() and st.sending == 0
    assert room.ack.delivered == mids  # their 201s, at once, before the delete
    run = room.leaving.delivered_runs(0.0)[("t", LOCAL)]
    assert run.ids == mids and run.offsets == [100, 101, 102]
    assert room.leaving.waiting() == 3
    assert room.reports.handle() is False  # nothing new


def test_a_failed_send_goes_to_the_retry_rules_and_the_others_are_delivered(
    room: Rooms,
) -> None:
    st, mids, values = _sent(room, range(1, 4))
    failed = KafkaError(KafkaError._MSG_TIMED_OUT)
    for i, (mid, v) in enumerate(zip(mids, values, strict=True)):
        value_report(st.sink, mid, v, 0.0, failed if i == 1 else None, FakeMessage(0, i))
    assert room.reports.handle() is True
    assert room.ack.delivered == [mids[0], mids[2]]
    assert [f.msg.id for f in st.retry] == [mids[1]] and st.recovering
    assert st.retry[0].attempts == 1 and st.retry[0].sink is room.reports.sink
    assert room.registry.view().total("delivery_failures", topic="t") == 1


def test_a_message_acknowledged_by_both_clusters_leaves_once(room: Rooms) -> None:
    f = room.in_flight(TopicConfig(fallback_to_remote=True), 1)
    f.pending = 2  # sent to the local cluster, and speculatively to the remote one
    room.shared.topics["t"].sending = 2
    room.reports.on_delivery(f, LOCAL, None, FakeMessage(0, 7))
    room.reports.on_delivery(f, REMOTE, None, FakeMessage(3, 9))
    assert room.reports.handle() is True
    assert room.ack.delivered == [f.msg.id]
    assert room.leaving.waiting() == 1
    assert room.registry.view().total("messages_duplicate_acks", topic="t", cluster=REMOTE) == 1
