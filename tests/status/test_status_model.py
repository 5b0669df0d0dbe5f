"""The status documents and the health verdict, built from a real Registry (pure logic)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from agent.metrics import Registry
from status import model
from status.schema import validator

NOW = 1_800_000_000.0


def ctx(**changes: Any) -> model.Context:
    base: dict[str, Any] = dict(
        version="9.9.9", hostname="host-1", pid=42, started_at=NOW - 3600, now=NOW,
        phase="running", ready=True, ready_reason="ready",
        clusters={"local": "127.0.0.1:9092", "remote": "10.0.0.1:9092"},
        max_bytes=1000,
    )
    base.update(changes)
    return model.Context(**base)


def everything(reg: Registry, history: list[dict[str, Any]] | None = None,
               **changes: Any) -> dict[str, Any]:
    doc = model.everything(reg.view(), ctx(**changes), history or [], include_history=True)
    errors = list(validator("all").iter_errors(doc))
    assert not errors, errors
    json.dumps(doc, allow_nan=False)
    return doc


def healthy_registry() -> Registry:
    reg = Registry()
    for cluster in ("local", "remote"):
        reg.set("cluster_up", 1.0, cluster=cluster)
        reg.set("cluster_brokers_up", 3.0, cluster=cluster)
    reg.set("buffer_used_bytes", 100.0)
    reg.set("buffer_max_bytes", 1000.0)
    return reg


# -- documents -------------------------------------------------------------------------------


def test_forwarder_snapshot_counts_once_and_survives_its_restart() -> None:
    parent = Registry()
    parent.inc("messages_accepted", 10, source="socket", topic="a")
    child = Registry()
    child.inc("messages_delivered", 6, topic="a", cluster="local")
    parent.merge("forwarder", child.snapshot())
    parent.merge("forwarder", child.snapshot())  # the same snapshot again: no double count
    assert model.totals(parent.view())["delivered"] == 6
    restarted = Registry()
    restarted.inc("messages_delivered", 1, topic="a", cluster="local")
    parent.merge("forwarder", restarted.snapshot())
    doc = everything(parent)
    assert doc["totals"]["delivered"] == 7
    assert doc["topics"][0]["delivered_by_cluster"] == {"local": 7}


def test_unknown_is_null_not_zero() -> None:
    doc = everything(Registry(), max_bytes=0)
    assert [c["name"] for c in doc["clusters"]] == ["local", "remote"]
    assert all(c["up"] is None and c["brokers_up"] is None for c in doc["clusters"])
    assert doc["queues"]["buffer"]["used_bytes"] is None
    assert doc["queues"]["buffer"]["used_fraction"] is None
    assert doc["queues"]["buffer"]["oldest_age_seconds"] is None
    assert doc["spool"]["files_pending"] is None
    assert doc["health"]["status"] == "ok"


def test_cluster_seen_in_metrics_but_not_configured_is_listed() -> None:
    reg = Registry()
    reg.inc("messages_delivered", 1, topic="a", cluster="old-dc")
    doc = everything(reg)
    row = next(c for c in doc["clusters"] if c["name"] == "old-dc")
    assert row["configured"] is False and row["delivered"] == 1


def test_last_error_is_the_newest_sample_of_the_topic() -> None:
    reg = Registry()
    reg.inc("delivery_failures", 5, topic="a", cluster="local", error="MSG_TIMED_OUT")
    reg.sample("error", "MSG_TIMED_OUT", {"topic": "a", "cluster": "local", "detail": "old"})
    reg.sample("error", "LEADER_NOT_AVAILABLE", {"topic": "b", "cluster": "local",
                                                 "detail": "other topic"})
    reg.sample("error", "NOT_ENOUGH_REPLICAS", {"topic": "a", "cluster": "remote",
                                                "detail": "newest"})
    reg.sample("error", "_TRANSPORT", {"cluster": "local", "detail": "no topic at all"})
    topics = {t["topic"]: t for t in everything(reg)["topics"]}
    err = topics["a"]["last_error"]
    assert (err["error"], err["cluster"], err["detail"]) == (
        "NOT_ENOUGH_REPLICAS", "remote", "newest")


def test_last_error_falls_back_to_the_commonest_counted_error() -> None:
    reg = Registry()
    reg.inc("delivery_failures", 2, topic="a", cluster="local", error="A_ERR")
    reg.inc("delivery_failures", 9, topic="a", cluster="remote", error="B_ERR")
    err = everything(reg)["topics"][0]["last_error"]
    assert err == {"time": None, "error": "B_ERR", "cluster": "remote", "detail": None}


def test_discard_report_counts_by_reason_with_newest_samples_first() -> None:
    reg = Registry()
    for i in range(15):
        reg.inc("messages_discarded", topic="a", reason="ttl")
        reg.sample("discarded", "ttl", {"topic": "a", "id": f"{i:024x}"})
    reg.inc("messages_rejected", 3, source="socket", reason="malformed")
    reg.sample("rejected", "bad_topic", {"source": "http", "detail": "x" * 5000,
                                         "raw": b"\xff\xfe"})
    doc = everything(reg)["discards"]
    groups = {(g["kind"], g["reason"]): g for g in doc["groups"]}
    ttl = groups[("discarded", "ttl")]
    assert ttl["count"] == 15
    assert [s["id"] for s in ttl["samples"]][:2] == [f"{14:024x}", f"{13:024x}"]
    assert len(ttl["samples"]) == 10  # the registry keeps the last 10 per reason
    assert groups[("rejected", "malformed")]["samples"] == []
    sample = groups[("rejected", "bad_topic")]["samples"][0]
    assert len(sample["detail"]) < 500  # long client data is cut
    assert sample["raw"] == "\\xff\\xfe"
    assert groups[("rejected", "bad_topic")]["count"] == 0  # sampled, never counted
    assert [g["kind"] for g in doc["groups"]] == ["discarded", "rejected", "rejected"]


def test_counters_document_lists_every_series() -> None:
    reg = Registry()
    reg.inc("messages_accepted", 3, source="http", topic="a")
    reg.observe("produce_latency_seconds", 0.003, cluster="local")
    reg.observe("produce_latency_seconds", 99.0, cluster="local")
    doc = model.counters(reg.view(), ctx())
    assert not list(validator("counters").iter_errors(doc))
    metrics = {m["name"]: m for m in doc["metrics"]}
    assert metrics["messages_accepted"]["series"] == [
        {"labels": {"source": "http", "topic": "a"}, "value": 3}]
    [hist] = metrics["produce_latency_seconds"]["series"]
    assert hist["count"] == 2
    assert hist["buckets"][-1] == {"le": "+Inf", "count": 2}
    assert {"le": 0.005, "count": 1} in hist["buckets"]


# -- health ----------------------------------------------------------------------------------


def verdict(doc: dict[str, Any], **thresholds: float) -> tuple[str, list[str]]:
    h = model.health(doc, model.Thresholds(**thresholds))
    return h["status"], [p["check"] for p in h["problems"]]


def test_healthy_agent_is_ok() -> None:
    assert verdict(everything(healthy_registry())) == ("ok", [])


def test_buffer_full_is_critical() -> None:
    reg = healthy_registry()
    reg.set("buffer_full", 1.0)
    assert verdict(everything(reg)) == ("critical", ["buffer_full"])


def test_a_fenced_transactional_producer_is_critical() -> None:
    reg = healthy_registry()
    reg.set("transactions_fenced", 1.0)
    assert verdict(everything(reg)) == ("critical", ["fenced"])
    assert everything(reg)["transactions"]["fenced"] is True


@pytest.mark.parametrize(("used", "expected"), [
    (790.0, "ok"), (800.0, "warning"), (949.0, "warning"), (950.0, "critical")])
def test_buffer_use_thresholds(used: float, expected: str) -> None:
    reg = healthy_registry()
    reg.set("buffer_used_bytes", used)
    assert verdict(everything(reg))[0] == expected


@pytest.mark.parametrize(("age", "expected"), [
    (59.0, "ok"), (60.0, "warning"), (599.0, "warning"), (600.0, "critical")])
def test_oldest_message_age_thresholds(age: float, expected: str) -> None:
    reg = healthy_registry()
    reg.replace_gauge("buffer_messages", {(("topic", "a"),): 3.0, (("topic", "b"),): 1.0})
    reg.replace_gauge("buffer_oldest_age_seconds", {(("topic", "a"),): age,
                                                    (("topic", "b"),): 1.0})
    status, checks = verdict(everything(reg))
    assert status == expected
    assert checks == ([] if expected == "ok" else ["oldest_message"])


def test_custom_thresholds_apply() -> None:
    reg = healthy_registry()
    reg.replace_gauge("buffer_messages", {(("topic", "a"),): 3.0})
    reg.replace_gauge("buffer_oldest_age_seconds", {(("topic", "a"),): 5.0})
    doc = everything(reg)
    assert verdict(doc)[0] == "ok"
    assert verdict(doc, oldest_warning_seconds=2, oldest_critical_seconds=4)[0] == "critical"


def test_one_cluster_down_warns_and_all_down_is_critical() -> None:
    reg = healthy_registry()
    reg.set("cluster_up", 0.0, cluster="remote")
    assert verdict(everything(reg)) == ("warning", ["cluster"])
    reg.set("cluster_up", 0.0, cluster="local")
    status, _ = verdict(doc := everything(reg))
    assert status == "critical"
    assert sorted(p["message"] for p in doc["health"]["problems"]) == [
        "cluster local is down", "cluster remote is down"]


def test_a_down_cluster_is_critical_with_the_forwarders_reason() -> None:
    """The forwarder's verdict (info cluster_state) is what the health and the row show."""
    reg = healthy_registry()
    reg.set("cluster_up", 0.0, cluster="local")
    reg.set("cluster_up", 0.0, cluster="remote")
    why = ("no answer to a metadata request (Failed while waiting for controller: Local: "
           "Timed out): 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: "
           "Connection refused")
    reg.set_info("cluster_state", {
        "local": {"state": "down", "reason": why, "since": time.time() - 5,
                  "last_probe_time": time.time(), "last_probe_ok": False,
                  "last_error": "Connect failed", "errors": 3},
        "remote": {"state": "down", "reason": "no answer", "since": time.time(),
                   "last_probe_time": None, "last_probe_ok": None, "last_error": "",
                   "errors": 0}})
    reg.inc("cluster_errors", 3, cluster="local", error="_TRANSPORT")
    doc = everything(reg)
    assert doc["health"]["status"] == "critical"
    assert f"cluster local is down: {why}" in [p["message"] for p in doc["health"]["problems"]]
    row = next(c for c in doc["clusters"] if c["name"] == "local")
    assert (row["state"], row["reason"], row["up"]) == ("down", why, False)
    assert row["client_errors_by_error"] == {"_TRANSPORT": 3}
    # The cluster's error rows on the page count what they show samples of.
    reg.sample("error", "_TRANSPORT", {"cluster": "local", "detail": "Connect failed"})
    group = next(g for g in everything(reg)["discards"]["groups"]
                 if (g["kind"], g["reason"]) == ("error", "_TRANSPORT"))
    assert group["count"] == 3 and group["last_time"] is not None


