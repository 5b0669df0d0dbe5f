"""A cluster's state from probes and sends (agent/forwarder/health.py), with a test clock:
idleness is never an outage, a cluster that never answered is down at the first failed
probe, one that answered only after outage_after_seconds of failures or of unanswered sends."""

from __future__ import annotations

from agent.forwarder.health import SETTLE_SECONDS, ClusterHealth

LIMIT = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def health() -> tuple[ClusterHealth, Clock]:
    clock = Clock()
    return ClusterHealth("local", LIMIT, clock=clock, wall=clock), clock


def test_unknown_until_the_first_probe() -> None:
    h, clock = health()
    clock.now += 60
    h.check()
    assert h.state == "unknown"
    h.probe_answered(3)
    assert h.state == "up"
    assert [(c.old, c.new) for c in h.changes()] == [("unknown", "up")]


def test_a_cluster_that_never_answered_is_down_at_the_first_failed_probe() -> None:
    h, _ = health()
    h.client_error("127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: "
                   "Connection refused")
    h.probe_failed("Failed while waiting for controller: Local: Timed out")
    assert h.state == "down"
    assert "Connection refused" in h.reason and "Timed out" in h.reason
    snap = h.snapshot()
    assert (snap.state, snap.last_probe_ok, snap.errors) == ("down", False, 1)


def test_an_idle_cluster_answering_probes_stays_up_however_long() -> None:
    """The bug of issue 17: after 10 s without traffic, the next send looked like an outage."""
    h, clock = health()
    h.probe_answered(1)
    for _ in range(100):  # 1000 s idle, probed every 10 s
        clock.now += 10
        h.probe_answered(1)
        h.sends(0)
        h.check()
    h.sends(500)  # a burst: its sends are outstanding from now, not since the last ack
    h.check()
    assert h.state == "up"
    clock.now += 0.05
    h.acknowledged()
    h.sends(0)
    assert h.state == "up"
    assert [(c.old, c.new) for c in h.changes()] == [("unknown", "up")]


def test_outstanding_sends_unanswered_for_the_limit_mean_down() -> None:
    h, clock = health()
    h.probe_answered(1)
    h.sends(5)
    clock.now += LIMIT - 0.5
    h.sends(5)
    h.check()
    assert h.state == "up"
    clock.now += 1.0
    h.check()
    assert h.state == "down"
    assert h.reason.startswith("5 messages sent, none acknowledged for 10 s")
    # Probes answering do not undo what the sends show (no flapping)...
    h.probe_answered(1)
    assert h.state == "down"
    # ... an acknowledgement does.
    h.acknowledged()
    assert h.state == "up"


def test_sends_retried_and_never_acknowledged_mean_down_while_probes_answer() -> None:
    """The KRaft quorum lost: a surviving broker answers every probe, but no acks=all write
    completes. Sends time out (here every 3 s, a message timeout shorter than the limit)
    and wait a second for their retry: the clock runs across the retries, so the cluster is
    down once nothing was acknowledged for the limit, and stays down while they go round."""
    h, clock = health()
    h.probe_answered(3)
    for _ in range(3):  # 3 rounds of 3 s in flight and 1 s waiting for the retry: 12 s
        h.sends(5)
        clock.now += 3.0
        h.probe_answered(3)
        h.check()
        h.sends(0, retrying=5)  # timed out: back in the forwarder, waiting for the retry
        clock.now += 1.0
        h.probe_answered(3)
        h.check()
    assert h.state == "down"
    assert h.reason.startswith("5 messages sent, none acknowledged for 12 s"), h.reason
    assert [(c.old, c.new) for c in h.changes()] == [("unknown", "up"), ("up", "down")]
    # Nothing in either count for a moment (a report not served yet) is no delivery...
    h.sends(0, retrying=0)
    clock.now += SETTLE_SECONDS / 2
    h.sends(0, retrying=0)
    h.sends(0, retrying=5)
    assert h.state == "down"
    # ... nothing left to send for good (delivered elsewhere, or discarded by the TTL) while
    # the probes answer is: up again.
    h.sends(0, retrying=0)
    clock.now += SETTLE_SECONDS
    h.sends(0, retrying=0)
    assert h.state == "up"


def test_acknowledgements_keep_a_busy_cluster_up() -> None:
    h, clock = health()
    h.probe_answered(1)
    for _ in range(50):
        clock.now += 1.0
        h.sends(100)
        h.acknowledged()
        h.check()
    assert h.state == "up"


