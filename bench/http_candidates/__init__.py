"""Candidate front doors for Ferry's publish logic, used only by bench/bench_http_servers.py
until issue #29 decides which server Ferry keeps (nothing in agent/ imports them)."""
