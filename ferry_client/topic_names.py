"""Kafka's rule for topic names, the one copy every part of Ferry checks against.

Kafka (``org.apache.kafka.common.internals.Topic``) takes 1 to 249 characters of
``[A-Za-z0-9._-]``, except ``.`` and ``..``. Standard library only, so that the client, the
spool format and the agent can all import it without depending on each other.
"""

from __future__ import annotations

import re

__all__ = ["MAX_LENGTH", "PATTERN", "RULE", "illegal_topic", "is_legal_topic"]

MAX_LENGTH = 249
# For JSON Schema (OpenAPI) and documents; anchored, as JSON Schema patterns are not.
PATTERN = "^[A-Za-z0-9._-]{1,249}$"
# What every refusal says, so that a client reads one wording whichever input refused it.
RULE = "1 to 249 of A-Z a-z 0-9 . _ -, and not '.' or '..'"

# \Z, not $: "$" would also match before a final newline, which Kafka refuses.
_LEGAL = re.compile(r"[A-Za-z0-9._-]{1,249}\Z")


def is_legal_topic(name: object) -> bool:
    """Whether Kafka (and so Ferry) accepts ``name`` as a topic name."""
    return isinstance(name, str) and _LEGAL.match(name) is not None and name not in (".", "..")


def illegal_topic(name: object, shown: int = 300) -> str:
    """The refusal for an illegal ``name``: the name (cut to ``shown`` characters) and the rule."""
    text = name[:shown] if isinstance(name, str) else name
    return f"{text!r} is not a legal Kafka topic name: {RULE}"
