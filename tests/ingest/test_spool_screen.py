"""spool_screen.py: which records of a spool file their Kafka topic can never take."""

from __future__ import annotations

import logging
from pathlib import Path

from agent.ingest.spool_screen import Refused, Screen
from agent.metrics import Registry
from agent.process.log_limit import LogLimit
from agent.signals.limits import Limit, Snapshot
from spool.format import SpoolRecord

NOW = 1_700_000_000_000


def _screen(tmp_path: Path) -> Screen:
    limits = Snapshot(topics={"small": Limit(max_message_bytes=1000, before_max_ms=60_000)})
    return Screen(limits, NOW, tmp_path / "f.ferry", LogLimit(logging.getLogger("t")))


def test_a_topic_without_known_limits_takes_everything(tmp_path: Path) -> None:
    screen = _screen(tmp_path)
    assert screen.refusal(0, SpoolRecord("other", b"x" * 100_000, timestamp_ms=1)) is None


def test_too_large_and_too_old_records_are_refused_with_their_index(tmp_path: Path) -> None:
    screen = _screen(tmp_path)
    assert screen.refusal(0, SpoolRecord("small", b"x" * 10, timestamp_ms=NOW)) is None
    # No timestamp: stamped at intake, never too old.
    assert screen.refusal(1, SpoolRecord("small", b"x" * 10)) is None
    big = screen.refusal(2, SpoolRecord("small", b"x" * 5000, timestamp_ms=NOW))
    assert big is not None and big[:3] == (2, "small", "too_large_for_topic")
    old = screen.refusal(3, SpoolRecord("small", b"x", timestamp_ms=NOW - 3_600_000))
    assert old is not None and old[:3] == (3, "small", "timestamp_out_of_range")


def test_refused_records_are_counted_and_sampled_with_their_file(tmp_path: Path) -> None:
    screen, registry = _screen(tmp_path), Registry()
    screen.count(registry, [Refused(4, "small", "too_large_for_topic", "over the limit")])
    view = registry.view()
    assert view.total("messages_rejected", source="spool", reason="too_large_for_topic") == 1
    (sample, *_) = view.samples[("rejected", "too_large_for_topic")]
    assert sample["record"] == 4 and sample["file"].endswith("f.ferry")
