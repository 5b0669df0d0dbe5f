"""The send-eligibility rule (agent/forwarder/eligibility.py): each of its discards, their
order of precedence, and that both delivery loops discard by it, the same message for the
same reason.

Pure logic: stored values are built here with the buffer's codec and ids of a chosen age,
and the loops' send steps are handed them directly, with fake producers (fakes.py's
fakes) that record what was produced."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import reasons
from agent.buffer import codec, keys
from agent.buffer.store import Corrupt, DeliveredRun, Outcome, Store, StoredMessage, message
from agent.config import BufferConfig, FerryConfig, ForwarderConfig, TopicConfig
from agent.forwarder.discard_log import Discard, DiscardLog
from agent.forwarder.eligibility import Unsendable, judge
from agent.forwarder.forwarder import Forwarder
from agent.forwarder.partitioner import TopicLayout
from agent.forwarder.topic_state import TopicState
from agent.forwarder.transactions import ExactlyOnce, _Batch
from agent.metrics import Registry
from agent.records import Record
from tests.forwarder.fakes import FakeCluster, FakeProducer, steps_until
from tests.waiting import wait_until

TOPIC = "t"
TTL_SECONDS = 60
MAX_BYTES = 100
SETTINGS = TopicConfig(ttl_seconds=TTL_SECONDS, max_message_bytes=MAX_BYTES)
NOW_MS = 1_800_000_000_000
YOUNG_MS = NOW_MS - 1_000  # accepted a second ago
OLD_MS = NOW_MS - (TTL_SECONDS + 1) * 1000  # accepted past the TTL


def stored(value: bytes, *, generation: int = 1, accepted_ms: int = YOUNG_MS, seq: int = 0,
           key: bytes | None = None, headers: tuple[tuple[str, bytes], ...] = ()
           ) -> tuple[bytes, bytes]:
    """An ``(id, stored value)`` pair as ``Store.read_values`` returns it."""
    record = Record(TOPIC, value, key=key, timestamp_ms=accepted_ms, headers=headers)
    return keys.make_id(accepted_ms, seq), codec.encode(record, generation)


def decoded(pair: tuple[bytes, bytes]) -> StoredMessage | Corrupt:
    return message(TOPIC, *pair)


def verdict(pair: tuple[bytes, bytes], generation: int = 1, check_ttl: bool = True
            ) -> Unsendable | None:
    return judge(decoded(pair), SETTINGS, generation, MAX_BYTES, NOW_MS, check_ttl)


# -- each rule --------------------------------------------------------------------------------
def test_a_young_small_message_of_the_current_generation_is_sent() -> None:
    assert verdict(stored(b"x" * MAX_BYTES)) is None  # exactly the limit is allowed
    assert verdict(stored(b"x", key=b"k", headers=(("h", b"v"),))) is None


def test_a_value_that_does_not_decode_is_corrupt() -> None:
    m = decoded((keys.make_id(YOUNG_MS, 0), b"\x01\x02 not a stored value"))
    assert isinstance(m, Corrupt)
    why = judge(m, SETTINGS, 1, MAX_BYTES, NOW_MS)
    assert why == Unsendable(reasons.CORRUPT, m.error)


def test_a_message_of_an_older_generation_is_discarded_as_generation() -> None:
    why = verdict(stored(b"x", generation=1), generation=2)
    assert why is not None and why.reason == reasons.GENERATION
    assert "deleted" in why.detail
    assert verdict(stored(b"x", generation=2), generation=2) is None
    # A newer generation than the one known (the loop's view of it is a scan behind): sent.
    assert verdict(stored(b"x", generation=3), generation=2) is None


def test_key_and_value_together_larger_than_the_limit_are_too_large() -> None:
    why = verdict(stored(b"x" * (MAX_BYTES - 3), key=b"kkkk"))
    assert why == Unsendable(reasons.TOO_LARGE,
                             f"{MAX_BYTES + 1} bytes > max_message_bytes={MAX_BYTES}")
    assert verdict(stored(b"x" * (MAX_BYTES - 4), key=b"kkkk")) is None


def test_the_size_limit_is_the_one_given() -> None:
    m = decoded(stored(b"x" * 50))
    assert judge(m, SETTINGS, 1, 49, NOW_MS) == Unsendable(
        reasons.TOO_LARGE, "50 bytes > max_message_bytes=49")
    assert judge(m, SETTINGS, 1, 50, NOW_MS) is None


def test_a_message_older_than_the_ttl_is_discarded_as_ttl() -> None:
    why = verdict(stored(b"x", accepted_ms=OLD_MS))
    assert why == Unsendable(reasons.TTL, f"older than ttl_seconds={TTL_SECONDS}")
    at_the_limit = stored(b"x", accepted_ms=NOW_MS - TTL_SECONDS * 1000)
    assert verdict(at_the_limit) is None


def test_the_ttl_is_not_checked_when_the_caller_knows_none_expired() -> None:
    assert verdict(stored(b"x", accepted_ms=OLD_MS), check_ttl=False) is None
    # The other rules still hold without it.
    too_large = verdict(stored(b"x" * (MAX_BYTES + 1), accepted_ms=OLD_MS), check_ttl=False)
    assert too_large is not None and too_large.reason == reasons.TOO_LARGE


# -- precedence: corrupt, generation, size, TTL ----------------------------------------------
@pytest.mark.parametrize(("generation", "size", "accepted_ms", "reason"), [
    (1, MAX_BYTES + 1, OLD_MS, reasons.GENERATION),  # older generation, too large, expired
    (1, 1, OLD_MS, reasons.GENERATION),
    (1, MAX_BYTES + 1, YOUNG_MS, reasons.GENERATION),
    (2, MAX_BYTES + 1, OLD_MS, reasons.TOO_LARGE),  # too large and expired
    (2, 1, OLD_MS, reasons.TTL),
])
def test_the_first_rule_that_applies_names_the_reason(generation: int, size: int,
                                                      accepted_ms: int, reason: str) -> None:
    why = verdict(stored(b"x" * size, generation=generation, accepted_ms=accepted_ms),
                  generation=2)
    assert why is not None and why.reason == reason


def test_corrupt_comes_before_every_other_rule() -> None:
    # Old past the TTL, and its topic's generation moved on: still "corrupt", for its bytes
    # say nothing of its generation or size.
    m = decoded((keys.make_id(OLD_MS, 0), b"\x00"))
    assert isinstance(m, Corrupt)
    why = judge(m, SETTINGS, 5, MAX_BYTES, NOW_MS)
    assert why is not None and why.reason == reasons.CORRUPT


# -- both loops use it ------------------------------------------------------------------------
def batch_to_judge(now_ms: int) -> list[tuple[bytes, bytes]]:
    """One read's ``(id, stored value)`` pairs, in id order, with one message per outcome
    (and one per precedence pair), ids aged against the real clock ``now_ms``."""
    old, young = now_ms - (TTL_SECONDS + 5) * 1000, now_ms - 1000
    big = b"x" * (MAX_BYTES + 1)
    pairs = [
        stored(b"expired", accepted_ms=old, seq=1),
        stored(b"old-generation", generation=0, accepted_ms=old, seq=2),  # and expired
        stored(big, accepted_ms=old, seq=3),  # too large and expired
        (keys.make_id(old, 4), b"\x01\x02 corrupt"),
        stored(b"old-generation, young", generation=0, accepted_ms=young, seq=5),
        stored(big, accepted_ms=young, seq=6),
        stored(b"sendable", accepted_ms=young, seq=7),
        stored(b"sendable, with a header", accepted_ms=young, seq=8,
               headers=(("h", b"v"),)),
    ]
    return sorted(pairs)


EXPECTED = {
    b"expired": reasons.TTL,
    b"old-generation": reasons.GENERATION,
    b"x" * (MAX_BYTES + 1): reasons.TOO_LARGE,
    b"old-generation, young": reasons.GENERATION,
}


class TransactionalFake(FakeProducer):
    """What the exactly-once loop's send step calls besides produce()."""

    def begin_transaction(self) -> None:
        pass

    def flush(self, timeout: float = 0) -> int:
        return 0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "buffer", 64 * 1024 * 1024)
    s.bump_generation(TOPIC)  # generation 1: the messages of generation 0 are of the old one
    try:
        yield s
    finally:
        s.close()


