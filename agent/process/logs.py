"""Logging set-up: one line per event, with the process role, to stderr (journald)."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, process: str = "ingest") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s ferry[{process}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
