"""Crash: SIGKILL the whole agent at random points under load on all three inputs; every
acknowledged message must reach Kafka (lost = 0). Duplicates are counted and reported.

The checker (tests/reliability/checker.py) defines "acknowledged" per input; docs/reliability.md
has the method and the latest figures. CI runs 20 kills; ``dev/reliability --long`` runs 300.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.kafka import Broker
from tests.reliability.checker import check_report, run_crash_check

# Mostly waits (on agents, brokers and an outage): run beside the Apache Kafka tests
# (tests/conftest.py, in_waiting_part).
pytestmark = pytest.mark.waiting

CI_KILLS = int(os.environ.get("FERRY_RELIABILITY_KILLS", "20"))
LONG_KILLS = int(os.environ.get("FERRY_RELIABILITY_LONG_KILLS", "300"))


def test_sigkill_at_random_points_loses_no_acknowledged_message(
    tmp_path: Path, broker: Broker, artifacts_dir: Path
) -> None:
    report = run_crash_check(tmp_path / "agent", broker, kills=CI_KILLS, duration=200,
                             log=print, exactly_once=True)
    check_report(report, artifacts_dir, CI_KILLS)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_long_crash_run(tmp_path: Path, broker: Broker, artifacts_dir: Path) -> None:
    report = run_crash_check(tmp_path / "agent", broker, kills=LONG_KILLS, duration=6000,
                             log=print, exactly_once=True)
    check_report(report, artifacts_dir, LONG_KILLS)
