"""The status documents: JSON built from one merged registry ``View``. Pure functions, no I/O.

Every number on the status page, in the JSON endpoints and in ``ferry status`` comes from the
one metrics registry (``agent/metrics.py``), read through a ``View`` that already holds the
forwarder process's numbers. The documents are described by ``status/schema.json`` and in
``docs/status.md``; change the three together.

Documents never contain NaN or infinities (``json.dumps(allow_nan=False)`` must accept them):
unknown values are ``null``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.metrics import DEFINITIONS, Histogram, View

SOURCES = ("socket", "http", "spool", "replay")
# The kinds of agent/reasons.py, plus delivery errors (Kafka's error names).
SAMPLE_KINDS = ("discarded", "rejected", "quarantined", "error")
LEVELS = ("ok", "warning", "critical")
# A topic whose sends fail with a transient error (agent/forwarder/failures.py) is WARNING
# once it has failed this long with nothing acknowledged; one that needs an operator (an ACL,
# a missing topic) is CRITICAL at once.
STUCK_WARNING_SECONDS = 10.0

# Strings inside samples come from clients and errors; keep the documents (and the page) small.
_MAX_STRING = 400
_MAX_DEPTH = 4


@dataclass(frozen=True)
class Context:
    """What the documents need besides the registry: identity, lifecycle, configuration."""

    version: str
    hostname: str
    pid: int
    started_at: float
    now: float
    phase: str
    ready: bool
    ready_reason: str
    # Configured Kafka clusters: name ("local"/"remote") -> bootstrap servers.
    clusters: Mapping[str, str] = field(default_factory=dict)
    max_bytes: int = 0
    track_messages: bool = True
    track_seconds: int = 3600


@dataclass(frozen=True)
class Thresholds:
    """When ``health`` calls the agent unhealthy. ``ferry status`` can override each one."""

    oldest_warning_seconds: float = 60.0
    oldest_critical_seconds: float = 600.0
    used_warning_fraction: float = 0.80
    used_critical_fraction: float = 0.95
    # How far back "recently" reaches for discards, quarantines and restarts (bounded by the
    # server's history ring, 10 minutes).
    recent_seconds: float = 600.0

    def to_json(self) -> dict[str, float]:
        return {
            "oldest_warning_seconds": self.oldest_warning_seconds,
            "oldest_critical_seconds": self.oldest_critical_seconds,
            "used_warning_fraction": self.used_warning_fraction,
            "used_critical_fraction": self.used_critical_fraction,
            "recent_seconds": self.recent_seconds,
        }


DEFAULT_THRESHOLDS = Thresholds()


# -- small helpers ---------------------------------------------------------------------------


def _num(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value


def _count(value: float) -> int:
    return max(0, int(round(value))) if math.isfinite(value) else 0


def _gauge(view: View, name: str, **match: str) -> float | None:
    """A gauge's value, or None when nobody has set it (unknown is not zero)."""
    want = set(match.items())
    found = [v for k, v in view.values.get(name, {}).items() if want <= set(k)]
    if not found:
        return None
    return _num(sum(found))


def _counts(mapping: Mapping[str, float]) -> dict[str, int]:
    return {k: _count(v) for k, v in sorted(mapping.items())}


def jsonable(value: Any, depth: int = 0) -> Any:
    """Any sample or info value as JSON-safe data: bytes as text, long strings cut."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, str):
        return value if len(value) <= _MAX_STRING else value[:_MAX_STRING] + "…"
    if isinstance(value, bytes | bytearray | memoryview):
        return jsonable(bytes(value).decode("utf-8", "backslashreplace"), depth)
    if depth >= _MAX_DEPTH:
        return jsonable(repr(value), depth)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v, depth + 1) for v in value]
    return jsonable(str(value), depth)


def _latency(h: Histogram) -> dict[str, Any]:
    return {
        "count": h.count,
        "mean_seconds": _num(h.total / h.count) if h.count else None,
        "p50_seconds": _num(h.quantile(0.5)),
        "p99_seconds": _num(h.quantile(0.99)),
    }


# -- documents -------------------------------------------------------------------------------


def info(view: View, ctx: Context) -> dict[str, Any]:
    """Bruce's server info: who and what is running, since when."""
    return {
        "version": ctx.version,
        "hostname": ctx.hostname,
        "pid": ctx.pid,
        "time": ctx.now,
        "started_at": ctx.started_at,
        "uptime_seconds": max(0.0, ctx.now - ctx.started_at),
        "phase": ctx.phase,
        "ready": ctx.ready,
        "ready_reason": ctx.ready_reason,
        "details": jsonable(view.info),
        "memory": memory(view),
    }


