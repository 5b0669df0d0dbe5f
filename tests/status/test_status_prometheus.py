"""``/metrics``: Prometheus text format that parses, with conventional names and units."""

from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from agent import __version__
from agent.metrics import DEFINITIONS, Registry
from tests.status.statuskit import StatusServer


def scrape(url: str) -> dict[str, Metric]:
    """Families by name, parsed by prometheus_client's own parser."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name not in families, f"{family.name} exposed twice"
        families[family.name] = family
    return families


def value(family: Metric, name: str, **labels: str) -> float:
    found = [s.value for s in family.samples if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {found} in {family.samples}"
    return float(found[0])


def test_every_metric_is_exposed_with_conventional_names(status_server: StatusServer) -> None:
    got = scrape(status_server.url)
    types = {name: f.type for name, f in got.items()}
    for name, d in DEFINITIONS.items():
        assert types.get("ferry_" + name) == d.kind, name
    for name, kind in types.items():
        assert re.fullmatch(r"ferry_[a-z][a-z0-9_]*", name), name
        if kind == "counter":
            assert all(s.name in (name + "_total", name + "_created")
                       for s in got[name].samples), name
        if kind == "histogram":
            assert name.endswith("_seconds"), f"histogram {name} should be in seconds"
    # Durations and sizes carry their unit in the name.
    for name in types:
        if re.search(r"latency|_age_|_time_", name):
            assert name.endswith("_seconds"), name
    assert value(got["ferry_build_info"], "ferry_build_info", version=__version__) == 1


def test_values_match_what_happened(status_server: StatusServer) -> None:
    act = status_server.activity
    act.accept("clicks", 9, "socket", size=50)
    act.accept("clicks", 2, "http")
    act.deliver("clicks", 6, "local", latency=0.003)
    act.discard("clicks", 1, "ttl")
    act.reject("socket", "malformed", 3)
    got = scrape(status_server.url)
    accepted = got["ferry_messages_accepted"]
    assert value(accepted, "ferry_messages_accepted_total", source="socket", topic="clicks") == 9
    assert value(accepted, "ferry_messages_accepted_total", source="http", topic="clicks") == 2
    assert value(got["ferry_messages_delivered"], "ferry_messages_delivered_total",
                 topic="clicks", cluster="local") == 6
    assert value(got["ferry_messages_discarded"], "ferry_messages_discarded_total",
                 topic="clicks", reason="ttl") == 1
    assert value(got["ferry_messages_rejected"], "ferry_messages_rejected_total",
                 source="socket", reason="malformed") == 3
    assert value(got["ferry_buffer_messages"], "ferry_buffer_messages", topic="clicks") == 4
    assert value(got["ferry_buffer_bytes"], "ferry_buffer_bytes", topic="clicks") > 0
    assert value(got["ferry_buffer_max_bytes"], "ferry_buffer_max_bytes") == 64 * 1024 * 1024
    assert value(got["ferry_cluster_up"], "ferry_cluster_up", cluster="local") == 1
    # An unlabelled counter that never moved is 0, not missing.
    assert value(got["ferry_spool_files_ingested"], "ferry_spool_files_ingested_total") == 0

    latency = got["ferry_produce_latency_seconds"]
    buckets = [(s.labels["le"], s.value) for s in latency.samples
               if s.name == "ferry_produce_latency_seconds_bucket"]
    bounds = [float(le) for le, _ in buckets]
    assert bounds == sorted(bounds) and math.isinf(bounds[-1])
    counts = [c for _, c in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    assert counts[-1] == value(latency, "ferry_produce_latency_seconds_count", cluster="local")
    assert counts[-1] == 6
    assert value(latency, "ferry_produce_latency_seconds_count", cluster="local") == 6
    assert math.isclose(value(latency, "ferry_produce_latency_seconds_sum", cluster="local"),
                        0.018)
    le_5ms = dict(buckets)["0.005"]
    assert le_5ms == 6 and dict(buckets)["0.002"] == 0


def test_forwarder_process_numbers_are_included(status_server: StatusServer) -> None:
    """The forwarder runs in its own process; its snapshots merge into the one registry."""
    child = Registry()
    child.inc("messages_delivered", 5, topic="orders", cluster="remote")
    child.set("cluster_up", 0.0, cluster="remote")
    status_server.agent.registry.merge("forwarder", child.snapshot())
    status_server.agent.registry.inc("messages_delivered", 2, topic="orders", cluster="remote")
    got = scrape(status_server.url)
    assert value(got["ferry_messages_delivered"], "ferry_messages_delivered_total",
                 topic="orders", cluster="remote") == 7
    assert value(got["ferry_cluster_up"], "ferry_cluster_up", cluster="remote") == 0


def test_label_values_are_escaped(status_server: StatusServer) -> None:
    status_server.activity.reject("http", 'bad "quote"\\ and\nnewline')
    got = scrape(status_server.url)
    assert value(got["ferry_messages_rejected"], "ferry_messages_rejected_total",
                 source="http", reason='bad "quote"\\ and\nnewline') == 1


def test_openmetrics_is_served_when_asked_for(status_server: StatusServer) -> None:
    status_server.activity.accept("clicks", 2)
    r = httpx.get(status_server.url + "/metrics", timeout=10,
                  headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(r.text)}  # type: ignore[no-untyped-call]
    assert value(families["ferry_messages_accepted"], "ferry_messages_accepted_total",
                 source="socket", topic="clicks") == 2


def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "status.md").read_text()
    for name, d in DEFINITIONS.items():
        exposed = f"ferry_{name}" + ("_total" if d.kind == "counter" else "")
        assert f"| `{exposed}` | {d.kind} |" in doc, f"{exposed} missing from docs/status.md"
