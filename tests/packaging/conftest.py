"""Fixtures for the packaging tests: prerequisites, the built packages, the cached root file
system, and fresh chroots/containers made from it. See tests/packaging/harness.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.packaging import harness


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so --strict-markers accepts it even where pyproject.toml lacks it.
    config.addinivalue_line(
        "markers",
        "packaging: builds the .deb/.rpm and installs them in Debian chroots and containers "
        "(root; several minutes on a first run)",
    )


@pytest.fixture(scope="session")
def packaging_prereqs() -> None:
    if os.geteuid() != 0:
        pytest.fail("the packaging tests need root (mmdebstrap, chroot, rpm --root, "
                    "systemd-nspawn); deselect them with -m 'not packaging'", pytrace=False)
    harness.install_test_deps()


@pytest.fixture(scope="session")
def packages(packaging_prereqs: None) -> harness.Packages:
    return harness.build_packages()


@pytest.fixture(scope="session")
def upgrade_deb(packages: harness.Packages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness.build_upgrade_deb(f"{packages.version}+upgrade1",
                                     tmp_path_factory.mktemp("upgrade"))


@pytest.fixture(scope="session")
def rootfs(packaging_prereqs: None) -> Path:
    return harness.rootfs()


@pytest.fixture
def chroot(rootfs: Path, tmp_path: Path) -> Iterator[harness.Chroot]:
    root = harness.Chroot(rootfs, tmp_path / "root")
    try:
        yield root
    finally:
        root.cleanup()


@pytest.fixture
def container(rootfs: Path, tmp_path: Path) -> Iterator[harness.Container]:
    """Booted with systemd; shares the host's network (brokers on 127.0.0.1)."""
    booted = harness.Container(rootfs, tmp_path / "machine", tmp_path / "nspawn.log")
    try:
        yield booted
    finally:
        booted.cleanup()


@pytest.fixture
def isolated_container(rootfs: Path, tmp_path: Path) -> Iterator[harness.Container]:
    """Booted with systemd in its own network namespace (sysctls under net.* are its own)."""
    booted = harness.Container(rootfs, tmp_path / "machine", tmp_path / "nspawn.log",
                               private_network=True)
    try:
        yield booted
    finally:
        booted.cleanup()