def config(tmp_path: Path) -> FerryConfig:
    return FerryConfig(buffer=BufferConfig(path=tmp_path / "buffer"),
                       forwarder=ForwarderConfig(agent_id="test-agent"))


def at_least_once_discards(tmp_path: Path, store: Store, pairs: list[tuple[bytes, bytes]],
                           now_ms: int) -> tuple[dict[bytes, str], list[bytes]]:
    """The reasons the at-least-once loop's send step discards with, by id, and what it
    produced. ``check_ttl``: the oldest message of the read is past the TTL."""
    cluster = FakeCluster()
    fwd = Forwarder(config(tmp_path), store, registry=Registry(),
                    discard_log=DiscardLog(tmp_path / "alo.jsonl"),
                    clusters={"local": cluster},  # type: ignore[dict-item]
                    topic_settings=lambda _: SETTINGS)
    fwd._send_values(TOPIC, pairs, TopicState(), SETTINGS, store.generation(TOPIC), True,
                     now_ms, cluster.p, cluster.layout(TOPIC), time.monotonic())
    discards: list[Discard] = fwd.leaving.discards()
    return ({keys.parse_id_text(d.message_id) or b"": d.reason for d in discards},
            [v for v, _ in cluster.p.sent])


def exactly_once_discards(tmp_path: Path, store: Store, pairs: list[tuple[bytes, bytes]]
                          ) -> tuple[dict[bytes, str], list[bytes]]:
    """The same for the exactly-once loop's send step (inside a transaction)."""
    cluster = FakeCluster()
    eo = ExactlyOnce(config(tmp_path), store, registry=Registry(),
                     topic_settings=lambda _: SETTINGS,
                     cluster=cluster,  # type: ignore[arg-type]
                     discard_log=DiscardLog(tmp_path / "eo.jsonl"))
    p: Any = TransactionalFake()
    discards: list[Discard] = []
    outcomes: list[Outcome] = []
    eo._send_values(p, TOPIC, pairs, None, _Batch(DeliveredRun(TOPIC, "local")), discards,
                    outcomes)
    assert [o.reason for o in outcomes] == [d.reason for d in discards]
    return ({keys.parse_id_text(d.message_id) or b"": d.reason for d in discards},
            [v for v, _ in p.sent])


