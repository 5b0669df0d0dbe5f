"""agent/forwarder/brokers.py: which brokers the agent cannot reach, from librdkafka's
statistics (pure logic; the documents are shaped as librdkafka 2.16 writes them, with the
fields read here)."""

from __future__ import annotations

import json
from typing import Any

from agent.forwarder.brokers import HOLD_SECONDS, BrokerWatch, brokers, queued_messages


def _broker(node: int, state: str = "UP", rxidle_ms: int = 5, waitresp: int = 0,
            parts: tuple[tuple[str, int], ...] = (("t", 0),), messages: int = 0,
            throttle_ms: int = 0) -> dict[str, Any]:
    return {"name": f"127.0.0.1:{9000 + node}/{node}", "nodeid": node,
            "nodename": f"127.0.0.1:{9000 + node}", "state": state, "stateage": 1_000_000,
            "outbuf_cnt": 0, "outbuf_msg_cnt": 0, "waitresp_cnt": waitresp,
            "waitresp_msg_cnt": messages,
            "rxidle": rxidle_ms * 1000 if rxidle_ms >= 0 else -1,
            "throttle": {"min": 0, "max": throttle_ms, "avg": 0, "cnt": 1 if throttle_ms else 0},
            "toppars": {f"{t}-{p}": {"topic": t, "partition": p} for t, p in parts}}


def _stats(*bs: dict[str, Any]) -> str:
    bootstrap = {"name": "127.0.0.1:9001/bootstrap", "nodeid": -1, "state": "DOWN",
                 "toppars": {}}
    doc = {"name": "ferry-local-all", "type": "producer",
           "brokers": {b["name"]: b for b in (bootstrap, *bs)},
           "topics": {"t": {"topic": "t", "partitions": {"0": {"partition": 0}}}}}
    return json.dumps(doc)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(clock: Clock, quiet_after: float = 5.0) -> BrokerWatch:
    return BrokerWatch(quiet_after, clock=clock, wall=lambda: clock.now + 1e9)


def test_only_learned_brokers_are_read_and_their_partitions_kept() -> None:
    found = brokers(_stats(_broker(1, parts=(("t", 0), ("u", 3))), _broker(2, parts=())))
    assert [(b.node, b.partitions) for b in found] == [(1, (("t", 0), ("u", 3))), (2, ())]
    assert brokers("not json") == [] and brokers('{"brokers": 3}') == []


def test_a_broker_with_requests_out_and_nothing_back_is_unreachable_after_quiet_after() -> None:
    clock = Clock()
    w = _watch(clock)
    healthy = _broker(2, rxidle_ms=3, waitresp=4, parts=(("t", 1),))
    assert not w.sample("p", _stats(_broker(1, waitresp=5, rxidle_ms=2000), healthy))
    clock.now += 2.0
    assert not w.sample("p", _stats(_broker(1, waitresp=5, rxidle_ms=4000), healthy))
    clock.now += 1.5  # nothing received from node 1 for 5.5 s
    assert w.sample("p", _stats(_broker(1, waitresp=5, rxidle_ms=5500, messages=40), healthy))
    gone = w.unreachable()
    assert list(gone) == [1] and gone[1].partitions == (("t", 0),)
    assert gone[1].address == "127.0.0.1:9001"
    assert w.stranded() == 40
    assert "broker 1 (127.0.0.1:9001) does not answer" in w.describe()
    # It answers again: reachable at the next sample.
    clock.now += 1.0
    assert w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=10), healthy))
    assert w.unreachable() == {} and w.stranded() == 0 and w.describe() == ""


def test_reconnecting_without_success_is_quiet_from_the_first_attempt() -> None:
    """A broker librdkafka keeps trying to reach (connecting states, reset every attempt)
    is quiet since the first attempt; a DOWN sample between attempts says nothing."""
    clock = Clock()
    w = _watch(clock)
    for state in ("CONNECT", "DOWN", "APIVERSION_QUERY", "TRY_CONNECT", "DOWN"):
        assert not w.unreachable()
        w.sample("p", _stats(_broker(1, state=state, rxidle_ms=-1, waitresp=1)))
        clock.now += 1.0
    assert w.sample("p", _stats(_broker(1, state="CONNECT", rxidle_ms=-1)))
    assert list(w.unreachable()) == [1]


def test_idle_brokers_and_brokers_leading_nothing_are_never_unreachable() -> None:
    clock = Clock()
    w = _watch(clock)
    for _ in range(20):
        w.sample("p", _stats(_broker(1, rxidle_ms=60_000),  # idle: nothing waiting
                             _broker(2, state="CONNECT", parts=()),  # leads nothing of ours
                             _broker(3, state="DOWN", rxidle_ms=-1)))  # closed when idle
        clock.now += 1.0
    assert w.unreachable() == {}


def test_a_connecting_broker_that_comes_up_is_not_held_against_it() -> None:
    clock = Clock()
    w = _watch(clock)
    w.sample("p", _stats(_broker(1, state="TRY_CONNECT", rxidle_ms=-1)))
    clock.now += 1.0
    w.sample("p", _stats(_broker(1, state="UP", rxidle_ms=-1)))  # connected, nothing waiting
    for _ in range(10):
        clock.now += 1.0
        w.sample("p", _stats(_broker(1, rxidle_ms=30_000)))  # idle since
    assert w.unreachable() == {}