def test_an_unknown_cluster_is_neither_up_nor_down() -> None:
    reg = healthy_registry()
    reg.set_info("cluster_state", {"local": {"state": "unknown", "reason": "no probe answered "
                                             "yet", "since": time.time()}})
    row = next(c for c in everything(reg)["clusters"] if c["name"] == "local")
    assert (row["state"], row["up"]) == ("unknown", None)


def _stuck(operator: bool, age: float) -> dict[str, Any]:
    now = NOW  # the documents' time (ctx)
    return {"error": "TOPIC_AUTHORIZATION_FAILED" if operator else "_MSG_TIMED_OUT",
            "cluster": "local", "detail": "Broker: Topic authorization failed",
            "operator": operator, "since": now - age, "last_time": now, "failures": 7,
            "retrying": 5}


@pytest.mark.parametrize(("operator", "age", "expected"), [
    (True, 0.5, "critical"),     # an ACL: only a person helps, say so at once
    (False, 0.5, "ok"),          # a transient failure retried at once is no news
    (False, 30.0, "warning"),    # ... unless the topic stays stuck
])
def test_a_stuck_topic_is_named_with_its_error(operator: bool, age: float,
                                               expected: str) -> None:
    reg = healthy_registry()
    reg.replace_gauge("buffer_messages", {(("topic", "orders"),): 5.0})
    reg.set_info("stuck_topics", {"orders": _stuck(operator, age)})
    doc = everything(reg)
    row = next(t for t in doc["topics"] if t["topic"] == "orders")
    assert row["stuck"]["failures"] == 7 and row["stuck"]["operator"] is operator
    assert doc["health"]["status"] == expected
    if expected != "ok":
        (problem,) = [p for p in doc["health"]["problems"] if p["check"] == "topic"]
        assert problem["message"].startswith("topic orders cannot be delivered for ")
        assert row["stuck"]["error"] in problem["message"]
        assert "5 messages kept" in problem["message"]