def test_both_loops_discard_the_same_messages_for_the_same_reasons(
    tmp_path: Path, store: Store
) -> None:
    now_ms = int(time.time() * 1000)
    pairs = batch_to_judge(now_ms)
    alo, alo_sent = at_least_once_discards(tmp_path, store, pairs, now_ms)
    eo, eo_sent = exactly_once_discards(tmp_path, store, pairs)
    # The rule's own verdict on each message, against the topic's current generation.
    expected = {}
    for mid, v in pairs:
        why = judge(message(TOPIC, mid, v), SETTINGS, 1, MAX_BYTES, now_ms)
        if why is not None:
            expected[mid] = why.reason
    assert alo == expected
    assert eo == expected
    by_value = {}
    for mid, v in pairs:
        m = message(TOPIC, mid, v)
        by_value[m.record.value if isinstance(m, StoredMessage) else b"corrupt"] = expected.get(
            mid)
    assert by_value == {**EXPECTED, b"corrupt": reasons.CORRUPT, b"sendable": None,
                        b"sendable, with a header": None}
    assert sorted(alo_sent) == sorted(eo_sent) == [b"sendable", b"sendable, with a header"]


# -- and the at-least-once loop's retries and expiry ----------------------------------------
def discard_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_retry_is_judged_again_and_keeps_its_last_error(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = FakeCluster()
    log_path = tmp_path / "discards.jsonl"
    fwd = Forwarder(config(tmp_path), store, registry=Registry(),
                    discard_log=DiscardLog(log_path),
                    clusters={"local": cluster},  # type: ignore[dict-item]
                    topic_settings=lambda _: SETTINGS)
    store.append([[Record(TOPIC, b"late")]])
    assert steps_until(fwd, lambda: len(cluster.p.sent) == 1)
    later = time.time() + TTL_SECONDS + 5
    monkeypatch.setattr(time, "time", lambda: later)  # it waited past its TTL in flight
    cluster.p.fail(b"late")  # ... and its send failed: judged again before the retry
    assert steps_until(fwd, lambda: not store.topic_stats())
    wait_until(lambda: fwd.step() is not None and bool(discard_lines(log_path)), timeout=10,
               interval=0.001, message="the discard line")
    [line] = discard_lines(log_path)
    assert line["reason"] == reasons.TTL
    assert line["detail"].startswith(f"older than ttl_seconds={TTL_SECONDS}; last error: ")
    assert [v for v, _ in cluster.p.sent] == [b"late"]  # never sent again


class Unreachable(FakeCluster):
    """Partitions never known: the loop can only discard what waits at a topic's head."""

    def layout(self, topic: str) -> TopicLayout:
        return None  # type: ignore[return-value]


def test_the_head_of_a_topic_that_cannot_be_sent_to_leaves_by_the_same_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store(tmp_path / "buffer", 64 * 1024 * 1024) as store:
        real = time.time()
        for hours, value in ((2, b"old generation"), (1, b"expired")):
            with monkeypatch.context() as m:
                m.setattr(time, "time", lambda h=hours: real - h * 3600)  # accepted h ago
                store.append([[Record(TOPIC, value)]])
            if hours == 2:
                store.bump_generation(TOPIC)  # the topic deleted: that message is of the old one
        store.append([[Record(TOPIC, b"x" * (MAX_BYTES + 1)), Record(TOPIC, b"sendable"),
                       Record(TOPIC, b"behind it")]])
        log_path = tmp_path / "discards.jsonl"
        fwd = Forwarder(config(tmp_path), store, registry=Registry(),
                        discard_log=DiscardLog(log_path),
                        clusters={"local": Unreachable()},  # type: ignore[dict-item]
                        topic_settings=lambda _: SETTINGS)
        wait_until(lambda: fwd.step() is not None and len(discard_lines(log_path)) == 3
                   and sum(t.messages for t in store.topic_stats()) == 2, timeout=10,
                   interval=0.001, message="the head's discards")
        assert [d["reason"] for d in discard_lines(log_path)] == [
            reasons.GENERATION, reasons.TTL, reasons.TOO_LARGE]
        # The first message the rule would send ends the expiry: it and what follows wait.
        assert [m.record.value for m in store.read(TOPIC, None, 10)  # type: ignore[union-attr]
                ] == [b"sendable", b"behind it"]
