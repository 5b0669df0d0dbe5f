"""The exactly-once loop's isolation bookkeeping (agent/forwarder/suspects.py), alone: windows
that halve when refused and double when accepted, and a window of one as a verdict. The same
rules on Apache Kafka are in test_kafka_refusals.py."""

from __future__ import annotations

from agent.forwarder.suspects import Suspects


def ids(n: int) -> list[bytes]:
    return [b"m%03d" % i for i in range(n)]


def test_a_refused_batch_makes_suspects_and_the_first_window_half_of_them() -> None:
    s = Suspects()
    s.begin()
    sent = ids(8)
    s.refused("t", sent, sent)  # a whole batch refused, none in a window
    assert all(m in s for m in sent) and len(s) == 8
    s.begin()
    assert s.open_window("t") == 4
    assert s.open_window("t") == 0, "one window per topic per transaction"


def test_windows_halve_until_the_culprit_is_alone() -> None:
    s = Suspects()
    msgs = ids(8)
    s.refused("t", msgs, msgs)
    culprit = msgs[5]
    size = 0
    for _ in range(10):  # bounded: 8 suspects need at most 2 log2(8) rounds
        s.begin()
        size = s.open_window("t")
        window = [m for m in msgs if m in s][:size]
        for m in window:
            s.in_window(m, size)
        if culprit in window:
            s.refused("t", window, window)
            if s.alone(culprit):
                break
        else:
            s.delivered(["t"], window)
    assert s.alone(culprit) and size == 1
    # Everything but the culprit (and what the last windows did not reach) is cleared.
    assert culprit in s and len(s) <= 3


def test_window_members_a_refusal_did_not_touch_are_cleared() -> None:
    s = Suspects()
    msgs = ids(4)
    s.refused("t", msgs, msgs)
    s.begin()
    size = s.open_window("t")
    for m in msgs[:size]:
        s.in_window(m, size)
    # The window's batches on other partitions were accepted: only msgs[0] was refused.
    s.refused("t", [msgs[0]], msgs[:size])
    assert msgs[0] in s and msgs[1] not in s
    assert msgs[2] in s and msgs[3] in s, "not sent in the window: still suspects"


def test_delivered_clears_restamp_marks_even_without_suspects() -> None:
    s = Suspects()
    s.restamp.add(b"old")
    s.begin()
    s.delivered(["t"], [b"old"])
    assert s.restamp == set() and not s