def test_probes_failing_on_an_answered_cluster_mean_down_after_the_limit() -> None:
    h, clock = health()
    h.probe_answered(2)
    h.probe_failed("timed out")
    assert h.state == "up"
    clock.now += LIMIT - 1
    h.probe_failed("timed out")
    h.check()
    assert h.state == "up"
    clock.now += 1
    h.check()
    assert h.state == "down"
    assert "no answer to metadata requests for 10 s" in h.reason
    clock.now += 30
    h.probe_answered(2)
    assert h.state == "up"
    changes = h.changes()
    assert [(c.old, c.new) for c in changes] == [("unknown", "up"), ("up", "down"),
                                                 ("down", "up")]
    assert changes[-1].after_seconds == 30


def test_an_acknowledgement_outweighs_a_failing_probe() -> None:
    h, clock = health()
    h.probe_answered(1)
    h.probe_failed("timed out")
    clock.now += 1
    h.acknowledged()
    clock.now += LIMIT * 3
    h.check()
    assert h.state == "up"


def test_all_brokers_down_does_not_hide_the_error_that_took_them_down() -> None:
    """librdkafka reports refused credentials once, then "1/1 brokers are down": the reason
    must keep naming the credentials until the cluster answers again (issue #31)."""
    h, _ = health()
    h.client_error("sasl_ssl://127.0.0.1:9093/1: SASL authentication error: Authentication "
                   "failed during authentication due to invalid credentials")
    h.client_error("1/1 brokers are down", generic=True)
    h.probe_failed("Failed while waiting for controller: Local: Timed out")
    assert h.state == "down" and "invalid credentials" in h.reason
    assert h.snapshot().errors == 2
    h.probe_answered(1)
    h.client_error("1/1 brokers are down", generic=True)  # answered since: news again
    assert h.last_error == "1/1 brokers are down"


def test_a_send_refused_by_the_clusters_verdict_is_an_answer_not_an_outage() -> None:
    """One topic missing on the cluster (auto-create off) kept its messages outstanding and
    unacknowledged, and the whole cluster was called down (issue #31)."""
    h, clock = health()
    h.probe_answered(1)
    h.sends(50)
    clock.now += LIMIT - 1
    h.answered()  # UNKNOWN_TOPIC_OR_PART for one of them
    clock.now += LIMIT - 1
    h.sends(50)
    h.check()
    assert h.state == "up"
    clock.now += 2  # nothing at all for the limit: down, as before
    h.check()
    assert h.state == "down"
    h.answered()
    assert h.state == "up"


def test_an_answer_does_not_outweigh_failing_probes() -> None:
    h, clock = health()
    h.probe_answered(1)
    h.probe_failed("Local: Timed out")
    clock.now += LIMIT
    h.answered()
    h.probe_failed("Local: Timed out")
    assert h.state == "down"


def test_a_broker_out_of_reach_is_the_reason_while_up_and_the_cause_once_down() -> None:
    """One broker the agent cannot reach (brokers.py) while the rest answers: the cluster
    stays up and says which; when sends go unanswered anyway, down names it as the cause;
    once it answers again, the reason is a whole cluster's again."""
    h, clock = health()
    h.probe_answered(3)
    h.unreachable("broker 2 (127.0.0.1:9002) does not answer this agent, 4 partitions wait")
    assert h.state == "up" and h.reason.startswith("broker 2 (127.0.0.1:9002)")
    h.sends(5)
    clock.now += LIMIT
    h.check()
    assert h.state == "down"
    assert h.reason == ("5 messages sent, none acknowledged for 10 s: broker 2 "
                        "(127.0.0.1:9002) does not answer this agent, 4 partitions wait")
    h.acknowledged()
    assert h.state == "up" and h.reason.startswith("broker 2")
    h.unreachable("")
    assert h.state == "up" and h.reason == "answering"


def test_a_probe_failing_on_a_broker_out_of_reach_does_not_make_a_partial_failure_down() -> None:
    """The probe asks one broker; when it is the one out of reach (a partial failure: at
    most half the brokers), its failures do not make the cluster down. A whole failure
    does, as before."""
    h, clock = health()
    h.probe_answered(3)
    h.unreachable("broker 2 (127.0.0.1:9002) does not answer this agent, 4 partitions wait",
                  partial=True)
    h.probe_failed("Failed while waiting for response from broker: Local: Timed out")
    clock.now += LIMIT * 3
    h.check()
    assert h.state == "up" and h.reason.startswith("broker 2")
    h.unreachable("broker 1 ...; broker 2 ...", partial=False)
    assert h.state == "down" and "no answer to metadata requests" in h.reason
