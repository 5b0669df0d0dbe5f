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
from tests.reliability.checker import Report, is_exactly_once, run_crash_check

CI_KILLS = int(os.environ.get("FERRY_RELIABILITY_KILLS", "20"))
LONG_KILLS = int(os.environ.get("FERRY_RELIABILITY_LONG_KILLS", "300"))


def _check(report: Report, artifacts: Path, kills: int) -> None:
    (artifacts / "crash-report.json").write_text(report.to_json())
    print("\n" + report.summary())
    assert report.kills == kills, f"only {report.kills} of {kills} kills ran in the time budget"
    for name, tally in report.inputs.items():
        assert tally.lost == 0, (
            f"{tally.lost} acknowledged {name} messages lost, e.g. {tally.lost_examples}; "
            f"{report.summary()}")
        assert tally.unknown == 0, f"{name}: {tally.unknown} values in Kafka nobody sent"
        # The check means something only if every input had acknowledged traffic.
        assert tally.acked > 0, f"no {name} message was acknowledged: {report.summary()}"
        if is_exactly_once(name):
            # delivery = "exactly_once", read read_committed: not one value twice (the
            # at-least-once streams of the same run show what kills do without it).
            assert tally.duplicates == 0, f"{name}: {tally.duplicates} duplicates; " \
                f"{report.summary()}"
    assert report.socket_round_timeouts == 0, "a live agent never counted a datagram round"
    modes = report.modes()
    assert len(modes) >= 3, f"kills should land in varied states: {modes}"


def test_sigkill_at_random_points_loses_no_acknowledged_message(
    tmp_path: Path, broker: Broker, artifacts_dir: Path
) -> None:
    report = run_crash_check(tmp_path / "agent", broker, kills=CI_KILLS, duration=200,
                             log=print, exactly_once=True)
    _check(report, artifacts_dir, CI_KILLS)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_long_crash_run(tmp_path: Path, broker: Broker, artifacts_dir: Path) -> None:
    report = run_crash_check(tmp_path / "agent", broker, kills=LONG_KILLS, duration=6000,
                             log=print, exactly_once=True)
    _check(report, artifacts_dir, LONG_KILLS)
