"""Configuration: defaults, a full TOML file, FERRY_* overrides, clear errors naming the field."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import config as config_module
from agent.config import BufferConfig, ConfigError, FerryConfig, load_config
from ferry_client.topic_names import is_legal_topic

REPO_ROOT = Path(__file__).resolve().parent.parent

FULL_EXAMPLE = """
log_level = "debug"

[buffer]
path = "/srv/ferry/buffer"
max_bytes = 2147483648
commit_interval_ms = 0.5
commit_max_messages = 5000
discard_log = "/srv/ferry/discards.jsonl"

[socket]
path = "/srv/ferry/ferry.sock"
mode = "0620"
receive_buffer_bytes = 1048576

[http]
listen = "[::1]:8080"
management_token = "s3cret"
auto_create_topics = false
idempotency_window_seconds = 60
header_allowlist = ["Trace-Id", "Tenant"]
body_timeout_seconds = 2.5

[spool]
dirs = ["/srv/spool/a", "/srv/spool/b"]
after_ingest = "move"
scan_interval_seconds = 0.25

[kafka.local]
bootstrap_servers = "127.0.0.1:9092,127.0.0.1:9093"
outage_after_seconds = 3.0

[kafka.local.properties]
"security.protocol" = "SSL"
"socket.timeout.ms" = 5000
"enable.ssl.certificate.verification" = false

[kafka.remote]
bootstrap_servers = "10.0.0.1:9092"

[forwarder]
compression = "zstd"
linger_ms = 1.0
retry_backoff_ms = 50
retry_backoff_max_ms = 2000
max_in_flight_messages = 1000

[status]
track_messages = false
track_seconds = 120

[topics.default]
ttl_seconds = 3600

[topics."orders.v1"]
acks = "all"
ttl_seconds = 86400
max_message_bytes = 2000000
max_attempts = 10
content_type = "json"
schema = '{"type": "object"}'
rate_limit = 100.5
ack_timeout_ms = 10
fallback_to_remote = true
speculative_send_delay_ms = 0
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No FERRY_* variable of the developer's shell, and no /etc/ferry/ferry.toml, leaks in."""
    for name in list(os.environ):
        if name.startswith("FERRY_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "ferry.toml")
    yield


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ferry.toml"
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    return str(err.value)


# -- defaults ----------------------------------------------------------------------------------
def test_defaults_without_a_file() -> None:
    cfg = load_config()
    assert cfg.buffer.path == Path("/var/lib/ferry/buffer")
    assert cfg.buffer.max_bytes == 10 * 1024**3
    assert cfg.discard_log_path == Path("/var/lib/ferry/buffer/discards.jsonl")
    assert cfg.socket.path == Path("/run/ferry/ferry.sock")
    assert cfg.socket.mode == "0660"
    assert cfg.http.listen == "127.0.0.1:9090"
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 9090)
    assert cfg.spool.dirs == [Path("/var/lib/ferry/spool")]
    assert cfg.kafka.local.bootstrap_servers == "localhost:9092"
    assert cfg.kafka.remote is None
    assert cfg.forwarder.compression == "lz4"
    assert cfg.status.track_messages is True
    assert list(cfg.topics) == ["default"]
    assert cfg.topic("anything").acks == "leader"
    assert cfg.log_level == "info"


def test_an_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == load_config()


def test_the_packaged_example_file_loads_and_holds_the_defaults() -> None:
    # packaging/ferry.toml says "the values below are the defaults".
    assert load_config(REPO_ROOT / "packaging" / "ferry.toml") == load_config()


def test_the_default_path_is_read_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH",
                        write(tmp_path, '[http]\nlisten = "127.0.0.1:1"\n'))
    assert load_config().http.port == 1


