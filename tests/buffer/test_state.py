"""agent/buffer/state.py: the one way ``state`` is written, alone and with a group."""

from __future__ import annotations

import pytest

from agent.buffer.environment import Environment
from agent.buffer.state import StateChange, StateKeys, apply_change, write_state


def test_puts_then_deletes_in_one_transaction(env: Environment) -> None:
    keys = StateKeys(env)
    keys.update({b"p:a": b"1", b"p:b": b"2", b"q:c": b"3"})
    # A key both put and deleted in one call ends deleted: deletes come after puts.
    keys.update({b"p:a": b"10", b"p:d": b"4"}, deletes=[b"p:b", b"p:d", b"absent"])
    assert keys.items(b"p:") == [(b"p:a", b"10")]
    assert keys.get(b"q:c") == b"3"
    assert keys.get(b"p:b") is None


def test_a_change_derived_from_ids_is_written_with_its_group(env: Environment) -> None:
    seen: list[list[bytes]] = []

    def derive(ids: list[bytes]) -> dict[bytes, bytes]:
        seen.append(ids)
        return {b"idem:k": b",".join(ids)}

    change = StateChange({b"s:1": b"x"}, (b"s:old",), derive)
    with env.txn(write=True) as txn:
        write_state(txn, env.state, {b"s:old": b"y"})
        apply_change(txn, env.state, change, [b"id1", b"id2"])
        apply_change(txn, env.state, None, [b"id3"])  # no change: nothing written
    keys = StateKeys(env)
    assert seen == [[b"id1", b"id2"]]
    assert keys.items(b"") == [(b"idem:k", b"id1,id2"), (b"s:1", b"x")]


def test_a_failed_transaction_keeps_no_state(env: Environment) -> None:
    with pytest.raises(RuntimeError), env.txn(write=True) as txn:
        write_state(txn, env.state, {b"k": b"v"})
        raise RuntimeError("abort")
    assert StateKeys(env).get(b"k") is None