def memory(view: View) -> dict[str, Any]:
    """The agent's own memory apart from the buffer's mapped pages (agent/process/memory.py).

    Both processes map the same buffer file, so its resident pages are one set of physical
    pages: the total is the larger of the two, not the sum."""
    processes: dict[str, dict[str, int]] = {}
    for (labels, value) in view.values.get("process_memory_bytes", {}).items():
        lab = dict(labels)
        if value == value:  # not NaN
            processes.setdefault(lab.get("process", "?"), {})[lab.get("kind", "?")] = \
                _count(value)
    if not processes:
        return {"own_bytes": None, "buffer_mapped_bytes": None, "rss_bytes": None,
                "processes": {}}
    return {
        "own_bytes": sum(p.get("anonymous", 0) for p in processes.values()),
        "buffer_mapped_bytes": max(p.get("buffer_mapped", 0) for p in processes.values()),
        "rss_bytes": sum(p.get("rss", 0) for p in processes.values()),
        "processes": {name: processes[name] for name in sorted(processes)},
    }


def totals(view: View) -> dict[str, Any]:
    """The headline counters (cumulative since start; the page turns them into rates)."""
    accepted = view.by("messages_accepted", "source")
    return {
        "received": _count(view.total("messages_received")),
        "accepted": _count(view.total("messages_accepted")),
        "accepted_by_source": {s: _count(accepted.get(s, 0))
                               for s in sorted(set(SOURCES) | set(accepted))},
        "rejected": _count(view.total("messages_rejected")),
        "delivered": _count(view.total("messages_delivered")),
        "delivered_by_cluster": _counts(view.by("messages_delivered", "cluster")),
        "discarded": _count(view.total("messages_discarded")),
        "delivery_failures": _count(view.total("delivery_failures")),
        "duplicate_acks": _count(view.total("messages_duplicate_acks")),
        "process_restarts": _count(view.total("process_restarts")),
    }


def counters(view: View, ctx: Context) -> dict[str, Any]:
    """Bruce's counters: every series of every metric, plus the headline totals."""
    metrics: list[dict[str, Any]] = []
    names = list(DEFINITIONS) + sorted(
        (set(view.values) | set(view.hists)) - set(DEFINITIONS))
    for name in names:
        d = DEFINITIONS.get(name)
        kind = d.kind if d else ("histogram" if name in view.hists else "gauge")
        series: list[dict[str, Any]] = []
        if kind == "histogram":
            for key, h in sorted(view.hists.get(name, {}).items()):
                cumulative, buckets = 0, []
                for bound, c in zip([*h.buckets, math.inf], h.counts, strict=True):
                    cumulative += c
                    buckets.append({"le": bound if math.isfinite(bound) else "+Inf",
                                    "count": cumulative})
                series.append({"labels": dict(key), "count": h.count, "sum": _num(h.total),
                               "buckets": buckets})
        else:
            for key, v in sorted(view.values.get(name, {}).items()):
                series.append({"labels": dict(key), "value": _num(v)})
        metrics.append({
            "name": name,
            "kind": kind,
            "help": d.help if d else "",
            "labels": list(d.labels) if d else [],
            "series": series,
        })
    return {"time": ctx.now, "totals": totals(view), "metrics": metrics}


