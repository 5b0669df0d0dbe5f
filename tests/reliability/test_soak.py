"""Soak (long mode only): 10 minutes of mixed load on all inputs, with bad input and status
polling mixed in. Memory (private RSS) and open file descriptors of every agent process must
stay flat after a warm-up, and every acknowledged message must be delivered.

``dev/reliability --long`` runs it; ``FERRY_SOAK_SECONDS`` changes the length. The samples go
to ``test-artifacts/<test>/soak-report.json``; docs/reliability.md holds the current figures,
bench/results/reliability.md the runs.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from tests.agent_harness import write_config
from tests.kafka import Broker
from tests.reliability.checker import INPUTS, Ledger, Load, spool_files_left, tally
from tests.reliability.harness import Agent, Usage, metric_total, read_values
from tests.waiting import wait_until

SOAK_SECONDS = float(os.environ.get("FERRY_SOAK_SECONDS", "600"))
SAMPLE_EVERY = 10.0
MIB = 1024


def _noise(agent: Agent, stop: threading.Event) -> None:
    """Bad input and status readers, twice a second: the paths a long run also exercises."""
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.connect(str(agent.socket_path))
    rng = random.Random(7)
    with httpx.Client(timeout=10) as client:
        for _ in range(1_000_000):
            if stop.wait(0.5):
                break
            raw.send(rng.randbytes(rng.randint(0, 60)))  # malformed datagram
            client.post(f"{agent.http_url}/topics/bad topic", content=b"x")  # 400
            client.post(f"{agent.http_url}/topics/soak-json/batch", content=b"{]",
                        headers={"content-type": "application/x-ndjson"})
            client.get(f"{agent.http_url}/status/all?history=1")
            client.get(f"{agent.http_url}/metrics")
    raw.close()


def _row(t: float, u: Usage, buffered: int) -> dict[str, float]:
    row: dict[str, float] = {"t": round(t, 1), "buffered": buffered}
    for role in ("ingest", "forwarder"):
        p = u.role(role)
        if p is not None:
            row[f"{role}_rss_mib"] = round(p.rss_kib / MIB, 1)
            row[f"{role}_anon_mib"] = round(p.anon_kib / MIB, 1)
            row[f"{role}_fds"] = p.fds
    return row


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS) + 900)
def test_soak_memory_and_descriptors_stay_flat(
    tmp_path: Path, broker: Broker, artifacts_dir: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    topics = {name: f"soak-{tag}-{name}" for name in INPUTS}
    config = write_config(tmp_path / "agent", broker.bootstrap, spool=True,
                          topics={"soak-json": {"content_type": "json"}})
    spool_dir = tmp_path / "agent" / "spool"
    spool_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger()
    samples: list[dict[str, float]] = []
    with Agent(config) as agent:
        pids = agent.pids()
        load = Load(agent, topics, spool_dir, ledger, random.Random(1),
                    # HTTP paced: tansu reads back one-message batches slowly (read_values)
                    spool_pause=(1.0, 2.0), socket_pause=0.2, http_pause=0.05)
        stop_noise = threading.Event()
        noise = threading.Thread(target=_noise, args=(agent, stop_noise), daemon=True)
        started = time.monotonic()
        load.start()
        noise.start()
        try:
            for _ in range(int(SOAK_SECONDS / SAMPLE_EVERY) + 1):
                t = time.monotonic() - started
                samples.append(_row(t, agent.usage(), sum(agent.buffered().values())))
                if t >= SOAK_SECONDS:
                    break
                # The sampling period: a measurement cadence, not a synchronisation.
                time.sleep(min(SAMPLE_EVERY, max(0.0, SOAK_SECONDS - t)))
        finally:
            load.killing.set()
            load.finish()
            stop_noise.set()
            noise.join(30)
        wait_until(lambda: not spool_files_left(spool_dir), timeout=120,
                   message="spool files ingested")
        wait_until(lambda: sum(agent.buffered().values()) == 0, timeout=300, interval=0.5,
                   message="buffer drained")
        samples.append(_row(time.monotonic() - started, agent.usage(), 0))
        counters = agent.counters()
        assert agent.pids() == pids, "a process of the agent was replaced during the soak"
    inputs = {name: tally(ledger, name, read_values(broker.bootstrap, topics[name]))
              for name in INPUTS}
    warm = min(120.0, SOAK_SECONDS / 5)
    after_warmup = [s for s in samples if warm <= s["t"] < warm + 120]
    last = samples[-4:-1] or samples[-1:]  # under load, before the final drain
    verdicts = {}
    for role in ("ingest", "forwarder"):
        start_anon = statistics.median(s[f"{role}_anon_mib"] for s in after_warmup)
        end_anon = statistics.median(s[f"{role}_anon_mib"] for s in last)
        start_fds = max(s[f"{role}_fds"] for s in after_warmup)
        end_fds = samples[-1][f"{role}_fds"]
        verdicts[role] = {"anon_mib_after_warmup": start_anon, "anon_mib_at_end": end_anon,
                          "fds_after_warmup": start_fds, "fds_at_end": end_fds,
                          "rss_mib_after_warmup": statistics.median(
                              s[f"{role}_rss_mib"] for s in after_warmup),
                          "rss_mib_at_end": statistics.median(s[f"{role}_rss_mib"]
                                                              for s in last)}
    report = {
        "seconds": SOAK_SECONDS, "warmup_seconds": warm, "verdicts": verdicts,
        "accepted_by_source": counters["totals"]["accepted_by_source"],
        "delivered": metric_total(counters, "messages_delivered"),
        "rejected": metric_total(counters, "messages_rejected"),
        "inputs": {n: asdict(x) for n, x in inputs.items()},
        "client_errors": dict(ledger.errors), "samples": samples,
    }
    (artifacts_dir / "soak-report.json").write_text(json.dumps(report, indent=2))
    print("\n" + json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    for name, tallied in inputs.items():
        assert tallied.lost == 0, (
            f"{name}: {tallied.lost} acknowledged lost, e.g. {tallied.lost_examples}")
        assert tallied.acked > 0
    for role, v in verdicts.items():
        assert v["anon_mib_at_end"] <= v["anon_mib_after_warmup"] * 1.25 + 10, (role, v)
        assert v["fds_at_end"] <= v["fds_after_warmup"] + 5, (role, v)
