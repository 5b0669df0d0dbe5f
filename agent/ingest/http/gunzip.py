"""A gzip request body, decoded a bounded step at a time (``Content-Encoding: gzip``).

Every member of a multi-member body is decoded (RFC 1952 §2.2: ``cat a.gz b.gz`` is one
gzip body) and bytes after a member that are not another whole member are refused, never
dropped (issue #29 F). Decoding used to hand each new member the whole rest of the body,
which zlib copies as ``unused_data`` when the member ends: quadratic in the members, and one
4 MiB body of empty members held the event loop for 58 s (issue #37 N1). Here input is fed
in slices, starting small after each member's start and doubling up to ``MAX_SLICE``, so
what is copied at a member's end is at most the slice it ended in: the work is linear in the
body. Output per call is capped too (a 64 KiB slice of zeros can inflate to 64 MiB), and
``run`` stops when its time is up, so the protocol decodes in steps of a few milliseconds
with the event loop serving everyone else in between.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

from agent import reasons
from agent.ingest.http.errors import HttpError

FIRST_SLICE = 256  # an empty member is 20 bytes: copy little after each one
MAX_SLICE = 64 * 1024
OUT_STEP = 256 * 1024  # decoded bytes per zlib call at most
STEP_SECONDS = 0.002  # how long one step may hold the event loop (issue #37, item 3)


class GzipBody:
    """Decode ``data`` up to ``limit`` decoded bytes; ``take(n)`` reserves memory for ``n``
    more decoded bytes and says whether it may (the body budget)."""

    __slots__ = ("view", "end", "pos", "size", "tail", "fed", "members", "limit", "out",
                 "decoder", "take")

    def __init__(self, data: bytes, limit: int, take: Callable[[int], bool]) -> None:
        self.view = memoryview(data)
        self.end = len(data)
        self.pos = 0
        self.size = FIRST_SLICE
        self.tail = b""  # input zlib gave back because the output cap was reached
        self.fed = False  # the current member's decoder has had input
        self.members = 0
        self.limit = limit
        self.out = bytearray()
        self.decoder = zlib.decompressobj(wbits=31)
        self.take = take

    def run(self, seconds: float = STEP_SECONDS) -> bytes | None:
        """Decode for about ``seconds``: the whole body once it is decoded, None if there is
        more to do; HttpError 400 (not gzip, truncated, trailing bytes), 413 (over the
        limit) or 503 (the body budget is spent)."""
        deadline = time.monotonic() + seconds
        while True:
            if self.tail:
                piece: bytes | memoryview = self.tail
            elif self.pos >= self.end:
                return self._finish()
            else:
                piece = self.view[self.pos:self.pos + self.size]
                self.pos += len(piece)
            self.fed = True
            decoder = self.decoder
            room = self.limit - len(self.out)
            try:
                chunk = decoder.decompress(piece, min(room + 1, OUT_STEP))
            except zlib.error as exc:
                raise HttpError(400, reasons.INVALID_BODY,
                                f"the gzip body cannot be decoded: {exc}",
                                reason=reasons.INVALID_BODY) from None
            if len(chunk) > room:
                raise HttpError(413, reasons.TOO_LARGE, f"the decoded body is over the limit "
                                f"of {self.limit} bytes", reason=reasons.TOO_LARGE)
            if chunk:
                if not self.take(len(chunk)):
                    raise Spent()
                self.out += chunk
            self.tail = decoder.unconsumed_tail
            if decoder.eof:
                # The member ended inside this slice: what follows it goes back to the input,
                # a copy of at most one slice.
                self.pos -= len(decoder.unused_data)
                self.members += 1
                self.decoder = zlib.decompressobj(wbits=31)
                self.fed = False
                self.size = FIRST_SLICE
            elif not self.tail:
                self.size = min(self.size * 2, MAX_SLICE)
            if time.monotonic() >= deadline:
                return None

    def _finish(self) -> bytes:
        if self.fed or not self.members:
            raise HttpError(400, reasons.INVALID_BODY, "the gzip body is truncated",
                            reason=reasons.INVALID_BODY)
        return bytes(self.out)


class Spent(Exception):
    """The body budget could not hold the decoded bytes (the caller answers 503)."""
