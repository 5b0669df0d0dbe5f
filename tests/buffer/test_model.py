"""Model-based test of the buffer (Vector's approach): random operations against the real Store
and a plain in-memory model, which must agree after every step -- including across reopening.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.buffer import codec, keys
from agent.buffer.store import EncodedGroup, Outcome, Store, StoredMessage
from agent.records import Record

MB = 1024 * 1024
TOPICS = ("a", "b", "a.b")  # "a" is a prefix of "a.b": their FIFO ranges must not mix

records = st.builds(
    Record,
    topic=st.just(""),  # replaced by the rule's topic
    value=st.binary(max_size=64),
    key=st.none() | st.binary(max_size=8),
    partition_key=st.none() | st.integers(-(2**31), 2**31 - 1),
    timestamp_ms=st.integers(0, 2**41),
    headers=st.lists(st.tuples(st.sampled_from(["h", "ü"]), st.binary(max_size=4)),
                     max_size=2).map(tuple),
    hash_key=st.booleans(),
)
groups = st.lists(
    st.lists(st.tuples(st.sampled_from(TOPICS), records), min_size=0, max_size=4),
    min_size=1,
    max_size=3,
)


class Entry:
    """A message as the model knows it."""

    __slots__ = ("id", "record", "generation")

    def __init__(self, mid: bytes, record: Record, generation: int) -> None:
        self.id = mid
        self.record = record
        self.generation = generation

    @property
    def key(self) -> bytes:
        return keys.message_key(self.record.topic, self.id)

    @property
    def stored_bytes(self) -> int:
        return len(self.key) + len(codec.encode(self.record, self.generation))


def fields(r: Record) -> tuple[object, ...]:
    return (r.topic, r.value, r.key, r.partition_key, r.timestamp_ms, r.headers, r.hash_key)


class BufferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ferry-model-"))
        self.store = self._open()
        self.fifo: dict[str, list[Entry]] = {t: [] for t in TOPICS}
        self.generations: dict[str, int] = {}
        self.last_id = b""
        self.gone: list[Entry] = []  # removed messages, for duplicate acknowledgements

    def _open(self) -> Store:
        # A tiny initial map so that growth happens within a few steps.
        return Store(self.dir / "buffer", 64 * MB, initial_map_bytes=64 * 1024)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules ---------------------------------------------------------------------------------
    @rule(batch=groups, big=st.booleans(), encoded=st.lists(st.booleans(), min_size=3),
          stale=st.booleans())
    def append(self, batch: list[list[tuple[str, Record]]], big: bool, encoded: list[bool],
               stale: bool) -> None:
        recs = []
        for group in batch:
            rs = []
            for topic, r in group:
                value = r.value * 2000 if big else r.value  # sometimes large: grows the map
                rs.append(Record(topic, value, r.key, r.partition_key, r.timestamp_ms,
                                 r.headers, r.hash_key))
            recs.append(rs)
        # Some groups go in pre-encoded (the socket's path), sometimes under generation 0
        # while the topic has moved on: the store must re-encode them.
        as_given: list[list[Record] | EncodedGroup] = [
            self._encoded(rs, stale) if enc else rs
            for rs, enc in zip(recs, encoded, strict=False)]
        result = self.store.append(as_given)
        assert len(result) == len(recs)
        given: list[bytes] = []
        for rs, ids in zip(recs, result, strict=True):
            assert isinstance(ids, list), ids
            assert len(ids) == len(rs)
            for r, mid in zip(rs, ids, strict=True):
                # Within a call, each topic's ids increase in the order its messages came
                # (ids of different topics are given a topic at a time).
                fifo = self.fifo[r.topic]
                assert not fifo or mid > fifo[-1].id, "a topic's ids must strictly increase"
                fifo.append(Entry(mid, r, self.generations.get(r.topic, 0)))
                given.append(mid)
        # Across calls, every id is above every earlier one.
        assert not given or min(given) > self.last_id, "ids must increase across calls"
        assert len(set(given)) == len(given)
        self.last_id = max(given, default=self.last_id)

    def _encoded(self, rs: list[Record], stale: bool) -> EncodedGroup:
        runs: list[tuple[str, list[bytes], int]] = []
        for r in rs:
            gen = 0 if stale else self.generations.get(r.topic, 0)
            if not runs or runs[-1][0] != r.topic:
                runs.append((r.topic, [], gen))
            runs[-1][1].append(codec.encode(r, gen))
        return EncodedGroup(runs)

    @rule(topic=st.sampled_from(TOPICS), n=st.integers(1, 5))
    def deliver_oldest(self, topic: str, n: int) -> None:
        batch = self.store.read(topic, None, n)
        expected = self.fifo[topic][:n]
        assert [m.id for m in batch] == [e.id for e in expected]
        outcomes = []
        for m in batch:
            assert isinstance(m, StoredMessage)
            outcomes.append(Outcome(m.key, m.stored_bytes, topic, "delivered", cluster="local",
                                    partition=0, offset=1))
        assert self.store.remove(outcomes) == [True] * len(batch)
        del self.fifo[topic][: len(batch)]
        self.gone += expected
        for e in expected:
            where = self.store.locate(e.id)
            assert where is not None and where["state"] == "delivered"

    @precondition(lambda self: any(self.fifo.values()))
    @rule(data=st.data())
    def discard_some(self, data: st.DataObject) -> None:
        topic = data.draw(st.sampled_from([t for t in TOPICS if self.fifo[t]]))
        entries = self.fifo[topic]
        picked = sorted(data.draw(st.sets(st.integers(0, len(entries) - 1), min_size=1)))
        chosen = [entries[i] for i in picked]
        outcomes = [Outcome(e.key, e.stored_bytes, topic, "discarded", reason="ttl")
                    for e in chosen]
        assert self.store.remove(outcomes) == [True] * len(chosen)
        self.fifo[topic] = [e for i, e in enumerate(entries) if i not in set(picked)]
        self.gone += chosen
        for e in chosen:
            assert self.store.locate(e.id) is not None

    @precondition(lambda self: bool(self.gone))
    @rule(data=st.data())
    def acknowledge_again(self, data: st.DataObject) -> None:
        # A second cluster acknowledges messages already removed: nothing changes.
        again = data.draw(st.lists(st.sampled_from(self.gone), min_size=1, max_size=4))
        outcomes = [Outcome(e.key, e.stored_bytes, e.record.topic, "delivered",
                            cluster="remote") for e in again]
        assert self.store.remove(outcomes) == [False] * len(again)

    @rule(topic=st.sampled_from(TOPICS))
    def purge(self, topic: str) -> None:
        assert self.store.purge(topic) == len(self.fifo[topic])
        self.gone += self.fifo[topic]
        self.fifo[topic] = []

    @rule(topic=st.sampled_from(TOPICS))
    def bump_generation(self, topic: str) -> None:
        expected = self.generations.get(topic, 0) + 1
        assert self.store.bump_generation(topic) == expected
        self.generations[topic] = expected

    @rule()
    def close_and_reopen(self) -> None:
        self.store.close()
        self.store = self._open()

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def contents_match_the_model(self) -> None:
        for topic in TOPICS:
            got = self.store.read(topic, None, 1_000_000)
            want = self.fifo[topic]
            assert [m.id for m in got] == [e.id for e in want]
            for m, e in zip(got, want, strict=True):
                assert isinstance(m, StoredMessage)
                assert fields(m.record) == fields(e.record)
                assert m.generation == e.generation

    @invariant()
    def pages_match_the_model(self) -> None:
        # Reading on from the last id, as the forwarder does, in small pages.
        for topic in TOPICS:
            ids: list[bytes] = []
            after = None
            while page := self.store.read(topic, after, 2):
                ids += [m.id for m in page]
                after = page[-1].id
            assert ids == [e.id for e in self.fifo[topic]]

    @invariant()
    def stats_match_the_model(self) -> None:
        want = {
            t: (len(es), sum(e.stored_bytes for e in es), keys.id_timestamp_ms(es[0].id))
            for t, es in self.fifo.items()
            if es
        }
        got = {s.topic: (s.messages, s.bytes, s.oldest_ms) for s in self.store.topic_stats()}
        assert got == want
        assert sorted(self.store.topics()) == sorted(want)

    @invariant()
    def locate_finds_each_buffered_message_under_its_topic(self) -> None:
        for topic, entries in self.fifo.items():
            for e in entries:
                assert self.store.locate(e.id) == {"state": "buffered", "topic": topic}

    @invariant()
    def generations_match_the_model(self) -> None:
        assert self.store.generations() == self.generations


BufferMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_buffer_matches_the_model = BufferMachine.TestCase
