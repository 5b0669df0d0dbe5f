"""Single-message groups handed over together, packed into one encoded group.

The HTTP stage hands the writer every publish of one event-loop iteration at once
(``Committer.submit_groups``), and nearly all are groups of one message. As groups of their
own, each cost the writer thread a submission, a measurement, a disk check, a slice of ids and
a callback: several times the work of storing the message itself, on the thread that also
holds the GIL the event loop needs. Packed into one ``EncodedGroup``, encoded here on the
handing thread, they cost the writer a few C-level operations a message and Python work only
per run of one topic.

What packing changes, and why it is sound:

- A pack the buffer has no room for (``BufferFull``: its ``max_bytes``, or the disk) is
  split, and its messages are retried as groups of their own in the next commit, so near the
  limit those that fit are stored, as without packing (one commit later). Any other refusal
  (a disk error) refuses the pack whole.
- Its order relative to the other groups of the same hand-over is not kept: they were
  concurrent requests (one connection never has two in one hand-over). Within the pack, and
  within each group, order is kept, so each topic's FIFO order follows the hand-over.
- A message that cannot be encoded is not packed: it stays a group of its own, so its
  refusal (``InvalidGroup``) is its alone.
- A pack holds at most ``limit`` messages (the committer's ``max_batch_messages``), so a
  commit still holds no more than that.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.buffer import codec
from agent.buffer.appender import EncodedGroup
from agent.buffer.refusals import Refusal
from agent.buffer.weight import RECORD_OVERHEAD_BYTES
from agent.records import Record

# What a group's result is: its ids, or the refusal (the committer's ``Result``).
PackResult = list[bytes] | Refusal


class Pack:
    """Messages of single-message groups, encoded, in runs of one topic and generation."""

    __slots__ = ("runs", "indexes", "weight", "_values", "_topic", "_generation")

    def __init__(self) -> None:
        self.runs: list[tuple[str, list[bytes], int]] = []
        self.indexes: list[int] = []  # each message's group, in the hand-over's numbering
        self.weight = 0  # against the committer's max_pending_bytes (weight.py)
        self._values: list[bytes] = []
        self._topic = ""
        self._generation = -1

    def __len__(self) -> int:
        return len(self.indexes)

    def add(self, index: int, record: Record, generation: int) -> bool:
        """Pack ``record``, the only message of group ``index``, encoded under the topic's
        ``generation`` (the buffer re-encodes it if that is stale by the commit). False when
        it cannot be encoded: it was not packed."""
        try:
            value = codec.encode(record, generation)
        except codec.UNENCODABLE:
            return False
        topic = record.topic
        if topic != self._topic or generation != self._generation:
            self._values = []
            self._topic, self._generation = topic, generation
            self.runs.append((topic, self._values, generation))
        self._values.append(value)
        self.indexes.append(index)
        self.weight += len(value) + RECORD_OVERHEAD_BYTES
        return True

    def group(self) -> EncodedGroup:
        return EncodedGroup(self.runs)

    def split(self) -> list[tuple[int, EncodedGroup]]:
        """Each packed message as a group of its own, with its group's index: a pack the
        buffer had no room for is retried this way, so that those that fit are stored."""
        indexes = iter(self.indexes)
        return [(next(indexes), EncodedGroup([(topic, [value], generation)]))
                for topic, values, generation in self.runs for value in values]

    def fan_out(self, each: Callable[[int, PackResult], None], result: PackResult) -> None:
        """Give each packed group its share of the pack's ``result``: its one id, or the
        refusal."""
        if isinstance(result, list):
            for at, index in enumerate(self.indexes):
                each(index, result[at:at + 1])
        else:
            for index in self.indexes:
                each(index, result)
