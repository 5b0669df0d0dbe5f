"""HttpServer: binding, port 0, clear errors, graceful stop."""

from __future__ import annotations

import gc
import socket
import sys
from collections.abc import Callable

import httpx
import pytest

from agent.ingest.http.server import (
    GC_GEN0_THRESHOLD,
    SWITCH_INTERVAL,
    HttpBindError,
    HttpServer,
)
from agent.ingest.runtime import Phase
from tests.http.harness import Served


def test_port_zero_reports_the_port_it_got(served: Served) -> None:
    assert served.server.port > 0
    assert served.url == f"http://127.0.0.1:{served.server.port}"
    assert httpx.get(served.url + "/status/ping").text == "pong"


def test_a_taken_port_is_a_clear_error(served: Served) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = served.runtime.config.model_copy(update={
            "http": served.runtime.config.http.model_copy(update={"listen": f"127.0.0.1:{port}"})})
        runtime = type(served.runtime)(cfg, served.store, served.committer, served.registry)
        server = HttpServer(runtime, served.app)
        with pytest.raises(HttpBindError, match=f"cannot listen on 127.0.0.1:{port}: "
                                                "Address already in use"):
            server.start()


def test_an_unknown_host_is_a_clear_error(served: Served) -> None:
    cfg = served.runtime.config.model_copy(update={
        "http": served.runtime.config.http.model_copy(update={"listen": "no.such.host.:0"})})
    runtime = type(served.runtime)(cfg, served.store, served.committer, served.registry)
    with pytest.raises(HttpBindError, match="cannot listen on no.such.host.:0"):
        HttpServer(runtime, served.app).start()


def test_starting_twice_is_refused(served: Served) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        served.server.start()


def test_stop_refuses_new_work_and_closes_the_listener(serve: Callable[..., Served]) -> None:
    served = serve()
    assert served.client.post("/topics/t", content=b"v").status_code == 202
    served.server.stop(5.0)
    assert served.runtime.phase is Phase.STOPPING
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url + "/status/ping", timeout=5)
    served.server.stop(5.0)  # idempotent
    assert len(served.messages("t")) == 1


@pytest.mark.parametrize(("before", "after"), [(0.005, SWITCH_INTERVAL), (0.0002, 0.0002)])
def test_serving_lowers_the_gil_switch_interval_and_never_raises_it(
    serve: Callable[..., Served], before: float, after: float
) -> None:
    original = sys.getswitchinterval()
    sys.setswitchinterval(before)
    try:
        serve()
        assert sys.getswitchinterval() == pytest.approx(after)
    finally:
        sys.setswitchinterval(original)


def test_serving_freezes_the_startup_heap_and_raises_the_young_gc_threshold(
    serve: Callable[..., Served],
) -> None:
    original = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        serve()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*original)
