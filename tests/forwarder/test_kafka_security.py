"""TLS, SASL and ACLs on real Apache Kafka: SASL_SSL with SCRAM-SHA-512, mutual TLS, and an
exactly-once topic an ACL denies beside one it allows.

One single-node cluster serves both, each on its own listener, with certificates this module
makes (tests/certificates.py): SASL_SSL (server certificate, SCRAM-SHA-512 users written at
format time) and MTLS (``ssl.client.auth=required``: only clients with a certificate the
cluster's CA signed get in). Ferry is configured through ``[kafka.local.properties]``, the
way docs/configuration.md ("TLS and SASL") shows.

Each test starts the agent with a configuration the cluster refuses (a wrong password, a
client certificate from a CA the cluster does not trust), publishes, and checks that the
refusal is reported with its cause (status JSON, ``ferry status``, a log line) while every
acknowledged message stays buffered; then restarts the agent with the fixed configuration,
as an operator would, and counts every message at a consumer: none lost, none twice.
The configurations are docs/configuration.md's examples, with this module's files.
"""

from __future__ import annotations

import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agent_harness import AgentProcess, wait_drained, write_config
from tests.apache_kafka import KafkaCluster, Listener
from tests.certificates import CertificateAuthority, Issued
from tests.forwarder.apache_delivery import (
    cluster_row,
    committed,
    ferry_status,
    health_messages,
    log_lines,
    logged_discards,
    publish,
    status,
    tally,
    topic_row,
    until_drained,
    values,
)
from tests.waiting import wait_until

USER, PASSWORD = "ferry", "scram-secret-1"
MESSAGES = 60
CONFIGURATION_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SCRAM_JAAS = "org.apache.kafka.common.security.scram.ScramLoginModule required;"


