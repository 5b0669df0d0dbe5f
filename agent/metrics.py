"""The one metrics registry: every counter, gauge and recent-sample list Ferry keeps.

Each process (the ingest process and the forwarder process) owns a ``Registry``. Child
processes ship ``snapshot()`` to the parent a few times a second; the parent's registry
``merge()``s them, so whatever reads the parent's registry (status page, JSON, Prometheus)
sees every process's numbers. Counters from a child that restarted keep counting from where
the old child left off.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]
LabelKey = tuple[tuple[str, str], ...]

# Seconds; sized for fsync commits (sub-ms on good disks, tens of ms on bad ones) and Kafka.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


DEFINITIONS: dict[str, MetricDef] = {
    d.name: d
    for d in (
        MetricDef("messages_received", "counter",
                  "Messages handed to Ferry by clients, before validation.", ("source",)),
        MetricDef("messages_accepted", "counter",
                  "Messages durably committed to the buffer.", ("source", "topic")),
        MetricDef("messages_rejected", "counter",
                  "Input refused before it was committed (never acknowledged).",
                  ("source", "reason")),
        MetricDef("messages_delivered", "counter",
                  "Messages acknowledged by a Kafka cluster and removed from the buffer.",
                  ("topic", "cluster")),
        MetricDef("messages_discarded", "counter",
                  "Buffered messages discarded by an explicit rule; each is in the discard log.",
                  ("topic", "reason")),
        MetricDef("messages_duplicate_acks", "counter",
                  "Acknowledgements for messages already removed (e.g. both clusters acked).",
                  ("topic", "cluster")),
        MetricDef("delivery_failures", "counter",
                  "Failed delivery attempts (the message stays buffered and is retried).",
                  ("topic", "cluster", "error")),
        MetricDef("messages_isolated", "counter",
                  "Messages sent again in a batch of their own after Kafka refused a batch "
                  "they were in (agent/forwarder/isolation.py).", ("topic",)),
        MetricDef("messages_refused", "counter",
                  "Messages Kafka refused alone, by Kafka's error; each is discarded as "
                  "invalid (also in messages_discarded).", ("topic", "cluster", "error")),
        MetricDef("messages_restamped", "counter",
                  "Messages sent with the send time after waiting in the buffer past their "
                  "topic's timestamp limit; the original time is in a header "
                  "(agent/forwarder/timestamps.py).", ("topic",)),
        MetricDef("buffer_commits", "counter", "Durable buffer transactions committed.",
                  ("writer",)),
        MetricDef("buffer_commit_seconds", "histogram",
                  "Time to commit a group of messages durably (write + fsync).", ("writer",)),
        MetricDef("buffer_messages", "gauge", "Messages in the buffer.", ("topic",)),
        MetricDef("buffer_bytes", "gauge", "Bytes of message data in the buffer.", ("topic",)),
        MetricDef("buffer_oldest_age_seconds", "gauge",
                  "Age of the oldest buffered message.", ("topic",)),
        MetricDef("buffer_used_bytes", "gauge", "LMDB pages in use by buffered messages."),
        MetricDef("buffer_max_bytes", "gauge", "Configured buffer capacity."),
        MetricDef("buffer_full", "gauge", "1 while new input is refused for lack of space."),
        MetricDef("kafka_topic_limits_known", "gauge",
                  "Topics whose limits on the local cluster (max.message.bytes, timestamps) "
                  "the intake knows from the forwarder: what they can never take is refused "
                  "at intake (too_large_for_topic, timestamp_out_of_range)."),
        MetricDef("produce_latency_seconds", "histogram",
                  "Time from produce() to the cluster's acknowledgement.", ("cluster",)),
        MetricDef("topics_stuck", "gauge",
                  "Topics whose sends fail with an error retrying cannot fix (authorization, "
                  "unknown topic, TLS...): they wait for an operator; /status/topics says "
                  "which and why."),
        MetricDef("cluster_up", "gauge",
                  "1 while the cluster is up, 0 while down (docs/design.md, \"Cluster "
                  "state\"); absent while unknown.", ("cluster",)),
        MetricDef("cluster_errors", "counter",
                  "Errors the cluster's clients reported outside deliveries (connect "
                  "failures, authentication, ...).", ("cluster", "error")),
        MetricDef("cluster_brokers_up", "gauge", "Brokers in the cluster's metadata.",
                  ("cluster",)),
        MetricDef("messages_in_flight", "gauge", "Messages handed to Kafka, not yet acked.",
                  ("cluster",)),
        MetricDef("spool_files_ingested", "counter", "Spool files fully ingested."),
        MetricDef("spool_files_quarantined", "counter", "Spool files moved to quarantine/.",
                  ("reason",)),
        MetricDef("spool_files_duplicate", "counter",
                  "Binary spool files removed without ingesting: a file of the same name and "
                  "the same content (or a prefix of it) was ingested before (a retried task)."),
        MetricDef("spool_files_extended", "counter",
                  "Binary spool files whose first records were ingested before under the same "
                  "name (same content): only the rest was ingested (a retried task)."),
        MetricDef("spool_files_diverged", "counter",
                  "Binary spool files whose name was ingested before with other content (a "
                  "nondeterministic Spark plan): ingested whole, so some records may repeat."),
        MetricDef("spool_records_skipped", "counter",
                  "Records of re-published spool files not ingested again, because the same "
                  "bytes were ingested before under the same name.", ("reason",)),
        MetricDef("spool_files_pending", "gauge", "Spool files waiting to be ingested."),
        MetricDef("spool_batches_deferred", "counter",
                  "Spool batches the buffer refused for lack of space (buffer_full, "
                  "disk_full, disk_error); their records wait in the file, which is retried "
                  "every 0.5 s. Not messages_rejected: nothing was refused to a client.",
                  ("reason",)),
        MetricDef("spool_intake_paused", "gauge",
                  "1 while the spool intake waits for room in the buffer."),
        MetricDef("spool_files_unrecognized", "gauge",
                  "Files in spool directories that Ferry does not read (wrong place or "
                  "extension)."),
        MetricDef("spool_files_failed", "counter",
                  "Spool files Ferry could not finish with: unremovable (ingested, but the "
                  "agent may not delete or move it), error (an unexpected error, in the log).",
                  ("reason",)),
        MetricDef("transactions_committed", "counter",
                  "Kafka transactions of exactly-once topics committed."),
        MetricDef("transactions_aborted", "counter",
                  "Kafka transactions of exactly-once topics given up (the next producer "
                  "instance settles them; what landed is found and not sent again): "
                  "refused (Kafka refused a message), timed_out (not committed within "
                  "transaction_commit_timeout_ms: a quota, a slow cluster), failed.",
                  ("reason",)),
        MetricDef("transaction_seconds", "histogram",
                  "Time from a transaction's first message to its commit."),
        MetricDef("transaction_progress_timestamp_seconds", "gauge",
                  "Acceptance time of the newest message committed to Kafka of an "
                  "exactly-once topic (its progress position).", ("topic",)),
        MetricDef("transactions_fenced", "gauge",
                  "1 once another running agent with this agent's identity fenced its "
                  "transactional producer: exactly-once topics are stopped."),
        MetricDef("http_requests", "counter", "HTTP requests answered.", ("route", "status")),
        MetricDef("http_connections_closed", "counter",
                  "HTTP connections closed before a request could be read: "
                  "too_many_connections (a new one at the cap with every connection busy; "
                  "answered 503 over plain HTTP), closed_for_room (the one that waited "
                  "longest for a request, to admit a new one at the cap), tls_handshake (a "
                  "TLS handshake failed: no or an unknown client certificate, plain HTTP "
                  "on the TLS port, ...; the log line says which).", ("reason",)),
        MetricDef("process_restarts", "counter", "Child processes restarted.", ("process",)),
        MetricDef("process_memory_bytes", "gauge",
                  "Memory of each Ferry process by kind: rss (all resident), anonymous (its "
                  "own: heap, Python, librdkafka), buffer_mapped (resident pages of the buffer "
                  "file; reclaimable file cache).", ("process", "kind")),
    )
}

SAMPLE_KEEP = 10  # recent samples kept per (kind, reason), as Bruce's discard report does


class Histogram:
    __slots__ = ("buckets", "counts", "total", "count")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = 0
        for i, bound in enumerate(self.buckets):  # noqa: B007 - i is used after the loop
            if value <= bound:
                break
        else:
            i = len(self.buckets)
        self.counts[i] += 1
        self.total += value
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """Upper bucket bound below which a fraction ``q`` of observations fall."""
        if self.count == 0:
            return None
        target = q * self.count
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= target:
                return self.buckets[i] if i < len(self.buckets) else float("inf")
        return float("inf")

    def to_json(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts),
                "sum": self.total, "count": self.count}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Histogram:
        h = cls(tuple(data["buckets"]))
        h.counts = list(data["counts"])
        h.total = float(data["sum"])
        h.count = int(data["count"])
        return h

    def add(self, other: Histogram) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.total += other.total
        self.count += other.count


def _key(labels: Mapping[str, str]) -> LabelKey:
    return tuple(sorted(labels.items()))


class Registry:
    """Thread-safe store of every number Ferry reports. Hot paths call it once per batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[LabelKey, float]] = {}
        self._hists: dict[str, dict[LabelKey, Histogram]] = {}
        self._samples: dict[tuple[str, str], deque[dict[str, Any]]] = {}
        self._info: dict[str, Any] = {}
        # Merged state of child processes: latest snapshot per child, plus counter bases
        # carried over from earlier incarnations of a restarted child.
        self._children: dict[str, dict[str, Any]] = {}
        self._bases: dict[str, dict[str, dict[LabelKey, float]]] = {}
        # What earlier incarnations of a child recorded in histograms and samples.
        self._hist_bases: dict[str, dict[str, dict[LabelKey, Histogram]]] = {}
        self._sample_bases: dict[str, dict[tuple[str, str], list[dict[str, Any]]]] = {}
        self.started = time.time()
        # Tells a restarted child's snapshots from its predecessor's.
        self.incarnation = uuid.uuid4().hex

    # -- recording -------------------------------------------------------------------------
    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        _check(name, "counter", labels)
        key = _key(labels)
        with self._lock:
            series = self._values.setdefault(name, {})
            series[key] = series.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        _check(name, "gauge", labels)
        with self._lock:
            self._values.setdefault(name, {})[_key(labels)] = value

    def replace_gauge(self, name: str, series: Mapping[LabelKey, float]) -> None:
        """Set every series of a gauge at once, dropping series that are gone."""
        with self._lock:
            self._values[name] = dict(series)

    def observe(self, name: str, value: float, **labels: str) -> None:
        _check(name, "histogram", labels)
        key = _key(labels)
        with self._lock:
            series = self._hists.setdefault(name, {})
            hist = series.get(key)
            if hist is None:
                hist = series[key] = Histogram()
            hist.observe(value)

    def sample(self, kind: str, reason: str, item: Mapping[str, Any]) -> None:
        """Keep one of the last few examples of a reject/discard/error, for people to read."""
        entry = {"time": time.time(), **item}
        with self._lock:
            q = self._samples.get((kind, reason))
            if q is None:
                q = self._samples[(kind, reason)] = deque(maxlen=SAMPLE_KEEP)
            q.append(entry)

    def set_info(self, key: str, value: Any) -> None:
        with self._lock:
            self._info[key] = value

    # -- cross-process ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything this process recorded, as plain picklable/JSON-able data."""
        with self._lock:
            return {
                "values": {n: [[list(map(list, k)), v] for k, v in s.items()]
                           for n, s in self._values.items()},
                "hists": {n: [[list(map(list, k)), h.to_json()] for k, h in s.items()]
                          for n, s in self._hists.items()},
                "samples": [[kind, reason, list(q)] for (kind, reason), q in self._samples.items()],
                "info": dict(self._info),
                "incarnation": self.incarnation,
            }

    def merge(self, child: str, snap: dict[str, Any]) -> None:
        """Adopt the latest snapshot of a child process."""
        with self._lock:
            previous = self._children.get(child)
            if previous is not None:
                restarted = previous.get("incarnation") != snap.get("incarnation")
                self._carry_restart(child, previous, snap, restarted)
            self._children[child] = snap

    def _carry_restart(
        self, child: str, old: dict[str, Any], new: dict[str, Any], restarted: bool
    ) -> None:
        # A new incarnation (or, for snapshots without one, a counter that went down) means
        # the child restarted: keep its old totals as a base.
        new_vals = {n: {_tuplify(k): v for k, v in s} for n, s in new["values"].items()}
        for name, series in old["values"].items():
            if DEFINITIONS.get(name, MetricDef(name, "gauge", "")).kind != "counter":
                continue
            for k, v in series:
                key = _tuplify(k)
                if restarted or new_vals.get(name, {}).get(key, 0) < v:
                    base = self._bases.setdefault(child, {}).setdefault(name, {})
                    base[key] = base.get(key, 0) + v
        if not restarted:
            return
        # Histograms are counters too (their _count, _sum and buckets must never go down),
        # and the recent samples are what the status page explains the counts with.
        hist_base = self._hist_bases.setdefault(child, {})
        for name, series in old["hists"].items():
            target = hist_base.setdefault(name, {})
            for k, hj in series:
                key = _tuplify(k)
                h = Histogram.from_json(hj)
                if key in target:
                    target[key].add(h)
                else:
                    target[key] = h
        sample_base = self._sample_bases.setdefault(child, {})
        for kind, reason, items in old["samples"]:
            kept = sample_base.setdefault((kind, reason), [])
            kept.extend(items)
            del kept[:-SAMPLE_KEEP]

    # -- reading ---------------------------------------------------------------------------
    def view(self) -> View:
        """A consistent merged copy of every process's numbers."""
        with self._lock:
            values = {n: dict(s) for n, s in self._values.items()}
            hists: dict[str, dict[LabelKey, Histogram]] = {}
            for n, s in self._hists.items():
                hists[n] = {}
                for k, h in s.items():
                    copy = Histogram(h.buckets)
                    copy.add(h)
                    hists[n][k] = copy
            samples = {k: list(q) for k, q in self._samples.items()}
            info = dict(self._info)
            for child, snap in self._children.items():
                for name, series in snap["values"].items():
                    kind = DEFINITIONS.get(name, MetricDef(name, "gauge", "")).kind
                    target = values.setdefault(name, {})
                    for k, v in series:
                        key = _tuplify(k)
                        if kind == "counter":
                            target[key] = target.get(key, 0) + v
                        else:
                            target[key] = v
                for name, bases in self._bases.get(child, {}).items():
                    target = values.setdefault(name, {})
                    for key, v in bases.items():
                        target[key] = target.get(key, 0) + v
                hist_series = [(name, _tuplify(k), Histogram.from_json(hj))
                               for name, series in snap["hists"].items() for k, hj in series]
                for name, hbase in self._hist_bases.get(child, {}).items():
                    for key, h in hbase.items():
                        copy = Histogram(h.buckets)
                        copy.add(h)
                        hist_series.append((name, key, copy))
                for name, key, h in hist_series:
                    htarget = hists.setdefault(name, {})
                    if key in htarget:
                        htarget[key].add(h)
                    else:
                        htarget[key] = h
                sample_items = [(kind, reason, items) for kind, reason, items in snap["samples"]]
                sample_items += [(kind, reason, items) for (kind, reason), items
                                 in self._sample_bases.get(child, {}).items()]
                for kind, reason, items in sample_items:
                    merged = samples.setdefault((kind, reason), [])
                    merged.extend(items)
                    merged.sort(key=lambda e: e["time"])
                    del merged[:-SAMPLE_KEEP]
                info.update(snap["info"])
            return View(values, hists, samples, info, self.started)


