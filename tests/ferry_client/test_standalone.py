"""The client stands alone: it imports only the standard library, and installed by itself in
a fresh virtual environment (no agent, no third-party packages) it sends to a running agent
over both the datagram socket and HTTP."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from agent.config import load_config
from tests.agent_harness import REPO_ROOT, AgentProcess, write_config
from tests.kafka import Broker, consume_all, create_topic

# An interpreter that reports which modules `import ferry_client` adds to what it had at start.
_NEW_MODULES = """
import json, sys
before = set(sys.modules)
import ferry_client
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _clean_env() -> dict[str, str]:
    # Nothing from this checkout may leak in through the environment.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_importing_the_client_loads_only_the_standard_library() -> None:
    # -S: no site-packages at all, so a third-party import would fail outright; -E: no
    # PYTHONPATH. The checkout is found as the current directory.
    out = subprocess.run([sys.executable, "-S", "-E", "-c", _NEW_MODULES], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    added = json.loads(out)
    assert "ferry_client" in added
    tops = {name.split(".")[0] for name in added}
    outside = sorted(t for t in tops - {"ferry_client"} if t not in sys.stdlib_module_names)
    assert outside == [], f"import ferry_client loaded non-stdlib modules: {outside}"
    assert not [name for name in added if name == "agent" or name.startswith("agent.")]


def test_client_installed_alone_sends_to_a_running_agent(
    tmp_path: Path, session_broker: Broker, unique_topic: str
) -> None:
    # Build the client's wheel from its own pyproject.toml (ferry_client/pyproject.toml), in a
    # copy so that no build output lands in the checkout, offline.
    source = tmp_path / "client-src"
    shutil.copytree(REPO_ROOT / "ferry_client", source,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                    "--no-build-isolation", "-q", "-w", str(wheels), str(source)],
                   check=True, timeout=120, env=_clean_env())
    [wheel] = wheels.glob("ferry_client-*.whl")

    # A fresh venv from the base interpreter (none of this project's packages), offline.
    # Without pip of its own (ensurepip took ~6 s of CPU, the slowest step): this pip installs
    # into it and lists it (--python), so the venv holds the client and nothing else at all.
    venv = tmp_path / "app-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "-q", "--no-index", str(wheel)],
                   check=True, timeout=120, env=_clean_env())
    listed = subprocess.run([*pip, "list", "--format=json"], check=True,
                            capture_output=True, text=True, timeout=60, env=_clean_env())
    installed = {p["name"] for p in json.loads(listed.stdout)}
    assert installed == {"ferry-client"}

    create_topic(session_broker.bootstrap, unique_topic, 1)
    config = write_config(tmp_path / "ferry-state", session_broker.bootstrap)
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        assert importlib.util.find_spec("agent") is None, "the agent must not be importable"
        from ferry_client import FerryClient, FerryHttp
        with FerryClient({str(load_config(config).socket.path)!r}, timeout=10) as ferry:
            ferry.send({unique_topic!r}, b"over the socket", key=b"k")
        with FerryHttp(sys.argv[1]) as ferry:
            answer = ferry.publish({unique_topic!r}, b"over HTTP")
        print(answer.id)
    """))
    with AgentProcess(config) as agent:
        # From a directory outside the checkout, so only the installed package can be found.
        done = subprocess.run([str(python), str(script), agent.http_url], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, env=_clean_env())
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.strip()) == 24  # the message id Ferry answered with
        got = consume_all(session_broker.bootstrap, unique_topic, 2, timeout=30)
    # Sorted: a datagram is queued, not yet buffered, when send() returns, so the HTTP message
    # can be committed (and forwarded) first.
    assert sorted((m.value, m.key) for m in got) == [(b"over HTTP", None),
                                                      (b"over the socket", b"k")]