# -- a full file -------------------------------------------------------------------------------
def test_every_section_of_a_full_file_is_read(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_EXAMPLE))
    assert cfg.log_level == "debug"
    assert cfg.buffer.path == Path("/srv/ferry/buffer")
    assert cfg.buffer.max_bytes == 2 * 1024**3
    assert cfg.buffer.commit_interval_ms == 0.5
    assert cfg.buffer.commit_max_messages == 5000
    assert cfg.discard_log_path == Path("/srv/ferry/discards.jsonl")
    assert cfg.socket.path == Path("/srv/ferry/ferry.sock")
    assert cfg.socket.mode == "0620"
    assert cfg.socket.receive_buffer_bytes == 1048576
    assert (cfg.http.host, cfg.http.port) == ("::1", 8080)
    assert cfg.http.management_token == "s3cret"
    assert cfg.http.auto_create_topics is False
    assert cfg.http.idempotency_window_seconds == 60
    assert cfg.http.header_allowlist == ["Trace-Id", "Tenant"]
    assert cfg.http.body_timeout_seconds == 2.5
    assert cfg.spool.dirs == [Path("/srv/spool/a"), Path("/srv/spool/b")]
    assert cfg.spool.after_ingest == "move"
    assert cfg.spool.scan_interval_seconds == 0.25
    assert cfg.kafka.local.bootstrap_servers == "127.0.0.1:9092,127.0.0.1:9093"
    assert cfg.kafka.local.outage_after_seconds == 3.0
    assert cfg.kafka.local.properties == {
        "security.protocol": "SSL",
        "socket.timeout.ms": 5000,
        "enable.ssl.certificate.verification": False,
    }
    assert cfg.kafka.remote is not None
    assert cfg.kafka.remote.bootstrap_servers == "10.0.0.1:9092"
    assert cfg.kafka.remote.outage_after_seconds == 10.0  # default inside a given section
    assert cfg.forwarder.compression == "zstd"
    assert cfg.forwarder.linger_ms == 1.0
    assert cfg.forwarder.retry_backoff_ms == 50
    assert cfg.forwarder.retry_backoff_max_ms == 2000
    assert cfg.forwarder.max_in_flight_messages == 1000
    assert cfg.status.track_messages is False
    assert cfg.status.track_seconds == 120
    orders = cfg.topic("orders.v1")
    assert orders.acks == "all"
    assert orders.ttl_seconds == 86400
    assert orders.max_message_bytes == 2_000_000
    assert orders.max_attempts == 10
    assert orders.content_type == "json"
    assert orders.schema_ == '{"type": "object"}'
    assert orders.rate_limit == 100.5
    assert orders.ack_timeout_ms == 10
    assert orders.fallback_to_remote is True
    assert orders.speculative_send_delay_ms == 0
    # Other topics get [topics.default], which kept its own defaults beside the one it set.
    assert cfg.topic("other").ttl_seconds == 3600
    assert cfg.topic("other").acks == "leader"


def test_a_file_without_a_default_topic_still_has_one(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[topics.clicks]\nacks = "all"\n'))
    assert set(cfg.topics) == {"clicks", "default"}
    assert cfg.topic("unknown") == cfg.topics["default"]


def test_an_empty_socket_path_disables_the_socket(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, '[socket]\npath = ""\n')).socket.path is None


# -- precedence --------------------------------------------------------------------------------
def test_environment_beats_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[buffer]\nmax_bytes = 2000000\npath = "/from/file"\n')
    monkeypatch.setenv("FERRY_BUFFER__MAX_BYTES", "3000000")
    cfg = load_config(path)
    assert cfg.buffer.max_bytes == 3_000_000
    assert cfg.buffer.path == Path("/from/file")  # the rest of the section still comes from file


def test_environment_reaches_deeply_nested_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FERRY_KAFKA__LOCAL__BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    monkeypatch.setenv("FERRY_LOG_LEVEL", "warning")
    cfg = load_config(write(tmp_path, FULL_EXAMPLE))
    assert cfg.kafka.local.bootstrap_servers == "127.0.0.1:19092"
    assert cfg.kafka.local.properties["security.protocol"] == "SSL"  # kept from the file
    assert cfg.log_level == "warning"


def test_keyword_overrides_beat_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FERRY_BUFFER__MAX_BYTES", "3000000")
    cfg = load_config(write(tmp_path, FULL_EXAMPLE), buffer={"max_bytes": 4_000_000})
    assert cfg.buffer.max_bytes == 4_000_000


def test_an_invalid_environment_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_BUFFER__MAX_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"buffer\.max_bytes"):
        load_config()


def test_a_load_does_not_leak_its_file_into_later_configs(tmp_path: Path) -> None:
    # The file being read is a context variable, reset when load_config returns.
    a = tmp_path / "a.toml"
    a.write_text("[http]\nlisten = \"127.0.0.1:1\"\n")
    assert load_config(a).http.port == 1
    assert FerryConfig().http.port == 9090  # no file: defaults, not a.toml


# -- errors ------------------------------------------------------------------------------------
def test_negative_max_bytes_names_the_field(tmp_path: Path) -> None:
    message = config_error(tmp_path, "[buffer]\nmax_bytes = -1\n")
    assert "buffer.max_bytes" in message
    assert "greater than or equal" in message
    assert str(tmp_path / "ferry.toml") in message


