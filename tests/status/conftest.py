"""Fixtures of the status tests: an agent core served over HTTP, and a headless Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver

from agent.daemon.agent import Agent
from status.routes import StatusService
from tests.status.statuskit import Activity, StatusServer, close_agent, make_agent, serve

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = make_agent(tmp_path, remote=True)
    try:
        yield a
    finally:
        close_agent(a)


@pytest.fixture
def activity(agent: Agent) -> Activity:
    return Activity(agent)


@pytest.fixture
def status_server(agent: Agent, activity: Activity) -> Iterator[StatusServer]:
    """The status routes of ``agent`` on a real HTTP server; history sampled every 0.2 s."""
    service = StatusService(agent.runtime, history_interval=0.2).start()
    try:
        with serve(service.routes()) as url:
            yield StatusServer(url, agent, service, activity)
    finally:
        service.stop()


@pytest.fixture(scope="session")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """Debian's headless Chromium through its chromedriver (selenium-manager never runs)."""
    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-dev-shm-usage", "--force-device-scale-factor=1", "--window-size=1400,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
