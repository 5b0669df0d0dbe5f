"""The `ferry` command as a user runs it (real processes, real buffer)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import __version__
from agent.buffer.store import Store
from agent.records import Record
from tests.agent_harness import REPO_ROOT, ferry, write_config


def test_version() -> None:
    done = ferry("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"ferry {__version__}"


def test_invalid_config_stops_start_up_naming_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "ferry.toml"
    cfg.write_text('[buffer]\nmax_bytes = -5\n[socket]\nmode = "999"\n')
    done = ferry("run", "--config", str(cfg))
    assert done.returncode == 2
    assert "buffer.max_bytes" in done.stderr
    assert "socket.mode" in done.stderr
    assert "Traceback" not in done.stderr


def test_environment_overrides_are_validated_too(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    done = ferry("run", "--config", str(cfg), env={"FERRY_HTTP__LISTEN": "nonsense"})
    assert done.returncode == 2
    assert "http.listen" in done.stderr


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    done = ferry("run", "--config", str(tmp_path / "nope.toml"))
    assert done.returncode == 2
    assert "does not exist" in done.stderr


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the developer's FERRY_* variables, plus ``extra``."""
    import os

    return {**{k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}, **extra}


def ferry_clean(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli.main", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, env=clean_env(**env))


def test_validate_accepts_a_valid_file_and_summarises_it(tmp_path: Path) -> None:
    cfg = tmp_path / "ferry.toml"
    cfg.write_text('[kafka.local]\nbootstrap_servers = "127.0.0.1:1"\n'
                   '[kafka.remote]\nbootstrap_servers = "127.0.0.1:2"\n'
                   f'[spool]\ndirs = ["{tmp_path / "a"}", "{tmp_path / "b"}"]\n'
                   '[topics.clicks]\nacks = "all"\n')
    done = ferry_clean("validate", "--config", str(cfg))
    assert done.returncode == 0, done.stderr
    first, summary = done.stdout.splitlines()
    assert first == f"config OK: {cfg}"
    assert "clusters: local 127.0.0.1:1, remote 127.0.0.1:2;" in summary
    assert f"spool dirs: {tmp_path / 'a'}, {tmp_path / 'b'};" in summary
    assert "topics: clicks, default" in summary
    assert done.stderr == ""


def test_validate_lists_every_problem_and_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "ferry.toml"
    cfg.write_text('bufer = 1\n[buffer]\nmax_bytes = "lots"\n[http]\nlistn = "x"\n')
    done = ferry_clean("validate", "--config", str(cfg), FERRY_SOCKET__MODE="999")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == f"ferry: invalid configuration ({cfg} and FERRY_* variables):"
    assert sorted(lines[1:]) == sorted([
        f"  bufer: unknown setting in {cfg}, did you mean 'buffer'?",
        "  buffer.max_bytes: Input should be a valid integer, unable to parse string as an "
        "integer",
        f"  http.listn: unknown setting in {cfg}, did you mean 'listen'?",
        "  socket.mode (environment variable FERRY_SOCKET__MODE): Value error, must be an "
        "octal file mode such as '0660'",
    ])


def test_validate_names_an_unreadable_environment_variable(tmp_path: Path) -> None:
    cfg = tmp_path / "ferry.toml"
    cfg.write_text("")
    done = ferry_clean("validate", "--config", str(cfg), FERRY_SPOOL__DIRS="/a")
    assert done.returncode == 2
    assert "spool: the environment variable FERRY_SPOOL__DIRS could not be read" in done.stderr


def test_validate_warns_about_a_misspelt_variable_but_passes(tmp_path: Path) -> None:
    # The agent ignores it (and logs the same warning at start): valid, but said.
    cfg = tmp_path / "ferry.toml"
    cfg.write_text("")
    done = ferry_clean("validate", "--config", str(cfg), FERRY_LOGLEVEL="debug")
    assert done.returncode == 0
    assert done.stderr == ("ferry validate: warning: environment variable FERRY_LOGLEVEL is "
                           "not a Ferry setting and is ignored (did you mean FERRY_LOG_LEVEL?)\n")


def test_validate_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    done = ferry_clean("validate", "--config", str(tmp_path / "nope.toml"))
    assert done.returncode == 2
    assert done.stderr == f"ferry: config file {tmp_path / 'nope.toml'} does not exist\n"


def test_run_refuses_a_config_with_the_messages_of_validate(tmp_path: Path) -> None:
    cfg = tmp_path / "ferry.toml"
    cfg.write_text(f'[buffer]\npath = "{tmp_path / "buffer"}"\n'
                   '[topics.t]\nackz = "all"\n[http]\nlisten = "nonsense"\n')
    validated = ferry_clean("validate", "--config", str(cfg))
    ran = ferry_clean("run", "--config", str(cfg))
    assert validated.returncode == ran.returncode == 2
    assert "did you mean 'acks'?" in ran.stderr
    assert ran.stderr == validated.stderr
    assert not (tmp_path / "buffer").exists()  # refused before opening anything


def test_send_to_a_missing_socket_fails_clearly(tmp_path: Path) -> None:
    done = ferry("send", "--socket-path", str(tmp_path / "none.sock"), "--topic", "t",
                 "--value", "v")
    assert done.returncode == 1
    assert "ferry send:" in done.stderr
    assert "Traceback" not in done.stderr


def test_send_refuses_an_illegal_topic(tmp_path: Path) -> None:
    done = ferry("send", "--socket-path", str(tmp_path / "none.sock"), "--topic", "a b",
                 "--value", "v")
    assert done.returncode == 1
    assert "topic" in done.stderr


def test_buffer_topics_peek_and_purge(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    store = Store(tmp_path / "buffer", 256 * 1024 * 1024)
    store.append([[Record("orders", b"first", key=b"k", partition_key=3),
                   Record("orders", b"second"), Record("audit", b"x")]])
    store.close()
    done = ferry("buffer", "--config", str(cfg), "topics")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[1:-1]}
    assert lines == {"audit": "1", "orders": "2"}
    done = ferry("buffer", "--config", str(cfg), "peek", "orders", "--limit", "1")
    assert "value=b'first'" in done.stdout and "partition_key=3" in done.stdout
    assert "second" not in done.stdout
    # Purge asks first; a wrong answer purges nothing.
    done = ferry("buffer", "--config", str(cfg), "purge", "orders")
    assert done.returncode == 1  # no terminal to ask on, and no --yes
    done = ferry("buffer", "--config", str(cfg), "purge", "orders", "--yes")
    assert done.returncode == 0 and "purged 2 messages" in done.stdout
    store = Store(tmp_path / "buffer", 256 * 1024 * 1024)
    assert [s.topic for s in store.topic_stats()] == ["audit"]
    store.close()


def _purge_on_a_terminal(cfg: Path, topic: str, answer: str) -> tuple[int, str]:
    """Run `ferry buffer purge TOPIC` with a pseudo-terminal as stdin, type ``answer``."""
    import os
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli.main", "buffer", "--config",
                                 str(cfg), "purge", topic], cwd=REPO_ROOT, stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.write(master, answer.encode() + b"\n")
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(master)
        os.close(slave)
    return proc.returncode, out + err