@pytest.mark.parametrize("mode", ["999", "0999", "rw-rw----", "66", "000660"])
def test_a_bad_socket_mode_names_the_field(tmp_path: Path, mode: str) -> None:
    message = config_error(tmp_path, f'[socket]\nmode = "{mode}"\n')
    assert "socket.mode" in message
    assert "octal" in message


@pytest.mark.parametrize("mode", ["0660", "660", "0600", "1777", "01777"])
def test_good_socket_modes_are_accepted(tmp_path: Path, mode: str) -> None:
    assert load_config(write(tmp_path, f'[socket]\nmode = "{mode}"\n')).socket.mode == mode


@pytest.mark.parametrize("listen", ["127.0.0.1", "127.0.0.1:", ":9090", "host:port", "h:70000"])
def test_listen_without_a_port_names_the_field(tmp_path: Path, listen: str) -> None:
    message = config_error(tmp_path, f'[http]\nlisten = "{listen}"\n')
    assert "http.listen" in message
    assert "HOST:PORT" in message


def test_an_empty_listen_disables_http(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, '[http]\nlisten = ""\n')).http.listen == ""


@pytest.mark.parametrize("name", ["bad topic", "ab\\n", "..", "x" * 250, "ü"])
def test_an_illegal_topic_name_names_the_field_and_the_topic(tmp_path: Path, name: str) -> None:
    message = config_error(tmp_path, f'[topics."{name}"]\nacks = "all"\n')
    assert "topics" in message
    assert "not a legal Kafka topic name" in message


def test_topic_name_rule_is_kafkas() -> None:
    assert is_legal_topic("a.b_c-D9")
    assert is_legal_topic("x" * 249)
    assert is_legal_topic("...")
    for bad in ("", ".", "..", "x" * 250, "a b", "a/b", "ab\n", "a\x00b"):
        assert not is_legal_topic(bad), bad


@pytest.mark.parametrize(
    ("text", "field", "meant"),
    [
        ("[buffer]\nmax_byte = 5\n", "buffer.max_byte", "max_bytes"),
        ("bogus = 1\n", "bogus", None),
        ("bufer = 1\n", "bufer", "buffer"),
        ("[kafka.local]\nbootstrap = \"x\"\n", "kafka.local.bootstrap", "bootstrap_servers"),
        ("[kafka.remote]\nbootstrap_server = \"x\"\n", "kafka.remote.bootstrap_server",
         "bootstrap_servers"),
        ("[topics.t]\nackz = \"all\"\n", "topics.t.ackz", "acks"),
        ("[topics.t]\nschemas = \"x\"\n", "topics.t.schemas", "schema"),  # the alias
        ("[nosuchsection]\n", "nosuchsection", None),
    ],
)
def test_an_unknown_field_is_named_with_the_key_it_may_mean(
    tmp_path: Path, text: str, field: str, meant: str | None
) -> None:
    message = config_error(tmp_path, text)
    assert f"{field}: unknown setting in {tmp_path / 'ferry.toml'}" in message
    if meant:
        assert f"did you mean '{meant}'?" in message
    else:
        assert "did you mean" not in message


def test_every_kind_of_problem_is_listed_in_one_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # An unreadable variable used to end the load before the file's problems were seen.
    monkeypatch.setenv("FERRY_SPOOL__DIRS", "/a")
    monkeypatch.setenv("FERRY_HTTP__LISTEN", "nonsense")
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, 'logg_level = "debug"\n[buffer]\nmax_bytes = "big"\n'
                          '[spool]\ndirs = "/x"\n'))
    problems = raised.value.problems
    assert len(problems) == 5, problems
    assert problems[0].startswith("spool: the environment variable FERRY_SPOOL__DIRS")
    assert any(line.startswith("buffer.max_bytes: Input should be a valid integer")
               for line in problems)
    assert ("http.listen (environment variable FERRY_HTTP__LISTEN): Value error, must be "
            "HOST:PORT, e.g. 127.0.0.1:9090") in problems
    # The unreadable variable was left out: this one is the file's value, not the variable's.
    assert "spool.dirs: Input should be a valid list" in problems
    assert (f"logg_level: unknown setting in {tmp_path / 'ferry.toml'}, did you mean "
            "'log_level'?") in problems
    assert all(line in str(raised.value) for line in problems)


def test_an_out_of_range_environment_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FERRY_TOPICS__CLICKS__MAX_ATTEMPTS", "-1")
    message = config_error(tmp_path, "[topics.clicks]\nmax_attempts = 3\n")
    assert ("topics.clicks.max_attempts (environment variable "
            "FERRY_TOPICS__CLICKS__MAX_ATTEMPTS):") in message


