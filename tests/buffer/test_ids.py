"""agent/buffer/ids.py: ids given in runs, and the runs that index a topic."""

from __future__ import annotations

import pytest

from agent.buffer import keys
from agent.buffer.environment import Environment
from agent.buffer.ids import IdCounter, extend_runs, follows, run_ids, run_span

MAX_SEQ = 0xFFFFFFFF


def test_a_run_of_ids_follows_on_and_says_where_the_next_starts() -> None:
    ids, ts, seq = run_ids(1000, 5, 3)
    assert ids == [keys.make_id(1000, 5), keys.make_id(1000, 6), keys.make_id(1000, 7)]
    assert (ts, seq) == (1000, 8)
    assert all(follows(a, b) for a, b in zip(ids, ids[1:], strict=False))


def test_a_sequence_that_would_wrap_carries_into_the_next_millisecond() -> None:
    ids, ts, seq = run_ids(1000, MAX_SEQ - 1, 4)
    assert ids == [keys.make_id(1000, MAX_SEQ - 1), keys.make_id(1000, MAX_SEQ),
                   keys.make_id(1001, 0), keys.make_id(1001, 1)]
    assert (ts, seq) == (1001, 2)
    assert ids == sorted(ids) and len(set(ids)) == 4
    assert all(follows(a, b) for a, b in zip(ids, ids[1:], strict=False))
    assert run_span(ids[0], ids[-1]) >= len(ids)


def test_follows_only_the_very_next_id() -> None:
    assert follows(keys.make_id(5, 1), keys.make_id(5, 2))
    assert not follows(keys.make_id(5, 1), keys.make_id(5, 3))
    assert not follows(keys.make_id(5, 1), keys.make_id(6, 0))
    assert follows(keys.make_id(5, MAX_SEQ), keys.make_id(6, 0))


def test_runs_grow_only_with_the_same_topic_and_the_next_id() -> None:
    runs: list[list[bytes]] = []
    a, b, c, d = (keys.make_id(9, i) for i in range(4))
    extend_runs(runs, b"x", a)
    extend_runs(runs, b"x", b)  # the next id of the same topic: the run grows
    extend_runs(runs, b"y", c)  # another topic: a run of its own
    extend_runs(runs, b"y", keys.make_id(9, 9), keys.make_id(9, 12))  # a gap: a new run
    assert runs == [[b"x", a, b], [b"y", c, c], [b"y", keys.make_id(9, 9), keys.make_id(9, 12)]]
    extend_runs(runs, b"x", d)  # x again, but y's ids lie between
    assert runs[-1] == [b"x", d, d]


def test_run_span_counts_the_ids_between_inclusive() -> None:
    assert run_span(keys.make_id(3, 10), keys.make_id(3, 10)) == 1
    assert run_span(keys.make_id(3, 10), keys.make_id(3, 19)) == 10
    assert run_span(keys.make_id(3, MAX_SEQ), keys.make_id(4, 0)) == 2


def test_the_counter_goes_on_from_the_last_id_even_when_the_clock_is_behind(
    env: Environment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.buffer.clock.now_ms", lambda: 2_000)
    with env.txn(write=True) as txn:
        counter = IdCounter(txn, env.meta)
        assert counter.take(2) == [keys.make_id(2_000, 0), keys.make_id(2_000, 1)]
        counter.save(txn, env.meta)
    monkeypatch.setattr("agent.buffer.clock.now_ms", lambda: 1_000)  # stepped back
    with env.txn(write=True) as txn:
        counter = IdCounter(txn, env.meta)
        assert counter.take(1) == [keys.make_id(2_000, 2)]
        counter.save(txn, env.meta)
    monkeypatch.setattr("agent.buffer.clock.now_ms", lambda: 3_000)  # moved on
    with env.txn(write=True) as txn:
        assert IdCounter(txn, env.meta).take(1) == [keys.make_id(3_000, 0)]
