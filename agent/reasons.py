"""One vocabulary of reasons: why input was refused, why a buffered message was discarded,
why a spool file was quarantined. The same word is the metrics label
(``messages_rejected{reason}``, ``messages_discarded{reason}``, ``spool_files_quarantined
{reason}``), the kind of sample on the status page, and, for HTTP, the ``error`` code of the
answer: an operator who reads ``invalid_topic`` in one place finds it under that name in
every other (it used to be ``invalid_topic``, ``invalid`` and ``bad_topic``).

Code names a reason only through the constants below (``reasons.INVALID_TOPIC``), never as a
string literal, so a reason cannot be misspelt or coined in one place alone: docs/status.md
holds the table (``table()``), and tests/test_reasons.py reads every production module to
check both.
"""

from __future__ import annotations

from typing import Final, Literal

Kind = Literal["rejected", "discarded", "quarantined"]

# Plain str constants: the words travel as metric labels, sample keys, JSON and log text, and
# are looked up in dicts keyed by the word. A plain Enum would not do: its member equals only
# itself, so `counts[Reason.TTL]` would miss the entry stored under "ttl". A StrEnum would (it
# hashes, compares, formats and serialises as its value on Python 3.11+), but it adds nothing
# here: the names are already the only way code writes a reason, and tests/test_reasons.py
# checks that, and the words stay str wherever they go (a member's repr, `<Reason.TTL:
# 'ttl'>`, would otherwise show in `%r` log text). A str is the word.
# A word used in two tables (too_large, corrupt, unencodable) is one constant: the same word
# must mean the same thing to the reader wherever it shows.

# Rejected: refused before it was acknowledged.
MALFORMED: Final = "malformed"
UNSUPPORTED_API_KEY: Final = "unsupported_api_key"
UNSUPPORTED_VERSION: Final = "unsupported_version"
INVALID_TOPIC: Final = "invalid_topic"
UNKNOWN_TOPIC: Final = "unknown_topic"
TOO_LARGE: Final = "too_large"
INVALID_HEADER: Final = "invalid_header"
INVALID_BODY: Final = "invalid_body"
UNSUPPORTED_MEDIA_TYPE: Final = "unsupported_media_type"
IDEMPOTENCY_KEY_REUSED: Final = "idempotency_key_reused"
RATE_LIMITED: Final = "rate_limited"
REQUEST_TIMEOUT: Final = "request_timeout"
INTERNAL_TOPIC: Final = "internal_topic"
INVALID_HTTP: Final = "invalid_http"
URI_TOO_LONG: Final = "uri_too_long"
HEADERS_TOO_LARGE: Final = "headers_too_large"
UNSUPPORTED_CONTENT_ENCODING: Final = "unsupported_content_encoding"
OVERLOADED: Final = "overloaded"
BODY_BUDGET: Final = "body_budget"
STARTING: Final = "starting"
SHUTTING_DOWN: Final = "shutting_down"
BUFFER_FULL: Final = "buffer_full"
DISK_FULL: Final = "disk_full"
DISK_ERROR: Final = "disk_error"
UNENCODABLE: Final = "unencodable"
TOO_LARGE_FOR_TOPIC: Final = "too_large_for_topic"
TIMESTAMP_OUT_OF_RANGE: Final = "timestamp_out_of_range"

# Discarded: buffered (acknowledged), then dropped by an explicit rule.
TTL: Final = "ttl"
ATTEMPTS: Final = "attempts"
INVALID: Final = "invalid"
GENERATION: Final = "generation"
CORRUPT: Final = "corrupt"
PURGED: Final = "purged"

# Quarantined: a spool file moved aside.
UNREADABLE: Final = "unreadable"

# The refusals that mean "no room" (the buffer's limit or its disk): they pass when the
# buffer drains, so they are logged once per episode and make the agent unready, where any
# other refusal is about the input itself.
SPACE: Final = frozenset({BUFFER_FULL, DISK_FULL, DISK_ERROR})

