"""``start_jitter_seconds`` (agent/forwarder/forwarder.py, ``_wait_start_jitter``): a whole
agent on the tansu broker takes messages at once, and its forwarder connects to Kafka only
after its random delay, then delivers them; an agent stopped during the delay stops at once.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from ferry_client import FerryClient
from tests.agent_harness import AgentProcess, write_config
from tests.kafka import Broker, read_topic
from tests.waiting import wait_until

JITTER = 3.0


def _delay(agent: AgentProcess) -> float | None:
    found = re.search(r"connecting to Kafka in ([0-9.]+) s", agent.log_path.read_text())
    return float(found.group(1)) if found else None


def test_messages_are_taken_at_once_and_delivered_after_the_delay(
    broker: Broker, unique_topic: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, broker.bootstrap,
                          forwarder={"start_jitter_seconds": JITTER})
    with AgentProcess(config) as agent:
        wait_until(lambda: _delay(agent) is not None, timeout=30,
                   message="the forwarder's start delay logged")
        delay = _delay(agent)
        assert delay is not None and 0 <= delay <= JITTER
        with FerryClient(agent.socket_path) as client:
            client.send(unique_topic, b"during the delay")
        wait_until(lambda: [m.value for m in read_topic(broker.bootstrap, unique_topic)]
                   == [b"during the delay"], timeout=JITTER + 30,
                   message="the message delivered once the delay is over")


def test_an_agent_stopped_during_the_delay_stops_at_once(
    broker: Broker, tmp_path: Path
) -> None:
    config = write_config(tmp_path, broker.bootstrap,
                          forwarder={"start_jitter_seconds": 600})
    agent = AgentProcess(config).start()
    try:
        wait_until(lambda: _delay(agent) is not None, timeout=30,
                   message="the forwarder's start delay logged")
        started = time.monotonic()
        assert agent.terminate(30) == 0
        # Told to stop, the wait ends within its polling period, not at up to 600 s.
        assert time.monotonic() - started < 10
    finally:
        agent.kill()
