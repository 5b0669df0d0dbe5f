"""Fixtures the buffer's unit tests share."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.buffer.environment import Environment
from tests.buffer.helpers import FakeClock


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Environment]:
    """A bare LMDB environment of the buffer's layout, for tests of one room."""
    e = Environment(tmp_path / "b", map_cap=64 << 20, initial_map_bytes=1 << 20,
                    readonly=False)
    yield e
    e.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(1_700_000_000.0)
    monkeypatch.setattr("agent.buffer.clock.time", types.SimpleNamespace(time=fake.time))
    return fake
