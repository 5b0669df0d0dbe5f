"""The status page in a real headless Chromium: it renders, its charts move, it stays local."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By

from agent import __version__
from agent.daemon.agent import Agent
from ferry_client import FerryClient
from status.routes import StatusService
from tests.agent_harness import AgentProcess, write_config
from tests.kafka import Broker, free_port, unique_topic_name
from tests.status.statuskit import Activity, StatusServer, serve
from tests.waiting import wait_until

# Series colours in page.js; the tests find the charts' lines by them.
SOCKET_BLUE = (0x25, 0x63, 0xEB)
DEPTH_INDIGO = (0x4F, 0x46, 0xE5)
DELIVERED_GREEN = (0x16, 0xA3, 0x4A)
STEPS = 20  # polls of simulated traffic in the chart test

# Where in a canvas pixels of a colour are: the highest one, and the plot's baseline.
_PIXELS_JS = """
const [id, rgb, chart] = arguments;
const c = document.getElementById(id);
const plot = window.ferryStatus.charts[chart].plot;
const dpr = c.width / c.clientWidth;
const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let top = null, count = 0;
for (let y = 0; y < c.height; y++) {
  for (let x = 0; x < c.width; x++) {
    const i = (y * c.width + x) * 4;
    if (data[i + 3] > 200 && Math.abs(data[i] - rgb[0]) < 30 &&
        Math.abs(data[i + 1] - rgb[1]) < 30 && Math.abs(data[i + 2] - rgb[2]) < 30) {
      count++;
      if (top === null || y < top) top = y;
    }
  }
}
return {top: top, count: count, baseline: Math.round(plot.bottom * dpr),
        height: Math.round((plot.bottom - plot.top) * dpr)};
"""


def polls(driver: WebDriver) -> int:
    return int(driver.execute_script("return window.ferryStatus ? window.ferryStatus.polls : 0"))


def next_poll(driver: WebDriver, after: int | None = None) -> int:
    """Wait until the page has fetched and rendered once more; returns the poll count."""
    start = polls(driver) if after is None else after
    return wait_until(lambda: (n := polls(driver)) > start and n, timeout=10,
                      message=f"page poll after #{start}")


def line_pixels(driver: WebDriver, canvas: str, rgb: tuple[int, int, int],
                chart: str) -> dict[str, Any]:
    result: dict[str, Any] = driver.execute_script(_PIXELS_JS, canvas, list(rgb), chart)
    return result


def rises(px: dict[str, Any], fraction: float = 0.3) -> bool:
    """The line reaches well above the chart's zero line."""
    return px["top"] is not None and px["top"] < px["baseline"] - fraction * px["height"]


def texts(driver: WebDriver, selector: str) -> list[str]:
    """textContent of every element matching ``selector``, read in one go."""
    found: list[str] = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent)",
        selector)
    return found


def page_errors(driver: WebDriver) -> list[str]:
    log: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [e["message"] for e in log if e["level"] == "SEVERE"]


