"""Ferry's configuration: one typed model, read from TOML and overridden by FERRY_* variables.

Precedence (highest first): keyword arguments, ``FERRY_*`` environment variables (nested with
``__``, e.g. ``FERRY_BUFFER__MAX_BYTES``), the TOML file, the defaults below.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import types
import typing
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from ferry_client.topic_names import illegal_topic, is_legal_topic

DEFAULT_CONFIG_PATH = Path("/etc/ferry/ferry.toml")

# The TOML file load_config() is reading; a context variable rather than a class attribute so
# that concurrent loads (tests) cannot see each other's file.
_toml_file: ContextVar[Path | None] = ContextVar("_toml_file", default=None)
# Sections whose FERRY_* value did not parse during the current load, collected rather than
# raised so that one run reports them together with every other problem.
_unreadable_env: ContextVar[list[str] | None] = ContextVar("_unreadable_env", default=None)

log = logging.getLogger(__name__)

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BufferConfig(_Section):
    path: Path = Path("/var/lib/ferry/buffer")
    max_bytes: int = Field(default=10 * 1024**3, ge=1024 * 1024)
    # Longest a message waits for the group commit it rides in; the batch is cut earlier when
    # the writer is idle, so this only matters under load.
    commit_interval_ms: float = Field(default=0.0, ge=0, le=1000)
    commit_max_messages: int = Field(default=20000, ge=1)
    discard_log: Path | None = None  # default: <buffer.path>/discards.jsonl
    # The nice value of the ingest writer thread (0 leaves it alone). Under full load on a
    # small machine its commits otherwise wait for a CPU behind less urgent threads; see
    # docs/buffer.md. Needs RLIMIT_NICE (the packaged unit's LimitNICE=-5) or CAP_SYS_NICE.
    writer_nice: int = Field(default=-5, ge=-20, le=19)
    # Disk space kept allocated beyond what the buffer's file uses, never given to new
    # messages: what deletes need when the filesystem is full (docs/buffer.md, "Disk space").
    reserve_bytes: int = Field(default=32 * 1024**2, ge=1024**2)
    # Allocate the whole buffer (max_bytes and LMDB's headroom) at start, not as it grows.
    preallocate: bool = False
    # The discard log stops growing here: further discards wait in the buffer (0: no limit).
    discard_log_max_bytes: int = Field(default=1024**3, ge=0)


class SocketConfig(_Section):
    path: Path | None = Path("/run/ferry/ferry.sock")  # None (or "") disables the socket
    mode: str = "0660"
    receive_buffer_bytes: int = Field(default=8 * 1024 * 1024, ge=65536)

    @field_validator("mode")
    @classmethod
    def _octal(cls, value: str) -> str:
        if not re.fullmatch(r"0?[0-7]{3,4}", value):
            raise ValueError("must be an octal file mode such as '0660'")
        return value

    @field_validator("path", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value


class HttpConfig(_Section):
    listen: str = "127.0.0.1:9090"  # "" disables HTTP
    # Topic management's mutating calls (POST/PUT/DELETE /topics...) need
    # "Authorization: Bearer <token>". The token: management_token, else the first line of
    # management_token_file, else the systemd credential "management-token" (the packaged
    # unit loads /etc/ferry/management.token, created at install). None of them: mutating
    # calls are refused (closed by default). Reading (GET /topics) needs no token.
    management_token: str | None = None
    management_token_file: Path | None = None
    auto_create_topics: bool = True
    idempotency_window_seconds: int = Field(default=600, ge=0)
    header_allowlist: list[str] = Field(default_factory=list)
    body_timeout_seconds: float = Field(default=10.0, gt=0)
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    keep_alive_seconds: float = Field(default=5.0, gt=0)
    # Answers left unread above the transport's high-water mark this long drop the connection
    # (a client that pipelines and never reads would otherwise hold it for ever).
    write_timeout_seconds: float = Field(default=10.0, gt=0)
    # Largest body POST /topics/{topic}/batch takes (413 above); each message of it is still
    # limited by its topic's max_message_bytes.
    max_batch_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # Most messages POST /topics/{topic}/batch takes (413 above): a byte limit alone let a
    # 4 MiB JSON array of 2.1 million messages cost 756 MiB and 20 s of CPU (issue #37 N6).
    max_batch_messages: int = Field(default=10_000, ge=1)
    # Bytes of request bodies held at once by all HTTP connections together (read so far,
    # queued, decoded, being answered): past it a body is answered 503 body_budget and its
    # connection closed, so many clients cannot together take the agent's memory (#37 N5).
    # At least twice max_batch_bytes: one gzip batch, compressed and decoded, always fits.
    max_body_bytes_in_flight: int = Field(default=128 * 1024 * 1024, ge=1024 * 1024)
    # Limits of the HTTP exchange itself (agent/ingest/http/protocol.py, docs/http.md).
    # A request line longer than max_request_line_bytes is answered 414; headers over
    # max_header_bytes in all, or more than max_headers of them, 431. Both are closed.
    max_request_line_bytes: int = Field(default=8 * 1024, ge=256)
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    max_headers: int = Field(default=100, ge=8)
    # Open connections at most; 0: as many as the descriptor limit allows (RLIMIT_NOFILE,
    # less a reserve for the buffer, the datagram socket and the spool intake). Either way
    # the cap never exceeds what the limit allows. At the cap, the connection idle longest
    # is closed to make room; with none idle, the new one is answered 503.
    max_connections: int = Field(default=0, ge=0)
    # Topics whose name starts with "__" (Kafka's own, e.g. __consumer_offsets) are refused
    # unless listed here or defined in [topics].
    internal_topics: list[str] = Field(default_factory=list)
    # HTTPS: a second listener on tls_listen ("" for none), speaking TLS 1.2 or later, with
    # the same routes, limits and connection cap as the plain one (which stays: keep it on
    # loopback for the local tools). tls_cert_file: the server's certificate chain (PEM);
    # tls_key_file: its private key (PEM, unencrypted). tls_client_ca_file (PEM): clients
    # must present a certificate one of these CAs signed (mTLS); without it, none is asked.
    tls_listen: str = ""
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None

    @field_validator("listen", "tls_listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value == "":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:9090")
        return value

    @model_validator(mode="after")
    def _budget_holds_a_batch(self) -> HttpConfig:
        if self.max_body_bytes_in_flight < 2 * self.max_batch_bytes:
            raise ValueError("max_body_bytes_in_flight must be at least twice max_batch_bytes "
                             f"({2 * self.max_batch_bytes}): a gzip batch is held compressed "
                             "and decoded while it is decoded")
        return self

    @model_validator(mode="after")
    def _tls_complete(self) -> HttpConfig:
        files = {"tls_cert_file": self.tls_cert_file, "tls_key_file": self.tls_key_file,
                 "tls_client_ca_file": self.tls_client_ca_file}
        if self.tls_listen:
            missing = [k for k in ("tls_cert_file", "tls_key_file") if files[k] is None]
            if missing:
                raise ValueError(f"tls_listen needs {' and '.join(missing)}")
            if not self.listen:
                raise ValueError("tls_listen needs listen too (the plain listener, for the "
                                 "local tools; keep it on loopback)")
        else:
            given = [k for k, v in files.items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} set, but tls_listen is empty: set "
                                 "tls_listen to HOST:PORT to serve HTTPS")
        return self

    @property
    def host(self) -> str:
        return _address(self.listen)[0]

    @property
    def port(self) -> int:
        return _address(self.listen)[1]

    @property
    def tls_host(self) -> str:
        return _address(self.tls_listen)[0]

    @property
    def tls_port(self) -> int:
        return _address(self.tls_listen)[1]


def _address(listen: str) -> tuple[str, int]:
    """The host (without an IPv6 address's brackets) and port of a checked HOST:PORT."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class SpoolConfig(_Section):
    dirs: list[Path] = Field(default_factory=lambda: [Path("/var/lib/ferry/spool")])
    after_ingest: Literal["delete", "move"] = "delete"  # "move" keeps files in <dir>/done/
    scan_interval_seconds: float = Field(default=5.0, gt=0)
    # How long the content of a binary file ingested under a name is remembered, so a file
    # re-published under that name (a retried Spark task, a re-run with the same jobId) is
    # not ingested twice. 0 remembers nothing: every file is ingested whole.
    dedup_retention_seconds: float = Field(default=7 * 24 * 3600, ge=0)
    # Temporary files (*.tmp, being written) not modified for this long are a dead writer's
    # and deleted; staged Spark files (.*.staged, waiting for their job's commit) after
    # staged_retention_seconds, which must outlast the longest job.
    stale_temp_seconds: float = Field(default=3600, gt=0)
    staged_retention_seconds: float = Field(default=2 * 24 * 3600, gt=0)


class KafkaClusterConfig(_Section):
    bootstrap_servers: str = "localhost:9092"
    # Any librdkafka property (TLS, SASL, ...); applied after Ferry's own defaults.
    properties: dict[str, str | int | float | bool] = Field(default_factory=dict)
    # The cluster is down once metadata probes have failed for this long, or once messages
    # sent to it have been outstanding this long with nothing acknowledged (docs/design.md,
    # "Cluster state"). Idleness never counts.
    outage_after_seconds: float = Field(default=10.0, gt=0)
    # How often the forwarder asks the cluster for its metadata, with or without traffic.
    probe_interval_seconds: float = Field(default=2.0, gt=0, le=300, allow_inf_nan=False)
    # A connection to the cluster that carried nothing for this long is closed (librdkafka's
    # connections.max.idle.ms on every client); the next request opens it again. 0: never.
    # An idle agent keeps only the probe's connection (docs/design.md, "Connections").
    idle_connection_seconds: float = Field(default=30.0, ge=0, le=86_400,
                                           allow_inf_nan=False)


class KafkaConfig(_Section):
    local: KafkaClusterConfig = Field(default_factory=KafkaClusterConfig)
    remote: KafkaClusterConfig | None = None


# Longest an HTTP publish may wait for Kafka's acknowledgement (201) before answering 202:
# a bound of TopicConfig, so the config file and the management API refuse the same values.
MAX_ACK_TIMEOUT_MS = 60_000


class TopicConfig(_Section):
    acks: Literal["all", "leader"] = "leader"
    ttl_seconds: int = Field(default=7 * 24 * 3600, ge=1)
    max_message_bytes: int = Field(default=1_000_000, ge=1)
    max_attempts: int = Field(default=0, ge=0)  # 0 = retry until the TTL
    content_type: Literal["binary", "json", "avro"] = "binary"
    schema_: str | None = Field(default=None, alias="schema")
    # messages/s over HTTP; 0 = unlimited. Finite: JSON has no infinity to store it as.
    rate_limit: float = Field(default=0, ge=0, allow_inf_nan=False)
    ack_timeout_ms: int = Field(default=65, ge=0, le=MAX_ACK_TIMEOUT_MS)
    fallback_to_remote: bool = False
    speculative_send_delay_ms: int = Field(default=250, ge=0)
    # "exactly_once": Kafka transactions with a progress record and a read-back of the
    # uncertain tail (docs/design.md, "Exactly-once delivery"); needs acks "all".
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_once_rules(self) -> TopicConfig:
        if self.delivery != "exactly_once":
            return self
        if self.acks != "all":
            # Not implied: the default is "leader", and a topic's settings should read as
            # what they do. Transactions need idempotent acks=all producers.
            raise ValueError('delivery = "exactly_once" needs acks = "all" (transactions '
                             'write with acks=all): set acks = "all" for this topic')
        if self.fallback_to_remote:
            raise ValueError('delivery = "exactly_once" cannot be combined with '
                             'fallback_to_remote: a second send to another cluster would '
                             'deliver the message twice')
        return self


class ForwarderConfig(_Section):
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "lz4"
    # Bounds are librdkafka's for the properties these become (linger.ms, retry.backoff.ms,
    # retry.backoff.max.ms): out of range, every producer the forwarder made would fail.
    linger_ms: float = Field(default=5.0, ge=0, le=900_000, allow_inf_nan=False)
    retry_backoff_ms: int = Field(default=100, ge=1, le=300_000)
    retry_backoff_max_ms: int = Field(default=5000, ge=1, le=300_000)
    max_in_flight_messages: int = Field(default=200_000, ge=1)
    # A message Kafka has not acknowledged in this time is reported failed and sent again.
    # Until then librdkafka keeps it queued in order: per-key order within a cluster holds
    # across any outage shorter than this.
    message_timeout_ms: int = Field(default=300_000, ge=1000)
    # The forwarder process, restarted when it dies (agent/daemon/supervision.py): after a crash,
    # wait restart_backoff_seconds, doubling per crash up to restart_backoff_max_seconds; a
    # run of restart_healthy_seconds resets that. restart_max_crashes crashes in a row with
    # no healthy run between them stop the agent with exit code 1 (0: never give up).
    restart_backoff_seconds: float = Field(default=0.5, gt=0, le=3600, allow_inf_nan=False)
    restart_backoff_max_seconds: float = Field(default=30.0, gt=0, le=3600, allow_inf_nan=False)
    restart_healthy_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    restart_max_crashes: int = Field(default=10, ge=0)
    # The forwarder connects to Kafka after a random delay of up to this long when it starts
    # (or restarts): agents of a fleet restarted together (a package upgrade, a configuration
    # push) then reach the cluster spread over this window, not in the same second, and their
    # probes do not stay in step. Messages are taken and stored meanwhile. 0: at once.
    start_jitter_seconds: float = Field(default=0.0, ge=0, le=600, allow_inf_nan=False)
    # Exactly-once topics (delivery = "exactly_once"): this agent's identity, which names its
    # transactional.id and its progress records. Empty: /etc/machine-id, else the host name.
    # Two running agents must never share one (docs/design.md, "Agent identity").
    agent_id: str = Field(default="", pattern=r"^[A-Za-z0-9._-]{0,200}$")
    # A transaction collects messages for at most this long before it commits: longer means
    # fewer commits (throughput), shorter means read_committed consumers see messages sooner.
    transaction_interval_ms: int = Field(default=100, ge=1, le=60_000)
    transaction_max_messages: int = Field(default=20_000, ge=1)
    # A transaction not acknowledged and committed within this is given up and sent again;
    # transactions are sized to take a quarter of it (agent/forwarder/transaction_size.py).
    # At most 60 s: the transactional producer's transaction.timeout.ms, past which Kafka
    # aborts an open transaction itself (and librdkafka wants message.timeout.ms below it).
    transaction_commit_timeout_ms: int = Field(default=30_000, ge=1000, le=60_000)
    # Internal compacted topic holding each agent's progress per exactly-once topic.
    progress_topic: str = "_ferry_progress"


class StatusConfig(_Section):
    track_messages: bool = True
    track_seconds: int = Field(default=3600, ge=0)


class FerryConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FERRY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    buffer: BufferConfig = Field(default_factory=BufferConfig)
    socket: SocketConfig = Field(default_factory=SocketConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    spool: SpoolConfig = Field(default_factory=SpoolConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    forwarder: ForwarderConfig = Field(default_factory=ForwarderConfig)
    status: StatusConfig = Field(default_factory=StatusConfig)
    topics: dict[str, TopicConfig] = Field(default_factory=lambda: {"default": TopicConfig()})
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("topics")
    @classmethod
    def _topic_names(cls, value: dict[str, TopicConfig]) -> dict[str, TopicConfig]:
        for name in value:
            if name != "default" and not is_legal_topic(name):
                raise ValueError(illegal_topic(name))
        value.setdefault("default", TopicConfig())
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_path = _toml_file.get()
        # env_settings, except that unreadable values are collected (_EnvSource).
        sources: list[PydanticBaseSettingsSource] = [init_settings, _EnvSource(settings_cls)]
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)

    def topic(self, name: str) -> TopicConfig:
        """The settings that apply to ``name``: its own section, else ``[topics.default]``."""
        return self.topics.get(name) or self.topics["default"]

    @property
    def discard_log_path(self) -> Path:
        return self.buffer.discard_log or self.buffer.path / "discards.jsonl"


class _EnvSource(EnvSettingsSource):
    """FERRY_* variables, as pydantic-settings reads them, except that a section whose value
    does not parse is noted (and left out) instead of ending the load: the other problems of
    the configuration are then reported in the same run."""

    def prepare_field_value(self, field_name: str, field: FieldInfo, value: Any,
                            value_is_complex: bool) -> Any:
        try:
            return super().prepare_field_value(field_name, field, value, value_is_complex)
        except ValueError:
            unreadable = _unreadable_env.get()
            if unreadable is None:
                raise
            unreadable.append(field_name)
            return None


class ConfigError(Exception):
    """The configuration cannot be used; the message names the field and the reason.

    ``problems`` holds one line per problem found, all of them (not just the first)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = problems if problems is not None else [message]
        super().__init__(message)


def config_file(path: Path | None = None, *, system_default: bool = True) -> Path | None:
    """The TOML file load_config() reads for these arguments, or None (no file)."""
    if path is None and system_default and DEFAULT_CONFIG_PATH.exists():
        return DEFAULT_CONFIG_PATH
    return path


def load_config(path: Path | None = None, *, system_default: bool = True,
                warn_environment: bool = True, **overrides: Any) -> FerryConfig:
    """Read ``path`` (or /etc/ferry/ferry.toml when present and ``system_default``), then
    FERRY_* variables; ``overrides`` win over both.

    This is the one check of a configuration: ``ferry run`` and ``ferry validate`` both call
    it. A ConfigError lists every problem found; FERRY_* variables that name no setting are
    only warned about (``warn_environment``), as pydantic-settings ignores them."""
    path = config_file(path, system_default=system_default)
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    token = _toml_file.set(path)
    unreadable: list[str] = []
    env_token = _unreadable_env.set(unreadable)
    try:
        errors: list[Any] = []
        try:
            config = FerryConfig(**overrides)
        except ValidationError as exc:
            errors = list(exc.errors())
        problems = [_describe_unreadable(section) for section in unreadable]
        problems += [_describe_error(err, path, overrides, unreadable) for err in errors]
        if problems:
            where = f" ({path} and FERRY_* variables)" if path else " (FERRY_* variables)"
            raise ConfigError("\n".join([f"invalid configuration{where}:",
                                         *(f"  {line}" for line in problems)]), problems)
        if warn_environment:
            for line in environment_warnings():
                log.warning("%s", line)
        return config
    except SettingsError as exc:  # a failure _EnvSource does not collect
        raise ConfigError(f"invalid configuration: {exc}") from None
    except ValueError as exc:  # TOML syntax errors surface as ValueError subclasses
        raise ConfigError(f"{path}: {exc}") from None
    finally:
        _unreadable_env.reset(env_token)
        _toml_file.reset(token)


def environment_warnings() -> list[str]:
    """One line per FERRY_* variable that looks meant for the configuration but names no
    section: such a variable is ignored, which a typo would make silent."""
    return [f"environment variable {name} is not a Ferry setting and is ignored"
            + (f" (did you mean {hint}?)" if hint else "")
            for name, hint in _suspect_environment()]


def _suspect_environment() -> list[tuple[str, str]]:
    """FERRY_* variables that look meant for the configuration but name no section or
    setting, with what they probably meant. pydantic-settings ignores them (a misspelt key
    *inside* a section is already an error), so a typo would silently leave the default.
    Other FERRY_* variables (the test and packaging tools have their own) are not flagged:
    only those written the nested way (``__``), or close to a setting's name."""
    fields = list(FerryConfig.model_fields)
    out: list[tuple[str, str]] = []
    for name in sorted(os.environ):
        if not name.upper().startswith("FERRY_"):
            continue
        parts = name[len("FERRY_"):].lower().split("__")
        if parts[0] in FerryConfig.model_fields:
            continue
        close = difflib.get_close_matches(parts[0], fields, n=1, cutoff=0.8)
        if close or len(parts) > 1:
            rest = "__" + "__".join(parts[1:]).upper() if len(parts) > 1 else ""
            out.append((name, f"FERRY_{close[0].upper()}{rest}" if close else ""))
    return out


def _env_names(prefix: str) -> list[str]:
    """The environment variables named ``prefix`` or nested under it (case-insensitive, as
    pydantic-settings reads them)."""
    prefix = prefix.upper()
    return sorted(n for n in os.environ
                  if n.upper() == prefix or n.upper().startswith(prefix + "__"))


def _describe_unreadable(section: str) -> str:
    """pydantic-settings names only the section ("spool") when a FERRY_* value does not
    parse: name the variables, and say how lists and tables are written."""
    prefix = f"FERRY_{section}".upper()
    names = _env_names(prefix)
    return (f"{section}: the environment variable{'s' if len(names) != 1 else ''} "
            f"{', '.join(names) or prefix + '*'} could not be read: lists and tables are "
            "written as JSON, e.g. FERRY_SPOOL__DIRS='[\"/var/lib/ferry/spool\"]'")


def _env_variable(loc: tuple[str, ...]) -> str | None:
    """The FERRY_* variable that set the value at ``loc`` (or the table holding it), if one
    did: variables win over the file, so an error there is the variable's."""
    upper = {n.upper(): n for n in os.environ}
    for end in range(len(loc), 0, -1):
        name = upper.get("FERRY_" + "__".join(loc[:end]).upper())
        if name is not None:
            return name
    return None


def _in_overrides(loc: tuple[str, ...], overrides: dict[str, Any]) -> bool:
    node: Any = overrides
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model that holds the keys at ``loc`` (``("topics", "clicks")`` ->
    TopicConfig), or None where the keys are free (a dict of values)."""
    model: type[BaseModel] = FerryConfig
    annotation: Any = None
    for part in loc:
        if annotation is not None:  # inside a dict of sections: ``part`` is its key
            model, annotation = annotation, None
            continue
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return None
        inner = _section_type(field.annotation)
        if inner is None:
            return None
        if typing.get_origin(inner) is dict:
            annotation = _section_type(typing.get_args(inner)[1])
            if annotation is None:
                return None
        else:
            model = inner
    return None if annotation is not None else model


def _section_type(annotation: Any) -> Any:
    """``annotation`` without ``| None``, when it is a section model or a dict of them."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is dict:
        return annotation
    return None


def _suggestion(loc: tuple[str, ...]) -> str | None:
    """The known key at ``loc``'s level closest to its misspelt last part, if one is close."""
    model = _model_at(loc[:-1])
    if model is None:
        return None
    names = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1].lower(), names, n=1, cutoff=0.6)
    return close[0] if close else None


def _describe_error(err: Any, path: Path | None, overrides: dict[str, Any],
                    unreadable: list[str]) -> str:
    """One line for one pydantic error: the key path, where the value came from when it was
    a FERRY_* variable, what is wrong, and for an unknown key the known one it may mean."""
    loc = tuple(str(part) for part in err["loc"])
    field = ".".join(loc) or "(top level)"
    # A section whose variables could not be read was left out: its values are the file's.
    from_env = loc and loc[0] not in unreadable and not _in_overrides(loc, overrides)
    variable = _env_variable(loc) if from_env else None
    if err["type"] != "extra_forbidden" or not loc:
        source = f" (environment variable {variable})" if variable else ""
        return f"{field}{source}: {err['msg']}"
    hint = _suggestion(loc)
    if variable:
        meant = "FERRY_" + "__".join((*loc[:-1], hint)).upper() if hint else None
        return (f"{field} (environment variable {variable}): unknown setting"
                + (f", did you mean {meant}?" if meant else ""))
    where = f" in {path}" if path else ""
    return (f"{field}: unknown setting{where}"
            + (f", did you mean '{hint}'?" if hint else ""))
