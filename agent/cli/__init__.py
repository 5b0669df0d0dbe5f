"""The ``ferry`` command: its parser and subcommands (``main.py``), ``ferry replay``."""
