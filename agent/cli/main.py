"""The ``ferry`` command: run the daemon, send messages, inspect the buffer, replay discards."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from agent import __version__
from agent.config import ConfigError, FerryConfig, config_file, environment_warnings, load_config

log = logging.getLogger("ferry")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        result: int = args.func(args)
        return result
    except ConfigError as exc:
        print(f"ferry: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    # Plain text, not the module's docstring: argparse prints descriptions as they are, and
    # reST markup (``ferry``) would show as such in a terminal.
    p = argparse.ArgumentParser(
        prog="ferry",
        description="Ferry, a durable store-and-forward agent for Kafka: run the daemon, check "
        "a configuration, send messages, inspect the buffer, replay discards.",
        epilog="Run 'ferry COMMAND --help' for the options of a command. "
        "Documentation: README.md and docs/ in Ferry's source.",
    )
    p.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = _command(sub.add_parser, "run", "run the agent")
    run.add_argument("--config", type=Path, help="TOML file (default /etc/ferry/ferry.toml "
                     "when present); FERRY_* variables override it")
    run.add_argument("--try-out", action="store_true",
                     help="try Ferry on this machine: state under ./var, a local tansu broker "
                     "started for the session")
    run.set_defaults(func=_run)

    validate = _command(sub.add_parser, "validate", "check a configuration without starting "
                        "the agent (exit 0 valid, 2 invalid: every problem is listed)")
    validate.add_argument("--config", type=Path, help="TOML file (default /etc/ferry/ferry.toml "
                          "when present); FERRY_* variables are checked too")
    validate.set_defaults(func=_validate)

    send = _command(sub.add_parser, "send", "send messages to the datagram socket (like to_bruce)")
    send.add_argument("--socket-path", type=Path, default=None,
                      help="default: socket.path of the config, else /run/ferry/ferry.sock")
    send.add_argument("--config", type=Path)
    send.add_argument("--topic", required=True)
    src = send.add_mutually_exclusive_group(required=True)
    src.add_argument("--value", help="message value")
    src.add_argument("--stdin", action="store_true", help="read the value from standard input")
    send.add_argument("--key", help="Kafka message key")
    send.add_argument("--partition-key", type=int,
                      help="32-bit partition key: send a PartitionKey message")
    send.add_argument("--count", type=int, default=1, help="send the message this many times")
    send.set_defaults(func=_send)

    status = _command(sub.add_parser, "status", "summary of a running agent; exit code for "
                      "monitoring (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN)")
    status.add_argument("--url", default=None, help="default: from the config's http.listen")
    status.add_argument("--config", type=Path)
    status.add_argument("--timeout", type=float, default=5.0)
    from status.cli import add_threshold_arguments

    add_threshold_arguments(status)
    status.set_defaults(func=_status)

    buf = _command(sub.add_parser, "buffer", "inspect the buffer (works while the agent runs)")
    buf.add_argument("--config", type=Path)
    bsub = buf.add_subparsers(dest="buffer_command", metavar="ACTION", required=True)
    _command(bsub.add_parser, "topics", "per-topic depth, bytes and oldest message")
    peek = _command(bsub.add_parser, "peek", "show the oldest messages of a topic")
    peek.add_argument("topic")
    peek.add_argument("--limit", type=int, default=10)
    _command(bsub.add_parser, "compact", "give a drained buffer's disk space back (agent "
             "stopped): rewrite the file without its free pages")
    purge = _command(bsub.add_parser, "purge", "delete every buffered message of a topic")
    purge.add_argument("topic")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    buf.set_defaults(func=_buffer)

    topics = _command(sub.add_parser, "topics", "topic management over HTTP (list, show, "
                      "set, delete); changes need the management token")
    topics.add_argument("--config", type=Path)
    topics.add_argument("--url", default=None, help="default: from the config's http.listen")
    topics.add_argument("--token-file", type=Path, default=None,
                        help="default: http.management_token(_file) of the config, else "
                        "/etc/ferry/management.token (created by the package)")
    tsub = topics.add_subparsers(dest="topics_command", metavar="ACTION", required=True)
    tsub.add_parser("list", help="every defined topic with its settings")
    tshow = tsub.add_parser("show", help="one topic's settings")
    tshow.add_argument("name")
    tset = tsub.add_parser("set", help="define a topic or change settings (PUT)")
    tset.add_argument("name")
    tset.add_argument("settings", help='JSON object, e.g. \'{"acks": "all"}\'')
    tdel = tsub.add_parser("delete", help="forget a topic; its buffered messages are discarded")
    tdel.add_argument("name")
    tdel.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    topics.set_defaults(func=_topics)

    replay = _command(sub.add_parser, "replay",
                      "put messages from a discard log back in the buffer, each once: lines "
                      "already put back (by an earlier run) are skipped")
    replay.add_argument("file", type=Path)
    replay.add_argument("--config", type=Path)
    replay.set_defaults(func=_replay)
    return p


def _command(
    add_parser: Callable[..., argparse.ArgumentParser], name: str, text: str
) -> argparse.ArgumentParser:
    """A subcommand (``add_parser`` of a subparsers group) whose one-line help also heads its
    own ``--help``."""
    return add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


# -- run -----------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    from agent.daemon.agent import Agent, run_until_signalled
    from agent.ingest.http.server import HttpBindError
    from agent.process.logs import setup_logging

    if args.try_out:
        from agent.daemon.tryout import TryOut

        with contextlib.ExitStack() as stack:
            try:
                trial = stack.enter_context(TryOut(Path.cwd() / "var", config_path=args.config))
            except RuntimeError as exc:  # no broker, or the HTTP port taken: one line
                print(f"ferry run --try-out: {exc}", file=sys.stderr)
                return 1
            setup_logging(trial.config.log_level)
            agent = Agent(trial.config)
            try:
                return run_until_signalled(agent, started=trial.print_welcome)
            except HttpBindError as exc:
                print(f"ferry run --try-out: {exc}", file=sys.stderr)
                return 1
    config = load_config(args.config)
    setup_logging(config.log_level)
    try:
        agent = Agent(config)
    except Exception as exc:  # noqa: BLE001 - say what is wrong in one line, not a traceback
        print(f"ferry: cannot open the buffer at {config.buffer.path}: {exc}", file=sys.stderr)
        return 1
    # Non-zero when the agent stopped itself (its forwarder kept crashing): systemd restarts it.
    try:
        return run_until_signalled(agent)
    except HttpBindError as exc:
        print(f"ferry: {exc} (http.listen)", file=sys.stderr)
        return 1


# -- validate ------------------------------------------------------------------------------
def _validate(args: argparse.Namespace) -> int:
    # The very check `ferry run` makes at start (load_config): a ConfigError reaches main(),
    # which prints it as `ferry run` would and exits 2.
    config = load_config(args.config, warn_environment=False)
    for line in environment_warnings():
        print(f"ferry validate: warning: {line}", file=sys.stderr)
    path = config_file(args.config)
    print(f"config OK: {path if path else '(no file: defaults and FERRY_* variables)'}")
    print(_summary(config))
    return 0


def _summary(config: FerryConfig) -> str:
    kafka = config.kafka
    clusters = f"local {kafka.local.bootstrap_servers}"
    clusters += f", remote {kafka.remote.bootstrap_servers}" if kafka.remote else ", no remote"
    dirs = ", ".join(str(d) for d in config.spool.dirs) or "none"
    topics = ", ".join(sorted(config.topics))
    http = config.http
    https = ""
    if http.tls_listen:
        https = (f"; https: {http.tls_listen} (client certificates "
                 f"{'required' if http.tls_client_ca_file else 'not asked for'})")
    return (f"  clusters: {clusters}; spool dirs: {dirs}; "
            f"socket: {config.socket.path or 'off'}; http: {http.listen or 'off'}{https}; "
            f"buffer: {config.buffer.path}; topics: {topics}")


# -- send ----------------------------------------------------------------------------------
def _send(args: argparse.Namespace) -> int:
    # The application client (stdlib only): what `ferry send` does, any program can do.
    from ferry_client import FerryClient
    from ferry_client.topic_names import illegal_topic, is_legal_topic

    if not is_legal_topic(args.topic):
        print(f"ferry send: {illegal_topic(args.topic)}", file=sys.stderr)
        return 1
    path = args.socket_path
    if path is None:
        try:
            path = _config(args).socket.path or Path("/run/ferry/ferry.sock")
        except (ConfigError, PermissionError):
            # Client users usually cannot read the daemon's config (it may hold secrets);
            # only a config named explicitly must be readable.
            if args.config is not None:
                raise
            path = Path("/run/ferry/ferry.sock")
    # os.fsencode: arguments are bytes to the kernel; bytes that are not UTF-8 reach Python
    # as surrogate escapes and go out as they came in (as to_bruce sends them).
    value = sys.stdin.buffer.read() if args.stdin else os.fsencode(args.value)
    key = os.fsencode(args.key) if args.key is not None else None
    try:
        with FerryClient(path) as client:
            for _ in range(args.count):
                client.send(args.topic, value, key=key, partition_key=args.partition_key)
    except (OSError, ValueError) as exc:
        print(f"ferry send: {exc}", file=sys.stderr)
        return 1
    return 0


# -- status --------------------------------------------------------------------------------
def _status(args: argparse.Namespace) -> int:
    from status.cli import status_command, thresholds_from

    url = args.url
    if url is None:
        url = f"http://{_config(args).http.listen}"
    result: int = status_command(url, args.timeout, thresholds=thresholds_from(args))
    return result


# -- buffer --------------------------------------------------------------------------------
def _buffer(args: argparse.Namespace) -> int:
    import time

    from agent.buffer import keys
    from agent.buffer.store import Corrupt, Store

    config = _config(args)
    if not (config.buffer.path / "data.mdb").exists():
        print(f"ferry buffer: no buffer at {config.buffer.path}", file=sys.stderr)
        return 1
    if args.buffer_command == "compact":
        return _compact(config.buffer.path)
    with Store(config.buffer.path, config.buffer.max_bytes,
               reserve_bytes=config.buffer.reserve_bytes) as store:
        if args.buffer_command == "topics":
            now = time.time() * 1000
            print(f"{'topic':40} {'messages':>10} {'bytes':>12} {'oldest':>10}")
            for s in store.topic_stats():
                age = f"{(now - s.oldest_ms) / 1000:.0f}s" if s.oldest_ms else "-"
                print(f"{s.topic:40} {s.messages:>10} {s.bytes:>12} {age:>10}")
            print(f"used {store.used_bytes()} of {config.buffer.max_bytes} bytes")
            return 0
        if args.buffer_command == "peek":
            for m in store.read(args.topic, None, args.limit):
                if isinstance(m, Corrupt):
                    print(f"{keys.id_text(m.id)} CORRUPT: {m.error}")
                    continue
                r = m.record
                print(f"{keys.id_text(m.id)} ts={r.timestamp_ms} key={r.key!r} "
                      f"partition_key={r.partition_key} value={r.value[:200]!r}")
            return 0
        if args.buffer_command == "purge":
            if not args.yes:
                confirmed = _confirm("buffer purge", f"Delete every buffered message of "
                                     f"{args.topic!r}? They will not be delivered. Type the "
                                     "topic name to confirm: ", args.topic)
                if not confirmed:
                    if confirmed is not None:
                        print("not purged")
                    return 1
            n = store.purge(args.topic)
            print(f"purged {n} messages of {args.topic}")
            return 0
    return 2


def _confirm(command: str, question: str, answer: str) -> bool | None:
    """Ask the user to type ``answer`` to go ahead. None (and why, on stderr) when there is
    no terminal to ask: a script must say --yes."""
    if not sys.stdin.isatty():
        print(f"ferry {command}: refusing without --yes (no terminal to ask)", file=sys.stderr)
        return None
    return input(question).strip() == answer


def _compact(path: Path) -> int:
    from agent.buffer.compact import BufferBusy, compact

    try:
        done = compact(path)
    except BufferBusy as exc:
        print(f"ferry buffer compact: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"ferry buffer compact: {exc}; the buffer is unchanged", file=sys.stderr)
        return 1
    print(f"compacted {path}/data.mdb: {done.before_bytes:,} -> {done.after_bytes:,} bytes")
    return 0


# -- topics --------------------------------------------------------------------------------
def _topics(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request
    from urllib.parse import quote

    from agent.ingest.http import auth

    config = _config(args)
    url = (args.url or f"http://{config.http.listen}").rstrip("/")
    if args.token_file is not None:
        token = auth.read_token_file(args.token_file)
    elif config.http.management_token:
        token = config.http.management_token
    else:
        token = auth.read_token_file(config.http.management_token_file
                                     or auth.DEFAULT_TOKEN_FILE)
    command = args.topics_command
    method, path, body = "GET", "/topics", None
    if command == "show":
        path = f"/topics/{quote(args.name, safe='')}"
    elif command == "set":
        try:
            settings = json.loads(args.settings)
        except ValueError as exc:
            print(f"ferry topics set: the settings are not JSON: {exc}", file=sys.stderr)
            return 2
        method, path = "PUT", f"/topics/{quote(args.name, safe='')}"
        body = json.dumps(settings).encode()
    elif command == "delete":
        if not args.yes:
            confirmed = _confirm("topics delete", f"Delete topic {args.name!r}? Its buffered "
                                 "messages are discarded. Type the topic name to confirm: ",
                                 args.name)
            if not confirmed:
                if confirmed is not None:
                    print("not deleted")
                return 1
        method, path = "DELETE", f"/topics/{quote(args.name, safe='')}"
    if method != "GET" and token is None:
        print("ferry topics: no management token (give --token-file, or set "
              "http.management_token in the config; the package keeps it in "
              f"{auth.DEFAULT_TOKEN_FILE}, readable by root and the ferry-admin group)",
              file=sys.stderr)
        return 1
    request = urllib.request.Request(url + path, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            doc = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc).get("message", exc.reason)
        except ValueError:
            message = exc.reason
        print(f"ferry topics {command}: {exc.code} {message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"ferry topics {command}: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2, ensure_ascii=False))
    return 0


# -- replay --------------------------------------------------------------------------------
def _replay(args: argparse.Namespace) -> int:
    from agent.cli.replay import replay

    return replay(_config(args), args.file)


def _config(args: argparse.Namespace) -> FerryConfig:
    return load_config(getattr(args, "config", None))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
