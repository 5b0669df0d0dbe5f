"""Moved: the client is the stdlib-only package ``client`` (``from client import FerryClient``).

Kept only so that code written against the old path keeps working; new code imports from
``client``, which applications can install without the agent (README, "Sending messages").
"""

from client.datagram import (
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
