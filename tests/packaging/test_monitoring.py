"""packaging/monitoring: the Prometheus alert rules and the Grafana dashboard.

The rules pass ``promtool check rules`` and fire as ``ferry_alerts_test.yml`` says (promtool's
own rule unit tests); the dashboard's queries are valid PromQL; and every metric either of
them names is one a real agent exports on ``/metrics``. promtool comes from Debian's
prometheus package (packaging/install-test-deps.sh, root). No ``packaging`` marker: nothing
is built here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.metrics import DEFINITIONS
from tests.agent_harness import AgentProcess, write_config
from tests.kafka import Broker, create_topic, unique_topic_name
from tests.packaging import harness
from tests.waiting import wait_until

MONITORING = harness.PACKAGING / "monitoring"
RULES = MONITORING / "ferry-alerts.yml"
DASHBOARD = MONITORING / "ferry-dashboard.json"
RULE_TESTS = Path(__file__).with_name("ferry_alerts_test.yml")
# What pages an operator (issue #20): each must have an alert.
REQUIRED_METRICS = {
    "buffer filling": "ferry_buffer_used_bytes",
    "buffer full": "ferry_buffer_full",
    "oldest message age": "ferry_buffer_oldest_age_seconds",
    "cluster down": "ferry_cluster_up",
    "stuck topic": "ferry_topics_stuck",
    "discards by reason": "ferry_messages_discarded_total",
    "rejected input": "ferry_messages_rejected_total",
    "forwarder restarts": "ferry_process_restarts_total",
}
# Grafana's variables, replaced by something PromQL parses before promtool checks a query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                     "$instance": ".+"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.geteuid() != 0:
            pytest.fail("promtool is missing and only root may install it "
                        "(packaging/install-test-deps.sh)", pytrace=False)
        harness.install_test_deps()
        found = shutil.which("promtool")
    assert found, "install-test-deps.sh did not install promtool"
    return found


# --------------------------------------------------------------------------------------------
# Reading metric names out of PromQL
# --------------------------------------------------------------------------------------------

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (or a Grafana ``label_values`` query)."""
    values = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if values:
        return {values.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:])[a-zA-Z_:][\w:]*", text):
        following = text[match.end():].lstrip()[:1]
        if following == "(" or match.group(0).lower() in _KEYWORDS:
            continue  # a function or an aggregation, not a metric
        names.add(match.group(0))
    return names


def label_names(expr: str) -> set[str]:
    """Labels an expression groups by or matches on."""
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in group.split(",") if name.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    return labels


def test_metric_names_reads_selectors_not_functions_labels_or_keywords() -> None:
    expr = ('histogram_quantile(0.99, sum by (cluster, le) (rate(ferry_a_bucket{x="y",'
            'instance=~"$instance"}[5m]))) > 1e3 and on (instance) ferry_b == bool 0 '
            'unless max without (topic) (ferry_c offset 5m)')
    assert metric_names(expr) == {"ferry_a_bucket", "ferry_b", "ferry_c"}
    assert label_names(expr) == {"cluster", "le", "x", "instance", "topic"}
    assert metric_names("label_values(ferry_build_info, instance)") == {"ferry_build_info"}


