"""One vocabulary of reasons: why input was refused, why a buffered message was discarded,
why a spool file was quarantined. The same word is the metrics label
(``messages_rejected{reason}``, ``messages_discarded{reason}``, ``spool_files_quarantined
{reason}``), the kind of sample on the status page, and, for HTTP, the ``error`` code of the
answer: an operator who reads ``invalid_topic`` in one place finds it under that name in
every other (it used to be ``invalid_topic``, ``invalid`` and ``bad_topic``).

docs/status.md holds the table (``table()``); tests/test_reasons.py checks that every source
uses only these words and that the document is the code's.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["rejected", "discarded", "quarantined"]

# Refused before it was acknowledged: the client was told (an HTTP status, a datagram counted
# and sampled, a spool file quarantined). Word -> (sources, meaning).
REJECTED: dict[str, tuple[str, str]] = {
    "malformed": ("socket", "not Bruce's datagram format (sizes, lengths, trailing bytes)"),
    "unsupported_api_key": ("socket", "a datagram ApiKey other than 256 or 257"),
    "unsupported_version": ("socket", "a datagram ApiVersion Ferry does not read"),
    "invalid_topic": ("socket, http", "not a legal Kafka topic name"),
    "unknown_topic": ("http", "not defined, and http.auto_create_topics is off (404)"),
    "too_large": ("socket, http", "key + value over the topic's max_message_bytes (413)"),
    "invalid_header": ("http", "a header Ferry reads has a bad value (400)"),
    "invalid_body": ("http", "the body does not fit the topic's content_type or schema (400)"),
    "unsupported_media_type": ("http", "Content-Type not accepted by the topic (415)"),
    "idempotency_key_reused": ("http", "an Idempotency-Key reused for another request (422)"),
    "rate_limited": ("http", "over the topic's rate_limit (429)"),
    "request_timeout": ("http", "the body did not arrive within http.body_timeout_seconds "
                        "(408)"),
    "internal_topic": ("http", "a topic name starting with __ that is neither in "
                       "http.internal_topics nor defined (400)"),
    "invalid_http": ("http", "bytes the HTTP parser refuses (400, connection closed)"),
    "uri_too_long": ("http", "request line over http.max_request_line_bytes (414)"),
    "headers_too_large": ("http", "headers over http.max_header_bytes or http.max_headers "
                          "(431)"),
    "unsupported_content_encoding": ("http", "Content-Encoding other than gzip or identity "
                                     "(415)"),
    "overloaded": ("http", "the buffer's writer is behind (503)"),
    "starting": ("http", "the agent is starting (503)"),
    "shutting_down": ("socket, http", "the agent is stopping (503)"),
    # (For the spool these three are not rejections: the batch waits in its file and is
    # counted as spool_batches_deferred{reason}.)
    "buffer_full": ("socket, http", "the buffer is at buffer.max_bytes (503)"),
    "disk_full": ("socket, http", "the buffer's filesystem is down to its reserve (503)"),
    "disk_error": ("socket, http", "the buffer's disk refused a write (503)"),
    "unencodable": ("socket, http, spool", "a record the buffer cannot encode (400; a spool "
                    "file holding one is quarantined as unencodable)"),
}

# Buffered (acknowledged), then dropped by an explicit rule; each is in the discard log.
DISCARDED: dict[str, tuple[str, str]] = {
    "ttl": ("forwarder", "older than its topic's ttl_seconds"),
    "attempts": ("forwarder", "max_attempts sends failed"),
    "invalid": ("forwarder", "Kafka refused it for good (docs/design.md, \"Failure policy\")"),
    "too_large": ("forwarder", "over max_message_bytes (a spool record; other sources refuse "
                  "at once)"),
    "generation": ("forwarder", "its topic was deleted (management API) after it was "
                   "accepted"),
    "corrupt": ("forwarder", "its buffer record cannot be decoded"),
    "purged": ("ferry purge", "removed by an operator"),
}

# Spool files moved to quarantine/ (with a .reason file beside them).
QUARANTINED: dict[str, tuple[str, str]] = {
    "corrupt": ("spool", "not a valid spool file, or changed while being read"),
    "unreadable": ("spool", "the agent cannot read it"),
    "unencodable": ("spool", "holds a record the buffer cannot encode"),
}

VOCABULARY: dict[Kind, dict[str, tuple[str, str]]] = {
    "rejected": REJECTED, "discarded": DISCARDED, "quarantined": QUARANTINED,
}


def table() -> str:
    """The vocabulary as the Markdown table of docs/status.md."""
    lines = ["| kind | reason | from | meaning |", "| --- | --- | --- | --- |"]
    for kind, words in VOCABULARY.items():
        for word, (sources, meaning) in words.items():
            lines.append(f"| {kind} | `{word}` | {sources} | {meaning} |")
    return "\n".join(lines)
