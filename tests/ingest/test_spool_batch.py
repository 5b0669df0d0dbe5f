"""spool_batch.py: the intake's pause while the buffer has no room for a batch."""

from __future__ import annotations

import logging

import pytest

from agent.buffer.refusals import BufferFull, BufferUnavailable
from agent.ingest.spool_batch import Pause
from agent.metrics import Registry


def test_a_pause_logs_when_it_begins_and_ends_and_counts_every_attempt(
    caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry()
    pause = Pause(registry, logging.getLogger("agent.ingest.spool_intake"))
    with caplog.at_level(logging.INFO, logger="agent.ingest.spool_intake"):
        pause.refused(BufferFull("no room"))
        pause.refused(BufferFull("no room"))
        pause.refused(BufferUnavailable("disk_full", "no space"))
        assert registry.view().total("spool_intake_paused") == 1
        pause.ended()
        pause.ended()
    view = registry.view()
    assert view.total("spool_batches_deferred", reason="buffer_full") == 2
    assert view.total("spool_batches_deferred", reason="disk_full") == 1
    assert view.total("spool_intake_paused") == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "agent.ingest.spool_intake"]
    assert len(lines) == 2, lines
    assert "spool intake paused" in lines[0] and "retried every 0.5 s" in lines[0]
    assert "3 refused attempts" in lines[1]