def save_full_page(driver: WebDriver, path: Path) -> None:
    """A screenshot of the whole page, not just the window (for people to look at)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
    })
    path.write_bytes(base64.b64decode(shot["data"]))


def open_page(driver: WebDriver, server: StatusServer, refresh_ms: int = 250) -> None:
    driver.set_window_size(1400, 1000)
    driver.get(f"{server.url}/?refresh={refresh_ms}")
    page_errors(driver)  # drop what earlier tests left in the log
    next_poll(driver, 1)


def test_charts_render_and_change_as_messages_flow(
    chromium: WebDriver, status_server: StatusServer, artifacts_dir: Path
) -> None:
    act = status_server.activity
    open_page(chromium, status_server)
    assert chromium.find_element(By.ID, "health").text.lower() == "ok"
    assert chromium.find_element(By.ID, "version").text == __version__
    before_rate = line_pixels(chromium, "rate-chart", SOCKET_BLUE, "rate")
    before_depth = line_pixels(chromium, "depth-chart", DEPTH_INDIGO, "depth")
    assert not rises(before_rate, 0.02) and not rises(before_depth, 0.02)
    before_image = chromium.execute_script(
        "return document.getElementById('rate-chart').toDataURL()")

    # Traffic over several polls, as an operator would see it: a burst over the socket,
    # steadier HTTP and spool, Kafka acknowledging most of it, a few discards and rejects.
    act.cluster("local", up=True)
    act.cluster("remote", up=True)
    seen = polls(chromium)
    for step in range(STEPS):
        act.accept("clicks", 400 if step in (6, 7, 14) else 50 + step, "socket")
        act.accept("page-views", 25, "http")
        act.accept("billing.events", 10, "spool")
        act.deliver("clicks", 50, "local", partition=step % 4)
        act.deliver("page-views", 20, "local" if step % 3 else "remote")
        if step == 10:
            act.discard("billing.events", 3, "ttl")
            act.reject("socket", "malformed", 2, detail="datagram shorter than its header")
            act.fail("billing.events", "local", "MSG_TIMED_OUT", "Local: Message timed out")
            # A retried Spark task's file came again: only its new records were ingested.
            act.registry.inc("spool_files_extended")
            act.registry.inc("spool_records_skipped", 1200, reason="extension")
            # The buffer is full: the spool intake waits, its batches deferred.
            act.registry.set("spool_intake_paused", 1.0)
            act.registry.inc("spool_batches_deferred", 4, reason="buffer_full")
            # An exactly-once topic: transactions committed, one given up, its progress.
            act.registry.inc("transactions_committed", 7)
            act.registry.inc("transactions_aborted", reason="failed")
            act.registry.observe("transaction_seconds", 0.12)
            act.registry.set("transaction_progress_timestamp_seconds", 1.0, topic="orders")
        seen = next_poll(chromium, seen)

    def charts_moved() -> bool:
        rate = line_pixels(chromium, "rate-chart", SOCKET_BLUE, "rate")
        depth = line_pixels(chromium, "depth-chart", DEPTH_INDIGO, "depth")
        return rises(rate) and rises(depth)

    wait_until(charts_moved, timeout=10, message="rate and depth lines above zero")
    assert chromium.execute_script(
        "return document.getElementById('rate-chart').toDataURL()") != before_image

    # The tables and tiles show the same numbers the JSON endpoints do. (The page re-renders
    # every poll, so everything is read in one script call, never through stale elements.)
    doc = status_server.service.everything()
    wait_until(lambda: texts(chromium, "#buffer-messages")
               == [f"{doc['queues']['buffer']['messages']:,}"], timeout=10,
               message="buffer tile shows the buffered count")
    clicks = texts(chromium, "#topics tr[data-topic='clicks'] td")
    accepted = sum(400 if step in (6, 7, 14) else 50 + step for step in range(STEPS))
    assert clicks[:3] == ["clicks", f"{accepted:,}", f"{STEPS * 50:,}"]
    assert clicks[8] == "local"
    assert "MSG_TIMED_OUT" in texts(chromium, "#topics tr[data-topic='billing.events']")[0]
    ttl = texts(chromium, "#discards tr[data-reason='ttl'] td")
    assert ttl[:3] == ["discarded", "ttl", "3"]
    chromium.execute_script(
        "document.querySelector(\"#discards tr[data-reason='malformed'] summary\").click()")
    next_poll(chromium)  # an opened sample list stays open across re-renders
    assert chromium.execute_script(
        "return document.querySelector(\"#discards tr[data-reason='malformed'] details\").open")
    samples = texts(chromium, "#discards tr[data-reason='malformed'] li")
    assert len(samples) == 2
    assert all("datagram shorter than its header" in sample for sample in samples)
    assert texts(chromium, "#clusters tr[data-cluster='local'] td")[1] == "up"
    assert texts(chromium, "#rate-socket") != ["–"]
    assert texts(chromium, "#spool-repeated") == [
        "0 duplicate, 1 extended (1,200 records skipped), 0 diverged"]
    assert texts(chromium, "#spool-paused") == [
        "yes, waiting for room in the buffer (batches deferred: buffer_full 4)"]
    assert texts(chromium, "#txn-committed") == ["7"]
    assert texts(chromium, "#txn-aborted") == ["1 (failed 1)"]
    assert texts(chromium, "#txn-progress")[0].startswith("orders ")
    assert page_errors(chromium) == []

    shot = artifacts_dir / "status-page.png"
    save_full_page(chromium, shot)
    assert shot.stat().st_size > 20_000


def test_page_fetches_nothing_from_outside_the_agent(
    chromium: WebDriver, status_server: StatusServer
) -> None:
    open_page(chromium, status_server)
    urls: list[str] = chromium.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
        ".concat([location.href])")
    assert urls, "no resources recorded"
    assert all(u.startswith(status_server.url + "/") for u in urls), urls
    assert any(u.endswith("/status/static/page.js") for u in urls)
    assert page_errors(chromium) == []


def test_client_supplied_text_is_shown_as_text(
    chromium: WebDriver, status_server: StatusServer
) -> None:
    """Samples carry client data: it must never become markup or script on the page."""
    status_server.activity.reject(
        "http", "bad_topic", detail='<img src=x onerror="window.pwned=1"><b id="injected">x</b>')
    open_page(chromium, status_server)
    chromium.execute_script(
        "document.querySelector(\"#discards tr[data-reason='bad_topic'] summary\").click()")
    next_poll(chromium)
    [sample] = texts(chromium, "#discards tr[data-reason='bad_topic'] li")
    assert '<b id="injected">x</b>' in sample
    assert chromium.find_elements(By.ID, "injected") == []
    assert chromium.execute_script("return window.pwned === undefined")


def test_page_says_when_the_agent_is_unreachable(
    chromium: WebDriver, agent: Agent, activity: Activity
) -> None:
    activity.accept("clicks", 5)
    service = StatusService(agent.runtime).start()
    try:
        with serve(service.routes()) as url:
            open_page(chromium, StatusServer(url, agent, service, activity))
            banner = chromium.find_element(By.ID, "banner")
            assert not banner.is_displayed()
        # The agent's listener is gone now.
        wait_until(banner.is_displayed, timeout=10, message="unreachable banner")
    finally:
        service.stop()
    assert banner.text.startswith("Cannot reach Ferry")
    assert chromium.find_element(By.ID, "health").text.lower() == "unreachable"
    # The last figures stay on the page, and say how old they are.
    assert chromium.find_element(By.ID, "buffer-messages").text == "5"
    assert "The figures below are from" in banner.text


def test_page_of_the_real_agent_follows_messages_to_kafka(
    chromium: WebDriver, session_broker: Broker, tmp_path: Path, artifacts_dir: Path
) -> None:
    """The whole agent (`ferry run`): its own HTTP listener serves the page; socket messages
    show up on the charts and in the topic table once Kafka acknowledged them."""
    topic = unique_topic_name("page")
    with AgentProcess(write_config(tmp_path, session_broker.bootstrap)) as agent:
        chromium.set_window_size(1400, 1000)
        chromium.get(agent.http_url + "/?refresh=250")
        page_errors(chromium)
        seen = next_poll(chromium, 1)
        with FerryClient(agent.socket_path) as client:
            for burst in range(6):
                for i in range(200):
                    client.send(topic, b"page-%d-%d" % (burst, i))
                seen = next_poll(chromium, seen)
        row = f"#topics tr[data-topic='{topic}'] td"
        wait_until(lambda: texts(chromium, row)[1:3] == ["1,200", "1,200"], timeout=30,
                   message="1,200 accepted and delivered in the topic table")
        # Kafka keeps up, so the delivered line may be drawn right over the accepted one.
        wait_until(lambda: any(rises(line_pixels(chromium, "rate-chart", colour, "rate"))
                               for colour in (SOCKET_BLUE, DELIVERED_GREEN)),
                   timeout=10, message="socket or delivered rate line above zero")
        assert texts(chromium, "#clusters tr[data-cluster='local'] td")[1] == "up"
        assert texts(chromium, row)[8] == "local"
        # The agent's own memory, with the buffer's mapped pages told apart (both processes).
        wait_until(lambda: texts(chromium, "#memory-mapped")[0].startswith("RSS "), timeout=15,
                   message="memory tile filled from the first sample")
        own = texts(chromium, "#memory-own")[0]
        assert own.endswith(("MiB", "KiB", "GiB")), own
        assert "buffer pages (reclaimable)" in texts(chromium, "#memory-mapped")[0]
        assert set(agent.get_json("/status/info")["memory"]["processes"]) == {
            "ingest", "forwarder"}
        assert page_errors(chromium) == []
        save_full_page(chromium, artifacts_dir / "status-page-real-agent.png")


def test_page_says_why_a_cluster_is_down_and_why_a_topic_is_stuck(
    chromium: WebDriver, status_server: StatusServer
) -> None:
    act = status_server.activity
    now = time.time()
    act.cluster("local", up=False)
    act.cluster("remote", up=False)
    why = ("no answer to a metadata request (Local: Timed out): Connect to "
           "ipv4#127.0.0.1:1 failed: Connection refused")
    act.registry.set_info("cluster_state", {
        "local": {"state": "down", "reason": why, "since": now - 30},
        "remote": {"state": "down", "reason": "no answer", "since": now - 30}})
    act.accept("orders", 5)
    act.registry.set_info("stuck_topics", {"orders": {
        "error": "TOPIC_AUTHORIZATION_FAILED", "cluster": "local",
        "detail": "Broker: Topic authorization failed", "operator": True,
        "since": now - 60, "last_time": now, "failures": 42}})
    open_page(chromium, status_server)
    assert chromium.find_element(By.ID, "health").text.lower() == "critical"
    state = texts(chromium, "#clusters tr[data-cluster='local'] td")[1]
    assert state.startswith("DOWN") and "Connection refused" in state
    row = texts(chromium, "#topics tr[data-topic='orders'] td")
    assert row[0] == "orders"  # stuck topics come first
    assert "STUCK: TOPIC_AUTHORIZATION_FAILED @local" in row[7]
    assert "42 failed sends" in row[7] and "needs an operator" in row[7]
    problems = " ".join(texts(chromium, "#problems li"))
    assert "topic orders cannot be delivered" in problems
    assert "cluster local is down: " + why in problems
    # Time-axis labels in whole units (a 2-minute window ticks every 20 s).
    labels = chromium.execute_script(
        "return [0, 20, 40, 60, 80, 100, 120, 150, 300].map(window.ferryStatus.fmtTick)")
    assert labels == ["now", "-20s", "-40s", "-1m", "-1m20s", "-1m40s", "-2m", "-2m30s",
                      "-5m"]
    drawn = chromium.execute_script("return window.ferryStatus.charts.rate.ticks")
    assert drawn and all("." not in t for t in drawn), drawn
    assert page_errors(chromium) == []


def test_page_of_an_agent_whose_only_cluster_is_unreachable_is_critical(
    chromium: WebDriver, tmp_path: Path
) -> None:
    """No traffic at all, Kafka on a closed port: the page turns CRITICAL from the probes
    alone, and its cluster row says why (issue 17: it used to stay OK)."""
    closed = free_port()
    with AgentProcess(write_config(tmp_path, f"127.0.0.1:{closed}")) as agent:
        chromium.set_window_size(1400, 1000)
        chromium.get(agent.http_url + "/?refresh=250")
        page_errors(chromium)
        wait_until(lambda: chromium.find_element(By.ID, "health").text.lower() == "critical",
                   timeout=15, message="the page's badge CRITICAL without traffic")
        state = wait_until(lambda: (t := texts(chromium, "#clusters tr[data-cluster='local'] td"))
                           and "Connection refused" in t[1] and t[1], timeout=10,
                           message="the cluster row's reason")
        assert state.startswith("DOWN")
        assert "cluster local is down" in " ".join(texts(chromium, "#problems li"))
        assert page_errors(chromium) == []