def queues(view: View, ctx: Context) -> dict[str, Any]:
    """Bruce's queues: what waits in the buffer, per topic and overall."""
    messages = view.by("buffer_messages", "topic")
    sizes = view.by("buffer_bytes", "topic")
    ages = view.by("buffer_oldest_age_seconds", "topic")
    rows: list[dict[str, Any]] = []
    for topic in sorted(set(messages) | set(sizes)):
        n = _count(messages.get(topic, 0))
        if n <= 0:
            continue
        rows.append({
            "topic": topic,
            "messages": n,
            "bytes": _count(sizes.get(topic, 0)),
            "oldest_age_seconds": _num(ages[topic]) if topic in ages else None,
        })
    used = _gauge(view, "buffer_used_bytes")
    max_bytes = _gauge(view, "buffer_max_bytes") or float(ctx.max_bytes)
    known_ages: list[float] = [r["oldest_age_seconds"] for r in rows
                               if r["oldest_age_seconds"] is not None]
    return {
        "time": ctx.now,
        "buffer": {
            "messages": sum(r["messages"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows),
            "used_bytes": _count(used) if used is not None else None,
            "max_bytes": _count(max_bytes),
            "used_fraction": (_num(used / max_bytes) if used is not None and max_bytes > 0
                              else None),
            "full": bool(_gauge(view, "buffer_full")),
            "oldest_age_seconds": max(known_ages) if known_ages else None,
        },
        "in_flight": _counts(view.by("messages_in_flight", "cluster")),
        "topics": rows,
    }


def _last_error(view: View, topic: str) -> dict[str, Any] | None:
    latest: dict[str, Any] | None = None
    for (kind, reason), items in view.samples.items():
        if kind != "error":
            continue
        for item in items:
            t = item.get("time", 0)
            if item.get("topic") == topic and (latest is None or t > latest["time"]):
                latest = {"time": _num(float(t)), "error": reason,
                          "cluster": jsonable(item.get("cluster")),
                          "detail": jsonable(item.get("detail"))}
    if latest is not None:
        return latest
    # The samples roll over; the counter does not. Name the commonest error at least.
    errors = view.by("delivery_failures", "error", topic=topic)
    if not errors:
        return None
    worst = max(sorted(errors), key=lambda e: errors[e])
    clusters = view.by("delivery_failures", "cluster", topic=topic, error=worst)
    return {"time": None, "error": worst,
            "cluster": max(sorted(clusters), key=lambda c: clusters[c]) if clusters else None,
            "detail": None}


def _stuck(view: View, topic: str) -> dict[str, Any] | None:
    """Why the topic cannot deliver, as the forwarder last published it (or None)."""
    stuck = view.info.get("stuck_topics")
    item = stuck.get(topic) if isinstance(stuck, Mapping) else None
    if not isinstance(item, Mapping):
        return None
    return {
        "error": str(item.get("error", "")),
        "cluster": jsonable(item.get("cluster")),
        "detail": jsonable(item.get("detail")),
        "operator": bool(item.get("operator")),
        "since": _num(float(item.get("since", 0.0))),
        "last_time": _num(float(item.get("last_time", 0.0))),
        "failures": _count(float(item.get("failures", 0))),
    }


def topics(view: View, ctx: Context) -> dict[str, Any]:
    """Per topic: accepted, delivered, buffered, discarded, last error, clusters used."""
    names: set[str] = set()
    for metric in ("messages_accepted", "messages_delivered", "messages_discarded",
                   "buffer_messages", "delivery_failures"):
        names.update(view.by(metric, "topic"))
    stuck = view.info.get("stuck_topics")
    if isinstance(stuck, Mapping):
        names.update(str(t) for t in stuck)
    names.discard("")
    messages = view.by("buffer_messages", "topic")
    sizes = view.by("buffer_bytes", "topic")
    ages = view.by("buffer_oldest_age_seconds", "topic")
    rows = []
    for topic in sorted(names):
        delivered = view.by("messages_delivered", "cluster", topic=topic)
        used = sorted((c for c, n in delivered.items() if n > 0),
                      key=lambda c: (-delivered[c], c))
        buffered = _count(messages.get(topic, 0))
        rows.append({
            "topic": topic,
            "accepted": _count(view.total("messages_accepted", topic=topic)),
            "accepted_by_source": _counts(view.by("messages_accepted", "source", topic=topic)),
            "delivered": _count(sum(delivered.values())),
            "delivered_by_cluster": _counts(delivered),
            "buffered": buffered,
            "buffered_bytes": _count(sizes.get(topic, 0)) if buffered else 0,
            "oldest_age_seconds": _num(ages[topic]) if buffered and topic in ages else None,
            "discarded": _count(view.total("messages_discarded", topic=topic)),
            "discarded_by_reason": _counts(view.by("messages_discarded", "reason", topic=topic)),
            "delivery_failures": _count(view.total("delivery_failures", topic=topic)),
            "last_error": _last_error(view, topic),
            "stuck": _stuck(view, topic),
            "clusters_used": used,
        })
    return {"time": ctx.now, "topics": rows}


def clusters(view: View, ctx: Context) -> dict[str, Any]:
    """Bruce's metadata, as far as Ferry keeps it: each Kafka cluster's state and latency."""
    names = set(ctx.clusters)
    for metric in ("cluster_up", "cluster_brokers_up", "messages_in_flight",
                   "messages_delivered", "delivery_failures"):
        names.update(view.by(metric, "cluster"))
    for key in view.hists.get("produce_latency_seconds", {}):
        names.update(v for k, v in key if k == "cluster")
    names.discard("")
    metadata = view.info.get("cluster_metadata")
    states = view.info.get("cluster_state")
    states = states if isinstance(states, Mapping) else {}
    rows = []
    for name in sorted(names, key=lambda n: (n != "local", n)):
        up = _gauge(view, "cluster_up", cluster=name)
        brokers = _gauge(view, "cluster_brokers_up", cluster=name)
        in_flight = _gauge(view, "messages_in_flight", cluster=name)
        st = states.get(name)
        st = st if isinstance(st, Mapping) else {}
        state = st.get("state") if st.get("state") in ("unknown", "up", "down") else (
            "unknown" if up is None else ("up" if up >= 1 else "down"))
        errors = view.by("cluster_errors", "error", cluster=name)
        rows.append({
            "name": name,
            "configured": name in ctx.clusters,
            "bootstrap_servers": ctx.clusters.get(name),
            # The forwarder's one verdict (agent/forwarder/health.py); `up` says the same.
            "state": state,
            "reason": jsonable(st.get("reason")) or None,
            "state_since": _num(float(st["since"])) if isinstance(st.get("since"),
                                                                  int | float) else None,
            "last_probe_time": (_num(float(st["last_probe_time"]))
                                if isinstance(st.get("last_probe_time"), int | float) else None),
            "last_client_error": jsonable(st.get("last_error")) or None,
            # Brokers this agent cannot reach while others answer (agent/forwarder/brokers.py).
            "unreachable_brokers": jsonable(st.get("unreachable_brokers")) or [],
            "client_errors": _count(view.total("cluster_errors", cluster=name)),
            "client_errors_by_error": _counts(errors),
            "up": None if state == "unknown" else state == "up",
            "brokers_up": None if brokers is None else _count(brokers),
            "in_flight": None if in_flight is None else _count(in_flight),
            "delivered": _count(view.total("messages_delivered", cluster=name)),
            "delivery_failures": _count(view.total("delivery_failures", cluster=name)),
            "failures_by_error": _counts(view.by("delivery_failures", "error", cluster=name)),
            "latency": _latency(view.histogram("produce_latency_seconds", cluster=name)),
            "metadata": (jsonable(metadata.get(name)) if isinstance(metadata, Mapping)
                         else None),
        })
    return {"time": ctx.now, "clusters": rows}


def spool(view: View, ctx: Context) -> dict[str, Any]:
    """Spool intake: files waiting, done and quarantined; names that came again."""
    pending = _gauge(view, "spool_files_pending")
    paused = _gauge(view, "spool_intake_paused")
    return {
        "time": ctx.now,
        "files_pending": None if pending is None else _count(pending),
        "files_ingested": _count(view.total("spool_files_ingested")),
        "files_quarantined": _count(view.total("spool_files_quarantined")),
        "quarantined_by_reason": _counts(view.by("spool_files_quarantined", "reason")),
        "messages_accepted": _count(view.total("messages_accepted", source="spool")),
        # Binary files whose name was ingested before (spool_seen): skipped as duplicates,
        # ingested past the prefix already in, or ingested whole because they differ.
        "files_duplicate": _count(view.total("spool_files_duplicate")),
        "files_extended": _count(view.total("spool_files_extended")),
        "files_diverged": _count(view.total("spool_files_diverged")),
        "records_skipped": _count(view.total("spool_records_skipped")),
        # Waiting for room in the buffer: the files wait on disk, nothing is refused.
        "paused": bool(paused is not None and paused >= 1),
        "batches_deferred_by_reason": _counts(view.by("spool_batches_deferred", "reason")),
    }


def transactions(view: View, ctx: Context) -> dict[str, Any]:
    """Exactly-once topics (delivery = "exactly_once"): Kafka transactions and, per topic, the
    progress position (acceptance time of the newest message committed to Kafka)."""
    fenced = _gauge(view, "transactions_fenced")
    progress = view.by("transaction_progress_timestamp_seconds", "topic")
    return {
        "time": ctx.now,
        "committed": _count(view.total("transactions_committed")),
        "aborted": _count(view.total("transactions_aborted")),
        "aborted_by_reason": _counts(view.by("transactions_aborted", "reason")),
        "latency": _latency(view.histogram("transaction_seconds")),
        "fenced": bool(fenced is not None and fenced >= 1),
        "progress": [{"topic": t, "committed_up_to": _num(progress[t])}
                     for t in sorted(progress) if t],
    }


def _merge_counts(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def discards(view: View, ctx: Context) -> dict[str, Any]:
    """Bruce's discard report: counts by reason with the last few examples of each."""
    counted = {
        "discarded": view.by("messages_discarded", "reason"),
        "rejected": view.by("messages_rejected", "reason"),
        "quarantined": view.by("spool_files_quarantined", "reason"),
        "error": _merge_counts(view.by("delivery_failures", "error"),
                               view.by("cluster_errors", "error")),
    }
    groups: list[dict[str, Any]] = []
    for kind in SAMPLE_KINDS:
        reasons = set(counted[kind]) | {r for (k, r) in view.samples if k == kind}
        for reason in sorted(reasons):
            items = sorted(view.samples.get((kind, reason), []),
                           key=lambda e: e.get("time", 0), reverse=True)
            samples = [jsonable(dict(e)) for e in items]
            groups.append({
                "kind": kind,
                "reason": reason,
                "count": _count(counted[kind].get(reason, 0)),
                "last_time": samples[0].get("time") if samples else None,
                "samples": samples,
            })
    groups.sort(key=lambda g: (SAMPLE_KINDS.index(g["kind"]), -g["count"], g["reason"]))
    return {
        "time": ctx.now,
        "discarded": _count(view.total("messages_discarded")),
        "rejected": _count(view.total("messages_rejected")),
        "delivery_failures": _count(view.total("delivery_failures")),
        "rejected_by_source": _counts(view.by("messages_rejected", "source")),
        "groups": groups,
    }


def point(view: View, now: float) -> dict[str, Any]:
    """One history sample: the cumulative counters and depths the charts are drawn from."""
    t = totals(view)
    return {
        "time": now,
        "accepted_by_source": t["accepted_by_source"],
        "delivered": t["delivered"],
        "discarded": t["discarded"],
        "rejected": t["rejected"],
        "buffer_messages": _count(view.total("buffer_messages")),
        "buffer_bytes": _count(view.total("buffer_bytes")),
        "files_quarantined": _count(view.total("spool_files_quarantined")),
        "process_restarts": t["process_restarts"],
    }


def everything(
    view: View,
    ctx: Context,
    history: Sequence[Mapping[str, Any]] = (),
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
    *,
    include_history: bool = False,
) -> dict[str, Any]:
    """``/status/all``: every document the page shows, from one View, plus health."""
    doc: dict[str, Any] = {
        "time": ctx.now,
        "info": info(view, ctx),
        "totals": totals(view),
        "queues": queues(view, ctx),
        "topics": topics(view, ctx)["topics"],
        "clusters": clusters(view, ctx)["clusters"],
        "spool": spool(view, ctx),
        "transactions": transactions(view, ctx),
        "discards": discards(view, ctx),
        "history": [dict(p) for p in history],
    }
    doc["health"] = health(doc, thresholds)
    if not include_history:
        del doc["history"]
    return doc


# -- health ----------------------------------------------------------------------------------


def _problem(level: str, check: str, message: str) -> dict[str, str]:
    return {"level": level, "check": check, "message": message}


def _seconds(value: float) -> str:
    if value < 120:
        return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _recent(history: Iterable[Mapping[str, Any]], now: float, window: float,
            name: str, current: int) -> tuple[int, float]:
    """How much a cumulative count grew within the last ``window`` seconds, and over how long.

    (0, 0) when the history does not reach into the window or lacks the count.
    """
    for p in history:
        t, base = p.get("time"), p.get(name)
        if isinstance(t, int | float) and t >= now - window and isinstance(base, int | float):
            return max(0, int(current - base)), now - t  # a restart resets: never negative
    return 0, 0.0


def health(doc: Mapping[str, Any], thresholds: Thresholds = DEFAULT_THRESHOLDS) -> dict[str, Any]:
    """Nagios-style verdict on an ``/status/all`` document: ok, warning or critical, and why.

    Works on the document rather than the View so that ``ferry status`` can judge what it
    fetched with its own thresholds. Recent discards, quarantines and restarts are judged
    only when the document carries ``history``.
    """
    th = thresholds
    problems: list[dict[str, str]] = []
    inf = doc.get("info", {})
    if inf.get("phase") != "running":
        problems.append(_problem("warning", "phase", f"agent is {inf.get('phase', 'unknown')}"))
    buf = doc.get("queues", {}).get("buffer", {})
    if buf.get("full"):
        problems.append(_problem("critical", "buffer_full",
                                 "buffer full: new messages are refused"))
    used = buf.get("used_fraction")
    if isinstance(used, int | float):
        if used >= th.used_critical_fraction:
            problems.append(_problem("critical", "buffer_used", f"buffer {used:.0%} used"))
        elif used >= th.used_warning_fraction:
            problems.append(_problem("warning", "buffer_used", f"buffer {used:.0%} used"))
    age = buf.get("oldest_age_seconds")
    if isinstance(age, int | float):
        if age >= th.oldest_critical_seconds:
            problems.append(_problem("critical", "oldest_message",
                                     f"oldest buffered message is {_seconds(age)} old"))
        elif age >= th.oldest_warning_seconds:
            problems.append(_problem("warning", "oldest_message",
                                     f"oldest buffered message is {_seconds(age)} old"))
    configured = [c for c in doc.get("clusters", []) if c.get("configured")]
    down = [c for c in configured if c.get("state", "down" if c.get("up") is False
                                                else "up") == "down"]
    if down:
        every = len(down) == len(configured)
        for c in down:
            why = f": {c['reason']}" if c.get("reason") else ""
            problems.append(_problem("critical" if every else "warning", "cluster",
                                     f"cluster {c['name']} is down{why}"))
    for c in configured:
        if c in down:
            continue  # its reason names them already
        for b in c.get("unreachable_brokers") or []:
            if not isinstance(b, Mapping):
                continue
            parts = [str(p) for p in b.get("partitions") or []]
            shown = ", ".join(parts[:10]) + (f" and {len(parts) - 10} more" if len(parts) > 10
                                             else "")
            since, at = b.get("since"), doc.get("time")
            how_long = (f" for {_seconds(max(0.0, float(at) - float(since)))}"
                        if isinstance(since, int | float) and isinstance(at, int | float)
                        else "")
            problems.append(_problem(
                "warning", "broker",
                f"cluster {c['name']}: broker {b.get('node')} ({b.get('address')}) does not "
                f"answer this agent{how_long}; partitions waiting for it: {shown or 'none'} "
                "(the other partitions are sent to)"))
    for t in doc.get("topics", []):
        st = t.get("stuck")
        if not isinstance(st, Mapping):
            continue
        since, at = st.get("since"), doc.get("time")
        stuck_for = ""
        if isinstance(since, int | float) and isinstance(at, int | float):
            age = max(0.0, float(at) - float(since))
            if not st.get("operator") and age < STUCK_WARNING_SECONDS:
                continue  # a transient failure retried at once is no news
            stuck_for = f" for {_seconds(age)}"
        text = (f"topic {t['topic']} cannot be delivered{stuck_for}: {st.get('error')} at "
                f"cluster {st.get('cluster')} ({st.get('detail')}); "
                f"{t.get('buffered', 0)} messages kept")
        problems.append(_problem("critical" if st.get("operator") else "warning", "topic",
                                 text))
    if doc.get("transactions", {}).get("fenced"):
        problems.append(_problem("critical", "fenced",
                                 "exactly-once topics stopped: another running agent uses this "
                                 "agent's identity (forwarder.agent_id)"))
    history = doc.get("history") or []
    now = doc.get("time")
    if history and isinstance(now, int | float):
        tot = doc.get("totals", {})
        for name, current, one, many in (
            ("discarded", tot.get("discarded", 0), "message discarded", "messages discarded"),
            ("files_quarantined", doc.get("spool", {}).get("files_quarantined", 0),
             "spool file quarantined", "spool files quarantined"),
            ("process_restarts", tot.get("process_restarts", 0), "process restart",
             "process restarts"),
        ):
            grew, span = _recent(history, now, th.recent_seconds, name, int(current or 0))
            if grew:
                what = one if grew == 1 else many
                problems.append(_problem("warning", name,
                                         f"{grew} {what} in the last {_seconds(span)}"))
    worst = max((LEVELS.index(p["level"]) for p in problems), default=0)
    problems.sort(key=lambda p: -LEVELS.index(p["level"]))
    return {"status": LEVELS[worst], "code": worst, "problems": problems,
            "thresholds": th.to_json()}
