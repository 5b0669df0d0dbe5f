"""Ferry's configuration: one typed model, read from TOML and overridden by FERRY_* variables.

Precedence (highest first): keyword arguments, ``FERRY_*`` environment variables (nested with
``__``, e.g. ``FERRY_BUFFER__MAX_BYTES``), the TOML file, the defaults below.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG_PATH = Path("/etc/ferry/ferry.toml")

# The TOML file load_config() is reading; a context variable rather than a class attribute so
# that concurrent loads (tests) cannot see each other's file.
_toml_file: ContextVar[Path | None] = ContextVar("_toml_file", default=None)

# Kafka's own rule for topic names (kafka.common.internals.Topic).
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def is_valid_topic(name: str) -> bool:
    return bool(_TOPIC_RE.fullmatch(name)) and name not in (".", "..")


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
    management_token: str | None = None
    auto_create_topics: bool = True
    idempotency_window_seconds: int = Field(default=600, ge=0)
    header_allowlist: list[str] = Field(default_factory=list)
    body_timeout_seconds: float = Field(default=10.0, gt=0)
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    keep_alive_seconds: float = Field(default=5.0, gt=0)
    # Largest body POST /topics/{topic}/batch takes (413 above); each message of it is still
    # limited by its topic's max_message_bytes.
    max_batch_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value == "":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:9090")
        return value

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


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
    # Nothing acknowledged for this long while messages are outstanding => the cluster is down.
    outage_after_seconds: float = Field(default=10.0, gt=0)


class KafkaConfig(_Section):
    local: KafkaClusterConfig = Field(default_factory=KafkaClusterConfig)
    remote: KafkaClusterConfig | None = None


class TopicConfig(_Section):
    acks: Literal["all", "leader"] = "leader"
    ttl_seconds: int = Field(default=7 * 24 * 3600, ge=1)
    max_message_bytes: int = Field(default=1_000_000, ge=1)
    max_attempts: int = Field(default=0, ge=0)  # 0 = retry until the TTL
    content_type: Literal["binary", "json", "avro"] = "binary"
    schema_: str | None = Field(default=None, alias="schema")
    # messages/s over HTTP; 0 = unlimited. Finite: JSON has no infinity to store it as.
    rate_limit: float = Field(default=0, ge=0, allow_inf_nan=False)
    ack_timeout_ms: int = Field(default=65, ge=0)
    fallback_to_remote: bool = False
    speculative_send_delay_ms: int = Field(default=250, ge=0)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


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
    # The forwarder process, restarted when it dies (agent/supervision.py): after a crash,
    # wait restart_backoff_seconds, doubling per crash up to restart_backoff_max_seconds; a
    # run of restart_healthy_seconds resets that. restart_max_crashes crashes in a row with
    # no healthy run between them stop the agent with exit code 1 (0: never give up).
    restart_backoff_seconds: float = Field(default=0.5, gt=0, le=3600, allow_inf_nan=False)
    restart_backoff_max_seconds: float = Field(default=30.0, gt=0, le=3600, allow_inf_nan=False)
    restart_healthy_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    restart_max_crashes: int = Field(default=10, ge=0)


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
            if name != "default" and not is_valid_topic(name):
                raise ValueError(f"{name!r} is not a legal Kafka topic name")
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
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)

    def topic(self, name: str) -> TopicConfig:
        """The settings that apply to ``name``: its own section, else ``[topics.default]``."""
        return self.topics.get(name) or self.topics["default"]

    @property
    def discard_log_path(self) -> Path:
        return self.buffer.discard_log or self.buffer.path / "discards.jsonl"


class ConfigError(Exception):
    """The configuration cannot be used; the message names the field and the reason."""


def load_config(path: Path | None = None, *, system_default: bool = True,
                **overrides: Any) -> FerryConfig:
    """Read ``path`` (or /etc/ferry/ferry.toml when present and ``system_default``), then
    FERRY_* variables; ``overrides`` win over both."""
    if path is None and system_default and DEFAULT_CONFIG_PATH.exists():
        path = DEFAULT_CONFIG_PATH
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    token = _toml_file.set(path)
    try:
        config = FerryConfig(**overrides)
        for name, hint in _suspect_environment():
            log.warning("environment variable %s is not a Ferry setting and is ignored%s",
                        name, f" (did you mean {hint}?)" if hint else "")
        return config
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    except SettingsError as exc:
        raise ConfigError(_describe_environment(exc)) from None
    except ValueError as exc:  # TOML syntax errors surface as ValueError subclasses
        raise ConfigError(f"{path}: {exc}") from None
    finally:
        _toml_file.reset(token)


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


def _describe_environment(exc: SettingsError) -> str:
    """pydantic-settings names only the section ("spool") when a FERRY_* value does not
    parse: name the variables, and say how lists and tables are written."""
    match = re.search(r'field "([^"]+)"', str(exc))
    section = match.group(1) if match else ""
    prefix = f"FERRY_{section}".upper()
    names = sorted(n for n in os.environ
                   if n.upper() == prefix or n.upper().startswith(prefix + "__"))
    return (f"invalid configuration: the environment variable{'s' if len(names) != 1 else ''}"
            f" {', '.join(names) or prefix + '*'} (section {section or '?'}) could not be "
            "read: lists and tables are written as JSON, e.g. "
            "FERRY_SPOOL__DIRS='[\"/var/lib/ferry/spool\"]'")


def _describe(exc: ValidationError, path: Path | None) -> str:
    where = f" ({path} and FERRY_* variables)" if path else " (FERRY_* variables)"
    lines = [f"invalid configuration{where}:"]
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "(top level)"
        lines.append(f"  {field}: {err['msg']}")
    return "\n".join(lines)
