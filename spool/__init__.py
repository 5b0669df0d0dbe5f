"""Spool files: the binary format, a crash-safe writer, readers and the directory listing.

Used by the agent's spool intake and by the Spark writer on executors, so nothing here may
import from ``agent``. The format is specified in ``docs/spool.md`` and ``spool.format``.
"""

from ferry_client.topic_names import is_legal_topic
from spool.format import (
    EXTENSION,
    Headers,
    SpoolFormatError,
    SpoolRecord,
    check_topic,
)
from spool.reader import (
    BinarySpoolReader,
    JsonLinesReader,
    SpoolReader,
    TextLinesReader,
    list_ready_files,
    list_stale_temp_files,
    list_unrecognized_files,
    open_spool_file,
    read_spool_file,
    verify,
)
from spool.writer import SpoolWriter, unique_file_name, write_spool_file

__all__ = [
    "EXTENSION",
    "BinarySpoolReader",
    "Headers",
    "JsonLinesReader",
    "SpoolFormatError",
    "SpoolReader",
    "SpoolRecord",
    "SpoolWriter",
    "TextLinesReader",
    "check_topic",
    "is_legal_topic",
    "list_ready_files",
    "list_stale_temp_files",
    "list_unrecognized_files",
    "open_spool_file",
    "read_spool_file",
    "unique_file_name",
    "verify",
    "write_spool_file",
]
