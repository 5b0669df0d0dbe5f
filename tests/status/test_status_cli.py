"""``ferry status``: a readable summary and Nagios exit codes (0 OK, 1 WARN, 2 CRIT, 3 UNKNOWN)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from status import cli, model
from tests.kafka import free_port
from tests.status.statuskit import StatusServer, serve

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(url: str, **kwargs: object) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.status_command(url, 5.0, out=out, **kwargs)  # type: ignore[arg-type]
    return code, out.getvalue()


def healthy(server: StatusServer) -> None:
    act = server.activity
    act.accept("clicks", 5)
    act.deliver("clicks", 5, "local")
    act.cluster("remote", up=True)


def test_healthy_agent_is_ok_with_a_readable_summary(status_server: StatusServer) -> None:
    healthy(status_server)
    code, out = run(status_server.url)
    assert code == cli.OK, out
    first, *rest = out.splitlines()
    assert first.startswith("FERRY OK - 0 buffered")
    summary, perfdata = first.split(" | ")
    assert "local, remote up" in summary
    assert "buffered=0;;;0" in perfdata and "delivered=5c" in perfdata
    text = "\n".join(rest)
    assert "Messages:  accepted 5 (socket 5), delivered 5" in text
    assert "Clusters:  local up (3 brokers, p99 5 ms)" in text
    assert "Problems" not in text


def test_buffered_message_older_than_the_threshold_warns(status_server: StatusServer) -> None:
    healthy(status_server)
    status_server.activity.accept("orders", 2)
    code, out = run(status_server.url, thresholds=model.Thresholds(oldest_warning_seconds=0))
    assert code == cli.WARNING, out
    assert out.startswith("FERRY WARNING - oldest buffered message is")
    assert "orders: 2 buffered" in out
    assert "WARNING oldest_message" in out


def test_every_cluster_down_is_critical(status_server: StatusServer) -> None:
    act = status_server.activity
    act.accept("clicks", 3)
    act.cluster("local", up=False)
    act.cluster("remote", up=False)
    act.fail("clicks", "local", "_TRANSPORT", "Broker transport failure")
    code, out = run(status_server.url)
    assert code == cli.CRITICAL, out
    assert out.startswith("FERRY CRITICAL - cluster local is down; cluster remote is down")
    assert "clicks: 3 buffered" in out and "last error _TRANSPORT @local" in out


def test_buffer_full_is_critical(status_server: StatusServer) -> None:
    healthy(status_server)
    status_server.activity.registry.set("buffer_full", 1.0)
    code, out = run(status_server.url)
    assert code == cli.CRITICAL
    assert "buffer full: new messages are refused" in out.splitlines()[0]


def test_recent_discards_warn(status_server: StatusServer) -> None:
    healthy(status_server)
    # The history ring needs a point from before the discard.
    status_server.service.sampler.sample()
    status_server.activity.accept("orders", 1)
    status_server.activity.discard("orders", 1, "ttl")
    code, out = run(status_server.url)
    assert code == cli.WARNING, out
    assert "1 message discarded in the last" in out
    assert "Discards and rejects: discarded ttl 1" in out


def test_unreachable_agent_is_unknown() -> None:
    code, out = run(f"http://127.0.0.1:{free_port()}")
    assert code == cli.UNKNOWN
    assert out.startswith("FERRY UNKNOWN - cannot reach Ferry at http://127.0.0.1:")


def test_http_error_is_unknown(status_server: StatusServer) -> None:
    code, out = run(status_server.url + "/no/such/prefix")
    assert code == cli.UNKNOWN
    assert "answered HTTP 404" in out


@pytest.mark.parametrize(("body", "expected"), [
    (b"<html>not json</html>", "did not answer JSON"),
    (b'{"time": 1}', "invalid status document"),
    (b"[]", "invalid status document"),
])
def test_an_answer_that_is_not_a_status_document_is_unknown(body: bytes, expected: str) -> None:
    def impostor(request: Request) -> Response:
        return Response(body, media_type="application/json")

    with serve([Route("/status/all", impostor)]) as url:
        code, out = run(url)
    assert code == cli.UNKNOWN, out
    assert expected in out


def test_ferry_status_command_line(status_server: StatusServer) -> None:
    """The installed entry point: ``ferry status --url``, as a monitoring system runs it."""
    healthy(status_server)
    status_server.activity.accept("orders", 1)
    ferry = Path(sys.executable).with_name("ferry")
    args = [str(ferry)] if ferry.exists() else [sys.executable, "-m", "agent.cli.main"]
    ok = subprocess.run([*args, "status", "--url", status_server.url],
                        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("FERRY OK")
    # Thresholds per host, on the entry point and on the standalone module alike.
    for command in ([*args, "status"], [sys.executable, "-m", "status.cli"]):
        warn = subprocess.run([*command, "--url", status_server.url, "--warn-age", "0"],
                              capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert warn.returncode == 1, warn.stdout + warn.stderr
        assert warn.stdout.startswith("FERRY WARNING - oldest buffered message")
