"""Fixtures the ingest tests share."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ingest.harness import Running


@pytest.fixture
def start_running(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(**kwargs: object) -> Running:
        r = Running(tmp_path, **kwargs)  # type: ignore[arg-type]
        r.committer.start()
        r.server.start()
        started.append(r)
        return r

    original = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        yield start
    finally:
        for r in started:
            r.server.stop()
            r.committer.close()
            r.store.close()
            r.sender.close()
        sys.setswitchinterval(original)
