"""Ferry's status page, JSON and Prometheus endpoints, message tracking and ``ferry status``.

Everything here reads the one metrics registry (``agent/metrics.py``); see docs/status.md.
The daemon composes ``status.routes.routes(runtime)`` into its HTTP listener.
"""