def test_another_client_answered_by_the_same_broker_keeps_it_reachable() -> None:
    clock = Clock()
    w = _watch(clock)
    for _ in range(8):
        w.sample("stuck", _stats(_broker(1, waitresp=5, rxidle_ms=-1, state="APIVERSION_QUERY")))
        w.sample("fine", _stats(_broker(1, waitresp=2, rxidle_ms=20)))
        clock.now += 1.0
    assert w.unreachable() == {}


def test_a_quota_s_throttle_lengthens_the_wait_before_a_verdict() -> None:
    """A broker enforcing a quota delays its answers on purpose (its throttle time):
    that much longer without an answer is not yet unreachable."""
    clock = Clock()
    w = _watch(clock)
    w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=10, throttle_ms=4000)))
    for rxidle in (1000, 3000, 6000, 8000):
        clock.now += 2.0
        w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=rxidle)))
    assert w.unreachable() == {}  # 8 s < 5 s + 4 s of throttle
    clock.now += 2.0
    w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=10_000)))
    assert list(w.unreachable()) == [1]


def test_an_unreachable_broker_nothing_is_said_of_is_tried_again_after_the_hold() -> None:
    clock = Clock()
    w = _watch(clock, quiet_after=1.0)
    w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=2000)))
    assert list(w.unreachable()) == [1]
    clock.now += HOLD_SECONDS - 1
    w.sample("p", _stats(_broker(1, state="DOWN", rxidle_ms=-1)))  # no verdict either way
    assert list(w.unreachable()) == [1]
    clock.now += 1.0
    assert w.sample("p", _stats(_broker(1, state="DOWN", rxidle_ms=-1)))
    assert w.unreachable() == {}


def test_an_idle_connection_is_no_answer() -> None:
    """Another client's idle connection to the broker (UP, nothing waiting, nothing
    received) does not outweigh a client kept waiting: through a network gone silent, an
    idle connection stays UP."""
    clock = Clock()
    w = _watch(clock)
    for rxidle in range(0, 7000, 1000):
        w.sample("waiting", _stats(_broker(1, waitresp=3, rxidle_ms=rxidle)))
        w.sample("idle", _stats(_broker(1, rxidle_ms=20_000 + rxidle)))
        clock.now += 1.0
    assert list(w.unreachable()) == [1]


def test_a_broker_that_answers_a_request_of_its_own_is_in_reach_at_once() -> None:
    """The probe's reach check (probe.py) reaches a broker the statistics call quiet: it is
    in reach again at once, without waiting for the hold; an answer from one in reach
    changes nothing."""
    clock = Clock()
    w = _watch(clock, quiet_after=1.0)
    w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=2000)))
    assert list(w.unreachable()) == [1]
    assert not w.answered(2)
    clock.now += 0.5
    assert w.answered(1)
    assert w.unreachable() == {}


def test_a_check_left_unanswered_holds_a_broker_out_of_reach_past_the_hold() -> None:
    """While the probe's checks go unanswered, the hold does not run out: its partitions are
    not tried again for nothing. A broker in reach is not made unreachable by one."""
    clock = Clock()
    w = _watch(clock, quiet_after=1.0)
    w.unanswered(2)
    assert w.unreachable() == {}
    w.sample("p", _stats(_broker(1, waitresp=1, rxidle_ms=2000)))
    for _ in range(4):
        clock.now += HOLD_SECONDS / 2
        w.unanswered(1)
        assert not w.sample("p", _stats(_broker(1, state="DOWN", rxidle_ms=-1)))
    assert list(w.unreachable()) == [1]
    clock.now += HOLD_SECONDS  # the checks stopped: the hold runs out as before
    assert w.sample("p", _stats(_broker(1, state="DOWN", rxidle_ms=-1)))


def test_a_connection_caught_once_being_set_up_then_left_alone_is_no_verdict() -> None:
    """An idle agent's connection closed for idleness is set up again for a refresh: one
    sample may catch it connecting, the next ones find it neither connecting nor up (not
    wanted). That is no quiet spell, however long ago it began; a later one starts afresh."""
    clock = Clock()
    w = _watch(clock, quiet_after=2.0)
    w.sample("p", _stats(_broker(1, state="CONNECT", rxidle_ms=-1)))
    for _ in range(5):
        clock.now += 1.0
        assert not w.sample("p", _stats(_broker(1, state="INIT", rxidle_ms=-1)))
    assert w.unreachable() == {}
    # A real spell: connecting sample after sample, for quiet_after.
    clock.now += 1.0
    assert not w.sample("p", _stats(_broker(1, state="CONNECT", rxidle_ms=-1)))
    clock.now += 1.0
    assert not w.sample("p", _stats(_broker(1, state="APIVERSION_QUERY", rxidle_ms=-1)))
    clock.now += 1.0
    assert w.sample("p", _stats(_broker(1, state="CONNECT", rxidle_ms=-1)))
    assert list(w.unreachable()) == [1]


def test_the_messages_a_client_holds_are_its_own_msg_cnt_not_a_partitions() -> None:
    doc = json.loads(_stats(_broker(1)))
    # librdkafka writes the client's own fields first, then the brokers' and topics'.
    stats = json.dumps({"name": doc["name"], "msg_cnt": 3, "msg_size": 30, **doc})
    stats = stats.replace('"partition": 0}', '"partition": 0, "msg_cnt": 99}')
    assert queued_messages(stats) == 3
    assert queued_messages(stats.replace('"msg_cnt": 3', '"msg_cnt": 0')) == 0
    assert queued_messages(_stats(_broker(1))) is None  # says nothing
    assert queued_messages('{"msg_cnt": "x"}') is None
