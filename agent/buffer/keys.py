"""Key layout of the buffer's LMDB databases.

A message id is (accepted-at milliseconds, sequence) packed big-endian into 12 bytes, so ids
sort by acceptance time (the CDAP TMS row-key idea, seed 002). Ids are allocated inside the
write transaction from a counter stored in the same environment, so they are unique and
increasing across processes and restarts even if the clock steps back.

Records are stored by id (``records``: layout.py). A message's handle, which the forwarder
passes back to delete it, is ``topic NUL id``: NUL cannot occur in a Kafka topic name.
"""

from __future__ import annotations

import struct

ID = struct.Struct(">QI")
ID_LEN = ID.size  # 12
SEP = b"\x00"


def make_id(timestamp_ms: int, seq: int) -> bytes:
    return ID.pack(timestamp_ms, seq)


def id_timestamp_ms(message_id: bytes) -> int:
    return int.from_bytes(message_id[:8], "big")


def id_text(message_id: bytes) -> str:
    """The id as clients see it (Ferry-Message-Id): 24 lowercase hex digits."""
    return message_id.hex()


def parse_id_text(text: str) -> bytes | None:
    if len(text) != ID_LEN * 2:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def topic_prefix(topic: str) -> bytes:
    return topic.encode("ascii") + SEP


def message_key(topic: str, message_id: bytes) -> bytes:
    return topic_prefix(topic) + message_id


def split_key(key: bytes) -> tuple[str, bytes]:
    return key[:-ID_LEN - 1].decode("ascii"), key[-ID_LEN:]
