"""agent/process/gc_tuning.py, in a child interpreter: the settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.agent_harness import REPO_ROOT

PROBE = """
import gc, json
from agent.process.gc_tuning import freeze_startup_heap
before = gc.get_threshold()
freeze_startup_heap(50_000)
after_first = (gc.get_threshold(), gc.get_freeze_count())
freeze_startup_heap(1_000)  # never lowers the threshold
after_second = gc.get_threshold()
young = [[] for _ in range(10)]  # made after the freeze: tracked, not frozen
print(json.dumps({"before": before, "after_first": after_first, "after_second": after_second,
                  "young_tracked": all(gc.is_tracked(x) for x in young)}))
"""


def test_freeze_startup_heap_freezes_what_exists_and_only_raises_the_threshold() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    (threshold, frozen) = got["after_first"]
    assert threshold == [50_000, got["before"][1], got["before"][2]]
    assert frozen > 1000  # the interpreter's and Ferry's startup objects
    assert got["after_second"] == threshold
    assert got["young_tracked"]