@dataclass
class SecureCluster:
    kafka: KafkaCluster
    ca: CertificateAuthority
    client: Issued  # signed by the cluster's CA
    stranger: Issued  # signed by a CA the cluster does not trust

    @property
    def sasl_bootstrap(self) -> str:
        return self.kafka.listener_bootstrap("SASL_SSL")

    @property
    def mtls_bootstrap(self) -> str:
        return self.kafka.listener_bootstrap("MTLS")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    root = tmp_path_factory.mktemp("secure-kafka")
    ca = CertificateAuthority(root)
    broker = ca.issue("broker", server=True)
    client = ca.issue("ferry-agent", server=False)
    stranger = CertificateAuthority(root, "untrusted-ca").issue("ferry-agent", server=False)
    # Kafka 4 reads PEM directly: the key and its chain in one file, the CA as trust store.
    tls = {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(broker.keystore),
           "ssl.truststore.type": "PEM", "ssl.truststore.location": str(ca.cert)}
    listeners = [
        Listener("SASL_SSL", "SASL_SSL", {
            **tls, "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "scram-sha-512.sasl.jaas.config": SCRAM_JAAS}),
        Listener("MTLS", "SSL", {**tls, "ssl.client.auth": "required"}),
    ]
    # Kafka's StandardAuthorizer, everything allowed where no ACL says otherwise: the
    # PLAINTEXT listener (the tests' own clients, the node itself) is a super user, and
    # Ferry's SASL user is held to the ACLs a test adds (an exactly-once topic denied).
    authorizer = {"authorizer.class.name":
                  "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                  "allow.everyone.if.no.acl.found": "true", "super.users": "User:ANONYMOUS"}
    with KafkaCluster(root / "kafka", nodes=1, listeners=listeners,
                      scram_users={USER: PASSWORD}, start_timeout=240,
                      properties={"sasl.enabled.mechanisms": "SCRAM-SHA-512",
                                  **authorizer}) as kafka:
        yield SecureCluster(kafka, ca, client, stranger)


def documented_properties(heading: str) -> dict[str, str]:
    """``[kafka.local.properties]`` of the example under ``heading`` in docs/configuration.md:
    the test runs the documented configuration, so the document cannot drift from one
    that works."""
    section = CONFIGURATION_DOC.read_text().split(f"\n### {heading}\n", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    properties: dict[str, str] = tomllib.loads(example)["kafka"]["local"]["properties"]
    return properties


def sasl_properties(ca: Path, password: str) -> dict[str, str]:
    documented = documented_properties("SASL_SSL with SCRAM-SHA-512")
    assert documented["sasl.username"] == USER
    return {**documented, "sasl.password": password, "ssl.ca.location": str(ca)}


def mtls_properties(ca: Path, client: Issued) -> dict[str, str]:
    return {**documented_properties("Mutual TLS"), "ssl.ca.location": str(ca),
            "ssl.certificate.location": str(client.cert),
            "ssl.key.location": str(client.key)}


def agent_config(root: Path, bootstrap: str, properties: dict[str, str], topic: str) -> Path:
    section = "\n[kafka.local.properties]\n" + "".join(
        f'"{k}" = "{v}"\n' for k, v in properties.items())
    return write_config(root, bootstrap, topics={topic: {"acks": "all"}}, extra=section)


def refused_then_fixed(tmp_path: Path, secure: SecureCluster, topic: str, bootstrap: str,
                       refused: dict[str, str], fixed: dict[str, str],
                       cause: tuple[str, ...]) -> None:
    """Publish with a configuration the cluster refuses; check the reason is told and the
    messages kept; restart with ``fixed``; check every message arrives once."""
    secure.kafka.create_topic(topic, 2)
    with AgentProcess(agent_config(tmp_path / "agent", bootstrap, refused, topic)) as agent:
        acknowledged = publish(agent, topic, "refused", MESSAGES)

        def local_down_with_cause() -> dict[str, object] | None:
            row = cluster_row(status(agent), "local")
            reason = str(row["reason"] or "") + str(row["last_client_error"] or "")
            return row if row["state"] == "down" and any(c in reason for c in cause) else None

        row = wait_until(local_down_with_cause, timeout=60, interval=0.5,
                         message=f"local cluster down with a cause among {cause}")
        print(f"refused: cluster local {row['state']}: {row['reason']}")
        # The topic says why it waits, naming the cluster's state and cause.
        stuck = wait_until(lambda: (topic_row(status(agent), topic) or {}).get("stuck"),
                           timeout=60, interval=0.5, message=f"{topic} reported stuck")
        assert any(c in stuck["detail"] for c in cause), stuck
        doc = status(agent)
        assert doc["health"]["status"] == "critical", health_messages(doc)
        assert any("cluster local is down" in m and any(c in m for c in cause)
                   for m in health_messages(doc)), health_messages(doc)
        code, output = ferry_status(agent)
        assert code == 2 and "local DOWN" in output, output
        assert any(c in output for c in cause), output
        print(output.splitlines()[0])
        # The log: "cluster local is down: ..." names the cause when it was known at that
        # moment; when the probe's timeout came first, librdkafka's line just after does.
        assert log_lines(agent, "cluster local is down"), agent.log_tail()
        assert any(log_lines(agent, c) for c in cause), agent.log_tail()
        # Nothing acknowledged went anywhere else: it is all in the buffer.
        assert agent.buffered() == {topic: MESSAGES}
        assert doc["totals"]["discarded"] == 0

    # The operator fixes the configuration and restarts the agent on the same buffer.
    t0 = time.monotonic()
    with AgentProcess(agent_config(tmp_path / "agent", bootstrap, fixed, topic)) as agent:
        acknowledged += publish(agent, topic, "fixed", MESSAGES)
        wait_drained(agent, timeout=90)
        drained = time.monotonic() - t0
        assert cluster_row(status(agent), "local")["state"] == "up"
        assert status(agent)["totals"]["discarded"] == 0
    counted = tally(acknowledged, values(secure.kafka.bootstrap, topic))
    print(f"{topic}: {counted}; drained {drained:.1f} s after the restart")
    assert counted.lost == [] and counted.duplicated == {}, counted
    assert counted.acknowledged == 2 * MESSAGES


def test_sasl_scram_wrong_password_is_reported_and_kept_until_fixed(
    tmp_path: Path, secure: SecureCluster, unique_topic: str
) -> None:
    refused_then_fixed(
        tmp_path, secure, unique_topic, secure.sasl_bootstrap,
        refused=sasl_properties(secure.ca.cert, "not-the-password"),
        fixed=sasl_properties(secure.ca.cert, PASSWORD),
        cause=("Authentication failed", "SASL authentication error"),
    )


def test_mtls_untrusted_client_certificate_is_reported_and_kept_until_fixed(
    tmp_path: Path, secure: SecureCluster, unique_topic: str
) -> None:
    refused_then_fixed(
        tmp_path, secure, unique_topic, secure.mtls_bootstrap,
        refused=mtls_properties(secure.ca.cert, secure.stranger),
        fixed=mtls_properties(secure.ca.cert, secure.client),
        cause=("certificate", "SSL handshake"),
    )


def test_an_exactly_once_topic_an_acl_denies_holds_back_only_itself(
    tmp_path: Path, secure: SecureCluster
) -> None:
    """Two exactly-once topics share the transactions; an ACL denies Ferry writing one. The
    allowed one keeps committing (every message, once, read_committed); the denied one is
    held, its messages kept, health CRITICAL naming it and the error; once the ACL goes, it
    delivers everything too."""
    kafka = secure.kafka
    run = uuid.uuid4().hex[:8]
    denied, allowed = f"denied-eo-{run}", f"allowed-eo-{run}"
    for topic in (denied, allowed):
        kafka.create_topic(topic, 2)
    kafka.set_acl("TOPIC", denied, "WRITE", "DENY", f"User:{USER}")
    eo = {"delivery": "exactly_once", "acks": "all", "ack_timeout_ms": 0}
    config = sasl_agent_config(tmp_path / "agent", secure, {denied: eo, allowed: eo}, run)
    with AgentProcess(config) as agent:
        kept = publish(agent, denied, "denied", 100)
        sent = publish(agent, allowed, "allowed-a", 200)
        wait_until(lambda: allowed not in agent.buffered(), timeout=60, interval=0.5,
                   message="the allowed topic delivered while the other is denied")
        sent += publish(agent, allowed, "allowed-b", 200)
        wait_until(lambda: allowed not in agent.buffered(), timeout=60, interval=0.5,
                   message="the allowed topic delivered again")
        assert agent.buffered() == {denied: 100}
        doc = status(agent)
        problems = [m for m in health_messages(doc) if denied in m]
        assert doc["health"]["status"] == "critical", doc["health"]
        assert problems and "TOPIC_AUTHORIZATION_FAILED" in problems[0], problems
        kafka.set_acl("TOPIC", denied, "WRITE", "DENY", f"User:{USER}", remove=True)
        until_drained(agent, timeout=90)
        assert logged_discards(agent) == []
    for topic, expected in ((denied, kept), (allowed, sent)):
        counted = tally(expected, committed(kafka.bootstrap, topic))
        print(topic, counted)
        assert counted.lost == [] and counted.duplicated == {}, counted


@pytest.mark.parametrize(("resource", "name", "error"), [
    ("TRANSACTIONAL_ID", "ferry-", "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"),
    ("GROUP", "ferry-progress-", "GROUP_AUTHORIZATION_FAILED"),
])
def test_an_acl_exactly_once_needs_is_named_in_health_and_nothing_is_lost(
    tmp_path: Path, secure: SecureCluster, resource: str, name: str, error: str
) -> None:
    """Exactly-once needs ACLs at-least-once does not (docs/configuration.md, "ACLs"): its
    transactional id, and the group it reads its progress with. Denied one, every
    exactly-once topic waits, health CRITICAL naming the topic and Kafka's error (not
    ``_STATE``); granted again, everything is delivered once."""
    kafka = secure.kafka
    run = uuid.uuid4().hex[:8]
    topic = f"eo-{run}"
    kafka.create_topic(topic, 1)
    kafka.set_acl(resource, name, "ALL", "DENY", f"User:{USER}", prefixed=True)
    eo = {"delivery": "exactly_once", "acks": "all", "ack_timeout_ms": 0}
    try:
        with AgentProcess(sasl_agent_config(tmp_path / "agent", secure, {topic: eo},
                                            run)) as agent:
            kept = publish(agent, topic, "kept", 20)
            problem = wait_until(
                lambda: next((m for m in health_messages(status(agent))
                              if topic in m and error in m), None),
                timeout=60, interval=0.5, message=f"health naming {topic} and {error}")
            print(problem)
            assert status(agent)["health"]["status"] == "critical"
            assert agent.buffered() == {topic: 20}
            kafka.set_acl(resource, name, "ALL", "DENY", f"User:{USER}", prefixed=True,
                          remove=True)
            until_drained(agent, timeout=90)
    finally:
        kafka.set_acl(resource, name, "ALL", "DENY", f"User:{USER}", prefixed=True,
                      remove=True)
    counted = tally(kept, committed(kafka.bootstrap, topic))
    assert counted.lost == [] and counted.duplicated == {}, counted


def sasl_agent_config(root: Path, secure: SecureCluster, topics: dict[str, dict[str, object]],
                      run: str) -> Path:
    """An agent on the SASL_SSL listener as Ferry's user, with the documented settings."""
    section = "\n[kafka.local.properties]\n" + "".join(
        f'"{k}" = "{v}"\n' for k, v in sasl_properties(secure.ca.cert, PASSWORD).items())
    return write_config(root, secure.sasl_bootstrap, topics=dict(topics),
                        forwarder={"agent_id": f"acl-{run}"}, extra=section)
