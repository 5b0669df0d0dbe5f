"""The metrics registry: recording, checking names, merging child processes across restarts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.metrics import DEFINITIONS, LATENCY_BUCKETS, SAMPLE_KEEP, Histogram, Registry


def through_the_pipe(snap: dict[str, Any]) -> dict[str, Any]:
    """Children ship snapshots to the parent as JSON; test what actually arrives."""
    result: dict[str, Any] = json.loads(json.dumps(snap))
    return result


def child_registry(**accepted: int) -> Registry:
    reg = Registry()
    for topic, n in accepted.items():
        reg.inc("messages_accepted", n, source="socket", topic=topic)
    return reg


# -- recording ---------------------------------------------------------------------------------
def test_counters_add_per_label_set() -> None:
    reg = Registry()
    reg.inc("messages_accepted", source="socket", topic="a")
    reg.inc("messages_accepted", 4, source="socket", topic="a")
    reg.inc("messages_accepted", 2, topic="b", source="http")  # label order does not matter
    view = reg.view()
    assert view.total("messages_accepted") == 7
    assert view.total("messages_accepted", topic="a") == 5
    assert view.total("messages_accepted", source="http", topic="b") == 2
    assert view.total("messages_accepted", topic="nope") == 0
    assert view.by("messages_accepted", "topic") == {"a": 5, "b": 2}
    assert view.by("messages_accepted", "source", topic="b") == {"http": 2}


def test_gauges_keep_the_last_value() -> None:
    reg = Registry()
    reg.set("buffer_messages", 10, topic="a")
    reg.set("buffer_messages", 3, topic="a")
    reg.set("buffer_full", 1)
    view = reg.view()
    assert view.total("buffer_messages", topic="a") == 3
    assert view.total("buffer_full") == 1


def test_replace_gauge_drops_series_that_are_gone() -> None:
    reg = Registry()
    reg.set("buffer_messages", 10, topic="a")
    reg.set("buffer_messages", 5, topic="b")
    reg.replace_gauge("buffer_messages", {(("topic", "b"),): 7})
    assert reg.view().by("buffer_messages", "topic") == {"b": 7}


def test_histogram_counts_and_sums_observations() -> None:
    reg = Registry()
    for v in (0.0001, 0.003, 0.003, 7.0):
        reg.observe("buffer_commit_seconds", v, writer="ingest")
    reg.observe("buffer_commit_seconds", 0.5, writer="forwarder")
    h = reg.view().histogram("buffer_commit_seconds", writer="ingest")
    assert h.count == 4
    assert h.total == pytest.approx(7.0061)
    assert reg.view().histogram("buffer_commit_seconds").count == 5


def test_samples_keep_the_last_few_per_kind_and_reason() -> None:
    reg = Registry()
    for i in range(SAMPLE_KEEP + 5):
        reg.sample("reject", "too_large", {"n": i})
    reg.sample("reject", "bad_topic", {"n": 99})
    samples = reg.view().samples
    assert [s["n"] for s in samples[("reject", "too_large")]] == list(range(5, SAMPLE_KEEP + 5))
    assert [s["n"] for s in samples[("reject", "bad_topic")]] == [99]
    assert all("time" in s for s in samples[("reject", "too_large")])


def test_view_is_a_copy() -> None:
    reg = Registry()
    reg.inc("buffer_commits", writer="ingest")
    reg.observe("buffer_commit_seconds", 0.001, writer="ingest")
    view = reg.view()
    reg.inc("buffer_commits", writer="ingest")
    reg.observe("buffer_commit_seconds", 0.001, writer="ingest")
    assert view.total("buffer_commits") == 1
    assert view.histogram("buffer_commit_seconds").count == 1


# -- checking ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "name", "labels"),
    [
        ("inc", "no_such_metric", {}),
        ("inc", "messages_accepted", {"source": "socket"}),  # missing a label
        ("inc", "messages_accepted", {"source": "s", "topic": "t", "extra": "x"}),
        ("inc", "messages_accepted", {"source": "s", "topc": "t"}),  # misspelt label
        ("inc", "buffer_full", {}),  # a gauge, not a counter
        ("set", "messages_accepted", {"source": "s", "topic": "t"}),  # a counter
        ("observe", "buffer_commits", {"writer": "w"}),  # a counter, not a histogram
        ("set", "buffer_full", {"topic": "t"}),  # takes no labels
    ],
)
def test_undefined_names_kinds_and_labels_are_rejected(
    call: str, name: str, labels: dict[str, str]
) -> None:
    reg = Registry()
    with pytest.raises(KeyError, match=name):
        getattr(reg, call)(name, 1, **labels)
    assert reg.view().values == {} and reg.view().hists == {}  # nothing was recorded


def test_every_definition_can_be_recorded() -> None:
    reg = Registry()
    for d in DEFINITIONS.values():
        labels = {label: "x" for label in d.labels}
        if d.kind == "counter":
            reg.inc(d.name, 1, **labels)
        elif d.kind == "gauge":
            reg.set(d.name, 1, **labels)
        else:
            reg.observe(d.name, 1, **labels)
    view = reg.view()
    assert set(view.values) | set(view.hists) == set(DEFINITIONS)


# -- histogram quantiles -----------------------------------------------------------------------
def test_quantile_of_nothing_is_none() -> None:
    assert Histogram().quantile(0.5) is None


def test_quantiles_report_the_upper_bound_of_the_bucket() -> None:
    h = Histogram()
    for _ in range(90):
        h.observe(0.0003)  # bucket <= 0.0005
    for _ in range(9):
        h.observe(0.03)  # bucket <= 0.05
    h.observe(0.3)  # bucket <= 0.5
    assert h.quantile(0.5) == 0.0005
    assert h.quantile(0.9) == 0.0005
    assert h.quantile(0.95) == 0.05
    assert h.quantile(0.99) == 0.05
    assert h.quantile(1.0) == 0.5


def test_a_value_on_a_bound_falls_in_that_bucket() -> None:
    h = Histogram()
    h.observe(0.001)
    assert h.counts[LATENCY_BUCKETS.index(0.001)] == 1
    assert h.quantile(1.0) == 0.001


def test_values_beyond_the_last_bucket_are_infinite() -> None:
    h = Histogram()
    h.observe(0.001)
    h.observe(60.0)
    assert h.counts[-1] == 1
    assert h.quantile(0.5) == 0.001
    assert h.quantile(1.0) == float("inf")


def test_histogram_json_round_trip_and_add() -> None:
    a, b = Histogram(), Histogram()
    for v in (0.0004, 0.2, 3.0):
        a.observe(v)
    b.observe(0.2)
    copy = Histogram.from_json(json.loads(json.dumps(a.to_json())))
    copy.add(b)
    assert copy.count == 4
    assert copy.total == pytest.approx(3.4004)
    assert copy.counts[LATENCY_BUCKETS.index(0.25)] == 2
    assert a.count == 3  # add() changed only the copy


# -- merging child processes -------------------------------------------------------------------
def test_merge_adds_child_counters_to_the_parents() -> None:
    parent = Registry()
    parent.inc("messages_accepted", 2, source="socket", topic="a")
    parent.merge("forwarder", through_the_pipe(child_registry(a=5, b=1).snapshot()))
    view = parent.view()
    assert view.by("messages_accepted", "topic") == {"a": 7, "b": 1}


def test_merge_replaces_the_childs_previous_snapshot() -> None:
    parent = Registry()
    child = child_registry(a=5)
    parent.merge("forwarder", through_the_pipe(child.snapshot()))
    parent.merge("forwarder", through_the_pipe(child.snapshot()))  # same numbers again
    assert parent.view().total("messages_accepted") == 5
    child.inc("messages_accepted", 3, source="socket", topic="a")
    parent.merge("forwarder", through_the_pipe(child.snapshot()))
    assert parent.view().total("messages_accepted") == 8


def test_two_children_are_summed() -> None:
    parent = Registry()
    parent.merge("one", through_the_pipe(child_registry(a=5).snapshot()))
    parent.merge("two", through_the_pipe(child_registry(a=7).snapshot()))
    assert parent.view().total("messages_accepted", topic="a") == 12


def test_merge_brings_child_gauges_histograms_samples_and_info() -> None:
    parent = Registry()
    parent.observe("buffer_commit_seconds", 0.001, writer="w")
    parent.sample("discard", "ttl", {"who": "parent"})
    child = Registry()
    child.set("cluster_up", 1, cluster="local")
    child.observe("buffer_commit_seconds", 0.001, writer="w")
    child.observe("produce_latency_seconds", 0.02, cluster="local")
    child.sample("discard", "ttl", {"who": "child"})
    child.set_info("kafka_version", "3.7")
    parent.merge("forwarder", through_the_pipe(child.snapshot()))
    view = parent.view()
    assert view.total("cluster_up", cluster="local") == 1
    assert view.histogram("buffer_commit_seconds", writer="w").count == 2
    assert view.histogram("produce_latency_seconds").count == 1
    assert sorted(s["who"] for s in view.samples[("discard", "ttl")]) == ["child", "parent"]
    assert view.info["kafka_version"] == "3.7"


def test_merged_samples_keep_only_the_newest_few() -> None:
    parent = Registry()
    for i in range(SAMPLE_KEEP):
        parent.sample("reject", "r", {"n": i})
    child = Registry()
    for i in range(SAMPLE_KEEP):
        child.sample("reject", "r", {"n": 100 + i})  # recorded later: newer
    parent.merge("c", through_the_pipe(child.snapshot()))
    merged = parent.view().samples[("reject", "r")]
    assert len(merged) == SAMPLE_KEEP
    assert [s["n"] for s in merged] == [100 + i for i in range(SAMPLE_KEEP)]


def test_a_restarted_child_keeps_counting_from_where_the_old_one_left_off() -> None:
    parent = Registry()
    parent.merge("forwarder", through_the_pipe(child_registry(a=10, b=4).snapshot()))
    assert parent.view().total("messages_accepted") == 14
    # The forwarder restarts: its new registry starts from zero.
    reborn = child_registry(a=3)
    parent.merge("forwarder", through_the_pipe(reborn.snapshot()))
    assert parent.view().by("messages_accepted", "topic") == {"a": 13, "b": 4}
    reborn.inc("messages_accepted", 2, source="socket", topic="a")
    reborn.inc("messages_accepted", 1, source="socket", topic="b")
    parent.merge("forwarder", through_the_pipe(reborn.snapshot()))
    assert parent.view().by("messages_accepted", "topic") == {"a": 15, "b": 5}
    # ... and restarts again.
    parent.merge("forwarder", through_the_pipe(child_registry(a=1).snapshot()))
    assert parent.view().by("messages_accepted", "topic") == {"a": 16, "b": 5}


def test_restart_carry_over_is_per_child() -> None:
    parent = Registry()
    parent.merge("one", through_the_pipe(child_registry(a=10).snapshot()))
    parent.merge("two", through_the_pipe(child_registry(a=20).snapshot()))
    parent.merge("one", through_the_pipe(child_registry(a=1).snapshot()))  # "one" restarted
    assert parent.view().total("messages_accepted") == 31


def test_a_restart_counts_every_series_of_the_old_child() -> None:
    # One snapshot shows the restart (series "a" went down); series "b" of the new child
    # already passed the old child's value. Both must continue from the old totals: 10+3 and
    # 2+5. Detecting the restart per series loses b's old 2.
    parent = Registry()
    parent.merge("forwarder", through_the_pipe(child_registry(a=10, b=2).snapshot()))
    parent.merge("forwarder", through_the_pipe(child_registry(a=3, b=5).snapshot()))
    assert parent.view().by("messages_accepted", "topic") == {"a": 13, "b": 7}


def test_gauges_of_a_restarted_child_are_not_carried_over() -> None:
    parent = Registry()
    old = Registry()
    old.set("buffer_messages", 500, topic="a")
    parent.merge("ingest", through_the_pipe(old.snapshot()))
    new = Registry()
    new.set("buffer_messages", 20, topic="a")
    parent.merge("ingest", through_the_pipe(new.snapshot()))
    assert parent.view().total("buffer_messages", topic="a") == 20


@given(
    st.lists(  # incarnations of one child, each a list of non-decreasing increments
        st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 5)), min_size=1, max_size=6),
        min_size=1,
        max_size=5,
    )
)
def test_merged_counter_totals_never_go_down(incarnations: list[list[tuple[str, int]]]) -> None:
    parent = Registry()
    last = {"a": 0.0, "b": 0.0}
    for steps in incarnations:
        child = Registry()  # a restart: counters from zero
        for topic, n in steps:
            child.inc("messages_accepted", n, source="socket", topic=topic)
            parent.merge("c", through_the_pipe(child.snapshot()))
            now = parent.view().by("messages_accepted", "topic")
            for t in "ab":
                assert now.get(t, 0) >= last[t]
                last[t] = now.get(t, 0)


def test_a_restarted_child_keeps_its_histograms_and_samples() -> None:
    parent = Registry()
    old = Registry()
    for seconds in (0.01, 0.2):
        old.observe("produce_latency_seconds", seconds, cluster="local")
    old.sample("discarded", "too_large", {"topic": "t", "id": "a"})
    parent.merge("forwarder", through_the_pipe(old.snapshot()))
    reborn = Registry()  # the forwarder restarted: a new incarnation, starting from nothing
    parent.merge("forwarder", through_the_pipe(reborn.snapshot()))
    view = parent.view()
    # Histogram series are counters in Prometheus: _count and _sum never go down.
    assert view.histogram("produce_latency_seconds").count == 2
    assert [s["id"] for s in view.samples[("discarded", "too_large")]] == ["a"]
    reborn.observe("produce_latency_seconds", 0.05, cluster="local")
    reborn.sample("discarded", "too_large", {"topic": "t", "id": "b"})
    parent.merge("forwarder", through_the_pipe(reborn.snapshot()))
    view = parent.view()
    assert view.histogram("produce_latency_seconds").count == 3
    assert [s["id"] for s in view.samples[("discarded", "too_large")]] == ["a", "b"]
    # The view is a copy: asking twice does not count the base twice.
    assert parent.view().histogram("produce_latency_seconds").count == 3