def test_unconfigured_cluster_down_does_not_count() -> None:
    reg = healthy_registry()
    reg.set("cluster_up", 0.0, cluster="old-dc")
    assert verdict(everything(reg))[0] == "ok"


def test_not_running_warns() -> None:
    assert verdict(everything(healthy_registry(), phase="starting")) == ("warning", ["phase"])


def point(t: float, **values: int) -> dict[str, Any]:
    base = {"time": t, "accepted_by_source": {}, "delivered": 0, "discarded": 0, "rejected": 0,
            "buffer_messages": 0, "buffer_bytes": 0, "files_quarantined": 0,
            "process_restarts": 0}
    return base | values


def test_recent_discards_quarantines_and_restarts_warn() -> None:
    reg = healthy_registry()
    reg.inc("messages_discarded", 4, topic="a", reason="ttl")
    reg.inc("spool_files_quarantined", reason="corrupt")
    reg.inc("process_restarts", process="forwarder")
    old = [point(NOW - 900, discarded=0), point(NOW - 300, discarded=1), point(NOW - 5,
                                                                             discarded=4)]
    doc = everything(reg, history=old)
    status, checks = verdict(doc)
    assert status == "warning"
    assert checks == ["discarded", "files_quarantined", "process_restarts"]
    assert doc["health"]["problems"][0]["message"] == "3 messages discarded in the last 5.0 min"
    # Nothing new in the window: no warning, however many were discarded long ago.
    quiet = [point(NOW - 30, discarded=4, files_quarantined=1, process_restarts=1)]
    assert verdict(everything(reg, history=quiet)) == ("ok", [])
    # Without history (plain /status/all) these checks cannot be judged, so they are not.
    assert verdict(everything(reg)) == ("ok", [])


