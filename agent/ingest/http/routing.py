"""Which requests publish: ``POST /topics/{topic}`` and ``POST /topics/{topic}/batch``.

The one rule the connection protocol (on the raw target), the ASGI app (on the decoded path)
and the 404/405 answers match publishes by; every other path is the management API's, the
probes' or the status page's, and goes through Starlette's router.
"""

from __future__ import annotations

PREFIX = "/topics/"
BATCH = "batch"


def publish_target(path: str) -> tuple[str, bool] | None:
    """``(topic, batch)`` when a POST to ``path`` publishes, else None.

    The topic is returned as it stands in ``path``: still percent-encoded in a raw target,
    which the caller decodes (and checks) itself.
    """
    if not path.startswith(PREFIX):
        return None
    topic, slash, tail = path[len(PREFIX):].partition("/")
    if not topic or (slash and tail != BATCH):
        return None
    return topic, bool(slash)
