"""Cluster state from probes, against the real agent (issue 17): an unreachable cluster is
reported with its cause even when nothing is sent, and an idle period is never an outage
(so it never sends a fallback topic to the remote datacenter). Real tansu brokers."""

from __future__ import annotations

import io
import time
from pathlib import Path

from agent.config import KafkaClusterConfig
from ferry_client import FerryClient
from status import cli
from tests.agent_harness import AgentProcess, wait_drained, write_config
from tests.kafka import Broker, consume_all, create_topic, free_port, read_topic
from tests.waiting import wait_until

OUTAGE_AFTER = 2.0  # write_config's outage_after_seconds
PROBE = KafkaClusterConfig().probe_interval_seconds
# The verdict reaches `ferry status` through the forwarder's metrics snapshots (4 a second)
# and this test's polling; on a shared, loaded 2-vCPU host that is well within this.
SLACK = 3.0
# An idle period four times outage_after_seconds and four probe periods: the old verdict
# (time since the last acknowledgement) called the cluster down after one.
IDLE = 4 * max(OUTAGE_AFTER, PROBE)


def status(agent: AgentProcess) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.status_command(agent.http_url, 5.0, out=out)
    return code, out.getvalue()


def test_an_unreachable_cluster_without_traffic_is_critical_with_its_cause(
    tmp_path: Path,
) -> None:
    closed = free_port()  # nothing listens there: every connect is refused
    config = write_config(tmp_path / "agent", f"127.0.0.1:{closed}",
                          outage_after_seconds=OUTAGE_AFTER)
    with AgentProcess(config) as agent:
        ready = time.monotonic()
        seen: list[tuple[int, str]] = []

        def critical() -> bool:
            seen.append(status(agent))
            return seen[-1][0] == cli.CRITICAL

        try:
            wait_until(critical, timeout=OUTAGE_AFTER + PROBE + SLACK, interval=0.2,
                       message="ferry status CRITICAL without traffic")
        except (AssertionError, TimeoutError) as exc:
            last = seen[-1][1] if seen else "-"
            raise AssertionError(f"{exc}; last answer:\n{last}\n{agent.log_tail()}") from exc
        took = time.monotonic() - ready
        code, out = seen[-1]
        first = out.splitlines()[0]
        assert first.startswith("FERRY CRITICAL - cluster local is down: "), out
        assert "Connection refused" in first, out  # the cause, not just "down"
        assert f"127.0.0.1:{closed}" in first, out
        # The page shows the same verdict: it renders /status/all's health.
        doc = agent.get_json("/status/all")
        assert doc["health"]["status"] == "critical"
        (row,) = doc["clusters"]
        assert (row["state"], row["up"]) == ("down", False)
        assert "Connection refused" in row["reason"]
        assert agent.buffered() == {}  # nothing was sent: the probes alone found it
        # The probe endpoints read the same state: still ready (buffering through an outage
        # is Ferry's job), with the cluster's verdict and cause in the body.
        for path, ok in (("/status/ready", "ready"), ("/status/health", "status")):
            body = agent.get_json(path)
            assert body[ok] in (True, "ok"), body
            assert body["clusters"]["local"]["state"] == "down", body
            assert "Connection refused" in body["clusters"]["local"]["reason"], body
        print(f"CRITICAL {took:.2f} s after ready (bound {OUTAGE_AFTER + PROBE + SLACK:g} s)")


def test_idle_then_burst_sends_nothing_to_the_remote_cluster(tmp_path: Path) -> None:
    topic = "fallback-idle"
    with Broker(log_path=tmp_path / "local.log") as local, \
            Broker(log_path=tmp_path / "remote.log") as remote:
        for b in (local, remote):
            create_topic(b.bootstrap, topic, 2)
        config = write_config(
            tmp_path / "agent", local.bootstrap, remote_bootstrap=remote.bootstrap,
            outage_after_seconds=OUTAGE_AFTER,
            # Long enough that a healthy local cluster always answers first: what is under
            # test is the cluster state, not the speculative race.
            topics={topic: {"fallback_to_remote": True, "speculative_send_delay_ms": 5000}})
        with AgentProcess(config) as agent:
            with FerryClient(agent.socket_path) as client:
                client.send(topic, b"warm-up")
            wait_drained(agent)
            wait_until(lambda: all(c["state"] == "up"
                                   for c in agent.get_json("/status/clusters")["clusters"]),
                       timeout=10, message="both clusters up")
            # The scenario itself, not a synchronisation: IDLE seconds without any traffic,
            # longer than outage_after_seconds several times over.
            time.sleep(IDLE)
            burst = [b"burst-%03d" % i for i in range(200)]
            with FerryClient(agent.socket_path) as client:
                for v in burst:
                    client.send(topic, v)
            wait_drained(agent)
            got = consume_all(local.bootstrap, topic, len(burst) + 1, timeout=20)
            assert sorted(m.value for m in got if m.value != b"warm-up") == burst
            assert read_topic(remote.bootstrap, topic) == []
            log = agent.log_path.read_text(errors="replace")
            assert " is down" not in log, agent.log_tail()
            states = {c["name"]: c["state"]
                      for c in agent.get_json("/status/clusters")["clusters"]}
            assert states == {"local": "up", "remote": "up"}