def test_a_misspelt_key_in_an_environment_variable_suggests_the_variable(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FERRY_HTTP__LISTN", "127.0.0.1:1")
    with pytest.raises(ConfigError) as raised:
        load_config()
    assert raised.value.problems == [
        "http.listn (environment variable FERRY_HTTP__LISTN): unknown setting, did you mean "
        "FERRY_HTTP__LISTEN?"]


def test_a_value_given_as_an_override_is_not_blamed_on_a_variable(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FERRY_HTTP__LISTEN", "127.0.0.1:1")
    with pytest.raises(ConfigError) as raised:
        load_config(http={"listen": "nonsense"})
    assert raised.value.problems[0].startswith("http.listen: ")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[topics.t]\nacks = "some"\n', "topics.t.acks"),
        ('[forwarder]\ncompression = "brotli"\n', "forwarder.compression"),
        ('[spool]\nafter_ingest = "keep"\n', "spool.after_ingest"),
        ("[buffer]\ncommit_interval_ms = 5000\n", "buffer.commit_interval_ms"),
        ("[http]\nkeep_alive_seconds = 0\n", "http.keep_alive_seconds"),
        ('log_level = "loud"\n', "log_level"),
    ],
)
def test_out_of_range_values_are_named(tmp_path: Path, text: str, field: str) -> None:
    assert f"{field}:" in config_error(tmp_path, text)


def test_every_error_is_listed_not_only_the_first(tmp_path: Path) -> None:
    message = config_error(tmp_path, '[buffer]\nmax_bytes = -1\n[socket]\nmode = "9"\n')
    assert "buffer.max_bytes" in message and "socket.mode" in message


def test_a_toml_syntax_error_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    message = config_error(tmp_path, "[buffer\nmax_bytes = 5\n")
    assert str(tmp_path / "ferry.toml") in message
    assert "line 1" in message


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_config(missing)
    assert str(missing) in str(err.value)


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path)


@pytest.mark.parametrize(("setting", "value"), [
    ("linger_ms", "1e7"), ("linger_ms", "inf"), ("linger_ms", "nan"),
    ("retry_backoff_ms", "300001"), ("retry_backoff_max_ms", "300001"),
])
def test_forwarder_settings_librdkafka_would_refuse_stop_start_up(
    tmp_path: Path, setting: str, value: str
) -> None:
    # Accepted, they made every producer fail in the forwarder process, a crash loop.
    message = config_error(tmp_path, f"[forwarder]\n{setting} = {value}\n")
    assert f"forwarder.{setting}" in message


@pytest.mark.parametrize(("name", "value"), [
    ("FERRY_SPOOL__DIRS", "/a"), ("FERRY_HTTP__HEADER_ALLOWLIST", "X-A"),
])
def test_an_unparsable_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        load_config()
    message = str(raised.value)
    assert name in message and "JSON" in message
    assert "None" not in message  # once: "None: error parsing value for field ..."


def test_a_misspelt_environment_variable_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # pydantic-settings ignores FERRY_* names that match no section: the setting silently
    # kept its default. Variables of Ferry's own tools (FERRY_TEST_CACHE, ...) are not typos.
    monkeypatch.setenv("FERRY_BUFER__MAX_BYTES", "5000000")
    monkeypatch.setenv("FERRY_LOGLEVEL", "debug")
    monkeypatch.setenv("FERRY_TEST_CACHE", "/tmp/x")
    with caplog.at_level("WARNING", logger="agent.config"):
        config = load_config()
    assert config.buffer.max_bytes == BufferConfig().max_bytes
    warned = sorted(r.getMessage() for r in caplog.records)
    assert len(warned) == 2, warned
    assert "FERRY_BUFER__MAX_BYTES" in warned[0] and "FERRY_BUFFER__MAX_BYTES" in warned[0]
    assert "FERRY_LOGLEVEL" in warned[1] and "FERRY_LOG_LEVEL" in warned[1]


def test_a_config_file_topic_over_the_ack_wait_cap_is_refused_not_clamped(
    tmp_path: Path,
) -> None:
    """The 60 s cap on ack_timeout_ms is a bound of TopicConfig: the config file gets the
    same answer as the management API (it used to be clamped silently at publish time)."""
    message = config_error(tmp_path, '[topics."orders"]\nack_timeout_ms = 60001\n')
    assert "topics.orders.ack_timeout_ms" in message
    assert "less than or equal to 60000" in message
    ok = write(tmp_path, '[topics."orders"]\nack_timeout_ms = 60000\n')
    assert load_config(ok).topic("orders").ack_timeout_ms == 60000
