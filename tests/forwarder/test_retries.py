"""agent/forwarder/retries.py: what a failed send becomes (a discard, the other cluster, a
retry in id order), as a room of its own: fake clusters, the real Leaving and StuckTopics,
and the two send acts it is handed recorded. (The same through the whole loop:
tests/forwarder/test_failure_paths.py, test_order.py, test_fallback.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import reasons
from agent.buffer import keys
from agent.config import TopicConfig
from agent.forwarder.flight import LOCAL, REMOTE
from tests.forwarder.fakes import BACKOFF, Rooms


@pytest.fixture
def room(tmp_path: Path) -> Iterator[Rooms]:
    r = Rooms(tmp_path, LOCAL)
    yield r
    r.close()


def test_failed_sends_are_sent_again_in_id_order_once_their_back_off_passed(room: Rooms) -> None:
    flights = [room.in_flight(TopicConfig(), seq) for seq in (1, 2, 3)]
    for f in (flights[2], flights[0], flights[1]):  # reports come in any order
        room.retries.failed(f, LOCAL, "Local: Broker transport failure", permanent=False,
                            code="_TRANSPORT")
    now = time.monotonic()
    assert room.shared.topics["t"].recovering  # reads nothing new until they are re-sent
    assert room.retries.due(now, {}) is False  # the back-off has not passed
    assert room.retries.due(now + BACKOFF + 0.1, {}) is True
    assert room.sent == flights
    assert [f.attempts for f in flights] == [1, 1, 1]
    assert room.shared.topics["t"].stuck is not None  # shown as stuck until it delivers
    assert room.shared.retry_topics == set()


def test_a_retry_waits_while_an_earlier_send_of_its_topic_has_not_reported(room: Rooms) -> None:
    f = room.in_flight(TopicConfig(), 1)
    room.retries.failed(f, LOCAL, "timed out", permanent=False)
    room.shared.topics["t"].sending = 1  # a send of the topic still in librdkafka's hands
    later = time.monotonic() + 10 * BACKOFF
    assert room.retries.due(later, {}) is False and room.sent == []
    room.shared.topics["t"].sending = 0
    assert room.retries.due(later, {}) is True and room.sent == [f]


def test_a_final_verdict_and_the_last_attempt_discard_with_their_reasons(room: Rooms) -> None:
    refused = room.in_flight(TopicConfig(), 1)
    room.retries.failed(refused, LOCAL, "Broker: Message size too large", permanent=True,
                        code="MSG_SIZE_TOO_LARGE")
    last = room.in_flight(TopicConfig(max_attempts=2), 2)
    room.retries.failed(last, LOCAL, "timed out", permanent=False)
    assert room.retries.due(time.monotonic() + BACKOFF + 0.1, {}) is True
    last.pending -= 1  # the retry's report came (reports.py takes it off): failed again
    room.retries.failed(last, LOCAL, "timed out", permanent=False)
    assert [(d.reason, d.message_id) for d in room.leaving.discards()] == [
        (reasons.INVALID, keys.id_text(refused.msg.id)),
        (reasons.ATTEMPTS, keys.id_text(last.msg.id)),
    ]
    assert refused.done and last.done and room.sent == [last]


def test_a_retry_of_a_topic_deleted_meanwhile_is_discarded_not_sent(room: Rooms) -> None:
    f = room.in_flight(TopicConfig(), 1)
    room.retries.failed(f, LOCAL, "timed out", permanent=False)
    assert room.retries.due(time.monotonic() + BACKOFF + 0.1, {"t": 1}) is True
    assert room.sent == []
    assert [d.reason for d in room.leaving.discards()] == [reasons.GENERATION]


@pytest.mark.parametrize("remote_takes_it", [True, None])
def test_a_fallback_topic_s_failed_local_send_goes_to_the_remote_cluster_at_once(
    tmp_path: Path, remote_takes_it: bool | None
) -> None:
    room = Rooms(tmp_path, LOCAL, REMOTE, produce=remote_takes_it)
    try:
        f = room.in_flight(TopicConfig(fallback_to_remote=True), 1)
        room.retries.failed(f, LOCAL, "timed out", permanent=False)
        assert room.produced == [(f, REMOTE)]
        # Sent there: nothing else to do. Not now (its partitions not known yet): a retry.
        assert (room.shared.topics["t"].retry == []) is bool(remote_takes_it)
        assert f.attempts == (0 if remote_takes_it else 1)
    finally:
        room.close()
