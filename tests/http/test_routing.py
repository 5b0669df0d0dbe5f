"""agent/ingest/http/routing.py: the one rule for which paths a POST publishes to."""

from __future__ import annotations

import pytest

from agent.ingest.http.routing import publish_target


@pytest.mark.parametrize(("path", "target"), [
    ("/topics/t", ("t", False)),
    ("/topics/t/batch", ("t", True)),
    ("/topics/a%20b", ("a%20b", False)),  # decoded (and refused) by the caller
    ("/topics/batch", ("batch", False)),  # a topic may be called "batch"
    ("/topics/batch/batch", ("batch", True)),
])
def test_publish_paths(path: str, target: tuple[str, bool]) -> None:
    assert publish_target(path) == target


@pytest.mark.parametrize("path", [
    "/topics/", "/topics", "/topics//batch", "/topics/t/", "/topics/t/batch/",
    "/topics/t/other", "/topics/t/batch/x", "/status/ping", "/", "/topicsx/t",
])
def test_other_paths_do_not_publish(path: str) -> None:
    assert publish_target(path) is None