# Refused before it was acknowledged: the client was told (an HTTP status, a datagram or a
# spool record counted and sampled, a spool file quarantined). Word -> (sources, meaning).
REJECTED: Final[dict[str, tuple[str, str]]] = {
    MALFORMED: ("socket", "not Bruce's datagram format (sizes, lengths, trailing bytes)"),
    UNSUPPORTED_API_KEY: ("socket", "a datagram ApiKey other than 256 or 257"),
    UNSUPPORTED_VERSION: ("socket", "a datagram ApiVersion Ferry does not read"),
    INVALID_TOPIC: ("socket, http", "not a legal Kafka topic name"),
    UNKNOWN_TOPIC: ("http", "not defined, and http.auto_create_topics is off (404)"),
    TOO_LARGE: ("socket, http", "key + value over the topic's max_message_bytes (413)"),
    INVALID_HEADER: ("http", "a header Ferry reads has a bad value (400)"),
    INVALID_BODY: ("http", "the body does not fit the topic's content_type or schema (400)"),
    UNSUPPORTED_MEDIA_TYPE: ("http", "Content-Type not accepted by the topic (415)"),
    IDEMPOTENCY_KEY_REUSED: ("http", "an Idempotency-Key reused for another request (422)"),
    RATE_LIMITED: ("http", "over the topic's rate_limit (429)"),
    REQUEST_TIMEOUT: ("http", "the body did not arrive within http.body_timeout_seconds "
                      "(408)"),
    INTERNAL_TOPIC: ("http", "a topic name starting with __ that is neither in "
                     "http.internal_topics nor defined (400)"),
    INVALID_HTTP: ("http", "bytes the HTTP parser refuses (400, connection closed)"),
    URI_TOO_LONG: ("http", "request line over http.max_request_line_bytes (414)"),
    HEADERS_TOO_LARGE: ("http", "headers over http.max_header_bytes or http.max_headers "
                        "(431)"),
    UNSUPPORTED_CONTENT_ENCODING: ("http", "Content-Encoding other than gzip or identity "
                                   "(415)"),
    OVERLOADED: ("http", "the buffer's writer is behind (503)"),
    BODY_BUDGET: ("http", "the bodies being read or answered on every connection together "
                  "are at http.max_body_bytes_in_flight (503)"),
    STARTING: ("http", "the agent is starting (503)"),
    SHUTTING_DOWN: ("socket, http", "the agent is stopping (503)"),
    # (For the spool these three are not rejections: the batch waits in its file and is
    # counted as spool_batches_deferred{reason}.)
    BUFFER_FULL: ("socket, http", "the buffer is at buffer.max_bytes (503)"),
    DISK_FULL: ("socket, http", "the buffer's filesystem is down to its reserve (503)"),
    DISK_ERROR: ("socket, http", "the buffer's disk refused a write (503)"),
    UNENCODABLE: ("socket, http, spool", "a record the buffer cannot encode (400; a spool "
                  "file holding one is quarantined as unencodable)"),
    TOO_LARGE_FOR_TOPIC: ("socket, http, spool", "larger, even alone in a batch and "
                          "compressed, than the Kafka topic's max.message.bytes on the local "
                          "cluster (413; a spool record is left out, the rest of its file "
                          "ingested)"),
    TIMESTAMP_OUT_OF_RANGE: ("socket, spool", "a client-set timestamp older than the Kafka "
                             "topic's message.timestamp.before.max.ms, or further ahead than "
                             "its after.max.ms, by more than a minute"),
}

# Buffered (acknowledged), then dropped by an explicit rule; each is in the discard log.
DISCARDED: Final[dict[str, tuple[str, str]]] = {
    TTL: ("forwarder", "older than its topic's ttl_seconds"),
    ATTEMPTS: ("forwarder", "max_attempts sends failed"),
    INVALID: ("forwarder", "Kafka refused it for good (docs/design.md, \"Failure policy\")"),
    TOO_LARGE: ("forwarder", "over max_message_bytes (a spool record; other sources refuse "
                "at once)"),
    GENERATION: ("forwarder", "its topic was deleted (management API) after it was "
                 "accepted"),
    CORRUPT: ("forwarder", "its buffer record cannot be decoded"),
    PURGED: ("ferry purge", "removed by an operator"),
}

# Spool files moved to quarantine/ (with a .reason file beside them).
QUARANTINED: Final[dict[str, tuple[str, str]]] = {
    CORRUPT: ("spool", "not a valid spool file, or changed while being read"),
    UNREADABLE: ("spool", "the agent cannot read it"),
    UNENCODABLE: ("spool", "holds a record the buffer cannot encode"),
}

VOCABULARY: Final[dict[Kind, dict[str, tuple[str, str]]]] = {
    "rejected": REJECTED, "discarded": DISCARDED, "quarantined": QUARANTINED,
}


def table() -> str:
    """The vocabulary as the Markdown table of docs/status.md."""
    lines = ["| kind | reason | from | meaning |", "| --- | --- | --- | --- |"]
    for kind, words in VOCABULARY.items():
        for word, (sources, meaning) in words.items():
            lines.append(f"| {kind} | `{word}` | {sources} | {meaning} |")
    return "\n".join(lines)