# --------------------------------------------------------------------------------------------
# The rules and the dashboard, as files
# --------------------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, query) for every panel target and templating query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']}", query["query"] if isinstance(query, dict) \
                else query


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    result = harness.run([promtool, "check", "rules", RULES], check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_alert_rules_cover_what_pages_an_operator() -> None:
    used = set().union(*(metric_names(rule["expr"]) for rule in alert_rules()))
    missing = {what: name for what, name in REQUIRED_METRICS.items() if name not in used}
    assert missing == {}
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_rules_fire_when_they_should_and_not_before(promtool: str,
                                                          tmp_path: Path) -> None:
    # promtool compares annotations too; the descriptions are fixed text, so they are copied
    # from the rules here rather than repeated in the test file.
    descriptions = {}
    for rule in alert_rules():
        description = rule["annotations"]["description"]
        assert "{{" not in description, f"{rule['alert']}: templates belong in the summary"
        descriptions[rule["alert"]] = description
    cases = yaml.safe_load(RULE_TESTS.read_text())
    tested = set()
    for case in cases["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                alert["exp_annotations"].setdefault("description",
                                                    descriptions[check["alertname"]])
                tested.add(check["alertname"])
    assert tested == set(descriptions), f"alerts never seen firing: {set(descriptions) - tested}"
    cases["rule_files"] = [str(RULES)]
    complete = tmp_path / RULE_TESTS.name
    complete.write_text(yaml.safe_dump(cases))

    result = harness.run([promtool, "test", "rules", complete], check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_dashboard_queries_are_valid_promql_on_the_datasource_variable(
    promtool: str, tmp_path: Path
) -> None:
    # promtool parses PromQL only inside rule files: each query becomes a recording rule.
    board = json.loads(DASHBOARD.read_text())
    rules = []
    for i, (where, query) in enumerate(dashboard_queries()):
        if where.startswith("variable"):
            continue  # label_values() is Grafana's, not PromQL
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        assert "$" not in query, f"{where}: unknown variable in {query}"
        rules.append({"record": f"dashboard:query_{i}", "expr": query})
    assert len(rules) >= 15
    check = tmp_path / "dashboard-queries.yml"
    check.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = harness.run([promtool, "check", "rules", check], check=False)
    assert result.returncode == 0, result.stdout + result.stderr

    # Portable: every panel queries the data source chosen on import.
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


# --------------------------------------------------------------------------------------------
# Against a real agent's /metrics
# --------------------------------------------------------------------------------------------


def exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Series names an exposition declares (by family type), and labels seen per series."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "gauge": [""]}[family.type]
        names |= {family.name + suffix for suffix in suffixes}
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


def test_every_metric_in_the_rules_and_dashboard_is_one_the_agent_exports(
    session_broker: Broker, tmp_path: Path
) -> None:
    topic = unique_topic_name("monitoring")
    create_topic(session_broker.bootstrap, topic)
    config = write_config(tmp_path / "agent", session_broker.bootstrap)
    with AgentProcess(config) as agent:
        publish = urllib.request.Request(f"{agent.http_url}/topics/{topic}", data=b"hello",
                                         method="POST")
        with urllib.request.urlopen(publish, timeout=10) as answer:
            assert answer.status in (201, 202)

        # A gauge the rules compare must be set by a running agent, or its alert never
        # fires; the agent sets them within a few monitor ticks. Per-topic buffer gauges
        # exist only while the topic holds messages (the message here is delivered at once),
        # and labelled counters appear with their first event; the rules allow for both.
        gauges = {f"ferry_{d.name}" for d in DEFINITIONS.values()
                  if d.kind == "gauge" and "topic" not in d.labels}
        rule_gauges = set().union(*(metric_names(r["expr"]) for r in alert_rules())) & gauges
        assert {"ferry_buffer_used_bytes", "ferry_buffer_full", "ferry_cluster_up"} \
            <= rule_gauges

        def settled_metrics() -> str | None:
            with urllib.request.urlopen(agent.http_url + "/metrics", timeout=10) as response:
                text = str(response.read().decode())
            sampled = set(exported(text)[1])
            wanted = rule_gauges | {"ferry_messages_delivered_total"}
            return text if wanted <= sampled else None

        text = wait_until(settled_metrics, timeout=30, message=f"samples of {rule_gauges} "
                          "and a delivered message on /metrics")
        assert text is not None
    names, seen_labels = exported(text)
    assert "ferry_buffer_max_bytes" in names and "ferry_build_info" in seen_labels

    # Labels: those the agent declares for the metric, plus what Prometheus adds per target.
    declared = {f"ferry_{d.name}": set(d.labels) for d in DEFINITIONS.values()}
    added = {"instance", "job"}
    queries = [(f"rule {rule['alert']}", rule["expr"]) for rule in alert_rules()]
    queries += list(dashboard_queries())
    problems = []
    for where, query in queries:
        used = metric_names(query)
        if not used:
            problems.append(f"{where}: uses no metric: {query}")
        for name in sorted(used - names):
            problems.append(f"{where}: {name} is not on /metrics")
        allowed = set(added) | {"le"}
        for name in used & names:
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            allowed |= declared.get(base, set()) | declared.get(name, set())
            allowed |= seen_labels.get(name, set())
        for label in sorted(label_names(query) - allowed):
            problems.append(f"{where}: label {label!r} is not on {sorted(used)}")
    assert problems == []