def test_counter_reset_is_not_a_negative_or_positive_change() -> None:
    reg = healthy_registry()  # fresh agent: 0 discarded
    history = [point(NOW - 60, discarded=50)]  # ... but the ring remembers an older agent
    assert verdict(everything(reg, history=history)) == ("ok", [])


def test_health_of_a_real_clock_document_is_ok() -> None:
    reg = healthy_registry()
    doc = model.everything(reg.view(), ctx(now=time.time()))
    assert doc["health"] == {"status": "ok", "code": 0, "problems": [],
                             "thresholds": model.Thresholds().to_json()}
    assert "history" not in doc


def test_memory_counts_the_shared_buffer_pages_once() -> None:
    reg = healthy_registry()
    for process, own, mapped in (("ingest", 30.0, 500.0), ("forwarder", 20.0, 700.0)):
        reg.set("process_memory_bytes", own, process=process, kind="anonymous")
        reg.set("process_memory_bytes", mapped, process=process, kind="buffer_mapped")
        reg.set("process_memory_bytes", own + mapped + 9, process=process, kind="rss")
    mem = everything(reg)["info"]["memory"]
    assert mem["own_bytes"] == 50
    assert mem["buffer_mapped_bytes"] == 700  # one file, mapped by both: not 1,200
    assert mem["rss_bytes"] == 539 + 729
    assert mem["processes"]["forwarder"] == {"anonymous": 20, "buffer_mapped": 700, "rss": 729}


def test_memory_before_the_first_sample_is_unknown() -> None:
    mem = everything(Registry())["info"]["memory"]
    assert mem == {"own_bytes": None, "buffer_mapped_bytes": None, "rss_bytes": None,
                   "processes": {}}
