"""What every Ferry OS process sets up: logging, rate-limited log lines, GC tuning, and
memory sampling."""
