"""Fixtures for the HTTP front door: ``serve(**sections)`` and ``served`` (see harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.http.harness import Served, make_config, start


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Start a server; keyword arguments are config sections merged over the test defaults
    (e.g. ``http={"auto_create_topics": False}``, ``topics={...}``)."""
    started: list[Served] = []

    def factory(*, running: bool = True, **sections: Any) -> Served:
        served = start(make_config(tmp_path, **sections), running=running)
        started.append(served)
        return served

    yield factory
    for served in reversed(started):
        served.stop()


@pytest.fixture
def served(serve: Callable[..., Served]) -> Served:
    """A server with the test defaults: auto-created binary topics, no Kafka wait."""
    return serve()
