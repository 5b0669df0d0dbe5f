"""The writer's wake-up of an idle forwarder (agent/signals/commit.py): a commit that stored
messages signals, a refused one does not, and an idle forwarder's wait ends on the signal
and reads a topic it had just found empty. Real buffer, real committer, real sockets; the
producer is the fake of tests/forwarder/fakes.py (pure logic)."""

from __future__ import annotations

import time
from pathlib import Path

from agent.buffer.committer import Committer
from agent.buffer.store import Store
from agent.config import TopicConfig
from agent.metrics import Registry
from agent.records import Record
from agent.signals.commit import CommitListener, CommitSender, socket_path
from tests.forwarder.fakes import FakeCluster, Setup


def test_a_commit_that_stored_messages_signals_and_a_refused_one_does_not(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "buffer", 1024 * 1024)
    listener = CommitListener(socket_path(tmp_path / "buffer"))
    sender = CommitSender(socket_path(tmp_path / "buffer"))
    committer = Committer(store, registry=Registry(), committed=sender.send)
    committer.start()
    try:
        assert listener.wait(0.0) is False  # nothing committed yet
        assert isinstance(committer.commit([Record("t", b"m")], "test"), list)
        assert listener.wait(30.0) is True
        assert listener.wait(0.0) is False  # consumed: one signal, one wake-up
        refused = committer.commit([Record("t", b"x" * (2 * 1024 * 1024))], "test")
        assert not isinstance(refused, list)  # larger than the whole buffer
        assert listener.wait(0.2) is False
    finally:
        committer.close()
        sender.close()
        listener.close()
        store.close()
    assert not socket_path(tmp_path / "buffer").exists()


def test_an_idle_forwarder_wakes_on_a_commit_and_reads_at_once(
        setup: Setup) -> None:
    cluster = FakeCluster()
    fwd = setup.forwarder({"local": cluster}, lambda t: TopicConfig())
    committer = Committer(setup.store, registry=Registry(),
                          committed=CommitSender(socket_path(setup.config.buffer.path)).send)
    committer.start()
    try:
        setup.store.append([[Record("t", b"first")]])
        for _ in range(1000):  # until "first" is sent and "t" found drained
            fwd.step()
            if cluster.p.sent:
                break
        cluster.p.ack(b"first")
        deadline = time.monotonic() + 5  # the delete is batched (DELETE_BATCH_SECONDS)
        while fwd.stats()["in_flight"] and time.monotonic() < deadline:
            fwd.step()
        assert fwd.stats()["in_flight"] == 0 and not fwd.step()  # idle, "t" just drained
        assert isinstance(committer.commit([Record("t", b"second")], "test"), list)
        started = time.monotonic()
        fwd._wait(30.0)  # the idle wait: ends on the commit's signal, not after 30 s
        assert time.monotonic() - started < 15.0
        fwd.step()  # the woken loop reads the topic it had found drained
        assert [v for v, _ in cluster.p.sent] == [b"first", b"second"]
    finally:
        committer.close()
        fwd.shutdown(0.1)