@dataclass
class View:
    values: dict[str, dict[LabelKey, float]]
    hists: dict[str, dict[LabelKey, Histogram]]
    samples: dict[tuple[str, str], list[dict[str, Any]]]
    info: dict[str, Any]
    started: float

    def total(self, name: str, **match: str) -> float:
        """Sum of a metric over every series whose labels include ``match``."""
        want = set(match.items())
        return sum(v for k, v in self.values.get(name, {}).items() if want <= set(k))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """A metric summed per value of one label."""
        want = set(match.items())
        out: dict[str, float] = {}
        for k, v in self.values.get(name, {}).items():
            if want <= set(k):
                lv = dict(k).get(label, "")
                out[lv] = out.get(lv, 0) + v
        return out

    def histogram(self, name: str, **match: str) -> Histogram:
        want = set(match.items())
        out = Histogram()
        for k, h in self.hists.get(name, {}).items():
            if want <= set(k):
                out.add(h)
        return out


def _tuplify(k: Iterable[Iterable[str]]) -> LabelKey:
    return tuple((str(a), str(b)) for a, b in k)


def _check(name: str, kind: Kind, labels: Mapping[str, str]) -> None:
    d = DEFINITIONS.get(name)
    if d is None or d.kind != kind or set(labels) != set(d.labels):
        raise KeyError(f"metric {name!r} ({kind}) with labels {sorted(labels)} is not defined")


# The process's registry. Each process has its own; the ingest process also holds the merge.
REGISTRY = Registry()
