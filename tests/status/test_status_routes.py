"""The status routes over real HTTP: every JSON document valid against status/schema.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from agent.buffer import keys
from agent.daemon.agent import Agent
from status import model
from status.routes import PAGE_CSP, routes
from status.schema import schema, validator
from tests.status.statuskit import Activity, StatusServer, serve
from tests.waiting import wait_until

DOCUMENTS = {
    "/status/all": "all",
    "/status/all?history=1": "all",
    "/status/info": "info",
    "/status/counters": "counters",
    "/status/discards": "discards",
    "/status/queues": "queues",
    "/status/topics": "topics",
    "/status/clusters": "clusters",
    "/status/spool": "spool",
}


def get_json(url: str, expect: int = 200) -> Any:
    r = httpx.get(url, timeout=10)
    assert r.status_code == expect, r.text
    assert r.headers["content-type"] == "application/json"
    # Strict parse: NaN or Infinity would make the answer invalid JSON for other parsers.
    return json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def assert_valid(doc: Any, document: str) -> None:
    errors = sorted(validator(document).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def busy(activity: Activity) -> None:
    """A bit of everything: several sources and topics, deliveries, discards, rejects."""
    activity.accept("clicks", 30, "socket")
    activity.accept("clicks", 5, "http")
    activity.accept("orders", 7, "spool")
    activity.deliver("clicks", 20, "local", partition=1)
    activity.deliver("clicks", 3, "remote", partition=0)
    activity.discard("orders", 2, "ttl")
    activity.reject("socket", "malformed", 2, detail="<script>alert(1)</script>")
    activity.fail("clicks", "local", "MSG_TIMED_OUT", "Local: Message timed out")
    activity.cluster("remote", up=False)
    activity.registry.set("spool_files_pending", 4.0)
    activity.registry.inc("spool_files_quarantined", reason="corrupt")
    activity.registry.inc("spool_files_duplicate")
    activity.registry.inc("spool_files_diverged")
    activity.registry.inc("spool_records_skipped", 30, reason="duplicate")
    activity.registry.set("spool_intake_paused", 1.0)
    activity.registry.inc("spool_batches_deferred", 3, reason="disk_full")


def test_the_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(schema())
    for name in ("all", "info", "counters", "discards", "queues", "topics", "clusters",
                 "spool", "message", "error", "point", "health"):
        assert name in schema()["$defs"]


@pytest.mark.parametrize("busy_agent", [False, True], ids=["idle", "busy"])
def test_every_document_matches_its_schema(status_server: StatusServer, busy_agent: bool) -> None:
    if busy_agent:
        busy(status_server.activity)
    for path, document in DOCUMENTS.items():
        assert_valid(get_json(status_server.url + path), document)


def test_documents_report_what_happened(status_server: StatusServer) -> None:
    busy(status_server.activity)
    doc = get_json(status_server.url + "/status/all")
    assert doc["totals"]["accepted_by_source"] == {"socket": 30, "http": 5, "spool": 7,
                                                   "replay": 0}
    assert doc["totals"]["delivered"] == 23
    assert doc["totals"]["discarded"] == 2
    assert doc["totals"]["rejected"] == 2
    assert doc["queues"]["buffer"]["messages"] == 17  # clicks 35 - 23, orders 7 - 2
    assert {t["topic"]: t["messages"] for t in doc["queues"]["topics"]} == {"clicks": 12,
                                                                             "orders": 5}
    assert doc["queues"]["buffer"]["oldest_age_seconds"] is not None
    assert doc["queues"]["buffer"]["max_bytes"] == 64 * 1024 * 1024
    topics = {t["topic"]: t for t in doc["topics"]}
    assert topics["clicks"]["clusters_used"] == ["local", "remote"]
    assert topics["clicks"]["delivered_by_cluster"] == {"local": 20, "remote": 3}
    assert topics["clicks"]["last_error"]["error"] == "MSG_TIMED_OUT"
    assert topics["orders"]["discarded_by_reason"] == {"ttl": 2}
    clusters = {c["name"]: c for c in doc["clusters"]}
    assert clusters["local"]["up"] is True and clusters["remote"]["up"] is False
    assert clusters["local"]["latency"]["count"] == 20
    assert doc["spool"]["files_pending"] == 4 and doc["spool"]["files_quarantined"] == 1
    assert (doc["spool"]["files_duplicate"], doc["spool"]["files_extended"],
            doc["spool"]["files_diverged"], doc["spool"]["records_skipped"]) == (1, 0, 1, 30)
    assert doc["spool"]["paused"] is True
    assert doc["spool"]["batches_deferred_by_reason"] == {"disk_full": 3}
    groups = {(g["kind"], g["reason"]): g for g in doc["discards"]["groups"]}
    assert groups[("discarded", "ttl")]["count"] == 2
    assert len(groups[("discarded", "ttl")]["samples"]) == 2
    assert groups[("rejected", "malformed")]["samples"][0]["detail"] == "<script>alert(1)</script>"
    # One of two clusters down: a warning, not critical.
    assert doc["health"]["status"] == "warning"
    assert any(p["check"] == "cluster" for p in doc["health"]["problems"])


def test_history_ring_is_served_on_request(status_server: StatusServer) -> None:
    status_server.activity.accept("clicks", 3)
    url = status_server.url + "/status/all?history=1"

    def with_three_points() -> Any:
        doc = get_json(url)
        return doc if len(doc["history"]) >= 3 else None

    doc = wait_until(with_three_points, timeout=10, message="three history points")
    assert_valid(doc, "all")
    times = [p["time"] for p in doc["history"]]
    assert times == sorted(times)
    assert doc["history"][-1]["accepted_by_source"]["socket"] == 3
    assert "history" not in get_json(status_server.url + "/status/all")


def test_nan_and_infinite_values_still_give_valid_json(status_server: StatusServer) -> None:
    reg = status_server.activity.registry
    reg.set("buffer_used_bytes", float("nan"))
    reg.set("cluster_brokers_up", float("inf"), cluster="local")
    reg.observe("produce_latency_seconds", 1e9, cluster="local")  # beyond the last bucket
    reg.sample("error", "weird", {"topic": "t", "detail": b"\xff\x00bytes", "n": float("nan")})
    for path, document in DOCUMENTS.items():
        assert_valid(get_json(status_server.url + path), document)
    doc = get_json(status_server.url + "/status/all")
    assert doc["queues"]["buffer"]["used_bytes"] is None
    local = next(c for c in doc["clusters"] if c["name"] == "local")
    assert local["latency"]["p99_seconds"] is None  # +Inf bucket: unknown, not Infinity


def test_a_failing_document_is_still_a_json_error(
    status_server: StatusServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> dict[str, Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "health", broken)
    doc = get_json(status_server.url + "/status/all", expect=500)
    assert_valid(doc, "error")
    assert doc["error"] == "internal" and "boom" in doc["message"]


# -- message tracking ------------------------------------------------------------------------


def test_tracking_follows_a_message_from_buffer_to_delivery(status_server: StatusServer) -> None:
    act = status_server.activity
    first, second = act.accept("clicks", 2)
    doc = get_json(f"{status_server.url}/messages/{first.hex()}")
    assert_valid(doc, "message")
    assert doc == {"id": first.hex(), "state": "buffered", "topic": "clicks",
                   "accepted_ms": keys.id_timestamp_ms(first)}
    [(delivered_id, offset)] = act.deliver("clicks", 1, "remote", partition=2)
    assert delivered_id == first
    doc = get_json(f"{status_server.url}/messages/{first.hex()}")
    assert_valid(doc, "message")
    assert (doc["state"], doc["cluster"], doc["partition"], doc["offset"]) == (
        "delivered", "remote", 2, offset)
    # Ids are case-insensitive hex.
    assert get_json(f"{status_server.url}/messages/{first.hex().upper()}")["offset"] == offset
    assert get_json(f"{status_server.url}/messages/{second.hex()}")["state"] == "buffered"


def test_tracking_reports_why_a_message_was_discarded(status_server: StatusServer) -> None:
    act = status_server.activity
    [mid] = act.accept("orders", 1)
    act.discard("orders", 1, "attempts")
    doc = get_json(f"{status_server.url}/messages/{mid.hex()}")
    assert_valid(doc, "message")
    assert (doc["state"], doc["reason"], doc["topic"]) == ("discarded", "attempts", "orders")


def test_tracking_unknown_id_is_404_json(status_server: StatusServer) -> None:
    status_server.activity.accept("clicks", 1)
    never = keys.make_id(1_000, 7).hex()
    doc = get_json(f"{status_server.url}/messages/{never}", expect=404)
    assert_valid(doc, "error")
    assert doc["error"] == "not_found" and doc["id"] == never and doc["state"] == "unknown"


@pytest.mark.parametrize("bad", ["nothex", "00", "z" * 24, "0" * 23, "0" * 26, "%20" * 12])
def test_tracking_malformed_id_is_400_json(status_server: StatusServer, bad: str) -> None:
    doc = get_json(f"{status_server.url}/messages/{bad}", expect=400)
    assert_valid(doc, "error")
    assert doc["error"] == doc["code"] == "malformed_id"  # the listener's one error shape
    assert "24 hexadecimal digits" in doc["message"]


# -- page and assets -------------------------------------------------------------------------


def test_page_and_assets_are_served_from_the_agent(status_server: StatusServer) -> None:
    page = httpx.get(status_server.url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == PAGE_CSP
    assert "http://" not in page.text and "https://" not in page.text
    for name, kind in (("page.js", "text/javascript"), ("page.css", "text/css")):
        r = httpx.get(f"{status_server.url}/status/static/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "http://" not in r.text and "https://" not in r.text
    missing = httpx.get(status_server.url + "/status/static/..%2Fschema.json", timeout=10)
    assert missing.status_code == 404
    assert get_json(status_server.url + "/status/schema") == schema()


def test_routes_entry_point_serves_the_runtime(tmp_path: Path, agent: Agent) -> None:
    """``routes(runtime)`` is what the daemon composes into its HTTP listener."""
    agent.registry.inc("messages_accepted", 4, source="http", topic="t")
    with serve(routes(agent.runtime)) as url:
        doc = get_json(url + "/status/info")
        assert_valid(doc, "info")
        assert doc["phase"] == "running" and doc["ready"] is True
        assert get_json(url + "/status/counters")["totals"]["accepted_by_source"]["http"] == 4


def test_pretty_output_is_the_same_document(status_server: StatusServer) -> None:
    plain = get_json(status_server.url + "/status/topics")
    pretty = httpx.get(status_server.url + "/status/topics?pretty=1", timeout=10)
    assert "\n  " in pretty.text
    assert json.loads(pretty.text)["topics"] == plain["topics"]