def test_buffer_purge_asks_for_the_topic_name_on_a_terminal(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    store = Store(tmp_path / "buffer", 256 * 1024 * 1024)
    store.append([[Record("orders", b"a"), Record("orders", b"b"), Record("audit", b"x")]])
    store.close()

    code, out = _purge_on_a_terminal(cfg, "orders", "yes")  # not the topic name
    assert code == 1 and "not purged" in out
    code, out = _purge_on_a_terminal(cfg, "orders", "orders")
    assert code == 0 and "purged 2 messages of orders" in out
    store = Store(tmp_path / "buffer", 256 * 1024 * 1024)
    assert [(s.topic, s.messages) for s in store.topic_stats()] == [("audit", 1)]
    store.close()


def test_buffer_topics_shows_the_age_of_the_oldest_message(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "127.0.0.1:1", http=False)
    store = Store(tmp_path / "buffer", 256 * 1024 * 1024)
    store.append([[Record("orders", b"a")]])
    store.close()
    done = ferry("buffer", "--config", str(cfg), "topics")
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[:2]
    assert header.split() == ["topic", "messages", "bytes", "oldest"]
    topic, messages, _bytes, oldest = row.split()
    assert (topic, messages) == ("orders", "1")
    # Accepted a moment ago: an age in whole seconds, not a timestamp or "-".
    assert oldest.endswith("s") and 0 <= int(oldest[:-1]) < 60


def test_send_passes_argument_bytes_that_are_not_utf8_as_they_are(tmp_path: Path) -> None:
    """As to_bruce does: a shell argument is bytes, and a value (or key) that is not UTF-8
    goes out byte for byte instead of failing to encode."""
    import os
    import socket

    from agent.ingest.datagram import parse

    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        receiver.settimeout(30)
        done = subprocess.run(
            [sys.executable, "-m", "agent.cli.main", "send", "--socket-path", str(path),
             "--topic", "t", "--value", b"caf\xe9 \xff", "--key", b"\xfek"],
            cwd=REPO_ROOT, capture_output=True, timeout=60, env=dict(os.environ))
        assert done.returncode == 0, done.stderr
        record = parse(receiver.recv(65536), 1_000_000)
    assert (record.value, record.key) == (b"caf\xe9 \xff", b"\xfek")


@pytest.fixture
def stand_in_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A "tansu" that only listens on its port: all TryOut waits for before it reads the
    config."""
    from agent.daemon import tryout

    fake = tmp_path / "tansu"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import socket, sys, time\n"
        "url = sys.argv[sys.argv.index('--listener-url') + 1]\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(url.rsplit(':', 1)[1]))); s.listen()\n"
        "time.sleep(600)\n")
    fake.chmod(0o755)
    monkeypatch.setattr(tryout, "tansu_binary", lambda: fake)


@pytest.mark.usefixtures("stand_in_broker")
def test_try_out_stops_its_broker_when_the_config_is_invalid(tmp_path: Path) -> None:
    """The broker starts before the config is read; a bad config must not leave it running."""
    from agent.config import ConfigError
    from agent.daemon import tryout

    bad = tmp_path / "bad.toml"
    bad.write_text('log_level = "loud"\n')
    trial = tryout.TryOut(tmp_path / "state", bad)
    with pytest.raises(ConfigError, match="log_level"):
        trial.__enter__()
    assert trial.proc is not None and trial.proc.poll() is not None, "the broker still runs"


@pytest.mark.usefixtures("stand_in_broker")
def test_try_out_ignores_the_hosts_production_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent import config as config_module
    from agent.daemon import tryout

    production = tmp_path / "ferry.toml"
    production.write_text('[kafka.remote]\nbootstrap_servers = "prod-remote:9092"\n')
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", production)
    assert config_module.load_config().kafka.remote is not None  # what `ferry run` reads
    with tryout.TryOut(tmp_path / "state") as trial:
        assert trial.config.kafka.remote is None  # demo traffic stays on the laptop
        assert trial.config.kafka.local.bootstrap_servers == f"127.0.0.1:{trial.port}"


def test_try_out_says_so_at_once_when_its_broker_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.daemon import tryout

    fake = tmp_path / "tansu"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    fake.chmod(0o755)
    monkeypatch.setattr(tryout, "tansu_binary", lambda: fake)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the tansu broker did not start; see .*tansu.log"):
        tryout.TryOut(tmp_path / "state").__enter__()
    # Not the 10 s the port is waited for: the probe stops retrying once the broker exited.
    assert time.monotonic() - started < 8


# -- try-out and a taken port ------------------------------------------------------------------
@pytest.mark.usefixtures("stand_in_broker")
def test_try_out_listens_where_ferry_http_listen_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.daemon import tryout
    from tests.kafka import free_port

    listen = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("FERRY_HTTP__LISTEN", listen)
    with tryout.TryOut(tmp_path / "state") as trial:
        assert trial.config.http.listen == listen


@pytest.mark.usefixtures("stand_in_broker")
def test_try_out_on_a_taken_port_says_so_in_one_line_and_stops_its_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from agent.cli.main import main
    from agent.daemon import tryout

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        monkeypatch.setenv("FERRY_HTTP__LISTEN", listen)
        trial = tryout.TryOut(tmp_path / "direct")
        with pytest.raises(RuntimeError, match=f"cannot listen on {listen}"):
            trial.__enter__()
        assert trial.proc is not None and trial.proc.poll() is not None, "the broker still runs"
        monkeypatch.chdir(tmp_path)
        assert main(["run", "--try-out"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ferry run --try-out: cannot listen on {listen}: Address already in use; "
                   "choose another address, e.g. FERRY_HTTP__LISTEN=127.0.0.1:9091 dev/try"]


def test_ferry_run_on_a_taken_port_exits_1_in_one_line_and_leaves_no_forwarder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import multiprocessing
    import socket

    from agent.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, "127.0.0.1:1")
        text = config.read_text()  # the harness picked a free port: point it at the taken one
        config.write_text(text.replace(text.split("listen = ")[1].split("\n")[0],
                                       f'"127.0.0.1:{port}"'))
        assert main(["run", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "Traceback" not in err
    assert multiprocessing.active_children() == []  # the forwarder was stopped, not orphaned


def test_the_banner_comes_once_every_listener_is_open(tmp_path: Path) -> None:
    """run_until_signalled calls ``started`` after the agent's start: HTTP answers and the
    socket exists by then (try-out prints its banner there)."""
    import socket

    from agent.config import load_config
    from agent.daemon.agent import Agent, run_until_signalled
    from agent.metrics import Registry

    config = load_config(write_config(tmp_path, "127.0.0.1:1"))
    agent = Agent(config, registry=Registry())
    seen: list[bool] = []

    def started() -> None:
        host, _, port = config.http.listen.rpartition(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # listening
        seen.append(Path(str(config.socket.path)).exists())
        agent.stop_requested.set()

    assert run_until_signalled(agent, started=started) == 0
    assert seen == [True]


def test_the_printed_ferry_command_works_as_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.daemon import tryout

    monkeypatch.setattr(sys, "argv", [".venv/bin/ferry", "run", "--try-out"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert tryout.ferry_command() == ".venv/bin/ferry"  # dev/try puts nothing on PATH
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert tryout.ferry_command() == f"{sys.executable} -m agent.cli.main"


def test_help_is_plain_text_and_every_command_says_what_it_does() -> None:
    # argparse prints descriptions verbatim: reST markup (``ferry``) would show as such.
    top = ferry("--help")
    assert top.returncode == 0
    assert top.stdout.startswith("usage: ferry ")
    assert "Ferry, a durable store-and-forward agent for Kafka" in top.stdout
    commands = {"run": "Run the agent.", "validate": "Check a configuration",
                "send": "Send messages", "status": "Summary of a running agent",
                "buffer": "Inspect the buffer", "replay": "Put messages from a discard log",
                "buffer topics": "Per-topic depth", "buffer peek": "Show the oldest messages",
                "buffer compact": "Give a drained buffer's disk space back",
                "buffer purge": "Delete every buffered message"}
    texts = [top.stdout]
    for command, heading in commands.items():
        shown = ferry(*command.split(), "--help")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.split("\n\n")[1].startswith(heading), (command, shown.stdout)
        texts.append(shown.stdout)
    for text in texts:
        assert not any(mark in text for mark in ("``", ":class:", ":func:", "**")), text
