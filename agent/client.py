"""Moved: the client is the stdlib-only package ``ferry_client``.

Kept only so that code written against the old path (``from agent.client import FerryClient``)
keeps working; new code imports from ``ferry_client``, which applications can install without
the agent (README, "Sending messages").
"""

from ferry_client.datagram import (
    DEFAULT_SOCKET_PATH,
    FerryClient,
    FerryClientError,
    FerryUnavailable,
    MessageTooLarge,
    QueueFull,
    send,
)

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "FerryClient",
    "FerryClientError",
    "FerryUnavailable",
    "MessageTooLarge",
    "QueueFull",
    "send",
]
