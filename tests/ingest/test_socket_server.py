"""The datagram socket on its own (no forwarder, no Kafka): what it stores, under which topic
generation, what it counts, and the process setting it makes."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.buffer.store import BufferUnavailable
from agent.config import TopicConfig
from agent.ingest.gil import SWITCH_INTERVAL, lower_switch_interval
from agent.records import Record
from ferry_client.wire import encode_any_partition, encode_partition_key
from tests.ingest.harness import Running
from tests.waiting import wait_until


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    r = Running(tmp_path)
    r.committer.start()
    original = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    r.server.start()
    try:
        yield r
    finally:
        r.server.stop()
        r.committer.close()
        r.store.close()
        r.sender.close()
        sys.setswitchinterval(original)


def test_datagrams_are_stored_as_sent_in_order_per_topic(running: Running) -> None:
    sent = [encode_any_partition("a", b"v%d" % i, b"k" if i % 2 else None, 1000 + i)
            for i in range(50)]
    sent += [encode_partition_key("b", -7, b"pk", None, 5)]
    for d in sent:
        running.send(d)
    wait_until(lambda: running.counter("messages_accepted") == 51, timeout=30,
               message="51 datagrams accepted")
    assert [m.record for m in running.stored("a")] == [
        Record("a", b"v%d" % i, b"k" if i % 2 else None, None, 1000 + i) for i in range(50)]
    assert [m.record for m in running.stored("b")] == [Record("b", b"pk", None, -7, 5)]
    assert running.counter("messages_accepted", source="socket", topic="a") == 50
    assert running.counter("messages_received", source="socket") == 51


def test_a_bad_datagram_is_counted_and_the_good_ones_around_it_are_stored(
    running: Running,
) -> None:
    running.send(encode_any_partition("t", b"before"))
    running.send(b"\x00\x00\x00\x05junk")
    running.send(encode_any_partition("t", b"after"))
    wait_until(lambda: running.counter("messages_received") == 3
               and running.counter("messages_accepted") == 2, timeout=30,
               message="3 received, 2 accepted")
    assert running.counter("messages_rejected", source="socket", reason="malformed") == 1
    assert [m.record.value for m in running.stored("t")] == [b"before", b"after"]


def test_after_a_topic_is_deleted_new_datagrams_carry_its_new_generation(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    running.send(encode_any_partition("t", b"old"))
    wait_until(lambda: running.counter("messages_accepted") == 1, timeout=30,
               message="the first datagram accepted")
    # Deleted (through HTTP management, say) while the socket thread's view of generations
    # is still fresh: the buffer re-encodes what the thread encoded under the old one.
    assert running.store.bump_generation("t") == 1
    running.send(encode_any_partition("t", b"new"))
    wait_until(lambda: running.counter("messages_accepted") == 2, timeout=30,
               message="the second datagram accepted")
    assert [(m.record.value, m.generation) for m in running.stored("t")] == [
        (b"old", 0), (b"new", 1)]


def test_when_generations_cannot_be_read_datagrams_are_still_stored_under_the_right_one(
    running: Running, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert running.store.bump_generation("t") == 1

    def unreadable() -> dict[str, int]:
        raise BufferUnavailable("disk_error", "simulated read failure")

    monkeypatch.setattr(running.store, "generations", unreadable)
    running.send(encode_any_partition("t", b"v"))
    wait_until(lambda: running.counter("messages_accepted") == 1, timeout=30,
               message="the datagram accepted")
    assert [(m.record.value, m.generation) for m in running.stored("t")] == [(b"v", 1)]
    assert "could not read topic generations" in caplog.text


def test_the_socket_lowers_the_gil_switch_interval(running: Running) -> None:
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)  # 0.005 before start


@pytest.mark.parametrize(("before", "asked", "after"), [
    (0.005, 0.001, 0.001), (0.0002, 0.001, 0.0002), (0.005, None, 0.005)])
def test_lower_switch_interval_never_raises_it(
    before: float, asked: float | None, after: float
) -> None:
    original = sys.getswitchinterval()
    sys.setswitchinterval(before)
    try:
        lower_switch_interval(asked)
        assert sys.getswitchinterval() == pytest.approx(after)
    finally:
        sys.setswitchinterval(original)


# -- sizes -----------------------------------------------------------------------------------
def _big_sender(r: Running) -> None:
    # What FerryClient(send_buffer_bytes=...) does for big messages: the kernel then takes
    # datagrams of up to twice this, beyond its default datagram size.
    r.sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 212_992)


def test_a_datagram_bigger_than_the_kernel_default_is_received_whole(
    start_running: Callable[..., Running],
) -> None:
    r = start_running()
    _big_sender(r)
    value = b"x" * 300_000  # under the default max_message_bytes (1,000,000)
    r.send(encode_any_partition("big", value, b"k", 7))
    wait_until(lambda: r.counter("messages_accepted") == 1, timeout=30, message="accepted")
    assert [m.record for m in r.stored("big")] == [Record("big", value, b"k", None, 7)]
    assert r.counter("messages_rejected") == 0


def test_a_datagram_over_the_receive_buffer_is_too_large_not_malformed(
    start_running: Callable[..., Running],
) -> None:
    r = start_running(default_max_bytes=1000)  # so the receive buffer is its 256 KiB minimum
    _big_sender(r)
    r.send(encode_any_partition("t", b"x" * 300_000, None, 1))
    r.send(encode_any_partition("t", b"small", None, 2))
    wait_until(lambda: r.counter("messages_received") == 2, timeout=30, message="both counted")
    wait_until(lambda: r.counter("messages_accepted") == 1, timeout=30, message="accepted")
    assert r.counter("messages_rejected", reason="too_large") == 1
    assert r.counter("messages_rejected", reason="malformed") == 0
    [sample] = r.registry.view().samples[("rejected", "too_large")]
    assert f"{len(encode_any_partition('t', b'x' * 300_000, None, 1))} bytes" in sample["detail"]
    assert [m.record.value for m in r.stored("t")] == [b"small"]


def test_topics_defined_over_http_set_the_limit_for_datagrams(
    start_running: Callable[..., Running],
) -> None:
    r = start_running(catalog=True)
    assert r.catalog is not None
    r.catalog.create("small", TopicConfig(max_message_bytes=100))
    r.catalog.create("roomy", TopicConfig(max_message_bytes=2_000_000))
    _big_sender(r)
    r.send(encode_any_partition("small", b"x" * 500, None, 1))
    r.send(encode_any_partition("small", b"x" * 50, None, 2))
    r.send(encode_any_partition("roomy", b"y" * 300_000, None, 3))  # over [topics.default]'s?
    wait_until(lambda: r.counter("messages_received") == 3, timeout=30, message="all counted")
    wait_until(lambda: r.counter("messages_accepted") == 2, timeout=30, message="accepted")
    assert r.counter("messages_rejected", reason="too_large") == 1
    assert [len(m.record.value) for m in r.stored("small")] == [50]
    assert [len(m.record.value) for m in r.stored("roomy")] == [300_000]
