"""Ferry's client for applications: standard library only, installable without the agent.

- :class:`FerryClient` sends over the UNIX datagram socket (Bruce's wire format);
- :func:`encode_any_partition` / :func:`encode_partition_key` build those datagrams;
- :class:`FerryHttp` / :func:`publish` publish over HTTP (``POST /topics/{topic}``) with
  retries made safe by ``Idempotency-Key``.

Nothing here imports the agent or any third-party package (a test checks it), so
``pip install ./ferry_client`` is all an application needs; README "Sending messages" shows how.
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
from ferry_client.http import (
    FerryHttp,
    Published,
    PublishError,
    PublishFailed,
    PublishRejected,
    publish,
)
from ferry_client.topic_names import is_legal_topic
from ferry_client.wire import (
    ANY_PARTITION,
    API_VERSION,
    PARTITION_KEY,
    encode_any_partition,
    encode_partition_key,
)

__all__ = [
    "ANY_PARTITION",
    "API_VERSION",
    "DEFAULT_SOCKET_PATH",
    "PARTITION_KEY",
    "FerryClient",
    "FerryClientError",
    "FerryHttp",
    "FerryUnavailable",
    "MessageTooLarge",
    "PublishError",
    "PublishFailed",
    "PublishRejected",
    "Published",
    "QueueFull",
    "encode_any_partition",
    "encode_partition_key",
    "is_legal_topic",
    "publish",
    "send",
]

__version__ = "0.1.0"
